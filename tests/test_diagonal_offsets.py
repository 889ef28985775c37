"""The kernels' diagonal offsets (params.h) against float64 truth.

Ring attention hands every (query shard, key shard) block to the ordinary
kernels with the block's diagonal moved by a per-batch offset; these tests
check that argument alone, on random offsets on both sides of the block,
with every mask kind, forward and backward, for the native kernels (C++ on
the CPU, every CUDA family on a GPU) and the Pallas kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import _core, _native, reference
from cases import mask_kwargs, numpy_mask
from conftest import assert_within_budget, numpy_reference, random_inputs, tiered

MASK_NAMES = ["causal", "window", "window_causal_bottom_right", "lengths_causal_bottom_right",
              "lengths"]
KERNELS = _core.KERNELS


def _spec(q, k, v, kw):
  return _core.validate(
      q, k, v, None, None, None, kw.get("is_causal", False), kw.get("query_seq_lengths"),
      kw.get("key_value_seq_lengths"), kw.get("local_window_size"),
      kw.get("causal_alignment", "top_left"), False).spec


def _lengths(kw, name, B, n):
  x = kw.get(name)
  return jnp.full((B,), n, jnp.int32) if x is None else jnp.asarray(x, jnp.int32)


def check_offsets(rng, kernels, shape, mask_name, dtype):
  B, T, S, N, K, D = shape
  q, k, v = random_inputs(rng, B, T, S, N, K, D, dtype)
  kw = mask_kwargs(mask_name, rng, B, T, S)
  # Offsets on both sides of the block and beyond it (blocks nothing sees).
  offsets = rng.integers(-(T + S), T + S + 1, size=B).astype(np.int32)
  offsets[0] = rng.integers(-3, 4)
  spec = _spec(q, k, v, kw)
  ql, kl = _lengths(kw, "query_seq_lengths", B, T), _lengths(kw, "key_value_seq_lengths", B, S)
  mask = dict(numpy_mask(kw), offsets=offsets)
  scale = 1.0 / np.sqrt(D)

  def base(q, k, v, ql=ql, kl=kl, off=offsets):  # the `xla` implementation in the input
    return reference.attention(                   # dtype: the error yardstick
        q, k, v, scale=scale, is_causal=kw.get("is_causal", False),
        causal_alignment=kw.get("causal_alignment", "top_left"),
        local_window_size=kw.get("local_window_size"), query_seq_lengths=ql,
        key_value_seq_lengths=kl, compute_dtype=q.dtype, diagonal_offsets=off)

  # The kernels' calls and the baseline each jitted (eager, every operation compiles
  # on its own), the lengths and offsets as arguments (one program for every seed).
  off = jnp.asarray(offsets)
  forward = jax.jit(lambda *a: kernels.forward(*a[:5], spec, a[5]))
  o, lse = forward(q, k, v, ql, kl, off)
  truth_o, truth_lse, _ = numpy_reference.forward(q, k, v, scale=scale, **mask)
  base_o, base_lse = jax.jit(base)(q, k, v, ql, kl, off)
  assert_within_budget(o, truth_o, base_o, "output")
  empty = truth_lse == numpy_reference.EMPTY_LSE
  assert np.array_equal(np.asarray(lse) == numpy_reference.EMPTY_LSE, empty), \
      "LSE is the empty-row value exactly where no key"
  assert_within_budget(np.where(empty, 0, lse), np.where(empty, 0, truth_lse),
                       np.where(empty, 0, np.asarray(base_lse, np.float64)), "lse")

  do = jnp.asarray(rng.standard_normal(q.shape), dtype)
  dlse = jnp.asarray(np.where(empty, 0, rng.standard_normal(lse.shape)), jnp.float32)
  backward = jax.jit(lambda *a: kernels.backward(*a[:9], spec, a[9]))
  grads = backward(q, k, v, o, lse, do, dlse, ql, kl, off)
  truth = numpy_reference.backward(q, k, v, do, dlse, scale=scale, **mask)
  base_grads = jax.jit(lambda q, k, v, ql, kl, off, ct: jax.vjp(
      lambda q, k, v: base(q, k, v, ql, kl, off), q, k, v)[1](ct))(
          q, k, v, ql, kl, off, (do, dlse.astype(base_lse.dtype)))
  for name, g, b, t in zip(("dq", "dk", "dv"), grads, base_grads, truth):
    assert_within_budget(g, t, b, name)


@pytest.mark.parametrize("mask_name", MASK_NAMES)
@pytest.mark.parametrize("impl", list(KERNELS))
def test_offsets(rng, impl, mask_name):
  if impl == "native":
    _native.require(jax.default_backend())
  dtype = jnp.float32 if impl == "pallas" else jnp.bfloat16
  check_offsets(rng, KERNELS[impl], (2, 37, 29, 4, 2, 16), mask_name, dtype)


# On a GPU: the SIMT kernels (float32), the architecture's tensor-core family
# (wgmma on Hopper at D = 64/128/256), and the sm80 family forced on Hopper.
GPU_FAMILIES = [("simt", jnp.float32, False), ("arch", jnp.bfloat16, False),
                ("sm80", jnp.float16, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("D", tiered([64, 128], [128]))
@pytest.mark.parametrize("family,dtype,sm80", GPU_FAMILIES, ids=[f[0] for f in GPU_FAMILIES])
@pytest.mark.parametrize("mask_name", MASK_NAMES)
def test_offsets_cuda_families(rng, mask_name, family, dtype, sm80, D):
  # The kernels are called below the public API, which is what registers the FFI targets: a
  # worker whose first test this is would find no handler (seen on the GPU, twenty-fourth session).
  _native.require("gpu")
  with _native.forced_tile(0, sm80=sm80):
    check_offsets(rng, _core.NativeKernels, (2, 200, 333, 4, 2, D), mask_name, dtype)
