"""Split-KV and GQA packing (decode steps) against float64 truth.

Runs on the default backend: the C++ kernels and the Pallas interpreter on a
CPU-only machine (CI), the CUDA kernels and Pallas on Triton with a GPU
(tests/test_cuda_decode.py adds the GPU-only cases). Forced split counts run
from one to more splits than there are key tiles (empty splits), over every
mask, GQA 1/4/8, all dtypes and sequence lengths 0 and 1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _splits
from cases import MASKS
from conftest import assert_within_budget, max_abs, numpy_reference, random_inputs
from test_native import attention, baseline, check_forward, check_gradients

_ids = lambda x: getattr(x, "__name__", str(x))

# (B, T, S, N, K, D): q_len 1..16 against longer K/V, GQA 1, 4 and 8.
DECODE_SHAPES = [
    (2, 1, 300, 8, 8, 64),     # MHA decode step
    (2, 1, 333, 8, 2, 40),     # GQA 4
    (1, 3, 500, 16, 2, 128),   # GQA 8, speculative q_len 3
    (2, 16, 200, 8, 2, 32),    # chunk of 16 queries, GQA 4 (64 packed rows)
    (1, 7, 129, 4, 1, 96),     # MQA 4, ragged
]
SPLITS = [1, 2, 3, 16]   # 16 > the key tiles of some shapes: empty splits merge to nothing


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("shape", DECODE_SHAPES[:3], ids=str)
def test_forced_splits_every_mask(rng, shape, mask_name, splits):
  check_forward(rng, shape, mask_name, jnp.bfloat16, num_splits=splits)


@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=_ids)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=str)
def test_forced_splits_dtypes(rng, shape, dtype, splits):
  check_forward(rng, shape, "lengths_causal_bottom_right", dtype, num_splits=splits)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_kv_lengths_zero_and_one(rng, group, splits):
  """Sequences with no key, one key, a few keys, and a full cache, q_len 1..16."""
  for T in (1, 2, 16):
    B, S, K, D = 4, 150, 2, 64
    q, k, v = random_inputs(rng, B, T, S, K * group, K, D, jnp.float32)
    kv_lengths = np.array([0, 1, 5, S], np.int32)
    kw = dict(is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=kv_lengths)
    out, lse = attention(q, k, v, num_splits=splits, **kw)
    truth_o, truth_lse, _ = numpy_reference.forward(
        q, k, v, scale=1 / np.sqrt(D), right=0, bottom_right=True, kv_lengths=kv_lengths)
    lse = np.asarray(lse).transpose(0, 2, 1)
    empty = truth_lse == numpy_reference.EMPTY_LSE
    assert empty[0].all() and np.array_equal(lse == numpy_reference.EMPTY_LSE, empty), \
        "the empty-row LSE exactly on rows with no key"
    assert np.all(np.asarray(out)[0] == 0), "a sequence with no keys gives zeros"
    assert max_abs(out, truth_o) < 1e-5
    assert max_abs(np.where(empty, 0, lse), np.where(empty, 0, truth_lse)) < 1e-5


@pytest.mark.parametrize("mask_name", ["causal_bottom_right", "window", "lengths"])
def test_split_equals_unsplit(rng, mask_name):
  """Split-KV is a reordering of the same sums: O and LSE agree to rounding."""
  B, T, S, N, K, D = 2, 4, 1000, 8, 2, 64
  q, k, v = random_inputs(rng, B, T, S, N, K, D, jnp.float32)
  from cases import mask_kwargs
  kw = mask_kwargs(mask_name, rng, B, T, S)
  o1, l1 = attention(q, k, v, num_splits=1, **kw)
  for splits in (2, 7, 64):
    o, l = attention(q, k, v, num_splits=splits, **kw)
    assert max_abs(o, o1) < 2e-6
    empty = np.asarray(l1) == numpy_reference.EMPTY_LSE
    assert np.array_equal(np.asarray(l) == numpy_reference.EMPTY_LSE, empty)
    assert np.all(np.isfinite(np.asarray(l)))
    assert max_abs(np.where(empty, 0, l), np.where(empty, 0, l1)) < 2e-6


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=_ids)
def test_backward_unaffected_by_splits(rng, dtype):
  """Gradients of a split forward: the backward sees the same O and LSE."""
  check_gradients(rng, (2, 3, 200, 8, 2, 64), "lengths_causal_bottom_right", dtype, num_splits=4)


def test_vmap_folds_the_split_partials(rng):
  q, k, v = random_inputs(rng, 2, 2, 300, 4, 2, 32, jnp.float32)
  qs, ks, vs = (jnp.stack([x, x * 0.5]) for x in (q, k, v))
  f = functools.partial(jaxflash.dot_product_attention, implementation="native", num_splits=3,
                        is_causal=True, causal_alignment="bottom_right")
  batched = jax.vmap(f)(qs, ks, vs)
  for i in range(2):
    assert max_abs(batched[i], f(qs[i], ks[i], vs[i])) < 1e-6


# ------------------------------------------------------------------ Pallas

PALLAS_CASES = [
    (DECODE_SHAPES[0], "causal_bottom_right", 1),
    (DECODE_SHAPES[1], "window_causal_bottom_right", 3),
    (DECODE_SHAPES[2], "lengths_causal_bottom_right", 4),
    (DECODE_SHAPES[3], "lengths", 16),
    ((1, 40, 70, 4, 2, 16), "causal", 2),   # 80 packed rows: the split path's second row tile
]


@pytest.mark.parametrize("shape,mask_name,splits", PALLAS_CASES, ids=str)
def test_pallas_splits(rng, shape, mask_name, splits):
  check_forward(rng, shape, mask_name, jnp.float32, implementation="pallas", num_splits=splits)


# ------------------------------------------------------------------ heuristic and API

def test_heuristic_fills_the_machine():
  # 32 items on 264 slots over 32k keys: about eight splits, none when the
  # items already fill the slots, none when the keys are few.
  s = _splits.heuristic(32, 32768, 264)
  assert 6 <= s <= 9
  assert _splits.heuristic(512, 32768, 264) == 1
  assert _splits.heuristic(8, 300, 264) == 1
  assert _splits.heuristic(8, 131072, 264) > 16
  assert 48 <= _splits.heuristic(1, 1 << 20, 264, max_splits=64) <= 64


def test_gpu_split_rule(monkeypatch):
  """On a GPU (132 SMs), 16-bit: short queries up to 128 packed rows split,
  longer ones run the training kernel unsplit unless paged (only the decode
  kernel reads pages); float32 never splits (the SIMT kernels)."""
  monkeypatch.setattr(_splits, "_gpu_sms", lambda: 132)
  native = lambda T, N, K, S, B=8, **kw: _splits.native(0, (B, T, N, 128), (B, S, K, 128),
                                                        jnp.bfloat16, "gpu", **kw)
  assert native(1, 32, 4, 32768) > 1           # a decode step: 32 items on 264 slots
  assert native(16, 32, 4, 32768) > 1          # 128 packed rows, two 64-row tiles per item
  assert native(32, 32, 4, 32768) == 1         # 256 rows: the training kernel
  assert native(32, 32, 4, 32768, paged=True) > 1
  assert native(1, 32, 8, 4096, B=64) == 1     # 512 items fill the machine
  assert _splits.native(0, (8, 1, 32, 128), (8, 32768, 4, 128), jnp.float32, "gpu") == 1
  assert [_splits.decode_tile_rows(r) for r in (1, 16, 17, 64, 128)] == [16, 16, 64, 64, 64]


def test_gpu_split_rule_counts_one_cta_where_one_fits(monkeypatch):
  """The native decode tiles at (D 256, 16 rows) and (D 192, 64 rows) fit one
  CTA per SM (decode_kernel.cuh asserts it), so half the slots: fewer splits
  than the Pallas kernel's count on the same call, the same elsewhere."""
  monkeypatch.setattr(_splits, "_gpu_sms", lambda: 132)
  def both(T, N, K, S, D, B=1):
    q, k = (B, T, N, D), (B, S, K, D)
    return _splits.native(0, q, k, jnp.bfloat16, "gpu"), _splits.pallas(0, q, k, "gpu")
  for T, D in ((1, 256), (16, 192), (1, 200)):   # a head dim in the 256 bucket too
    native, pallas = both(T, 32, 8, 131072, D)
    assert 1 < native < pallas
  for T, D in ((16, 256), (1, 192), (1, 128), (16, 128)):
    native, pallas = both(T, 32, 8, 131072, D)
    assert native == pallas > 1


def test_automatic_splits_on_a_many_core_cpu(rng, monkeypatch):
  """The CPU heuristic splits a single-item decode step over many threads."""
  monkeypatch.setattr(_splits.os, "cpu_count", lambda: 64)
  shape = (1, 1, 4096, 8, 1, 32)
  assert _splits.native(0, shape[:2] + shape[3:4] + shape[5:], (1, 4096, 1, 32), jnp.float32,
                        "cpu") > 1
  check_forward(rng, shape, "causal_bottom_right", jnp.float32)


@pytest.mark.parametrize("bad,error", [(0, ValueError), (2000, ValueError), (1.5, TypeError),
                                       (True, TypeError), ("2", TypeError)])
def test_num_splits_is_validated(rng, bad, error):
  q, k, v = random_inputs(rng, 1, 1, 8, 2, 1, 16, jnp.float32)
  with pytest.raises(error, match="num_splits"):
    jaxflash.dot_product_attention(q, k, v, num_splits=bad)


def test_cudnn_takes_no_num_splits(rng):
  q, k, v = random_inputs(rng, 1, 1, 8, 2, 1, 16, jnp.float32)
  with pytest.raises(ValueError, match="cudnn"):
    jaxflash.dot_product_attention(q, k, v, implementation="cudnn", num_splits=2)


def test_xla_ignores_num_splits(rng):
  q, k, v = random_inputs(rng, 1, 2, 30, 2, 1, 16, jnp.float32)
  # Jitted (eager, every operation compiles on its own).
  a = jax.jit(lambda q, k, v: jaxflash.dot_product_attention(
      q, k, v, implementation="xla", num_splits=3))(q, k, v)
  b = jax.jit(lambda q, k, v: jaxflash.dot_product_attention(q, k, v, implementation="xla"))(
      q, k, v)
  assert max_abs(a, b) == 0
