"""The dense bias's gradient as a Pallas kernel: `pallas_bias_gradient`.

dB is the score gradient dS = P (dP - delta) of every pair, summed over the
bias's broadcast axes (`jaxflash.derivatives.bias_gradient` is the definition;
a dense bias enters after a soft-cap, so no cap slope). One program owns one
block of query rows of one (batch, head) of the bias [Bb, Nb, Tb, Sb] and walks
every key block; for each it sums the tiles of the (batch, query head) items
the bias broadcasts over (all B where Bb = 1, all Hq where Nb = 1), then
writes that block of dB once: deterministic, no atomics, and nothing
materialised beyond dB. A bias broadcast over rows (Tb = 1) gets each
program's tiles summed over its rows, which the wrapper then sums over the
programs. A bias of one key (Sb = 1) has its gradient in closed form
(`jaxflash.dense.gradient_over_keys`): no kernel.

dB is element-wise in the pairs (each pair's dS involves only its own row and
key), so a hidden pair is an exact zero whatever its inputs: no tile product
carries a non-finite value from one pair to another, and no pair-by-pair
recomputation is needed. Tiles that no item can see (outside the mask rule's
key-block range, or hidden whole by the dense mask's tile summary) are not
computed.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxflash import dense as _dense
from jaxflash.pallas.blocks import (
    Alibi, DenseTile, Mask, Scores, both, dot, key_blocks, lse_log2, take_extras)
from jaxflash.pallas.config import (
    EMPTY_LSE, PallasConfig, compiler_params, large_shared_memory, padded_head_dim,
    resolve_config)
from jaxflash.pallas.host import (
    batch_offsets, block_sizes, check_static_args, clamped_lengths, dense_operands,
    extra_operands, output, output_delta, pad_to, same_varying_axes)

__all__ = ["pallas_bias_gradient"]


class _At:
  """A view of a ref with its leading indices fixed: `_At(ref, b)[i...]` reads
  `ref[b, i...]` (one batch element's segment table), and `window` = (start, n) makes
  the next axis a window of n positions from start (a [rows, keys] block of one
  (batch, head) of a dense operand, which DenseTile reads as its query-major refs).
  The Triton lowering takes one indexer per ref access, so `ref.at[b, h]` cannot
  stand in for it."""

  def __init__(self, ref, *lead, window=None):
    self.ref, self.lead, self.window = ref, lead, window
    self.shape = ref.shape[len(lead):] if window is None else (
        (window[1],) + tuple(ref.shape[len(lead) + 1:]))

  def __getitem__(self, idx):
    idx = (slice(None),) * len(self.shape) if idx is Ellipsis else (
        idx if isinstance(idx, tuple) else (idx,))
    if self.window is not None:
      start, n = self.window
      first = idx[0]
      idx = (pl.ds(start, n) if isinstance(first, slice) else start + first,) + idx[1:]
    return self.ref[self.lead + idx]


def _dense_view(ref, b, h, r0, n):
  """`ref` [Bx, Nx, R, C] at batch b and head h (0 on its broadcast axes), rows
  [r0, r0 + n) (the one row where R = 1), for DenseTile."""
  Bx, Nx, R, _ = ref.shape
  return _At(ref, b if Bx > 1 else 0, h if Nx > 1 else 0,
             window=(r0, n) if R > 1 else (0, 1))


class _Item(NamedTuple):
  """One (batch, query head) item of a program: what its tiles need."""
  batch: jax.Array
  kv_head: jax.Array
  mask: Mask
  dense: DenseTile
  lo: jax.Array        # the key blocks its rows see: [lo, hi)
  hi: jax.Array
  slopes: Alibi
  q: jax.Array         # its rows of q and dO, [block_q, dp]
  do: jax.Array
  lse2: jax.Array      # [block_q]
  delta: jax.Array
  q_ids: jax.Array | None


def _kernel(q_len_ref, kv_len_ref, off_ref, *refs, scores: Scores, alibi: bool,
            segments: bool, dense_mask: bool, batch: int, heads: int, group: int,
            bias_shape, left: int, right: int, bottom_right: bool, block_q: int,
            block_k: int, num_k_blocks: int):
  Bb, Nb, Tb, _ = bias_shape
  slope_ref, tables, refs = take_extras(refs, alibi, segments)
  bias_ref, refs = refs[0], refs[1:]
  (mask_ref, summary_ref), refs = (refs[:2], refs[2:]) if dense_mask else ((None, None), refs)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, db_ref = refs

  qi, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  r0 = qi * block_q
  rows = r0 + jnp.arange(block_q, dtype=jnp.int32)[:, None]
  n_batch, n_head = (1 if Bb > 1 else batch), (1 if Nb > 1 else heads)
  bias = _dense_view(bias_ref, b, h, r0, block_q)

  def item(index) -> _Item:
    # lax, not jnp: the indices are >= 0, and jnp's // and % do not lower to Triton.
    bg = b if Bb > 1 else lax.div(index, jnp.int32(n_head))
    hg = h if Nb > 1 else lax.rem(index, jnp.int32(n_head))
    mask = Mask.make(q_len_ref[bg], kv_len_ref[bg], off_ref[bg], left, right, bottom_right,
                     tuple(None if t is None else _At(t, bg) for t in tables))
    dense = DenseTile(bias)
    if mask_ref is not None:   # the mask's rows of this block, its summary's row of tiles
      dense = DenseTile(bias, _dense_view(mask_ref, bg, hg, r0, block_q),
                        _dense_view(summary_ref, bg, hg, qi, 1))
    lo, _, _, hi = key_blocks(mask, r0, block_q, block_k)
    return _Item(bg, lax.div(hg, jnp.int32(group)), mask, dense, lo, hi,
                 Alibi.of(slope_ref, bg * heads + hg, mask),
                 q_ref[bg, pl.ds(r0, block_q), hg, :], do_ref[bg, pl.ds(r0, block_q), hg, :],
                 lse_log2(lse_ref[bg, hg, pl.ds(r0, block_q)]),
                 delta_ref[bg, hg, pl.ds(r0, block_q)], mask.row_ids(r0, block_q))

  def score_grads(it: _Item, kb):
    """dS of item `it` on key block kb (zeros where it sees none of the tile)."""
    c0 = pl.multiple_of(kb * block_k, block_k)
    cols = c0 + jnp.arange(block_k, dtype=jnp.int32)[None, :]

    def compute():
      k = k_ref[it.batch, pl.ds(c0, block_k), it.kv_head, :]
      v = v_ref[it.batch, pl.ds(c0, block_k), it.kv_head, :]
      s = it.slopes.add(scores.log2(dot(it.q, k, 1, 1)), rows, cols)
      p = jnp.exp2(it.dense.add(s, c0, block_k) - it.lse2[:, None])
      visible = both(it.mask.visible(rows, cols, it.mask.with_keys(it.q_ids, c0, block_k)),
                     it.dense.shows(c0, block_k))
      return jnp.where(visible, p * (dot(it.do, v, 1, 1) - it.delta[:, None]), 0.0)

    seen = (kb >= it.lo) & (kb < it.hi)
    if it.dense.summary is not None:
      seen &= jnp.logical_not(it.dense.hidden(kb))
    return lax.cond(seen, compute, lambda: jnp.zeros((block_q, block_k), jnp.float32))

  n_items = n_batch * n_head
  single = item(0) if n_items == 1 else None
  out_rows = pl.ds(r0, block_q) if Tb > 1 else pl.ds(qi, 1)

  def key_block_sum(kb):
    """This program's block of dB at key block kb: its items' dS, summed over its rows
    where the bias has one row."""
    if single is not None:
      ds = score_grads(single, kb)
    else:
      ds = lax.fori_loop(0, n_items, lambda i, acc: acc + score_grads(item(i), kb),
                         jnp.zeros((block_q, block_k), jnp.float32))
    return jnp.sum(ds, axis=0, keepdims=True) if Tb == 1 else ds

  def store(kb, carry):
    cols = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
    db_ref[b, h, out_rows, cols] = key_block_sum(kb).astype(db_ref.dtype)
    return carry
  lax.fori_loop(0, num_k_blocks, store, None)


# The kernel's (rows, keys, warps) per padded head dim for 16-bit inputs on GPUs that
# grant a block ~227 KB of shared memory: the fastest of the tiles timed on an H200
# (2026-11-29, bf16, B 2, S 4k, 16 heads, bias [1, 16, T, S]; performance-log.md,
# "Pallas's bias gradient"): D 64 1.01 ms (128 x 128: 1.24), D 128 1.45 ms (the dQ
# kernel's 128 x 32: 1.95), D 256 2.74 ms (64 x 64: 3.75). Elsewhere (float32, smaller
# GPUs) the dQ kernel's tile, which default_config fits to an A100's shared memory.
_TILES = {64: (128, 64, 4), 128: (128, 128, 8), 256: (128, 64, 8)}


def _tile(config: PallasConfig | None, cfg: PallasConfig, dp: int, itemsize: int):
  """(rows, keys, warps) of the kernel: a config's dQ fields where it names them, else
  _TILES where they apply (head dims to 256), else the dQ kernel's."""
  own = (cfg.block_q_dq, cfg.block_k_dq, cfg.num_warps_bwd)
  if itemsize == 2 and dp <= max(_TILES) and not cfg.interpret and large_shared_memory():
    own = _TILES[min(width for width in _TILES if width >= dp)]
  named = config if config is not None else PallasConfig()
  return tuple(o if n is None else n
               for n, o in zip((named.block_q_dq, named.block_k_dq, named.num_warps_bwd), own))


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
  if Sb == 1:
    return _dense.gradient_over_keys(o, lse, do, dlse, bias.shape).astype(bias.dtype)
  cfg = resolve_config(config, d, q.dtype)
  dp = padded_head_dim(d)
  block_q, block_k, warps = _tile(config, cfg, dp, q.dtype.itemsize)
  bq, t_all = block_sizes(t, block_q)
  bk, s_all = block_sizes(s, block_k)
  nq = t_all // bq
  q_len = clamped_lengths(q_lengths, batch, t)
  kv_len = clamped_lengths(kv_lengths, batch, s)
  offsets = batch_offsets(diagonal_offsets, batch)
  lse = lse.astype(jnp.float32)
  # Rows that see no key carry no gradient.
  delta = jnp.where(lse == EMPTY_LSE, 0.0, output_delta(o, do, dlse))

  extras, _ = extra_operands(alibi, segments, batch, hq, t_all, s_all)
  dense_ops, _ = dense_operands(dense, key_major=False, group=hq // hkv, t_pad=t_all,
                                s_pad=s_all, block_q=bq, block_k=bk)
  operands = same_varying_axes(
      q_len, kv_len, offsets, *extras, *dense_ops, pad_to(q, {1: t_all, 3: dp}),
      pad_to(k, {1: s_all, 3: dp}), pad_to(v, {1: s_all, 3: dp}), pad_to(do, {1: t_all, 3: dp}),
      pad_to(lse, {2: t_all}, value=EMPTY_LSE), pad_to(delta, {2: t_all}))
  whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
  summed_later = Tb == 1 and nq > 1   # one row per program, summed below
  out_shape = (Bb, Nb, t_all if Tb > 1 else nq, s_all)
  db = pl.pallas_call(
      functools.partial(
          _kernel, scores=Scores(float(scale), float(softcap)), alibi=alibi is not None,
          segments=segments is not None, dense_mask=dense.mask is not None, batch=batch,
          heads=hq, group=hq // hkv, bias_shape=(Bb, Nb, Tb, Sb), left=int(window_left),
          right=int(window_right), bottom_right=bool(bottom_right), block_q=bq, block_k=bk,
          num_k_blocks=s_all // bk),
      grid=(nq, Bb, Nb),
      in_specs=[whole(x) for x in operands],
      out_specs=pl.BlockSpec(out_shape, lambda *_: (0,) * 4),
      out_shape=output(out_shape, jnp.float32 if summed_later else bias.dtype, operands[-1]),
      interpret=cfg.interpret,
      compiler_params=None if cfg.interpret else compiler_params(
          warps, cfg.num_stages_bwd, bq, bk, dp),
      name="jaxflash_pallas_bias_grad",
  )(*operands)
  if summed_later:
    db = jnp.sum(db, axis=2, keepdims=True)
  return db[:, :, :Tb, :s].astype(bias.dtype)
