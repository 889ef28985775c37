"""No false alarms under jax.debug_infs / jax.debug_nans.

Valid inputs, masked every way there is (causal, windows, padding of both
sequences, a batch element with no keys at all, so fully masked rows), must
not produce an inf or NaN anywhere: the flags check the output of every
operation run eagerly and of every jitted computation. The LSE of a row that
sees no key is therefore the dtype's lowest finite value, not -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from conftest import random_inputs

MASKS = {
    "lengths_causal": dict(is_causal=True, query_seq_lengths=np.array([20, 7], np.int32),
                           key_value_seq_lengths=np.array([0, 24], np.int32)),
    # Bottom-right windows leave the first rows of batch element 1 with no key.
    "window_bottom_right": dict(local_window_size=(2, 0), causal_alignment="bottom_right",
                                key_value_seq_lengths=np.array([24, 9], np.int32)),
}


def _run(impl, q, k, v, kw, jit, differentiable):
  def loss(q, k, v):
    out, lse = jaxflash.dot_product_attention(
        q, k, v, implementation=impl, return_residual=True,
        differentiable_residual=differentiable, **kw)
    # Empty rows' lowest value would overflow a sum (or a cast from float64).
    live = jnp.where(lse == jnp.finfo(lse.dtype).min, 0, lse).astype(jnp.float32)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(live), (out, lse)
  f = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  if jit:
    f = jax.jit(f)
  return jax.block_until_ready(f(q, k, v))


@pytest.mark.parametrize("differentiable", [False, True], ids=["residual", "differentiable"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("flag", ["debug_infs", "debug_nans"])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("impl", ["native", "pallas", "xla"])
def test_no_false_alarm(rng, impl, mask_name, flag, jit, differentiable):
  if impl == "pallas" and jit:
    pytest.skip("eager is the stricter case (every operation checked); the interpreter is slow")
  q, k, v = random_inputs(rng, 2, 20, 24, 2, 1, 16, jnp.float32)
  with getattr(jax, flag)(True):
    (_, (out, lse)), grads = _run(impl, q, k, v, MASKS[mask_name], jit, differentiable)
  for x in (out, lse, *grads):
    assert np.all(np.isfinite(np.asarray(x, np.float64)))
  assert np.any(np.asarray(lse) == np.finfo(np.float32).min)  # fully masked rows were there


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
def test_empty_row_residual_is_finite_in_half_types(rng, dtype):
  """float16's lowest value is -65504; a cast of float32's would be -inf."""
  q, k, v = random_inputs(rng, 2, 20, 24, 2, 1, 16, dtype)
  with jax.debug_infs(True):
    out, lse = jaxflash.dot_product_attention(q, k, v, return_residual=True,
                                              **MASKS["lengths_causal"])
  assert lse.dtype == dtype and np.all(np.asarray(lse)[0] == jnp.finfo(dtype).min)


@pytest.mark.parametrize("flag", ["debug_infs", "debug_nans"])
def test_float64_through_xla(rng, flag):
  with jax.enable_x64(True):
    q, k, v = random_inputs(rng, 2, 20, 24, 2, 1, 16, jnp.float64)
    with getattr(jax, flag)(True):
      (_, (out, lse)), grads = _run(None, q, k, v, MASKS["lengths_causal"], False, True)
    assert out.dtype == jnp.float64
    assert np.all(np.asarray(lse)[0] == np.finfo(np.float64).min)


# The fast GPU tier runs four of the eight cases, covering each implementation,
# dtype and flag twice (under the flags every op runs and compiles on its own,
# a few dozen programs a case); the slow tier runs the other four.
_FAST_ALARMS = {("native", "bfloat16", "debug_infs"), ("native", "float32", "debug_nans"),
                ("pallas", "bfloat16", "debug_nans"), ("pallas", "float32", "debug_infs")}


@pytest.mark.gpu
@pytest.mark.parametrize("impl,dtype,flag", [
    pytest.param(i, d, f, marks=() if (i, d.__name__, f) in _FAST_ALARMS else pytest.mark.slow)
    for i in ("native", "pallas") for d in (jnp.bfloat16, jnp.float32)
    for f in ("debug_infs", "debug_nans")], ids=lambda x: getattr(x, "__name__", str(x)))
def test_no_false_alarm_gpu(rng, impl, dtype, flag):
  """The CUDA kernels (tensor cores for bfloat16, SIMT for float32) and Triton."""
  q, k, v = random_inputs(rng, 2, 200, 240, 4, 2, 64, dtype)
  kw = dict(is_causal=True, query_seq_lengths=np.array([200, 70], np.int32),
            key_value_seq_lengths=np.array([0, 240], np.int32))
  with getattr(jax, flag)(True):
    (_, (out, lse)), grads = _run(impl, q, k, v, kw, False, True)
  for x in (out, lse, *grads):
    assert np.all(np.isfinite(np.asarray(x, np.float64)))
