"""Three implementations, one function: native vs pallas vs xla through the
public API, forward and gradients, on random shapes and masks.

Each is held to the float64 error budget, and native and pallas must agree
with each other within the sum of their budgets. On CPU the Pallas kernels run
in the interpreter, so shapes stay small.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import jaxflash
from cases import MASKS, mask_kwargs
from conftest import max_abs, random_inputs
from test_native import check_forward, check_gradients


@settings(max_examples=3, deadline=None)
# One key, float32: dQ is exactly 0 in exact arithmetic, and each implementation's
# rounding of dP - delta leaves ~1e-5 of it (a failure hypothesis found once).
@example(T=25, S=1, K=1, G=1, D=24, mask_name="none", dtype=jnp.float32, seed=0)
@given(T=st.integers(1, 40), S=st.integers(1, 40), K=st.integers(1, 2), G=st.sampled_from([1, 2]),
       D=st.sampled_from([8, 24, 40]), mask_name=st.sampled_from(list(MASKS)),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_three_way(T, S, K, G, D, mask_name, dtype, seed):
  rng = np.random.default_rng(seed)
  shape = (2, T, S, K * G, K, D)
  for implementation in ("native", "pallas", "xla"):
    check_forward(np.random.default_rng(seed), shape, mask_name, dtype,
                  implementation=implementation)
  check_gradients(rng, shape, mask_name, dtype, implementation="pallas")

  # native and pallas on the very same inputs.
  q, k, v = random_inputs(rng, 2, T, S, K * G, K, D, dtype)
  kw = mask_kwargs(mask_name, rng, 2, T, S)
  outs = {}
  for impl in ("native", "pallas"):
    # Jitted, as users call it (eager, the Pallas interpreter dispatches each operation alone).
    call = functools.partial(jaxflash.dot_product_attention, implementation=impl, **kw)
    loss = lambda q, k, v: jnp.sum(call(q, k, v).astype(jnp.float32) ** 2)
    outs[impl] = (jax.jit(call)(q, k, v), *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
  tol = 1e-5 if dtype == jnp.float32 else 5e-2
  size = lambda x: float(jnp.max(jnp.abs(x.astype(jnp.float32)), initial=0.0))
  # dQ, dK and dV come from the same products (dP, and delta that cancels
  # against it), so their rounding scales with the largest of the three, not
  # with each one's own size: with one key dQ is 0 but its rounding is dV's.
  grads = max(1.0, *(size(g) for g in outs["pallas"][1:]))
  for i, (a, b) in enumerate(zip(outs["native"], outs["pallas"])):
    assert max_abs(a, b) <= tol * (max(1.0, size(b)) if i == 0 else grads)


def test_automatic_choice_never_picks_the_interpreter():
  q = k = v = jnp.zeros((1, 8, 2, 16), jnp.float32)
  if jax.default_backend() == "cpu":
    # (causal: an unmasked call this small is of the CPU's small class, where xla may run)
    hlo = jax.jit(lambda q, k, v: jaxflash.dot_product_attention(q, k, v, is_causal=True)).lower(
        q, k, v).as_text()
    assert "jaxflash_fwd" in hlo
  out = jaxflash.dot_product_attention(q, k, v, implementation="pallas")
  assert out.shape == q.shape


def test_pallas_refuses_what_it_cannot_serve():
  q = k = v = jnp.zeros((1, 8, 2, 520), jnp.float32)
  with pytest.raises(ValueError, match="head_dim"):
    jaxflash.dot_product_attention(q, k, v, implementation="pallas")
