"""The gradients of the Hopper wide forward (head dims 257-512), which has no backward kernel.

`backward` runs the blockwise backward of `derivatives.backward` in the inputs' 16-bit type
through XLA's matrix products (float32 sums), up to 1024 keys a step. A causal or windowed
call visits, per group of key blocks (one block a group up to 16 blocks, more past that),
only the query rows that can see them (`row_ranges`); the rest of a block's products would
multiply zero weights. Pallas's exact backward takes what this cannot (`exact`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxflash import derivatives, reference

# Past this many query rows (B · N · T) a wide call's gradients are the exact ones: the
# blockwise backward holds a few float32 [rows, block] arrays a step (at the smallest
# block, 128 keys, 512 MiB each at the bound).
MAX_ROWS = 1 << 20
# At most this many groups of key blocks, each a scan over its blocks and the rows they
# see together (or one plain step for a group of one block): the compiled program grows
# with the groups (64 plain steps compiled in 10 s on a CPU, one scan in 0.4 s).
MAX_GROUPS = 16


def row_ranges(spec, T: int, S: int, block: int, *, lengths: bool, offsets) -> list | None:
  """Groups (j0, j1, lo, hi) of consecutive key blocks [j0, j1) of `block` keys (at most S), at most
  MAX_GROUPS, with the static rows [lo, hi) that the causal bound or window lets see
  any of them (a superset: lengths hide more); or None where no static bound holds: no
  window side, ring offsets, a bottom-right diagonal moved by the lengths."""
  left, right = spec.window_left, spec.window_right
  if (left < 0 and right < 0) or offsets is not None or (spec.bottom_right and lengths):
    return None
  shift = S - T if spec.bottom_right else 0   # row i's diagonal key: i + shift
  block = min(block, S)   # as derivatives.backward's blocks
  count = -(-S // block)
  size = -(-count // MAX_GROUPS)   # blocks a group
  groups = []
  for j0 in range(0, count, size):
    j1 = min(count, j0 + size)
    lo = 0 if right < 0 else min(T, max(0, j0 * block - shift - right))
    hi = T if left < 0 else min(T, max(0, j1 * block + left - shift))
    groups.append((j0, j1, lo, max(lo, hi)))
  return groups


def backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, *, spec, exact, offsets=None):
  """(dQ, dK, dV) of a 16-bit call past the CUDA kernels' head dims. `exact()` gives the
  gradients where this cannot: calls past `MAX_ROWS`, and calls whose gradients come out
  non-finite. Padding rows and keys are zeroed first, as the kernels' loads zero them; but a
  block's products multiply a hidden pair's zero weight by the key's value and query, so a
  NaN or Inf of an input could reach rows that cannot see it (design.md §2), and the exact
  gradients then replace all three (under vmap both run: the choice is per call, not per
  element)."""
  B, T, N, _ = q.shape
  if B * N * T > MAX_ROWS:
    return exact()
  S = k.shape[1]
  block = 128
  while block < 1024 and block < S and B * N * T * block * 2 <= MAX_ROWS * 128:
    block *= 2
  valid_rows = (jnp.arange(T) < reference.clamped_lengths(q_lengths, B, T)[:, None])[..., None, None]
  valid_keys = (jnp.arange(S) < reference.clamped_lengths(kv_lengths, B, S)[:, None])[..., None, None]
  q, o, do = (jnp.where(valid_rows, x, 0) for x in (q, o, do))
  k, v = (jnp.where(valid_keys, x, 0) for x in (k, v))
  lengths = any(reference.given_lengths(x) is not None for x in (q_lengths, kv_lengths))
  grads = derivatives.backward(
      q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec=spec, offsets=offsets, dtype=q.dtype,
      block=block, rows=row_ranges(spec, T, S, block, lengths=lengths, offsets=offsets))
  finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in grads]))
  return lax.cond(finite, lambda: grads, exact)
