"""How many key ranges a forward splits its work into (split-KV).

A decode step (a few query rows against a long K/V cache) has few work
items: (batch, K/V head, query tile). Alone they leave most of the machine
idle while each streams the whole K/V sequence. Splitting every item's keys
into `s` ranges multiplies the items by `s`; a merge then combines the
partial results by the online-softmax rule, at a cost of `s` times the size
of O in float32, small next to K/V.

`None` (automatic) asks the heuristic here; an int forces that many splits
(tests, tuning). The number is resolved on the Python side because the
partial buffers are outputs of the call, sized here: nothing is allocated at
run time.
"""

from __future__ import annotations

import math
import numbers
import os

import jax
import jax.numpy as jnp

from jaxflash import tile_cache

MAX_SPLITS = 1024  # the handlers' limit (ffi/handlers/decode.h)

# The GPU decode kernels (native and Pallas) take up to this many packed rows
# (q_len x query heads per K/V head) unsplit (ffi/kernels/decode/launch_decode.h,
# kMaxPackedRows); longer queries run the training kernels, which automatic
# splitting leaves alone (paged calls excepted: only the decode kernel reads
# pages). 128 rows still read K/V at ~128 flop per byte, under the tensor
# cores' ridge, where a training kernel would read K/V once per query head.
DECODE_MAX_ROWS = 128
# Both use 16-row tiles up to 16 packed rows, else 64 (DecodeTilePick). The
# native one fits two CTAs per SM (shared memory; its stage count leaves room
# for Q, decode_kernel.cuh) except at these (head-dim bucket, tile rows), where
# two stages beside Q leave room for one (a static_assert there keeps the list
# exact); the Pallas one is counted at two.
_DECODE_TILE_ROWS = 64
_GPU_CTAS_PER_SM = 2
_ONE_DECODE_CTA_PER_SM = ((192, 64), (256, 16))
# The CPU forward's packed rows per work item (ffi/kernels/cpu/tile.h).
_CPU_TILE_ROWS = 32
_H100_SMS = 132  # when a GPU does not report its SM count


def decode_tile_rows(rows: int) -> int:
  """Packed rows per tile of the GPU decode kernels."""
  return 16 if rows <= 16 else _DECODE_TILE_ROWS


def validate(num_splits) -> int:
  """`num_splits` as the API takes it -> 0 (automatic) or the forced count."""
  if num_splits is None:
    return 0
  if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
    raise TypeError(f"num_splits must be None or an int, got {num_splits!r}")
  num_splits = int(num_splits)
  if not 1 <= num_splits <= MAX_SPLITS:
    raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}] (or None for automatic), got "
                     f"{num_splits}")
  return num_splits


def heuristic(work_items: int, kv_len: int, slots: int, *, min_keys: int = 256,
              max_splits: int = 64, within: float = 0.15) -> int:
  """Splits for `work_items` items over `kv_len` keys on `slots` parallel workers.

  No split when the items already fill most of the slots. Otherwise the
  smallest split count whose wave efficiency (items x splits over slots,
  against the next whole number of waves) is within `within` of the best one
  reachable, keeping at least `min_keys` keys per split.
  """
  if work_items <= 0 or slots <= 0 or work_items >= 0.8 * slots:
    return 1
  limit = max(1, min(max_splits, kv_len // min_keys))
  efficiency = []
  for s in range(1, limit + 1):
    waves = work_items * s / slots
    efficiency.append(waves / math.ceil(waves))
  best = max(efficiency)
  return next(s for s, e in enumerate(efficiency, 1) if e >= (1 - within) * best)


def _gpu_sms() -> int:
  count = getattr(jax.devices()[0], "core_count", None)
  return int(count) if isinstance(count, int) and count > 0 else _H100_SMS


def _gpu_decode(q_shape, k_shape, paged: bool = False, native_kernel: bool = False) -> int:
  B, T, N, D = q_shape
  S, K = k_shape[1], k_shape[2]
  rows = T * (N // K)
  if rows > DECODE_MAX_ROWS and not paged:
    return 1
  tile = decode_tile_rows(rows)
  items = B * K * math.ceil(rows / tile)
  ctas = _GPU_CTAS_PER_SM
  if native_kernel and (tile_cache.bucket(D), tile) in _ONE_DECODE_CTA_PER_SM:
    ctas = 1
  # Within 5% of full: the GPU decode kernels stream K/V at a rate set by the
  # copies each CTA has in flight, so an idle slot is lost bandwidth. On an
  # H100, B 1 x kv 128k with 8 K/V heads ran 220 us at 29 splits (232 CTAs of
  # 264 slots, what 15% allowed) and 211 at 32 (thirteenth session in
  # docs/performance-log.md).
  return heuristic(items, S, _gpu_sms() * ctas, within=0.05)


def native(forced: int, q_shape, k_shape, dtype, platform: str, paged: bool = False) -> int:
  """The split count of a native forward of q [B, T, N, D] against k [B, S, K, D].

  On the GPU only the tensor-core decode kernel splits: float32 and head dims
  that are not a multiple of 8 run the SIMT kernels unsplit, head dims past 256
  the Hopper forward (sm90/fwd_wide_kernel.cuh) unsplit, and automatic
  splitting stays off for queries past DECODE_MAX_ROWS packed rows unless the
  call is `paged` (the decode kernel takes every paged call).
  """
  if platform in ("gpu", "cuda"):
    if jnp.dtype(dtype) == jnp.float32 or q_shape[-1] % 8 or q_shape[-1] > 256:
      return 1
    return forced or _gpu_decode(q_shape, k_shape, paged, native_kernel=True)
  if forced:
    return forced
  B, T, N, _ = q_shape
  S, K = k_shape[1], k_shape[2]
  items = B * K * math.ceil(T * (N // K) / _CPU_TILE_ROWS)
  return heuristic(items, S, os.cpu_count() or 1, min_keys=512)


def pallas(forced: int, q_shape, k_shape, platform: str) -> int:
  """The split count of a Pallas forward: automatic only on the GPU (the CPU
  interpreter runs one program at a time, so splitting cannot help there)."""
  if forced:
    return forced
  return _gpu_decode(q_shape, k_shape) if platform in ("gpu", "cuda") else 1
