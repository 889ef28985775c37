"""JAX's own dot_product_attention tests, run against jaxflash.

The cases, shapes, seeds and tolerances of the attention tests in
tests/nn_test.py of the JAX repository (releases 0.10 and 0.11), written
again here: where JAX compares an implementation under test with
`jax.nn.dot_product_attention(implementation=None)` (its xla path), we put
jaxflash's implementations under test against the same reference. A drop-in
has to pass them as written, including their expectation that a cotangent
for the returned residual is ignored.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

import jaxflash

_ids = lambda x: getattr(x, "__name__", str(x))


def reference(*args, **kw):
  """jax.nn's xla implementation, in full float32 products on every backend."""
  with jax.default_matmul_precision("highest"):
    return jax.nn.dot_product_attention(*args, implementation="xla", **kw)


def assert_close(actual, desired, tol):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(desired, np.float32),
                             atol=tol, rtol=tol)


def _fold_groups(x, groups):
  """Gradient of K repeated over its query-head group, summed back per KV head."""
  B, S, N, H = x.shape
  return x.reshape(B, S, N // groups, groups, H).sum(axis=3)


# ------------------------------------------------------------------ GQA, vmap, residual
# JAX's testDotProductAttention: bf16/f16, GQA groups 1/2/4, with and without
# vmap over the batch, forward, gradients, and the residual with a cotangent
# of its own (which must not change the gradients).

@pytest.mark.parametrize("implementation", [None, "native", "xla"])
@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("group_num", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=_ids)
def test_dot_product_attention(dtype, group_num, use_vmap, implementation):
  check_dot_product_attention(dtype, group_num, use_vmap, implementation)


@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("group_num", [1, 4])
def test_dot_product_attention_pallas(group_num, use_vmap):
  check_dot_product_attention(jnp.bfloat16, group_num, use_vmap, "pallas")


def check_dot_product_attention(dtype, group_num, use_vmap, implementation):
  B, S, T, N, H, G = 2, 128, 128, 4, 32, group_num
  keys = random.split(random.PRNGKey(0), 5)
  q = random.normal(keys[0], (B, T, N, H), dtype)
  k = random.normal(keys[1], (B, S, N // G, H), dtype)
  v = random.normal(keys[2], (B, S, N // G, H), dtype)
  grad = random.normal(keys[3], (B, T, N, H), dtype)
  lse_grad = random.normal(keys[4], (B, T, N), dtype)

  ours = functools.partial(jaxflash.dot_product_attention, implementation=implementation)
  ours_lse = functools.partial(ours, return_residual=True)
  if use_vmap:  # per example: rank-3 inputs, no bias, no mask
    ours = jax.vmap(ours, in_axes=(0, 0, 0, None, None))
  # The reference sees K and V repeated over each group (no GQA).
  k_ref, v_ref = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)

  out_ref, vjp_ref = jax.vjp(reference, q, k_ref, v_ref, None, None)
  out, vjp = jax.vjp(ours, q, k, v, None, None)
  res_ref, vjp_res_ref = jax.vjp(functools.partial(reference, return_residual=True),
                                 q, k_ref, v_ref, None, None)
  res, vjp_res = jax.vjp(ours_lse, q, k, v, None, None)

  assert_close(out, out_ref, .01)
  dq, dk, dv = vjp(grad)[:3]
  dq_ref, dk_ref, dv_ref = vjp_ref(grad)[:3]
  assert_close(dq, dq_ref, .01)
  assert_close(dk, _fold_groups(dk_ref, G), .01)
  assert_close(dv, _fold_groups(dv_ref, G), .01)

  assert_close(res[0], res_ref[0], .01)
  assert_close(res[1], res_ref[1], .01)
  dq, dk, dv = vjp_res((grad, lse_grad))[:3]
  dq_ref, dk_ref, dv_ref = vjp_res_ref((grad, lse_grad))[:3]
  assert_close(dq, dq_ref, .01)
  assert_close(dk, _fold_groups(dk_ref, G), .01)
  assert_close(dv, _fold_groups(dv_ref, G), .01)


# ------------------------------------------------------------------ masks and bias
# JAX's testDotProductAttentionMask: bias, causal, padding (sequence
# lengths), a custom boolean mask, and combinations, bf16, with dbias.

MASK_MODES = ["bias", "causal", "padding", "custom", ("causal", "padding"), ("custom", "padding"),
              ("bias", "causal"), ("causal", "sliding_window")]


@pytest.mark.parametrize("implementation", [None, "native", "pallas"])
@pytest.mark.parametrize("mask_mode", MASK_MODES, ids=str)
def test_dot_product_attention_mask(mask_mode, implementation):
  mask_mode = (mask_mode,) if isinstance(mask_mode, str) else mask_mode
  if implementation is not None and ("bias" in mask_mode or "custom" in mask_mode):
    pytest.skip("a dense bias or mask is served by the xla implementation only")
  dtype = jnp.bfloat16
  B, S, T, N, H = 2, 128, 128, 4, 32
  keys = random.split(random.PRNGKey(0), 5)
  q = random.normal(keys[0], (B, T, N, H), dtype)
  k = random.normal(keys[1], (B, S, N, H), dtype)
  v = random.normal(keys[2], (B, S, N, H), dtype)
  grad = random.normal(keys[3], (B, T, N, H), dtype)
  bias = mask = q_seqlen = kv_seqlen = window = None
  is_causal = "causal" in mask_mode
  if "padding" in mask_mode:
    q_seqlen = jnp.array([T // 2, T // 4], jnp.int32)
    kv_seqlen = jnp.array([S // 4, S // 2], jnp.int32)
  if "custom" in mask_mode:  # a causal mask, given as a dense boolean mask
    mask = jnp.tril(jnp.ones((T, S), jnp.bool_))[None, None]
  if "bias" in mask_mode:
    bias = random.normal(keys[4], (1, N, T, S), dtype)
  if "sliding_window" in mask_mode:
    window = (3, 2) if is_causal else (3, 0)

  def call(fn, q, k, v, bias, mask, qs, kvs):
    return fn(q, k, v, bias, mask, is_causal=is_causal, query_seq_lengths=qs,
              key_value_seq_lengths=kvs, local_window_size=window)

  ours = functools.partial(jaxflash.dot_product_attention, implementation=implementation)
  args = (q, k, v, bias, mask, q_seqlen, kv_seqlen)
  out_ref, vjp_ref = jax.vjp(functools.partial(call, reference), *args)
  out, vjp = jax.vjp(functools.partial(call, ours), *args)
  assert_close(out, out_ref, .01)
  dq, dk, dv, dbias = vjp(grad)[:4]
  dq_ref, dk_ref, dv_ref, dbias_ref = vjp_ref(grad)[:4]
  assert_close(dq, dq_ref, .02)
  assert_close(dk, dk_ref, .02)
  assert_close(dv, dv_ref, .01)
  if bias is not None:
    assert_close(dbias, dbias_ref, .02)


# ------------------------------------------------------------------ float64 under debug_infs
# JAX's testDotProductAttentionFloat64MaskDebugInfs (jax-ml/jax#37422):
# float64 zeros with a boolean mask, rank-3 inputs, GQA: no inf may appear
# anywhere (jax.debug_infs checks every operation) and nothing may warn.

def test_float64_mask_under_debug_infs():
  T, S, K, N, H = 5, 7, 3, 6, 11
  with jax.enable_x64(True):
    mask = jnp.arange(S) <= S // 2
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      with jax.debug_infs(True):
        out = jaxflash.dot_product_attention(
            jnp.zeros((T, N, H), jnp.float64), jnp.zeros((S, K, H), jnp.float64),
            jnp.zeros((S, K, H), jnp.float64), mask=mask)
        out.block_until_ready()
    assert out.dtype == jnp.float64 and out.shape == (T, N, H)


# ------------------------------------------------------------------ bias gradient
# JAX's testDotProductAttentionBiasGradient: self-attention (q = k = v) with a
# per-example bias and an all-true mask, batch 1 and 16, with and without vmap.

@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("batch_size", [1, 16])
def test_dot_product_attention_bias_gradient(batch_size, use_vmap):
  dtype = jnp.bfloat16
  B, S, N, H = batch_size, 128, 4, 32
  keys = random.split(random.PRNGKey(0), 2)
  x = random.normal(keys[0], (B, S, N, H), dtype)
  bias = random.normal(keys[1], (B, N, S, S), dtype)
  mask = jnp.ones((1, 1, S), jnp.bool_)

  def attention(fn, x, bias, mask):
    return fn(x, x, x, bias, mask, is_causal=False)

  ref = functools.partial(attention, reference)
  ours = functools.partial(attention, jaxflash.dot_product_attention)
  if use_vmap:
    ref, ours = (jax.vmap(f, in_axes=(0, 0, None)) for f in (ref, ours))
  assert_close(jax.jit(ours)(x, bias, mask), jax.jit(ref)(x, bias, mask), 1e-2)

  def dbias(fn):
    _, vjp = jax.vjp(fn, x, bias, mask)
    return vjp(x)[1]
  assert_close(jax.jit(lambda: dbias(ours))(), jax.jit(lambda: dbias(ref))(), 0.1)


# ------------------------------------------------------------------ local window, no mask
# JAX's testDotProductAttention_localWindowSizeWithoutMask: the window alone
# changes the result.

@pytest.mark.parametrize("implementation", [None, "native", "pallas", "xla"])
def test_local_window_size_without_mask(implementation):
  B, S, T, N, H = 2, 128, 128, 4, 32
  keys = random.split(random.PRNGKey(0), 3)
  q = random.normal(keys[0], (B, T, N, H), jnp.float32)
  k = random.normal(keys[1], (B, S, N, H), jnp.float32)
  v = random.normal(keys[2], (B, S, N, H), jnp.float32)
  large, small = (jaxflash.dot_product_attention(q, k, v, mask=None, local_window_size=w,
                                                 implementation=implementation)
                  for w in ((32, 32), (1, 1)))
  assert not jnp.allclose(large, small)
  assert_close(small, reference(q, k, v, local_window_size=(1, 1)), 1e-5)
