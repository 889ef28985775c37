"""ALiBi: `alibi_slopes` against float64 truth.

The score of row i and key j gains -slope * |i + offset - j| (reference.alibi_bias;
numpy_reference.alibi_bias), the offset being the row's diagonal under the causal
alignment and the lengths. Native on the default backend (C++ on a CPU, CUDA on a
GPU), Pallas (the interpreter on a CPU) and xla; the jnp derivatives give native's
forward mode and ring attention's blocks, Pallas has a tangent kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from conftest import HAS_GPU, diagonal, random_inputs
from test_native import check_forward, check_gradients


def slopes(heads: int, base: float = 8.0) -> np.ndarray:
  """The ALiBi paper's geometric slopes 2^(-base (n + 1) / heads), float32."""
  return (2.0 ** (-base * (np.arange(heads) + 1) / heads)).astype(np.float32)


# (B, T, S, N, K, D): ragged lengths; GQA 1, 4 and 8; head dims off the powers of two.
SHAPES = [(2, 37, 61, 4, 4, 40), (1, 70, 70, 8, 2, 64), (2, 45, 45, 8, 1, 32)]
MASKS = ["none", "causal", "window", "lengths_causal_bottom_right"]


@pytest.mark.parametrize("shape, dtype", [(s, jnp.float32) for s in SHAPES] +
                         [(SHAPES[1], jnp.bfloat16)], ids=str)
@pytest.mark.parametrize("mask", MASKS)
def test_native_forward(rng, shape, mask, dtype):
  check_forward(rng, shape, mask, dtype, alibi=slopes(shape[3]))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_gradients(rng, mask, dtype):
  check_gradients(rng, SHAPES[0], mask, dtype, alibi=slopes(SHAPES[0][3]))


def test_composes_with_soft_cap_and_segment_ids(rng):
  """The cap applies first, the bias after it; segment ids and per-batch slopes with it."""
  shape = (2, 48, 48, 4, 2, 32)
  ids = lambda rng, B, T, S: (jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32),) * 2
  per_batch = np.stack([slopes(4), slopes(4, base=4.0)])
  for segs in (None, ids):
    check_forward(rng, shape, "causal", jnp.float32, magnitude=2.0, softcap=5.0, alibi=per_batch,
                  segments=segs)
    check_gradients(rng, shape, "causal", jnp.float32, magnitude=2.0, softcap=5.0,
                    alibi=per_batch, segments=segs)


def test_forward_mode_vmap_and_batch_axes(rng):
  q, k, v = random_inputs(rng, 2, 33, 45, 4, 2, 32, jnp.float32)
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v))
  f = lambda impl, s=slopes(4): lambda q, k, v: jaxflash.dot_product_attention(
      q, k, v, is_causal=True, causal_alignment="bottom_right", alibi_slopes=s,
      implementation=impl)
  # Each side jitted (eager, every operation of the xla side compiles on its own).
  jvp = lambda impl: jax.jit(lambda p, t: jax.jvp(f(impl), p, t))((q, k, v), tangents)
  _, got = jvp(None)
  _, want = jvp("xla")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
  # vmap over a leading axis (slopes closed over), and [*batch, heads] slopes.
  got = jax.jit(jax.vmap(f(None)))(q[:, None], k[:, None], v[:, None])[:, 0]
  np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(f("xla"))(q, k, v)), atol=2e-5)
  per_batch = np.stack([slopes(4), slopes(4, base=2.0)])[None]       # [1, 2, heads]
  x4 = lambda x: x[None]
  got = jax.jit(f(None, per_batch))(x4(q), x4(k), x4(v))
  np.testing.assert_allclose(
      np.asarray(got), np.asarray(jax.jit(f("xla", per_batch))(x4(q), x4(k), x4(v))), atol=2e-5)


def test_zero_slopes_are_the_plain_call_and_nan_slopes_stay(rng):
  q, k, v = random_inputs(rng, 1, 20, 20, 2, 2, 16, jnp.float32)
  plain = jaxflash.dot_product_attention(q, k, v, is_causal=True)
  zero = jaxflash.dot_product_attention(q, k, v, is_causal=True, alibi_slopes=np.zeros(2, np.float32))
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(zero))
  biased = jaxflash.dot_product_attention(q, k, v, is_causal=True, alibi_slopes=slopes(2))
  assert float(jnp.max(jnp.abs(biased - plain))) > 1e-2
  nan = jaxflash.dot_product_attention(q, k, v, is_causal=True,
                                       alibi_slopes=np.array([np.nan, 0.5], np.float32))
  assert np.isnan(np.asarray(nan[..., 0, :])).all() and np.isfinite(np.asarray(nan[..., 1, :])).all()


def test_slopes_get_no_gradient_and_bad_slopes_are_refused():
  q = jnp.ones((1, 4, 2, 8), jnp.float32)
  g = jax.grad(lambda s: jaxflash.dot_product_attention(q, q, q, alibi_slopes=s).sum())(
      jnp.ones(2, jnp.float32))
  np.testing.assert_array_equal(np.asarray(g), 0)   # constants, as documented
  for bad, match in [(np.ones(3, np.float32), "alibi_slopes must have shape"),
                     (np.ones((2, 2), np.float32), "alibi_slopes must have shape"),
                     (np.ones(2, np.int32), "floating-point"), ("slopes", "must be an array")]:
    with pytest.raises((TypeError, ValueError), match=match):
      jaxflash.dot_product_attention(q, q, q, alibi_slopes=bad)
  s = slopes(2)
  with pytest.raises(ValueError, match="extra keywords"):
    jaxflash.dot_product_attention(q, q, q, alibi_slopes=s, implementation="cudnn")


@pytest.mark.parametrize("splits", [1, 3])
def test_split_kv_decode_steps(rng, splits):
  """Short queries (the decode kernel's calls on a GPU; packed rows mix the heads of a
  group, each with its own slope), unsplit and split."""
  for shape in [(2, 1, 150, 8, 2, 32), (2, 3, 97, 4, 4, 16)]:
    check_forward(rng, shape, "lengths_causal_bottom_right", jnp.float32, alibi=slopes(shape[3]),
                  num_splits=splits)


@pytest.mark.parametrize("implementation, splits", [("native", 1), ("native", 3), ("pallas", 3)])
def test_a_nan_value_reaches_only_the_rows_that_see_it(rng, implementation, splits):
  """A NaN in the last key's value, inside a tile the other rows also read: only the row
  that sees the key turns NaN, in that column (the kernels recompute the others' outputs
  exactly, with their slopes); everything else equals xla's result without the NaN."""
  dtype = jnp.bfloat16 if HAS_GPU else jnp.float32
  B, T, S, N, K, D = 1, 4, 200, 8, 2, 64
  q, k, v = random_inputs(rng, B, T, S, N, K, D, dtype)
  kw = dict(is_causal=True, causal_alignment="bottom_right", alibi_slopes=slopes(N))
  out = np.asarray(jaxflash.dot_product_attention(q, k, v.at[0, S - 1, 0, 3].set(jnp.nan),
                                                  num_splits=splits, implementation=implementation,
                                                  **kw), np.float32)
  want = np.asarray(jaxflash.dot_product_attention(q, k, v, implementation="xla", **kw), np.float32)
  nan = np.zeros(out.shape, bool)
  nan[0, T - 1, :N // K, 3] = True        # the last row of K/V head 0's query heads
  assert np.array_equal(np.isnan(out), nan)
  assert np.max(np.abs(out[~nan] - want[~nan])) < (2e-2 if dtype == jnp.bfloat16 else 1e-5)


@pytest.mark.parametrize("mask", ["lengths_causal_bottom_right"])
def test_pallas(rng, mask):
  """The Pallas kernels (forward, dQ and dK/dV, tangent; the CPU interpreter here) with
  slopes, a soft-cap beside them; short queries run the decode kernel (packed rows of a
  GQA group, each with its own head's slope), split and not."""
  shape = (1, 24, 40, 4, 2, 16)
  check_forward(rng, shape, mask, jnp.float32, implementation="pallas", alibi=slopes(4))
  check_gradients(rng, shape, mask, jnp.float32, implementation="pallas", alibi=slopes(4),
                  softcap=5.0, magnitude=2.0)
  for splits in (1, 3):
    check_forward(rng, (2, 3, 40, 4, 2, 16), mask, jnp.float32, implementation="pallas",
                  alibi=slopes(4), num_splits=splits)
  q, k, v = random_inputs(rng, 1, 24, 40, 4, 2, 16, jnp.float32)
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v))
  f = lambda impl: lambda q, k, v: jaxflash.dot_product_attention(
      q, k, v, is_causal=True, alibi_slopes=slopes(4), implementation=impl)
  np.testing.assert_allclose(np.asarray(jax.jvp(f("pallas"), (q, k, v), tangents)[1]),
                             np.asarray(jax.jvp(f("xla"), (q, k, v), tangents)[1]), atol=2e-5)


# On a GPU: the tensor-core kernels (16-bit; the sm80 family forced too) and the SIMT
# kernels (float32), forward and backward, with a soft-cap and segment ids as well.
# The fast tier runs each dtype and each mask once; the slow tier the rest.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, mask", diagonal([jnp.bfloat16, jnp.float16, jnp.float32],
                                                 ["causal", "window", "lengths_causal_bottom_right"]))
def test_gpu_kernels(rng, dtype, mask):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  for shape in SHAPES + [(1, 300, 300, 4, 1, 128), (1, 200, 260, 4, 2, 256), (2, 1, 500, 8, 2, 128)]:
    check_forward(rng, shape, mask, dtype, alibi=slopes(shape[3]))
    if shape[1] > 1:
      check_gradients(rng, shape, mask, dtype, alibi=slopes(shape[3]))

  shape = (1, 300, 300, 4, 2, 128)
  check_forward(rng, shape, mask, dtype, magnitude=2.0, softcap=5.0, alibi=slopes(4))
  check_gradients(rng, shape, mask, dtype, magnitude=2.0, softcap=5.0, alibi=slopes(4))
  ids = lambda rng, B, T, S: (jnp.asarray(np.sort(rng.integers(0, 4, (B, T)), axis=1), jnp.int32),) * 2
  if mask != "lengths_causal_bottom_right":
    check_gradients(rng, shape, mask, dtype, alibi=slopes(4), segments=ids)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mask", ["causal", "lengths_causal_bottom_right", "window"])
def test_gpu_decode_kernel(rng, dtype, mask):
  """The decode kernel (short queries: 16- and 64-row tiles whose rows mix the heads of a
  group, each row with its own slope), split and not; the automatic choice runs it."""
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  for shape in [(2, 1, 500, 8, 2, 128), (2, 4, 700, 16, 2, 64), (1, 9, 333, 32, 4, 256)]:
    for splits in (1, 5):
      check_forward(rng, shape, mask, dtype, alibi=slopes(shape[3]), num_splits=splits)
  q = jnp.ones((2, 1, 8, 128), dtype)
  assert _core_order_of(q, slopes(8))[0] == "native"


def _core_order_of(q, alibi):
  from jaxflash import _core
  call = _core.validate(q, q, q, None, None, None, True, None, None, None, "bottom_right", False,
                        alibi_slopes=alibi)
  return _core.automatic_order(call)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_gpu_pallas(rng, dtype):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  for shape in [(1, 300, 300, 4, 2, 64), (2, 129, 200, 8, 1, 128), (2, 1, 500, 8, 2, 128)]:
    for mask in ("causal", "lengths_causal_bottom_right"):
      check_forward(rng, shape, mask, dtype, implementation="pallas", alibi=slopes(shape[3]))
      # float32 gradients are the bf16 kernels' code at a wider type, and Triton takes
      # ~45 s a shape to compile them: the fast tier checks them at bf16 only.
      if shape[1] > 1 and dtype != jnp.float32:
        check_gradients(rng, shape, mask, dtype, implementation="pallas", alibi=slopes(shape[3]))


@pytest.mark.gpu
def test_gpu_sm80_kernels(rng):
  if not HAS_GPU:
    pytest.skip("needs a GPU")
  from jaxflash import _native
  with _native.forced_tile(0, sm80=True):
    for shape in [(1, 300, 300, 4, 2, 64), (1, 200, 200, 4, 2, 128)]:
      check_forward(rng, shape, "causal", jnp.bfloat16, alibi=slopes(4))
      check_gradients(rng, shape, "causal", jnp.bfloat16, alibi=slopes(4), softcap=5.0)
