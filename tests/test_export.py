"""jax.export: a program that calls jaxflash serialises, loads and runs like the direct call."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _native
from conftest import random_inputs


def _named_targets(text):
  """The jaxflash custom-call targets a program's text names."""
  return set(re.findall(r"jaxflash_[a-z_]+_v[0-9]+", text))


def round_trip(f, *args):
  """f exported with jaxflash's checks disabled, serialised, deserialised, called."""
  pytest.importorskip("flatbuffers")   # jax.export's serialisation needs it
  exported = jax.export.export(jax.jit(f), disabled_checks=jaxflash.disabled_export_checks())(*args)
  text = exported.mlir_module()
  assert _named_targets(text) <= set(_native.TARGETS)   # versioned names only
  return jax.export.deserialize(exported.serialize()).call(*args)


@pytest.mark.parametrize("impl", ["native", None])
def test_forward_and_gradient_survive_a_round_trip(rng, impl):
  q, k, v = random_inputs(rng, 2, 40, 50, 4, 2, 32, jnp.float32)
  kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([50, 17], jnp.int32),
            implementation=impl)
  attend = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, **kw)
  loss = lambda q, k, v: jnp.sum(attend(q, k, v) ** 2)
  grad = jax.grad(loss, argnums=(0, 1, 2))
  for f in (attend, grad):
    for got, want in zip(jax.tree.leaves(round_trip(f, q, k, v)), jax.tree.leaves(jax.jit(f)(q, k, v))):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_exported_program_names_the_versioned_targets(rng):
  q, k, v = random_inputs(rng, 1, 16, 16, 2, 2, 16, jnp.float32)
  f = jax.jit(jax.grad(lambda q: jnp.sum(jaxflash.dot_product_attention(q, k, v, implementation="native"))))
  text = jax.export.export(f, disabled_checks=jaxflash.disabled_export_checks())(q).mlir_module()
  assert _native.FORWARD_TARGET in text and _native.BACKWARD_TARGET in text
  # Without the disabled checks, export refuses our custom calls (and says which).
  with pytest.raises(ValueError, match=_native.FORWARD_TARGET):
    jax.export.export(f)(q)


def test_the_extension_registers_the_python_side_target_names():
  if _native.unavailable_reason("cpu"):
    pytest.skip("the extension is not built")
  ext, _ = _native._load()
  assert set(ext.cpu_targets()) == set(_native.CPU_TARGETS)
  if ext.with_cuda:
    assert set(ext.cuda_targets()) == set(_native.TARGETS)


def test_programs_of_older_targets_still_run(rng):
  """An artifact exported before the soft-cap attribute calls jaxflash_fwd_v1, one
  exported before the segment tables jaxflash_fwd_v2, one before ALiBi jaxflash_fwd_v3:
  all stay registered and compute what the newest target computes with no cap, no
  segment ids and no slopes."""
  if _native.unavailable_reason("cpu"):
    pytest.skip("the extension is not built")
  q, k, v = random_inputs(rng, 2, 24, 30, 4, 2, 16, jnp.float32)
  none = jnp.zeros((0,), jnp.int32)
  attrs = dict(scale=np.float32(0.25), window_left=np.int64(-1), window_right=np.int64(0),
               bottom_right=False, tile=np.int64(0), num_splits=np.int64(1))
  outs = jaxflash._core.NativeKernels.out_types(q, 1)
  v1 = jax.ffi.ffi_call("jaxflash_fwd_v1", outs)(q, k, v, none, none, none, **attrs)
  v2 = jax.ffi.ffi_call("jaxflash_fwd_v2", outs)(q, k, v, none, none, none, **attrs,
                                                 softcap=np.float32(0))
  v3 = jax.ffi.ffi_call("jaxflash_fwd_v3", outs)(q, k, v, none, none, none, none, none, **attrs,
                                                 softcap=np.float32(0))
  v4 = jax.ffi.ffi_call(_native.FORWARD_TARGET, outs)(q, k, v, none, none, none, none, none,
                                                      jnp.zeros((0,), jnp.float32), **attrs,
                                                      softcap=np.float32(0))
  # The paged forward: v1, v2 (before its segment tables) and v3 (before its slopes) against v4.
  pages = jnp.asarray(rng.standard_normal((4, 8, 2, 16)), jnp.float32)
  table, lengths = jnp.array([[0, 1], [3, 2]], jnp.int32), jnp.array([16, 9], jnp.int32)
  paged_attrs = dict(scale=np.float32(0.25), window_left=np.int64(-1), window_right=np.int64(0),
                     tile=np.int64(0), num_splits=np.int64(1))
  paged = [jax.ffi.ffi_call(name, outs)(q, pages, pages, table, lengths, *extra, **paged_attrs,
                                        **cap)[0]
           for name, extra, cap in (("jaxflash_paged_fwd_v1", (), {}),
                                    ("jaxflash_paged_fwd_v2", (), dict(softcap=np.float32(0))),
                                    ("jaxflash_paged_fwd_v3", (none, none),
                                     dict(softcap=np.float32(0))),
                                    (_native.PAGED_TARGET, (none, none, jnp.zeros((0,), jnp.float32)),
                                     dict(softcap=np.float32(0))))]
  for old in paged[:3]:
    np.testing.assert_array_equal(np.asarray(old), np.asarray(paged[3]))
  for old in (v1, v2, v3):
    for a, b in zip(old[:2], v4[:2]):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
