"""Host-side helpers shared by the wrappers around the Pallas calls.

Argument checks, block sizes and padding, the clamped lengths and the
diagonal offsets. T, S are padded to the block size and the head dim to a
power of two (at least 16) in the wrapper; the padding is masked (rows/keys)
or zero (head dim) and sliced off again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxflash import reference
from jaxflash.pallas.config import MIN_BLOCK, next_pow2, pallas_supported


def same_varying_axes(*operands) -> tuple:
  """The operands of a Pallas call, cast to vary over the same manual mesh axes.

  Inside `shard_map` (with its default check_vma) a kernel that mixes operands
  of different variance (q varying over a mesh axis, lengths replicated) is
  refused; each operand is cast up to the union. Elsewhere nothing changes.
  """
  kinds = [getattr(jax.typeof(x), "manual_axis_type", None) for x in operands]
  if any(kind is None for kind in kinds):   # a JAX without manual axis types
    return operands
  axes = [kind.varying for kind in kinds]
  union = frozenset().union(*axes)
  return tuple(x if a == union else jax.lax.pcast(x, tuple(sorted(union - a)), to="varying")
               for x, a in zip(operands, axes))


def output(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """A Pallas call's result type: varying over the manual mesh axes of `like`, one
  of its operands after `same_varying_axes` (shard_map's check_vma asks for them)."""
  kind = getattr(jax.typeof(like), "manual_axis_type", None)
  if kind is None or kind.empty:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=kind)


def check_static_args(q, k, v, scale, window_left, window_right, softcap=0.0):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError("q, k, v must have rank 4")
  reason = pallas_supported(q.shape, k.shape, v.shape, q.dtype, platform="cpu",
                            k_dtype=k.dtype, v_dtype=v.dtype, logits_soft_cap=softcap)
  if reason is not None:
    raise ValueError(reason)
  if not isinstance(window_left, (int, np.integer)) or not isinstance(
      window_right, (int, np.integer)):
    raise TypeError("window_left and window_right must be Python ints")
  if not np.isfinite(float(scale)):
    raise ValueError(f"scale must be finite, got {scale!r}")


def round_up(n: int, block: int) -> int:
  return max(block, -(-n // block) * block)


def block_sizes(length: int, block: int) -> tuple[int, int]:
  """(block, padded length): the block shrinks for short sequences."""
  block = min(block, max(MIN_BLOCK, next_pow2(length)))
  return block, round_up(length, block)


def pad_to(x, axis_sizes: dict[int, int], value=0):
  pads = [(0, 0)] * x.ndim
  need = False
  for axis, size in axis_sizes.items():
    if x.shape[axis] != size:
      pads[axis] = (0, size - x.shape[axis])
      need = True
  return jnp.pad(x, pads, constant_values=value) if need else x


def clamped_lengths(lengths, batch: int, limit: int):
  if reference.given_lengths(lengths) is not None and jnp.shape(lengths) != (batch,):
    raise ValueError(
        f"sequence lengths must have shape ({batch},), got {jnp.shape(lengths)}")
  return reference.clamped_lengths(lengths, batch, limit)


def batch_offsets(offsets, batch: int):
  if offsets is None:
    return jnp.zeros((batch,), jnp.int32)
  offsets = jnp.asarray(offsets)
  if offsets.shape != (batch,):
    raise ValueError(
        f"diagonal offsets must have shape ({batch},), got {offsets.shape}")
  return offsets.astype(jnp.int32)


def output_delta(o, do, dlse):
  """delta_i = rowsum(dO * O)_i - dlse_i, float32 [B, Hq, T] (`dlse` None: zero); the
  callers zero it on rows that see no key."""
  delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
  return delta if dlse is None else delta - dlse.astype(jnp.float32)


def length_spec(batch: int):
  return pl.BlockSpec((batch,), lambda *_: (0,))


def extra_operands(alibi, segments, batch: int, heads: int, t_pad: int, s_pad: int):
  """(operands, specs) a kernel takes after its lengths and offsets, in the order
  blocks.take_extras reads them: ALiBi's slopes ([B, Hq] flattened to b * Hq + h,
  zero-padded to a power of two: a whole block), then the segment tables (each
  batch element's whole table, padded to the padded lengths); none without them."""
  operands, specs = [], []
  if alibi is not None:
    n = 1 << max(0, (batch * heads - 1).bit_length())
    operands.append(pad_to(jnp.asarray(alibi, jnp.float32).reshape(batch * heads), {0: n}))
    specs.append(length_spec(n))
  if segments is not None:
    for table, n in zip(segments, (t_pad, s_pad)):
      operands.append(pad_to(table, {1: n}))
      specs.append(pl.BlockSpec((None, n, table.shape[-1]), lambda *g: (g[1], 0, 0)))
  return operands, specs


def dense_operands(dense, *, key_major: bool, group: int, t_pad: int, s_pad: int,
                   block_q: int, block_k: int):
  """(operands, specs) of a call's dense bias and mask (jaxflash/dense.py) for one kernel,
  after its other extras, in the order blocks.DenseTile.take reads them: the bias, the
  mask (as int8) and the mask's tile summary (`tile_summary`); none without them.

  A query-major kernel (grid: query block, batch, query head) reads its block of rows
  (or the one broadcast row) over every key; a key-major one (grid: key block, batch,
  K/V head) every row of its group's heads over its block of keys. Broadcast axes stay 1.
  """
  operands, specs = [], []
  if dense is None:
    return operands, specs
  for x in (dense.bias, dense.mask):
    if x is None:
      continue
    Bb, Nb, Tb, Sb = x.shape
    x = pad_to(x.astype(jnp.int8) if x.dtype == jnp.bool_ else x,
               {**({2: t_pad} if Tb > 1 else {}), **({3: s_pad} if Sb > 1 else {})})
    rows, keys = (t_pad if key_major else block_q) if Tb > 1 else 1, (
        (block_k if key_major else s_pad) if Sb > 1 else 1)
    operands.append(x)
    specs.append(_dense_spec(x.shape, key_major, group, rows, keys))
    if x.dtype == jnp.int8:
      summary = tile_summary(x, block_q if Tb > 1 else 1, block_k if Sb > 1 else 1)
      n_rows, n_keys = summary.shape[2:]
      operands.append(summary)
      specs.append(_dense_spec(summary.shape, key_major, group, n_rows if key_major else 1,
                               1 if key_major else n_keys))
  return operands, specs


def _dense_spec(shape, key_major: bool, group: int, rows: int, keys: int):
  """The BlockSpec of a [Bb, Nb, R, C] dense operand: `rows` x `keys` blocks, batch and
  head axes followed where not broadcast (size 1)."""
  Bb, Nb, R, C = shape
  b_of = (lambda b: b) if Bb > 1 else (lambda b: 0)
  if key_major:   # grid (key block j, batch b, K/V head h): all of h's group at once
    heads = group if Nb > 1 else 1
    return pl.BlockSpec((None, heads, rows, keys),
                        lambda j, b, h: (b_of(b), h if Nb > 1 else 0, 0, j if C > keys else 0))
  # grid (query block i, batch b, query head h); blocks of rows visited last to first
  n = R // rows
  return pl.BlockSpec((None, None, rows, keys),
                      lambda i, b, h: (b_of(b), h if Nb > 1 else 0, n - 1 - i if n > 1 else 0, 0))


def tile_summary(mask, block_q: int, block_k: int):
  """int32 [Bm, Nm, R, C]: per tile of `block_q` x `block_k` pairs of an int8 mask
  [Bm, Nm, T, S] (a broadcast axis of 1 counts as one block), 0 when the mask hides the
  whole tile, 2 when it shows the whole tile, 1 when mixed. One pass over the mask."""
  Bm, Nm, T, S = mask.shape
  x = mask.reshape(Bm, Nm, T // block_q, block_q, S // block_k, block_k)
  return (jnp.max(x, axis=(3, 5)) + jnp.min(x, axis=(3, 5))).astype(jnp.int32)
