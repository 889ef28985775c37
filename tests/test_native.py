"""The native path against float64 truth, with the DESIGN.md §5 error budget.

Runs on the default backend: the C++ kernels on a CPU-only machine (CI), the
CUDA kernels when a GPU is present.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxflash
from jaxflash.pallas import pallas_supported
from cases import MASKS, SHAPES, mask_kwargs, numpy_mask, segment_ids
from conftest import assert_within_budget, numpy_reference, random_inputs

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def attention(q, k, v, implementation="native", **kw):
  """(out, lse) with a differentiable fp32 LSE, so the gradient checks cover dLSE too.
  Jitted, as users call it (eager, the Pallas interpreter dispatches each operation of its
  kernels on its own: a small forward 9.6 s against 4.3 s jitted on a 2-core CPU)."""
  return jax.jit(functools.partial(jaxflash.dot_product_attention, implementation=implementation,
                                   return_residual=True, residual_dtype=jnp.float32,
                                   differentiable_residual=True, **kw))(q, k, v)


def baseline(q, k, v, compute_dtype=None, **kw):
  """The `xla` implementation computed in the input dtype: the error yardstick."""
  scale = 1.0 / np.sqrt(q.shape[-1])
  return jaxflash.reference.attention(
      q, k, v, scale=scale, is_causal=kw.get("is_causal", False),
      causal_alignment=kw.get("causal_alignment", "top_left"),
      local_window_size=kw.get("local_window_size"),
      query_seq_lengths=kw.get("query_seq_lengths"),
      key_value_seq_lengths=kw.get("key_value_seq_lengths"),
      logits_soft_cap=kw.get("logits_soft_cap"), compute_dtype=compute_dtype or q.dtype,
      segment_ids=segment_ids(kw), alibi_slopes=kw.get("alibi_slopes"))


def with_segments(kw, segments):
  """kw with the segment ids `segments` ((q_ids, kv_ids) or None) added."""
  if segments is not None:
    kw["query_segment_ids"], kw["key_value_segment_ids"] = segments
  return kw


def finite_baseline(compute, dtype):
  """`compute(compute_dtype)` in `dtype`, or, where that overflows (float16
  scores beyond 65504 at large magnitudes), in float32 rounded to `dtype`:
  an overflowing baseline gives no yardstick, and the rounded float32 one is
  the stricter of the two."""
  results = compute(dtype)
  if all(np.all(np.isfinite(np.asarray(x, np.float64))) for x in results):
    return results
  return tuple(jnp.asarray(x, dtype) for x in compute(jnp.float32))


def max_logit(q, k, scale) -> float:
  """The largest |scaled score|, for the tolerance rule's exponent term."""
  q, k = (np.asarray(x, np.float64) for x in (q, k))
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  return float(np.max(np.abs(np.einsum("btnd,bsnd->bnts", q, k) * scale), initial=0.0))


def check_forward(rng, shape, mask_name, dtype, magnitude=1.0, implementation="native", inputs=None,
                  softcap=0.0, segments=None, alibi=None, **extra):
  """`inputs(rng, shape, dtype)` replaces the random q, k, v (its scores may
  be large: the budget then counts the largest one, as for magnitude > 1);
  `softcap` > 0 runs the call with that logit soft-cap; `segments` a function
  (rng, B, T, S) -> (q_ids, kv_ids) gives it segment ids; `alibi` ALiBi slopes."""
  B, T, S, N, K, D = shape
  q, k, v = inputs(rng, shape, dtype) if inputs else random_inputs(rng, B, T, S, N, K, D, dtype, magnitude)
  kw = with_segments(mask_kwargs(mask_name, rng, B, T, S), segments and segments(rng, B, T, S))
  if softcap:
    kw["logits_soft_cap"] = softcap
  if alibi is not None:
    kw["alibi_slopes"] = alibi
  out, lse = attention(q, k, v, implementation=implementation, **kw, **extra)
  scale = 1.0 / np.sqrt(D)
  truth_o, truth_lse, _ = numpy_reference.forward(q, k, v, scale=scale, softcap=softcap,
                                                  alibi=alibi, **numpy_mask(kw))
  base_o, base_lse = finite_baseline(
      lambda c: jax.jit(functools.partial(baseline, compute_dtype=c, **kw))(q, k, v), dtype)
  budget = dict(max_logit=max_logit(q, k, scale)) if magnitude > 1 or inputs else {}
  assert out.dtype == q.dtype and out.shape == q.shape
  assert np.all(np.isfinite(np.asarray(lse, np.float64)))
  assert_within_budget(out, truth_o, base_o, "output", **budget)
  lse = np.asarray(lse).transpose(0, 2, 1)  # [B, T, N] -> [B, N, T]
  empty = truth_lse == numpy_reference.EMPTY_LSE
  assert np.array_equal(lse == numpy_reference.EMPTY_LSE, empty), \
      "LSE is the empty-row value exactly on rows with no key"
  assert np.all(np.asarray(out, np.float64)[np.transpose(empty, (0, 2, 1))] == 0)
  assert_within_budget(np.where(empty, 0, lse), np.where(empty, 0, truth_lse),
                       np.where(empty, 0, np.asarray(base_lse, np.float64)), "lse", **budget)


def check_gradients(rng, shape, mask_name, dtype, implementation="native", magnitude=1.0,
                    softcap=0.0, segments=None, alibi=None, **extra):
  B, T, S, N, K, D = shape
  q, k, v = random_inputs(rng, B, T, S, N, K, D, dtype, magnitude)
  kw = with_segments(mask_kwargs(mask_name, rng, B, T, S), segments and segments(rng, B, T, S))
  if softcap:
    kw["logits_soft_cap"] = softcap
  if alibi is not None:
    kw["alibi_slopes"] = alibi
  do = jnp.asarray(rng.standard_normal(q.shape), dtype)
  dlse = jnp.asarray(rng.standard_normal((B, T, N)), jnp.float32)

  def loss(fn, q, k, v):
    o, lse = fn(q, k, v)
    lse = jnp.where(lse == numpy_reference.EMPTY_LSE, 0, lse)  # empty rows carry no gradient
    return (jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) +
            jnp.sum(lse.astype(jnp.float32) * dlse))

  native = functools.partial(attention, implementation=implementation, **kw, **extra)
  grads = jax.jit(jax.grad(functools.partial(loss, native), argnums=(0, 1, 2)))(q, k, v)

  def base_grads(compute_dtype):
    def base_fn(q, k, v):
      o, lse = baseline(q, k, v, compute_dtype=compute_dtype, **kw)
      return o, jnp.transpose(lse, (0, 2, 1))
    return jax.jit(jax.grad(functools.partial(loss, base_fn), argnums=(0, 1, 2)))(q, k, v)
  base = finite_baseline(base_grads, dtype)
  truth = numpy_reference.backward(q, k, v, do, np.asarray(dlse).transpose(0, 2, 1),
                                   scale=1.0 / np.sqrt(D), softcap=softcap, alibi=alibi,
                                   **numpy_mask(kw))
  budget = dict(max_logit=max_logit(q, k, 1.0 / np.sqrt(D))) if magnitude > 1 else {}
  for name, g, b, t in zip(("dq", "dk", "dv"), grads, base, truth):
    assert g.dtype == dtype
    assert_within_budget(g, t, b, name, **budget)


# A curated cross product: every mask on three shapes in every dtype, every
# shape with two masks in float32 and bfloat16.
FORWARD_CASES = (
    [(s, m, d) for s in SHAPES[:3] for m in MASKS for d in DTYPES] +
    [(s, m, d) for s in SHAPES[3:] for m in ("causal_bottom_right", "lengths")
     for d in (jnp.float32, jnp.bfloat16)])


@pytest.mark.parametrize("shape,mask_name,dtype", FORWARD_CASES,
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_forward(rng, shape, mask_name, dtype):
  check_forward(rng, shape, mask_name, dtype)


@pytest.mark.parametrize("shape,mask_name,dtype", FORWARD_CASES,
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_gradients(rng, shape, mask_name, dtype):
  check_gradients(rng, shape, mask_name, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_cpu_backward_schemes_agree(rng, monkeypatch, dtype):
  """The CPU backward's one-pass scheme (room for dQ sums, where (batch, kv head)
  items fill the threads) and its three passes give the same bits, and the one-pass
  scheme meets float64 under the budget: GQA 4, ragged lengths, causal, a window,
  unsorted segment ids (gaps), ALiBi, soft-cap, random dO and dLSE, NaN in the rows
  past the lengths (dQ there is 0, and the NaN reaches no other row)."""
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU kernels' schemes")
  from jaxflash import _native
  B, T, S, N, K, D = 2, 150, 203, 8, 2, 40
  q, k, v = random_inputs(rng, B, T, S, N, K, D, dtype)
  q, k, v = q.at[1, 97:].set(jnp.nan), k.at[1, 120:].set(jnp.nan), v.at[1, 120:].set(jnp.nan)
  ids = lambda n: jnp.asarray(rng.integers(0, 3, (B, n)), jnp.int32)
  kw = dict(query_seq_lengths=jnp.array([150, 97]), key_value_seq_lengths=jnp.array([203, 120]),
            is_causal=True, local_window_size=(90, 0), query_segment_ids=ids(T),
            key_value_segment_ids=ids(S), alibi_slopes=jnp.linspace(0.1, 0.5, N),
            logits_soft_cap=20.0)
  cts = (jnp.asarray(rng.standard_normal(q.shape), dtype),
         jnp.asarray(rng.standard_normal((B, T, N)), jnp.float32))
  grads_of = lambda q, k, v: jax.vjp(lambda *x: attention(*x, **kw), q, k, v)[1](cts)
  grads = {}
  for threads in (1, 64):   # items B * K = 4: they fill one thread, not 64
    monkeypatch.setattr(_native, "cpu_threads", lambda: threads)
    jax.clear_caches()   # newer JAX reuses the last trace
    call, = [line for line in jax.jit(grads_of).lower(q, k, v).as_text().splitlines()
             if "@jaxflash_bwd" in line]
    assert call.rstrip().endswith(f"tensor<{B}x{T}x{N}x{D}xf32>)") == (threads == 1)  # the room
    grads[threads] = [np.asarray(g, np.float32) for g in jax.jit(grads_of)(q, k, v)]
  for one, three in zip(grads[1], grads[64]):
    np.testing.assert_array_equal(one, three)
  assert np.all(grads[1][0][1, 97:] == 0) and np.all(np.isfinite(grads[1][0][:, :97]))
  assert all(np.all(np.isfinite(g[0])) for g in grads[1])
  assert np.all(np.isfinite(grads[1][1][1])) and np.all(np.isfinite(grads[1][2][1]))  # dK, dV
  if dtype == jnp.float32:   # (the float64 check of 16-bit gradients is test_gradients')
    monkeypatch.setattr(_native, "cpu_threads", lambda: 1)
    jax.clear_caches()
    check_gradients(rng, (B, T, S, N, K, D), "causal", dtype)


def test_value_head_dim_of_its_own_on_the_cpu(rng):
  """The CPU kernels read v at its own head dim (MLA: q/k 24, v 40 and 16), unpadded:
  split-KV decode steps, a dense bias and mask with gradients, a Hessian-vector product
  and the paged cache, each against xla."""
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU kernels' value head dim")
  B, T, S, N, K, D = 2, 9, 70, 4, 2, 24
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4,
                                                  atol=2e-5)
  for dv in (40, 16):
    q, k = random_inputs(rng, B, T, S, N, K, D, jnp.float32)[:2]
    v = jnp.asarray(rng.standard_normal((B, S, K, dv)), jnp.float32)
    run = lambda impl, q, k, v, **kw: jaxflash.dot_product_attention(
        q, k, v, implementation=impl, **kw)
    fwd, = [l for l in jax.jit(functools.partial(run, "native")).lower(q, k, v).as_text()
            .splitlines() if "@jaxflash_fwd" in l]
    # On one device v goes unpadded; behind the partition rules (several devices) the
    # narrower side is padded to the wider (sharding.partitioned: the rules take one width).
    width = dv if jax.device_count() == 1 else max(dv, D)
    assert f"tensor<{B}x{S}x{K}x{width}xf32>" in fwd and f"tensor<{B}x{T}x{N}x{width}xf32>" in fwd
    # decode steps in three splits, bottom-right causal, ragged key lengths
    step = dict(is_causal=True, causal_alignment="bottom_right", num_splits=3,
                key_value_seq_lengths=jnp.array([70, 33]))
    decode = lambda impl: jax.jit(functools.partial(run, impl, **step))(q[:, :1], k, v)
    close(decode("native"), decode("xla"))
    # a dense bias and mask, gradients of all four
    bias = jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.float32)
    mask = jnp.asarray(rng.random((B, 1, T, S)) < 0.7)
    loss = lambda impl: lambda q, k, v, b: jnp.sum(
        jnp.sin(run(impl, q, k, v, bias=b, mask=mask, is_causal=True)))
    grads = lambda impl: jax.jit(jax.grad(loss(impl), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for a, b in zip(grads("native"), grads("xla")):
      close(a, b)
    # second order: a Hessian-vector product in q
    hvp = lambda impl: jax.jit(lambda q: jax.jvp(jax.grad(lambda q: loss(impl)(q, k, v, bias)),
                                                 (q,), (jnp.cos(q),))[1])(q)
    close(hvp("native"), hvp("xla"))
    # the paged cache: 9 pages of 8 rows, shuffled
    pages = lambda x: jnp.concatenate([x, jnp.zeros((B, 2, K, x.shape[-1]), x.dtype)], 1).reshape(
        B * 9, 8, K, x.shape[-1])
    table = jnp.asarray(rng.permutation(B * 9).reshape(B, 9), jnp.int32)
    perm = jnp.argsort(table.reshape(-1))
    kp, vp = pages(k)[perm], pages(v)[perm]
    lengths = jnp.array([70, 41], jnp.int32)
    paged = lambda impl: jax.jit(functools.partial(jaxflash.paged_attention,
                                                   implementation=impl))(q[:, :2], kp, vp, table,
                                                                         lengths)
    got = paged("native")
    assert got.shape == (B, 2, N, dv)
    close(got, paged("xla"))


@pytest.mark.parametrize("implementation", ["native", "pallas"])
@pytest.mark.parametrize("shape,dtype", [((2, 33, 47, 4, 2, 264), jnp.float32),
                                         ((1, 20, 40, 2, 1, 512), jnp.bfloat16)], ids=str)
def test_head_dims_past_256(rng, shape, dtype, implementation):
  """Head dims 257-512: the CPU kernels and Pallas's (the interpreter on a CPU, Triton on
  a GPU) take them (against float64, forward and gradients, GQA 2, ragged lengths); on a
  GPU native takes 16-bit calls on Hopper (its wide forward, blockwise gradients) and
  refuses the others with a clear error, and the default runs Pallas for those."""
  gpu = jax.default_backend() != "cpu"
  pallas_reason = gpu and pallas_supported((1, 8, 2, 320), (1, 8, 2, 320), dtype=dtype,
                                           platform="gpu")
  hopper = getattr(jax.devices()[0], "compute_capability", "") == "9.0"
  if implementation == "native" and gpu and not (hopper and dtype != jnp.float32):
    q = jnp.ones((1, 8, 2, 320), dtype)
    with pytest.raises(ValueError, match="head_dim <= 256"):
      jaxflash.dot_product_attention(q, q, q, implementation="native")
    jaxpr = str(jax.make_jaxpr(lambda q: jaxflash.dot_product_attention(q, q, q))(q))
    assert ("jaxflash_pallas" in jaxpr) == (not pallas_reason), pallas_reason
    return
  if implementation == "pallas" and pallas_reason:
    pytest.skip(pallas_reason)
  check_forward(rng, shape, "lengths", dtype, implementation=implementation)
  check_gradients(rng, shape, "causal_bottom_right", dtype, implementation=implementation)
  q = jnp.ones((1, 8, 2, 520), dtype)
  with pytest.raises(ValueError, match="head_dim <= 512|head dims 1..512"):
    jaxflash.dot_product_attention(q, q, q, implementation=implementation)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="runs the GPU's rule on the CPU")
def test_wide_backward_rule_on_the_cpu(rng, monkeypatch):
  """The gradients of Hopper's wide forward (wide_gradients.backward: the blockwise backward
  in the inputs' 16-bit type, padding zeroed, the exact gradients wherever one comes out
  non-finite), run here in place of the CPU kernels' backward, whose gradients serve as the
  exact ones: under the tolerance rule (GQA 2, ragged lengths, two key blocks), and a NaN or
  Inf in a key, value or query that hidden pairs meet reaches only what the visible pairs
  give it, as with every kernel."""
  from jaxflash import _core, wide_gradients
  import test_nonfinite
  kernel_backward = _core.NativeKernels.backward

  def wide(cls, q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec, offsets=None, **kw):
    assert not kw or not any(kw.values())
    exact = lambda: kernel_backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec, offsets)
    return wide_gradients.backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec=spec,
                                   offsets=offsets, exact=exact)

  monkeypatch.setattr(_core.NativeKernels, "backward", classmethod(wide))
  check_gradients(rng, (2, 70, 90, 4, 2, 512), "lengths_causal_bottom_right", jnp.bfloat16)
  # Two blocks of 1024 keys, each over the rows that can see it only (row_ranges), or none.
  ranges, row_ranges = [], wide_gradients.row_ranges
  monkeypatch.setattr(wide_gradients, "row_ranges", lambda *a, **kw: ranges.append(row_ranges(*a, **kw))
                      or ranges[-1])
  check_gradients(rng, (1, 40, 1100, 2, 2, 264), "window", jnp.float16)
  check_gradients(rng, (1, 300, 1100, 2, 2, 512), "window_causal_bottom_right", jnp.bfloat16)
  assert ranges == [[(0, 1, 0, 40), (1, 2, 40, 40)], [(0, 1, 0, 229), (1, 2, 224, 300)]]
  for poison in ("q_nan", "k_nan", "v_inf"):
    test_nonfinite.check_case(rng, "native", poison, "lengths_causal", jnp.bfloat16,
                              shape=(2, 70, 90, 4, 2, 512))


@pytest.mark.parametrize("mask", ["causal", "window_causal_bottom_right"])
def test_blockwise_backward_over_row_groups(rng, mask):
  """derivatives.backward over wide_gradients.row_ranges' groups (a scan a group of several
  key blocks, a plain step for one, groups no row sees skipped) gives the gradients of its
  scan over every row: 19 blocks of 16 keys in 10 groups."""
  from jaxflash import _core, derivatives, reference, wide_gradients
  spec = {"causal": _core.MaskSpec(scale=0.125, window_right=0),
          "window_causal_bottom_right": _core.MaskSpec(scale=0.125, window_left=20, window_right=0,
                                                       bottom_right=True)}[mask]
  T = 300 if mask == "causal" else 40
  q = jnp.asarray(rng.standard_normal((2, T, 4, 64)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((2, 300, 2, 64)), jnp.float32) for _ in range(2))
  do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  o, lse = reference.attention(q, k, v, scale=0.125, is_causal=True, local_window_size=(
      (spec.window_left, 0) if spec.window_left >= 0 else None),
      causal_alignment="bottom_right" if spec.bottom_right else "top_left")
  groups = wide_gradients.row_ranges(spec, T, 300, 16, lengths=False, offsets=None)
  assert len(groups) == 10 and {j1 - j0 for j0, j1, _, _ in groups} == {1, 2}
  run = lambda rows: derivatives.backward(q, k, v, o, lse, do, jnp.zeros_like(lse), None, None,
                                          spec=spec, block=16, rows=rows)
  for got, want in zip(run(groups), run(None)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_wide_forward(rng):
  """Hopper's forward of head dims 257-512 (sm90/fwd_wide_kernel.cuh; gradients
  by wide_gradients.backward, Pallas's where one is non-finite):
  every mask rule with ragged lengths, GQA 2, rows and keys past whole tiles, head dims with
  zero-padded columns, both 16-bit dtypes; non-finite inputs reach exactly the outputs a
  dense softmax over the visible pairs puts them in; the default runs it."""
  if getattr(jax.devices()[0], "compute_capability", "") != "9.0":
    pytest.skip("the wide forward runs on Hopper GPUs")
  import test_nonfinite
  for shape, dtype, masks in [((2, 130, 97, 4, 2, 512), jnp.bfloat16, list(MASKS)),
                              ((1, 70, 200, 2, 1, 264), jnp.float16,
                               ["causal_bottom_right", "window", "lengths"]),
                              ((1, 64, 64, 2, 2, 384), jnp.bfloat16, ["none"])]:
    for mask in masks:
      check_forward(rng, shape, mask, dtype)
    check_gradients(rng, shape, "lengths_causal_bottom_right", dtype)
  # Gradients whose key blocks each visit the rows that can see them (wide_gradients.row_ranges).
  check_gradients(rng, (1, 2100, 2100, 2, 2, 512), "causal", jnp.bfloat16)
  check_gradients(rng, (1, 300, 1100, 2, 2, 264), "window_causal_bottom_right", jnp.float16)
  for poison in ("q_nan", "k_nan", "v_nan", "v_inf", "k_neginf"):
    test_nonfinite.check_case(rng, "native", poison, "lengths_causal", jnp.bfloat16,
                              shape=(2, 70, 90, 4, 2, 512))
  q = jnp.ones((1, 8, 2, 512), jnp.bfloat16)
  jaxpr = str(jax.make_jaxpr(lambda q: jaxflash.dot_product_attention(q, q, q))(q))
  assert "jaxflash_fwd" in jaxpr and "jaxflash_pallas" not in jaxpr


@pytest.mark.gpu
def test_gpu_head_dims_past_256(rng):
  """The fast GPU tier's run of test_head_dims_past_256: Pallas's kernels (where the GPU's
  shared memory takes them), native's refusal and the default's pick."""
  for shape, dtype in [((2, 33, 47, 4, 2, 264), jnp.float32), ((1, 20, 40, 2, 1, 512), jnp.bfloat16)]:
    for implementation in ("native", "pallas"):
      test_head_dims_past_256(rng, shape, dtype, implementation)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_large_logits_stay_finite_and_exact(rng, dtype):
  # Logits of magnitude ~1e3: a kernel without the running max overflows.
  check_forward(rng, (1, 127, 127, 2, 2, 64), "causal", dtype, magnitude=6.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("implementation", ["native", "pallas", "xla"])
def test_logits_up_to_1e4(rng, implementation, dtype):
  """scale * |q . k| up to ~1e4 (q, k of size 50): output, LSE and gradients
  finite and within the rule in every implementation."""
  shape = (1, 40, 50, 2, 1, 16)
  check_forward(rng, shape, "lengths_causal_bottom_right", dtype, magnitude=50.0,
                implementation=implementation)
  check_gradients(rng, shape, "causal", dtype, magnitude=50.0, implementation=implementation)


@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 70), S=st.integers(1, 70), K=st.integers(1, 2),
       G=st.sampled_from([1, 2, 3]), D=st.integers(1, 80), mask_name=st.sampled_from(list(MASKS)),
       seed=st.integers(0, 2**31 - 1))
def test_random_shapes(B, T, S, K, G, D, mask_name, seed):
  rng = np.random.default_rng(seed)
  check_forward(rng, (B, T, S, K * G, K, D), mask_name, jnp.float32)
  check_gradients(rng, (B, T, S, K * G, K, D), mask_name, jnp.float32)


def test_long_sequence_rows_match(rng):
  """S = 16k: the kernel's rows agree with a float64 computation of a sample."""
  B, T, S, N, K, D = 1, 16384, 16384, 1, 1, 32
  q, k, v = random_inputs(rng, B, T, S, N, K, D, jnp.float32)
  out, lse = attention(q, k, v, is_causal=True)
  rows = np.sort(rng.choice(T, size=48, replace=False))
  rows[-1] = T - 1
  qs = np.asarray(q, np.float64)[:, rows]
  s = np.einsum("bnd,bsd->bns", qs[:, :, 0], np.asarray(k, np.float64)[:, :, 0]) / np.sqrt(D)
  s = np.where(np.arange(S)[None, None, :] <= rows[None, :, None], s, -np.inf)
  m = s.max(-1, keepdims=True)
  p = np.exp(s - m)
  expect = np.einsum("bns,bsd->bnd", p / p.sum(-1, keepdims=True), np.asarray(v, np.float64)[:, :, 0])
  np.testing.assert_allclose(np.asarray(out)[:, rows, 0], expect, atol=2e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(lse)[:, rows, 0], (m[..., 0] + np.log(p.sum(-1))), atol=2e-5)


def test_long_sequence_script_runs_small():
  """tools/long_sequences.py (the GPU stage 'long') at sizes a CPU can run."""
  import importlib.util
  import os
  path = os.path.join(os.path.dirname(__file__), "..", "tools", "long_sequences.py")
  spec = importlib.util.spec_from_file_location("long_sequences", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.main(["--seq", "1024", "--forward-only", "2048"]) == 0


def test_no_kernel_fills_lengths_that_were_not_given():
  """A call without sequence lengths passes the native handlers empty arrays
  (reference.no_lengths): before, XLA filled three [batch] arrays (lengths and
  diagonal offsets) with a kernel each before every call, ~7 µs of a decode step."""
  q = jnp.zeros((2, 1, 8, 64), jnp.bfloat16)
  k = jnp.zeros((2, 128, 2, 64), jnp.bfloat16)
  hlo = jax.jit(lambda q, k: jaxflash.dot_product_attention(q, k, k, implementation="native")) \
      .lower(q, k).compile().as_text()
  call = next(line for line in hlo.splitlines() if "custom_call_target=\"jaxflash_fwd" in line)
  assert "broadcast" not in hlo, hlo
  assert call.count("s32[0]") == 5, call   # lengths, diagonal offsets, no segment tables
  assert call.count("f32[0]") == 1, call   # no ALiBi slopes
  # Given lengths still reach the kernel, and mean what they say.
  lengths = jnp.array([1, 0], jnp.int32)
  out = jaxflash.dot_product_attention(q + 1, k + 1, k + 2, key_value_seq_lengths=lengths,
                                       implementation="native")
  np.testing.assert_array_equal(np.asarray(out[0], np.float32), 2.0)
  np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)
