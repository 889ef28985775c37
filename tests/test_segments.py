"""Segment ids (packed sequences): the native and Pallas kernels against float64 truth.

`query_segment_ids` / `key_value_segment_ids` let row i see key j only where the
ids agree (numpy_reference.visible's `segments`). The kernels find their tiles
from the tables of jaxflash/segments.py; these tests give them ids of every
kind: documents packed in order (exact intervals, tiles of other documents
skipped), runs in shuffled order (exact intervals that are not monotone) and
ids drawn at random (intervals with gaps: the per-element comparison), with
every mask, GQA 1/4/8, ragged lengths and both alignments.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from conftest import HAS_GPU, diagonal, random_inputs
from jaxflash import segments as seg_lib
from jaxflash._core import MaskSpec
from test_native import check_forward, check_gradients


def packed(rng, B, T, S, documents=4):
  """Documents of random lengths one after another; query and key rows of a
  self-attention call (T == S) share them, a cross-attention call splits both
  sides into the same number of documents."""
  def cut(n):
    def row():
      edges = np.sort(rng.choice(np.arange(1, max(n, 2)), size=min(documents, max(n - 1, 1)) - 1,
                                 replace=False)) if n > 1 else np.zeros(0, int)
      return np.searchsorted(edges, np.arange(n), side="right")
    return np.stack([row() for _ in range(B)])
  q_ids = cut(T).astype(np.int32)
  return q_ids, (q_ids if S == T else cut(S).astype(np.int32))


def shuffled_runs(rng, B, T, S):
  """Packed documents whose ids run in a random order (each id one run)."""
  q_ids, kv_ids = packed(rng, B, T, S)
  perm = rng.permutation(8).astype(np.int32)
  return perm[q_ids], perm[kv_ids]


def scattered(rng, B, T, S):
  """Ids drawn at random from three values: every interval has gaps."""
  return (rng.integers(0, 3, (B, T)).astype(np.int32), rng.integers(0, 3, (B, S)).astype(np.int32))


KINDS = {"packed": packed, "shuffled_runs": shuffled_runs, "scattered": scattered}
# (B, T, S, N, K, D): GQA 1, 4 and 8; self- and cross-attention; ragged sizes.
SHAPES = [(2, 70, 70, 4, 4, 32), (1, 45, 83, 8, 2, 40), (2, 64, 64, 8, 1, 64)]
MASKS = ["none", "causal", "window", "lengths_causal_bottom_right"]


# Every kind of ids with every mask, each mask on its own shape (the CPU suite stays lean).
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mask, shape", list(zip(MASKS, SHAPES + SHAPES[:1])))
def test_native_forward(rng, shape, mask, kind):
  check_forward(rng, shape, mask, jnp.float32, segments=KINDS[kind])


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mask, shape, dtype", [("lengths_causal_bottom_right", SHAPES[1], jnp.bfloat16),
                                                ("window", SHAPES[2], jnp.float32)])
def test_native_gradients(rng, kind, mask, shape, dtype):
  check_gradients(rng, shape, mask, dtype, segments=KINDS[kind])


def test_with_soft_cap(rng):
  check_forward(rng, SHAPES[0], "causal", jnp.bfloat16, magnitude=2.0, softcap=5.0, segments=packed)
  check_gradients(rng, SHAPES[0], "causal", jnp.float32, magnitude=2.0, softcap=5.0,
                  segments=scattered)


def test_forward_mode_and_vmap(rng):
  q, k, v = random_inputs(rng, 2, 33, 33, 4, 2, 16, jnp.float32)
  q_ids, _ = packed(rng, 2, 33, 33)
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v))
  f = lambda impl: lambda q, k, v: jaxflash.dot_product_attention(
      q, k, v, is_causal=True, query_segment_ids=q_ids, implementation=impl)
  jvp = lambda impl: jax.jit(lambda p, t: jax.jvp(f(impl), p, t)[1])((q, k, v), tangents)
  np.testing.assert_allclose(jvp("native"), jvp("xla"), rtol=1e-4, atol=1e-4)
  # vmap over a leading axis, the ids mapped with the inputs.
  ids = np.stack([q_ids, q_ids[::-1]])
  g = lambda impl: jax.jit(jax.vmap(lambda q, k, v, i: jaxflash.dot_product_attention(
      q, k, v, query_segment_ids=i, implementation=impl)))
  stacked = tuple(jnp.stack([x, x]) for x in (q, k, v))
  np.testing.assert_allclose(g("native")(*stacked, ids), g("xla")(*stacked, ids), rtol=1e-5,
                             atol=1e-5)


def test_leading_batch_axes(rng):
  q, k, v = random_inputs(rng, 6, 20, 20, 2, 2, 16, jnp.float32)
  q_ids, _ = packed(rng, 6, 20, 20)
  shaped = lambda x: x.reshape((2, 3) + x.shape[1:])
  f = lambda impl: jax.jit(lambda q, k, v, ids: jaxflash.dot_product_attention(
      q, k, v, is_causal=True, query_segment_ids=ids, implementation=impl))(
          *(shaped(x) for x in (q, k, v, q_ids)))
  np.testing.assert_allclose(f("native"), f("xla"), rtol=1e-5, atol=1e-5)


def test_nan_in_another_segment_reaches_nothing(rng):
  """A NaN in one document's keys and values stays there, sorted ids or not."""
  B, T, N, D = 1, 48, 2, 16
  q, k, v = random_inputs(rng, B, T, T, N, N, D, jnp.float32)
  for q_ids in (np.repeat(np.arange(3, dtype=np.int32), 16)[None],
                np.tile(np.arange(3, dtype=np.int32), 16)[None]):
    poisoned = q_ids[0] == 1
    k_bad = jnp.where(poisoned[None, :, None, None], jnp.nan, k)
    v_bad = jnp.where(poisoned[None, :, None, None], jnp.nan, v)
    f = lambda k, v: jaxflash.dot_product_attention(q, k, v, query_segment_ids=q_ids,
                                                    implementation="native")
    out = np.asarray(f(k_bad, v_bad))
    assert np.all(np.isnan(out[0, poisoned])), "the poisoned document sees its NaN"
    np.testing.assert_allclose(out[0, ~poisoned], np.asarray(f(k, v))[0, ~poisoned], rtol=1e-6)
    grads = jax.grad(lambda k, v: jnp.sum(jnp.where(poisoned[None, :, None, None], 0, f(k, v))),
                     argnums=(0, 1))(k_bad, v_bad)
    for g in grads:
      assert np.all(np.isfinite(np.asarray(g)[0, ~poisoned]))


def test_rows_without_a_key_of_their_segment(rng):
  """Query ids with no key of their id are empty rows: zeros, the empty LSE."""
  q, k, v = random_inputs(rng, 1, 12, 10, 2, 1, 16, jnp.float32)
  q_ids = np.array([[0, 0, 5, 5, 1, 1, 1, 7, 7, 2, 2, 2]], np.int32)
  kv_ids = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]], np.int32)
  for impl in ("native", "xla"):
    out, lse = jaxflash.dot_product_attention(q, k, v, query_segment_ids=q_ids,
                                              key_value_segment_ids=kv_ids, return_residual=True,
                                              residual_dtype=jnp.float32, implementation=impl)
    empty = np.isin(q_ids[0], [5, 7])
    assert np.all(np.asarray(out)[0, empty] == 0)
    assert np.all(np.asarray(lse)[0, empty] == np.finfo(np.float32).min)


# Windows (left, right; -1 unbounded) of the table checks: none, causal, both sides, left only.
WINDOWS = [(-1, -1), (-1, 0), (5, 2), (3, -1)]


def _tables(spec):
  """segments.tables of `spec`, run op by op: each operation compiles once per shape and
  serves every window, where a jitted call compiles each window's whole program (~5 s)."""
  return lambda q_ids, kv_ids, q_len: seg_lib.tables(q_ids, kv_ids, q_len, None, spec)


def test_tables_against_brute_force(rng):
  """segments.tables: each position's exact interval, gap flag, non-decreasing
  envelopes and run ends, against the dense mask, over random calls."""
  for (T, S), (left, right), kind in itertools.product(((1, 1), (21, 21), (13, 29)), WINDOWS,
                                                      KINDS.values()):
    B = 2
    q_ids, kv_ids = kind(rng, B, T, S)
    spec = MaskSpec(scale=1.0, window_left=left, window_right=right, bottom_right=left == 3)
    q_len = jnp.asarray(rng.integers(0, T + 1, B), jnp.int32)
    tables = _tables(spec)(jnp.asarray(q_ids), jnp.asarray(kv_ids), q_len)
    vis = np.asarray(jaxflash.reference.visible_mask(
        T, S, query_seq_lengths=q_len, window_left=None if spec.window_left < 0 else spec.window_left,
        window_right=None if spec.window_right < 0 else spec.window_right,
        bottom_right=spec.bottom_right, batch=B, segment_ids=(q_ids, kv_ids)))[:, 0]
    for table, v in zip(tables, (vis, vis.transpose(0, 2, 1))):
      table = np.asarray(table)
      for b in range(B):
        for i in range(v.shape[1]):
          seen = np.nonzero(v[b, i])[0]
          f = table[b, i]
          assert f[seg_lib.ID] == (q_ids if v is vis else kv_ids)[b, i]
          if len(seen):
            assert (f[seg_lib.BEGIN], f[seg_lib.END]) == (seen[0], seen[-1] + 1)
            assert f[seg_lib.GAP_FREE] == (len(seen) == seen[-1] + 1 - seen[0])
          else:
            assert f[seg_lib.BEGIN] >= f[seg_lib.END]
          later = [np.nonzero(v[b, j])[0][0] for j in range(i, v.shape[1]) if v[b, j].any()]
          earlier = [np.nonzero(v[b, j])[0][-1] + 1 for j in range(i + 1) if v[b, j].any()]
          assert f[seg_lib.ENV_BEGIN] <= min(later, default=v.shape[2])
          assert f[seg_lib.ENV_END] >= max(earlier, default=0)
        ids = (q_ids if v is vis else kv_ids)[b]
        for i in range(len(ids)):
          end = f_end = table[b, i, seg_lib.RUN_END]
          assert np.all(ids[i:end] == ids[i]) and (f_end == len(ids) or ids[f_end] != ids[i])


def test_full_tiles_hide_nothing(rng):
  """MaskPolicy::FullKeys with segment tables (mask.h), mirrored here: over random
  ids, windows and lengths, a block of rows it calls full on some keys sees all of
  them. (A row that sees nothing once bounded the block with an empty interval
  of [0, 0): 630 false blocks in 400 random calls; now its [S, 0) empties it.)"""
  for (T, S), (left, right), kind in itertools.product(((24, 24), (19, 27)), WINDOWS, KINDS.values()):
    q_ids, kv_ids = kind(rng, 1, T, S)
    spec = MaskSpec(scale=1.0, window_left=left, window_right=right)
    q_len = jnp.asarray(rng.integers(0, T + 1, 1), jnp.int32)
    table = np.asarray(_tables(spec)(jnp.asarray(q_ids), jnp.asarray(kv_ids), q_len)[0])[0]
    vis = np.asarray(jaxflash.reference.visible_mask(
        T, S, query_seq_lengths=q_len, window_left=None if spec.window_left < 0 else spec.window_left,
        window_right=None if spec.window_right < 0 else spec.window_right,
        segment_ids=(q_ids, kv_ids)))[0, 0]
    for r0 in range(T):
      for r1 in range(r0 + 1, int(q_len[0]) + 1):
        last = r1 - 1
        if (table[r0, seg_lib.RUN_END] < r1 or not table[r0, seg_lib.GAP_FREE] or
            not table[last, seg_lib.GAP_FREE]):
          continue
        begin, end = table[last, seg_lib.BEGIN], table[r0, seg_lib.END]
        assert begin >= end or vis[r0:r1, begin:end].all(), (q_ids, kv_ids, spec, r0, r1)


# On a GPU: the tensor-core kernels (16-bit; the sm80 family forced too), the
# SIMT kernels (float32) and a decode step, forward and backward.
# The fast tier runs each id layout and mask once in bfloat16 (the diagonal) and the float16 and
# float32 cases; the slow tier the rest of the bfloat16 grid.
GPU_CASES = (diagonal([(jnp.bfloat16, kind) for kind in KINDS],
                      ["causal", "lengths_causal_bottom_right", "window"]) +
             [(jnp.float16, "packed", "causal"), (jnp.float16, "scattered", "window"),
              (jnp.float32, "packed", "causal"), (jnp.float32, "scattered", "lengths_causal_bottom_right")])


@pytest.mark.parametrize("kind, mask", [("packed", "causal"),
                                        ("scattered", "lengths_causal_bottom_right")])
def test_pallas(rng, kind, mask):
  """The Pallas kernels read the same tables (the CPU interpreter here): forward,
  dQ and dK/dV with their block ranges from the tables' envelopes and runs, the
  tangent kernel; a short query runs the unsplit kernel, not decode's."""
  shape = (1, 24, 40, 2, 1, 16)
  check_forward(rng, shape, mask, jnp.float32, implementation="pallas", segments=KINDS[kind])
  check_gradients(rng, shape, mask, jnp.float32, implementation="pallas", segments=KINDS[kind])
  if kind != "packed":
    return
  check_forward(rng, (2, 2, 40, 2, 1, 16), mask, jnp.float32, implementation="pallas",
                segments=KINDS[kind])
  q, k, v = random_inputs(rng, 1, 24, 24, 2, 1, 16, jnp.float32)
  ids = jnp.asarray(packed(rng, 1, 24, 24)[0])
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v))
  f = lambda impl: lambda q, k, v: jaxflash.dot_product_attention(
      q, k, v, is_causal=True, query_segment_ids=ids, implementation=impl)
  jvp = lambda impl: jax.jit(lambda p, t: jax.jvp(f(impl), p, t)[1])((q, k, v), tangents)
  np.testing.assert_allclose(np.asarray(jvp("pallas")), np.asarray(jvp("xla")), atol=2e-5)


def _paged_case(rng, B=2, T=3, pages=6, page_size=8, N=4, K=2, D=16, dtype=jnp.float32):
  """A paged cache of packed prompts: the new query rows carry the ids of the documents
  their sequence is in, each cached key the id of its document."""
  max_pages = pages // B
  S = max_pages * page_size
  q = jnp.asarray(rng.standard_normal((B, T, N, D)), dtype)
  kp, vp = (jnp.asarray(rng.standard_normal((pages, page_size, K, D)), dtype) for _ in range(2))
  table = jnp.asarray(rng.permutation(pages).reshape(B, max_pages), jnp.int32)
  lengths = jnp.asarray([S, S - 5], jnp.int32)[:B]
  kv_ids = np.stack([np.sort(rng.integers(0, 3, S)) for _ in range(B)]).astype(np.int32)
  q_ids = np.stack([kv_ids[b, int(lengths[b]) - T:int(lengths[b])] for b in range(B)])
  return q, kp, vp, table, lengths, jnp.asarray(q_ids), jnp.asarray(kv_ids)


def test_paged(rng):
  """paged_attention with segment ids: the native kernels read the tables by the cache's
  logical positions (decode and a prefill chunk), equal to gathering the pages into xla."""
  for T in (1, 3):
    q, kp, vp, table, lengths, q_ids, kv_ids = _paged_case(rng, T=T)
    run = lambda impl, **kw: jax.jit(lambda q, kp, vp, table, lengths, q_ids, kv_ids: (  # noqa: E731
        jaxflash.paged_attention(q, kp, vp, table, lengths, query_segment_ids=q_ids,
                                 key_value_segment_ids=kv_ids, implementation=impl, **kw)))(
        q, kp, vp, table, lengths, q_ids, kv_ids)
    np.testing.assert_allclose(np.asarray(run("native")), np.asarray(run("xla")), atol=2e-5)
    np.testing.assert_allclose(np.asarray(run("native", local_window_size=(5, 0))),
                               np.asarray(run("xla", local_window_size=(5, 0))), atol=2e-5)
    plain = jaxflash.paged_attention(q, kp, vp, table, lengths)
    assert float(jnp.max(jnp.abs(run("native") - plain))) > 1e-3   # the ids changed the result
  with pytest.raises(ValueError, match="key_value_segment_ids"):
    jaxflash.paged_attention(q, kp, vp, table, lengths, query_segment_ids=q_ids)
  with pytest.raises(ValueError, match="split-KV"):
    jaxflash.paged_attention(q, kp, vp, table, lengths, query_segment_ids=q_ids,
                             key_value_segment_ids=kv_ids, num_splits=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_paged(rng, dtype):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  for T in (1, 4, 16):
    q, kp, vp, table, lengths, q_ids, kv_ids = _paged_case(rng, T=T, pages=64, page_size=16,
                                                           N=8, K=2, D=128, dtype=dtype)
    run = lambda impl: jaxflash.paged_attention(  # noqa: E731
        q, kp, vp, table, lengths, query_segment_ids=q_ids, key_value_segment_ids=kv_ids,
        implementation=impl)
    np.testing.assert_allclose(np.asarray(run("native"), np.float32),
                               np.asarray(run("xla"), np.float32), atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_gpu_pallas(rng, dtype):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  for kind, mask in (("packed", "causal"), ("scattered", "lengths_causal_bottom_right")):
    for shape in [(2, 300, 300, 4, 2, 64), (1, 200, 260, 8, 1, 128)]:
      check_forward(rng, shape, mask, dtype, implementation="pallas", segments=KINDS[kind])
      check_gradients(rng, shape, mask, dtype, implementation="pallas", segments=KINDS[kind])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, kind, mask", GPU_CASES)
def test_gpu_kernels(rng, dtype, kind, mask):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  for shape in [(2, 300, 300, 4, 2, 64), (1, 333, 333, 8, 1, 128), (1, 200, 260, 2, 2, 256),
                (2, 190, 190, 4, 4, 96)]:
    check_forward(rng, shape, mask, dtype, segments=KINDS[kind])
    check_gradients(rng, shape, mask, dtype, segments=KINDS[kind])
  check_forward(rng, (2, 4, 700, 8, 1, 128), mask, dtype, segments=KINDS[kind])   # decode


@pytest.mark.gpu
def test_gpu_sm80_kernels(rng):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  from jaxflash import _native
  with _native.forced_tile(0, sm80=True):
    for kind in KINDS.values():
      check_forward(rng, (1, 300, 300, 4, 2, 64), "causal", jnp.bfloat16, segments=kind)
      check_gradients(rng, (1, 300, 300, 4, 2, 128), "causal", jnp.bfloat16, segments=kind)


@pytest.mark.gpu
def test_gpu_table_kernel_equals_the_definition(rng):
  """The GPU kernel's tables (segment_tables.cu) equal segments.py's XLA definition field
  for field: every kind of ids, every window, both alignments, lengths on both sides,
  diagonal offsets, one position to the kernel's longest side, many scan chunks, vmap."""
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  sizes = [(1, 1), (21, 21), (13, 29), (700, 700), (2500, 1900), (4096, 4096),
           (seg_lib.MAX_KERNEL_LENGTH, seg_lib.MAX_KERNEL_LENGTH)]
  for (T, S), (left, right) in itertools.product(sizes, WINDOWS):
    B = 2
    kind = list(KINDS.values())[rng.integers(len(KINDS))]
    q_ids, kv_ids = (jnp.asarray(x) for x in kind(rng, B, T, S))
    if T == S and rng.integers(2):
      kv_ids = q_ids                    # self-attention: one array both sides
    spec = MaskSpec(scale=1.0, window_left=left, window_right=right,
                    bottom_right=bool(rng.integers(2)))
    lengths = lambda n: jnp.asarray(rng.integers(0, n + 1, B), jnp.int32)  # noqa: E731
    args = (q_ids, kv_ids, lengths(T), lengths(S),
            jnp.asarray(rng.integers(-S, T + 1, B), jnp.int32))
    got = jax.jit(functools.partial(seg_lib._tables_kernel, spec=spec))(*args)
    want = jax.jit(functools.partial(seg_lib._tables_xla, spec=spec, same=False))(*args)
    for g, w, side in zip(got, want, ("query", "key")):
      g, w = np.asarray(g), np.asarray(w)
      bad = np.argwhere(g != w)
      assert bad.size == 0, (f"{side} table T={T} S={S} window=({left}, {right}) {kind.__name__}: "
                             f"{len(bad)} fields differ, first {bad[0]}: {g[tuple(bad[0])]} != "
                             f"{w[tuple(bad[0])]}")
  # Under vmap the handler folds the mapped axis into the batch.
  q_ids, kv_ids = (jnp.asarray(x) for x in packed(rng, 6, 300, 300))
  spec = MaskSpec(scale=1.0, window_left=-1, window_right=0)
  f = lambda table: jax.vmap(lambda q, kv: table(q, kv, reference_none, reference_none,  # noqa: E731
                                                 reference_none, spec=spec))
  reference_none = jaxflash.reference.no_lengths()
  got = jax.jit(f(seg_lib._tables_kernel))(q_ids.reshape(3, 2, 300), kv_ids.reshape(3, 2, 300))
  want = seg_lib._tables_xla(q_ids, kv_ids, reference_none, reference_none, reference_none,
                             spec=spec, same=False)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g).reshape(w.shape), np.asarray(w))


@pytest.mark.gpu
def test_gpu_forward_claims_its_tiles(rng):
  """Segment ids on more work tiles than the GPU has SMs: the warp-specialised forward's CTAs
  claim their tiles where the tile has the dynamic walk (sm90/tile_scheduler.cuh). Every tile is
  done (the reference), causal or not, with row counts that leave a consumer's 64 rows past the
  last query (a consumer that sees no key passes over the whole work tile: the first version of
  the walk deadlocked there, and where the other consumer saw many more key tiles); D 128 and
  D 64's two-consumer tile. Then 66 launches of one jitted call on alternating inputs, each
  against xla: the launches wrap the 64 claim slots, so a slot whose counters were not reset
  would skip tiles (and leave the other input's rows in a reused buffer)."""
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  for shape, mask in [((2, 1536, 1536, 8, 2, 128), "causal"), ((2, 1540, 1540, 8, 2, 128), "none"),
                      ((2, 1540, 1540, 8, 2, 128), "lengths_causal_bottom_right"),
                      ((1, 1540, 1540, 16, 4, 64), "none")]:
    for kind in ("packed", "scattered"):
      check_forward(rng, shape, mask, jnp.bfloat16, segments=KINDS[kind])
  B, S, N, K, D = 2, 2048, 16, 4, 128
  inputs = [random_inputs(rng, B, S, S, N, K, D, jnp.bfloat16) for _ in range(2)]
  ids, _ = packed(rng, B, S, S, documents=8)
  run = jax.jit(lambda q, k, v, impl: jaxflash.dot_product_attention(  # noqa: E731
      q, k, v, is_causal=True, query_segment_ids=ids, implementation=impl), static_argnums=3)
  truth = [np.asarray(run(*x, "xla"), np.float32) for x in inputs]
  for i in range(66):
    np.testing.assert_allclose(np.asarray(run(*inputs[i % 2], "native"), np.float32), truth[i % 2],
                               atol=2e-2, err_msg=f"launch {i}")
