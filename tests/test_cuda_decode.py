"""The CUDA decode kernels (GQA packing, split-KV, paged K/V) against float64.

Every test here needs a GPU (marker `gpu`). Each compiled head-dim bucket, both
decode tile shapes, split counts from one to more splits than key tiles, every
mask and GQA 1/4/8 with q_len 1..16; paged caches with page sizes 1, 16, 24
and 64; a long (32k) decode step with the automatic split count; and, on an sm_90a
GPU, the TMA-loading decode kernel against its cp.async twin bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _native, _splits
from cases import MASKS
from conftest import (assert_within_budget, check_value_width_case, numpy_reference, random_inputs, tiered,
                      v_operand, value_width_case)
from test_cuda_kernels import _poison_allocator
from test_native import attention, baseline, check_forward
from test_paged import contiguous, make_cache

pytestmark = pytest.mark.gpu

LOW = [jnp.bfloat16, jnp.float16]
_ids = lambda x: getattr(x, "__name__", str(x))


@pytest.mark.parametrize("splits", [1, 3, 40])
@pytest.mark.parametrize("D", tiered([32, 40, 64, 96, 128, 160, 192, 256], [40, 96, 128, 256]))
@pytest.mark.parametrize("dtype", tiered(LOW, [jnp.bfloat16]), ids=_ids)
def test_decode_head_dims(rng, dtype, D, splits):
  _poison_allocator()
  check_forward(rng, (2, 2, 1000, 16, 2, D), "lengths_causal_bottom_right", dtype, num_splits=splits)


# q_len 1..16 x GQA 1/4/8: 1 to 128 packed rows (one 16-row tile up to two 64-row tiles).
DECODE_SHAPES = [(2, 1, 777, 8, 8, 128), (2, 1, 500, 8, 2, 64), (1, 2, 900, 16, 2, 128),
                 (2, 4, 333, 16, 2, 64), (1, 16, 600, 8, 2, 128), (2, 16, 257, 16, 2, 64)]


@pytest.mark.parametrize("splits", [1, 5, 64])
@pytest.mark.parametrize("mask_name", tiered(list(MASKS), ["causal_bottom_right", "lengths",
                                                           "window_causal_bottom_right"]))
@pytest.mark.parametrize("shape", tiered(DECODE_SHAPES, [DECODE_SHAPES[i] for i in (0, 3, 5)]),
                         ids=str)  # fast: 1, 32 and 128 packed rows
def test_decode_masks_and_splits(rng, shape, mask_name, splits):
  _poison_allocator()
  check_forward(rng, shape, mask_name, jnp.bfloat16, num_splits=splits)


@pytest.mark.parametrize("splits", [12, 20, 100])
@pytest.mark.parametrize("D", [128, 256])
def test_merge_rows_shared_by_warps(rng, D, splits):
  """The merge's layouts with 2, 4 and 8 warps per row (two rounds of loads
  at 100 splits, most of them empty) on 5 rows, so a block's last rows are
  past the end; D 256 takes two column chunks."""
  _poison_allocator()
  check_forward(rng, (1, 1, 1000, 5, 1, D), "lengths_causal_bottom_right", jnp.bfloat16, num_splits=splits)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("candidate", [1, 2])
@pytest.mark.parametrize("shape", [(2, 1, 300, 8, 1, 64), (1, 6, 400, 8, 1, 128),
                                   (1, 130, 200, 4, 4, 96)], ids=str)
def test_every_decode_tile(rng, shape, candidate, splits):
  """Both tile shapes (16 rows, warps split keys; 64 rows, warps split rows)
  on 8, 48 and 130 packed rows, whichever the table would pick."""
  _poison_allocator()
  with _native.forced_tile(candidate):
    check_forward(rng, shape, "window_causal_bottom_right", jnp.float16, num_splits=splits)


def test_forced_splits_on_a_long_query(rng):
  """num_splits > 1 routes any query length to the decode kernel (many query tiles)."""
  _poison_allocator()
  check_forward(rng, (2, 300, 500, 8, 2, 64), "causal", jnp.bfloat16, num_splits=3)
  check_forward(rng, (1, 200, 200, 4, 4, 128), "lengths", jnp.float16, num_splits=5)


@pytest.mark.parametrize("dtype", LOW, ids=_ids)
def test_long_decode_step_automatic_splits(rng, dtype):
  """One query against 32k keys, 32 query / 8 K/V heads: the heuristic splits it."""
  B, T, S, N, K, D = 1, 1, 32768, 32, 8, 128
  assert _splits.native(0, (B, T, N, D), (B, S, K, D), dtype, "gpu") > 1
  check_forward(rng, (B, T, S, N, K, D), "causal_bottom_right", dtype)


@pytest.mark.parametrize("dtype", tiered(LOW + [jnp.float32], [jnp.bfloat16, jnp.float32]), ids=_ids)
@pytest.mark.parametrize("page_size", tiered([1, 4, 8, 16, 24, 64], [1, 24]))
@pytest.mark.parametrize("shape", [(4, 1, 32, 8, 128), (2, 5, 8, 1, 64), (2, 16, 16, 2, 96)],
                         ids=str)
def test_paged_on_gpu(rng, shape, page_size, dtype):
  """Paged against float64, and against contiguous bit for bit wherever both run
  the same kernel (float32: SIMT; 16-bit: the decode kernel, which a paged call
  always takes and a contiguous one takes up to 64 packed rows or when split);
  sequences of length 0 and 1 included. Page sizes on both sides of the decode
  kernel's one-page copies (a thread's 4 rows at D 64, 8 at D 96 and 128:
  PageEntries::OnePage) and not powers of two."""
  _poison_allocator()
  B, T, N, K, D = shape
  lengths = [0, 1, 300, 1000] if B == 4 else [0, 777]
  q, kp, vp, table, kv_lengths, k, v = make_cache(rng, B, T, N, K, D, page_size,
                                                 -(-1024 // page_size), dtype, lengths=lengths)
  kw = dict(is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=kv_lengths)
  truth, _, _ = numpy_reference.forward(q, k, v, scale=1 / np.sqrt(D), right=0, bottom_right=True,
                                        kv_lengths=np.asarray(kv_lengths))
  base = baseline(q, k, v, **kw)[0]
  for splits in (None, 1, 4):
    paged = jaxflash.paged_attention(q, kp, vp, table, kv_lengths, num_splits=splits)
    assert_within_budget(paged, truth, base, f"paged output, num_splits={splits}")
    resolved = _splits.native(splits or 0, q.shape, k.shape, dtype, "gpu")
    if dtype == jnp.float32 or T * (N // K) <= 64 or resolved > 1:
      dense = contiguous(q, k, v, kv_lengths, num_splits=splits, implementation="native")
      np.testing.assert_array_equal(np.asarray(paged, np.float32), np.asarray(dense, np.float32))


@pytest.mark.parametrize("dqk, dv", [(192, 128), (64, 128), (128, 96)])
def test_decode_value_width_of_its_own(rng, dqk, dv):
  """MLA-style widths in the decode kernels: v, its pages and O at v's own head dim (the
  tile at the wider; each side's columns past its own land as zeros in shared memory, v 96
  half a TMA box). The traced calls' v operands at dv; a decode step contiguous (unsplit,
  split) and paged (page 16: TMA boxes on sm_90a; 24: cp.async) against float64, GQA 4,
  ragged lengths and an empty sequence; and the gradients of a 4-query call, whose backward
  pads every operand to the wider dim where its kernels take one (all but the Hopper
  (192, 128) pair), against float64."""
  _poison_allocator()
  B, T, N, K = 3, 2, 8, 2
  lengths = [700, 0, 333]
  kw = dict(is_causal=True, causal_alignment="bottom_right")
  f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
  for page in (16, 24):
    q, kp, _, table, kv_lengths, k, _ = make_cache(rng, B, T, N, K, dqk, page, -(-700 // page),
                                                   jnp.bfloat16, lengths=lengths)
    v = rng.standard_normal((B, k.shape[1], K, dv))
    vp = rng.standard_normal((kp.shape[0], page, K, dv))
    for b, row in enumerate(np.asarray(table)):
      for slot, entry in enumerate(row):
        if entry >= 0:
          vp[entry] = v[b, slot * page:(slot + 1) * page]
    v, vp = jnp.asarray(v, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16)
    lengths_kw = dict(kw, key_value_seq_lengths=kv_lengths)
    with jax.enable_x64(True):
      truth = jaxflash.dot_product_attention(f64(q), f64(k), f64(v), implementation="xla", **lengths_kw)
    base = baseline(q, k, v, **lengths_kw)[0]
    paged = lambda q, kp, vp: jaxflash.paged_attention(q, kp, vp, table, kv_lengths)
    assert v_operand(jax.jit(paged).lower(q, kp, vp).as_text(), "@jaxflash_paged_fwd").endswith(f"x{dv}xbf16>")
    assert_within_budget(paged(q, kp, vp), truth, base, f"paged output, page {page}")
    for splits in (1, 4):
      run = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, implementation="native",
                                                           num_splits=splits, **lengths_kw)
      assert v_operand(jax.jit(run).lower(q, k, v).as_text(), "@jaxflash_fwd").endswith(f"x{dv}xbf16>")
      assert_within_budget(run(q, k, v), truth, base, f"output, num_splits={splits}")

  case = value_width_case(rng, B, 4, 500, N, K, dqk, dv, jnp.bfloat16, **kw,
                          key_value_seq_lengths=jnp.array([500, 3, 0], jnp.int32))
  (q, k, v, _), _, grads = case
  hlo = grads.lower(q, k, v, "native").as_text()
  assert v_operand(hlo, "@jaxflash_fwd").endswith(f"x{dv}xbf16>")
  pair = getattr(jax.devices()[0], "compute_capability", "") == "9.0" and dqk == 192 and dv <= 128
  assert v_operand(hlo, "@jaxflash_bwd").endswith(f"x{dv if pair else max(dqk, dv)}xbf16>")
  check_value_width_case(case, "native")


def _poison_past_lengths(kp, vp, table, lengths, k, v):
  """NaN in every cache slot past a sequence's length: the tail of its last
  page, the pages no sequence uses, and the contiguous twin's tail."""
  kp, vp, k, v = (np.array(x, np.float32) for x in (kp, vp, k, v))
  table, lengths = np.asarray(table), np.asarray(lengths)
  page_size = kp.shape[1]
  used = np.zeros(kp.shape[0], bool)
  for b, n in enumerate(lengths):
    k[b, n:] = v[b, n:] = np.nan
    for slot in range(-(-int(n) // page_size)):
      used[table[b, slot]] = True
    if n % page_size:
      kp[table[b, n // page_size], n % page_size:] = vp[table[b, n // page_size], n % page_size:] = np.nan
  kp[~used] = vp[~used] = np.nan
  return kp, vp, k, v


@pytest.mark.parametrize("dtype", tiered(LOW, [jnp.bfloat16]), ids=_ids)
@pytest.mark.parametrize("case", tiered(
    [((4, 1, 32, 8, 128), 8), ((4, 1, 32, 8, 128), 16), ((4, 1, 32, 8, 128), 64),
     ((2, 2, 16, 2, 64), 32), ((2, 1, 16, 2, 256), 16), ((2, 3, 24, 8, 192), 128),
     ((2, 8, 16, 2, 128), 64), ((2, 8, 16, 2, 128), 16)],
    [((4, 1, 32, 8, 128), 16), ((2, 2, 16, 2, 64), 32), ((2, 1, 16, 2, 256), 16)]), ids=str)
def test_tma_and_cp_async_loaders_agree(rng, case, dtype):
  """On a GPU that runs the sm_90a code the decode kernel copies K/V by TMA
  (dense caches and pages of 8+ keys at head dims 64/128/192/256; 64-row
  tiles take pages of a whole key tile, so the last case stays on cp.async);
  the sm80 flag forces its cp.async copies. Only the copies differ, so the bits must not:
  paged and dense, split and not, ragged lengths 0..1000 with NaN stored in
  every slot past a length (zeroed or masked, never in a product), and the
  result within the error budget of the float64 truth."""
  if str(getattr(jax.devices()[0], "compute_capability", "")) != "9.0":
    pytest.skip("the TMA loader runs on sm_90a GPUs only")
  _poison_allocator()
  (B, T, N, K, D), page_size = case  # shape, then page size
  lengths = [0, 1, 300, 1000] if B == 4 else [T, 777]
  q, kp, vp, table, kv_lengths, k, v = make_cache(rng, B, T, N, K, D, page_size,
                                                 -(-1024 // page_size), dtype, lengths=lengths)
  truth, _, _ = numpy_reference.forward(q, k, v, scale=1 / np.sqrt(D), right=0, bottom_right=True,
                                        kv_lengths=np.asarray(kv_lengths))
  kw = dict(is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=kv_lengths)
  base = baseline(q, k, v, **kw)[0]
  kp, vp, k, v = (jnp.asarray(x, dtype) for x in _poison_past_lengths(kp, vp, table, kv_lengths, k, v))

  def run(sm80):
    with _native.forced_tile(0, sm80=sm80):
      return [np.asarray(out, np.float32) for splits in (1, 5) for out in (
          jaxflash.paged_attention(q, kp, vp, table, kv_lengths, num_splits=splits),
          contiguous(q, k, v, kv_lengths, num_splits=splits, implementation="native"))]

  tma, cp_async = run(False), run(True)
  for got, want in zip(tma, cp_async):
    np.testing.assert_array_equal(got, want)
  for got in tma:
    assert_within_budget(got, truth, base, "TMA-loaded output")


def test_split_results_repeat(rng):
  """Split-KV has no atomics: the same call gives the same bits."""
  q, k, v = random_inputs(rng, 2, 1, 5000, 16, 2, 128, jnp.bfloat16)
  first = np.asarray(attention(q, k, v, num_splits=9)[0], np.float32)
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(attention(q, k, v, num_splits=9)[0], np.float32), first)
