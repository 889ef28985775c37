"""The logit soft-cap: the fused implementations against float64 truth.

`logits_soft_cap=c` turns each score u = scale * q.k into c * tanh(u / c)
before masking (reference.soft_cap; numpy_reference's `softcap`). Native on
the default backend (C++ on a CPU, CUDA on a GPU), Pallas on the GPU (and in
the CPU interpreter: test_pallas.py); the jnp derivatives give forward mode
and ring attention's blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from conftest import HAS_GPU, diagonal, random_inputs
from test_native import check_forward, check_gradients

CAP = 5.0
# (B, T, S, N, K, D): ragged lengths, GQA 2 and 4, head dims off the powers of two.
SHAPES = [(2, 37, 61, 4, 2, 40), (1, 70, 70, 8, 2, 64)]
MASKS = ["none", "causal", "window", "lengths_causal_bottom_right"]


# magnitude 2: scores of several units, where tanh(u / 5) bends.
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_forward(rng, shape, mask, dtype):
  check_forward(rng, shape, mask, dtype, magnitude=2.0, softcap=CAP)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_gradients(rng, mask, dtype):
  check_gradients(rng, SHAPES[0], mask, dtype, magnitude=2.0, softcap=CAP)


# On a GPU: the tensor-core kernels (16-bit; the sm80 family forced too), the SIMT
# kernels (float32) and the Pallas kernels, forward and backward.
# The fast tier runs each implementation and dtype with one mask, each mask at least once; the
# slow tier the rest.
@pytest.mark.gpu
@pytest.mark.parametrize("impl, dtype, mask", diagonal(
    [("native", jnp.bfloat16), ("native", jnp.float16), ("native", jnp.float32), ("pallas", jnp.bfloat16)],
    ["causal", "window", "lengths_causal_bottom_right"]))
def test_gpu_kernels(rng, impl, dtype, mask):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  for shape in SHAPES + [(1, 300, 300, 4, 1, 128)]:
    check_forward(rng, shape, mask, dtype, magnitude=2.0, implementation=impl, softcap=CAP)
    check_gradients(rng, shape, mask, dtype, magnitude=2.0, implementation=impl, softcap=CAP)
  for shape in [(2, 1, 500, 8, 2, 128), (2, 4, 700, 8, 1, 64)]:   # decode steps (split-KV)
    check_forward(rng, shape, mask, dtype, magnitude=2.0, implementation=impl, softcap=CAP)


# A grid past the small-grid rule (fwd_launch.cuh's SmallGrid: at D 64 more work tiles of the
# pick than half the SMs), so the capped calls run the two-consumer warp-specialised forward
# (CapAndMask) and the backward that keeps the tanh (KeptTanh): fused, or with
# `deterministic` the pass without dQ sums, then the dQ pass. With ALiBi, segment ids, GQA 4.
@pytest.mark.gpu
@pytest.mark.parametrize("extra", ["alibi", "segments"])
def test_gpu_warp_specialised_d64(rng, extra):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  from test_alibi import slopes
  from test_segments import packed
  shape = (1, 1100, 1100, 16, 4, 64)
  kw = dict(alibi=slopes(16)) if extra == "alibi" else dict(segments=packed)
  check_forward(rng, shape, "causal", jnp.bfloat16, magnitude=2.0, softcap=CAP, **kw)
  check_gradients(rng, shape, "causal", jnp.bfloat16, magnitude=2.0, softcap=CAP, **kw)
  check_gradients(rng, shape, "window", jnp.bfloat16, magnitude=2.0, softcap=CAP, deterministic=True, **kw)


# D 256: capped calls run the warp-specialised forward (the 80-key pick; with ALiBi its
# 64-key tile: both forced too, so a tile that stopped taking the cap fails rather than
# falling back) and the backward's column-tile passes (default: without dQ sums, then the
# dQ pass; `fused`: the tile with dQ sums). Ragged lengths, GQA 4, segment ids.
@pytest.mark.gpu
@pytest.mark.parametrize("extra", ["none", "alibi", "segments", "fused"])
def test_gpu_warp_specialised_d256(rng, extra, request):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  from jaxflash import _native
  from test_alibi import slopes
  from test_segments import packed
  kw = (dict(alibi=slopes(8)) if extra == "alibi" else
        dict(segments=packed) if extra == "segments" else {})
  if extra == "fused":
    request.getfixturevalue("fused_backward")
  shape = (2, 333, 333, 8, 2, 256)
  with _native.forced_tile(1 if extra == "alibi" else 3):   # 1-based: the 64- / 80-key tile
    check_forward(rng, shape, "lengths_causal_bottom_right", jnp.bfloat16, magnitude=2.0,
                  softcap=CAP, **kw)
  check_forward(rng, shape, "none", jnp.float16, magnitude=2.0, softcap=CAP, **kw)
  check_gradients(rng, shape, "causal", jnp.bfloat16, magnitude=2.0, softcap=CAP, **kw)
  check_gradients(rng, shape, "lengths_causal_bottom_right", jnp.float16, magnitude=2.0,
                  softcap=CAP, **kw)


# Non-finite inputs through the 16-bit warp-specialised forward with a cap: an infinite score
# is capped to a finite one, a NaN reaches only the rows that see it.
@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 192, 256])
def test_gpu_nonfinite_capped(rng, D):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  q, k, v = random_inputs(rng, 2, 600, 600, 8, 2, D, jnp.bfloat16)
  big = q.at[0, 3, 0, 0].set(jnp.inf)
  fused = jaxflash.dot_product_attention(big, k, v, logits_soft_cap=CAP, is_causal=True)
  dense = jaxflash.dot_product_attention(*(x.astype(jnp.float32) for x in (big, k, v)),
                                         logits_soft_cap=CAP, is_causal=True, implementation="xla")
  np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(dense), atol=3e-2)
  nan = q.at[1, 5, 1, 0].set(jnp.nan)
  got = np.asarray(jaxflash.dot_product_attention(nan, k, v, logits_soft_cap=CAP, is_causal=True),
                   np.float32)
  assert np.isnan(got[1, 5, 1]).all()
  assert np.isfinite(np.delete(got[1], 5, axis=0)).all() and np.isfinite(got[0]).all()
  assert np.isfinite(np.delete(got[1, 5], 1, axis=0)).all()


@pytest.mark.gpu
def test_gpu_sm80_kernels(rng):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  from jaxflash import _native
  with _native.forced_tile(0, sm80=True):
    check_forward(rng, (1, 300, 300, 4, 2, 64), "causal", jnp.bfloat16, magnitude=2.0,
                  softcap=CAP)
    check_gradients(rng, (1, 300, 300, 4, 2, 64), "causal", jnp.bfloat16, magnitude=2.0,
                    softcap=CAP)


def test_forward_mode(rng):
  q, k, v = random_inputs(rng, 1, 33, 45, 4, 2, 32, jnp.float32, magnitude=2.0)
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v))
  f = lambda impl: lambda q, k, v: jaxflash.dot_product_attention(
      q, k, v, is_causal=True, logits_soft_cap=CAP, implementation=impl)
  _, got = jax.jvp(f(None), (q, k, v), tangents)
  _, want = jax.jvp(f("xla"), (q, k, v), tangents)
  assert float(jnp.max(jnp.abs(got - want))) < 1e-4 * max(1.0, float(jnp.max(jnp.abs(want))))


def test_infinite_scores_cap_and_nan_stays(rng):
  """tanh takes an infinite score to +-c (a finite row); a NaN reaches the rows that see it."""
  q, k, v = random_inputs(rng, 1, 8, 8, 2, 2, 16, jnp.float32)
  big = q.at[0, 3, 0, 0].set(jnp.inf)
  fused = jaxflash.dot_product_attention(big, k, v, logits_soft_cap=CAP)
  dense = jaxflash.dot_product_attention(big, k, v, logits_soft_cap=CAP, implementation="xla")
  np.testing.assert_allclose(np.asarray(fused), np.asarray(dense), atol=1e-5, equal_nan=True)
  nan = q.at[0, 5, 1, 0].set(jnp.nan)
  got = np.asarray(jaxflash.dot_product_attention(nan, k, v, logits_soft_cap=CAP, is_causal=True))
  assert np.isnan(got[0, 5, 1]).all() and np.isfinite(np.delete(got[0], 5, axis=0)).all()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "soft"])
def test_bad_caps_are_refused_before_any_kernel(bad):
  q = jnp.zeros((1, 4, 2, 8), jnp.float32)
  with pytest.raises((TypeError, ValueError), match="logits_soft_cap"):
    jaxflash.dot_product_attention(q, q, q, logits_soft_cap=bad)


def test_traced_caps_and_cudnn_are_refused():
  q = jnp.zeros((1, 4, 2, 8), jnp.float32)
  with pytest.raises(TypeError, match="logits_soft_cap must be a static"):
    jax.jit(lambda c: jaxflash.dot_product_attention(q, q, q, logits_soft_cap=c))(1.0)
  with pytest.raises(ValueError, match="extra keywords"):
    jaxflash.dot_product_attention(q, q, q, logits_soft_cap=CAP, implementation="cudnn")


def test_paged_decode(rng):
  q = jnp.asarray(rng.standard_normal((2, 1, 4, 32)), jnp.float32) * 2
  pages = jnp.asarray(rng.standard_normal((6, 8, 2, 32)), jnp.float32) * 2
  values = jnp.asarray(rng.standard_normal((6, 8, 2, 32)), jnp.float32)
  table = jnp.array([[0, 2, 4], [1, 3, 5]], jnp.int32)
  lengths = jnp.array([20, 9], jnp.int32)
  run = lambda impl, **kw: jaxflash.paged_attention(q, pages, values, table, lengths,
                                                    implementation=impl, **kw)
  capped = run("xla", logits_soft_cap=CAP)
  np.testing.assert_allclose(np.asarray(run("native", logits_soft_cap=CAP)), np.asarray(capped),
                             atol=2e-5)
  assert float(jnp.max(jnp.abs(run("xla") - capped))) > 1e-3   # the cap changed the result
