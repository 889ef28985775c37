"""implementation=None: the order of a call's class comes from measurements (choice.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import _core, choice, tile_cache

H100 = "NVIDIA H100 80GB HBM3"


def order(**kw):
  fields = dict(device=H100, build="", bits=16, head_dim=64, causal=False, queries="train",
                order=("pallas", "native"), ms=(1.0, 2.0), measured="2026-11-27")
  fields.update(kw)
  return tile_cache.Order(**fields)


@pytest.fixture
def tables(tmp_path, monkeypatch):
  """A cache file and a shipped table of this test's own (both empty at first)."""
  cache, shipped = tmp_path / "cache.json", tmp_path / "orders.json"
  monkeypatch.setenv(tile_cache.ENV, str(cache))
  monkeypatch.setattr(choice, "SHIPPED", shipped)
  choice._shipped.cache_clear()
  tile_cache._read_cached.cache_clear()
  yield cache, shipped
  choice._shipped.cache_clear()


def test_a_class_no_one_measured_takes_the_rule(tables):
  assert choice.order(H100, lambda: "b", jnp.bfloat16, 64, False, 4096) == choice.FALLBACK
  assert choice.order("cpu", lambda: "b", jnp.float32, 64, True, 1) == choice.FALLBACK


def test_the_shipped_orders_speak_for_their_device_and_class(tables):
  _, shipped = tables
  tile_cache.write([order(), order(queries="decode", order=("native", "pallas")),
                    order(head_dim=128, causal=True, order=("native",))], shipped)
  assert choice.order(H100, lambda: "b", jnp.bfloat16, 64, False, 4096) == ("pallas", "native")
  assert choice.order(H100, lambda: "b", jnp.float16, 40, False, 5) == ("pallas", "native")   # same class
  assert choice.order(H100, lambda: "b", jnp.bfloat16, 64, False, 4) == ("native", "pallas")  # decode
  assert choice.order(H100, lambda: "b", jnp.bfloat16, 128, True, 4096) == ("native",)
  assert choice.order(H100, lambda: "b", jnp.float32, 64, False, 4096) == choice.FALLBACK     # 32-bit
  assert choice.order(H100, lambda: "b", jnp.bfloat16, 64, True, 4096) == choice.FALLBACK     # causal
  assert choice.order("NVIDIA H200", lambda: "b", jnp.bfloat16, 64, False, 4096) == choice.FALLBACK


def test_the_device_cache_of_this_build_comes_before_the_shipped_orders(tables):
  _, shipped = tables
  tile_cache.write([order()], shipped)
  tile_cache.write([order(build="mine", order=("native", "pallas"))])
  assert choice.order(H100, lambda: "mine", jnp.bfloat16, 64, False, 4096) == ("native", "pallas")
  # Another build's measurement is stale: the shipped order speaks.
  assert choice.order(H100, lambda: "other", jnp.bfloat16, 64, False, 4096) == ("pallas", "native")


def test_the_choice_takes_the_first_implementation_that_serves_the_call(monkeypatch):
  q = jnp.zeros((1, 8, 2, 16), jnp.float32)
  call = _core.validate(q, q, q, None, None, None, False, None, None, None, "top_left", False)
  monkeypatch.setattr(choice, "order", lambda *a: ("xla", "native"))
  assert _core.choose(call, None) == "xla"
  monkeypatch.setattr(choice, "order", lambda *a: ("pallas", "native"))
  if _core.platform() == "cpu":   # the interpreter: never picked unasked
    assert _core.choose(call, None) == "native"
  else:
    assert _core.choose(call, None) == "pallas"
  assert _core.choose(call, "pallas") == "pallas"
  # An order that names one implementation only: the others follow, before xla.
  monkeypatch.setattr(choice, "order", lambda *a: ("pallas",))
  assert _core.choose(call, None) == ("native" if _core.platform() == "cpu" else "pallas")


def test_a_decode_step_with_slopes_or_ids_puts_native_first(monkeypatch):
  """The orders are measured on plain calls; Pallas's decode kernel takes neither ALiBi
  slopes nor segment ids, so such a decode step goes to native first."""
  monkeypatch.setattr(choice, "order", lambda *a: ("pallas", "native"))
  validate = lambda q, k, **kw: _core.validate(q, k, k, None, None, None, True, None, None, None,
                                               "bottom_right", False, **kw)
  step, k = jnp.zeros((2, 1, 4, 16), jnp.float32), jnp.zeros((2, 64, 4, 16), jnp.float32)
  slopes = jnp.ones(4, jnp.float32)
  ids = dict(query_segment_ids=jnp.zeros((2, 1), jnp.int32),
             key_value_segment_ids=jnp.zeros((2, 64), jnp.int32))
  assert _core.automatic_order(validate(step, k)) == ("pallas", "native")
  assert _core.automatic_order(validate(step, k, alibi_slopes=slopes)) == ("native", "pallas")
  assert _core.automatic_order(validate(step, k, **ids)) == ("native", "pallas")
  train = jnp.zeros((2, 64, 4, 16), jnp.float32)   # not a decode step: the measured order
  assert _core.automatic_order(validate(train, k, alibi_slopes=slopes)) == ("pallas", "native")


def test_the_shipped_table_is_well_formed():
  shipped = tile_cache.read(choice.SHIPPED, "orders")
  assert shipped, "jaxflash/orders.json holds no orders"
  for o in shipped:
    assert o.build == "" and len(o.ms) == len(o.order)
    # xla competes only in the CPU's small class (choice.SMALL_SCORES).
    assert set(o.order) <= set(choice.candidates(o.queries)), o
    assert o.queries != "small" or (o.device == "cpu" and not o.causal), o   # hides no pair
    assert list(o.ms) == sorted(o.ms), o   # fastest first
  cells = [o.cell() for o in shipped]
  assert len(cells) == len(set(cells))


def test_a_small_cpu_call_has_a_class_of_its_own(tables, monkeypatch):
  """On the CPU a call of at most SMALL_SCORES scores that hides no pair is "small", a class
  whose measured order may put xla first; larger calls, masked ones, decode steps and calls on
  a GPU keep their classes."""
  _, shipped = tables
  tile_cache.write([order(device="cpu", bits=32, queries="small", order=("xla", "native"))], shipped)
  assert choice.order("cpu", lambda: "b", jnp.float32, 64, False, 64, True) == ("xla", "native")
  assert choice.order("cpu", lambda: "b", jnp.float32, 64, False, 64) == choice.FALLBACK
  assert choice.order("cpu", lambda: "b", jnp.float32, 64, False, 1, True) == choice.FALLBACK  # decode
  seen = []
  monkeypatch.setattr(choice, "order", lambda *a: seen.append(a[-1]) or ("native",))
  validate = lambda q, causal=False, **kw: _core.validate(q, q, q, None, None, None, causal, None,
                                                         None, None, "top_left", False, **kw)
  small = jnp.zeros((1, 64, 4, 16), jnp.float32)   # 4 x 64 x 64 = 16k scores
  big = jnp.zeros((2, 128, 4, 16), jnp.float32)    # 128k
  ids = jnp.zeros((1, 64), jnp.int32)
  for platform in ("cpu", "gpu"):
    monkeypatch.setattr(_core, "platform", lambda: platform)
    for call in (validate(small), validate(big), validate(small, True),
                 validate(small, query_segment_ids=ids)):
      _core.automatic_order(call)
  assert seen == [True, False, False, False] + [False] * 4


@pytest.mark.skipif(_core.platform() != "cpu", reason="the CPU's small class")
def test_a_small_cpu_call_on_xla_keeps_the_native_semantics(tables, rng):
  """With nothing hidden every pair counts in both, so xla's results are native's: a NaN of a
  key or value reaches every row, of a query its own row (the order is this test's own)."""
  from conftest import random_inputs
  import jaxflash
  _, shipped = tables
  tile_cache.write([order(device="cpu", bits=32, head_dim=64, queries="small", order=("xla", "native"))],
                   shipped)
  q, k, v = random_inputs(rng, 2, 24, 20, 4, 2, 48, jnp.float32)
  for x, at in ((q, (1, 5, 0, 0)), (k, (1, 7, 1, 3)), (v, (0, 2, 0, 1))):
    args = [y.at[at].set(jnp.nan) if y is x else y for y in (q, k, v)]
    call = _core.validate(*args, None, None, None, False, None, None, None, "top_left", False)
    assert _core.choose(call, None) == "xla"
    got = jaxflash.dot_product_attention(*args)
    want = jaxflash.dot_product_attention(*args, implementation="native")
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, equal_nan=True)


def test_head_dims_past_the_cuda_kernels_run_on_pallas(monkeypatch):
  """Where native cannot take a call's head dim (the CUDA kernels' 256, here pretended on
  any platform) the order is Pallas's, whatever the measured orders say."""
  monkeypatch.setattr(_core, "max_head_dim", lambda name: 256 if name == "native" else 512)
  monkeypatch.setattr(choice, "order", lambda *a: ("native",))
  q, k = jnp.zeros((2, 64, 4, 320), jnp.bfloat16), jnp.zeros((2, 96, 2, 320), jnp.bfloat16)
  call = _core.validate(q, k, k, None, None, None, False, None, None, None, "top_left", False)
  assert _core.automatic_order(call) == ("pallas",)


def test_head_dims_past_256_on_a_gpu_take_the_wide_forward_where_it_can(monkeypatch):
  """On a GPU (pretended here) past 256: native first (its Hopper forward) where
  `_native.wide_refusal` admits the call, each other call refused with the reason before
  any kernel, and the wide forward's gradients by the blockwise backward, Pallas's past its bound."""
  from jaxflash import _native
  gpu = type("Device", (), {"platform": "gpu", "compute_capability": "9.0"})()
  monkeypatch.setattr(_core, "platform", lambda: "gpu")
  monkeypatch.setattr(_native.jax, "devices", lambda *a: [gpu])
  q = jnp.zeros((2, 64, 4, 320), jnp.bfloat16)
  validate = lambda q, **kw: _core.validate(q, q, q, None, None, None, False, None, None, None,
                                            "top_left", False, **kw)
  assert _core.automatic_order(validate(q)) == ("native", "pallas")
  assert _native.wide_refusal(validate(q)) is None
  for call, why in [(validate(q.astype(jnp.float32)), "float16 or bfloat16"),
                    (validate(q, logits_soft_cap=5.0), "no segment ids, soft-cap"),
                    (validate(q, num_splits=2), "split-KV"),
                    (validate(jnp.zeros((2, 64, 4, 324), jnp.bfloat16)), "multiple of 8")]:
    assert why in _native.wide_refusal(call) and "head_dim <= 256" in _native.wide_refusal(call)
  monkeypatch.setattr(gpu, "compute_capability", "8.0", raising=False)
  assert "Hopper" in _native.wide_refusal(validate(q))
  # Its gradients: the blockwise backward (wide_gradients.backward), Pallas's the exact ones,
  # which also take calls past its memory bound.
  from jaxflash import wide_gradients
  wide_backward, handed = wide_gradients.backward, []
  monkeypatch.setattr(wide_gradients, "backward", lambda *a, exact, **kw: handed.append(exact) or "blockwise")
  monkeypatch.setattr(_core.PallasKernels, "backward", classmethod(lambda cls, *a: "pallas"))
  assert _core.NativeKernels.backward(q, q, q, q, None, q, None, None, None, None) == "blockwise"
  assert len(handed) == 1 and handed[0]() == "pallas"
  monkeypatch.setattr(wide_gradients, "MAX_ROWS", 2 * 64 * 4 - 1)
  assert wide_backward(q, q, q, q, None, q, None, None, None, spec=None, exact=lambda: "exact") == "exact"
