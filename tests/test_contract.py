"""The contract, fuzzed: random calls checked against the float64 truth.

Hypothesis draws every argument that shapes a call: batch, query and key
lengths (decode-step queries of 1 to 4 rows often), heads and GQA ratio, head
dim (most not a multiple of 8), dtype, causal masks in both alignments,
windows, sequence lengths (0 and full included), scale (zero and negative
included), forced split-KV (`num_splits`), `return_residual` with and without
a float32 or differentiable residual. Each call's output, residual and
gradients are held to the tolerance rule against `numpy_reference` in
float64. The rule's yardstick is the `xla` implementation in the input dtype,
whose compilation per shape would cost a second a call; the check first uses
`numpy_reference.in_dtype` (every operation correctly rounded to the dtype,
a stricter yardstick: XLA's own low-precision reductions and softmax gradient
err more) and compiles the real one only for a call that fails that. For the
gradients a third yardstick applies last: the exact gradients computed from
the output as stored (delta = rowsum(dO * O) with O rounded to the input
dtype), which is what every fused backward reads (docs/design.md §5: in a row
dominated by one key that rounding is most of dQ's error, and the dense xla
path, whose softmax gradient never forms delta from O, does better there).
Failures shrink to a minimal call; the ones found are kept as explicit cases
at the bottom.

Budget: on the CPU, 300 native calls (4 shards; JAXFLASH_FUZZ_EXAMPLES sets
the total) and 40 Pallas-interpreter calls (JAXFLASH_FUZZ_PALLAS_EXAMPLES)
drawn from a fixed menu of static configurations (the interpreter's compile
time is per configuration; both cut twice as CI neared its time limit, from
1000 and 120; every run draws afresh, and the GPU tier keeps the larger draws); on a
GPU (`slow` tier, tools/gpu_check.sh fuzz), 2000 native calls at larger
shapes and 200 Pallas (JAXFLASH_FUZZ_GPU_EXAMPLES).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxflash
from conftest import assert_within_budget, numpy_reference

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
SHARDS = 4
GPU_SHARDS = 8


@dataclasses.dataclass(frozen=True)
class Call:
  """One drawn call: shapes, dtype, static keywords, lengths, residual options."""
  shape: tuple[int, int, int, int, int, int]   # B, T, S, N, K, D
  dtype: type
  static: tuple                                 # keyword arguments that are Python values
  q_lengths: tuple | None
  kv_lengths: tuple | None
  return_residual: bool
  residual_float32: bool
  differentiable: bool
  seed: int


def _lengths(draw, batch, length, always=False):
  """None (no lengths argument) or one length per batch element, 0 and full included."""
  if not always and not draw(st.booleans()):
    return None
  each = st.one_of(st.just(0), st.just(length), st.integers(0, length))
  return tuple(draw(st.lists(each, min_size=batch, max_size=batch)))


@st.composite
def _masks(draw):
  """Static mask keywords: causal (both alignments), windows, both, or none."""
  kind = draw(st.sampled_from(["none", "causal", "window", "window_causal"]))
  kw = {}
  if kind in ("causal", "window_causal"):
    kw["is_causal"] = True
  if kind in ("window", "window_causal"):
    side = st.integers(0, 12)
    kw["local_window_size"] = (draw(side), draw(side))
  if kind != "none" and draw(st.booleans()):
    kw["causal_alignment"] = "bottom_right"
  return kw


@st.composite
def calls(draw, max_len=70, max_dim=72, max_batch=3, max_kv_heads=3, max_group=4):
  B = draw(st.integers(1, max_batch))
  T = draw(st.one_of(st.integers(1, 4), st.integers(1, max_len)))  # decode steps often
  S = draw(st.integers(1, max_len))
  K, G = draw(st.integers(1, max_kv_heads)), draw(st.integers(1, max_group))
  D = draw(st.integers(1, max_dim))
  static = dict(draw(_masks()))
  scale = draw(st.one_of(st.none(), st.sampled_from([0.0, -0.5, 2.0]),
                         st.floats(0.01, 1.0, allow_nan=False)))
  if scale is not None:
    static["scale"] = scale
  splits = draw(st.sampled_from([None, None, 1, 2, 3, 7]))  # None: automatic
  if splits is not None:
    static["num_splits"] = splits
  rr = draw(st.booleans())
  return Call(shape=(B, T, S, K * G, K, D), dtype=draw(st.sampled_from(DTYPES)),
              static=tuple(sorted(static.items())), q_lengths=_lengths(draw, B, T),
              kv_lengths=_lengths(draw, B, S), return_residual=rr,
              residual_float32=rr and draw(st.booleans()),
              differentiable=rr and draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


# Pallas in the interpreter compiles each static configuration for seconds, so
# its calls draw shapes, dtype, mask and scale from this menu and always pass
# lengths and a float32 residual (drawing values, lengths and whether the
# residual is differentiable freely): two dozen compilations for the run. The
# native calls cover the other residual options.
PALLAS_MENU = [
    ((2, 17, 33, 4, 2, 24), jnp.float32, dict(is_causal=True)),
    ((2, 17, 33, 4, 2, 24), jnp.bfloat16, dict(is_causal=True, causal_alignment="bottom_right")),
    ((1, 40, 40, 3, 1, 40), jnp.float16, dict(local_window_size=(5, 2))),
    ((1, 40, 40, 3, 1, 40), jnp.float32, dict(local_window_size=(3, 0), is_causal=True,
                                              causal_alignment="bottom_right", scale=-0.5)),
    ((2, 1, 50, 2, 2, 64), jnp.bfloat16, dict(is_causal=True, causal_alignment="bottom_right")),
    ((2, 1, 50, 2, 2, 64), jnp.float32, dict(scale=2.0)),
    ((1, 64, 20, 8, 2, 13), jnp.bfloat16, dict()),
    ((1, 64, 20, 8, 2, 13), jnp.float32, dict(is_causal=True)),
    ((2, 33, 47, 4, 1, 9), jnp.float16, dict(local_window_size=(0, 6))),
    ((2, 33, 47, 4, 1, 9), jnp.float32, dict(local_window_size=(7, 7), causal_alignment="bottom_right")),
    ((1, 70, 65, 2, 1, 72), jnp.bfloat16, dict(is_causal=True, scale=0.0)),
    ((1, 70, 65, 2, 1, 72), jnp.float32, dict(local_window_size=(12, 1), is_causal=True)),
    # split-KV over packed GQA rows (the decode kernel and the jnp merge)
    ((2, 1, 150, 8, 2, 32), jnp.bfloat16, dict(is_causal=True, causal_alignment="bottom_right",
                                               num_splits=3)),
    ((1, 3, 140, 4, 1, 20), jnp.float32, dict(local_window_size=(40, 0), num_splits=4)),
]


@st.composite
def pallas_calls(draw):
  shape, dtype, static = draw(st.sampled_from(PALLAS_MENU))
  B, T, S = shape[:3]
  lengths = lambda length: _lengths(draw, B, length, always=True)
  return Call(shape=shape, dtype=dtype, static=tuple(sorted(static.items())),
              q_lengths=lengths(T), kv_lengths=lengths(S), return_residual=True,
              residual_float32=True, differentiable=draw(st.booleans()),
              seed=draw(st.integers(0, 2**31 - 1)))


# ------------------------------------------------------------------ running and checking

@functools.lru_cache(maxsize=None)
def _compiled(impl, static, has_q_lengths, has_kv_lengths, rr, residual_float32, differentiable):
  """Forward and VJP in one jitted function; jit caches per shape."""
  def run(q, k, v, do, dlse, q_lengths, kv_lengths):
    kw = dict(static)
    if has_q_lengths:
      kw["query_seq_lengths"] = q_lengths
    if has_kv_lengths:
      kw["key_value_seq_lengths"] = kv_lengths
    if rr:
      kw.update(return_residual=True, differentiable_residual=differentiable,
                residual_dtype=jnp.float32 if residual_float32 else None)
    f = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, implementation=impl, **kw)
    out, vjp = jax.vjp(f, q, k, v)
    grads = vjp((do, dlse.astype(out[1].dtype)) if rr else do)
    return (out if rr else (out, None)), grads
  return jax.jit(run)


@functools.lru_cache(maxsize=None)
def _xla_in_dtype(static, rr, differentiable):
  """The rule's yardstick: forward and VJP of the xla implementation in the input dtype."""
  static = dict(static)
  def run(q, k, v, do, dlse, q_lengths, kv_lengths):
    def f(q, k, v):
      out, lse = jaxflash.reference.attention(
          q, k, v, scale=static.get("scale", 1.0 / np.sqrt(q.shape[-1])),
          is_causal=static.get("is_causal", False),
          causal_alignment=static.get("causal_alignment", "top_left"),
          local_window_size=static.get("local_window_size"), query_seq_lengths=q_lengths,
          key_value_seq_lengths=kv_lengths, compute_dtype=q.dtype)
      return out, jax.lax.stop_gradient(lse) if not differentiable else lse
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, lse), vjp((do, jnp.transpose(dlse, (0, 2, 1)).astype(lse.dtype)))
  return jax.jit(run)


def check_call(call: Call, impl: str):
  B, T, S, N, K, D = call.shape
  rng = np.random.default_rng(call.seed)
  dtype = call.dtype
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), dtype)
                 for s in ((B, T, N, D), (B, S, K, D), (B, S, K, D), (B, T, N, D)))
  dlse = jnp.asarray(rng.standard_normal((B, T, N)), jnp.float32)
  lengths = [jnp.asarray(x if x is not None else [0] * B, jnp.int32)
             for x in (call.q_lengths, call.kv_lengths)]
  full = [jnp.asarray(x if x is not None else [n] * B, jnp.int32)
          for x, n in ((call.q_lengths, T), (call.kv_lengths, S))]
  fn = _compiled(impl, call.static, call.q_lengths is not None, call.kv_lengths is not None,
                 call.return_residual, call.residual_float32, call.differentiable)
  (out, lse), grads = fn(q, k, v, do, dlse, *lengths)

  static = dict(call.static)
  scale = static.get("scale", 1.0 / np.sqrt(D))
  left, right = static.get("local_window_size", (-1, -1))
  if static.get("is_causal"):
    right = 0 if right < 0 else min(right, 0)
  mask = dict(left=left, right=right, bottom_right=static.get("causal_alignment") == "bottom_right",
              q_lengths=call.q_lengths, kv_lengths=call.kv_lengths)
  dlse_t = np.asarray(dlse).transpose(0, 2, 1) if call.differentiable else None
  with np.errstate(all="ignore"):
    truth_o, truth_lse, _ = numpy_reference.forward(q, k, v, scale=scale, **mask)
    scores = np.einsum("btnd,bsnd->bnts", np.asarray(q, np.float64),
                       np.repeat(np.asarray(k, np.float64), N // K, axis=2)) * scale
    budget = dict(max_logit=float(np.max(np.abs(scores), initial=0.0)))
    truth_grads = numpy_reference.backward(q, k, v, do, dlse_t, scale=scale, **mask)
    base = numpy_reference.in_dtype(q, k, v, do, dlse_t, jnp.dtype(dtype), scale=scale, **mask)

  def within(actual, truth, numpy_base, name, xla_base, stored_base=None, magnitude=0.0):
    rule = dict(budget, magnitude=magnitude)
    try:
      assert_within_budget(actual, truth, numpy_base, name, **rule)
    except AssertionError:  # the strict yardstick failed: ask the rule's own
      try:
        assert_within_budget(actual, truth, xla_base(), name, **rule)
      except AssertionError:
        if stored_base is None:
          raise
        assert_within_budget(actual, truth, stored_base(), name, **rule)

  @functools.cache
  def from_stored_output():
    with np.errstate(all="ignore"):
      return numpy_reference.backward(q, k, v, do, dlse_t, scale=scale, o_stored=out, **mask)

  @functools.cache
  def xla():
    (o, lse), g = _xla_in_dtype(call.static, call.return_residual, call.differentiable)(
        q, k, v, do, dlse, *full)
    return o, lse, *g

  assert out.shape == q.shape and out.dtype == dtype
  within(out, truth_o, base[0], "output", lambda: xla()[0])
  sibling = max(float(np.max(np.abs(g), initial=0)) for g in truth_grads[:3])
  for i, (name, g, x) in enumerate(zip(("dq", "dk", "dv"), grads, (q, k, v))):
    assert g.shape == x.shape and g.dtype == dtype, name
    within(g, truth_grads[i], base[2 + i], name, lambda i=i: xla()[2 + i],
           lambda i=i: from_stored_output()[i], magnitude=sibling)
  if call.return_residual:
    lse_dtype = jnp.float32 if call.residual_float32 else dtype
    assert lse.shape == (B, T, N) and lse.dtype == lse_dtype
    lse = np.asarray(lse, np.float64).transpose(0, 2, 1)
    empty = truth_lse == numpy_reference.EMPTY_LSE
    assert np.all(lse[empty] == float(jnp.finfo(lse_dtype).min)), "empty rows' residual"
    assert_within_budget(np.where(empty, 0, lse), np.where(empty, 0, truth_lse),
                         np.where(empty, 0, base[1]), "lse", **budget)


def _examples(variable, default, shards):
  return max(1, int(os.environ.get(variable, default)) // shards)


_SETTINGS = dict(deadline=None, database=None, derandomize=False,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("shard", range(SHARDS))
@settings(max_examples=_examples("JAXFLASH_FUZZ_EXAMPLES", 300, SHARDS), **_SETTINGS)
@given(call=calls())
def test_contract_native(shard, call):
  check_call(call, "native")


@settings(max_examples=int(os.environ.get("JAXFLASH_FUZZ_PALLAS_EXAMPLES", 40)), **_SETTINGS)
@given(call=pallas_calls())
def test_contract_pallas_interpret(call):
  check_call(call, "pallas")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("shard", range(GPU_SHARDS))
@settings(max_examples=_examples("JAXFLASH_FUZZ_GPU_EXAMPLES", 2000, GPU_SHARDS), **_SETTINGS)
@given(call=calls(max_len=160, max_dim=256, max_batch=2, max_kv_heads=2, max_group=4))
def test_contract_gpu(shard, call):
  check_call(call, "native")


@pytest.mark.gpu
@pytest.mark.slow
@settings(max_examples=200, **_SETTINGS)
@given(call=pallas_calls())
def test_contract_pallas_gpu(call):
  check_call(call, "pallas")


# ------------------------------------------------------------------ minimal cases found
# Calls the fuzzing shrank failures to, kept as explicit tests. The first five
# were the check's, not the kernels': a yardstick luckier than the output's own
# 16-bit rounding (now half an ulp of the output dtype is allowed, conftest),
# a numpy yardstick stricter than the rule's (the two-key dQ loses bits to the
# cancellation in dP - delta in any 16-bit implementation; the xla one errs
# 8.9e-3 there, the kernels 8.3e-3 and 1.3e-2), and float32 scores of 30 and
# more whose exponent no float32 kernel gets to an ulp. The last is the known
# limit of reading delta from the stored bfloat16 output (docs/design.md §5):
# a row 98.6% on one key, dQ off by 0.033 of 0.116 where the dense bfloat16
# computation is off by 0.0023.
MINIMAL_CASES = [
    Call(shape=(2, 1, 54, 1, 1, 1), dtype=jnp.bfloat16,
         static=(("local_window_size", (0, 1)), ("scale", -0.5)), q_lengths=None, kv_lengths=None,
         return_residual=False, residual_float32=False, differentiable=False, seed=0),
    Call(shape=(1, 2, 12, 1, 1, 44), dtype=jnp.bfloat16, static=(("is_causal", True),),
         q_lengths=None, kv_lengths=None, return_residual=False, residual_float32=False,
         differentiable=False, seed=1),
    Call(shape=(2, 17, 2, 3, 1, 5), dtype=jnp.float16, static=(("scale", 0.5257586062297953),),
         q_lengths=(1, 0), kv_lengths=None, return_residual=False, residual_float32=False,
         differentiable=False, seed=83),
    Call(shape=(1, 29, 2, 3, 1, 17), dtype=jnp.bfloat16,
         static=(("causal_alignment", "bottom_right"), ("is_causal", True), ("scale", -0.5)),
         q_lengths=(18,), kv_lengths=None, return_residual=False, residual_float32=False,
         differentiable=False, seed=18),
    Call(shape=(2, 1, 50, 2, 2, 64), dtype=jnp.float32, static=(("scale", 2.0),),
         q_lengths=(1, 1), kv_lengths=(50, 50), return_residual=True, residual_float32=True,
         differentiable=True, seed=0),
    Call(shape=(3, 2, 25, 2, 2, 64), dtype=jnp.bfloat16, static=(("scale", -0.5),),
         q_lengths=(0, 1, 0), kv_lengths=(0, 2, 0), return_residual=True, residual_float32=False,
         differentiable=False, seed=64),
]


@pytest.mark.parametrize("impl", ["native", "pallas"])
@pytest.mark.parametrize("call", MINIMAL_CASES, ids=lambda c: f"{c.shape}-{jnp.dtype(c.dtype).name}")
def test_contract_minimal_cases(call, impl):
  check_call(call, impl)
