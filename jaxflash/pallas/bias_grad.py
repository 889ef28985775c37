"""The dense bias's gradient as a Pallas kernel: `pallas_bias_gradient`.

dB is the score gradient dS = P (dP - delta) of every pair, summed over the
bias's broadcast axes (`jaxflash.derivatives.bias_gradient` is the definition;
a dense bias enters after a soft-cap, so no cap slope). One program owns one
block of query rows of one (batch, head) of the bias [Bb, Nb, Tb, Sb] and walks
every key block; for each it sums the tiles of the (batch, query head) items
the bias broadcasts over (all B where Bb = 1, all Hq where Nb = 1), then
writes that block of dB once: deterministic, no atomics, and nothing
materialised beyond dB. A bias broadcast over rows (Tb = 1) gets per-program
row sums that the wrapper adds up; over keys (Sb = 1), column sums.

dB is element-wise in the pairs (each pair's dS involves only its own row and
key), so a hidden pair is an exact zero whatever its inputs: no tile product
carries a non-finite value from one pair to another, and no pair-by-pair
recomputation is needed. Tiles that no item can see (outside the mask rule's
key-block range, or hidden whole by the dense mask's tile summary) are not
computed.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxflash.pallas.blocks import (
    Alibi, DenseTile, Mask, Scores, both, dot, key_blocks, lse_log2, take_extras)
from jaxflash.pallas.config import EMPTY_LSE, compiler_params, padded_head_dim, resolve_config
from jaxflash.pallas.host import (
    batch_offsets, block_sizes, check_static_args, clamped_lengths, extra_operands, output,
    pad_to, same_varying_axes, tile_summary)

__all__ = ["pallas_bias_gradient"]


class _At:
  """A view of a ref with its leading indices fixed: `_At(ref, b)[i...]` reads
  `ref[b, i...]` (one batch element's segment table), and `rows` = (start, n) makes
  the next axis a window of n positions from start (a [rows, keys] block of one
  (batch, head) of a dense operand, which DenseTile reads as its query-major refs)."""

  def __init__(self, ref, *lead, rows=None):
    self.ref, self.lead, self.rows = ref, lead, rows
    self.shape = ref.shape[len(lead):] if rows is None else (
        (rows[1],) + tuple(ref.shape[len(lead) + 1:]))

  def __getitem__(self, idx):
    idx = (slice(None),) * len(self.shape) if idx is Ellipsis else (
        idx if isinstance(idx, tuple) else (idx,))
    if self.rows is not None:
      start, n = self.rows
      first = idx[0]
      idx = (pl.ds(start, n) if isinstance(first, slice) else start + first,) + idx[1:]
    return self.ref[self.lead + idx]


def _dense_view(ref, b, h, r0, n):
  """`ref` [Bx, Nx, R, C] at batch b and head h (0 on its broadcast axes), rows
  [r0, r0 + n) (the one row where R = 1), for DenseTile."""
  Bx, Nx, R, _ = ref.shape
  return _At(ref, b if Bx > 1 else 0, h if Nx > 1 else 0,
             rows=(r0, n) if R > 1 else (0, 1))


def _kernel(q_len_ref, kv_len_ref, off_ref, *refs, scores: Scores, alibi: bool,
            segments: bool, dense_mask: bool, shape, left: int, right: int,
            bottom_right: bool, block_q: int, block_k: int, num_k_blocks: int):
  B, Hq, group, Bb, Nb, Tb, Sb = shape
  slope_ref, tables, refs = take_extras(refs, alibi, segments)
  (mask_ref, summary_ref), refs = (refs[:2], refs[2:]) if dense_mask else ((None, None), refs)
  bias_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, db_ref = refs

  qi, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  r0 = qi * block_q
  rows = r0 + jnp.arange(block_q, dtype=jnp.int32)[:, None]
  n_batch, n_head = (1 if Bb > 1 else B), (1 if Nb > 1 else Hq)
  bias = _dense_view(bias_ref, b, h, r0, block_q)

  def item(index):
    """The mask, operands and key-block range of item `index` (batch, query head)."""
    bg = b if Bb > 1 else lax.div(index, jnp.int32(n_head))   # (lax: indices are >= 0, and
    hg = h if Nb > 1 else lax.rem(index, jnp.int32(n_head))   # jnp's // and % do not lower)
    mask = Mask.make(q_len_ref[bg], kv_len_ref[bg], off_ref[bg], left, right, bottom_right,
                     tuple(None if t is None else _At(t, bg) for t in tables))
    dense = DenseTile(bias)
    if mask_ref is not None:   # the mask's rows of this block, its summary's row of tiles
      dense = DenseTile(bias, _dense_view(mask_ref, bg, hg, r0, block_q),
                        _dense_view(summary_ref, bg, hg, qi, 1))
    lo, _, _, hi = key_blocks(mask, r0, block_q, block_k)
    return dict(bg=bg, kv=lax.div(hg, jnp.int32(group)), mask=mask, dense=dense, lo=lo, hi=hi,
                slopes=Alibi.of(slope_ref, bg * Hq + hg, mask),
                q=q_ref[bg, pl.ds(r0, block_q), hg, :], do=do_ref[bg, pl.ds(r0, block_q), hg, :],
                lse2=lse_log2(lse_ref[bg, hg, pl.ds(r0, block_q)]),
                delta=delta_ref[bg, hg, pl.ds(r0, block_q)],
                q_ids=mask.row_ids(r0, block_q))

  def tile(it, kb):
    """dS of item `it` on key block kb (zeros where it sees none of the tile)."""
    c0 = pl.multiple_of(kb * block_k, block_k)
    cols = c0 + jnp.arange(block_k, dtype=jnp.int32)[None, :]
    mask, dense = it["mask"], it["dense"]

    def compute():
      k = k_ref[it["bg"], pl.ds(c0, block_k), it["kv"], :]
      v = v_ref[it["bg"], pl.ds(c0, block_k), it["kv"], :]
      s = it["slopes"].add(scores.log2(dot(it["q"], k, 1, 1)), rows, cols)
      p = jnp.exp2(dense.add(s, c0, block_k) - it["lse2"][:, None])
      visible = both(mask.visible(rows, cols, mask.with_keys(it["q_ids"], c0, block_k)),
                     dense.shows(c0, block_k))
      ds = p * (dot(it["do"], v, 1, 1) - it["delta"][:, None])
      return jnp.where(visible, ds, 0.0)

    seen = (kb >= it["lo"]) & (kb < it["hi"])
    if dense.summary is not None:
      seen &= jnp.logical_not(dense.hidden(kb))
    return lax.cond(seen, compute, lambda: jnp.zeros((block_q, block_k), jnp.float32))

  n_items = n_batch * n_head
  single = item(0) if n_items == 1 else None

  def key_block(kb, total):
    if single is not None:
      ds = tile(single, kb)
    else:
      ds = lax.fori_loop(0, n_items, lambda i, acc: acc + tile(item(i), kb),
                         jnp.zeros((block_q, block_k), jnp.float32))
    if Tb == 1:   # this program's row sum; the wrapper adds the programs' sums
      ds = jnp.sum(ds, axis=0, keepdims=True)
    if Sb == 1:
      return total + jnp.sum(ds, axis=1, keepdims=True)
    out_rows = pl.ds(r0, block_q) if Tb > 1 else pl.ds(qi, 1)
    db_ref[b, h, out_rows, pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)] = (
        ds.astype(db_ref.dtype))
    return total

  total = lax.fori_loop(0, num_k_blocks, key_block,
                        jnp.zeros((block_q if Tb > 1 else 1, 1), jnp.float32))
  if Sb == 1:
    db_ref[b, h, pl.ds(r0, block_q) if Tb > 1 else pl.ds(qi, 1), :] = total.astype(db_ref.dtype)


# The kernel's (rows, keys, warps) per padded head dim where no config names them (its
# dQ kernel's blocks and warps then): the fastest of the tiles timed on an H200
# (2026-11-29, bf16, B 2, S 4k, 16 heads, bias [1, 16, T, S]; performance-log.md,
# "Pallas's bias gradient"): D 64 1.01 ms (128 x 128: 1.24), D 128 1.45 ms (the dQ
# kernel's 128 x 32: 1.95), D 256 2.74 ms (64 x 64: 3.75).
_TILES = {64: (128, 64, 4), 128: (128, 128, 8), 256: (128, 64, 8)}


def pallas_bias_gradient(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, *, dense,
                         scale: float, window_left: int, window_right: int, bottom_right: bool,
                         softcap: float = 0.0, diagonal_offsets=None, alibi=None,
                         segments=None, config=None):
  """The gradient of `dense.bias` [Bb, Nb, Tb, Sb] (jaxflash/dense.py), in its dtype.

  Arguments as for :func:`pallas_backward` (o, lse the forward's outputs, do and dlse
  their cotangents); `dense.mask`, when given, hides pairs as it did in the forward.
  A `config` sets the kernel's tile by its dQ fields (`block_q_dq`, `block_k_dq`,
  `num_warps_bwd`).
  """
  check_static_args(q, k, v, scale, window_left, window_right, softcap)
  batch, t, hq, d = q.shape
  _, s, hkv, _ = k.shape
  bias = dense.bias
  Bb, Nb, Tb, Sb = bias.shape
  if batch * t * hq * s == 0:
    return jnp.zeros(bias.shape, bias.dtype)
  cfg = resolve_config(config, d, q.dtype)
  dp = padded_head_dim(d)
  tile = (cfg.block_q_dq, cfg.block_k_dq, cfg.num_warps_bwd)
  if config is None and not cfg.interpret:
    tile = _TILES[min(t for t in _TILES if t >= dp)]
  bq, t_all = block_sizes(t, tile[0])
  bk, s_all = block_sizes(s, tile[1])
  nq = t_all // bq
  q_len = clamped_lengths(q_lengths, batch, t)
  kv_len = clamped_lengths(kv_lengths, batch, s)
  offsets = batch_offsets(diagonal_offsets, batch)

  # delta_i = rowsum(dO * O)_i - dlse_i; rows that see no key carry no gradient.
  lse = lse.astype(jnp.float32)
  delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
  if dlse is not None:
    delta = delta - dlse.astype(jnp.float32)
  delta = jnp.where(lse == EMPTY_LSE, 0.0, delta)

  extras, _ = extra_operands(alibi, segments, batch, hq, t_all, s_all)
  pad_dense = lambda x: pad_to(x, {**({2: t_all} if x.shape[2] > 1 else {}),
                                   **({3: s_all} if x.shape[3] > 1 else {})})
  masks = []
  if dense.mask is not None:
    m = pad_dense(dense.mask.astype(jnp.int8))
    masks = [m, tile_summary(m, bq if m.shape[2] > 1 else 1, bk if m.shape[3] > 1 else 1)]
  operands = [*extras, *masks, pad_dense(bias),
              pad_to(q, {1: t_all, 3: dp}), pad_to(k, {1: s_all, 3: dp}),
              pad_to(v, {1: s_all, 3: dp}), pad_to(do, {1: t_all, 3: dp}),
              pad_to(lse, {2: t_all}, value=EMPTY_LSE), pad_to(delta, {2: t_all})]
  operands = same_varying_axes(q_len, kv_len, offsets, *operands)
  whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
  partial = Tb == 1 and nq > 1   # row sums per program, added below
  out_shape = (Bb, Nb, t_all if Tb > 1 else nq, s_all if Sb > 1 else 1)
  out_dtype = jnp.float32 if partial else bias.dtype
  db = pl.pallas_call(
      functools.partial(
          _kernel, scores=Scores(float(scale), float(softcap)), alibi=alibi is not None,
          segments=segments is not None, dense_mask=dense.mask is not None,
          shape=(batch, hq, hq // hkv, Bb, Nb, Tb, Sb), left=int(window_left),
          right=int(window_right), bottom_right=bool(bottom_right), block_q=bq, block_k=bk,
          num_k_blocks=s_all // bk),
      grid=(nq, Bb, Nb),
      in_specs=[whole(x) for x in operands],
      out_specs=pl.BlockSpec(out_shape, lambda *_: (0,) * 4),
      out_shape=output(out_shape, out_dtype, operands[-1]),
      interpret=cfg.interpret,
      compiler_params=None if cfg.interpret else compiler_params(
          tile[2], cfg.num_stages_bwd, bq, bk),
      name="jaxflash_pallas_bias_grad",
  )(*operands)
  if partial:
    db = jnp.sum(db, axis=2, keepdims=True)
  return db[:, :, :Tb, :Sb].astype(bias.dtype)
