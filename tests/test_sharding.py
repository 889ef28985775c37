"""Sharded calls on 8 CPU devices: partition rules and ring attention.

* Batch-, head- and batch x head-sharded calls compile, forward and backward
  and under both partitioners (Shardy, GSPMD), to the local kernels with no
  collective at all, and give the unsharded result.
* Sequence-sharded calls (automatic, through the partition rule) and
  `ring_attention` under `shard_map` (2, 4 and 8 shards, both layouts) match
  float64 truth within the DESIGN.md §5 budget, outputs and gradients, with
  causal and windowed masks, GQA and ragged lengths.

The host platform must be split into 8 devices before jax starts its
backends, and the rest of the suite has started them with one; so, run with
fewer devices, this module re-runs itself in a child process with the flag
set (one test in the parent, the real ones in the child).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxflash
from conftest import assert_within_budget, numpy_reference, random_inputs

DEVICES = 8
IN_CHILD = len(jax.devices("cpu")) >= DEVICES


if not IN_CHILD:

  def test_on_8_cpu_devices():
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    print(child.stdout[-3000:])
    assert child.returncode == 0, child.stdout[-20000:] + child.stderr[-5000:]

else:
  from jaxflash import _native
  _native.require("cpu")

COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce)"
                        r"(-start)?\(")
child_only = pytest.mark.skipif(not IN_CHILD, reason="runs in the 8-device child process")


def _mesh(shape, names, auto=False):
  n = int(np.prod(shape))
  types = (AxisType.Auto if auto else AxisType.Explicit,) * len(shape)
  return jax.make_mesh(shape, names, devices=jax.devices()[:n], axis_types=types)


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
  before = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
  yield request.param
  jax.config.update("jax_use_shardy_partitioner", before)


def _collectives(compiled) -> list[str]:
  return sorted({m.group(1) for m in COLLECTIVE.finditer(compiled.as_text())})


def _call(kw, implementation="native"):
  """(q, k, v, do, dlse) -> (o, lse, dq, dk, dv): the forward and its VJP."""
  def run(q, k, v, do, dlse):
    f = lambda q, k, v: jaxflash.dot_product_attention(
        q, k, v, implementation=implementation, return_residual=True,
        residual_dtype=jnp.float32, differentiable_residual=True, **kw)
    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse) + vjp((do, dlse))
  return run


def _inputs(rng, shape, dtype, kw):
  B, T, S, N, K, D = shape
  q, k, v = random_inputs(rng, B, T, S, N, K, D, dtype)
  do = jnp.asarray(rng.standard_normal(q.shape), dtype)
  dlse = jnp.asarray(rng.standard_normal((B, T, N)), jnp.float32)
  if kw.get("query_seq_lengths") is not None:  # rows beyond the lengths carry no cotangent
    dlse = jnp.where(jnp.arange(T)[None, :, None] < kw["query_seq_lengths"][:, None, None],
                     dlse, 0)
  return q, k, v, do, dlse


def _check_against_truth(results, inputs, kw, blocks: int = 1):
  """Forward and gradients within the §5 budget of float64 truth.

  `blocks`: how many kernel calls a ring sums into one gradient (shards x
  pieces per shard); each rounds its share to the input dtype first, which
  the budget allows for. The merged output is a convex combination of block
  outputs, one rounding.
  """
  q, k, v, do, dlse = inputs
  o, lse, dq, dk, dv = results
  D = q.shape[-1]
  left = right = -1
  if kw.get("local_window_size") is not None:
    left, right = kw["local_window_size"]
  if kw.get("is_causal"):
    right = 0 if right < 0 else min(right, 0)
  mask = dict(left=left, right=right, bottom_right=kw.get("causal_alignment") == "bottom_right",
              q_lengths=kw.get("query_seq_lengths"), kv_lengths=kw.get("key_value_seq_lengths"))
  truth_o, truth_lse, _ = numpy_reference.forward(q, k, v, scale=1 / np.sqrt(D), **mask)
  truth = numpy_reference.backward(q, k, v, do, np.transpose(dlse, (0, 2, 1)),
                                   scale=1 / np.sqrt(D), **mask)
  base = jax.jit(_call(kw, "xla"))(*inputs)
  empty = np.transpose(truth_lse == numpy_reference.EMPTY_LSE, (0, 2, 1))
  assert np.array_equal(np.asarray(lse) == numpy_reference.EMPTY_LSE, empty)
  assert_within_budget(o, truth_o, base[0], "output")
  assert_within_budget(np.where(empty, 0, lse), np.where(empty, 0, truth_lse.transpose(0, 2, 1)),
                       np.where(empty, 0, np.asarray(base[1], np.float64)), "lse")
  for name, g, t, b in zip(("dq", "dk", "dv"), (dq, dk, dv), truth, base[2:]):
    assert_within_budget(g, t, b, name, roundings=blocks)


# ------------------------------------------------------------------ local partition rules

# (mesh shape, axis names, PartitionSpec of q, k, v and do, (B, T, S, N, K, D))
LOCAL_CASES = {
    "batch": ((8,), ("x",), P("x"), (8, 24, 24, 4, 2, 16)),
    "heads": ((8,), ("x",), P(None, None, "x"), (1, 24, 24, 16, 8, 16)),
    "batch_x_heads": ((4, 2), ("x", "y"), P("x", None, "y"), (4, 24, 24, 8, 2, 16)),
    "batch_x_heads_gqa4": ((2, 4), ("x", "y"), P("x", None, "y"), (2, 24, 40, 16, 4, 16)),
}


@child_only
@pytest.mark.parametrize("case", list(LOCAL_CASES))
def test_batch_and_head_sharding_has_no_collectives(rng, partitioner, case):
  mesh_shape, names, spec, shape = LOCAL_CASES[case]
  mesh = _mesh(mesh_shape, names)
  kw = dict(is_causal=True, causal_alignment="bottom_right")
  inputs = _inputs(rng, shape, jnp.float32, kw)
  rows, keys = NamedSharding(mesh, spec), NamedSharding(mesh, spec)
  stats = NamedSharding(mesh, P(spec[0] if len(spec) else None, None,
                                spec[2] if len(spec) > 2 else None))
  placed = [jax.device_put(x, s) for x, s in zip(inputs, (rows, keys, keys, rows, stats))]
  fwd = jax.jit(lambda q, k, v: jaxflash.dot_product_attention(q, k, v, implementation="native",
                                                               **kw))
  fwd_bwd = jax.jit(_call(kw))
  assert _collectives(fwd.lower(*placed[:3]).compile()) == []
  assert _collectives(fwd_bwd.lower(*placed).compile()) == []
  results = fwd_bwd(*placed)
  unsharded = fwd_bwd(*inputs)
  for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), results, unsharded):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6, err_msg=name)
  assert results[2].sharding.is_equivalent_to(placed[0].sharding, 4)


@child_only
def test_pallas_batch_x_heads_has_no_collectives(rng, partitioner):
  mesh_shape, names, spec, shape = LOCAL_CASES["batch_x_heads"]
  mesh = _mesh(mesh_shape, names)
  inputs = _inputs(rng, shape, jnp.float32, {})
  sh = NamedSharding(mesh, spec)
  stats = NamedSharding(mesh, P("x", None, "y"))
  placed = [jax.device_put(x, s) for x, s in zip(inputs, (sh, sh, sh, sh, stats))]
  fwd_bwd = jax.jit(_call(dict(is_causal=True), "pallas"))
  assert _collectives(fwd_bwd.lower(*placed).compile()) == []
  _check_against_truth(fwd_bwd(*placed), inputs, dict(is_causal=True))


@child_only
def test_fewer_kv_heads_than_shards(rng, partitioner):
  """MQA with heads over 4 devices: K/V stay replicated and each shard slices its head.

  The forward needs no collective; the backward sums dK/dV over the head axis.
  """
  mesh = _mesh((4,), ("x",))
  kw = dict(is_causal=True)
  inputs = _inputs(rng, (2, 24, 24, 8, 2, 16), jnp.float32, kw)   # 2 K/V heads, 4 shards
  heads, rep = NamedSharding(mesh, P(None, None, "x")), NamedSharding(mesh, P())
  stats = NamedSharding(mesh, P(None, None, "x"))
  placed = [jax.device_put(x, s) for x, s in zip(inputs, (heads, rep, rep, heads, stats))]
  fwd = jax.jit(lambda q, k, v: jaxflash.dot_product_attention(q, k, v, implementation="native",
                                                               **kw))
  assert _collectives(fwd.lower(*placed[:3]).compile()) == []
  assert _collectives(jax.jit(_call(kw)).lower(*placed).compile()) == ["all-reduce"]
  _check_against_truth(jax.jit(_call(kw))(*placed), inputs, kw)


@child_only
def test_vmap_of_a_sharded_call(rng):
  """vmap folds its axis into the batch, in front of it (custom_vmap): a call
  sharded over heads (or over the vmapped axis) stays local. (Sharded over the
  batch behind the vmapped axis, the fold gathers: documented in README.)"""
  mesh = _mesh((2,), ("x",))
  q, k, v = (jnp.stack([x] * 3) for x in random_inputs(rng, 4, 16, 16, 4, 2, 16, jnp.float32))
  sh = NamedSharding(mesh, P(None, None, None, "x"))
  placed = [jax.device_put(x, sh) for x in (q, k, v)]
  f = jax.jit(jax.vmap(lambda q, k, v: jaxflash.dot_product_attention(
      q, k, v, is_causal=True, implementation="native")))
  assert _collectives(f.lower(*placed).compile()) == []
  np.testing.assert_allclose(f(*placed), f(q, k, v), rtol=1e-6, atol=1e-6)


@child_only
def test_sharded_head_dim_is_gathered(rng):
  """head_dim is never split: the rule replicates it, and the result is right."""
  mesh = _mesh((2,), ("x",))
  inputs = _inputs(rng, (2, 24, 24, 4, 2, 16), jnp.float32, {})
  sh = NamedSharding(mesh, P(None, None, None, "x"))
  placed = [jax.device_put(x, sh) for x in inputs[:4]] + [inputs[4]]
  _check_against_truth(jax.jit(_call({}))(*placed), inputs, {})


# ------------------------------------------------------------------ sequence sharding

MASKS = {
    "causal": dict(is_causal=True),
    "none": {},
    "window": dict(local_window_size=(9, 3)),
    "lengths_causal_bottom_right": dict(is_causal=True, causal_alignment="bottom_right",
                                        lengths=True),
}


def _mask_kwargs(name, rng, B, T, S):
  kw = dict(MASKS[name])
  if kw.pop("lengths", False):
    kw["query_seq_lengths"] = jnp.asarray(rng.integers(T // 3, T + 1, size=B), jnp.int32)
    kw["key_value_seq_lengths"] = jnp.asarray(rng.integers(0, S + 1, size=B), jnp.int32)
  return kw


# (shards, mask, (B, T, S, N, K, D), dtype): every shard count (an odd one too), every
# mask, GQA, q_len != kv_len, and bfloat16 once.
RING_CASES = [
    (2, "causal", (2, 64, 64, 4, 2, 16), jnp.float32),
    (4, "none", (1, 64, 64, 4, 4, 16), jnp.float32),
    (8, "causal", (1, 64, 64, 8, 2, 16), jnp.float32),
    (8, "window", (2, 64, 64, 4, 1, 16), jnp.float32),
    (4, "lengths_causal_bottom_right", (2, 64, 64, 4, 2, 16), jnp.float32),
    (2, "lengths_causal_bottom_right", (2, 32, 48, 4, 2, 16), jnp.float32),
    (3, "causal", (2, 48, 48, 4, 2, 32), jnp.bfloat16),   # odd: the middle shard keeps its half
]
_ring_id = lambda c: f"{c[0]}shards-{c[1]}-{jnp.dtype(c[3]).name}-T{c[2][1]}S{c[2][2]}"


@child_only
@pytest.mark.parametrize("case", RING_CASES, ids=_ring_id)
def test_sequence_sharded_call_runs_the_ring(rng, partitioner, case):
  shards, mask_name, shape, dtype = case
  mesh = _mesh((shards,), ("s",))
  kw = _mask_kwargs(mask_name, rng, shape[0], shape[1], shape[2])
  inputs = _inputs(rng, shape, dtype, kw)
  rows = NamedSharding(mesh, P(None, "s"))
  stats = NamedSharding(mesh, P(None, "s"))
  placed = [jax.device_put(x, s) for x, s in zip(inputs, (rows, rows, rows, rows, stats))]
  f = jax.jit(_call(kw))
  collectives = _collectives(f.lower(*placed).compile())
  assert "all-gather" not in collectives and "collective-permute" in collectives
  results = f(*placed)
  assert results[0].sharding.spec[1] == "s"
  _check_against_truth(results, inputs, kw, blocks=2 * shards)


@child_only
def test_segment_ids_shard_with_their_rows(rng):
  """Packed sequences: ids sharded with the batch run locally (no collective) and give
  the unsharded result; sharded along the sequence they run the ring, still exact."""
  shape = (4, 32, 32, 8, 2, 16)
  ids = jnp.asarray(np.sort(rng.integers(0, 4, (4, 32)), axis=1), jnp.int32)
  kw = dict(is_causal=True, query_segment_ids=ids)
  inputs = _inputs(rng, shape, jnp.float32, kw)
  f = jax.jit(lambda ids, *xs: _call(dict(kw, query_segment_ids=ids))(*xs))
  unsharded = f(ids, *inputs)
  for spec, id_spec in ((P("x", None, "y"), P("x")), (P("x", "y"), P("x", "y"))):
    mesh = _mesh((4, 2), ("x", "y"))
    rows = NamedSharding(mesh, spec)
    stats = NamedSharding(mesh, P(*spec[:3]))   # dlse [B, T, N]
    placed = [jax.device_put(x, s) for x, s in zip(inputs, (rows, rows, rows, rows, stats))]
    placed_ids = jax.device_put(ids, NamedSharding(mesh, id_spec))
    if len(spec) > 2:
      assert _collectives(f.lower(placed_ids, *placed).compile()) == []
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), f(placed_ids, *placed), unsharded):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)


@child_only
def test_alibi_slopes_shard_with_their_heads(rng):
  """ALiBi: slopes split with the query heads run locally (no collective); with the
  sequence sharded the ring measures each block's distances from global positions."""
  shape = (4, 32, 32, 8, 2, 16)
  slopes = (2.0 ** -np.arange(1, 9)).astype(np.float32)
  kw = dict(is_causal=True, causal_alignment="bottom_right", alibi_slopes=slopes,
            key_value_seq_lengths=jnp.array([32, 20, 7, 31], jnp.int32))
  inputs = _inputs(rng, shape, jnp.float32, kw)
  f = jax.jit(_call(kw))
  unsharded = f(*inputs)
  for spec in (P("x", None, "y"), P(None, "y")):
    mesh = _mesh((4, 2), ("x", "y"))
    rows = NamedSharding(mesh, spec)
    stats = NamedSharding(mesh, P(*spec[:3]))   # dlse [B, T, N]
    placed = [jax.device_put(x, s) for x, s in zip(inputs, (rows, rows, rows, rows, stats))]
    if len(spec) > 2:
      assert _collectives(f.lower(*placed).compile()) == []
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), f(*placed), unsharded):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)


@child_only
def test_dense_bias_and_mask_shard_with_their_batch_and_heads(rng, partitioner):
  """A bias [B, N, T, S] and a key-padding mask [B, 1, 1, S] split with the batch and
  the query heads run the kernels locally (no collective); the bias's gradient (a jnp
  pass, which may gather the [B, N, T] row statistics) and a sequence-sharded call (no
  ring for dense terms: the sequences are gathered) are as exact."""
  shape = (4, 24, 40, 8, 4, 16)
  B, T, S, N = shape[:4]
  bias = jnp.asarray(rng.standard_normal((B, N, T, S)), jnp.float32)
  mask = jnp.asarray(rng.random((B, 1, 1, S)) < 0.8)
  q, k, v, do, dlse = _inputs(rng, shape, jnp.float32, {})

  def run(q, k, v, bias, with_bias_grad=True):
    f = lambda q, k, v, b: jaxflash.dot_product_attention(
        q, k, v, b, mask, is_causal=True, implementation="native", return_residual=True,
        residual_dtype=jnp.float32, differentiable_residual=True)
    if not with_bias_grad:
      f = functools.partial(f, b=jax.lax.stop_gradient(bias))
      (o, lse), vjp = jax.vjp(f, q, k, v)
    else:
      (o, lse), vjp = jax.vjp(f, q, k, v, bias)
    return (o, lse) + vjp((do, dlse))
  f = jax.jit(run)
  unsharded = f(q, k, v, bias)
  for spec, dense_spec in ((P("x", None, "y"), P("x", "y")), (P(None, "y"), P())):
    mesh = _mesh((4, 2), ("x", "y"))
    rows = NamedSharding(mesh, spec)
    placed = [jax.device_put(x, rows) for x in (q, k, v)] + [
        jax.device_put(bias, NamedSharding(mesh, dense_spec))]
    if len(spec) > 2:
      local = jax.jit(functools.partial(run, with_bias_grad=False))
      assert _collectives(local.lower(*placed).compile()) == []
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv", "dbias"), f(*placed), unsharded):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)


@child_only
def test_data_times_sequence_parallel(rng):
  """Batch over one mesh axis, sequence over the other (the trainer's --mesh)."""
  mesh = _mesh((2, 4), ("data", "seq"))
  kw = dict(is_causal=True)
  inputs = _inputs(rng, (4, 64, 64, 4, 2, 16), jnp.float32, kw)
  rows = NamedSharding(mesh, P("data", "seq"))
  placed = [jax.device_put(x, rows) for x in inputs]
  f = jax.jit(_call(kw))
  assert "all-gather" not in _collectives(f.lower(*placed).compile())
  _check_against_truth(f(*placed), inputs, kw, blocks=8)


# (shards, layout, mask, (B, T, S, N, K, D))
EXPLICIT_CASES = [
    (2, "zigzag", "causal", (2, 32, 32, 4, 2, 16)),
    (4, "zigzag", "lengths_causal_bottom_right", (2, 64, 64, 4, 1, 16)),
    (8, "zigzag", "window", (1, 64, 64, 4, 2, 16)),
    (8, "contiguous", "causal", (1, 64, 64, 2, 2, 16)),
    (4, "contiguous", "none", (2, 32, 64, 4, 2, 16)),
]


@child_only
@pytest.mark.parametrize("case", EXPLICIT_CASES, ids=lambda c: f"{c[0]}shards-{c[1]}-{c[2]}")
def test_ring_attention_in_shard_map(rng, case):
  shards, layout, mask_name, shape = case
  mesh = _mesh((shards,), ("s",), auto=True)
  kw = _mask_kwargs(mask_name, rng, shape[0], shape[1], shape[2])
  inputs = _inputs(rng, shape, jnp.float32, kw)
  lengths = {k: kw[k] for k in ("query_seq_lengths", "key_value_seq_lengths") if k in kw}
  static = {k: v for k, v in kw.items() if k not in lengths}
  seq = lambda x, axis=1: jaxflash.zigzag_order(x, shards, axis) if layout == "zigzag" else x
  back = lambda x, axis=1: jaxflash.zigzag_restore(x, shards, axis) if layout == "zigzag" else x

  @jax.jit
  def run(q, k, v, do, dlse):
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, "s"), out_specs=P(None, "s"))
    def local(q, k, v, do, dlse):
      f = lambda q, k, v: jaxflash.ring_attention(
          q, k, v, axis_name="s", layout=layout, return_residual=True,
          residual_dtype=jnp.float32, differentiable_residual=True, **lengths, **static)
      (o, lse), vjp = jax.vjp(f, q, k, v)
      return (o, lse) + vjp((do, dlse))
    return [back(x) for x in local(*(seq(x) for x in (q, k, v, do, dlse)))]

  _check_against_truth(run(*inputs), inputs, kw, blocks=2 * shards)


@child_only
@pytest.mark.parametrize("layout, kw, shards", [("zigzag", dict(is_causal=True), 2),
                                                ("contiguous", dict(local_window_size=(9, 4)), 4)])
def test_ring_attention_takes_segment_ids(rng, layout, kw, shards):
  """Packed documents over 2 (zigzag: two pieces a shard) and 4 shards (steps in the
  ring's loop): the key ids travel with their keys; outputs and gradients equal the
  unsharded call's."""
  shape = (2, 64, 64, 4, 2, 16)
  mesh = _mesh((shards,), ("s",), auto=True)
  ids = jnp.asarray(np.sort(rng.integers(0, 5, (2, 64)), axis=1), jnp.int32)
  inputs = _inputs(rng, shape, jnp.float32, kw)
  seq = lambda x, axis=1: jaxflash.zigzag_order(x, shards, axis) if layout == "zigzag" else x
  back = lambda x, axis=1: jaxflash.zigzag_restore(x, shards, axis) if layout == "zigzag" else x

  @jax.jit
  def run(ids, q, k, v, do, dlse):
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, "s"), out_specs=P(None, "s"))
    def local(ids, q, k, v, do, dlse):
      f = lambda q, k, v: jaxflash.ring_attention(
          q, k, v, axis_name="s", layout=layout, return_residual=True, residual_dtype=jnp.float32,
          differentiable_residual=True, query_segment_ids=ids, **kw)
      (o, lse), vjp = jax.vjp(f, q, k, v)
      return (o, lse) + vjp((do, dlse))
    return [back(x) for x in local(*(seq(x) for x in (ids, q, k, v, do, dlse)))]

  unsharded = jax.jit(_call(dict(kw, query_segment_ids=ids)))(*inputs)
  for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), run(ids, *inputs), unsharded):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)

  # Forward mode: the ring's tangent pass builds the same block tables.
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in inputs[:3])

  @jax.jit
  def jvp(ids, q, k, v, tq, tk, tv):
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, "s"), out_specs=P(None, "s"))
    def local(ids, q, k, v, tq, tk, tv):
      f = lambda q, k, v: jaxflash.ring_attention(q, k, v, axis_name="s", layout=layout,
                                                  query_segment_ids=ids, **kw)
      return jax.jvp(f, (q, k, v), (tq, tk, tv))[1]
    return back(local(*(seq(x) for x in (ids, q, k, v, tq, tk, tv))))

  want = jax.jit(lambda p, t: jax.jvp(lambda q, k, v: jaxflash.dot_product_attention(
      q, k, v, query_segment_ids=ids, **kw), p, t)[1])(inputs[:3], tangents)
  np.testing.assert_allclose(np.asarray(jvp(ids, *inputs[:3], *tangents)), np.asarray(want),
                             rtol=1e-4, atol=1e-4)


def _same_nonfinite_and_close(actual, expected, name):
  """NaN exactly where the unsharded call has it, the rest within float32 rounding."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert np.array_equal(np.isnan(actual), np.isnan(expected)), f"{name}: NaN elsewhere"
  np.testing.assert_allclose(np.nan_to_num(actual), np.nan_to_num(expected), rtol=1e-4, atol=1e-5,
                             err_msg=name)


@child_only
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_nan_row_and_empty_rows_match_unsharded(rng, layout):
  """A NaN in one query row and rows that see nothing (lengths 0, a batch
  element with no keys): the ring gives the unsharded call's output, LSE
  (the empty-row value included) and gradients, NaN in the same places."""
  shards, (B, T, N, K, D) = 4, (3, 32, 4, 2, 16)
  mesh = _mesh((shards,), ("s",), auto=True)
  q, k, v = random_inputs(rng, B, T, T, N, K, D, jnp.float32)
  q = q.at[0, 5, 1].set(jnp.nan)
  do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  lengths = dict(query_seq_lengths=jnp.array([T, 0, T - 5], jnp.int32),
                 key_value_seq_lengths=jnp.array([T - 3, T, 0], jnp.int32))

  def vjp_of(f):
    (o, lse), pull = jax.vjp(f, q, k, v)
    return (o, lse) + pull((do, jnp.zeros_like(lse)))

  seq = lambda x: jaxflash.zigzag_order(x, shards, 1) if layout == "zigzag" else x
  back = lambda x: jaxflash.zigzag_restore(x, shards, 1) if layout == "zigzag" else x

  @jax.jit
  def ring(q, k, v, do):
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, "s"), out_specs=P(None, "s"))
    def local(q, k, v, do):
      f = lambda q, k, v: jaxflash.ring_attention(
          q, k, v, axis_name="s", layout=layout, is_causal=True, return_residual=True,
          residual_dtype=jnp.float32, **lengths)
      (o, lse), pull = jax.vjp(f, q, k, v)
      return (o, lse) + pull((do, jnp.zeros_like(lse)))
    return [back(x) for x in local(*(seq(x) for x in (q, k, v, do)))]

  expected = vjp_of(lambda q, k, v: jaxflash.dot_product_attention(
      q, k, v, is_causal=True, implementation="native", return_residual=True,
      residual_dtype=jnp.float32, **lengths))
  got = ring(q, k, v, do)
  assert np.isnan(np.asarray(expected[0])[0, 5, 1]).all() and np.isfinite(expected[0][1]).all()
  assert (np.asarray(got[1])[1] == numpy_reference.EMPTY_LSE).all()
  for name, a, e in zip(("o", "lse", "dq", "dk", "dv"), got, expected):
    _same_nonfinite_and_close(a, e, name)


@child_only
def test_ring_forward_mode_matches_unsharded(rng):
  """jax.jvp through ring_attention (the ring's own tangent) equals the
  unsharded call's, output and LSE; Hessian-vector products are refused."""
  shards, (B, T, N, K, D) = 4, (2, 32, 4, 2, 16)
  mesh = _mesh((shards,), ("s",), auto=True)
  q, k, v = random_inputs(rng, B, T, T, N, K, D, jnp.float32)
  tq, tk, tv = random_inputs(rng, B, T, T, N, K, D, jnp.float32)
  kw = dict(is_causal=True, local_window_size=(9, 0), return_residual=True,
            residual_dtype=jnp.float32, differentiable_residual=True)

  @jax.jit
  def ring(*args):
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, "s"), out_specs=P(None, "s"))
    def local(q, k, v, tq, tk, tv):
      f = lambda q, k, v: jaxflash.ring_attention(q, k, v, axis_name="s", **kw)
      primal, tangent = jax.jvp(f, (q, k, v), (tq, tk, tv))
      return primal + tangent
    return local(*args)

  f = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, implementation="native", **kw)
  primal, tangent = jax.jvp(f, (q, k, v), (tq, tk, tv))
  for name, a, e in zip(("o", "lse", "t_o", "t_lse"), ring(q, k, v, tq, tk, tv), primal + tangent):
    _same_nonfinite_and_close(a, e, name)

  @jax.jit
  def hvp(q, k, v, tq):
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, "s"), out_specs=P(None, "s"))
    def local(q, k, v, tq):
      loss = lambda q: jaxflash.ring_attention(q, k, v, axis_name="s", is_causal=True).sum()
      return jax.jvp(jax.grad(loss), (q,), (tq,))[1]
    return local(q, k, v, tq)

  with pytest.raises(NotImplementedError, match="second derivatives"):
    hvp(q, k, v, tq)


@child_only
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_grad_in_shard_map_matches_unsharded(rng, jit):
  """dot_product_attention inside shard_map, as in jax-ml/jax#36008 (q, k, v
  split from one array sharded over batch and heads, causal, the gradient of
  a loss), jitted and eager: the unsharded call's loss and gradient. With no
  lengths given, no operand of the manual computation may be empty
  (attention._no_lengths); one such crashed XLA under jax 0.11."""
  mesh = _mesh((2, 2), ("dp", "tp"), auto=True)
  qkv = jnp.asarray(rng.standard_normal((4, 16, 4, 48)), jnp.float32)

  def attn(qkv):
    q, k, v = jnp.split(qkv, 3, axis=-1)
    return jaxflash.dot_product_attention(q, k, v, is_causal=True, implementation="native")

  spec = P("dp", None, "tp")
  sharded = jax.shard_map(attn, mesh=mesh, in_specs=spec, out_specs=spec)
  loss = lambda f: jax.value_and_grad(lambda x: (f(x) ** 2).sum())
  got = (jax.jit(loss(sharded)) if jit else loss(sharded))(qkv)
  for name, a, e in zip(("loss", "grad"), got, jax.jit(loss(attn))(qkv)):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=name)


def _per_device_bytes(loss, sharding, shape):
  """XLA's buffer assignment of grad(loss) (arguments + outputs + temps - aliased), per device."""
  arg = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(sharding,) * 4,
                 out_shardings=(sharding,) * 3)
  m = step.lower(arg, arg, arg, arg).compile().memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


@child_only
def test_ring_memory_per_device():
  """The ring's per-device buffers against one device's, forward+backward, 2 shards.

  Guards what design.md (Memory) measured: ring_attention on zigzag data 1.06x of
  one device (it was 1.15x while every operand was split into its pieces up front),
  the automatic causal ring 1.31x (its mirror re-layout's received halves; 1.37x with
  the zigzag re-layout it replaced). The backward's fold of O into dLSE
  (`ring.fold_output`) took this program 1.18x -> 1.31x: XLA CPU's row-sum fusion
  reads float32 copies of dO and O, made early. On two H200s the same fold took the
  per-GPU peak 0.845x -> 0.787x of one GPU (the GPU fuses the row sum). Compiles only.
  """
  shape = (1, 1024, 4, 128)
  one = NamedSharding(_mesh((1,), ("s",), auto=True), P())
  mesh = _mesh((2,), ("s",), auto=True)
  rows = NamedSharding(mesh, P(None, "s"))
  dot = lambda o, do: jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

  def automatic(q, k, v, do):
    return dot(jaxflash.dot_product_attention(q, k, v, is_causal=True), do)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, "s"), out_specs=P())
  def explicit(q, k, v, do):
    o = jaxflash.ring_attention(q, k, v, axis_name="s", is_causal=True, layout="zigzag")
    return jax.lax.psum(dot(o, do), "s")

  base = _per_device_bytes(automatic, one, shape)
  assert _per_device_bytes(explicit, rows, shape) <= 1.10 * base
  assert _per_device_bytes(automatic, rows, shape) <= 1.34 * base


@child_only
def test_example_trains_on_a_mesh():
  """examples/train_transformer.py --mesh 2x4: the same loss curve as on one device."""
  pytest.importorskip("flax")
  pytest.importorskip("optax")
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
  try:
    import train_transformer as example
  finally:
    sys.path.pop(0)
  data = example.CharData(example.make_corpus(20_000, seed=5))
  cfg = example.Config(vocab_size=data.vocab_size, seq_len=64, d_model=32, layers=2, heads=4,
                       kv_heads=2, batch=4, steps=6, lr=3e-3, warmup=2)
  _, on_mesh, _ = example.train(cfg, "jaxflash", data, mesh=example.make_mesh("2x4"))
  _, single, _ = example.train(cfg, "jaxflash", data)
  np.testing.assert_allclose(on_mesh, single, rtol=1e-4, atol=1e-5)


@child_only
def test_wide_backward_rule_on_several_devices(rng, monkeypatch):
  """The wide forward's gradients (wide_gradients.backward) where the partition rules trace them
  inside custom_partitioning, as on a host of several GPUs: no captured constant (the row
  groups' `.at[:, lo:hi].add` was a scatter with a constant index array, which the rules
  refuse), the same checks as on one device."""
  import test_native
  test_native.test_wide_backward_rule_on_the_cpu(rng, monkeypatch)


def test_zigzag_order_round_trip():
  x = jnp.arange(2 * 24 * 3).reshape(2, 24, 3)
  z = jaxflash.zigzag_order(x, 3)
  # Shard 0 of 3 holds chunks 0 and 5 of 6 (4 positions each).
  np.testing.assert_array_equal(z[0, :8, 0] // 3 % 24, [0, 1, 2, 3, 20, 21, 22, 23])
  np.testing.assert_array_equal(jaxflash.zigzag_restore(z, 3), x)
  with pytest.raises(ValueError, match="equal chunks"):
    jaxflash.zigzag_order(x, 5)


def test_ring_attention_refuses_bad_calls():
  q = jnp.zeros((1, 7, 2, 8))
  with pytest.raises(ValueError, match="layout"):
    jaxflash.ring_attention(q, q, q, axis_name="s", layout="striped")
  with pytest.raises(ValueError, match="implementation"):
    jaxflash.ring_attention(q, q, q, axis_name="s", implementation="xla")


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name", ["causal", "window", "lengths_causal_bottom_right"])
def test_ring_on_gpus(rng, mask_name):
  """The automatic ring over every GPU (two or more), bf16, against float64 truth."""
  gpus = jax.devices("gpu")
  if len(gpus) < 2:
    pytest.skip("needs two GPUs")
  mesh = jax.make_mesh((len(gpus),), ("s",), devices=gpus, axis_types=(AxisType.Auto,))
  shape = (2, 1024, 1024, 8, 2, 128)
  kw = _mask_kwargs(mask_name, rng, shape[0], shape[1], shape[2])
  inputs = _inputs(rng, shape, jnp.bfloat16, kw)
  rows = NamedSharding(mesh, P(None, "s"))
  placed = [jax.device_put(x, rows) for x in inputs]
  _check_against_truth(jax.jit(_call(kw))(*placed), inputs, kw, blocks=2 * len(gpus))
