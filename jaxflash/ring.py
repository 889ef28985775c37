"""Ring attention: exact attention over a sequence sharded across devices.

Every device keeps its shard of the queries; the key/value shards travel
around the ring of devices with `lax.ppermute`, one hop per step, and the hop
for the next step is issued before this step's kernels run, so the transfer
overlaps them. Each (query piece, key piece) block runs the ordinary fused
kernels with the block's local sequence lengths and its diagonal offset
(`diagonal_offsets`, params.h), which makes every mask exact: causal,
windows, both alignments, sequence lengths. Partial outputs merge with the
log-sum-exp rule in float32.

The backward runs the same ring. Each block calls the fused backward with the
*global* output and log-sum-exp: with them, a block's dQ, dK, dV are exactly
its share of the full gradient. dQ accumulates in place in float32; dK, dV
accumulate in float32 in buffers that travel with their keys and arrive back
at their owner after the last step.

Layouts (what each shard of the sequence axis holds: contiguous, zigzag, and the
partition rule's mirror) live in ring_layout.py.

Blocks that no row can see (above the causal diagonal, outside a window,
beyond the lengths) are skipped with `lax.cond` before any kernel runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflash import _core, derivatives, reference, segments as _segments
from jaxflash.ring_layout import Sharded, _FirstHalf

Layout = Literal["contiguous", "zigzag"]
LAYOUTS = ("contiguous", "zigzag")


# ------------------------------------------------------------------ blocks

def _piece(x, i: int, n: int, axis: int):
  """Piece i of n of `x` along `axis`; `x` may also be the tuple of its n pieces.

  Called inside a block's `lax.cond` branch, so the copy a slice makes lives
  only while that block's kernel runs. Slicing every operand into its pieces
  up front kept a second copy of q, k, v, o and dO alive through the whole
  ring (XLA CPU buffer assignment, zigzag at 2 devices: 0.74X of the 5.76X
  per-device temps, X = one q-sized tensor). An operand that is made of its
  pieces (`to_mirror`) comes as the tuple: a slice of a concatenation inside
  a branch would keep the concatenation alive instead.
  """
  if isinstance(x, tuple):
    return x[i].value() if isinstance(x[i], _FirstHalf) else x[i]
  if n == 1:
    return x
  size = x.shape[axis] // n
  return lax.slice_in_dim(x, i * size, (i + 1) * size, axis=axis)


def _length(x, axis: int) -> int:
  """Length of `x` (an array or the tuple of its pieces) along `axis`."""
  return sum(p.shape[axis] for p in x) if isinstance(x, tuple) else x.shape[axis]


def _dtype(x):
  return x[0].dtype if isinstance(x, tuple) else x.dtype


def _block(spec, q_start, q_piece: int, k_start, k_piece: int, ql, kvl):
  """Local lengths, diagonal offsets and `any row sees a key` of one block.

  ql, kvl are the global lengths clamped to the global sizes; `spec` is the
  call's MaskSpec (its bottom-right alignment becomes part of the offset).
  """
  lq = jnp.clip(ql - q_start, 0, q_piece)
  lk = jnp.clip(kvl - k_start, 0, k_piece)
  offsets = (q_start - k_start + (kvl - ql if spec.bottom_right else jnp.zeros_like(ql))
             ).astype(jnp.int32)
  # Row i sees key j iff j - i lies in [offset - left, offset + right]; the
  # block holds j - i in [-(lq - 1), lk - 1].
  lo = -(lq - 1)
  if spec.window_left >= 0:
    lo = jnp.maximum(lo, offsets - spec.window_left)
  hi = lk - 1
  if spec.window_right >= 0:
    hi = jnp.minimum(hi, offsets + spec.window_right)
  visible = jnp.any((lq > 0) & (lk > 0) & (lo <= hi))
  return lq.astype(jnp.int32), lk.astype(jnp.int32), offsets, visible


def _steps(n: int, step, carry):
  """step(r, carry, first, last) for r = 0 .. n-1, each step a phase of its own.

  The first and the last step are traced on their own (the first receives
  nothing, the last sends nothing); the ones between run in a fori_loop, so
  the program holds three copies of a step whatever the ring's size.

  An optimization barrier closes every step: no block of the next step starts
  before every block of this one has finished. Every device runs the same
  program, but which of a step's blocks are visible (run a kernel) differs
  from device to device while their total does not; a collective the
  scheduler placed between two blocks would make the device that reached it
  first wait for the other. Measured on two H200s at S 128k (the partition
  rule's causal ring): waits of 21-39 ms on a 281 ms step without phases.
  """
  phase = lambda r, c, first, last: lax.optimization_barrier(step(r, c, first, last))
  if n == 1:
    return phase(0, carry, True, True)
  carry = phase(0, carry, True, False)
  if n > 2:
    carry = lax.fori_loop(1, n - 1, lambda r, c: phase(r, c, False, False), carry)
  return phase(n - 1, carry, False, True)


def _like(x, value, dtype=None):
  """A constant shaped (and, inside shard_map, varying) like `x`."""
  return jnp.full_like(x, value, dtype=dtype)


def _accumulate(visible, update, acc):
  """update(acc) if `visible`, else acc unchanged, decided at run time.

  A block's kernel runs and its result is folded into the accumulators inside
  the taken branch, so the blocks of a step form one chain through the
  accumulators: each result dies where it is made, and XLA cannot schedule
  every block's output to be alive at once. The skipped branch returns the
  accumulators untouched, which also keeps both branches' types (and, inside
  shard_map, their varying axes) equal.
  """
  return lax.cond(visible, update, lambda acc: acc, acc)


_EMPTY = float(np.finfo(np.float32).min)   # the kernels' LSE of a row that sees no key


def _merge(acc, o, lse):
  """Online-softmax merge of a block's normalised (o, lse) into (acc_o, acc_lse), fp32.

  A row that sees no key has LSE `_EMPTY` (finite, not -inf: params.h) and
  weighs exactly 0, so an empty block contributes nothing and a row empty in
  every block stays `_EMPTY` with output 0; nothing here makes an inf (no
  false alarm under `jax.debug_infs`). A NaN LSE or output (a NaN input the
  row sees) makes the row NaN, as in the unsharded kernels.
  """
  acc_o, acc_lse = acc
  acc_empty, blk_empty = acc_lse == _EMPTY, lse == _EMPTY
  top = jnp.maximum(acc_lse, lse)     # NaN-propagating
  w_acc = jnp.where(acc_empty, 0.0, jnp.exp(jnp.where(acc_empty, 0.0, acc_lse - top)))
  w_blk = jnp.where(blk_empty, 0.0, jnp.exp(jnp.where(blk_empty, 0.0, lse - top)))
  both = acc_empty & blk_empty
  total = jnp.where(both, 1.0, w_acc + w_blk)   # >= 1 where a side is not empty
  new = jnp.where(both, _EMPTY, top + jnp.log(total))
  to_rows = lambda w: jnp.transpose(w / total, (0, 2, 1))[..., None]   # [B, N, T] -> [B, T, N, 1]
  return acc_o * to_rows(w_acc) + o.astype(jnp.float32) * to_rows(w_blk), new


# ------------------------------------------------------------------ the ring

def _no_dense(dense) -> None:
  """Ring attention's blocks take no dense bias or mask (the partition rules never run a
  ring for such calls, and `ring_attention` takes neither)."""
  if dense is not None:
    raise ValueError("ring attention does not take a dense bias or mask")


@dataclasses.dataclass(frozen=True)
class Ring:
  """Fused kernels run around a ring, with the `kernels` interface of _core.py.

  `forward` and `backward` take the local shards and must run where the mesh
  axes of `q_seq` and `kv_seq` are bound (inside `shard_map`, or a partition
  rule's per-shard function). `kv_seq.axis` None means the keys are not
  sharded: one step, no transfer (a query shard against all keys).
  """
  kernels: Any
  q_seq: Sharded
  kv_seq: Sharded
  q_len: int      # global lengths of the query and key sequences
  kv_len: int

  @property
  def name(self) -> str:
    return self.kernels.name

  @staticmethod
  def takes_value_width(call=None) -> bool:   # the blocks' merge takes one head dim (`run_fused` pads)
    return False

  def _blocks(self, spec, q, k, q_lengths, kv_lengths):
    """blocks(r) yields (a, c, lq, lk, offsets, visible) for query piece a and
    key piece c of step r."""
    batch = (q[0] if isinstance(q, tuple) else q).shape[0]   # pieces split the sequence only
    ql = reference.clamped_lengths(q_lengths, batch, self.q_len)    # global lengths
    kvl = reference.clamped_lengths(kv_lengths, batch, self.kv_len)
    T, S = _length(q, 1), _length(k, 1)
    hq, hk = T // self.q_seq.pieces, S // self.kv_seq.pieces
    q_starts = self.q_seq.starts(self.q_seq.index(), T)
    me = self.kv_seq.index()

    def blocks(r):
      src = (me - r) % self.kv_seq.shards   # whose keys step r holds
      for a, q0 in enumerate(q_starts):
        for c, k0 in enumerate(self.kv_seq.starts(src, S)):
          yield (a, c) + _block(spec, q0, hq, k0, hk, ql, kvl)
    return blocks

  @staticmethod
  def _ids(segments):
    """The local (q_ids, kv_ids) of the call's segment tables (their first field), or
    (None, None). A block's own tables come from these (`_block_tables`)."""
    return (None, None) if segments is None else _segments.ids_of(segments)

  @staticmethod
  def _block_tables(q_ids, kv_ids_c, a, m, lq, lk, block_spec, off):
    """The segment tables of the block of query piece a (of m) and the key piece whose
    ids are `kv_ids_c` ([] without ids: None), with the block's lengths and diagonal
    offset, as the kernels take them for the block alone."""
    if not kv_ids_c:
      return None
    return _segments.tables(_piece(q_ids, a, m, 1), kv_ids_c[0], lq, lk, block_spec, off)

  def forward(self, q, k, v, q_lengths, kv_lengths, spec, segments=None, alibi=None, dense=None):
    """(o, lse) of the local query shard; segment ids' key side travels with K/V."""
    _no_dense(dense)
    blocks = self._blocks(spec, q, k, q_lengths, kv_lengths)
    block_spec = dataclasses.replace(spec, bottom_right=False)   # folded into the offsets
    m, ks = self.q_seq.pieces, self.kv_seq
    q_ids, kv_ids = self._ids(segments)

    def step(r, carry, first, last):
      del first
      kv, acc = carry
      nxt = kv if last else ks.send(kv)        # issued before this step's kernels
      acc = list(acc)
      for a, c, lq, lk, off, visible in blocks(r):
        def update(acc, a=a, c=c, kv=kv, lq=lq, lk=lk, off=off):
          k_c, v_c, *ids_c = (_piece(x, c, ks.pieces, 1) for x in kv)
          tables = self._block_tables(q_ids, ids_c, a, m, lq, lk, block_spec, off)
          return _merge(acc, *self.kernels.forward(_piece(q, a, m, 1), k_c, v_c, lq, lk,
                                                   block_spec, off, segments=tables,
                                                   alibi=alibi))
        acc[a] = _accumulate(visible, update, acc[a])
      return nxt, tuple(acc)

    q_a = _piece(q, 0, m, 1)    # only its shape and type are used
    acc = tuple((_like(q_a, 0, jnp.float32),
                 _like(q_a[..., 0], _EMPTY, jnp.float32).transpose(0, 2, 1)) for _ in range(m))
    kv = (k, v) if kv_ids is None else (k, v, kv_ids)
    _, acc = _steps(ks.shards, step, (kv, acc))
    o = jnp.concatenate([a[0] for a in acc], axis=1).astype(_dtype(q))
    return o, jnp.concatenate([a[1] for a in acc], axis=2)

  def backward(self, q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec, segments=None,
               alibi=None, dense=None):
    """(dq, dk, dv) of the local shards, from the global o and lse.

    `o` None: `dlse` has the output's part folded in (`fold_output`). dq comes
    in the queries' layout, dk and dv in the keys' (the mirror layout's
    contiguous: `Sharded.home`).
    """
    _no_dense(dense)
    blocks = self._blocks(spec, q, k, q_lengths, kv_lengths)
    block_spec = dataclasses.replace(spec, bottom_right=False)
    m, ks = self.q_seq.pieces, self.kv_seq
    q_ids, kv_ids = self._ids(segments)

    def step(r, carry, first, last):
      kv, pending, dq = carry
      # The dK/dV sums of the keys this step holds arrive from the previous
      # shard while this step's kernels run.
      arrived = pending if first else ks.send(pending)
      nxt = kv if last else ks.send(kv)
      dq, dkv = list(dq), list(arrived)
      for a, c, lq, lk, off, visible in blocks(r):
        def update(acc, a=a, c=c, kv=kv, lq=lq, lk=lk, off=off):
          q_a, o_a, do_a = (_piece(x, a, m, 1) for x in (q, o, do))
          lse_a, dlse_a = (_piece(x, a, m, 2) for x in (lse, dlse))
          k_c, v_c, *ids_c = (_piece(x, c, ks.pieces, 1) for x in kv)
          tables = self._block_tables(q_ids, ids_c, a, m, lq, lk, block_spec, off)
          grads = self.kernels.backward(q_a, k_c, v_c, o_a, lse_a, do_a, dlse_a, lq, lk,
                                        block_spec, off, segments=tables, alibi=alibi)
          return tuple(s + g.astype(jnp.float32) for s, g in zip(acc, grads))
        dq[a], *dkv[c] = _accumulate(visible, update, (dq[a],) + tuple(dkv[c]))
        dkv[c] = tuple(dkv[c])
      return nxt, tuple(dkv), tuple(dq)

    q_a = _piece(q, 0, m, 1)    # only the shapes and types of these are used
    if o is None:       # dLSE carries the output's part: every piece reads one zero O
      o = (_like(_piece(do, 0, m, 1), 0),) * m
    pending = tuple(tuple(_like(_piece(x, 0, ks.pieces, 1), 0, jnp.float32) for x in (k, v))
                    for _ in range(ks.pieces))
    dq = tuple(_like(q_a, 0, jnp.float32) for _ in range(m))
    kv = (k, v) if kv_ids is None else (k, v, kv_ids)
    _, pending, dq = _steps(ks.shards, step, (kv, pending, dq))
    # The finished sums return to their owner in the input dtype (they are
    # rounded to it there anyway): half the bytes of the last hop.
    pending = jax.tree.map(lambda x: x.astype(_dtype(k)), pending)
    dk, dv = (ks.home(tuple(x[i] for x in pending), axis=1) for i in (0, 1))
    return jnp.concatenate(dq, axis=1).astype(_dtype(q)), dk, dv


  def tangent(self, q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, *, spec, segments=None,
              alibi=None):
    """(tO, tLSE) of the local query shard (forward mode), from the global lse.

    Given the row's global LSE both sums of the tangent run over keys
    (derivatives.tangent_sums), so every block adds its share, computed
    blockwise in jnp with the block's diagonal offset; K/V and their tangents
    travel around the ring as in the forward (with the keys' segment ids).
    """
    blocks = self._blocks(spec, q, k, q_lengths, kv_lengths)
    block_spec = dataclasses.replace(spec, bottom_right=False)
    m, ks = self.q_seq.pieces, self.kv_seq
    q_ids, kv_ids = self._ids(segments)

    def step(r, carry, first, last):
      del first
      kv, acc = carry
      nxt = kv if last else ks.send(kv)
      acc = list(acc)
      for a, c, lq, lk, off, visible in blocks(r):
        def update(acc, a=a, c=c, kv=kv, lq=lq, lk=lk, off=off):
          q_a, tq_a = (_piece(x, a, m, 1) for x in (q, tq))
          k_c, v_c, tk_c, tv_c, *ids_c = (_piece(x, c, ks.pieces, 1) for x in kv)
          tables = self._block_tables(q_ids, ids_c, a, m, lq, lk, block_spec, off)
          sums = derivatives.tangent_sums(q_a, k_c, v_c, _piece(lse, a, m, 2), lq, lk, tq_a,
                                          tk_c, tv_c, spec=block_spec, offsets=off,
                                          segments=tables, alibi=alibi)
          return tuple(x + y for x, y in zip(acc, sums))
        acc[a] = _accumulate(visible, update, acc[a])
      return nxt, tuple(acc)

    q_a, lse_a = _piece(q, 0, m, 1), _piece(lse, 0, m, 2)   # shapes and types only
    acc = tuple((_like(q_a, 0, jnp.float32), _like(lse_a, 0, jnp.float32),
                 _like(q_a, 0, jnp.float32)) for _ in range(m))
    kv = (k, v, tk, tv) if kv_ids is None else (k, v, tk, tv, kv_ids)
    _, acc = _steps(ks.shards, step, (kv, acc))
    sums, t_lse, o_sum = (jnp.concatenate([a[i] for a in acc], axis=2 if i == 1 else 1)
                          for i in range(3))
    return derivatives.finish_tangent(sums, t_lse, o_sum, o.dtype), t_lse

  # The blockwise second-order rule (derivatives.py) would see only the local
  # shards: Hessian-vector products through a ring are refused.
  second_order = False


# ------------------------------------------------------------------ entry point

def ring_attention(query, key, value, *, axis_name, is_causal: bool = False,
                   scale: float | None = None, query_seq_lengths=None,
                   key_value_seq_lengths=None, local_window_size=None,
                   causal_alignment: str = "top_left", layout: Layout = "contiguous",
                   implementation: str | None = None, return_residual: bool = False,
                   residual_dtype=None, differentiable_residual: bool = False,
                   logits_soft_cap: float | None = None, query_segment_ids=None,
                   key_value_segment_ids=None, alibi_slopes=None):
  """Exact attention over a sequence sharded along the mesh axis `axis_name`.

  Call it inside `jax.shard_map` with the local shards: ``query`` is this
  device's ``[batch, q_len / n, heads, head_dim]`` shard of the queries and
  ``key``/``value`` its shard of the keys and values (n = the size of
  `axis_name`, which may be a tuple of mesh axes). Arguments mean what they
  mean in `dot_product_attention`, for the whole (global) sequence: the
  lengths are the global ``[batch]`` lengths, the same on every shard, and
  the causal diagonal and windows are placed in global positions.

  ``layout`` says which part of the sequence each shard holds:
  ``"contiguous"`` (shard i holds chunk i of n) or ``"zigzag"`` (shard i holds
  chunks i and 2n-1-i of 2n: equal work per shard under a causal mask; see
  `zigzag_order`). The output is laid out like the queries.

  Runs the fused kernels: ``implementation`` "native" or "pallas"; None
  picks native where it runs (the FFI kernels fit shard_map's type checks;
  a Pallas call inside `shard_map` needs ``check_vma=False``), else pallas.
  Differentiable in reverse mode; the residual (``return_residual=True``)
  carries a gradient only with ``differentiable_residual=True``, as in
  `dot_product_attention`. Segment ids (packed sequences) are this shard's
  ``[batch, q_len / n]`` / ``[batch, kv_len / n]`` ids in the same layout; the
  key ids travel with their keys. ALiBi distances are global positions.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if implementation not in (None, "native", "pallas"):
    raise ValueError("ring_attention runs the fused kernels: implementation must be None, "
                     f"'native' or 'pallas', got {implementation!r}")
  call = _core.validate(query, key, value, None, None, scale, is_causal, query_seq_lengths,
                        key_value_seq_lengths, local_window_size, causal_alignment, False,
                        logits_soft_cap=logits_soft_cap, query_segment_ids=query_segment_ids,
                        key_value_segment_ids=key_value_segment_ids, alibi_slopes=alibi_slopes)
  shards = lax.axis_size(axis_name)
  B, T = call.q.shape[:2]
  S = call.k.shape[1]
  if layout == "zigzag" and (T % 2 or S % 2):
    raise ValueError(f"layout='zigzag' holds two equal chunks per shard; the local query and key "
                     f"lengths must be even, got {T} and {S}")
  chosen = implementation
  if chosen is None:
    chosen = "native" if _core.fused_unsupported(call, "native") is None else "pallas"
  reason = _core.fused_unsupported(call, chosen)
  if reason:
    raise ValueError(f"ring_attention: {reason}")
  seq = Sharded(axis_name, shards, layout)
  ring = Ring(_core.KERNELS[chosen], seq, seq, T * shards, S * shards)
  if call.empty:
    out, lse = _core.empty_result(call)
  else:
    q_lengths = call.q_lengths if call.q_lengths is not None else _core.full_lengths(B, T * shards)
    kv_lengths = (call.kv_lengths if call.kv_lengths is not None
                  else _core.full_lengths(B, S * shards))
    ids = None if call.segments is None else _segments.id_tables(*call.segments)
    out, lse = _core.run_fused(call, q_lengths, kv_lengths, ids, ring)
  return _core.finish(call, out, lse, return_residual, residual_dtype, differentiable_residual)
