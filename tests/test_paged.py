"""paged_attention: the native kernels reading a paged KV cache in place,
against the same call on contiguous K/V, the gather-then-attend reference and
float64 truth. Runs on the default backend (C++ kernels in CI, CUDA with a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from conftest import assert_within_budget, numpy_reference

_ids = lambda x: getattr(x, "__name__", str(x))


def make_cache(rng, B, T, N, K, D, page_size, max_pages, dtype, lengths=None, spare_pages=3):
  """A shuffled page pool holding B sequences, and their contiguous twin.

  Returns q, key_pages, value_pages, page_table, kv_lengths, k, v where k, v
  are [B, max_pages * page_size, K, D]: sequence b's keys in order. Unused
  table entries are -1 (never read).
  """
  S = max_pages * page_size
  if lengths is None:
    lengths = rng.integers(T, S + 1, size=B)
  lengths = np.asarray(lengths, np.int32)
  used = -(-lengths // page_size)
  num_pages = int(used.sum()) + spare_pages
  order = rng.permutation(num_pages)
  table = np.full((B, max_pages), -1, np.int32)
  key_pages = rng.standard_normal((num_pages, page_size, K, D))
  value_pages = rng.standard_normal((num_pages, page_size, K, D))
  k = np.zeros((B, S, K, D))
  v = np.zeros((B, S, K, D))
  at = 0
  for b in range(B):
    for p in range(used[b]):
      table[b, p] = order[at]
      k[b, p * page_size:(p + 1) * page_size] = key_pages[order[at]]
      v[b, p * page_size:(p + 1) * page_size] = value_pages[order[at]]
      at += 1
  q = rng.standard_normal((B, T, N, D))
  cast = lambda x: jnp.asarray(x, dtype)
  return (cast(q), cast(key_pages), cast(value_pages), jnp.asarray(table), jnp.asarray(lengths),
          cast(k), cast(v))


def contiguous(q, k, v, lengths, **kw):
  window = kw.pop("local_window_size", None)
  return jaxflash.dot_product_attention(
      q, k, v, key_value_seq_lengths=lengths, is_causal=kw.pop("is_causal", True),
      causal_alignment="bottom_right", local_window_size=window, **kw)


MASKS = {"causal": {}, "full": dict(is_causal=False), "window": dict(local_window_size=(40, 0)),
         "window_ahead": dict(is_causal=False, local_window_size=(9, 3))}


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("page_size", [1, 16, 64, 24])
@pytest.mark.parametrize("shape", [(3, 1, 8, 8, 64), (2, 4, 8, 2, 32), (2, 16, 8, 2, 128)],
                         ids=str)
def test_paged_equals_contiguous(rng, shape, page_size, mask_name):
  """Same kernel, same key tiles: the paged call gives the contiguous call's bits
  (up to 64 packed rows, where the GPU runs the decode kernel for both)."""
  B, T, N, K, D = shape
  q, kp, vp, table, lengths, k, v = make_cache(rng, B, T, N, K, D, page_size,
                                              max(1, 300 // page_size), jnp.bfloat16)
  kw = MASKS[mask_name]
  for splits in (1, 3):
    paged = jaxflash.paged_attention(q, kp, vp, table, lengths, num_splits=splits,
                                     implementation="native", **kw)
    dense = contiguous(q, k, v, lengths, num_splits=splits, implementation="native", **dict(kw))
    np.testing.assert_array_equal(np.asarray(paged, np.float32), np.asarray(dense, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=_ids)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_against_float64(rng, group, dtype):
  B, T, K, D, page_size = 4, 3, 2, 64, 16
  q, kp, vp, table, lengths, k, v = make_cache(rng, B, T, K * group, K, D, page_size, 12, dtype,
                                              lengths=[0, 1, 77, 192])
  out = jaxflash.paged_attention(q, kp, vp, table, lengths, implementation="native")
  base = jaxflash.paged_attention(q, kp, vp, table, lengths, implementation="xla")
  truth, _, _ = numpy_reference.forward(q, k, v, scale=1 / np.sqrt(D), right=0, bottom_right=True,
                                        kv_lengths=np.asarray(lengths))
  assert out.dtype == dtype and out.shape == q.shape
  assert np.all(np.asarray(out, np.float32)[0] == 0), "a sequence of length 0 gives zeros"
  assert_within_budget(out, truth, base, "paged output")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=_ids)
def test_paged_alibi_against_float64(rng, dtype):
  """ALiBi slopes on the paged cache: each query row's bias from its position in the
  cache; split and not; the paged call gives the contiguous call's bits."""
  B, T, N, K, D, page_size = 3, 4, 8, 2, 64, 16
  q, kp, vp, table, lengths, k, v = make_cache(rng, B, T, N, K, D, page_size, 12, dtype,
                                              lengths=[4, 77, 192])
  slopes = (2.0 ** (-np.arange(1, N + 1))).astype(np.float32)
  truth, _, _ = numpy_reference.forward(q, k, v, scale=1 / np.sqrt(D), right=0, bottom_right=True,
                                        kv_lengths=np.asarray(lengths), alibi=slopes)
  base = jaxflash.paged_attention(q, kp, vp, table, lengths, alibi_slopes=slopes,
                                  implementation="xla")
  for splits in (1, 3):
    out = jaxflash.paged_attention(q, kp, vp, table, lengths, alibi_slopes=slopes,
                                   num_splits=splits, implementation="native")
    assert_within_budget(out, truth, base, f"paged output, {splits} splits")
    dense = contiguous(q, k, v, lengths, alibi_slopes=slopes, num_splits=splits,
                       implementation="native")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(dense, np.float32))


def test_shared_prefix_pages(rng):
  """Two sequences whose tables point at the same first pages (prefix sharing)."""
  q, kp, vp, table, lengths, k, v = make_cache(rng, 2, 2, 4, 2, 32, 16, 6, jnp.float32,
                                              lengths=[80, 96])
  table = table.at[1, :3].set(table[0, :3])
  k = k.at[1, :48].set(k[0, :48])
  v = v.at[1, :48].set(v[0, :48])
  out = jaxflash.paged_attention(q, kp, vp, table, lengths, implementation="native")
  dense = contiguous(q, k, v, lengths, implementation="native")
  np.testing.assert_array_equal(np.asarray(out), np.asarray(dense))


def test_under_jit_with_traced_table(rng):
  q, kp, vp, table, lengths, _, _ = make_cache(rng, 2, 1, 4, 4, 64, 16, 8, jnp.bfloat16)
  f = jax.jit(lambda q, t, n: jaxflash.paged_attention(q, kp, vp, t, n, num_splits=2))
  eager = jaxflash.paged_attention(q, kp, vp, table, lengths, num_splits=2)
  np.testing.assert_array_equal(np.asarray(f(q, table, lengths), np.float32),
                                np.asarray(eager, np.float32))


def test_bad_entries_under_jit_are_clamped_not_read(rng):
  """Out-of-range page indices and lengths cannot be checked inside jit: the
  kernels clamp them (same result as the reference, which clamps too)."""
  q, kp, vp, table, lengths, _, _ = make_cache(rng, 2, 1, 4, 2, 32, 16, 4, jnp.float32)
  table = table.at[0, 0].set(10_000).at[1, 1].set(-7)
  lengths = lengths.at[1].set(1_000_000)
  f = jax.jit(lambda t, n, impl: jaxflash.paged_attention(q, kp, vp, t, n, implementation=impl),
              static_argnums=2)
  native, xla = f(table, lengths, "native"), f(table, lengths, "xla")
  assert np.all(np.isfinite(np.asarray(native)))
  np.testing.assert_allclose(np.asarray(native), np.asarray(xla), atol=1e-5)


def test_vmap(rng):
  q, kp, vp, table, lengths, _, _ = make_cache(rng, 2, 1, 4, 2, 32, 16, 4, jnp.float32)
  qs = jnp.stack([q, -q])
  batched = jax.vmap(lambda q: jaxflash.paged_attention(q, kp, vp, table, lengths))(qs)
  for i in range(2):
    np.testing.assert_allclose(np.asarray(batched[i]),
                               np.asarray(jaxflash.paged_attention(qs[i], kp, vp, table, lengths)),
                               atol=1e-6)


def test_native_is_forward_only_xla_differentiates(rng):
  q, kp, vp, table, lengths, _, _ = make_cache(rng, 1, 1, 2, 2, 16, 16, 2, jnp.float32)
  loss = lambda q, impl: jnp.sum(jaxflash.paged_attention(q, kp, vp, table, lengths,
                                                          implementation=impl))
  with pytest.raises(NotImplementedError, match="forward-only"):
    jax.grad(loss)(q, "native")
  assert np.all(np.isfinite(np.asarray(jax.grad(loss)(q, "xla"))))


def _call(q, kp, vp, table, lengths, **kw):
  return jaxflash.paged_attention(q, kp, vp, table, lengths, **kw)


def test_errors_name_the_argument(rng):
  q, kp, vp, table, lengths, _, _ = make_cache(rng, 2, 1, 4, 2, 16, 8, 4, jnp.float32,
                                              lengths=[8, 20])
  with pytest.raises(ValueError, match=r"page_table\[1, 3\] = -1"):
    _call(q, kp, vp, table, jnp.array([8, 25]))          # needs a fourth page sequence 1 lacks
  with pytest.raises(ValueError, match=r"page_table\[0, 0\] = 99"):
    _call(q, kp, vp, table.at[0, 0].set(99), lengths)
  with pytest.raises(ValueError, match="kv_lengths must be in"):
    _call(q, kp, vp, table, jnp.array([8, 33]))          # beyond max_pages * page_size = 32
  with pytest.raises(ValueError, match="key_pages must be"):
    _call(q, kp[0], vp[0], table, lengths)
  with pytest.raises(ValueError, match="value_pages"):
    _call(q, kp, vp[:, :4], table, lengths)
  with pytest.raises(ValueError, match="page_table must be"):
    _call(q, kp, vp, table[0], lengths)
  with pytest.raises(ValueError, match="kv_lengths must be"):
    _call(q, kp, vp, table, lengths[:1])
  with pytest.raises(ValueError, match="multiple"):
    _call(q[:, :, :3], kp, vp, table, lengths)
  with pytest.raises(TypeError, match="share one dtype"):
    _call(q.astype(jnp.bfloat16), kp, vp, table, lengths)
  with pytest.raises(ValueError, match="implementation"):
    _call(q, kp, vp, table, lengths, implementation="pallas")
  with pytest.raises(ValueError, match="num_splits"):
    _call(q, kp, vp, table, lengths, num_splits=0)
