"""Sequence lengths outside [0, length]: clamped by default, an error under
jaxflash.checked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from conftest import max_abs, random_inputs

T, S = 20, 24


def _attention(impl, q, k, v, ql, kl):
  return jaxflash.dot_product_attention(q, k, v, implementation=impl, is_causal=True,
                                        causal_alignment="bottom_right", query_seq_lengths=ql,
                                        key_value_seq_lengths=kl)


@pytest.mark.parametrize("impl", ["native", "pallas", "xla"])
def test_out_of_range_lengths_are_clamped(rng, impl):
  """Forward and gradients equal those of the clamped lengths, in every implementation."""
  q, k, v = random_inputs(rng, 3, T, S, 2, 1, 16, jnp.float32)
  wild = (jnp.array([-3, 99, 7], jnp.int32), jnp.array([1000, -1, 30], jnp.int32))
  clamped = (jnp.array([0, T, 7], jnp.int32), jnp.array([S, 0, S], jnp.int32))

  def run(lengths):
    loss = lambda q, k, v: jnp.sum(_attention(impl, q, k, v, *lengths) ** 2)
    return (_attention(impl, q, k, v, *lengths), *jax.grad(loss, argnums=(0, 1, 2))(q, k, v))

  for a, b in zip(run(wild), run(clamped)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_clamp_agrees_with_jax_nn_past_the_end(rng):
  """jax.nn's masks read a length past the end as the whole sequence, too."""
  q, k, v = random_inputs(rng, 2, T, S, 2, 2, 16, jnp.float32)
  kw = dict(query_seq_lengths=jnp.array([T + 5, 11], jnp.int32),
            key_value_seq_lengths=jnp.array([S + 100, 9], jnp.int32))
  ours = jaxflash.dot_product_attention(q, k, v, **kw)
  with jax.default_matmul_precision("highest"):
    theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
  assert max_abs(ours, theirs) < 2e-5


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("which, lengths, fragment", [
    ("q", [-1, 4], r"query_seq_lengths must lie in \[0, 20\]"),
    ("q", [21, 4], r"query_seq_lengths must lie in \[0, 20\]"),
    ("kv", [3, -7], r"key_value_seq_lengths must lie in \[0, 24\]"),
    ("kv", [25, 0], r"key_value_seq_lengths must lie in \[0, 24\]"),
])
def test_checked_raises_on_out_of_range_lengths(rng, jit, which, lengths, fragment):
  q, k, v = random_inputs(rng, 2, T, S, 2, 1, 16, jnp.float32)
  ok = jnp.array([T, S // 2], jnp.int32)
  bad = jnp.array(lengths, jnp.int32)
  ql, kl = (bad, ok) if which == "q" else (ok, bad)
  fn = lambda q, k, v, ql, kl: _attention("native", q, k, v, ql, kl)
  fn = jax.jit(fn) if jit else fn
  with pytest.raises(ValueError, match=fragment):
    jaxflash.checked(fn)(q, k, v, ql, kl)
  # Unchecked, the same call clamps and runs.
  assert fn(q, k, v, ql, kl).shape == q.shape


def test_unchecked_calls_carry_no_check_effect(rng):
  """Outside `checked` no check is planted: a planted one's effect keeps every
  call of the jitted function off jax.jit's C++ fast path (~200 us a call on an
  H100). The same jit object called inside `checked` afterwards is traced
  again, with the checks, and raises."""
  q, k, v = random_inputs(rng, 2, T, S, 2, 1, 16, jnp.float32)
  ok, bad = jnp.array([T, S // 2], jnp.int32), jnp.array([3, -7], jnp.int32)
  fn = jax.jit(lambda q, k, v, ql, kl: _attention("native", q, k, v, ql, kl))
  assert jax.make_jaxpr(fn)(q, k, v, ok, ok).effects == set()
  assert fn(q, k, v, ok, bad).shape == q.shape  # traced unchecked first
  with pytest.raises(ValueError, match=r"key_value_seq_lengths must lie in \[0, 24\]"):
    jaxflash.checked(fn)(q, k, v, ok, bad)


def test_checked_passes_valid_lengths_and_gradients_through(rng):
  q, k, v = random_inputs(rng, 2, T, S, 2, 1, 16, jnp.float32)
  ql, kl = jnp.array([T, 0], jnp.int32), jnp.array([0, S], jnp.int32)
  loss = lambda q: jnp.sum(_attention("native", q, k, v, ql, kl) ** 2)
  g = jaxflash.checked(jax.jit(jax.grad(loss)))(q)
  assert max_abs(g, jax.grad(loss)(q)) == 0
