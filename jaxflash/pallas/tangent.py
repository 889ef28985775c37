"""The forward-mode tangent of attention as a Pallas kernel.

Given the outputs (O, LSE) of a forward call and tangents (tQ, tK, tV), one
pass over the keys a block of query rows sees gives (tO, tLSE), with no
rescaling since the LSE is known (natural log, scale c, visible keys j):

    P = exp(c Q Kᵀ - LSE),  tS = c (tQ Kᵀ + Q tKᵀ),
    tLSE = Σ_j P tS,        tO = Σ_j P ((tS - tLSE) V_j + tV_j).

With a soft-cap C the scores are S = C tanh(c Q Kᵀ / C) and P = exp(S - LSE),
and tS gains the factor dS/du = 1 - (S / C)² (`Scores.chain`); ALiBi's constant
bias enters P only (`Alibi`).

tLSE is only known at the end of the walk, and the uncentred form
Σ P tS V - tLSE O cancels: where one key dominates a row, both terms are
about tLSE V while tO is small, and rounding P tS (or O) to 16 bits for the
tensor-core product costs |tLSE V| / 512, many ulps of tO. So the walk
centres on a running estimate m, the P-weighted mean of tS over the keys
seen so far, and accumulates Σ P (tS - m) V, re-centring the sum when m
moves by subtracting Δm Σ P V (a sixth product, float32). At the end m is
tLSE / Σ P, Σ P = 1 up to rounding, and tO = acc - (tLSE - m) Σ P V with a
vanishing correction: the rounding error is that of P (tS - tLSE), as in
jax.nn's own tangent.

The grid, the walk over key blocks (masked head, unmasked interior, masked
tail), the masks, the diagonal offsets and the padding are the forward
kernel's (forward.py). The non-finite rules are too: padding rows and keys
are zeroed where a masked tile loads them, P and tS are zeroed on masked
pairs, and a block whose result shows a NaN (a masked pair's 0 * NaN in a
tile product) is recomputed pair by pair over the visible pairs only. Rows
that see no key give tO = 0 and tLSE = 0. The jnp scan of the same formulas
is jaxflash.derivatives.tangent, which implementations without a tangent
kernel use.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxflash.pallas.blocks import (
    Alibi, Scores, dot, exact_where_nan, lse_log2, query_block, take_extras, zero_padding)
from jaxflash.pallas.config import (
    EMPTY_LSE, PallasConfig, compiler_params, fit_smem, padded_head_dim, resolve_config)
from jaxflash.pallas.host import (
    output, same_varying_axes,
    batch_offsets, block_sizes, check_static_args, clamped_lengths, length_spec, pad_to,
    extra_operands)

__all__ = ["pallas_tangent"]


def _tangent_kernel(q_len_ref, kv_len_ref, off_ref, *refs, scores: Scores, alibi: bool,
                    segments: bool, heads: int, left: int, right: int, bottom_right: bool,
                    block_q: int, block_k: int, num_q_blocks: int):
  slope_ref, tables, (q_ref, k_ref, v_ref, lse_ref, tq_ref, tk_ref, tv_ref, to_ref,
                      tlse_ref) = take_extras(refs, alibi, segments)
  mask, r0, rows, (lo, a, bb, hi) = query_block(
      q_len_ref, kv_len_ref, off_ref, left=left, right=right, bottom_right=bottom_right,
      block_q=block_q, block_k=block_k, num_q_blocks=num_q_blocks, tables=tables)
  bias = Alibi.of(slope_ref, pl.program_id(1) * heads + pl.program_id(2), mask)
  q_ids = mask.row_ids(r0, block_q)
  q = zero_padding(q_ref[...], rows, mask.q_valid)
  tq = zero_padding(tq_ref[...], rows, mask.q_valid)
  lse = lse_ref[...]
  lse2 = lse_log2(lse)
  dp = q.shape[-1]

  def step(masked, kb, carry):
    acc, o_sum, t_lse, p_sum, centre = carry
    start = pl.multiple_of(kb * block_k, block_k)
    k, v = k_ref[pl.ds(start, block_k), :], v_ref[pl.ds(start, block_k), :]
    tk, tv = tk_ref[pl.ds(start, block_k), :], tv_ref[pl.ds(start, block_k), :]
    s = scores.log2(dot(q, k, 1, 1))
    cols = start + jnp.arange(block_k, dtype=jnp.int32)[None, :]
    p = jnp.exp2(bias.add(s, rows, cols) - lse2[:, None])
    # A masked pair's factor may be NaN (padding): the mask below selects it away.
    ts = scores.chain((dot(tq, k, 1, 1) + dot(q, tk, 1, 1)) * scores.scale, s)
    if masked:
      v, tv = (zero_padding(x, cols.T, mask.kv_valid) for x in (v, tv))
      ids = mask.with_keys(q_ids, start, block_k)
      visible = mask.visible(rows, cols, ids)
      p = jnp.where(visible, p, 0.0)
      ts = jnp.where(visible, ts, 0.0)
    t_lse = t_lse + jnp.sum(p * ts, axis=1)
    p_sum = p_sum + jnp.sum(p, axis=1)
    moved = jnp.where(p_sum > 0, t_lse / jnp.where(p_sum > 0, p_sum, 1.0), centre)
    acc = acc - (moved - centre)[:, None] * o_sum
    p_half = p.astype(v.dtype)
    acc = (acc + dot((p * (ts - moved[:, None])).astype(v.dtype), v, 1, 0)
           + dot(p_half, tv, 1, 0))
    return acc, o_sum + dot(p_half, v, 1, 0), t_lse, p_sum, moved

  rows_zero = jnp.zeros((block_q,), jnp.float32)
  carry = (jnp.zeros((block_q, dp), jnp.float32), jnp.zeros((block_q, dp), jnp.float32),
           rows_zero, rows_zero, rows_zero)
  carry = lax.fori_loop(lo, a, functools.partial(step, True), carry)
  carry = lax.fori_loop(a, bb, functools.partial(step, False), carry)
  carry = lax.fori_loop(bb, hi, functools.partial(step, True), carry)

  def exact(xs):
    # Key by key over the visible pairs only, in float32 and uncentred (centre
    # 0): a masked pair is selected away, never multiplied by a zero weight.
    qf, tqf = q.astype(jnp.float32), tq.astype(jnp.float32)

    def key(j, sums):
      acc, o_sum, t_lse = sums
      kj, vj, tkj, tvj = (r[pl.ds(j, 1), :].astype(jnp.float32)
                          for r in (k_ref, v_ref, tk_ref, tv_ref))
      s = scores.log2(jnp.sum(qf * kj, axis=1))
      p = jnp.exp2(bias.add(s, rows[:, 0], j) - lse2)
      tu = (jnp.sum(tqf * kj, axis=1) + jnp.sum(qf * tkj, axis=1)) * scores.scale
      ts = scores.chain(tu, s)
      visible = mask.visible(rows, j, mask.with_keys(q_ids, j, 1))
      return (acc + jnp.where(visible, (p * ts)[:, None] * vj + p[:, None] * tvj, 0.0),
              o_sum + jnp.where(visible, p[:, None] * vj, 0.0),
              t_lse + jnp.where(visible[:, 0], p * ts, 0.0))

    zero = jnp.zeros_like(xs[0])
    new = lax.fori_loop(lo * block_k, hi * block_k, key, (zero, zero, jnp.zeros_like(xs[2])))
    ok = jnp.isfinite(lse)
    pick = lambda n, x: jnp.where(ok if x.ndim == 1 else ok[:, None], n, x)
    return (pick(new[0], xs[0]), pick(new[1], xs[1]), pick(new[2], xs[2]), xs[3],
            jnp.where(ok, 0.0, xs[4]))

  # Rows whose LSE is not finite are NaN throughout anyway.
  acc, o_sum, t_lse, _, centre = exact_where_nan(carry, jnp.isfinite(lse), exact)
  # Emptiness is structural, as in the forward: such rows output zeros.
  has_keys = mask.has_keys(rows[:, 0], r0)
  t_o = acc - (t_lse - centre)[:, None] * o_sum
  to_ref[...] = jnp.where(has_keys[:, None], t_o, 0.0).astype(to_ref.dtype)
  tlse_ref[...] = jnp.where(has_keys, t_lse, 0.0)


def pallas_tangent(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, *, scale: float,
                   window_left: int, window_right: int, bottom_right: bool,
                   config: PallasConfig | None = None, diagonal_offsets=None,
                   softcap: float = 0.0, alibi=None, segments=None):
  """(tO, tLSE) of the call whose outputs are (o, lse), for tangents (tq, tk, tv).

  Arguments as for `pallas_forward`, plus its outputs `o` (``[B, T, Hq, D]``)
  and `lse` (float32 ``[B, Hq, T]``) and tangents shaped like q, k, v. Returns
  tO in o's dtype and tLSE in float32; both are 0 on rows that see no key.
  Only o's shape and dtype are read: the kernel sums P V in float32 itself,
  since o rounded to 16 bits times tLSE would cost ulps of tO.
  Block sizes and warps are the forward's (``block_q``, ``block_k``,
  ``num_warps``, ``num_stages``), shrunk on the GPU until the twice as many
  tiles fit in shared memory.
  """
  check_static_args(q, k, v, scale, window_left, window_right, softcap)
  batch, t, hq, d = q.shape
  _, s, hkv, _ = k.shape
  group = hq // hkv
  if batch * t * hq * s == 0:
    return jnp.zeros(o.shape, o.dtype), jnp.zeros(lse.shape, jnp.float32)
  cfg = resolve_config(config, d, q.dtype)
  dp = padded_head_dim(d)
  block_q, block_k, stages = cfg.block_q, cfg.block_k, cfg.num_stages
  if not cfg.interpret:
    # Q and tQ stay for the program; K, V, tK, tV stream: twice the forward's tiles.
    block_q, block_k, stages = fit_smem(jnp.dtype(q.dtype).itemsize, dp, block_q, block_k,
                                        stages or 1, resident=2, streamed=4)
  bq, t_pad = block_sizes(t, block_q)
  bk, s_pad = block_sizes(s, block_k)
  nq = t_pad // bq
  pad_rows = lambda x: pad_to(x.astype(q.dtype), {1: t_pad, 3: dp})
  pad_keys = lambda x: pad_to(x.astype(k.dtype), {1: s_pad, 3: dp})

  kernel = functools.partial(
      _tangent_kernel, scores=Scores(float(scale), float(softcap)), alibi=alibi is not None,
      segments=segments is not None, heads=hq, left=int(window_left), right=int(window_right),
      bottom_right=bool(bottom_right), block_q=bq, block_k=bk, num_q_blocks=nq)
  q_spec = pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, nq - 1 - i, h, 0))
  kv_spec = pl.BlockSpec((None, s_pad, None, dp), lambda i, b, h: (b, 0, h // group, 0))
  lse_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, nq - 1 - i))
  extras, extra_specs = extra_operands(alibi, segments, batch, hq, t_pad, s_pad)
  operands = same_varying_axes(
      clamped_lengths(q_lengths, batch, t), clamped_lengths(kv_lengths, batch, s),
      batch_offsets(diagonal_offsets, batch), *extras, pad_rows(q), pad_keys(k),
      pad_keys(v),
      pad_to(lse.astype(jnp.float32), {2: t_pad}, value=EMPTY_LSE),
      pad_rows(tq), pad_keys(tk), pad_keys(tv))
  t_o, t_lse = pl.pallas_call(
      kernel,
      grid=(nq, batch, hq),
      in_specs=[length_spec(batch), length_spec(batch), length_spec(batch), *extra_specs,
                q_spec, kv_spec, kv_spec, lse_spec, q_spec, kv_spec, kv_spec],
      out_specs=[q_spec, lse_spec],
      out_shape=[output((batch, t_pad, hq, dp), o.dtype, operands[-1]),
                 output((batch, hq, t_pad), jnp.float32, operands[-1])],
      interpret=cfg.interpret,
      compiler_params=(None if cfg.interpret else
                       compiler_params(cfg.num_warps, stages, bq, bk, dp)),
      name="jaxflash_pallas_tangent",
  )(*operands)
  return t_o[:, :t, :, :d], t_lse[:, :, :t]
