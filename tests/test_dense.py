"""A dense `bias` and boolean `mask` in the fused implementations, against float64 truth.

Native on the default backend (the C++ kernels on a CPU; on a GPU the tensor-core kernels
in 16-bit types: on Hopper the warp-specialised forward's dense tile for a 16-bit bias it
stages without a mask at D 64 and 128, the sm80 kernels for the other dense calls and the
backward), Pallas (the interpreter on a CPU), each against
numpy_reference with the bias added after the scores and the mask joining the mask
rule; the yardstick is xla in the input dtype (tests/conftest.py's tolerance rule). Bias
and mask shapes cover every broadcast pattern the kernels read with stride 0; masks hide
whole rows (their output must be zeros with the empty LSE) and whole tiles (skipped).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _core, _native
from cases import mask_kwargs, numpy_mask
from conftest import HAS_GPU, assert_within_budget, max_abs, numpy_reference, random_inputs
from test_native import attention, finite_baseline

IMPLEMENTATIONS = ["pallas"] if HAS_GPU else ["native", "pallas"]


def dense_terms(rng, shape, bias_axes, mask_axes, dtype=jnp.float32, blocks=False):
  """(bias, mask): arrays whose axes named in `*_axes` ("BNTS" letters) have the call's
  size, the others 1 (None for no term). The mask shows ~70% of pairs (with `blocks`, a
  checkerboard of 64 x 64 blocks instead, mostly shown or hidden whole, ~5% of the shown
  pairs hidden in one of them), hides query row 1 entirely and leaves the first key block
  of the last row's keys hidden."""
  B, T, S, N, _, _ = shape
  size = lambda axes: tuple(n if a in axes else 1 for a, n in zip("BNTS", (B, N, T, S)))
  bias = None if bias_axes is None else jnp.asarray(rng.standard_normal(size(bias_axes)), dtype)
  mask = None
  if mask_axes is not None:
    mask = rng.random(size(mask_axes)) < 0.7
    if blocks:
      assert "T" in mask_axes and "S" in mask_axes
      grid = (np.arange(T)[:, None] // 64 + np.arange(S)[None, :] // 64) % 2 == 0
      mask = np.broadcast_to(grid, mask.shape).copy()
      mask[..., 64:128, :64] &= rng.random(mask[..., 64:128, :64].shape) < 0.95
    if "T" in mask_axes and T > 1:
      mask[..., 1, :] = False
    if "S" in mask_axes:
      mask[..., -1, :min(S, 64)] = False
    mask = jnp.asarray(mask)
  return bias, mask


def baseline(q, k, v, bias, mask, compute_dtype, kw):
  o, lse = jaxflash.reference.attention(
      q, k, v, scale=1.0 / np.sqrt(q.shape[-1]), bias=bias, mask=mask,
      is_causal=kw.get("is_causal", False),
      causal_alignment=kw.get("causal_alignment", "top_left"),
      local_window_size=kw.get("local_window_size"),
      query_seq_lengths=kw.get("query_seq_lengths"),
      key_value_seq_lengths=kw.get("key_value_seq_lengths"), compute_dtype=compute_dtype)
  return o, jnp.transpose(lse, (0, 2, 1))


def check(rng, shape, mask_name, dtype, implementation, bias_axes, mask_axes, gradients=True,
          bias_dtype=jnp.float32, blocks=False):
  B, T, S, N, K, D = shape
  q, k, v = random_inputs(rng, B, T, S, N, K, D, dtype)
  bias, mask = dense_terms(rng, shape, bias_axes, mask_axes, bias_dtype, blocks)
  kw = mask_kwargs(mask_name, rng, B, T, S)
  scale = 1.0 / np.sqrt(D)
  truth_kw = dict(scale=scale, bias=bias, dense_mask=mask, **numpy_mask(kw))

  out, lse = attention(q, k, v, implementation, bias=bias, mask=mask, **kw)
  truth_o, truth_lse, _ = numpy_reference.forward(q, k, v, **truth_kw)
  # Jitted, as test_native's baselines: eager, each operation compiles on its own.
  base_o, base_lse = finite_baseline(
      lambda c: jax.jit(lambda *x: baseline(*x, mask, c, kw))(q, k, v, bias), dtype)
  assert out.dtype == q.dtype
  assert_within_budget(out, truth_o, base_o, "output")
  lse = np.asarray(lse).transpose(0, 2, 1)
  empty = truth_lse == numpy_reference.EMPTY_LSE
  assert np.array_equal(lse == numpy_reference.EMPTY_LSE, empty), \
      "LSE is the empty-row value exactly on rows with no key (the dense mask's included)"
  assert np.all(np.asarray(out, np.float64)[np.transpose(empty, (0, 2, 1))] == 0)
  assert_within_budget(np.where(empty, 0, lse), np.where(empty, 0, truth_lse),
                       np.where(empty, 0, np.asarray(base_lse, np.float64).transpose(0, 2, 1)),
                       "lse")
  if not gradients:
    return
  do = jnp.asarray(rng.standard_normal(q.shape), dtype)
  dlse = jnp.asarray(rng.standard_normal((B, T, N)), jnp.float32)

  def loss(fn, q, k, v, bias):
    o, lse = fn(q, k, v, bias)
    lse = jnp.where(lse == numpy_reference.EMPTY_LSE, 0, lse)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(lse * dlse)

  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  fused = lambda q, k, v, b: attention(q, k, v, implementation, bias=b, mask=mask, **kw)
  grads = jax.jit(jax.grad(functools.partial(loss, fused), argnums))(q, k, v, bias)

  def base_grads(c):
    fn = lambda q, k, v, b: baseline(q, k, v, None if b is None else b.astype(c), mask, c, kw)
    return jax.jit(jax.grad(functools.partial(loss, fn), argnums))(q, k, v, bias)
  base = finite_baseline(base_grads, dtype)
  truth = numpy_reference.backward(q, k, v, do, np.asarray(dlse).transpose(0, 2, 1), **truth_kw)
  for name, g, b, t in zip(("dq", "dk", "dv", "dbias"), grads, base, truth):
    assert g.shape == np.shape(t), name
    assert_within_budget(g, t, b, name)


# (B, T, S, N, K, D): ragged lengths, GQA 1, 4 and 8, head dims off the powers of two.
SHAPES = [(2, 37, 70, 4, 4, 40), (1, 70, 130, 8, 2, 64), (2, 45, 45, 8, 1, 32)]
# Bias / mask broadcast patterns: full, one per head over the batch, key padding (one
# row for all queries), per query row only.
PATTERNS = [("BNTS", "BNTS"), ("NTS", "BTS"), ("BS", "BS"), ("T", None), (None, "NTS")]


@pytest.mark.parametrize("bias_axes, mask_axes", PATTERNS, ids=str)
@pytest.mark.parametrize("mask_name", ["none", "causal", "lengths_causal_bottom_right"])
def test_native_forward_and_gradients(rng, mask_name, bias_axes, mask_axes):
  if HAS_GPU:
    pytest.skip("float32: native's GPU kernels take a dense term in 16-bit types (test_gpu_native)")
  shape = SHAPES[(len(mask_name) + len(str(bias_axes))) % len(SHAPES)]
  check(rng, shape, mask_name, jnp.float32, "native", bias_axes, mask_axes)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_native_16_bit(rng, dtype):
  if HAS_GPU:
    pytest.skip("the CPU kernels' 16-bit path (the GPU's: test_gpu_native)")
  check(rng, SHAPES[1], "window", dtype, "native", "NTS", "BTS")


@pytest.mark.parametrize("mask_name", ["causal", "lengths"])
def test_pallas(rng, mask_name):
  check(rng, (2, 40, 70, 4, 2, 32), mask_name, jnp.float32, "pallas", "NTS", "BS")
  check(rng, (1, 33, 33, 2, 1, 16), mask_name, jnp.float32, "pallas", "T", "BNTS",
        gradients=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_gpu_pallas(rng, dtype):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  for shape in [(2, 300, 300, 4, 2, 64), (1, 129, 200, 8, 1, 128)]:
    for bias_axes, mask_axes in PATTERNS[:3]:
      check(rng, shape, "causal", dtype, "pallas", bias_axes, mask_axes,
            gradients=dtype == jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_gpu_native(rng, dtype):
  """The CUDA kernels' bias and mask (dense_tile.cuh) and their dB pass, every broadcast
  pattern, on ragged shapes (GQA 1, 2, 4; head dims 40, 64, 128, 256), the bias in the
  inputs' type (staged in shared memory where its rows allow: S a multiple of 8) and in
  float32."""
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  shapes = [(2, 300, 296, 4, 2, 64), (1, 129, 200, 8, 8, 128), (2, 70, 130, 8, 2, 40),
            (1, 100, 88, 4, 1, 256)]
  masks = ["causal", "none", "lengths_causal_bottom_right"]
  for i, (bias_axes, mask_axes) in enumerate(PATTERNS):
    for j, shape in enumerate(shapes[i % 2::2]):
      check(rng, shape, masks[(i + j) % 3], dtype, "native", bias_axes, mask_axes,
            bias_dtype=dtype if j == 0 else jnp.float32)
  # Block masks: tiles hidden whole (skipped by every kernel), shown whole and mixed, with
  # S a multiple of 16 (the vote's 16-byte loads) and the bias staged.
  for shape, (bias_axes, mask_axes) in [((1, 256, 320, 4, 2, 128), ("NTS", "TS")),
                                        ((2, 200, 192, 4, 4, 64), ("BNTS", "BNTS"))]:
    check(rng, shape, "none", dtype, "native", bias_axes, mask_axes, bias_dtype=dtype,
          blocks=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_gpu_native_staged_bias(rng, dtype):
  """A 16-bit bias without a mask, its keys contiguous and its rows whole 16-byte units
  (S a multiple of 8): on Hopper the warp-specialised forward's dense tile (D 64 and 128),
  which stages the bias beside K by TMA. Full and broadcast biases (stride-0 batch and
  head axes), rows and keys past the last tile's edge, GQA, every mask rule beside it; a
  grid of more work tiles than SMs (each CTA walks several, its stages turning over); a
  NaN in the bias makes its row NaN and no other."""
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  for shape, bias_axes, mask_name in [((2, 300, 296, 4, 2, 64), "BNTS", "causal"),
                                      ((1, 129, 200, 8, 8, 128), "NTS", "lengths_causal_bottom_right"),
                                      ((2, 200, 136, 4, 1, 128), "TS", "none"),
                                      ((2, 70, 64, 8, 2, 64), "BTS", "lengths")]:
    check(rng, shape, mask_name, dtype, "native", bias_axes, None, bias_dtype=dtype)
  check(rng, (2, 1024, 520, 16, 4, 128), "causal", dtype, "native", "NTS", None, gradients=False,
        bias_dtype=dtype)
  B, T, S, N, D = 1, 256, 384, 4, 64
  q, k, v = random_inputs(rng, B, T, S, N, N, D, dtype)
  bias = jnp.asarray(rng.standard_normal((1, N, T, S)), dtype).at[0, 2, 77, 300].set(jnp.nan)
  out = np.asarray(jaxflash.dot_product_attention(q, k, v, bias, implementation="native"), np.float32)
  row_nan = np.isnan(out).any(-1)
  assert row_nan[0, 77, 2] and row_nan.sum() == 1, "the NaN's row, and only it, is NaN"


@pytest.mark.gpu
def test_gpu_native_dense_backward_emits_db(rng):
  """On Hopper a bias in the inputs' 16-bit dtype that the dense tile stages, differentiated
  with q, k and v, takes one backward call that gives dB beside dQ, dK and dV (the
  jaxflash_bwd_db_v1 target, no bias-gradient pass) where at most two (batch, head)s share
  an entry: dS tiles stored into dB, or added there in 16 bits over the batch or the heads.
  Wider sharing and a float16 bias beside bfloat16 inputs take the separate pass. Rows and
  keys past a step's and a key tile's edge, ragged lengths (dB of the pairs the walk leaves
  out zeroed), GQA, head dims 112, 64 (three consumers, 192 keys a CTA) and 40."""
  if not HAS_GPU or getattr(jax.devices()[0], "compute_capability", "") != "9.0":
    pytest.skip("needs an sm90 GPU")
  B, T, S, N, D = 2, 200, 264, 4, 128
  q, k, v = random_inputs(rng, B, T, S, N, N, D, jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.bfloat16)
  loss = lambda *x: jaxflash.dot_product_attention(*x, implementation="native").astype(jnp.float32).sum()
  targets = lambda b: jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(q, k, v, b).as_text()
  hlo = targets(bias)
  assert _native.DB_TARGET in hlo and _native.BIAS_GRADIENT_TARGET not in hlo
  # A bias shared by every head and batch element: 8 terms an entry, so the float32 pass.
  hlo = targets(bias[:, :1])
  assert _native.DB_TARGET not in hlo and _native.BIAS_GRADIENT_TARGET in hlo
  # The default runs both native (Hopper's tiles take them both ways); a mask runs Pallas.
  call = lambda b, m=None: _core.validate(q, k, v, b, m, None, False, None, None, None, "top_left", False)
  for b in (bias, bias[:, :1]):
    assert _core.automatic_order(call(b))[0] == "native"
  assert _core.automatic_order(call(bias, jnp.ones((T, S), bool)))[0] == "pallas"
  for shape, bias_axes, mask_name, bias_dtype in [
      ((2, 200, 264, 4, 4, 128), "BNTS", "none", jnp.bfloat16),
      ((2, 130, 136, 4, 2, 128), "NTS", "lengths", jnp.bfloat16),
      ((1, 129, 200, 2, 2, 128), "BTS", "lengths_causal_bottom_right", jnp.bfloat16),
      ((2, 130, 136, 8, 2, 128), "BTS", "lengths", jnp.bfloat16),
      ((3, 64, 520, 4, 1, 112), "TS", "causal", jnp.float16),
      ((1, 129, 200, 8, 8, 128), "NTS", "lengths_causal_bottom_right", jnp.bfloat16),
      ((2, 200, 520, 4, 4, 64), "NTS", "none", jnp.bfloat16),
      ((2, 130, 136, 4, 2, 64), "BNTS", "lengths_causal_bottom_right", jnp.bfloat16),
      ((1, 96, 200, 2, 2, 40), "BTS", "lengths", jnp.bfloat16)]:
    check(rng, shape, mask_name, jnp.bfloat16, "native", bias_axes, None, bias_dtype=bias_dtype)


def _native_backward_inputs(rng, B, T, S, N, D, bias_shape):
  """A native forward with a bf16 bias, and what its backward takes: (q, k, v, o, lse, dO,
  dLSE, no lengths), dense, spec."""
  from jaxflash import dense as _dense, reference
  q, k, v = random_inputs(rng, B, T, S, N, N, D, jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal(bias_shape), jnp.bfloat16)
  dense, spec, none = _dense.make(bias, None), _core.MaskSpec(scale=float(D) ** -0.5), reference.no_lengths()
  o, lse = _core.NativeKernels.forward(q, k, v, none, none, spec, dense=dense)
  do = jnp.asarray(rng.standard_normal(o.shape), jnp.bfloat16)
  dlse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
  return (q, k, v, o, lse, do, dlse, none, none), dense, spec


def _legacy_call(target, out_types, args, dense, spec, **attrs):
  """An older target (kept registered so exported programs load) on the backward v5's operands."""
  from jaxflash import dense as _dense, reference
  return jax.ffi.ffi_call(target, out_types)(
      *args, reference.per_batch_operand(None), *_core._segments.operands(None), reference.alibi_operand(None),
      *_dense.operands(dense), **_core.NativeKernels._attrs(spec), **attrs)


def test_bias_gradient_legacy_target(rng):
  """jaxflash_bias_grad_v1 (dB in float32) gives the sums whose rounding to the bias's dtype is
  jaxflash_bias_grad_v2's dB (summed in float32, stored in the bias's dtype)."""
  args, dense, spec = _native_backward_inputs(rng, 2, 40, 72, 4, 64, (1, 4, 40, 72))
  assert "jaxflash_bias_grad_v1" in _native.LEGACY_TARGETS
  db = _core.NativeKernels.bias_gradient(*args, spec=spec, dense=dense)
  out_types = (jax.ShapeDtypeStruct(dense.bias.shape, jnp.float32), jax.ShapeDtypeStruct(args[4].shape, jnp.float32))
  db32, _ = _legacy_call("jaxflash_bias_grad_v1", out_types, args, dense, spec)
  assert db.dtype == dense.bias.dtype and db.shape == dense.bias.shape
  np.testing.assert_array_equal(np.asarray(db32.astype(db.dtype), np.float32), np.asarray(db, np.float32))


def test_cpu_backward_gives_db_where_each_entry_has_one_item(rng):
  """On the CPU a bias in the inputs' dtype whose every entry has one (batch, head) of the call
  (and its rows and keys) takes its gradient from the backward itself (jaxflash_bwd_db_v1: each
  tile's dS stored, hidden pairs 0, tiles the walk leaves out zeroed); a bias shared by the
  batch, one in another dtype, or a gradient over the bias alone keep the bias-gradient pass."""
  if HAS_GPU:
    pytest.skip("the CPU kernels' (the GPU's: test_gpu_native_dense_backward_emits_db)")
  if jax.device_count() > 1:
    pytest.skip("dB beside the backward is the kernels' call on one device (sharding.partitioned)")
  B, T, S, N, D = 2, 40, 72, 4, 32
  q, k, v = random_inputs(rng, B, T, S, N, N, D, jnp.float32)
  bias = jnp.asarray(rng.standard_normal((B, N, T, S)), jnp.float32)
  loss = lambda *x: jaxflash.dot_product_attention(*x, implementation="native", is_causal=True).sum()
  targets = lambda b, argnums=(0, 3): jax.jit(jax.grad(loss, argnums)).lower(q, k, v, b).as_text()
  for b, argnums, joint in [(bias, (0, 3), True), (bias[:1], (0, 3), False), (bias.astype(jnp.bfloat16), (0, 3), False),
                            (bias, (3,), False)]:
    hlo = targets(b, argnums)
    assert (_native.DB_TARGET in hlo) == joint and (_native.BIAS_GRADIENT_TARGET in hlo) != joint, (b.shape, argnums)
  # Ragged rows and keys, GQA, a dense mask beside the bias, 16 bits; B 1 with a bias over N, T, S.
  check(rng, (2, 37, 70, 4, 2, 40), "lengths_causal_bottom_right", jnp.bfloat16, "native", "BNTS", "BTS",
        bias_dtype=jnp.bfloat16)
  check(rng, (1, 70, 130, 8, 2, 64), "window", jnp.float32, "native", "NTS", None)


@pytest.mark.gpu
def test_gpu_legacy_dense_ds_target(rng):
  """The older jaxflash_bwd_ds_v1 (the whole dS [B, N, T, S], which its caller summed) gives
  the dQ, dK and dV of jaxflash_bwd_db_v1 and a dS whose sum over the batch is its dB (two
  bf16 terms: one rounding either way)."""
  if not HAS_GPU or getattr(jax.devices()[0], "compute_capability", "") != "9.0":
    pytest.skip("needs an sm90 GPU")
  B, T, S, N, D = 2, 136, 200, 2, 128
  args, dense, spec = _native_backward_inputs(rng, B, T, S, N, D, (1, N, T, S))
  q = args[0]
  *grads, db = _core.NativeKernels.backward(*args, spec, dense=dense, with_db=True)
  sums = _native.dq_sums_room(q.dtype, q.shape, args[1].shape, False)
  out_types = (*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args[:3]),
               jax.ShapeDtypeStruct(args[4].shape, jnp.float32),
               jax.ShapeDtypeStruct((*q.shape[:-1], D if sums else 0), jnp.float32),
               jax.ShapeDtypeStruct((B, N, T, S), q.dtype))
  dq, dk, dv, _, _, ds = _legacy_call(_native.LEGACY_CUDA_TARGETS[0], out_types, args, dense, spec,
                                      deterministic=False, tile=np.int64(_native.tile_attr("bwd", D, False)))
  # dK and dV alike bit for bit; dQ's float32 sums are added in any order (a bf16 ulp apart).
  for name, got, want in zip("dq dk dv".split(), (dq, dk, dv), grads):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    rtol = 2.0 ** -7 if name == "dq" else 0.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max(), err_msg=name)
  summed = np.asarray(jnp.sum(ds.astype(jnp.float32), axis=0, keepdims=True).astype(jnp.bfloat16), np.float32)
  db = np.asarray(db, np.float32)
  np.testing.assert_allclose(summed, db, rtol=2.0 ** -7, atol=2.0 ** -7 * np.abs(db).max())


def test_joint_backward_lowering(monkeypatch, rng):
  """Where the native kernels give dB beside dQ, dK and dV (the Hopper dense tile; forced
  here on the CPU, for tracing only), a gradient over the bias and any of q, k, v lowers to
  one dense backward with dB (jaxflash_bwd_db_v1) and no bias-gradient pass; one over the
  bias alone keeps the pass; vmap and a jvp of the gradient trace (as the separate passes)."""
  if HAS_GPU:
    pytest.skip("traced on the CPU (test_gpu_native_dense_backward_emits_db runs it on Hopper)")
  if jax.device_count() > 1:
    pytest.skip("dB beside the backward is the kernels' call on one device (sharding.partitioned)")
  monkeypatch.setattr(_core.NativeKernels, "emits_db", staticmethod(lambda *a, **kw: True))
  B, T, S, N, D = 2, 64, 64, 2, 128
  q, k, v = random_inputs(rng, B, T, S, N, N, D, jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.bfloat16)
  loss = lambda *x: jaxflash.dot_product_attention(*x, implementation="native").astype(jnp.float32).sum()
  for argnums, joint in [((0, 1, 2, 3), True), ((0, 3), True), ((3,), False), ((0, 1, 2), False)]:
    hlo = jax.jit(jax.grad(loss, argnums)).lower(q, k, v, bias).as_text()
    assert (_native.DB_TARGET in hlo) == joint, argnums
    assert (_native.BIAS_GRADIENT_TARGET in hlo) == (3 in argnums and not joint), argnums
  grad = jax.grad(loss, (0, 3))
  batched = jax.eval_shape(jax.vmap(grad), *(jnp.stack([x, x]) for x in (q, k, v, bias)))
  assert batched[1].shape == (2, *bias.shape)
  _, tangents = jax.eval_shape(lambda t: jax.jvp(lambda q: grad(q, k, v, bias), (q,), (t,)), q)
  assert tangents[1].shape == bias.shape


@pytest.mark.gpu
def test_gpu_native_sm80_family(rng):
  """The sm80 kernels' dense forward, forced, on the calls Hopper gives the warp-specialised
  dense tile (a 16-bit bias without a mask, D 64) and beside a mask (D 128): full and
  broadcast terms, the bias staged and in float32."""
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  with _native.forced_tile(0, sm80=True):
    check(rng, (2, 300, 296, 4, 2, 64), "causal", jnp.bfloat16, "native", "BNTS", None,
          bias_dtype=jnp.bfloat16)
    check(rng, (1, 129, 200, 8, 8, 128), "lengths_causal_bottom_right", jnp.bfloat16, "native", "NTS",
          "BTS")


@pytest.mark.gpu
def test_gpu_native_runs_the_dense_targets_and_keeps_hidden_nan_out(rng):
  """On a GPU a 16-bit native call with a bias and mask lowers to the CUDA kernels' v5
  targets and their dB pass; a block-sparse mask with NaN in the hidden blocks' values keeps the
  rows that cannot see them finite and equal to xla's."""
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  B, T, S, N, D = 2, 256, 384, 4, 128
  q, k, v = random_inputs(rng, B, T, S, N, N, D, jnp.bfloat16)
  blocks = (np.arange(T)[:, None] // 128 + np.arange(S)[None, :] // 128) % 2 == 0
  mask = jnp.asarray(blocks)
  bias = jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.bfloat16)
  loss = lambda q, b: jaxflash.dot_product_attention(
      q, k, v, b, mask, implementation="native").astype(jnp.float32).sum()
  hlo = jax.jit(jax.grad(loss, (0, 1))).lower(q, bias).as_text()
  for target in (*_native.DENSE_TARGETS, _native.BIAS_GRADIENT_TARGET):
    assert target in hlo, target
  ref = jaxflash.dot_product_attention(q, k, v, bias, mask, implementation="xla")
  v = v.at[:, 128:256].set(jnp.nan)    # keys 128-255: hidden from rows 0-127
  out = jaxflash.dot_product_attention(q, k, v, bias, mask, implementation="native")
  assert np.all(np.isfinite(np.asarray(out[:, :128], np.float32)))
  assert max_abs(out[:, :128], ref[:, :128]) < 2e-2
  assert np.all(np.isnan(np.asarray(out[:, 128:], np.float32)))
  grads = jax.grad(loss, (0, 1))(q, bias)
  assert np.all(np.isfinite(np.asarray(grads[1][:, :, :128], np.float32)))   # dB of rows 0-127


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_block_sparse_masks_skip_hidden_tiles_exactly(rng, implementation):
  """Half of the 64 x 64 tiles hidden (a checkerboard of blocks), a NaN in every value
  of a hidden block: the rows that cannot see it stay finite and equal xla."""
  B, T, S, N, D = 1, 128, 256, 2, 32
  q, k, v = random_inputs(rng, B, T, S, N, N, D, jnp.float32)
  blocks = (np.arange(T)[:, None] // 64 + np.arange(S)[None, :] // 64) % 2 == 0
  mask = jnp.asarray(blocks)
  # xla (like jax.nn) lets 0 * NaN of a hidden key through: its yardstick has no NaN.
  ref = jaxflash.dot_product_attention(q, k, v, mask=mask, implementation="xla")
  v = v.at[:, 64:128].set(jnp.nan)    # keys 64-127: hidden from rows 0-63
  out = jaxflash.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
  assert np.all(np.isfinite(np.asarray(out[:, :64])))
  assert max_abs(out[:, :64], ref[:, :64]) < 1e-5
  assert np.all(np.isnan(np.asarray(out[:, 64:])))   # rows 64-127 see the NaN


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_mode_vmap_and_the_default(rng, implementation):
  """The bias's tangent reaches tO and tLSE; vmap over a batch of biases; with neither
  argument named, a bias or mask runs fused (never xla) on the CPU."""
  q, k, v = random_inputs(rng, 2, 24, 40, 4, 2, 16, jnp.float32)
  bias = jnp.asarray(rng.standard_normal((1, 4, 24, 40)), jnp.float32)
  mask = jnp.asarray(rng.random((2, 1, 24, 40)) < 0.8)
  tangents = [jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v, bias)]
  run = lambda impl: lambda q, k, v, b: jaxflash.dot_product_attention(
      q, k, v, b, mask, is_causal=True, implementation=impl)
  # Each jitted (eager, every operation of the xla side compiles on its own).
  jvp = lambda impl: jax.jit(lambda p, t: jax.jvp(run(impl), p, t)[1])((q, k, v, bias),
                                                                        tuple(tangents))
  assert max_abs(jvp(implementation), jvp("xla")) < 1e-4
  biases = jnp.stack([bias, 2 * bias])
  batched = lambda impl: jax.jit(jax.vmap(lambda b: run(impl)(q, k, v, b)))(biases)
  out, ref = batched(implementation), batched("xla")
  assert max_abs(out, ref) < 1e-5
  # A batch of bias tangents for one shared bias, transposed (vmap folds the bias like them).
  tb = jnp.stack([tangents[3], -tangents[3]])
  transposed = lambda impl: jax.jit(lambda o: jax.linear_transpose(jax.vmap(
      lambda t: jax.jvp(lambda b: run(impl)(q, k, v, b), (bias,), (t,))[1]), tb)(o)[0])(out)
  assert max_abs(transposed(implementation), transposed("xla")) < 1e-4
  if implementation == "native":
    hlo = jax.jit(lambda q: jaxflash.dot_product_attention(q, k, v, bias, mask)).lower(q).as_text()
    assert "jaxflash_fwd_v5" in hlo


def test_a_bias_not_differentiated_costs_no_bias_gradient(rng):
  """dB is traced only when the bias is differentiated: the native kernels' (their dB
  target, or for this bias on the CPU the backward's with dB out) and Pallas's kernel on
  one device, the blockwise jnp one elsewhere (a scan; the partition rule runs it when
  several devices are visible)."""
  dtype = jnp.bfloat16 if HAS_GPU else jnp.float32   # (the CUDA kernels' dense path is 16-bit)
  q, k, v = random_inputs(rng, 1, 16, 16, 2, 2, 16, dtype)
  bias = jnp.zeros((1, 2, 16, 16))
  for impl in ("native", "pallas"):
    loss = lambda q, b: jaxflash.dot_product_attention(
        q, k, v, b, implementation=impl).astype(jnp.float32).sum()
    if impl == "native" and jax.device_count() == 1:   # the target, in the lowered program
      count = lambda argnums: sum(jax.jit(jax.grad(loss, argnums)).lower(q, bias).as_text().count(mark)
                                  for mark in (_native.BIAS_GRADIENT_TARGET, _native.DB_TARGET))
    else:
      mark = "scan" if jax.device_count() > 1 else "jaxflash_pallas_bias_grad"
      count = lambda argnums: str(jax.make_jaxpr(jax.grad(loss, argnums))(q, bias)).count(mark)
    assert count(0) < count((0, 1)), impl


def test_native_bias_gradient_with_score_modifiers_vmap_and_second_order(rng):
  """The CPU kernels' own dB pass against xla's: with a soft-cap (the bias is added
  after it), ALiBi, segment ids and a mask; vmapped (it runs the blockwise pass
  there) and differentiated once more (the blockwise pass's derivative)."""
  if HAS_GPU:
    pytest.skip("the CPU kernels' pass (the GPU's kernels take no bias beside a soft-cap)")
  q, k, v = random_inputs(rng, 2, 40, 56, 4, 2, 24, jnp.float32)
  bias = jnp.asarray(rng.standard_normal((1, 4, 40, 56)), jnp.float32)
  mask = jnp.asarray(rng.random((2, 1, 40, 56)) < 0.8)
  ids = jnp.asarray(np.sort(rng.integers(0, 3, (2, 40)), axis=1), jnp.int32)
  kv_ids = jnp.asarray(np.sort(rng.integers(0, 3, (2, 56)), axis=1), jnp.int32)
  slopes = jnp.asarray(rng.random(4), jnp.float32)
  do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def loss(impl, q, b):
    o = jaxflash.dot_product_attention(
        q, k, v, b, mask, is_causal=True, logits_soft_cap=4.0, alibi_slopes=slopes,
        query_segment_ids=ids, key_value_segment_ids=kv_ids, implementation=impl)
    return jnp.sum(o * do)
  # Each side jitted: run eagerly, every jax.numpy operation compiled on its own.
  grad = lambda impl: jax.grad(functools.partial(loss, impl), argnums=(0, 1))
  got, want = jax.jit(grad("native"))(q, bias), jax.jit(grad("xla"))(q, bias)
  assert max_abs(got[1], want[1]) < 1e-4 * float(jnp.max(jnp.abs(want[1])))
  biases = jnp.stack([bias, -bias])
  vmapped = lambda impl: jax.jit(jax.vmap(lambda b: grad(impl)(q, b)[1]))(biases)
  assert max_abs(vmapped("native"), vmapped("xla")) < 1e-4 * float(jnp.max(jnp.abs(want[1])))
  t = jnp.asarray(rng.standard_normal(bias.shape), jnp.float32)
  second = lambda impl: jax.jit(
      lambda b, t: jax.jvp(lambda b: grad(impl)(q, b)[1], (b,), (t,))[1])(bias, t)
  ref = second("xla")
  assert max_abs(second("native"), ref) < 1e-4 * float(jnp.max(jnp.abs(ref)))


T_DB, S_DB = 150, 200   # several row and key blocks of the kernel (64 x 64 on a CPU)


@pytest.mark.parametrize("bias_shape, mask_shape", [
    ((1, 4, T_DB, S_DB), (2, 1, T_DB, S_DB)), ((2, 1, 1, S_DB), None),
    ((2, 4, T_DB, 1), (1, 4, 1, S_DB)), ((1, 1, 1, 1), None)], ids=str)
def test_pallas_bias_gradient_kernel(rng, bias_shape, mask_shape):
  """Pallas's dB (pallas/bias_grad.py) against xla's in float32: the bias broadcast over
  the batch, the heads, the rows (the programs' sums added) and the keys (one key: the
  closed form, no kernel), under a soft-cap (the bias is added after it), ALiBi, segment
  ids, ragged lengths and a mask, the LSE differentiated too (so a bias of one key has a
  gradient); a NaN on a key past its length stays out of dB. In 16 bits on a GPU, the
  kernel's way for one key (dlse as the remainder of two large sums) failed this
  budget by 1.4-3x."""
  dtype = jnp.bfloat16 if HAS_GPU else jnp.float32
  q, k, v = random_inputs(rng, 2, T_DB, S_DB, 4, 2, 32, dtype)
  k = k.at[1, S_DB - 6].set(jnp.nan)   # past key_value_seq_lengths[1]: hidden from every row
  bias = jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
  mask = None if mask_shape is None else jnp.asarray(rng.random(mask_shape) < 0.8)
  ids = jnp.asarray(np.sort(rng.integers(0, 3, (2, T_DB)), axis=1), jnp.int32)
  kv_ids = jnp.asarray(np.sort(rng.integers(0, 3, (2, S_DB)), axis=1), jnp.int32)
  do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  dl = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)

  def grad(impl):
    def loss(b):
      o, lse = jaxflash.dot_product_attention(
          q, k, v, b, mask, is_causal=True, logits_soft_cap=4.0,
          alibi_slopes=jnp.asarray([0.1, 0.2, 0.3, 0.4]), query_segment_ids=ids,
          key_value_segment_ids=kv_ids, query_seq_lengths=jnp.asarray([T_DB, T_DB - 9]),
          key_value_seq_lengths=jnp.asarray([S_DB, S_DB - 11]), implementation=impl,
          return_residual=True, differentiable_residual=True)
      lse = jnp.where(lse.astype(jnp.float32) < -1e30, 0.0, lse.astype(jnp.float32))
      return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(lse * dl)
    return jax.jit(jax.grad(loss))(bias)
  kernel = "jaxflash_pallas_bias_grad" in str(jax.make_jaxpr(lambda b: grad("pallas"))(bias))
  # (on several devices the blockwise jnp pass runs: sharding.partitioned)
  assert kernel == (bias_shape[-1] > 1 and jax.device_count() == 1), "Pallas's dB from its kernel unless of one key"
  got, base = grad("pallas"), grad("xla")
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))   # xla in float32: the truth
  # An entry sums `count` pairs' dS, whose float32 rounding grows with it. In 16 bits
  # delta = rowsum(dO O) takes the output as rounded to them (the kernels' way; xla's
  # autodiff keeps it in float32), so dB is held to their precision: half an ulp of bf16
  # beyond the rule (without it, 2 of 6 seeds failed by 1.00-1.21x on the CPU).
  count = np.prod((2, 4, T_DB, S_DB)) // np.prod(bias_shape)
  assert_within_budget(got.astype(dtype), grad("xla"), base, "dbias", magnitude=np.sqrt(count))


@pytest.mark.parametrize("implementation", ["native", "pallas"])
def test_bias_of_one_key_gradient_in_closed_form(rng, implementation):
  """A bias of one key moves each row's LSE by its value and leaves the output as it
  is: its gradient is dlse (the LSE being bf16 here, rounded to it) summed over its
  broadcast axes, 0 on rows that see no key,
  NaN on rows whose output is NaN (a visible NaN key) -- in 16 bits too, where the
  kernels' delta (from the rounded output) would leave most of it rounding error."""
  B, T, S, N = 2, 40, 56, 4
  q, k, v = random_inputs(rng, B, T, S, N, 2, 32, jnp.bfloat16)
  k = k.at[0, 3, 0].set(jnp.nan)   # seen by heads 0-1 of batch 0 past row 2 (causal)
  do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  dl = jnp.asarray(rng.standard_normal((B, T, N)), jnp.float32)   # the LSE's [B, T, N]
  lengths = jnp.asarray([T, T - 5])

  def grad(bias):
    def loss(b):
      o, lse = jaxflash.dot_product_attention(
          q, k, v, b, is_causal=True, query_seq_lengths=lengths, return_residual=True,
          differentiable_residual=True, implementation=implementation)
      lse = jnp.where(jnp.isfinite(lse) & (lse > -1e30), lse.astype(jnp.float32), 0.0)
      return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(lse * dl)
    return jax.grad(loss)(bias)

  rows = np.where(np.arange(T)[None, None, :] < np.asarray(lengths)[:, None, None],
                  np.asarray(dl.astype(jnp.bfloat16), np.float32).transpose(0, 2, 1), 0.0)
  rows[0, :2, 3:] = np.nan
  got = np.asarray(grad(jnp.zeros((B, N, T, 1), jnp.float32)))[..., 0]
  np.testing.assert_allclose(got, rows, rtol=1e-6, atol=1e-6)
  per_head = np.asarray(grad(jnp.zeros((1, N, 1, 1), jnp.float32)))
  np.testing.assert_allclose(per_head.ravel(), np.sum(rows, axis=(0, 2)), rtol=1e-5)
  assert np.all(np.isfinite(per_head.ravel()[2:]))
  # Rows that see no key: 0 whatever their cotangents (a NaN dO, a dlse).
  o = jnp.zeros((1, 2, 1, 4))
  do = jnp.asarray([[[[jnp.nan] * 4], [[1.0] * 4]]])
  empty = jnp.finfo(jnp.float32).min
  got = jaxflash.dense.gradient_over_keys(o, jnp.asarray([[[empty, 0.5]]]), do,
                                          jnp.asarray([[[3.0, 2.0]]]), (1, 1, 2, 1))
  np.testing.assert_array_equal(np.asarray(got).ravel(), [0.0, 2.0])


def test_errors(rng):
  q, k, v = random_inputs(rng, 2, 8, 8, 2, 2, 16, jnp.float32)
  with pytest.raises(TypeError, match="bias must be a floating-point"):
    jaxflash.dot_product_attention(q, k, v, jnp.zeros((8, 8), jnp.int32))
  with pytest.raises(ValueError, match="num_splits"):
    jaxflash.dot_product_attention(q, k, v, jnp.zeros((8, 8)), implementation="native",
                                   num_splits=2)


def test_native_gpu_dense_refusals_are_said_before_any_kernel():
  """What the CUDA kernels' dense path refuses (dispatch.cu's DenseRefusal), as the
  Python check says it on any platform."""
  q = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
  refusal = lambda q, width=64, bias=True, cap=0.0: _native.dense_gpu_refusal(q, q, width, bias, cap)
  assert refusal(q) is None
  assert refusal(q, bias=False, cap=30.0) is None
  assert "float16 and bfloat16" in refusal(jax.ShapeDtypeStruct(q.shape, jnp.float32))
  assert "soft_cap" in refusal(q, cap=30.0)
  assert "multiples of 8" in refusal(q, width=36)
  assert "65535 heads" in refusal(jax.ShapeDtypeStruct((2, 64, 70000, 64), jnp.bfloat16))
