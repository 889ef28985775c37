"""The public API: drop-in behaviour, argument checking, transformations.

Bad inputs tested (each must raise at trace time, naming the argument):
  query rank not 3/4; key/value length or heads mismatch; batch mismatch; head_dim
  mismatch; query heads not a multiple of kv heads; non-float dtype; mixed
  dtypes; lengths of the wrong shape; non-integer lengths; negative window;
  malformed window; non-bool is_causal; unknown causal_alignment; non-finite
  scale; traced scale; bias that does not broadcast; non-boolean mask; unknown
  implementation; native with float64; native head_dim > 512;
  cudnn with jaxflash-only keywords.
The FFI handlers re-validate: a malformed direct ffi_call returns an error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from conftest import check_value_width_case, max_abs, random_inputs, value_width_case


def _inputs(rng, B=2, T=33, S=29, N=4, K=2, D=16, dtype=jnp.float32):
  return random_inputs(rng, B, T, S, N, K, D, dtype)


# ------------------------------------------------------------------ drop-in

DROP_IN_CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(4, 2)),
    "window_int": dict(local_window_size=3),
    "causal_window": dict(is_causal=True, local_window_size=(6, 0)),
    "lengths": dict(query_seq_lengths=np.array([33, 10], np.int32),
                    key_value_seq_lengths=np.array([5, 29], np.int32)),
    "scale": dict(scale=0.37),
}


@pytest.mark.parametrize("name", list(DROP_IN_CASES))
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_matches_jax_nn(rng, name, implementation):
  """Same outputs and residuals as jax.nn wherever every row sees a key."""
  q, k, v = _inputs(rng, T=29)
  kw = DROP_IN_CASES[name]
  ours, our_lse = jaxflash.dot_product_attention(q, k, v, implementation=implementation,
                                                 return_residual=True, **kw)
  with jax.default_matmul_precision("highest"):  # jax.nn would use TF32 on GPUs
    theirs, their_lse = jax.nn.dot_product_attention(q, k, v, implementation="xla",
                                                     return_residual=True, **kw)
  assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
  assert our_lse.shape == their_lse.shape and our_lse.dtype == their_lse.dtype
  assert max_abs(ours, theirs) < 2e-5
  rows = np.ones(our_lse.shape, bool)
  if "query_seq_lengths" in kw:  # jax.nn's LSE of padded query rows is meaningless
    rows = np.arange(q.shape[1])[None, :, None] < kw["query_seq_lengths"][:, None, None]
    rows = np.broadcast_to(rows, our_lse.shape)
  assert max_abs(np.asarray(our_lse)[rows], np.asarray(their_lse)[rows]) < 2e-5


def test_dense_bias_and_mask_match_jax_nn(rng):
  q, k, v = _inputs(rng)
  bias = jnp.asarray(rng.standard_normal((2, 4, 33, 29)), jnp.float32)
  mask = jnp.asarray(rng.random((1, 1, 33, 29)) < 0.8).at[..., 0].set(True)
  ours = jaxflash.dot_product_attention(q, k, v, bias, mask)
  with jax.default_matmul_precision("highest"):
    theirs = jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="xla")
  assert max_abs(ours, theirs) < 2e-5


def test_rank3_inputs(rng):
  q, k, v = _inputs(rng, B=1)
  out = jaxflash.dot_product_attention(q[0], k[0], v[0], is_causal=True)
  assert out.shape == q.shape[1:]
  assert max_abs(out, jaxflash.dot_product_attention(q, k, v, is_causal=True)[0]) == 0


def test_fully_masked_rows_are_zero_with_zero_grads(rng):
  q, k, v = _inputs(rng)
  kv_lengths = jnp.array([0, 29], jnp.int32)

  def loss(q, k, v):
    return jnp.sum(jaxflash.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths) ** 2)
  out = jaxflash.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths)
  assert np.all(np.asarray(out[0]) == 0)
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(g[0]) == 0)


def test_empty_problems(rng):
  q, k, v = _inputs(rng, T=0)
  assert jaxflash.dot_product_attention(q, k, v).shape == q.shape
  q, k, v = _inputs(rng, S=0)
  out, lse = jaxflash.dot_product_attention(q, k, v, return_residual=True)
  assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) == jnp.finfo(lse.dtype).min)


def test_bottom_right_alignment_is_a_kv_cache_step(rng):
  """The last query row of a bottom-right causal call sees every key."""
  q, k, v = _inputs(rng, T=4, S=29)
  out = jaxflash.dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
  full = jaxflash.dot_product_attention(q[:, -1:], k, v)
  assert max_abs(out[:, -1:], full) < 1e-6


# ------------------------------------------------------------------ selection

@pytest.mark.parametrize("implementation", ["native", "xla"])
def test_a_window_past_every_sequence_is_no_bound(rng, implementation):
  """Window sides of any size are accepted; one past every sequence bounds
  nothing (2**32 once reached the native kernels as 0, and overflowed the
  reference's int32 positions)."""
  q, k, v = random_inputs(rng, 2, 40, 33, 4, 2, 32, jnp.float32)
  attend = lambda **kw: jaxflash.dot_product_attention(q, k, v, implementation=implementation, **kw)
  causal = attend(is_causal=True)
  for window in [(2**32, 0), (2**31 - 1, 0), (2**40, 0)]:
    assert max_abs(attend(local_window_size=window), causal) < 1e-6, window
  assert max_abs(attend(local_window_size=2**33), attend()) < 1e-6
  assert max_abs(attend(local_window_size=(2**32, 3)), attend(local_window_size=(39, 3))) < 1e-6


def test_native_is_the_default_and_really_runs():
  q = k = v = jnp.zeros((1, 8, 2, 16), jnp.float32)
  f = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, is_causal=True)
  hlo = jax.jit(f).lower(q, k, v).as_text()
  assert "jaxflash_fwd" in hlo
  grad_hlo = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))).lower(
      q, k, v).as_text()
  assert "jaxflash_fwd" in grad_hlo and "jaxflash_bwd" in grad_hlo


def test_unsupported_calls_fall_back_only_when_not_named(rng):
  q, k, v = (jnp.zeros((1, 8, 2, 520), jnp.float32) for _ in range(3))  # past every kernel
  hlo = jax.jit(lambda q, k, v: jaxflash.dot_product_attention(q, k, v)).lower(q, k, v).as_text()
  assert "jaxflash_fwd" not in hlo
  with pytest.raises(ValueError, match="head_dim"):
    jaxflash.dot_product_attention(q, k, v, implementation="native")


def test_a_dense_bias_or_mask_runs_fused_on_the_cpu(rng):
  """The CPU kernels take them (the v5 targets); on a GPU native's tensor-core kernels take
  16-bit inputs only, and a float32 call is refused with a pointer to Pallas."""
  q, k, v = _inputs(rng)
  bias, mask = jnp.zeros((1, 1, 33, 29)), jnp.ones((33, 29), bool)
  if jax.default_backend() != "cpu":
    with pytest.raises(ValueError, match="float16 and bfloat16 only.*use 'pallas'"):
      jaxflash.dot_product_attention(q, k, v, bias, mask, implementation="native")
    return
  f = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, bias, mask)
  assert "jaxflash_fwd_v5" in jax.jit(f).lower(q, k, v).as_text()
  grad = jax.grad(lambda q, b: f(q, k, v).sum() + jaxflash.dot_product_attention(
      q, k, v, b).sum(), argnums=(0, 1))
  assert "jaxflash_bwd_v5" in jax.jit(grad).lower(q, bias).as_text()


def test_float64_uses_xla_and_native_refuses(rng):
  with jax.enable_x64(True):
    q, k, v = _inputs(rng, dtype=jnp.float64)
    out = jaxflash.dot_product_attention(q, k, v)
    assert out.dtype == jnp.float64
    with pytest.raises(ValueError, match="float64"):
      jaxflash.dot_product_attention(q, k, v, implementation="native")


# ------------------------------------------------------------------ bad inputs

def _bad_cases(rng):
  q, k, v = _inputs(rng)
  i32 = np.int32
  return [
      ("rank", lambda: jaxflash.dot_product_attention(q[0, 0], k, v), ValueError, "rank"),
      ("kv shape", lambda: jaxflash.dot_product_attention(q, k, v[:, :5]), ValueError,
       "same batch, length and heads"),
      ("batch", lambda: jaxflash.dot_product_attention(q[:1], k, v), ValueError, "batch"),
      ("head_dim", lambda: jaxflash.dot_product_attention(q[..., :8], k, v), ValueError, "head_dim"),
      ("gqa", lambda: jaxflash.dot_product_attention(q[:, :, :3], k, v), ValueError, "multiple"),
      ("int dtype", lambda: jaxflash.dot_product_attention(q.astype(jnp.int32), k.astype(jnp.int32),
                                                           v.astype(jnp.int32)), TypeError, "floating"),
      ("mixed dtype", lambda: jaxflash.dot_product_attention(q.astype(jnp.bfloat16), k, v), TypeError,
       "dtype"),
      ("lengths shape", lambda: jaxflash.dot_product_attention(
          q, k, v, query_seq_lengths=np.ones((3,), i32)), ValueError, "query_seq_lengths"),
      ("lengths dtype", lambda: jaxflash.dot_product_attention(
          q, k, v, key_value_seq_lengths=np.ones((2,), np.float32)), TypeError, "key_value_seq_lengths"),
      ("window negative", lambda: jaxflash.dot_product_attention(q, k, v, local_window_size=(-1, 2)),
       ValueError, "non-negative"),
      ("window malformed", lambda: jaxflash.dot_product_attention(q, k, v, local_window_size=(1, 2, 3)),
       TypeError, "local_window_size"),
      ("is_causal", lambda: jaxflash.dot_product_attention(q, k, v, is_causal="yes"), TypeError,
       "is_causal"),
      ("alignment", lambda: jaxflash.dot_product_attention(q, k, v, causal_alignment="left"),
       ValueError, "causal_alignment"),
      ("scale", lambda: jaxflash.dot_product_attention(q, k, v, scale=float("nan")), ValueError,
       "scale"),
      ("traced scale", lambda: jax.jit(lambda s: jaxflash.dot_product_attention(q, k, v, scale=s))(0.5),
       TypeError, "scale"),
      ("bias shape", lambda: jaxflash.dot_product_attention(q, k, v, jnp.zeros((3, 33, 29))),
       ValueError, "bias"),
      ("mask dtype", lambda: jaxflash.dot_product_attention(q, k, v, mask=jnp.zeros((33, 29))),
       TypeError, "mask"),
      ("implementation", lambda: jaxflash.dot_product_attention(q, k, v, implementation="fast"),
       ValueError, "implementation"),
      ("native head_dim", lambda: jaxflash.dot_product_attention(
          *_inputs(rng, D=520), implementation="native"), ValueError, "head_dim"),
      ("cudnn extras", lambda: jaxflash.dot_product_attention(
          q, k, v, implementation="cudnn", causal_alignment="bottom_right"), ValueError, "cudnn"),
      # Segment ids: [*batch, len] integers; key ids default to query ids only when T == S.
      ("segment shape", lambda: jaxflash.dot_product_attention(
          q, k, v, query_segment_ids=np.zeros((2, 29), i32), key_value_segment_ids=np.zeros((2, 29), i32)),
       ValueError, "query_segment_ids must have shape"),
      ("segment dtype", lambda: jaxflash.dot_product_attention(
          q, k, v, query_segment_ids=np.zeros((2, 33)), key_value_segment_ids=np.zeros((2, 29), i32)),
       TypeError, "query_segment_ids must be an integer"),
      ("segment kv only", lambda: jaxflash.dot_product_attention(
          q, k, v, key_value_segment_ids=np.zeros((2, 29), i32)), ValueError, "needs query_segment_ids"),
      ("segment kv missing", lambda: jaxflash.dot_product_attention(
          q, k, v, query_segment_ids=np.zeros((2, 33), i32)), ValueError, "key_value_segment_ids must be"),
      ("segment splits", lambda: jaxflash.dot_product_attention(
          q, k, v, query_segment_ids=np.zeros((2, 33), i32), key_value_segment_ids=np.zeros((2, 29), i32),
          num_splits=2), ValueError, "split-KV"),
  ]


def test_bad_inputs_raise_clear_errors(rng):
  for name, call, exc, fragment in _bad_cases(rng):
    with pytest.raises(exc, match=fragment):
      call()
      pytest.fail(f"{name}: no error")


def test_handlers_revalidate_what_reaches_them(rng):
  """A malformed direct call to the FFI target is refused, not run."""
  from jaxflash import _native
  _native.require(jax.default_backend())   # registers the targets
  q, k, v = _inputs(rng)
  lengths = jnp.full((2,), 29, jnp.int32)
  offsets = jnp.zeros((2,), jnp.int32)
  o = jax.ShapeDtypeStruct(q.shape, q.dtype)
  lse = jax.ShapeDtypeStruct((2, 4, 33), jnp.float32)
  wrong_lse = jax.ShapeDtypeStruct((2, 4, 5), jnp.float32)  # should be (2, 4, 33)
  empty = (jax.ShapeDtypeStruct((2, 0, 33, 4, 16), jnp.float32),
           jax.ShapeDtypeStruct((2, 0, 33, 4), jnp.float32))
  attrs = dict(scale=np.float32(1), window_left=np.int64(-1), window_right=np.int64(-1),
               bottom_right=False, tile=np.int64(0), num_splits=np.int64(1),
               softcap=np.float32(0))

  no_ids = jnp.zeros((0,), jnp.int32)   # no segment tables
  no_slopes = jnp.zeros((0,), jnp.float32)   # no ALiBi

  def refused(outputs, match, diag=offsets, tables=(no_ids, no_ids), slopes=no_slopes, **changed):
    call = jax.ffi.ffi_call(_native.FORWARD_TARGET, outputs)
    with pytest.raises(Exception, match=match):
      jax.block_until_ready(call(q, k, v, lengths, lengths, diag, *tables, slopes,
                                 **{**attrs, **changed}))

  refused((o, wrong_lse) + empty, "jaxflash: lse")
  refused((o, lse) + empty, "jaxflash: scale", scale=np.float32(np.inf))
  refused((o, lse) + empty, "jaxflash: softcap", softcap=np.float32(-1))
  refused((o, lse) + empty, "jaxflash: tile", tile=np.int64(-1))
  refused((o, lse) + empty, "jaxflash: tile", tile=np.int64(256))
  refused((o, lse) + empty, "jaxflash: diagonal_offsets", diag=offsets[:1])
  refused((o, lse) + empty, "jaxflash: num_splits", num_splits=np.int64(0))
  # Three splits need [batch, 3, q_len, q_heads, head_dim] partials, not empty ones.
  refused((o, lse) + empty, "jaxflash: o_partial", num_splits=np.int64(3))
  # Segment tables (segments.py): [batch, len, 8] int32, both or neither, one split.
  table = lambda n, dtype=jnp.int32: jnp.zeros((2, n, 8), dtype)
  refused((o, lse) + empty, "jaxflash: query segment table", tables=(table(32), table(29)))
  refused((o, lse) + empty, "jaxflash: key segment table", tables=(table(33), table(33)))
  refused((o, lse) + empty, "jaxflash: segment tables must be int32",
          tables=(table(33, jnp.float32), table(29)))
  split = (jax.ShapeDtypeStruct((2, 3, 33, 4, 16), jnp.float32),
           jax.ShapeDtypeStruct((2, 3, 33, 4), jnp.float32))
  refused((o, lse) + split, "jaxflash: split-KV", tables=(table(33), table(29)),
          num_splits=np.int64(3))
  # ALiBi slopes: float32 [batch, q_heads] (split-KV takes them).
  refused((o, lse) + empty, "jaxflash: alibi slopes has shape", slopes=jnp.zeros((2, 3)))
  refused((o, lse) + empty, "jaxflash: alibi slopes must be float32",
          slopes=jnp.zeros((2, 4), jnp.bfloat16))

  # The backward's workspaces: delta like lse; the dQ sums like q in float32,
  # or empty (last dimension 0), nothing else.
  bwd_attrs = dict(scale=np.float32(1), window_left=np.int64(-1), window_right=np.int64(-1),
                   bottom_right=False, deterministic=False, tile=np.int64(0),
                   softcap=np.float32(0))
  grads = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
  sums = lambda shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)
  dlse = jnp.zeros((2, 4, 33), jnp.float32)

  def backward(outputs):
    call = jax.ffi.ffi_call(_native.BACKWARD_TARGET, outputs)
    lse_value = jnp.zeros((2, 4, 33), jnp.float32)
    return jax.block_until_ready(call(q, k, v, q, lse_value, q, dlse, lengths, lengths, offsets,
                                      no_ids, no_ids, no_slopes, **bwd_attrs))

  backward(grads + (lse, sums((2, 33, 4, 0))))
  backward(grads + (lse, sums(q.shape)))   # room the CPU kernels leave unused
  for bad in [(2, 33, 4, 8), (2, 33, 2, 16)]:   # half the head dim; too few heads
    with pytest.raises(Exception, match="jaxflash: dq_accum has shape"):
      backward(grads + (lse, sums(bad)))
  with pytest.raises(Exception, match="jaxflash: dq_accum must be float32"):
    backward(grads + (lse, sums(q.shape, jnp.bfloat16)))


def test_fused_backward_switch(monkeypatch):
  """JAXFLASH_FUSED_BACKWARD: unset or auto = the buckets measured faster fused,
  1 = every sm90 bucket, 0 = none; anything else is a clear error at trace
  time. On the CPU the switch does not apply: the room follows the CPU backward's rule
  (its (batch, kv head) items fill the threads the call runs on), deterministic calls
  included."""
  from jaxflash import _native
  monkeypatch.delenv("JAXFLASH_FUSED_BACKWARD", raising=False)
  assert _native.fused_backward_buckets() == _native.FUSED_BACKWARD_BUCKETS
  monkeypatch.setattr(_native, "cpu_threads", lambda: 4)
  for mode, buckets in [("auto", _native.FUSED_BACKWARD_BUCKETS), ("1", (64, 128, 192, 256)), ("0", ())]:
    monkeypatch.setenv("JAXFLASH_FUSED_BACKWARD", mode)
    assert _native.fused_backward_buckets() == buckets
    if jax.devices()[0].platform == "cpu":
      # items B * kv heads: 4 and 8 fill four threads, 3 and 5 do not (75%, 62.5%)
      rooms = [_native.dq_sums_room(jnp.bfloat16, (B, 64, 4, 128), (B, 64, K, 128), d)
               for B, K, d in ((2, 2, False), (2, 4, True), (3, 1, False), (5, 1, False))]
      assert rooms == [True, True, False, False]
      # a call the CPU backward runs on one thread (B 1, 2 heads, S 64: 5.2 MFLOP)
      # fills it with one item
      assert _native.dq_sums_room(jnp.float32, (1, 64, 2, 64), (1, 64, 1, 64), False)
      assert not _native.dq_sums_room(jnp.float32, (1, 1 << 18, 64, 8), (1, 1 << 18, 4, 8), False)  # 512 MiB
  monkeypatch.setenv("JAXFLASH_FUSED_BACKWARD", "yes")
  with pytest.raises(ValueError, match="JAXFLASH_FUSED_BACKWARD must be 0, 1 or auto"):
    _native.fused_backward_buckets()


# ------------------------------------------------------------------ transformations

def _loss(q, k, v):
  return jnp.sum(jaxflash.dot_product_attention(q, k, v, is_causal=True) ** 2)


def test_jit_grad_value_and_grad(rng):
  q, k, v = _inputs(rng)
  eager = jax.grad(_loss, argnums=(0, 1, 2))(q, k, v)
  val, jitted = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1, 2)))(q, k, v)
  assert np.isclose(float(val), float(_loss(q, k, v)), rtol=1e-6)
  for a, b in zip(eager, jitted):
    assert max_abs(a, b) < 1e-6


def test_vmap_matches_a_loop(rng):
  q, k, v = _inputs(rng)
  qs, ks, vs = (jnp.stack([x, x * 0.5 + 1]) for x in (q, k, v))
  f = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, is_causal=True)
  batched = jax.vmap(f)(qs, ks, vs)
  for i in range(2):
    assert max_abs(batched[i], f(qs[i], ks[i], vs[i])) < 1e-6
  # vmap over q only (k, v shared), and a vmapped gradient.
  assert max_abs(jax.vmap(f, in_axes=(0, None, None))(qs, k, v)[1], f(qs[1], k, v)) < 1e-6
  g = jax.vmap(jax.grad(_loss))(qs, ks, vs)
  assert max_abs(g[1], jax.grad(_loss)(qs[1], ks[1], vs[1])) < 1e-6


def test_remat_and_donation(rng):
  q, k, v = _inputs(rng)
  expect = jax.grad(_loss, argnums=(0, 1, 2))(q, k, v)
  remat = jax.grad(jax.checkpoint(_loss), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(expect, remat):
    assert max_abs(a, b) < 1e-6
  step = jax.jit(lambda q, k, v: q - 0.1 * jax.grad(_loss)(q, k, v), donate_argnums=(0,))
  out = step(jnp.array(q), k, v)
  assert max_abs(out, q - 0.1 * expect[0]) < 1e-6


@pytest.mark.parametrize("implementation", ["native", "pallas", "xla"])
def test_residual_carries_no_gradient_unless_asked(rng, implementation):
  """As in jax.nn, a cotangent for the residual is ignored by default;
  differentiable_residual=True lets it through (and matches xla's)."""
  q, k, v = _inputs(rng)
  do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  dlse = jnp.asarray(rng.standard_normal(q.shape[:-1]), jnp.float32)

  def grads(impl, **kw):
    f = lambda q, k, v: jaxflash.dot_product_attention(
        q, k, v, implementation=impl, is_causal=True, return_residual=True,
        residual_dtype=jnp.float32, **kw)
    _, vjp = jax.vjp(f, q, k, v)
    return vjp((do, dlse))

  _, vjp = jax.vjp(lambda q, k, v: jaxflash.dot_product_attention(
      q, k, v, implementation=implementation, is_causal=True), q, k, v)
  for a, b in zip(grads(implementation), vjp(do)):
    assert max_abs(a, b) < 1e-6
  for a, b in zip(grads(implementation, differentiable_residual=True),
                  grads("xla", differentiable_residual=True)):
    assert max_abs(a, b) < 1e-5
  with pytest.raises(ValueError, match="return_residual"):
    jaxflash.dot_product_attention(q, k, v, differentiable_residual=True)



def test_build_against_newer_jaxlib_is_refused_with_a_clear_message(monkeypatch):
  """The FFI API-version trap: headers newer than the runtime jaxlib."""
  from jaxflash import _build_config, _native
  monkeypatch.setattr(_build_config, "FFI_HEADERS_JAXLIB_VERSION", "999.0.0")
  ext, err = _native._load.__wrapped__()
  assert ext is None and "newer than the installed jaxlib" in err and "--no-build-isolation" in err


def test_main_job_runs_from_the_source_checkout():
  """README: `pip install . && python -m jaxflash` in the repository root, where
  the checkout (without the compiled extension) comes first on sys.path."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run([sys.executable, "-m", "jaxflash", "--skip-bench"], cwd=root,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  assert "all checks passed" in result.stdout


@pytest.mark.parametrize("impl", ["native", "xla"])
def test_leading_batch_axes_are_flattened_and_restored(rng, impl):
  """[*batch, T, N, H]: each batch element equals its own rank-3 call, lengths of shape
  `batch` and a bias broadcast over one batch axis included (native: on the CPU, the
  only platform whose native kernels take one so far)."""
  q = jnp.asarray(rng.standard_normal((2, 3, 20, 4, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((2, 3, 24, 2, 16)), jnp.float32) for _ in range(2))
  ql = jnp.array([[20, 5, 0], [1, 2, 20]], jnp.int32)
  kl = jnp.array([[24, 3, 10], [24, 24, 1]], jnp.int32)
  bias = jnp.asarray(rng.standard_normal((3, 1, 20, 24)), jnp.float32)
  if impl == "native" and jax.default_backend() != "cpu":
    bias = None
  out, lse = jaxflash.dot_product_attention(
      q, k, v, bias, is_causal=True, query_seq_lengths=ql, key_value_seq_lengths=kl,
      implementation=impl, return_residual=True, residual_dtype=jnp.float32)
  assert out.shape == q.shape and lse.shape == q.shape[:-1]
  for i in range(2):
    for j in range(3):
      o1, l1 = jaxflash.dot_product_attention(
          q[i, j], k[i, j], v[i, j], None if bias is None else bias[j], is_causal=True,
          query_seq_lengths=ql[i, j:j + 1], key_value_seq_lengths=kl[i, j:j + 1],
          implementation=impl, return_residual=True, residual_dtype=jnp.float32)
      np.testing.assert_allclose(np.asarray(out[i, j]), np.asarray(o1), atol=1e-6)
      np.testing.assert_allclose(np.asarray(lse[i, j]), np.asarray(l1), atol=1e-6)
  with pytest.raises(ValueError, match="batch shape"):
    jaxflash.dot_product_attention(q, k, v, query_seq_lengths=ql.reshape(-1))
  with pytest.raises(ValueError, match="same batch axes"):
    jaxflash.dot_product_attention(q, k[:1], v[:1])


@pytest.mark.parametrize("impl", ["native", "pallas", "xla"])
@pytest.mark.parametrize("dqk, dv", [(24, 16), (16, 40)])
def test_value_head_dim_may_differ_from_the_query_key_one(rng, impl, dqk, dv):
  """MLA-style value head dims (an extension: jax.nn needs them equal): the output takes
  the value's; output and every gradient against a float64 truth under the tolerance
  rule (causal, GQA 2, ragged key lengths, an empty row), and forward mode."""
  if impl == "pallas" and dv > dqk:
    pytest.skip("one case of the Pallas interpreter is enough for the CPU suite")
  kw = dict(is_causal=True, causal_alignment="bottom_right",
            key_value_seq_lengths=jnp.array([19, 7], jnp.int32),
            query_seq_lengths=jnp.array([21, 21], jnp.int32))
  # Jitted (value_width_case), as users call it: eager, each operation compiles
  # on its own, the Pallas interpreter's above all.
  case = value_width_case(rng, 2, 21, 19, 4, 2, dqk, dv, jnp.float32, **kw)
  check_value_width_case(case, impl)
  (q, k, v, _), run, _ = case
  # Forward mode: the tangent of the output equals the reverse-mode product.
  tq, tk, tv = (jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v))
  tangent = lambda impl: jax.jit(lambda *xs: jax.jvp(lambda q, k, v: run(q, k, v, impl)[0],
                                                    xs[:3], xs[3:])[1])(q, k, v, tq, tk, tv)
  t_out, t_base = tangent(impl), tangent("xla")
  assert max_abs(t_out, t_base) < 1e-4
  # The one rank mismatch left is the batch, length or heads of key and value.
  with pytest.raises(ValueError, match="same batch, length and heads"):
    jaxflash.dot_product_attention(q, k, v[:, :, :1])


def test_an_implementation_sequence_takes_the_first_that_serves(rng):
  q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32) for _ in range(3))
  hlo = jax.jit(lambda q: jaxflash.dot_product_attention(
      q, k, v, causal_alignment="bottom_right", implementation=("cudnn", "native", "xla"))
                ).lower(q).as_text()
  assert "jaxflash_fwd" in hlo                      # cudnn takes no alignment: native did
  wide = jnp.zeros((1, 8, 2, 520), jnp.float32)
  hlo = jax.jit(lambda q: jaxflash.dot_product_attention(
      q, q, q, implementation=["pallas", "xla"])).lower(wide).as_text()
  assert "jaxflash_fwd" not in hlo and "pallas" not in hlo   # head dim 520: xla did
  with pytest.raises(ValueError, match="'native': .*head_dim.*'pallas': "):
    jaxflash.dot_product_attention(wide, wide, wide, implementation=("native", "pallas"))
  for bad in ((), ("native", "fast"), [None, 3]):
    with pytest.raises(ValueError, match="non-empty sequence"):
      jaxflash.dot_product_attention(q, k, v, implementation=bad)


def test_a_rank3_query_meets_rank4_keys_as_in_jax_nn(rng):
  q = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((1, 6, 2, 8)), jnp.float32) for _ in range(2))
  got = jaxflash.dot_product_attention(q, k, v, implementation="native")
  want = jax.nn.dot_product_attention(q, k, v, implementation="xla")
  assert got.shape == want.shape == q.shape
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
