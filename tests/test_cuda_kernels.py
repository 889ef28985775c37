"""The CUDA kernels (tensor-core fp16/bf16 and SIMT fp32) against float64 truth.

Every test here needs a GPU (marker `gpu`; conftest skips them without one).
Errors are held to the DESIGN.md §5 budget: at most twice the error of the
`xla` implementation computed in the input dtype, plus a few float32 ulps.
Parameters outside the fast tier are marked `slow` (conftest.tiered): the fast
tier still runs every family, dtype, head-dim bucket and mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from cases import MASKS
from conftest import check_value_width_case, random_inputs, tiered, v_operand, value_width_case
from test_native import attention, check_forward, check_gradients

pytestmark = pytest.mark.gpu

LOW = [jnp.bfloat16, jnp.float16]
ALL = LOW + [jnp.float32]
# Every compiled bucket and the padded dims between them.
HEAD_DIMS = [32, 40, 64, 80, 96, 128, 160, 192, 256]
_ids = lambda x: getattr(x, "__name__", str(x))


def _poison_allocator():
  """Fill device memory XLA is about to reuse with NaN.

  XLA's allocator hands freed blocks back out, so outputs allocated right after
  this land on NaN-filled memory: an element a kernel forgets to write shows up
  as a non-finite value or a mismatch instead of a lucky zero.
  """
  x = jnp.full((64 << 20,), jnp.nan, jnp.float32)  # 256 MiB
  x.block_until_ready()
  del x


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", tiered(ALL, [jnp.bfloat16, jnp.float32]), ids=_ids)
def test_forward_head_dims(rng, D, dtype):
  _poison_allocator()
  # Ragged T/S, q_len != kv_len, GQA 4.
  check_forward(rng, (2, 130, 203, 8, 2, D), "causal_bottom_right", dtype)


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", tiered(ALL, [jnp.bfloat16, jnp.float32]), ids=_ids)
def test_gradients_head_dims(rng, D, dtype):
  _poison_allocator()
  check_gradients(rng, (2, 130, 203, 8, 2, D), "lengths", dtype)


SHAPES = [
    (2, 1, 17, 4, 4, 64),        # single query row (decode)
    (1, 17, 1, 2, 2, 128),       # single key
    (2, 127, 127, 8, 1, 64),     # MQA
    (1, 1000, 127, 8, 8, 128),   # q_len > kv_len
    (1, 127, 1000, 16, 2, 96),   # q_len < kv_len, GQA 8
    (1, 300, 300, 4, 1, 256),    # GQA 4, largest head
]


# The fast tier: decode, GQA 8 with q_len < kv_len, the largest head, in bfloat16.
FAST_SHAPES = [SHAPES[0], SHAPES[4], SHAPES[5]]


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("shape", tiered(SHAPES, FAST_SHAPES), ids=str)
@pytest.mark.parametrize("dtype", tiered(LOW, [jnp.bfloat16]), ids=_ids)
def test_forward_masks(rng, shape, mask_name, dtype):
  _poison_allocator()
  check_forward(rng, shape, mask_name, dtype)


@pytest.mark.parametrize("D", [64, 128])
def test_window_past_the_keys(rng, D):
  """q_len > kv_len under a local window: the last rows of a row block see no
  key, their window starting past the last one. The warp-specialised forward's
  loop over unmasked key tiles once ran past the tiles its producer loads and
  hung here (FullKeyTiles; twelfth session), which only the slow tier reached."""
  _poison_allocator()
  check_forward(rng, (1, 1000, 127, 4, 4, D), "window", jnp.bfloat16)


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("shape", tiered(SHAPES, FAST_SHAPES), ids=str)
@pytest.mark.parametrize("dtype", tiered(LOW, [jnp.bfloat16]), ids=_ids)
def test_gradients_masks(rng, shape, mask_name, dtype):
  _poison_allocator()
  check_gradients(rng, shape, mask_name, dtype)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", LOW, ids=_ids)
def test_gqa_gradients(rng, group, dtype):
  check_gradients(rng, (1, 200, 200, 2 * group, 2, 128), "causal", dtype)


@pytest.mark.parametrize("magnitude", [6.0, 50.0])  # scores up to ~1e3 and ~1e4 (D = 64)
@pytest.mark.parametrize("dtype", LOW + [jnp.float32], ids=_ids)
def test_large_logits(rng, dtype, magnitude):
  check_forward(rng, (1, 257, 257, 2, 2, 64), "causal", dtype, magnitude=magnitude)
  check_gradients(rng, (1, 257, 257, 2, 2, 64), "causal", dtype, magnitude=magnitude)


def _rising_scores(growth):
  """Inputs whose scores rise along the keys by `growth` (log2 units) every
  64 keys, on top of the usual random ones: q's first component is sqrt(D)
  (so scale * q0 = 1) and k's grows with the key's index."""
  def inputs(rng, shape, dtype):
    B, T, S, N, K, D = shape
    q = rng.standard_normal((B, T, N, D))
    k = rng.standard_normal((B, S, K, D))
    v = rng.standard_normal((B, S, K, D))
    q[..., 0] = np.sqrt(D)
    k[..., 0] = np.arange(S)[None, :, None] * (growth / np.log2(np.e) / 64)
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))
  return inputs


@pytest.mark.parametrize("mask_name", ["none", "causal"])
@pytest.mark.parametrize("D", [64, 128, 192, 256])
def test_rising_scores(rng, D, mask_name):
  """The Hopper forward takes a row's exponents against a reference that
  moves only when the row outgrows it by more than 2^8 (OnlineSoftmax::
  Scores<true>). Scores rising 3 (log2 units) a 64-key tile make it stay for
  two tiles and move on the third, probabilities up to 2^8 accumulated
  against a stale reference and rescaled later, in every row, every tile."""
  check_forward(rng, (2, 300, 700, 4, 2, D), mask_name, jnp.bfloat16, inputs=_rising_scores(3.0))


@pytest.mark.parametrize("D", tiered([64, 128, 192, 256], [128]))
@pytest.mark.parametrize("mask_name", ["causal", "lengths", "window"])
def test_deterministic_gradients(rng, D, mask_name):
  """The deterministic backward (separate dQ pass, no atomics) against float64."""
  check_gradients(rng, (2, 150, 203, 8, 2, D), mask_name, jnp.bfloat16, deterministic=True)


@pytest.mark.parametrize("dtype", LOW, ids=_ids)
def test_backward_is_deterministic(rng, dtype):
  q, k, v = random_inputs(rng, 2, 300, 300, 8, 2, 128, dtype)
  do = jnp.asarray(rng.standard_normal(q.shape), dtype)

  @jax.jit
  def grads(q, k, v):
    f = lambda q, k, v: jaxflash.dot_product_attention(
        q, k, v, is_causal=True, implementation="native", deterministic=True)
    _, vjp = jax.vjp(f, q, k, v)
    return vjp(do)

  first = [np.asarray(g) for g in grads(q, k, v)]
  for _ in range(3):
    again = grads(q, k, v)
    for a, b in zip(first, again):
      assert np.array_equal(a, np.asarray(b))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", LOW, ids=_ids)
def test_long_kv_32k_stable(rng, dtype):
  """S = 32k keys (bottom-right causal decode block): sampled rows vs float64."""
  B, T, S, N, K, D = 1, 64, 32768, 2, 1, 128
  q, k, v = random_inputs(rng, B, T, S, N, K, D, dtype)
  out, lse = attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
  out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  scale = 1.0 / np.sqrt(D)
  for n in range(N):
    s = np.einsum("td,sd->ts", q64[0, :, n], k64[0, :, 0]) * scale
    visible = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    expect = (p / p.sum(-1, keepdims=True)) @ v64[0, :, 0]
    # bf16/fp16 output rounding dominates: half an ulp of values of size ~1/sqrt(S).
    tol = 4 * float(jnp.finfo(dtype).eps) * max(1.0, float(np.abs(expect).max()))
    np.testing.assert_allclose(out[0, :, n], expect, atol=tol, rtol=0)
    np.testing.assert_allclose(lse[0, :, n], m[:, 0] + np.log(p.sum(-1)), atol=1e-3, rtol=0)


BUCKETS = [32, 64, 96, 128, 192, 256]


@pytest.mark.parametrize("sm80", [False, True], ids=["arch", "sm80"])
@pytest.mark.parametrize("candidate", tiered([1, 2, 3, 4, 5, 6, 7, 8], [1]))
@pytest.mark.parametrize("D", BUCKETS)
def test_every_tile_candidate(rng, D, candidate, sm80):
  """Each compiled tile shape, not just the table's pick, forward and backward.

  "arch" runs the family the GPU dispatches to (the wgmma kernels on Hopper for
  D in {64, 128, 192, 256}, whose forward and backward each have their own candidate
  lists); "sm80" forces the mma.sync family, which Ampere and the other buckets
  use, so both stay tested on a Hopper GPU.
  """
  from jaxflash import _native
  _poison_allocator()
  # 2 x 2 x 48 = 192 forward work tiles of 128 rows, more than an H100's 132
  # SMs: the persistent forwards walk several per CTA (Q and O buffers turn over).
  checks = {"forward": lambda: check_forward(rng, (2, 200, 333, 48, 8, D), "window", jnp.bfloat16),
            "backward": lambda: check_gradients(rng, (1, 200, 333, 4, 2, D), "causal", jnp.bfloat16)}
  missing = []
  with _native.forced_tile(candidate, sm80=sm80):
    for direction, check in checks.items():
      try:
        check()
      except Exception as e:  # each list has two to five candidates, forward and backward apart
        if candidate > 1 and "does not exist" in str(e):
          missing.append(direction)
          continue
        raise
  if len(missing) == len(checks):
    pytest.skip(f"bucket {D} has fewer than {candidate} candidates")


@pytest.mark.parametrize("mask_name", tiered(["causal", "lengths_causal_bottom_right", "window"], ["causal"]))
@pytest.mark.parametrize("D", tiered([64, 128, 256], [128]))
def test_diagonal_masks_walk_row_blocks_in_pairs(rng, D, mask_name):
  """The Hopper forward's scheduler pairs row block m with the last but m
  under diagonal masks where the pairs fill its rounds (sm90/tile_scheduler.cuh):
  two row blocks of 128, 66 heads (GQA 11), 8 batch elements: 528 pairs, four
  full rounds on 132 SMs, 93% full on 114 (an H100 PCIe), so both walk
  paired. Every tile exactly once, the masks as everywhere."""
  _poison_allocator()
  check_forward(rng, (8, 256, 256 if mask_name == "causal" else 384, 66, 6, D), mask_name, jnp.bfloat16)


@pytest.mark.parametrize("dqk, dv", [(192, 128), (160, 96), (192, 64)])
def test_value_width_of_its_own(rng, dqk, dv):
  """MLA-style widths: on an H100/H200 the forward and backward read v at its own head
  dim (the (192, 128) bucket pair, dispatch.cu TakesValueWidth), elsewhere v is padded. The traced forward's v operand says which; output, LSE and every
  gradient against float64 under the tolerance rule (bf16, causal bottom-right, GQA 2,
  ragged lengths, an empty row; 300 queries: past the decode kernels' packed rows). v 64
  leaves the pair's second 64-column block wholly past the tensor (zero-filled, not stored)."""
  kw = dict(is_causal=True, causal_alignment="bottom_right",
            key_value_seq_lengths=jnp.array([333, 120], jnp.int32),
            query_seq_lengths=jnp.array([300, 0], jnp.int32))
  case = value_width_case(rng, 2, 300, 333, 4, 2, dqk, dv, jnp.bfloat16, **kw)
  (q, k, v, _), _, grads = case
  own = getattr(jax.devices()[0], "compute_capability", "") == "9.0"
  hlo = grads.lower(q, k, v, "native").as_text()
  for target in ("@jaxflash_fwd", "@jaxflash_bwd"):
    assert v_operand(hlo, target).endswith(f"x{dv}xbf16>") == own, target
  check_value_width_case(case, "native")


# ------------------------------------------------------------------ the fused Hopper backward

def _sums_room_in_hlo(D, dtype=jnp.bfloat16, **kw):
  """Whether the traced backward call's last result is room for dQ sums."""
  q = jnp.zeros((1, 64, 2, D), dtype)
  f = lambda q: jnp.sum(jaxflash.dot_product_attention(q, q, q, implementation="native", **kw))
  call, = [line for line in jax.jit(jax.grad(f)).lower(q).as_text().splitlines()
           if "@jaxflash_bwd" in line]
  return call.rstrip().endswith(f"tensor<1x64x2x{D}xf32>)")


@pytest.mark.parametrize("D", tiered([40, 64, 120, 128, 176, 192, 200, 256], [64, 128, 192, 256]))
@pytest.mark.parametrize("mask_name", tiered(list(MASKS), ["causal", "lengths", "window"]))
def test_fused_backward(rng, fused_backward, D, mask_name):
  """The one-pass backward (dQ added into float32 sums; warp-specialised at
  D 64 and 128, column tiles at 192 and 256) against float64: ragged T/S, q_len != kv_len,
  GQA 4, padded head dims of each sm90 bucket."""
  assert _sums_room_in_hlo(D)
  _poison_allocator()
  check_gradients(rng, (2, 150, 203, 8, 2, D), mask_name, jnp.bfloat16)


@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("dtype", LOW, ids=_ids)
def test_fused_backward_gqa_and_shapes(rng, fused_backward, group, dtype):
  check_gradients(rng, (1, 333, 200, 2 * group, 2, 128), "causal_bottom_right", dtype)
  check_gradients(rng, (2, 1, 77, 2 * group, 2, 64), "causal", dtype)      # one query row
  check_gradients(rng, (1, 257, 257, 2, 2, 64), "causal", dtype, magnitude=50.0)


def test_fused_backward_not_for_deterministic_calls(fused_backward):
  """deterministic=True gets no room for dQ sums: it runs a dQ kernel instead."""
  from jaxflash import _native
  shape = lambda D: (1, 64, 2, D)
  assert not _native.dq_sums_room(jnp.bfloat16, shape(128), shape(128), True)
  assert not _native.dq_sums_room(jnp.float32, shape(128), shape(128), False)
  assert not _native.dq_sums_room(jnp.bfloat16, shape(96), shape(96), False)   # an sm80 bucket
  assert _sums_room_in_hlo(128) and not _sums_room_in_hlo(128, deterministic=True)


def test_fused_backward_by_default_where_measured_faster(fused_backward, monkeypatch):
  """Without JAXFLASH_FUSED_BACKWARD the D 64 and D 128 buckets run fused on
  sm90 and D 256 keeps the two kernels (docs/performance-log.md); =0 turns it off."""
  monkeypatch.delenv("JAXFLASH_FUSED_BACKWARD")   # the fixture's =1, for its sm90 check
  assert [_sums_room_in_hlo(D) for D in (64, 120, 128, 256)] == [True, True, True, False]
  monkeypatch.setenv("JAXFLASH_FUSED_BACKWARD", "0")
  assert not _sums_room_in_hlo(128)


@pytest.mark.parametrize("D", tiered([64, 128, 192, 256], [128]))
def test_forward_score_kernels(rng, D):
  """The Hopper forward runs plain calls, capped ones and the others (ALiBi without a cap, a
  scale whose log2 product is not a positive normal float) in kernels of their own, each walk
  (fwd_ws_kernel.cuh's FwdScores, picked by launch_util.cuh's ScoreMods): every kind against
  float64 truth, with and without segment ids (the dynamic walk), so a call sent to a kernel
  that lacks its scores' code fails here."""
  import numpy_reference
  from test_alibi import slopes
  from test_segments import packed
  _poison_allocator()
  shape = (2, 300, 300, 8, 2, D)
  alibi = slopes(8)
  for segments in (None, packed):
    for kw in ({}, dict(softcap=5.0), dict(alibi=alibi), dict(softcap=5.0, alibi=alibi)):
      check_forward(rng, shape, "causal", jnp.bfloat16, magnitude=2.0 if kw else 1.0, segments=segments, **kw)
  # Scales the plain kernel does not take: negative, zero, and positive with a denormal log2
  # product (the uniform softmax), with ALiBi beside the first.
  B, T, S, N, K, _ = shape
  q, k, v = random_inputs(rng, B, T, S, N, K, D, jnp.bfloat16)
  for scale, slopes_ in ((-0.5, None), (-0.5, alibi), (0.0, None), (1e-45, None)):
    out = jaxflash.dot_product_attention(q, k, v, is_causal=True, scale=scale, implementation="native",
                                         alibi_slopes=slopes_)
    truth, _, _ = numpy_reference.forward(q, k, v, scale=scale, alibi=slopes_, right=0)
    np.testing.assert_allclose(np.asarray(out, np.float64), truth, atol=3e-2, rtol=3e-2,
                               err_msg=f"D {D}, scale {scale}, ALiBi {slopes_ is not None}")
