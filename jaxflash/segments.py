"""Segment ids (packed sequences): their validation, and the tables the kernels read.

A call with segment ids lets query row i see key j only if q_ids[b, i] == kv_ids[b, j],
on top of the window, the lengths and the diagonal (reference.visible_mask is the rule).

The native kernels never compare ids tile by tile to find their work. Once per call,
on the device, `tables` turns the ids into one row of `FIELDS` int32 per query row
and one per key (params.h, SegmentField): the first and one-past-last position of
the other side each sees (window, lengths and ids applied; exact), whether every
position between is seen (no gap: the interval alone masks exactly), non-decreasing
envelopes of those bounds (what a block of rows visits, whatever order the ids come
in), and where each run of equal ids ends (which tiles need no mask). Sorted ids
(documents packed one after another) give exact intervals, so only tiles that
straddle a document boundary or the diagonal are masked and tiles of other
documents are never visited; unsorted ids are as correct, only skipped less.

The cost is a sort of each row's keys and two binary searches per position:
O((T + S) log S) integer work, next to the O(T S H) of the attention. On a GPU
with the native kernels the FFI target `jaxflash_segment_tables_v1` builds both
tables (ffi/kernels/segments/segment_tables.cu; its sort holds sides of up to
`MAX_KERNEL_LENGTH` positions): XLA runs the definition below as a chain of small
latency-bound kernels (B 2 x S 8k on an H200: about 228 us; the kernel's span
pass, the bulk of its work, 13 us).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflash import _native, reference

# params.h's SegmentField, in order; the eighth field pads a row to 32 bytes.
FIELDS = 8
ID, BEGIN, END, GAP_FREE, ENV_BEGIN, ENV_END, RUN_END = range(7)

_MAX_OFFSET = 1 << 30
# params.h's kMaxSortedSegmentIds: the longest side the GPU kernel's sort holds.
MAX_KERNEL_LENGTH = 8192


def validate(query_segment_ids, key_value_segment_ids, batch: tuple[int, ...], q_len: int,
             kv_len: int):
  """(q_ids [B, T], kv_ids [B, S]) int32 with the batch axes flattened, or None.

  `key_value_segment_ids` defaults to `query_segment_ids` (self-attention: q_len ==
  kv_len); giving only the key ids is an error.
  """
  if query_segment_ids is None:
    if key_value_segment_ids is not None:
      raise ValueError("key_value_segment_ids needs query_segment_ids")
    return None
  self_attention = key_value_segment_ids is None or key_value_segment_ids is query_segment_ids
  if self_attention:
    if q_len != kv_len:
      raise ValueError("key_value_segment_ids must be given when the query and key lengths "
                       f"differ ({q_len} and {kv_len})")
    key_value_segment_ids = query_segment_ids
  ids = []
  for x, name, length in ((query_segment_ids, "query_segment_ids", q_len),
                          (key_value_segment_ids, "key_value_segment_ids", kv_len)):
    try:
      x = jnp.asarray(x)
    except TypeError as e:
      raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.dtype.itemsize > 4:
      raise TypeError(f"{name} must be an integer array of at most 32 bits, got {x.dtype}")
    if x.shape != batch + (length,):
      raise ValueError(f"{name} must have shape [*batch, {'q_len' if length == q_len else 'kv_len'}]"
                       f" = {batch + (length,)}, got {x.shape}")
    ids.append(x.reshape(-1, length).astype(jnp.int32))
    if self_attention:   # one array both sides: `tables` sorts it once
      return ids[0], ids[0]
  return tuple(ids)


def _policy(B, T, S, q_lengths, kv_lengths, spec, offsets):
  """(q_valid, kv_valid, offset) [B, 1] int32, as MaskPolicy::For computes them."""
  qv = reference.clamped_lengths(q_lengths, B, T)[:, None]
  kv = reference.clamped_lengths(kv_lengths, B, S)[:, None]
  extra = (0 if offsets is None or jnp.size(offsets) == 0
           else jnp.clip(jnp.asarray(offsets, jnp.int32), -_MAX_OFFSET, _MAX_OFFSET)[:, None])
  offset = jnp.clip((kv - qv if spec.bottom_right else 0) + extra, -_MAX_OFFSET, _MAX_OFFSET)
  return qv, kv, offset


def _window_spans(B, T, S, q_lengths, kv_lengths, spec, offsets):
  """The window's keys of each row and rows of each key, [B, T] / [B, S] begin and end
  (MaskPolicy's WindowKeyBegin ... WindowRowEnd; empty past the lengths)."""
  qv, kv, off = _policy(B, T, S, q_lengths, kv_lengths, spec, offsets)
  left, right = spec.window_left, spec.window_right
  i = jnp.arange(T, dtype=jnp.int32)[None]
  j = jnp.arange(S, dtype=jnp.int32)[None]
  key_begin = jnp.zeros((B, T), jnp.int32) if left < 0 else jnp.maximum(0, i + off - left)
  key_end = (jnp.broadcast_to(kv, (B, T)) if right < 0
             else jnp.clip(i + off + right + 1, 0, kv))
  key_end = jnp.where(i < qv, key_end, 0)
  row_begin = jnp.zeros((B, S), jnp.int32) if right < 0 else jnp.clip(j - off - right, 0, qv)
  row_end = (jnp.broadcast_to(qv, (B, S)) if left < 0 else jnp.clip(j - off + left + 1, 0, qv))
  row_end = jnp.where(j < kv, row_end, 0)
  return (key_begin, key_end), (row_begin, row_end)


def _lower_bound(sorted_ids, sorted_pos, ids, pos):
  """Per position: how many (id, position) pairs of a row sort before (ids, pos).

  A binary search unrolled in Python (log2 n + 1 steps): XLA fuses the steps into
  one kernel, where a loop would launch a few small kernels per step."""
  n = sorted_ids.shape[1]
  lo = jnp.zeros(ids.shape, jnp.int32)
  hi = jnp.full(ids.shape, n, jnp.int32)
  for _ in range(n.bit_length() + 1):
    mid = (lo + hi) // 2
    at = jnp.minimum(mid, n - 1)
    mid_id = jnp.take_along_axis(sorted_ids, at, axis=1)
    mid_pos = jnp.take_along_axis(sorted_pos, at, axis=1)
    before = (mid_id < ids) | ((mid_id == ids) & (mid_pos < pos))
    live = lo < hi
    lo, hi = jnp.where(live & before, mid + 1, lo), jnp.where(live & ~before, mid, hi)
  return lo


def _sorted(ids):
  """(ids, positions) of each row sorted by id, then position."""
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
  return lax.sort((ids, positions), dimension=1, num_keys=2)


def _side(ids, other_ids, other_sorted, begin, end):
  """The table of one side: [B, L, FIELDS] for positions with `ids` that see the
  positions of `other_ids` (sorted: `other_sorted`) in [begin, end) whose id equals theirs."""
  B, L = ids.shape
  n = other_ids.shape[1]
  if n == 0:
    empty = jnp.zeros((B, L), jnp.int32)
    first = last = empty
    count = empty
  else:
    sorted_ids, sorted_pos = other_sorted
    lo = _lower_bound(sorted_ids, sorted_pos, ids, begin)
    hi = _lower_bound(sorted_ids, sorted_pos, ids, jnp.maximum(begin, end))
    count = hi - lo
    first = jnp.take_along_axis(sorted_pos, jnp.minimum(lo, n - 1), axis=1)
    last = jnp.take_along_axis(sorted_pos, jnp.clip(hi - 1, 0, n - 1), axis=1)
  seen = count > 0
  # A position that sees nothing gets [n, 0): as the first or the last row of a
  # block it empties the keys the block sees whole (mask.h, FullKeys).
  span_begin = jnp.where(seen, first, n)
  span_end = jnp.where(seen, last + 1, 0)
  gap_free = (~seen | (count == span_end - span_begin)).astype(jnp.int32)
  env_begin = lax.cummin(span_begin, axis=1, reverse=True)
  env_end = lax.cummax(span_end, axis=1)
  index = jnp.arange(L, dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones((B, min(L, 1)), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
  next_start = lax.cummin(jnp.where(starts, index, L), axis=1, reverse=True)
  run_end = jnp.concatenate([next_start[:, 1:], jnp.full((B, min(L, 1)), L, jnp.int32)], axis=1)
  fields = (ids, span_begin, span_end, gap_free, env_begin, env_end, run_end,
            jnp.zeros((B, L), jnp.int32))
  return jnp.stack(fields, axis=-1)


def tables(q_ids, kv_ids, q_lengths, kv_lengths, spec, offsets=None):
  """(query table [B, T, FIELDS], key table [B, S, FIELDS]) int32 for the native kernels.

  `q_lengths` / `kv_lengths` as the kernels take them (None or empty: none), `offsets`
  the per-batch diagonal offsets (None: 0), `spec` the call's MaskSpec (window,
  alignment). Self-attention's ids (the same array both sides) are sorted once.
  """
  B, T = q_ids.shape
  S = kv_ids.shape[1]
  xla = lambda *args: _tables_xla(*args, spec=spec, same=q_ids is kv_ids)  # noqa: E731
  args = (q_ids, kv_ids, *map(reference.per_batch_operand, (q_lengths, kv_lengths, offsets)))
  if (B and 0 < T <= MAX_KERNEL_LENGTH and 0 < S <= MAX_KERNEL_LENGTH
      and _native.unavailable_reason("gpu") is None):
    kernel = lambda *args: _tables_kernel(*args, spec=spec)  # noqa: E731
    return lax.platform_dependent(*args, cuda=kernel, default=xla)
  return xla(*args)


def _tables_kernel(q_ids, kv_ids, q_lengths, kv_lengths, offsets, *, spec):
  """Both tables from the GPU kernel (the same fields as `_tables_xla`)."""
  B, T = q_ids.shape
  S = kv_ids.shape[1]
  out = (jax.ShapeDtypeStruct((B, T, FIELDS), jnp.int32),
         jax.ShapeDtypeStruct((B, S, FIELDS), jnp.int32))
  call = jax.ffi.ffi_call(_native.SEGMENT_TABLES_TARGET, out, vmap_method="broadcast_all")
  operands = (q_ids, kv_ids, q_lengths, kv_lengths, offsets)
  tables = call(*operands, window_left=np.int64(spec.window_left),
                window_right=np.int64(spec.window_right), bottom_right=bool(spec.bottom_right))
  # Inside shard_map: typed like the jnp branch, which varies with every operand.
  return tuple(reference.varying_like(t, *operands) for t in tables)


def _tables_xla(q_ids, kv_ids, q_lengths, kv_lengths, offsets, *, spec, same):
  """Both tables as jnp: the definition of every field."""
  B, T = q_ids.shape
  S = kv_ids.shape[1]
  (key_begin, key_end), (row_begin, row_end) = _window_spans(B, T, S, q_lengths, kv_lengths, spec,
                                                             offsets)
  kv_sorted = _sorted(kv_ids) if S else None
  q_sorted = kv_sorted if same else (_sorted(q_ids) if T else None)
  return (_side(q_ids, kv_ids, kv_sorted, key_begin, key_end),
          _side(kv_ids, q_ids, q_sorted, row_begin, row_end))


def operands(tables):
  """The tables as the two operands the FFI targets and the tangent primitive take: empty
  arrays for a call without ids."""
  return (reference.no_lengths(),) * 2 if tables is None else tables


def from_operands(q_table, kv_table):
  """The inverse of `operands`: the tables, or None for the empty pair."""
  return None if q_table.size == 0 else (q_table, kv_table)


def ids_of(tables):
  """(q_ids, kv_ids) of a call's segment tables (their first field)."""
  return tables[0][..., ID], tables[1][..., ID]


def id_tables(q_ids, kv_ids):
  """The ids in the tables' form, for code that reads nothing but them: ring attention,
  which builds each block's tables from its own ids, lengths and offset."""
  return q_ids[..., None], kv_ids[..., None]
