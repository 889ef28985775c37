"""The `xla` implementation: plain `jax.numpy`, the semantic source of truth.

It materialises the [batch, heads, q_len, kv_len] score matrix, so it is for
checking the other implementations and for calls they cannot serve (dense
`bias`/`mask`, float64, head dims above 256), not for long sequences.

Semantics (shared by every implementation, see `ffi/include/jaxflash/params.h`):
row i of batch b attends key j iff i < q_len_b, j < kv_len_b, and j lies in the
window [i + off - left, i + off + right] (an unbounded side when that bound is
None), where off = kv_len_b - q_len_b for bottom-right alignment and 0 for
top-left (jax.nn's). `is_causal` sets right = 0. A row that sees no key returns
zeros and an LSE of `empty_lse(dtype)` (the lowest finite value, standing in
for log 0 without an inf), with zero gradients.

Non-finite inputs follow IEEE arithmetic over the visible pairs: a NaN in q_i,
or in k_j / v_j of a key row i sees, reaches row i as in jax.nn. Nothing here
produces an inf or NaN from finite inputs (masked scores are never set to
-inf), so `jax.debug_infs` / `jax.debug_nans` stay quiet on valid calls. Rows
that see no key and keys that no row sees are zeroed before any product, so
padding never reaches anything; a key that some rows see and others do not is
multiplied into the others with an exact zero weight by the dense products,
which, as in jax.nn, turns a NaN or Inf of it into NaN there (the fused
implementations exclude such pairs exactly; docs/design.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def per_batch_operand(x) -> jax.Array:
  """Per-batch lengths or diagonal offsets as the FFI targets take them: int32 [batch], or
  an empty array for none (`no_lengths`), which the handlers read as full lengths / 0."""
  return no_lengths() if x is None else jnp.asarray(x, jnp.int32)


def varying_like(x, *likes):
  """`x`, typed to vary over the manual axes of each of `likes` inside shard_map (elsewhere
  unchanged).

  An FFI call's results vary over no manual axis, which makes a custom_vjp inside shard_map
  reject its cotangents and a platform_dependent switch its branches; adding a zero made
  from each of `likes` gives them their type, and XLA folds the additions away.
  """
  for like in likes:
    x = x + jnp.zeros_like(like, dtype=x.dtype, shape=())
  return x


def no_lengths() -> jax.Array:
  """Sequence lengths not given: every row and key is real.

  An empty int32 array rather than a [batch] array full of the sequence
  length: the native handlers read it as "no lengths", so no kernel runs to
  fill one (three such fills, lengths and diagonal offsets, took about 7 µs
  of a 220 µs decode step on an H100). Consumers that need values call
  `given_lengths` and fill in the sequence length themselves.
  """
  return jnp.zeros((0,), jnp.int32)


def alibi_operand(slopes) -> jax.Array:
  """ALiBi slopes as the native targets and the tangent primitive take them: [B, N]
  float32, or an empty array for none (as for lengths)."""
  return jnp.zeros((0,), jnp.float32) if slopes is None else slopes


def given_lengths(lengths):
  """`lengths`, or None where none were given (None, or `no_lengths()`)."""
  return None if lengths is None or jnp.size(lengths) == 0 else lengths


def clamped_lengths(lengths, batch: int, limit: int) -> jax.Array:
  """int32 `[batch]` lengths clipped to [0, limit]; `limit` where none were given."""
  lengths = given_lengths(lengths)
  if lengths is None:
    return jnp.full((batch,), limit, jnp.int32)
  return jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, limit)


def visible_mask(q_len: int, kv_len: int, *, query_seq_lengths=None, key_value_seq_lengths=None,
                 window_left: int | None = None, window_right: int | None = None,
                 bottom_right: bool = False, batch: int = 1, keys=None,
                 diagonal_offsets=None, segment_ids=None) -> jax.Array:
  """Boolean [batch, 1, q_len, kv_len]: which keys each query row attends.

  `keys` (int32 key indices) restricts the columns to those keys: a block of
  a computation that walks the keys block by block (derivatives.py).
  `diagonal_offsets` ([batch] ints) moves each batch element's diagonal, as the
  kernels' argument of that name does (ring attention's blocks).
  `segment_ids` (q_ids [batch, q_len], kv_ids [batch, kv_len], or None): a row
  sees only keys of its own segment (packed sequences).
  """
  i, j, qv3, kv3, diag = _positions(q_len, kv_len, query_seq_lengths, key_value_seq_lengths,
                                     bottom_right, batch, keys, diagonal_offsets)
  visible = (i < qv3) & (j < kv3)
  if window_left is not None:
    visible &= j >= diag - window_left
  if window_right is not None:
    visible &= j <= diag + window_right
  if segment_ids is not None:
    q_ids, kv_ids = segment_ids
    if keys is not None:
      kv_ids = jnp.take(kv_ids, jnp.clip(keys, 0, kv_len - 1), axis=1)
    visible &= q_ids[:, :, None] == kv_ids[:, None, :]
  return visible[:, None]


def _positions(q_len, kv_len, query_seq_lengths, key_value_seq_lengths, bottom_right, batch, keys,
               diagonal_offsets):
  """(i [1, T, 1], j [1, 1, S], q lengths, kv lengths, diagonal [B, T, 1]) int32: the
  diagonal is the key position row i is aligned with (i + offset_b in params.h)."""
  qv = (jnp.full((batch,), q_len, jnp.int32) if query_seq_lengths is None
        else jnp.clip(jnp.asarray(query_seq_lengths, jnp.int32), 0, q_len))
  kv = (jnp.full((batch,), kv_len, jnp.int32) if key_value_seq_lengths is None
        else jnp.clip(jnp.asarray(key_value_seq_lengths, jnp.int32), 0, kv_len))
  i = jnp.arange(q_len, dtype=jnp.int32)[None, :, None]
  j = (jnp.arange(kv_len, dtype=jnp.int32) if keys is None else keys)[None, None, :]
  qv3, kv3 = qv[:, None, None], kv[:, None, None]
  diag = i + (kv3 - qv3 if bottom_right else 0)
  if diagonal_offsets is not None:
    diag = diag + jnp.asarray(diagonal_offsets, jnp.int32)[:, None, None]
  return i, j, qv3, kv3, diag


def alibi_bias(slopes, q_len: int, kv_len: int, *, query_seq_lengths=None,
               key_value_seq_lengths=None, bottom_right: bool = False, batch: int = 1, keys=None,
               diagonal_offsets=None, dtype=jnp.float32) -> jax.Array:
  """ALiBi's [batch, heads, q_len, kv_len] bias: -slopes[b, n] * |i + offset_b - j|
  (`slopes` [heads] or [batch, heads]).

  The distance is measured from the diagonal of the call's causal alignment
  (offset_b as in `visible_mask`, ring attention's diagonal offsets included),
  so a causal row's own position is distance 0 under either alignment. Every
  implementation adds it after the soft-cap, like a dense bias.
  """
  _, j, _, _, diag = _positions(q_len, kv_len, query_seq_lengths, key_value_seq_lengths,
                                bottom_right, batch, keys, diagonal_offsets)
  distance = jnp.abs(diag - j).astype(dtype)[:, None]                     # [B, 1, T, S]
  slopes = jnp.asarray(slopes, dtype)
  return -slopes.reshape(-1, slopes.shape[-1], 1, 1) * distance


def window_bounds(is_causal: bool, local_window_size) -> tuple[int | None, int | None]:
  """(left, right) key bounds relative to the diagonal; None is unbounded."""
  left = right = None
  if local_window_size is not None:
    left, right = local_window_size
  if is_causal:
    right = 0 if right is None else min(right, 0)
  return left, right


def empty_lse(dtype) -> jax.Array:
  """The LSE of a row that sees no key, in `dtype`: its lowest finite value."""
  return jnp.asarray(jnp.finfo(dtype).min, dtype)


def cast_lse(lse: jax.Array, dtype) -> jax.Array:
  """`lse` in `dtype`, with empty rows mapped to `empty_lse(dtype)`.

  A plain cast would round the lowest finite float32 to -inf in bfloat16 and
  float16; the select keeps every intermediate finite.
  """
  empty = lse == empty_lse(lse.dtype)
  return jnp.where(empty, empty_lse(dtype), jnp.where(empty, 0, lse).astype(dtype))


def soft_cap(scores, cap):
  """Scores under a logit soft-cap `cap` (None or 0: none): cap * tanh(scores / cap).

  Every implementation applies it to scale * q.k, before masking and before a dense
  bias is added; tanh takes +-inf to +-cap and keeps NaN.
  """
  return scores if not cap else cap * jnp.tanh(scores / cap)


def soft_cap_slope(capped, cap):
  """d capped / d scores, from the capped scores: 1 - tanh^2 (None with no cap)."""
  return None if not cap else 1 - jnp.square(capped / cap)


def attention(query, key, value, *, scale: float, bias=None, mask=None, is_causal: bool = False,
              causal_alignment: str = "top_left", local_window_size=None,
              query_seq_lengths=None, key_value_seq_lengths=None, compute_dtype=None,
              diagonal_offsets=None, logits_soft_cap=None, segment_ids=None, alibi_slopes=None):
  """Attention over [B, T, N, H] / [B, S, K, H] inputs; returns (out, lse).

  `out` has the query's dtype (or `compute_dtype`), `lse` is [B, N, T] in
  `compute_dtype` (default: the query dtype promoted to float32), in natural-log
  units. `compute_dtype` sets the precision of every step, so the same call can
  give a float64 ground truth or a bfloat16 baseline for error budgets.
  """
  if compute_dtype is None:
    compute_dtype = jnp.promote_types(query.dtype, jnp.float32)
  out_dtype = query.dtype
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  G = N // K

  left, right = window_bounds(is_causal, local_window_size)
  q, k, v = query, key, value
  # A call that hides no pair skips the visibility masks: every select below would keep
  # its first operand, and on small calls (where the default runs this; choice.py) their
  # passes over the scores cost a sixth to a fifth of the call (CPU, 2026-12-02).
  hides = (mask is not None or left is not None or right is not None or segment_ids is not None
           or given_lengths(query_seq_lengths) is not None
           or given_lengths(key_value_seq_lengths) is not None)
  visible = sees = row_mask = None
  if hides:
    visible = visible_mask(T, S, query_seq_lengths=query_seq_lengths,
                           key_value_seq_lengths=key_value_seq_lengths, window_left=left,
                           window_right=right, bottom_right=causal_alignment == "bottom_right",
                           batch=B, diagonal_offsets=diagonal_offsets, segment_ids=segment_ids)
    if mask is not None:
      visible = visible & jnp.asarray(mask, bool)
    visible = jnp.broadcast_to(visible, (B, N, T, S))
    row_sees = jnp.any(visible, axis=-1)                                   # [B, N, T]
    key_seen = jnp.any(visible.reshape(B, K, G, T, S), axis=(2, 3))        # [B, K, S]
    sees = row_sees[..., None]                                            # [B, N, T, 1]
    row_mask = jnp.transpose(row_sees, (0, 2, 1))[..., None]               # [B, T, N, 1]
    # Padding (rows that see nothing, keys nobody sees) is zeroed before the
    # products, so whatever it holds, NaN included, reaches no output or gradient.
    q = jnp.where(row_mask, query, 0)
    k_mask = jnp.transpose(key_seen, (0, 2, 1))[..., None]
    k, v = jnp.where(k_mask, key, 0), jnp.where(k_mask, value, 0)
  q, k, v = (x.astype(compute_dtype) for x in (q, k, v))
  where = lambda cond, x, y: x if cond is None else jnp.where(cond, x, y)

  # Full-precision products for float32/float64: on GPUs the default would
  # be TF32, and this is the yardstick the kernels are measured against.
  precision = (jax.lax.Precision.HIGHEST if jnp.finfo(compute_dtype).bits >= 32
               else jax.lax.Precision.DEFAULT)
  # Query heads grouped over their key/value head; without grouping (G = 1) the plain
  # four-axis products, which XLA's CPU backend runs without a copy of the scores.
  grouped = (B, T, K, G) if G > 1 else (B, T, K)
  scores, output = (("btkgh,bskh->bkgts", "bkgts,bskh->btkgh") if G > 1 else
                    ("btkh,bskh->bkts", "bkts,bskh->btkh"))
  logits = jnp.einsum(scores, q.reshape(*grouped, H), k,
                      preferred_element_type=compute_dtype, precision=precision)
  logits = soft_cap(logits.reshape(B, N, T, S) * jnp.asarray(scale, compute_dtype),
                    logits_soft_cap)
  if alibi_slopes is not None:
    logits = logits + alibi_bias(alibi_slopes, T, S, query_seq_lengths=query_seq_lengths,
                                 key_value_seq_lengths=key_value_seq_lengths,
                                 bottom_right=causal_alignment == "bottom_right", batch=B,
                                 diagonal_offsets=diagonal_offsets, dtype=compute_dtype)
  if bias is not None:
    logits = logits + jnp.asarray(bias).astype(compute_dtype)

  # The max over visible scores only (NaN-propagating). The result does not
  # depend on the shift, so its gradient is dropped. As in jax.nn's softmax, a
  # +inf or NaN score makes the whole row (probabilities and LSE) NaN; a row
  # whose visible scores are all -inf shifts by 0 and gets 0 / 0 = NaN.
  row_max = jnp.max(where(visible, logits, jnp.finfo(compute_dtype).min), axis=-1, keepdims=True)
  shift = jax.lax.stop_gradient(jnp.where(row_max == -jnp.inf, 0, row_max))
  # exp sees only visible scores (masked entries read 0), so it never makes an
  # inf, and the select keeps masked probabilities exactly 0 with 0 gradient.
  probs = where(visible, jnp.exp(where(visible, logits - shift, 0)), 0)
  row_sum = jnp.sum(probs, axis=-1, keepdims=True)
  probs = (probs / where(sees, row_sum, 1)).astype(compute_dtype)

  out = jnp.einsum(output, probs.reshape(B, *grouped[2:], T, S), v,
                   preferred_element_type=compute_dtype, precision=precision)
  out = where(row_mask, out.reshape(B, T, N, v.shape[-1]), 0)
  lse = where(sees, jnp.log(where(sees, row_sum, 1)) + shift, empty_lse(compute_dtype))
  return out.astype(out_dtype), lse[..., 0]


def gather_pages(pages, page_table):
  """The pages of a paged cache in page-table order: contiguous keys or values.

  ``pages`` [num_pages, page_size, heads, head_dim] and ``page_table`` int
  [batch, max_pages] -> [batch, max_pages * page_size, heads, head_dim]. Page
  indices are clamped into range, as the native kernels clamp them.
  """
  num_pages, page_size = pages.shape[:2]
  gathered = jnp.take(pages, jnp.clip(page_table, 0, num_pages - 1), axis=0)
  return gathered.reshape((page_table.shape[0], page_table.shape[1] * page_size) + pages.shape[2:])
