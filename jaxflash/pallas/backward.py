"""The Pallas attention backward: the dQ and dK/dV kernels and `pallas_backward`.

dK/dV     grid (kv blocks, B, Hkv). For one K/V block, walks the query heads
          of its group and the query blocks that can see it, recomputing P
          from the LSE; the group sum of dK/dV happens in the fp32 accumulator.
dQ        grid (q blocks, B, Hq). Same walk as the forward, accumulates dS K.

With a soft-cap, dS (w.r.t. the capped score s) becomes dS_u = dS (1 - (s/c)^2),
w.r.t. u = scale * q . k, before it meets K or Q (`Scores.chain`). ALiBi's bias
enters P's exponent only (`Alibi`), as does a dense bias (`DenseTile`, whose mask
hides pairs like the mask rule and whose summary skips tiles it hides whole).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxflash import segments as _segments
from jaxflash.pallas.blocks import (
    Alibi, DenseTile, Mask, Scores, both, dot, exact_where_nan, lse_log2, query_block,
    query_blocks, take_extras, zero_padding)
from jaxflash.pallas.config import (
    EMPTY_LSE, PallasConfig, compiler_params, padded_head_dim, resolve_config)
from jaxflash.pallas.host import (
    output, output_delta, same_varying_axes,
    batch_offsets, block_sizes, check_static_args, clamped_lengths, length_spec, pad_to,
    round_up, extra_operands, dense_operands)

__all__ = ["pallas_backward"]


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


def _dq_kernel(q_len_ref, kv_len_ref, off_ref, *refs, scores: Scores, alibi: bool,
               segments: bool, bias: bool, dense_mask: bool, heads: int, left: int, right: int,
               bottom_right: bool, block_q: int, block_k: int, num_q_blocks: int):
  slope_ref, tables, refs = take_extras(refs, alibi, segments)
  dense, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref) = DenseTile.take(
      refs, bias, dense_mask, False)
  mask, r0, rows, (lo, a, bb, hi) = query_block(
      q_len_ref, kv_len_ref, off_ref, left=left, right=right, bottom_right=bottom_right,
      block_q=block_q, block_k=block_k, num_q_blocks=num_q_blocks, tables=tables)
  slopes = Alibi.of(slope_ref, pl.program_id(1) * heads + pl.program_id(2), mask)
  q_ids = mask.row_ids(r0, block_q)
  q = zero_padding(q_ref[...], rows, mask.q_valid)
  do = zero_padding(do_ref[...], rows, mask.q_valid)
  lse = lse_ref[...]
  lse2 = lse_log2(lse)
  delta = delta_ref[...]
  dp = q.shape[-1]

  def step(masked, kb, dq):
    start = pl.multiple_of(kb * block_k, block_k)
    k = k_ref[pl.ds(start, block_k), :]
    v = v_ref[pl.ds(start, block_k), :]
    s = scores.log2(dot(q, k, 1, 1))
    cols = start + jnp.arange(block_k, dtype=jnp.int32)[None, :]
    p = jnp.exp2(dense.add(slopes.add(s, rows, cols), start, block_k) - lse2[:, None])
    visible = None
    if masked:
      ids = mask.with_keys(q_ids, start, block_k)
      visible = mask.visible(rows, cols, ids)
      k = zero_padding(k, cols.T, mask.kv_valid)
      v = zero_padding(v, cols.T, mask.kv_valid)
    visible = both(visible, dense.shows(start, block_k))
    if visible is not None:
      p = jnp.where(visible, p, 0.0)
    dpv = dot(do, v, 1, 1)
    ds = scores.chain(p * (dpv - delta[:, None]), s, visible)
    return dq + dot(ds.astype(k.dtype), k, 1, 0)

  dq = jnp.zeros((block_q, dp), jnp.float32)
  dq = lax.fori_loop(lo, a, dense.walk(functools.partial(step, True)), dq)
  dq = lax.fori_loop(a, bb, dense.walk(functools.partial(step, False)), dq)
  dq = lax.fori_loop(bb, hi, dense.walk(functools.partial(step, True)), dq)

  # Rows whose LSE or delta is not finite are NaN throughout anyway.
  rows_ok = jnp.isfinite(lse) & jnp.isfinite(delta)

  def exact(xs):
    dq, = xs
    qf, dof = q.astype(jnp.float32), do.astype(jnp.float32)

    def key(j, acc):
      kj = k_ref[pl.ds(j, 1), :].astype(jnp.float32)
      vj = v_ref[pl.ds(j, 1), :].astype(jnp.float32)
      s = scores.log2(jnp.sum(qf * kj, axis=1))
      biased = dense.add(slopes.add(s, rows[:, 0], j)[:, None], j, 1)[:, 0]
      ds = scores.chain(jnp.exp2(biased - lse2) * (jnp.sum(dof * vj, axis=1) - delta), s)
      visible = both(mask.visible(rows, j, mask.with_keys(q_ids, j, 1)), dense.shows(j, 1))
      return acc + jnp.where(visible, ds[:, None] * kj, 0.0)

    acc = lax.fori_loop(lo * block_k, hi * block_k, key, jnp.zeros_like(dq))
    return (jnp.where(rows_ok[:, None], acc, dq),)

  dq, = exact_where_nan((dq,), rows_ok, exact)
  dq_ref[...] = (dq * scores.scale).astype(dq_ref.dtype)


def _dkdv_kernel(q_len_ref, kv_len_ref, off_ref, *refs, scores: Scores, alibi: bool,
                 segments: bool, bias: bool, dense_mask: bool, heads: int, left: int,
                 right: int, bottom_right: bool, block_q: int, block_k: int, group: int):
  slope_ref, tables, refs = take_extras(refs, alibi, segments)
  dense, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref) = DenseTile.take(
      refs, bias, dense_mask, True)
  kj = pl.program_id(0)
  b = pl.program_id(1)
  mask = Mask.make(q_len_ref[b], kv_len_ref[b], off_ref[b], left, right, bottom_right, tables)
  # The bias of query head g of this K/V head's group (the program id read here,
  # outside the loops: the interpreter lowers it only at the top level).
  first_head = b * heads + pl.program_id(2) * group
  bias_of = lambda g: Alibi.of(slope_ref, first_head + g, mask)
  c0 = kj * block_k
  lo, a, bb, hi = query_blocks(mask, c0, block_k, block_q)
  k_ids = mask.key_ids(c0, block_k)

  cols = c0 + jnp.arange(block_k, dtype=jnp.int32)[:, None]  # [bk, 1]
  k = zero_padding(k_ref[...], cols, mask.kv_valid)
  v = zero_padding(v_ref[...], cols, mask.kv_valid)
  dp = k.shape[-1]

  def step(g, masked, qb, carry):
    dk, dv = carry
    start = pl.multiple_of(qb * block_q, block_q)
    q = q_ref[pl.ds(start, block_q), g, :]
    do = do_ref[pl.ds(start, block_q), g, :]
    lse = lse_ref[g, pl.ds(start, block_q)]
    delta = delta_ref[g, pl.ds(start, block_q)]
    lse2 = lse_log2(lse)
    # Transposed tiles [bk, bq], so that no P^T is ever formed.
    st = scores.log2(dot(k, q, 1, 1))
    rows = start + jnp.arange(block_q, dtype=jnp.int32)[None, :]
    pt = jnp.exp2(dense.add(bias_of(g).add(st, rows, cols), start, block_q, g) - lse2[None, :])
    visible = None
    if masked:
      ids = mask.with_rows(k_ids, start, block_q)
      visible = mask.visible(rows, cols, ids)
      q = zero_padding(q, rows.T, mask.q_valid)
      do = zero_padding(do, rows.T, mask.q_valid)
    visible = both(visible, dense.shows(start, block_q, g))
    if visible is not None:
      pt = jnp.where(visible, pt, 0.0)
    dv = dv + dot(pt.astype(do.dtype), do, 1, 0)
    dpt = dot(v, do, 1, 1)
    dst = scores.chain(pt * (dpt - delta[None, :]), st, visible)
    dk = dk + dot(dst.astype(q.dtype), q, 1, 0)
    return dk, dv

  def head(g, carry):
    carry = lax.fori_loop(lo, a, dense.walk(functools.partial(step, g, True), g), carry)
    carry = lax.fori_loop(a, bb, dense.walk(functools.partial(step, g, False), g), carry)
    return lax.fori_loop(bb, hi, dense.walk(functools.partial(step, g, True), g), carry)

  carry = (jnp.zeros((block_k, dp), jnp.float32),
           jnp.zeros((block_k, dp), jnp.float32))
  if group == 1:
    dk, dv = head(0, carry)
  else:
    dk, dv = lax.fori_loop(0, group, head, carry)

  def exact(grads):
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)

    def row(g, i, carry):
      dk, dv = carry
      qi = q_ref[pl.ds(i, 1), g, :].astype(jnp.float32)
      doi = do_ref[pl.ds(i, 1), g, :].astype(jnp.float32)
      lse2 = lse_log2(lse_ref[g, pl.ds(i, 1)])
      st = scores.log2(jnp.sum(kf * qi, axis=1))
      pt = jnp.exp2(dense.add(bias_of(g).add(st, i, cols[:, 0])[:, None], i, 1, g)[:, 0] - lse2)
      dst = scores.chain(pt * (jnp.sum(vf * doi, axis=1) - delta_ref[g, pl.ds(i, 1)]), st)
      ids = mask.with_rows(k_ids, i, 1)
      vis = both(mask.visible(i, cols, ids), dense.shows(i, 1, g))
      return (dk + jnp.where(vis, dst[:, None] * qi, 0.0),
              dv + jnp.where(vis, pt[:, None] * doi, 0.0))

    def head(g, carry):
      return lax.fori_loop(lo * block_q, hi * block_q, functools.partial(row, g), carry)

    return lax.fori_loop(0, group, head, tuple(jnp.zeros_like(x) for x in grads))

  dk, dv = exact_where_nan((dk, dv), jnp.ones((block_k,), jnp.bool_), exact)
  dk_ref[...] = (dk * scores.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------


def pallas_backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, *,
                    scale: float, window_left: int, window_right: int,
                    bottom_right: bool, config: PallasConfig | None = None,
                    diagonal_offsets=None, softcap: float = 0.0, alibi=None, segments=None,
                    dense=None):
  """Attention backward with the Pallas kernels (the dense bias's gradient, where it is
  needed, is a kernel of its own: `pallas_bias_gradient`).

  Args:
    q, k, v, q_lengths, kv_lengths, scale, window_left, window_right,
    bottom_right, config, diagonal_offsets, softcap, alibi, segments, dense: as for
    :func:`pallas_forward`.
    o, lse: the outputs of :func:`pallas_forward` (or of any implementation
      of the same contract).
    do: cotangent of ``o``, ``[B, T, Hq, D]``.
    dlse: cotangent of ``lse``, float32 ``[B, Hq, T]``, or ``None`` for zero.

  Returns:
    ``(dq, dk, dv)`` in the dtypes of ``q``, ``k``, ``v``; the dK/dV of a
    key/value head is summed over its group of query heads.
  """
  check_static_args(q, k, v, scale, window_left, window_right, softcap)
  batch, t, hq, d = q.shape
  _, s, hkv, _ = k.shape
  group = hq // hkv
  if batch * t * hq * s == 0:
    return (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype),
            jnp.zeros(v.shape, v.dtype))
  cfg = resolve_config(config, d, q.dtype)
  dp = padded_head_dim(d)
  q_len = clamped_lengths(q_lengths, batch, t)
  kv_len = clamped_lengths(kv_lengths, batch, s)
  offsets = batch_offsets(diagonal_offsets, batch)

  # delta, 0 on rows that see no key, whose dO (padding, say) must not reach any key.
  delta = output_delta(o, do, dlse)
  mask = Mask.make(q_len[:, None], kv_len[:, None], offsets[:, None], int(window_left),
                   int(window_right), bool(bottom_right))
  if segments is None:
    has_keys = mask.has_keys(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t)))
  else:   # the rows' own intervals: rows past the lengths see [kv_len, 0)
    has_keys = segments[0][..., _segments.BEGIN] < segments[0][..., _segments.END]
  delta = jnp.where(has_keys[:, None, :], delta, 0.0)
  lse = lse.astype(jnp.float32)
  if dense is not None and dense.mask is not None:   # rows it leaves without keys, too
    delta = jnp.where(lse == EMPTY_LSE, 0.0, delta)

  common = dict(scores=Scores(float(scale), float(softcap)), alibi=alibi is not None,
                segments=segments is not None, bias=dense is not None and dense.bias is not None,
                dense_mask=dense is not None and dense.mask is not None, heads=hq,
                left=int(window_left),
                right=int(window_right), bottom_right=bool(bottom_right))
  def params(tile_m, tile_n):
    if cfg.interpret:
      return None
    return compiler_params(cfg.num_warps_bwd, cfg.num_stages_bwd, tile_m, tile_n, dp)

  bq_dq, _ = block_sizes(t, cfg.block_q_dq)
  bk_dq, _ = block_sizes(s, cfg.block_k_dq)
  bq_dkv, _ = block_sizes(t, cfg.block_q_dkv)
  bk_dkv, _ = block_sizes(s, cfg.block_k_dkv)
  # Blocks are powers of two, so padding to the larger serves both kernels.
  t_all = round_up(t, max(bq_dq, bq_dkv))
  s_all = round_up(s, max(bk_dq, bk_dkv))

  qp = pad_to(q, {1: t_all, 3: dp})
  dop = pad_to(do, {1: t_all, 3: dp})
  kp = pad_to(k, {1: s_all, 3: dp})
  vp = pad_to(v, {1: s_all, 3: dp})
  lsep = pad_to(lse, {2: t_all}, value=EMPTY_LSE)
  deltap = pad_to(delta, {2: t_all})

  nq = t_all // bq_dq
  q_spec = pl.BlockSpec((None, bq_dq, None, dp),
                        lambda i, b, h: (b, nq - 1 - i, h, 0))
  kv_spec = pl.BlockSpec((None, s_all, None, dp),
                         lambda i, b, h: (b, 0, h // group, 0))
  row_spec = pl.BlockSpec((None, None, bq_dq),
                          lambda i, b, h: (b, h, nq - 1 - i))
  extras, extra_specs = extra_operands(alibi, segments, batch, hq, t_all, s_all)
  dense_ops, dense_specs = dense_operands(dense, key_major=False, group=group, t_pad=t_all,
                                          s_pad=s_all, block_q=bq_dq, block_k=bk_dq)
  operands = same_varying_axes(q_len, kv_len, offsets, *extras, *dense_ops, qp, kp, vp, dop,
                               lsep, deltap)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_q=bq_dq, block_k=bk_dq,
                        num_q_blocks=nq,
                        **common),
      grid=(nq, batch, hq),
      in_specs=[length_spec(batch), length_spec(batch), length_spec(batch), *extra_specs,
                *dense_specs, q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
      out_specs=q_spec,
      out_shape=output((batch, t_all, hq, dp), q.dtype, operands[-1]),
      interpret=cfg.interpret,
      compiler_params=params(bq_dq, bk_dq),
      name="jaxflash_pallas_bwd_dq",
  )(*operands)

  nk = s_all // bk_dkv
  qg_spec = pl.BlockSpec((None, t_all, group, dp),
                         lambda j, b, h: (b, 0, h, 0))
  rowg_spec = pl.BlockSpec((None, group, t_all), lambda j, b, h: (b, h, 0))
  kblk_spec = pl.BlockSpec((None, bk_dkv, None, dp),
                           lambda j, b, h: (b, j, h, 0))
  dense_ops, dense_specs = dense_operands(dense, key_major=True, group=group, t_pad=t_all,
                                          s_pad=s_all, block_q=bq_dkv, block_k=bk_dkv)
  operands = same_varying_axes(q_len, kv_len, offsets, *extras, *dense_ops, qp, kp, vp, dop,
                               lsep, deltap)
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, block_q=bq_dkv, block_k=bk_dkv,
                        group=group,
                        **common),
      grid=(nk, batch, hkv),
      in_specs=[length_spec(batch), length_spec(batch), length_spec(batch), *extra_specs,
                *dense_specs, qg_spec, kblk_spec, kblk_spec, qg_spec, rowg_spec, rowg_spec],
      out_specs=[kblk_spec, kblk_spec],
      out_shape=[output((batch, s_all, hkv, dp), k.dtype, operands[-1]),
                 output((batch, s_all, hkv, dp), v.dtype, operands[-1])],
      interpret=cfg.interpret,
      compiler_params=params(bk_dkv, bq_dkv),
      name="jaxflash_pallas_bwd_dkdv",
  )(*operands)

  if t_all != t or dp != d:
    dq = dq[:, :t, :, :d]
  if s_all != s or dp != d:
    dk = dk[:, :s, :, :d]
    dv = dv[:, :s, :, :d]
  return dq, dk, dv
