"""A dense `bias` or boolean `mask` as the fused implementations take them.

`Dense` carries a call's bias (floating) and mask (boolean, True = attend), each
`[Bb, Nb, Tb, Sb]` where every axis is either the call's full size (B, N, T, S)
or 1: a broadcast axis stays 1 and is read with stride 0, never expanded in
memory. The mask is part of the mask rule (a masked pair is invisible: a row
whose every key is masked returns zeros, NaN of a masked key never reaches it);
the bias is added to the score after the soft-cap and ALiBi, before masking.

The kernels read both tile by tile. The bias gradient is the score gradient
dS = P (dP - delta) reduced over the bias's broadcast axes
(`derivatives.bias_gradient`), computed only when the bias is differentiated.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import reference


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dense:
  """A call's dense terms; either may be None (not both: no `Dense` then)."""

  bias: jax.Array | None = None
  mask: jax.Array | None = None


def validate(x, name: str, batch: tuple[int, ...], shape3: tuple[int, int, int]):
  """A call's `bias` or `mask` (`name`): broadcastable to [*batch, N, T, S], returned as
  [B or 1, N or 1, T or 1, S or 1] (the batch axes flattened like the inputs'; broadcast
  axes stay 1), or None; every bad one raises here, at trace time."""
  if x is None:
    return None
  try:
    x = jnp.asarray(x)
  except TypeError as e:
    raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e
  full = batch + shape3
  if x.ndim > len(full):
    raise ValueError(f"{name} must have rank <= {len(full)} (broadcastable to [*batch, N, T, S]), "
                     f"got {x.shape}")
  x = x.reshape((1,) * (len(full) - x.ndim) + x.shape)
  try:
    np.broadcast_shapes(x.shape, full)
  except ValueError:
    raise ValueError(f"{name} of shape {x.shape} does not broadcast to [*batch, N, T, S] = {full}")
  if name == "mask" and x.dtype != jnp.bool_:
    raise TypeError(f"mask must be boolean (True = attend), got dtype {x.dtype}; pass additive "
                    "masks as bias")
  if name == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"bias must be a floating-point array, got dtype {x.dtype}")
  lead = x.shape[:-3]
  if len(lead) > 1 and any(n != 1 for n in lead):
    x = jnp.broadcast_to(x, full[:-3] + x.shape[-3:])
  return x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:])


def make(bias, mask) -> Dense | None:
  """The `Dense` of a validated call's bias and mask (None when it has neither)."""
  return None if bias is None and mask is None else Dense(bias, mask)


_NO_BIAS = ((0, 0, 0, 0), jnp.float32)
_NO_MASK = ((0, 0, 0, 0), jnp.bool_)


def operands(dense: Dense | None) -> tuple[jax.Array, jax.Array]:
  """(bias, mask) as the native targets and the tangent primitive take them: empty
  [0, 0, 0, 0] arrays for the ones a call lacks (as for lengths)."""
  bias = None if dense is None else dense.bias
  mask = None if dense is None else dense.mask
  return (jnp.zeros(*_NO_BIAS) if bias is None else bias,
          jnp.zeros(*_NO_MASK) if mask is None else mask)


def from_operands(bias, mask) -> Dense | None:
  """`operands`' inverse."""
  return make(None if bias.size == 0 else bias, None if mask.size == 0 else mask)


def key_block(x, heads: int, kv_heads: int, j0, block: int):
  """Keys [j0, j0 + block) of a bias or mask [Bb, Nb, Tb, Sb], shaped to broadcast
  against [B, K, G, T, block] (query heads grouped over their K/V head); keys past
  the end read as 0 / hidden (the caller masks them anyway)."""
  Bb, Nb, Tb, Sb = x.shape
  x = x.reshape(Bb, kv_heads, heads // kv_heads, Tb, Sb) if Nb == heads else x[:, None]
  if Sb == 1:
    return x
  pad = (-Sb) % block + block
  x = jnp.pad(x, [(0, 0)] * 4 + [(0, pad)])
  return jax.lax.dynamic_slice_in_dim(x, j0, block, axis=4)


def gradient_over_keys(o, lse, do, dlse, shape: tuple[int, ...]):
  """The gradient of a bias of one key, `shape` [Bb, Nb, Tb, 1], in float32: a row's
  dS summed over its keys. The bias adds one constant to all of a row's scores, which
  moves its LSE by that constant and leaves its output as it is: the sum is dlse on
  rows that see a key, 0 on rows that see none. The kernels' way, A - delta Z with
  A = sum_j P dP, Z = sum_j P and delta = rowsum(dO O) - dlse, reaches dlse as the
  remainder of two large terms, most of it O's rounding in 16 bits. rowsum(dO O) * 0
  carries a NaN row (or an infinite cotangent) into the row's gradient, as the kernels
  would."""
  nan_carrier = 0.0 * jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32),
                                 o.astype(jnp.float32))
  rows = nan_carrier if dlse is None else dlse.astype(jnp.float32) + nan_carrier
  empty = lse.astype(jnp.float32) == reference.empty_lse(jnp.float32)
  return reduce_to(jnp.where(empty, 0.0, rows)[..., None], shape)


def reduce_to(ds, shape: tuple[int, ...]):
  """A score gradient [B, N, T, cols] summed over the axes `shape` broadcasts (size 1):
  the gradient of a bias of that shape (the last axis: its key block)."""
  axes = tuple(i for i, (n, m) in enumerate(zip(shape, ds.shape)) if n == 1 and m != 1)
  return jnp.sum(ds, axis=axes, keepdims=True) if axes else ds
