"""Partition rules: sharded calls of the fused kernels stay on their shards.

Under `jax.jit` with sharded inputs XLA cannot look inside a custom call, so
without a rule it gathers every operand onto every device. Each kernel call
(forward and backward, native and Pallas) is therefore wrapped in
`jax.experimental.custom_partitioning`, with a Shardy sharding rule (the
default partitioner) and the GSPMD callbacks, and a per-shard function that
runs the same kernels on the local block:

* batch: every operand and result is split along it; lengths go with it.
* heads: query heads are split with their key/value heads (query head n uses
  key/value head n // group, so a contiguous split of both is exact) when the
  key/value heads divide evenly. With fewer key/value heads than shards
  (MQA, GQA with a large group) keys and values stay replicated and each shard
  slices the one key/value head its query heads use; the forward is still
  local, the backward then sums dK/dV over the head axis (the gradient of any
  replicated input needs that sum).
* head_dim: never split; a sharded head_dim is gathered first (the sharding
  rule marks it need-replication).
* segment tables ([B, T, 8], [B, S, 8]) shard with their rows and keys; under
  sequence sharding the ring reads their ids and builds each block's own.
  ALiBi slopes ([B, N]) shard with the batch and the query heads; a dense
  bias or mask ([Bb, Nb, Tb, Sb], dense.py) with the batch and the query heads
  where it has them (a broadcast axis of size 1 is replicated).
* sequence: queries sharded along the sequence with the keys replicated run
  locally with each shard's diagonal offset; keys sharded along the sequence
  run ring attention (ring.py) over that mesh axis, causal masks in the
  mirror layout (`ring_layout.to_mirror`: half of each shard swapped on the way in
  and back on the way out) so every device does the same work at every step.
  Calls with a dense bias or mask gather the sequences instead.

Everything that is not named above is replicated, which is always correct.
A wrapper with `custom_vmap` folds vmapped axes into the batch, as the FFI
calls' `broadcast_all` does, because custom_partitioning has no batching rule.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxflash import (dense as _dense, derivatives, reference, ring as ring_lib, ring_layout,
                      segments as _segments)


# ------------------------------------------------------------------ the plan

def _axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _axis(axes: tuple[str, ...]):
  """The axis_name of a collective over `axes`."""
  return axes[0] if len(axes) == 1 else axes


def _dims(sharding, rank: int) -> list[tuple[str, ...]]:
  """Mesh axes of every dimension; anything but a NamedSharding counts as replicated."""
  if not isinstance(sharding, NamedSharding):
    return [()] * rank
  spec = tuple(sharding.spec) + (None,) * (rank - len(sharding.spec))
  return [_axes(e) for e in spec[:rank]]


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Which mesh axes split which dimension of one call (empty tuple: none)."""
  mesh: object
  batch: tuple[str, ...] = ()
  heads: tuple[str, ...] = ()
  kv_heads: tuple[str, ...] = ()    # heads, or () when K/V stay replicated over them
  q_seq: tuple[str, ...] = ()
  kv_seq: tuple[str, ...] = ()      # == q_seq when set: ring attention
  mirror: bool = False              # re-lay the ring out for a causal mask (ring_layout.to_mirror)

  def size(self, axes) -> int:
    return math.prod(self.mesh.shape[a] for a in axes)

  def _named(self, *dims):
    return NamedSharding(self.mesh, P(*(_entry(d) for d in dims)))

  def rows(self):       # q, o, do, dq
    return self._named(self.batch, self.q_seq, self.heads, ())

  def keys(self):       # k, v, dk, dv
    return self._named(self.batch, self.kv_seq, self.kv_heads, ())

  def stats(self):      # lse, dlse: [B, N, T]
    return self._named(self.batch, self.heads, self.q_seq)

  def lengths(self):
    return self._named(self.batch)

  def q_table(self):    # [B, T, 8] segment table (segments.py)
    return self._named(self.batch, self.q_seq, ())

  def kv_table(self):   # [B, S, 8]
    return self._named(self.batch, self.kv_seq, ())

  def slopes(self):     # [B, N] ALiBi slopes
    return self._named(self.batch, self.heads)

  def dense(self, shape):  # a dense bias or mask [Bb, Nb, Tb, Sb]: size-1 axes replicated
    return self._named(self.batch if shape[0] > 1 else (), self.heads if shape[1] > 1 else ())

  @property
  def sliced_kv_heads(self) -> bool:
    return bool(self.heads) and not self.kv_heads


def _plan(mesh, spec, q_shape, k_shape, q_sharding, k_sharding, dense: bool = False) -> _Plan:
  """The partition this rule runs for operands sharded like q and k (`dense`: the call
  has a dense bias or mask, whose sequence axes are never split: no ring, no
  query-sequence shards)."""
  if mesh is None or getattr(mesh, "empty", True):
    return _Plan(mesh)
  B, T, N, _ = q_shape
  S, K = k_shape[1], k_shape[2]
  qd, kd = _dims(q_sharding, 4), _dims(k_sharding, 4)
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  batch = qd[0] if B % size(qd[0]) == 0 else ()
  heads, kv_heads = qd[2], qd[2]
  if set(heads) & set(batch) or N % size(heads):
    heads = kv_heads = ()
  elif K % size(heads):
    # Fewer K/V heads than shards: each shard's query heads must share one.
    kv_heads = ()
    if (N // K) % (N // size(heads)):
      heads = ()
  used = set(batch) | set(heads)
  if dense:
    return _Plan(mesh, batch, heads, kv_heads)
  kv_seq = kd[1] if not set(kd[1]) & used else ()
  q_seq = kv_seq or (qd[1] if not set(qd[1]) & used else ())
  if T % size(q_seq) or S % size(kv_seq):
    kv_seq, q_seq = (), (qd[1] if T % size(qd[1]) == 0 and not set(qd[1]) & used else ())
  n = size(kv_seq)
  causal = spec.window_right >= 0 and spec.window_left < 0
  mirror = bool(kv_seq) and causal and T == S and (T // n) % 2 == 0 and n > 1
  return _Plan(mesh, batch, heads, kv_heads, q_seq, kv_seq, mirror)


# ------------------------------------------------------------------ per-shard functions

def _ring(plan: _Plan, kernels, q_len: int, kv_len: int):
  layout = "mirror" if plan.mirror else "contiguous"
  q_seq = ring_layout.Sharded(_axis(plan.q_seq), plan.size(plan.q_seq), layout)
  kv_seq = (ring_layout.Sharded(_axis(plan.kv_seq), plan.size(plan.kv_seq), layout) if plan.kv_seq
            else ring_layout.Sharded())
  return ring_lib.Ring(kernels, q_seq, kv_seq, q_len, kv_len)


def _kv_head_slice(plan: _Plan, N: int, K: int):
  """(start, 1) of the one K/V head this head shard's query heads use."""
  local = N // plan.size(plan.heads)
  return lax.axis_index(_axis(plan.heads)) * local // (N // K)


@dataclasses.dataclass(frozen=True)
class _Extras:
  """Which extra operands a call passes after its arrays, in this order: the two
  segment tables, the ALiBi slopes, the dense bias, the dense mask."""
  segments: bool = False
  alibi: bool = False
  bias: bool = False
  mask: bool = False

  @classmethod
  def of(cls, segments, alibi, dense) -> "_Extras":
    return cls(segments is not None, alibi is not None, dense is not None and dense.bias is not None,
               dense is not None and dense.mask is not None)

  @staticmethod
  def operands(segments, alibi, dense) -> tuple:
    return (*(segments or ()), *(() if alibi is None else (alibi,)),
            *(() if dense is None else tuple(x for x in (dense.bias, dense.mask) if x is not None)))

  def split(self, extras):
    """(segment tables or None, slopes or None, Dense or None) from the operands."""
    extras = list(extras)
    take = lambda flag, n=1: [extras.pop(0) for _ in range(n)] if flag else [None]  # noqa: E731
    ids = tuple(take(self.segments, 2)) if self.segments else None
    (slopes,), (bias,), (mask,) = take(self.alibi), take(self.bias), take(self.mask)
    return ids, slopes, _dense.make(bias, mask)

  @property
  def dense(self) -> bool:
    return self.bias or self.mask


def _to_mirror(seq, read, travel, ids):
  """`ring_layout.to_mirror` of a rule's operands, in the order given: `read`, (tensor, sequence
  axis) pairs only blocks read (their staying half sliced inside the blocks), `travel`,
  K/V, and the segment ids, which come back whole (the ring reads them as arrays)."""
  ids = ids or ()
  items = ([(x, axis, True) for x, axis in read] + [(x, 1, False) for x in travel]
           + [(x, 1, False) for x in ids])
  xs, axes, lazy = zip(*items)
  pieces = ring_layout.to_mirror(xs, seq, axes, lazy)
  n = len(read) + len(travel)
  return pieces[:n] + ((tuple(jnp.concatenate(p, axis=1) for p in pieces[n:]) or None),)


def _local_forward(plan: _Plan, kernels, spec, q_len: int, kv_len: int, N: int, K: int,
                   extra: _Extras):
  def run(q, k, v, q_lengths, kv_lengths, *extras):
    ids, alibi, dense = extra.split(extras)
    if plan.sliced_kv_heads:
      start = _kv_head_slice(plan, N, K)
      k, v = (lax.dynamic_slice_in_dim(x, start, 1, axis=2) for x in (k, v))
    if not plan.q_seq:
      return kernels.forward(q, k, v, q_lengths, kv_lengths, spec, segments=ids, alibi=alibi,
                             dense=dense)
    ring = _ring(plan, kernels, q_len, kv_len)
    if plan.mirror:
      q, k, v, ids = _to_mirror(ring.q_seq, [(q, 1)], (k, v), ids)
    o, lse = ring.forward(q, k, v, q_lengths, kv_lengths, spec, segments=ids, alibi=alibi)
    if plan.mirror:
      o, lse = ring_layout.from_mirror(o, ring.q_seq, 1), ring_layout.from_mirror(lse, ring.q_seq, 2)
    return o, lse
  return run


def _local_backward(plan: _Plan, kernels, spec, q_len: int, kv_len: int, N: int, K: int,
                    extra: _Extras):
  def run(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, *extras):
    ids, alibi, dense = extra.split(extras)
    full_k, full_v = k, v
    if plan.sliced_kv_heads:
      start = _kv_head_slice(plan, N, K)
      k, v = (lax.dynamic_slice_in_dim(x, start, 1, axis=2) for x in (k, v))
    if not plan.q_seq:
      dq, dk, dv = kernels.backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec,
                                    segments=ids, alibi=alibi, dense=dense)
    else:
      ring = _ring(plan, kernels, q_len, kv_len)
      # Nothing of the backward's ring starts before the forward's results exist: a
      # transfer of an input (the re-layout, the first hop of K/V) hoisted into the
      # forward would sit between its blocks (ring._steps) and keep its copy alive
      # through the forward.
      q, k, v, o, lse, do, dlse = lax.optimization_barrier((q, k, v, o, lse, do, dlse))
      if plan.mirror:
        # O folded into dLSE: one swap fewer, and the caller's O may die here.
        dlse, o = ring_layout.fold_output(o, do, dlse), None
        q, do, lse, dlse, k, v, ids = _to_mirror(
            ring.q_seq, [(q, 1), (do, 1), (lse, 2), (dlse, 2)], (k, v), ids)
      dq, dk, dv = ring.backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec,
                                 segments=ids, alibi=alibi)
      if plan.mirror:      # dK, dV come home contiguous (Sharded.home)
        dq = ring_layout.from_mirror(dq, ring.q_seq, 1)
    if plan.sliced_kv_heads:
      # K/V are replicated over the head axis: their gradient sums its shards.
      place = lambda g, full: lax.dynamic_update_slice_in_dim(
          jnp.zeros(full.shape, jnp.float32), g.astype(jnp.float32), start, axis=2)
      dk, dv = (lax.psum(place(g, full), _axis(plan.heads)).astype(full.dtype)
                for g, full in ((dk, full_k), (dv, full_v)))
    return dq, dk, dv
  return run


# ------------------------------------------------------------------ partition callbacks

def _shardy_rule(backward: bool, extra: _Extras):
  """The einsum-like Shardy rule of the forward or backward call.

  Every dimension gets its own factor, query and key/value heads and the two
  sequence axes included: Shardy then keeps each operand's sharding and the
  partition callback decides how they go together. (Tying the query heads to
  the key/value heads with a compound factor lets Shardy split a mesh axis
  into sub-axes for the key/value heads, which custom_partitioning cannot
  hand to its callback; one factor for both sequence axes makes Shardy slice
  replicated keys and run a ring where a local call suffices.)
  """
  def rule(kernels, spec, mesh, operand_types, result_types):
    del kernels, spec, mesh, operand_types, result_types
    rows, keys, stats = "b t n d", "b s h d", "b n t"
    if backward:
      operands = [rows, keys, keys, rows, stats, rows, stats, "b", "b"]
      results = [rows, keys, keys]
    else:
      operands, results = [rows, keys, keys, "b", "b"], [rows, stats]
    if extra.segments:
      operands += ["b t f", "b s f"]
    if extra.alibi:
      operands += ["b n"]
    # A dense term's axes are the call's or broadcast ones of size 1: factors of their
    # own (the partition callback shards them with the batch and heads it has).
    operands += [f"{x}b {x}n {x}t {x}s" for x, on in (("bias", extra.bias), ("mask", extra.mask)) if on]
    return (", ".join(operands) + " -> " + ", ".join(results),
            dict(need_replication_factors=("d",)))
  return rule


def _extra_shardings(plan: _Plan, extra: _Extras, arg_shapes):
  tables = (plan.q_table(), plan.kv_table()) if extra.segments else ()
  dense = tuple(plan.dense(x.shape) for x in arg_shapes[len(arg_shapes) - extra.bias - extra.mask:])
  return tables + ((plan.slopes(),) if extra.alibi else ()) + dense


def _forward_shardings(plan: _Plan, extra: _Extras, arg_shapes):
  return (plan.rows(), plan.keys(), plan.keys(), plan.lengths(), plan.lengths(),
          *_extra_shardings(plan, extra, arg_shapes)), (plan.rows(), plan.stats())


def _backward_shardings(plan: _Plan, extra: _Extras, arg_shapes):
  rows, keys, stats, lengths = plan.rows(), plan.keys(), plan.stats(), plan.lengths()
  return ((rows, keys, keys, rows, stats, rows, stats, lengths, lengths,
           *_extra_shardings(plan, extra, arg_shapes)), (rows, keys, keys))


def _plan_of(spec, mesh, arg_shapes, dense: bool) -> _Plan:
  q, k = arg_shapes[0], arg_shapes[1]
  return _plan(mesh, spec, q.shape, k.shape, q.sharding, k.sharding, dense)


def _partition(backward: bool, extra: _Extras):
  shardings = _backward_shardings if backward else _forward_shardings

  def partition(kernels, spec, mesh, arg_shapes, result_shape):
    del result_shape
    plan = _plan_of(spec, mesh, arg_shapes, extra.dense)
    q, k = arg_shapes[0].shape, arg_shapes[1].shape
    local = _local_backward if backward else _local_forward
    fn = local(plan, kernels, spec, q[1], k[1], q[2], k[2], extra)
    args, results = shardings(plan, extra, arg_shapes)
    return plan.mesh, fn, results, args

  def infer(kernels, spec, mesh, arg_shapes, result_shape):
    del kernels, result_shape
    return shardings(_plan_of(spec, mesh, arg_shapes, extra.dense), extra, arg_shapes)[1]
  return partition, infer


@functools.cache
def _call(backward: bool, extra: _Extras):
  """The kernels' forward or backward as a function of positional operands (the arrays,
  then the extra operands `extra` lists), the kernel table and the spec last."""
  arrays = 9 if backward else 5

  def fn(*args):
    *operands, kernels, spec = args
    ids, slopes, dense = extra.split(operands[arrays:])
    call = kernels.backward if backward else kernels.forward
    return call(*operands[:arrays], spec, segments=ids, alibi=slopes, dense=dense)
  return fn


@functools.cache
def _op(backward: bool, extra: _Extras):
  """The partitioned forward or backward call for one list of extra operands (segment
  tables, ALiBi slopes, dense bias and mask; `_Extras`): one op per operand list."""
  n = (9 if backward else 5) + 2 * extra.segments + extra.alibi + extra.bias + extra.mask
  op = custom_partitioning(_call(backward, extra), static_argnums=(n, n + 1))
  partition, infer = _partition(backward, extra)
  op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=_shardy_rule(backward, extra))
  return op


# ------------------------------------------------------------------ vmap

def _fold_vmap(fn, axis_size: int, in_batched, args, shared: int = 0):
  """Runs fn on args whose (leading) vmapped axis is folded into the batch. The last
  `shared` args are dense terms [Bb, ...]: one the vmapped axis does not vary keeps a
  batch of one (the kernels read it with stride 0); otherwise it is broadcast to q's."""
  batch = args[0].shape[1] if in_batched[0] else args[0].shape[0]
  folded = []
  for i, (a, b) in enumerate(zip(args, in_batched)):
    dense = i >= len(args) - shared
    if dense and not b and a.shape[0] == 1:
      folded.append(a)
      continue
    a = a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
    if dense:
      a = jnp.broadcast_to(a, a.shape[:1] + (batch,) + a.shape[2:])
    folded.append(a.reshape((-1,) + a.shape[2:]))
  outs = fn(*folded)
  outs = tuple(o.reshape((axis_size, -1) + o.shape[1:]) for o in outs)
  return outs, (True,) * len(outs)


@functools.cache
def _vmappable(op, kernels, spec, shared: int = 0):
  """op(*args, kernels, spec), vmapped by folding (`_fold_vmap`; `shared`: the number of
  dense terms among the last args)."""
  @jax.custom_batching.custom_vmap
  def call(*args):
    return op(*args, kernels, spec)

  call.def_vmap(lambda axis_size, in_batched, *args: _fold_vmap(call, axis_size, in_batched,
                                                                args, shared))
  return call


def _typed_sharding(x):
  """x's sharding when it is part of its type (explicit mesh axes), else None."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if not any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
    return None
  return sharding if any(e is not None for e in sharding.spec) else None


def _outside_explicit_axes(fn, q, k, results):
  """fn, run with the mesh's explicit axes made automatic when q's or k's type is sharded.

  Under explicit sharding the partition rule still does the work; this only
  keeps the global types away from the kernels' tracing (a Pallas call cannot
  take sharded types) and gives the results their types back. `results` names
  each result's layout: "rows" (like q), "keys" (like k) or "stats" ([B, N, T]).
  """
  qs, ks = _typed_sharding(q), _typed_sharding(k)
  if qs is None and ks is None:
    return fn
  mesh = (qs or ks).mesh
  qs, ks = qs or NamedSharding(mesh, P()), ks or NamedSharding(mesh, P())
  spec = tuple(qs.spec) + (None,) * (4 - len(qs.spec))
  layouts = dict(rows=qs, keys=ks, stats=NamedSharding(mesh, P(spec[0], spec[2], spec[1])))
  return jax.sharding.auto_axes(fn, out_sharding=tuple(layouts[r] for r in results))


def segment_tables(ids, q_lengths, kv_lengths, spec):
  """segments.tables of a call's (q_ids, kv_ids), sharded like the ids.

  Under explicit mesh axes a sort or gather along a sharded sequence axis is refused
  at trace time; the tables are then computed with those axes made automatic (the
  partitioner gathers the ids, each [B, S] int32) and handed back sharded like them.
  """
  none = reference.no_lengths()
  args = (*ids, none if q_lengths is None else q_lengths, none if kv_lengths is None else kv_lengths)
  fn = lambda q_ids, kv_ids, ql, kvl: _segments.tables(q_ids, kv_ids, ql, kvl, spec)  # noqa: E731
  typed = [_typed_sharding(x) for x in args]
  if all(t is None for t in typed):
    return fn(*args)
  mesh = next(t for t in typed if t is not None).mesh
  out = tuple(NamedSharding(mesh, P(*((tuple(t.spec) + (None, None))[:2] if t else ()), None))
              for t in typed[:2])
  return jax.sharding.auto_axes(fn, out_sharding=out)(*args)


@functools.cache
def partitioned(kernels):
  """`kernels` (the interface of _core.KERNELS) behind the partition rules."""

  class Partitioned:
    name = kernels.name

    # The rules and the ring take one head dim: v keeps its own only on one device.
    @staticmethod
    def takes_value_width(call=None):
      return jax.device_count() == 1 and kernels.takes_value_width(call)

    # With one device nothing can be sharded: the kernels are called as they
    # are, which saves the wrappers' tracing (about 50 ms per compiled call).
    @staticmethod
    def forward(q, k, v, q_lengths, kv_lengths, spec, segments=None, alibi=None, dense=None):
      if jax.device_count() == 1 and dense is not None:
        # The FFI call's own vmap rule would fold a bias of one batch element wrongly.
        extra = _Extras.of(segments, alibi, dense)
        call = _vmappable(_call(False, extra), kernels, spec, extra.bias + extra.mask)
        o, lse = call(q, k, v, q_lengths, kv_lengths, *_Extras.operands(segments, alibi, dense))
      elif jax.device_count() == 1:
        o, lse = kernels.forward(q, k, v, q_lengths, kv_lengths, spec, segments=segments,
                                 alibi=alibi, dense=dense)
      else:
        extra = _Extras.of(segments, alibi, dense)
        run = _outside_explicit_axes(_vmappable(_op(False, extra), kernels, spec,
                                                extra.bias + extra.mask), q, k, ("rows", "stats"))
        o, lse = run(q, k, v, q_lengths, kv_lengths, *_Extras.operands(segments, alibi, dense))
      return reference.varying_like(o, q), reference.varying_like(lse, q)

    if hasattr(kernels, "emits_db"):
      # dB beside dQ, dK and dV (derivatives._joint_backward, which vmaps it itself): the
      # kernels' call, on one device only.
      @staticmethod
      def emits_db(*args, **kw):
        return jax.device_count() == 1 and kernels.emits_db(*args, **kw)

    @staticmethod
    def backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec, segments=None,
                 alibi=None, dense=None, with_db=False):
      if with_db:  # (emits_db: one device)
        return kernels.backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec,
                                segments=segments, alibi=alibi, dense=dense, with_db=True)
      if jax.device_count() == 1 and dense is not None:
        extra = _Extras.of(segments, alibi, dense)
        call = _vmappable(_call(True, extra), kernels, spec, extra.bias + extra.mask)
        grads = call(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths,
                     *_Extras.operands(segments, alibi, dense))
      elif jax.device_count() == 1:
        grads = kernels.backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec,
                                 segments=segments, alibi=alibi, dense=dense)
      else:
        extra = _Extras.of(segments, alibi, dense)
        run = _outside_explicit_axes(_vmappable(_op(True, extra), kernels, spec,
                                                extra.bias + extra.mask), q, k,
                                     ("rows", "keys", "keys"))
        grads = run(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths,
                    *_Extras.operands(segments, alibi, dense))
      return tuple(reference.varying_like(g, x) for g, x in zip(grads, (q, k, v)))

    if hasattr(kernels, "bias_gradient"):
      # The dense bias's gradient: the kernels' pass on one device; on several the
      # blockwise jnp one, which the partitioner splits like any jnp.
      @staticmethod
      def bias_gradient(*args, **kw):
        fn = kernels.bias_gradient if jax.device_count() == 1 else derivatives.bias_gradient
        return fn(*args, **kw)

    if hasattr(kernels, "tangent"):
      # Forward mode on one device is the kernels' tangent pass; on several it
      # is the blockwise jnp tangent, which the partitioner splits like any jnp.
      @staticmethod
      def tangent(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, *, spec, segments=None,
                  alibi=None):
        fn = kernels.tangent if jax.device_count() == 1 else derivatives.tangent
        return fn(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, spec=spec,
                  segments=segments, alibi=alibi)

  Partitioned.__name__ = Partitioned.__qualname__ = f"Partitioned{kernels.__name__}"
  return Partitioned
