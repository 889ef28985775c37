"""The Pallas attention forward: its kernels and `pallas_forward`.

forward   grid (q blocks, B, Hq). Online softmax in base 2 (``log2(e)`` folded
          into the scale, or into the soft-cap) over the K/V blocks the mask
          lets the query block see; fp32 accumulators; writes O and LSE.
decode    grid (row tiles x splits, B, Hkv). The same online softmax over
          packed rows (the query heads of a K/V head stacked over the query
          rows), one key range per split; the splits are merged in jnp.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxflash import _splits
from jaxflash.pallas.blocks import (
    Alibi, DenseTile, Mask, Scores, both, dot, exact_where_nan, key_blocks, query_block,
    take_extras, zero_padding)
from jaxflash.pallas.config import (
    EMPTY_LSE, LN2, LOG2E, MIN_BLOCK, PallasConfig, compiler_params, next_pow2,
    padded_head_dim, resolve_config)
from jaxflash.pallas.host import (
    output, same_varying_axes,
    batch_offsets, block_sizes, check_static_args, clamped_lengths, length_spec, pad_to,
    round_up, extra_operands, dense_operands)

__all__ = ["pallas_forward"]


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


def _attend(q, k_ref, v_ref, rows, mask, ranges, *, scores: Scores,
            block_k: int, alibi: Alibi = Alibi(), q_ids=None, dense: DenseTile = DenseTile()):
  """Online softmax of q against the key blocks of ``ranges`` = (lo, a, b, hi):
  [lo, a) and [b, hi) element-masked, [a, b) entirely visible to the mask rule
  (a dense mask may still hide pairs there: `dense`, the program's dense bias and
  mask). ``rows`` [bq, 1] are the query rows the mask knows for q's rows (q's
  padding rows zeroed), ``q_ids`` their segment ids (`Mask.row_ids`; None without).
  Returns ((acc, m, l), seen): the unnormalised output, the running max (log2
  units) and sum per row; with a dense mask `seen` says which rows saw a key it
  shows (int32 > 0), else None."""
  lo, a, bb, hi = ranges

  def step(masked, kb, carry):
    acc, m, l, *seen = carry
    start = pl.multiple_of(kb * block_k, block_k)
    k = k_ref[pl.ds(start, block_k), :]
    v = v_ref[pl.ds(start, block_k), :]
    cols = start + jnp.arange(block_k, dtype=jnp.int32)[None, :]
    s = dense.add(alibi.add(scores.log2(dot(q, k, 1, 1)), rows, cols), start, block_k)
    visible = None
    if masked:
      visible = mask.visible(rows, cols, mask.with_keys(q_ids, start, block_k))
      v = zero_padding(v, cols.T, mask.kv_valid)
    visible = both(visible, dense.shows(start, block_k))
    if visible is not None:
      s = jnp.where(visible, s, -jnp.inf)
    if seen:
      shown = jnp.broadcast_to(visible, s.shape).astype(jnp.int32)
      seen = [jnp.maximum(seen[0], jnp.max(shown, axis=1))]
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A row may have seen only masked (or -inf) scores so far: shift by 0.
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_ref)
    p = jnp.exp2(s - m_ref[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, 1, 0)
    return (acc, m_new, l, *seen)

  block_q, dp = q.shape
  carry = (jnp.zeros((block_q, dp), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  if dense.mask is not None:
    carry += (jnp.zeros((block_q,), jnp.int32),)
  carry = lax.fori_loop(lo, a, dense.walk(functools.partial(step, True)), carry)
  carry = lax.fori_loop(a, bb, dense.walk(functools.partial(step, False)), carry)
  carry = lax.fori_loop(bb, hi, dense.walk(functools.partial(step, True)), carry)
  return carry[:3], (carry[3] if len(carry) > 3 else None)


def _finish(q, k_ref, v_ref, rows, mask, seen, keys, carry, *, scores: Scores,
            partial: bool, alibi: Alibi = Alibi(), q_ids=None, dense: DenseTile = DenseTile()):
  """The rows of an `_attend` pass: (o float32, LSE in natural units).

  `seen` [bq] says which rows see a key of the pass's element range `keys` =
  (begin, end); it comes from the mask, never from the sum: a +inf or NaN
  score makes l NaN (and the row and its LSE NaN, as in a dense softmax) even
  where the running max dropped it (Triton's max ignores NaN). Rows that see
  nothing give o = 0 and EMPTY_LSE. A row whose visible scores are all -inf
  has l = 0: a whole pass gives it 0 / 0 = NaN (LSE -inf), as a dense softmax
  does; a split (`partial`) keeps acc (0, or NaN from a non-finite value) with
  LSE -inf, so the merge weighs it 0 and decides the row from all splits.
  """
  acc, m, l = carry
  div = jnp.where(l == 0.0, 1.0, l) if partial else l
  o = jnp.where(seen[:, None], acc / div[:, None], 0.0)
  lse = jnp.where(seen, m * LN2 + jnp.log(jnp.where(seen, div, 1.0)), EMPTY_LSE)
  # Rows whose LSE says the row is NaN (or 0/0) anyway need no recomputation.
  rows_ok = ~jnp.isnan(lse) if partial else jnp.isfinite(lse)

  def exact(xs):
    # Key by key over the visible pairs only, with P from the (correct) LSE;
    # an all -inf row of a split weighs its values by 0.
    o, = xs
    lse2 = lse * LOG2E
    qf = q.astype(jnp.float32)

    def key(j, acc):
      kj = k_ref[pl.ds(j, 1), :].astype(jnp.float32)
      vj = v_ref[pl.ds(j, 1), :].astype(jnp.float32)
      s = dense.add(alibi.add(scores.log2(jnp.sum(qf * kj, axis=1))[:, None], rows, j), j, 1)
      p = jnp.exp2(s[:, 0] - lse2)
      p = jnp.where(lse == -jnp.inf, 0.0, p)
      visible = both(mask.visible(rows, j, mask.with_keys(q_ids, j, 1)), dense.shows(j, 1))
      return acc + jnp.where(visible, p[:, None] * vj, 0.0)

    acc = lax.fori_loop(keys[0], keys[1], key, jnp.zeros_like(o))
    return (jnp.where(rows_ok[:, None], acc, o),)

  o, = exact_where_nan((o,), rows_ok, exact)
  return o, lse


def _fwd_kernel(q_len_ref, kv_len_ref, off_ref, *refs, scores: Scores, alibi: bool,
                segments: bool, bias: bool, dense_mask: bool, heads: int, left: int, right: int,
                bottom_right: bool, block_q: int, block_k: int, num_q_blocks: int):
  slope_ref, tables, refs = take_extras(refs, alibi, segments)
  dense, (q_ref, k_ref, v_ref, o_ref, lse_ref) = DenseTile.take(refs, bias, dense_mask, False)
  mask, r0, rows, ranges = query_block(q_len_ref, kv_len_ref, off_ref, left=left, right=right,
                                       bottom_right=bottom_right, block_q=block_q,
                                       block_k=block_k, num_q_blocks=num_q_blocks, tables=tables)
  slopes = Alibi.of(slope_ref, pl.program_id(1) * heads + pl.program_id(2), mask)
  q_ids = mask.row_ids(r0, block_q)
  q = zero_padding(q_ref[...], rows, mask.q_valid)
  carry, dense_seen = _attend(q, k_ref, v_ref, rows, mask, ranges, scores=scores,
                              block_k=block_k, alibi=slopes, q_ids=q_ids, dense=dense)
  seen = mask.has_keys(rows[:, 0], r0)
  if dense_seen is not None:   # rows the dense mask leaves without a key are empty
    seen &= dense_seen > 0
  o, lse = _finish(q, k_ref, v_ref, rows, mask, seen,
                   (ranges[0] * block_k, ranges[3] * block_k), carry,
                   scores=scores, partial=False, alibi=slopes, q_ids=q_ids, dense=dense)
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse


def _decode_kernel(q_len_ref, kv_len_ref, *refs, scores: Scores, alibi: bool, left: int,
                   right: int, bottom_right: bool, block_r: int, block_k: int, group: int,
                   total_rows: int, row_tiles: int, num_splits: int):
  """One split of one tile of packed rows (the query heads of a K/V head's
  group stacked over the query rows: packed row r is query row r // group).
  Writes the split's normalised output (float32) and natural LSE, EMPTY_LSE
  for rows that see no key of the split (the merge skips those). With ALiBi
  the first ref holds the tile's per-row slopes (each row its own head's)."""
  slope_ref, refs = (refs[0], refs[1:]) if alibi else (None, refs)
  q_ref, k_ref, v_ref, o_ref, lse_ref = refs
  # Integer division as lax.div/lax.rem (operands are non-negative), which the
  # Triton lowering takes directly.
  div = lambda x, n: lax.div(x, jnp.int32(n))
  i = pl.program_id(0)
  split = div(i, row_tiles)
  r0 = lax.rem(i, jnp.int32(row_tiles)) * block_r
  b = pl.program_id(1)
  mask = Mask.make(q_len_ref[b], kv_len_ref[b], 0, left, right, bottom_right)
  rows = div(r0 + jnp.arange(block_r, dtype=jnp.int32)[:, None], group)
  # The query rows of the tile's real packed rows: [q0, q0 + q_rows).
  q0 = div(r0, group)
  q_rows = div(jnp.minimum(r0 + block_r, total_rows) - 1, group) + 1 - q0
  lo, a, bb, hi = key_blocks(mask, q0, q_rows, block_k)
  # This split's blocks (spans differ by at most one block), and the three
  # ranges cut to them.
  n = hi - lo
  s_lo = lo + lax.div(n * split, jnp.int32(num_splits))
  s_hi = lo + lax.div(n * (split + 1), jnp.int32(num_splits))
  cut = lambda x: jnp.clip(x, s_lo, s_hi)
  q = zero_padding(q_ref[...], rows, mask.q_valid)
  bias = Alibi() if slope_ref is None else Alibi(slope_ref[...][:, None] * -LOG2E, mask.offset)
  carry, _ = _attend(q, k_ref, v_ref, rows, mask, (cut(lo), cut(a), cut(bb), cut(hi)),
                     scores=scores, block_k=block_k, alibi=bias)
  k0, k1 = s_lo * block_k, s_hi * block_k
  r = rows[:, 0]
  seen = ((r < mask.q_valid) &
          (jnp.maximum(mask.key_begin(r), k0) < jnp.minimum(mask.key_end(r), k1)))
  o, lse = _finish(q, k_ref, v_ref, rows, mask, seen, (k0, k1), carry, scores=scores,
                   partial=True, alibi=bias)
  o_ref[...] = o
  lse_ref[...] = lse


# ---------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------


def _padded_kv(k, v, block_k: int, dp: int):
  """(key block, padded length, k, v): K/V padded to whole key blocks and dp."""
  bk, s_pad = block_sizes(k.shape[1], block_k)
  return bk, s_pad, pad_to(k, {1: s_pad, 3: dp}), pad_to(v, {1: s_pad, 3: dp})


def _merge_splits(o_part, lse_part):
  """Combines split partials [..., S, rows, dp] / [..., S, rows] (normalised
  outputs, natural LSEs, EMPTY_LSE where a split saw no key of the row) by
  the online-softmax rule; returns (o, lse) with main's row rules: O = 0 and
  EMPTY_LSE for rows no split saw, 0 / 0 = NaN (LSE -inf) for rows whose
  visible scores are all -inf, NaN from any split's NaN. Every intermediate
  stays finite on finite inputs."""
  valid = lse_part != EMPTY_LSE
  seen = jnp.any(valid, axis=-2)
  m = jnp.max(lse_part, axis=-2, keepdims=True)
  shift = jnp.where(m == -jnp.inf, 0.0, m)
  w = jnp.where(valid, jnp.exp(jnp.where(valid, lse_part - shift, 0.0)), 0.0)
  total = jnp.sum(w, axis=-2)
  num = jnp.sum(jnp.where(valid[..., None], w[..., None] * o_part, 0.0), axis=-3)
  total_safe = jnp.where(seen, total, 1.0)
  o = jnp.where(seen[..., None], num / total_safe[..., None], 0.0)
  lse = jnp.where(seen, jnp.log(total_safe) + shift[..., 0, :], EMPTY_LSE)
  return o, lse


def _decode_forward(q, k, v, q_len, kv_len, cfg: PallasConfig, *, splits: int,
                    scores: Scores, window_left: int, window_right: int,
                    bottom_right: bool, alibi=None):
  """The forward over packed rows (GQA heads stacked, so a K/V block is read
  once per K/V head) in `splits` key ranges, merged in jnp; `alibi` [B, Hq]
  slopes, laid out per packed row."""
  batch, t, hq, d = q.shape
  _, s, hkv, _ = k.shape
  group = hq // hkv
  dp = padded_head_dim(d)
  total = t * group
  br = max(MIN_BLOCK, min(_splits.decode_tile_rows(total), next_pow2(total)))
  if dp > 256:   # rows beside a K/V block within the forward's shared-memory fit
    br = min(br, cfg.block_q)
  r_pad = round_up(total, br)
  row_tiles = r_pad // br
  bk, s_pad, kp, vp = _padded_kv(k, v, cfg.block_k, dp)
  # [B, T, Hkv * G, D] -> [B, Hkv, T * G, D]: packed row r = query row r // G, head r % G.
  qp = q.reshape(batch, t, hkv, group, d).transpose(0, 2, 1, 3, 4).reshape(batch, hkv, total, d)
  qp = pad_to(qp, {2: r_pad, 3: dp})

  kernel = functools.partial(
      _decode_kernel, scores=scores, alibi=alibi is not None, left=int(window_left),
      right=int(window_right), bottom_right=bool(bottom_right), block_r=br,
      block_k=bk, group=group, total_rows=total, row_tiles=row_tiles,
      num_splits=splits)
  split_of = lambda i: lax.div(i, jnp.int32(row_tiles))
  tile_of = lambda i: lax.rem(i, jnp.int32(row_tiles))
  q_spec = pl.BlockSpec((None, None, br, dp), lambda i, b, h: (b, h, tile_of(i), 0))
  kv_spec = pl.BlockSpec((None, s_pad, None, dp), lambda i, b, h: (b, 0, h, 0))
  o_spec = pl.BlockSpec((None, None, None, br, dp),
                        lambda i, b, h: (b, h, split_of(i), tile_of(i), 0))
  lse_spec = pl.BlockSpec((None, None, None, br),
                          lambda i, b, h: (b, h, split_of(i), tile_of(i)))
  extras, extra_specs = [], []
  if alibi is not None:   # packed row r takes head r % G's slope; padding rows 0
    slopes = jnp.tile(jnp.asarray(alibi, jnp.float32).reshape(batch, hkv, group), (1, 1, t))
    extras.append(pad_to(slopes, {2: r_pad}))
    extra_specs.append(pl.BlockSpec((None, None, br), lambda i, b, h: (b, h, tile_of(i))))
  operands = same_varying_axes(q_len, kv_len, *extras, qp, kp, vp)
  o_part, lse_part = pl.pallas_call(
      kernel,
      grid=(row_tiles * splits, batch, hkv),
      in_specs=[length_spec(batch), length_spec(batch), *extra_specs, q_spec, kv_spec, kv_spec],
      out_specs=[o_spec, lse_spec],
      out_shape=[output((batch, hkv, splits, r_pad, dp), jnp.float32, operands[-3]),
                 output((batch, hkv, splits, r_pad), jnp.float32, operands[-3])],
      interpret=cfg.interpret,
      compiler_params=(None if cfg.interpret else
                       compiler_params(cfg.num_warps, cfg.num_stages, br, bk, dp)),
      name="jaxflash_pallas_decode",
  )(*operands)
  o, lse = _merge_splits(o_part[..., :total, :d], lse_part[..., :total])
  # Back to [B, T, Hq, D] and [B, Hq, T].
  o = o.reshape(batch, hkv, t, group, d).transpose(0, 2, 1, 3, 4).reshape(q.shape)
  lse = lse.reshape(batch, hkv, t, group).transpose(0, 1, 3, 2).reshape(batch, hq, t)
  return o.astype(q.dtype), lse


def pallas_forward(q, k, v, q_lengths, kv_lengths, *, scale: float,
                   window_left: int, window_right: int, bottom_right: bool,
                   config: PallasConfig | None = None, num_splits: int | None = None,
                   diagonal_offsets=None, softcap: float = 0.0, alibi=None, segments=None,
                   dense=None):
  """Attention forward with the Pallas kernel.

  Args:
    q: ``[B, T, Hq, D]``; k, v: ``[B, S, Hkv, D]``; one dtype out of float32,
      float16, bfloat16.
    q_lengths, kv_lengths: int32 ``[B]`` (clamped to ``[0, T]``/``[0, S]``).
    scale: multiplier of ``q . k``.
    softcap: ``0`` for none, else the cap ``c > 0`` of every score:
      ``c * tanh(scale * q . k / c)``, before the mask; the softmax and the
      LSE are over the capped scores.
    window_left, window_right: ints, ``-1`` unbounded; causal is
      ``window_right = 0``.
    bottom_right: align the diagonal to the end of the sequences.
    config: optional :class:`PallasConfig`.
    num_splits: split-KV (see :func:`jaxflash.dot_product_attention`):
      ``None`` automatic, an int >= 1 forced. Split calls, and short queries
      (query rows x query heads per K/V head <= 128), run the decode kernel,
      which stacks the query heads of a K/V head into one block of rows.
    diagonal_offsets: optional int32 ``[B]`` added to each batch element's
      diagonal (``None``: 0); places one block of a larger problem (ring
      attention). Such calls run the unsplit kernel (splitting only changes
      speed; the decode kernel has no offsets).
    alibi: optional float32 ``[B, Hq]`` ALiBi slopes (`jaxflash.reference.alibi_bias`);
      such calls run the unsplit kernel too (a decode block mixes heads).
    segments: optional segment tables (`jaxflash.segments.tables`, computed for the same
      lengths, mask and offsets); such calls run the unsplit kernel too.
    dense: optional `jaxflash.dense.Dense` (a dense bias and/or boolean mask, each
      [Bb, Hq or 1, T or 1, S or 1]); such calls run the unsplit kernel too.

  Returns:
    ``(o, lse)``: ``o`` ``[B, T, Hq, D]`` in the input dtype, ``lse`` float32
    ``[B, Hq, T]`` in natural-log units (the lowest finite float32 for rows
    that see nothing).
  """
  check_static_args(q, k, v, scale, window_left, window_right, softcap)
  batch, t, hq, d = q.shape
  _, s, hkv, _ = k.shape
  group = hq // hkv
  if batch * t * hq * s == 0:  # nothing to attend to, or nobody asks
    return (jnp.zeros(q.shape, q.dtype),
            jnp.full((batch, hq, t), EMPTY_LSE, jnp.float32))
  cfg = resolve_config(config, d, q.dtype)
  q_len = clamped_lengths(q_lengths, batch, t)
  kv_len = clamped_lengths(kv_lengths, batch, s)
  offsets = batch_offsets(diagonal_offsets, batch)
  splits = _splits.pallas(_splits.validate(num_splits), q.shape, k.shape,
                          "cpu" if cfg.interpret else "gpu")
  scores = Scores(float(scale), float(softcap))
  if (diagonal_offsets is None and segments is None and dense is None and
      (splits > 1 or t * group <= _splits.DECODE_MAX_ROWS)):
    return _decode_forward(q, k, v, q_len, kv_len, cfg, splits=splits, scores=scores,
                           window_left=window_left, window_right=window_right,
                           bottom_right=bottom_right, alibi=alibi)
  dp = padded_head_dim(d)
  bq, t_pad = block_sizes(t, cfg.block_q)
  bk, s_pad, kp, vp = _padded_kv(k, v, cfg.block_k, dp)
  nq = t_pad // bq
  qp = pad_to(q, {1: t_pad, 3: dp})

  kernel = functools.partial(
      _fwd_kernel, scores=scores, alibi=alibi is not None, segments=segments is not None,
      bias=dense is not None and dense.bias is not None,
      dense_mask=dense is not None and dense.mask is not None, heads=hq, left=int(window_left),
      right=int(window_right), bottom_right=bool(bottom_right), block_q=bq,
      block_k=bk, num_q_blocks=nq)
  extras, extra_specs = extra_operands(alibi, segments, batch, hq, t_pad, s_pad)
  dense_ops, dense_specs = dense_operands(dense, key_major=False, group=group, t_pad=t_pad,
                                          s_pad=s_pad, block_q=bq, block_k=bk)
  extras, extra_specs = extras + dense_ops, extra_specs + dense_specs
  q_spec = pl.BlockSpec((None, bq, None, dp),
                        lambda i, b, h: (b, nq - 1 - i, h, 0))
  kv_spec = pl.BlockSpec((None, s_pad, None, dp),
                         lambda i, b, h: (b, 0, h // group, 0))
  lse_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, nq - 1 - i))
  operands = same_varying_axes(q_len, kv_len, offsets, *extras, qp, kp, vp)
  o, lse = pl.pallas_call(
      kernel,
      grid=(nq, batch, hq),
      in_specs=[length_spec(batch), length_spec(batch), length_spec(batch), *extra_specs,
                q_spec, kv_spec, kv_spec],
      out_specs=[q_spec, lse_spec],
      out_shape=[output((batch, t_pad, hq, dp), q.dtype, operands[-1]),
                 output((batch, hq, t_pad), jnp.float32, operands[-1])],
      interpret=cfg.interpret,
      compiler_params=(None if cfg.interpret else
                       compiler_params(cfg.num_warps, cfg.num_stages, bq, bk, dp)),
      name="jaxflash_pallas_fwd",
  )(*operands)
  if t_pad != t or dp != d:
    o = o[:, :t, :, :d]
  if t_pad != t:
    lse = lse[:, :, :t]
  return o, lse
