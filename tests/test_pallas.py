"""Tests of the Pallas kernels (jaxflash.pallas) against float64 references.

On the CPU the kernels run in the Pallas interpreter, which is slow, so the
shapes here are small and the blocks are shrunk to 16 so that every kernel
still walks several blocks, boundary tiles and interior tiles. The GPU tests
(marker ``gpu``) run the Triton-compiled kernels at realistic sizes.

Tolerances follow the project rule: the kernel's error against the float64
reference may be at most twice the error of the same attention computed by
plain jnp in the input dtype, plus a small absolute term.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiered
from jaxflash.pallas import PallasConfig
from jaxflash.pallas import default_config
from jaxflash.pallas import pallas_backward
from jaxflash.pallas import pallas_forward
from jaxflash.pallas import pallas_supported
from jaxflash.pallas import pallas_tangent

_ON_GPU = any(d.platform == "gpu" for d in jax.devices())
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(not _ON_GPU, reason="needs a GPU")

SMALL = PallasConfig(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16,
                     block_q_dq=16, block_k_dq=16)
MIXED = PallasConfig(block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32,
                     block_q_dq=32, block_k_dq=16)

# The LSE of a row that sees no key (the lowest finite float32).
_EMPTY = float(np.finfo(np.float32).min)

# Absolute slack added to 2x the baseline error, relative to max|reference|.
_ATOL = {jnp.float32: 2e-5, jnp.float16: 1e-3, jnp.bfloat16: 4e-3}


def _seed(request) -> int:
  """A fresh seed per test (JAXFLASH_TEST_SEED pins it), shown on failure."""
  fixed = os.environ.get("JAXFLASH_TEST_SEED")
  if fixed is not None:
    base = int(fixed)
  else:
    base = int(np.random.SeedSequence().entropy % (2**31))
  seed = (base + zlib.crc32(request.node.name.encode())) % (2**31)
  print(f"seed={seed} (JAXFLASH_TEST_SEED={base})")
  return seed


@dataclasses.dataclass(frozen=True)
class Case:
  b: int = 2
  t: int = 17
  s: int = 17
  hq: int = 2
  hkv: int = 1
  d: int = 16
  dtype: type = jnp.float32
  left: int = -1
  right: int = -1
  bottom_right: bool = False
  lengths: str = "full"  # full | ragged | empty | short_q | short_kv
  magnitude: float = 1.0
  config: PallasConfig | None = SMALL

  def __str__(self):
    mask = f"w{self.left},{self.right}{'br' if self.bottom_right else 'tl'}"
    return (f"b{self.b}t{self.t}s{self.s}h{self.hq}/{self.hkv}d{self.d}-"
            f"{jnp.dtype(self.dtype).name}-{mask}-{self.lengths}"
            f"{'-x%g' % self.magnitude if self.magnitude != 1 else ''}")


def _lengths(case: Case, rng):
  b, t, s = case.b, case.t, case.s
  ql = np.full((b,), t, np.int32)
  kl = np.full((b,), s, np.int32)
  if case.lengths == "ragged":
    ql = rng.integers(1, t + 1, size=b).astype(np.int32)
    kl = rng.integers(1, s + 1, size=b).astype(np.int32)
    ql[0], kl[0] = t, s
  elif case.lengths == "empty":  # one batch element with nothing at all
    ql[-1] = 0
    kl[0] = 0
  elif case.lengths == "short_q":
    ql[:] = rng.integers(0, t + 1, size=b)
  elif case.lengths == "short_kv":
    kl[:] = rng.integers(0, s + 1, size=b)
    kl[0] = 0
  return ql, kl


def _inputs(case: Case, rng):
  shape_q = (case.b, case.t, case.hq, case.d)
  shape_kv = (case.b, case.s, case.hkv, case.d)
  q = rng.standard_normal(shape_q) * case.magnitude
  k = rng.standard_normal(shape_kv)
  v = rng.standard_normal(shape_kv)
  do = rng.standard_normal(shape_q)
  dlse = rng.standard_normal((case.b, case.hq, case.t))
  cast = lambda x: jnp.asarray(x, case.dtype)
  return (cast(q), cast(k), cast(v), cast(do),
          jnp.asarray(dlse, jnp.float32))


def _visible(case: Case, ql, kl):
  """Boolean [B, T, S], written independently of the kernels' arithmetic."""
  i = np.arange(case.t)[:, None]
  j = np.arange(case.s)[None, :]
  vis = np.zeros((case.b, case.t, case.s), bool)
  for b in range(case.b):
    qv = min(max(int(ql[b]), 0), case.t)
    kv = min(max(int(kl[b]), 0), case.s)
    off = kv - qv if case.bottom_right else 0
    m = (i < qv) & (j < kv)
    if case.left >= 0:
      m &= j >= i + off - case.left
    if case.right >= 0:
      m &= j <= i + off + case.right
    vis[b] = m
  return vis


def _reference64(q, k, v, do, dlse, vis, scale):
  """Float64 forward and backward from the contract's formulas."""
  q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
  dlse = np.asarray(dlse, np.float64)
  g = q.shape[2] // k.shape[2]
  kk = np.repeat(k, g, axis=2)
  vv = np.repeat(v, g, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, kk, optimize=True) * scale
  vis4 = vis[:, None]
  s = np.where(vis4, s, -np.inf)
  mx = s.max(-1, keepdims=True)
  mx = np.where(np.isfinite(mx), mx, 0.0)
  e = np.where(vis4, np.exp(s - mx), 0.0)
  l = e.sum(-1, keepdims=True)
  seen = l > 0
  lse = np.where(seen, np.log(np.where(seen, l, 1.0)) + mx, _EMPTY)[..., 0]
  p = e / np.where(seen, l, 1.0)
  o = np.einsum("bhts,bshd->bthd", p, vv, optimize=True)
  delta = np.einsum("bthd,bthd->bht", do, o) - dlse
  dvv = np.einsum("bhts,bthd->bshd", p, do, optimize=True)
  dp = np.einsum("bthd,bshd->bhts", do, vv, optimize=True)
  ds = p * (dp - delta[..., None])
  dq = np.einsum("bhts,bshd->bthd", ds, kk, optimize=True) * scale
  dkk = np.einsum("bhts,bthd->bshd", ds, q, optimize=True) * scale
  sum_group = lambda x: x.reshape(x.shape[0], x.shape[1], -1, g,
                                  x.shape[3]).sum(3)
  return o, lse, dq, sum_group(dkk), sum_group(dvv)


def _baseline(q, k, v, do, dlse, vis, scale):
  """The same attention by plain jnp in the input dtype, with its vjp."""
  return _baseline_jit(q, k, v, do, dlse, jnp.asarray(vis), scale)


def _dense(q, k, v, vis, scale, softcap=0.0):
  """Dense attention by plain jnp: (o, lse), lse -inf on rows that see nothing.

  Scores in float32 (float64 for float64 inputs), soft-capped when `softcap`
  > 0 before the mask [B, T, S] `vis`; P rounded to the inputs' dtype."""
  g = q.shape[2] // k.shape[2]
  kk = jnp.repeat(k, g, axis=2)
  vv = jnp.repeat(v, g, axis=2)
  vis4 = jnp.asarray(vis)[:, None]
  s = jnp.einsum("bthd,bshd->bhts", q, kk).astype(jnp.promote_types(q.dtype, jnp.float32))
  s = s * scale
  if softcap:
    s = softcap * jnp.tanh(s / softcap)
  s = jnp.where(vis4, s, -jnp.inf)
  mx = jax.lax.stop_gradient(s.max(-1, keepdims=True))
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  e = jnp.where(vis4, jnp.exp(s - mx), 0.0)
  l = e.sum(-1, keepdims=True)
  seen = l > 0
  lse = jnp.where(seen, jnp.log(jnp.where(seen, l, 1.0)) + mx, -jnp.inf)
  p = (e / jnp.where(seen, l, 1.0)).astype(q.dtype)
  o = jnp.einsum("bhts,bshd->bthd", p, vv)
  return o, lse[..., 0]


@functools.partial(jax.jit, static_argnums=(6,))
def _baseline_jit(q, k, v, do, dlse, vis, scale):
  (o, lse), vjp = jax.vjp(lambda q, k, v: _dense(q, k, v, vis, scale), q, k, v)
  dq, dk, dv = vjp((do, dlse))
  return o, lse, dq, dk, dv


def _err(x, ref):
  x = np.asarray(x, np.float64)
  return float(np.max(np.abs(x - ref), initial=0.0))


def _check(name, got, ref, base, dtype, seed):
  got_np = np.asarray(got, np.float64)
  assert got_np.shape == ref.shape, (name, got_np.shape, ref.shape)
  assert np.all(np.isfinite(got_np)), f"{name}: non-finite values (seed {seed})"
  scale = max(1.0, float(np.max(np.abs(ref), initial=0.0)))
  tol = 2.0 * _err(base, ref) + _ATOL[dtype] * scale
  err = _err(got_np, ref)
  assert err <= tol, (f"{name}: max error {err:.3g} > tolerance {tol:.3g} "
                      f"(baseline {_err(base, ref):.3g}, seed {seed})")


def _check_lse(got, ref, base, dtype, seed):
  got = np.asarray(got, np.float64)
  assert got.shape == ref.shape
  masked = ref == _EMPTY
  np.testing.assert_array_equal(got == _EMPTY, masked,
                                err_msg=f"lse empty-row pattern (seed {seed})")
  assert not np.any(np.isnan(got)), f"lse NaN (seed {seed})"
  fin = ~masked
  _check("lse", np.where(fin, got, 0.0), np.where(fin, ref, 0.0),
         np.where(fin, np.asarray(base, np.float64), 0.0), dtype, seed)


def _run(case: Case, request, *, grads: bool):
  seed = _seed(request)
  rng = np.random.default_rng(seed)
  q, k, v, do, dlse = _inputs(case, rng)
  ql, kl = _lengths(case, rng)
  scale = 1.0 / math.sqrt(case.d)
  kw = dict(scale=scale, window_left=case.left, window_right=case.right,
            bottom_right=case.bottom_right, config=case.config)
  o, lse = pallas_forward(q, k, v, jnp.asarray(ql), jnp.asarray(kl), **kw)
  assert o.dtype == case.dtype and lse.dtype == jnp.float32
  assert o.shape == q.shape and lse.shape == (case.b, case.hq, case.t)
  vis = _visible(case, ql, kl)
  ref = _reference64(q, k, v, do, dlse, vis, scale)
  base = _baseline(q, k, v, do, dlse, vis, scale)
  _check("o", o, ref[0], base[0], case.dtype, seed)
  _check_lse(lse, ref[1], base[1], case.dtype, seed)
  # Rows that see nothing are exactly zero.
  dead = ~vis.any(-1)  # [B, T]
  assert np.all(np.asarray(o, np.float32)[dead] == 0)
  if not grads:
    return
  dq, dk, dv = pallas_backward(q, k, v, o, lse, do, dlse, jnp.asarray(ql),
                               jnp.asarray(kl), **kw)
  for name, got, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
    assert got.shape == x.shape and got.dtype == x.dtype, name
  _check("dq", dq, ref[2], base[2], case.dtype, seed)
  _check("dk", dk, ref[3], base[3], case.dtype, seed)
  _check("dv", dv, ref[4], base[4], case.dtype, seed)
  assert np.all(np.asarray(dq, np.float32)[dead] == 0)
  dead_keys = ~vis.any(1)  # [B, S]
  assert np.all(np.asarray(dk, np.float32)[dead_keys] == 0)
  assert np.all(np.asarray(dv, np.float32)[dead_keys] == 0)


F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16

FORWARD_CASES = [
    Case(t=1, s=1, d=8),
    Case(t=1, s=127, hq=8, hkv=1, d=64, right=0, bottom_right=True),  # decode
    Case(t=17, s=127, hq=4, hkv=2, d=24),
    Case(t=127, s=17, d=40, right=0),
    Case(t=127, s=17, d=40, right=0, bottom_right=True),
    Case(t=64, s=64, d=32, right=0, config=None),
    Case(t=50, s=70, hq=2, hkv=2, d=96, left=5, right=3, bottom_right=True),
    Case(t=45, s=45, d=16, left=7),
    Case(t=45, s=33, d=16, right=2),
    Case(t=40, s=40, d=16, left=0, right=0),
    Case(t=33, s=47, d=20, lengths="ragged", right=0, bottom_right=True),
    Case(t=33, s=47, d=20, lengths="ragged", left=4, right=0),
    Case(t=30, s=30, d=16, lengths="empty", right=0),
    Case(t=30, s=20, d=16, lengths="short_kv", right=0, bottom_right=True),
    Case(t=48, s=16, d=16, right=0, bottom_right=True),  # rows before diag
    Case(t=37, s=61, hq=2, hkv=1, d=128, dtype=F16, right=0, config=MIXED),
    Case(t=37, s=61, hq=8, hkv=2, d=72, dtype=BF16, lengths="ragged"),
    Case(t=17, s=29, d=256, dtype=BF16, left=6, right=-1, config=MIXED),
    Case(t=40, s=40, d=32, magnitude=30.0, right=0),  # large logits
    Case(t=40, s=40, d=32, dtype=F16, magnitude=10.0),
]

BACKWARD_CASES = [
    Case(t=1, s=17, hq=2, hkv=2, d=8),
    Case(t=17, s=1, d=16, right=0),
    Case(t=37, s=53, hq=4, hkv=2, d=24, lengths="ragged"),
    Case(t=45, s=33, hq=8, hkv=1, d=16, right=0),
    Case(t=45, s=33, hq=2, hkv=1, d=40, right=0, bottom_right=True),
    Case(t=40, s=56, d=16, left=5, right=3, bottom_right=True,
         lengths="ragged"),
    Case(t=40, s=40, d=16, left=9, right=0, lengths="empty"),
    Case(t=36, s=20, d=16, right=0, bottom_right=True, lengths="short_kv"),
    Case(t=33, s=49, hq=4, hkv=1, d=96, dtype=F16, right=0, config=MIXED),
    Case(t=33, s=49, hq=4, hkv=2, d=64, dtype=BF16, left=10,
         lengths="short_q", config=MIXED),
    Case(t=50, s=50, d=32, right=0, config=None),
    Case(t=30, s=30, d=32, magnitude=20.0, left=7, right=7),
]


@pytest.mark.parametrize("case", FORWARD_CASES, ids=str)
def test_forward_matches_reference(case, request):
  _run(case, request, grads=False)


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=str)
def test_forward_backward_match_reference(case, request):
  _run(case, request, grads=True)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=lambda d: d.__name__)
def test_dtypes_gqa8_causal(dtype, request):
  _run(Case(t=31, s=31, hq=8, hkv=1, d=32, dtype=dtype, right=0,
            lengths="ragged"), request, grads=True)


def test_none_dlse_is_zero_cotangent(request):
  rng = np.random.default_rng(_seed(request))
  case = Case(t=20, s=24, d=16, right=0)
  q, k, v, do, _ = _inputs(case, rng)
  lens = (jnp.array([20, 11], jnp.int32), jnp.array([24, 24], jnp.int32))
  kw = dict(scale=0.25, window_left=-1, window_right=0, bottom_right=False,
            config=SMALL)
  o, lse = pallas_forward(q, k, v, *lens, **kw)
  a = pallas_backward(q, k, v, o, lse, do, None, *lens, **kw)
  b = pallas_backward(q, k, v, o, lse, do, jnp.zeros_like(lse), *lens, **kw)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fully_masked_everything_is_zero_not_nan():
  case = Case(t=20, s=20, d=16)
  rng = np.random.default_rng(0)
  q, k, v, do, dlse = _inputs(case, rng)
  kw = dict(scale=0.25, window_left=-1, window_right=0, bottom_right=False,
            config=SMALL)
  zeros = jnp.zeros((2,), jnp.int32)
  full = jnp.full((2,), 20, jnp.int32)
  for ql, kl in ((zeros, full), (full, zeros), (zeros, zeros)):
    o, lse = pallas_forward(q, k, v, ql, kl, **kw)
    assert np.all(np.asarray(o) == 0)
    assert np.all(np.asarray(lse) == _EMPTY)
    grads = pallas_backward(q, k, v, o, lse, do, dlse, ql, kl, **kw)
    for g in grads:
      assert np.all(np.asarray(g) == 0)


@pytest.mark.parametrize("b, t, s", [(0, 5, 5), (2, 0, 5), (2, 5, 0)])
def test_empty_shapes(b, t, s):
  q = jnp.ones((b, t, 2, 16), jnp.bfloat16)
  k = jnp.ones((b, s, 1, 16), jnp.bfloat16)
  ql = jnp.full((b,), t, jnp.int32)
  kl = jnp.full((b,), s, jnp.int32)
  kw = dict(scale=0.25, window_left=-1, window_right=-1, bottom_right=False,
            config=SMALL)
  o, lse = pallas_forward(q, k, k, ql, kl, **kw)
  assert o.shape == q.shape and lse.shape == (b, 2, t)
  assert np.all(np.asarray(o, np.float32) == 0)
  assert np.all(np.asarray(lse) == _EMPTY)
  grads = pallas_backward(q, k, k, o, lse, q, lse, ql, kl, **kw)
  for g, x in zip(grads, (q, k, k)):
    assert g.shape == x.shape and g.dtype == x.dtype
    assert np.all(np.asarray(g, np.float32) == 0)


def test_lengths_are_clamped(request):
  """Out-of-range lengths behave like the clamped ones (never out of bounds)."""
  rng = np.random.default_rng(_seed(request))
  case = Case(t=20, s=24, d=16)
  q, k, v, _, _ = _inputs(case, rng)
  kw = dict(scale=0.25, window_left=-1, window_right=0, bottom_right=True,
            config=SMALL)
  o1, l1 = pallas_forward(q, k, v, jnp.array([-5, 99], jnp.int32),
                          jnp.array([1000, -1], jnp.int32), **kw)
  o2, l2 = pallas_forward(q, k, v, jnp.array([0, 20], jnp.int32),
                          jnp.array([24, 0], jnp.int32), **kw)
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
  np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))


def test_custom_vjp_under_jit_and_grad(request):
  """The wiring the public API uses: custom_vjp over the two functions."""
  rng = np.random.default_rng(_seed(request))
  case = Case(t=24, s=40, hq=4, hkv=2, d=16, right=0, bottom_right=True,
              lengths="ragged")
  q, k, v, do, dlse = _inputs(case, rng)
  ql, kl = _lengths(case, rng)
  scale = 0.3
  kw = dict(scale=scale, window_left=-1, window_right=0, bottom_right=True,
            config=SMALL)

  @jax.custom_vjp
  def attn(q, k, v, ql, kl):
    return pallas_forward(q, k, v, ql, kl, **kw)

  def fwd(q, k, v, ql, kl):
    o, lse = pallas_forward(q, k, v, ql, kl, **kw)
    return (o, lse), (q, k, v, o, lse, ql, kl)

  def bwd(res, cts):
    q, k, v, o, lse, ql, kl = res
    dq, dk, dv = pallas_backward(q, k, v, o, lse, *cts, ql, kl, **kw)
    return dq, dk, dv, None, None

  attn.defvjp(fwd, bwd)

  def loss(q, k, v, ql, kl):
    o, lse = attn(q, k, v, ql, kl)
    lse = jnp.where(lse == _EMPTY, 0.0, lse)
    return jnp.sum(o * do) + jnp.sum(lse * dlse)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(
      q, k, v, jnp.asarray(ql), jnp.asarray(kl))
  vis = _visible(case, ql, kl)
  dead = ~vis.any(-1)  # rows with lse = -inf get no lse cotangent above
  dlse_eff = np.where(dead[:, None, :], 0.0, np.asarray(dlse))
  ref = _reference64(q, k, v, do, dlse_eff, vis, scale)
  base = _baseline(q, k, v, do, jnp.asarray(dlse_eff, jnp.float32), vis,
                   scale)
  for name, g, r, bb in zip(("dq", "dk", "dv"), grads, ref[2:], base[2:]):
    _check(name, g, r, bb, case.dtype, "jit")


def test_vmap_over_forward(request):
  rng = np.random.default_rng(_seed(request))
  case = Case(b=1, t=20, s=20, d=16)
  qs, ks, vs = [], [], []
  for _ in range(2):
    q, k, v, _, _ = _inputs(case, rng)
    qs.append(q)
    ks.append(k)
    vs.append(v)
  q, k, v = jnp.stack(qs), jnp.stack(ks), jnp.stack(vs)
  lens = jnp.full((1,), 20, jnp.int32)
  kw = dict(scale=0.25, window_left=-1, window_right=0, bottom_right=False,
            config=SMALL)
  o, lse = jax.vmap(lambda q, k, v: pallas_forward(q, k, v, lens, lens, **kw)
                    )(q, k, v)
  for i in range(2):
    oi, li = pallas_forward(q[i], k[i], v[i], lens, lens, **kw)
    np.testing.assert_allclose(np.asarray(o[i]), np.asarray(oi), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse[i]), np.asarray(li), rtol=1e-6,
                               atol=1e-6)


def test_block_size_does_not_change_the_result(request):
  rng = np.random.default_rng(_seed(request))
  case = Case(t=50, s=45, d=16, left=6, right=2)
  q, k, v, _, _ = _inputs(case, rng)
  lens = (jnp.array([50, 31], jnp.int32), jnp.array([45, 40], jnp.int32))
  kw = dict(scale=0.25, window_left=6, window_right=2, bottom_right=True)
  outs = [pallas_forward(q, k, v, *lens, config=c, **kw)
          for c in (SMALL, MIXED, PallasConfig(block_q=64, block_k=32))]
  for o, lse in outs[1:]:
    np.testing.assert_allclose(np.asarray(o), np.asarray(outs[0][0]),
                               atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(outs[0][1]),
                               atol=2e-6, rtol=0)


# ---------------------------------------------------------------------------
# Cross-check with the project's plain-jnp implementation
# ---------------------------------------------------------------------------


def _project_reference():
  try:
    from jaxflash import reference
  except ImportError:
    return None
  return getattr(reference, "attention", None)


@pytest.mark.parametrize("case", [
    Case(t=29, s=41, hq=4, hkv=2, d=24, right=0, bottom_right=True,
         lengths="ragged"),
    Case(t=41, s=29, hq=2, hkv=1, d=16, left=5, right=2, lengths="empty"),
], ids=str)
def test_matches_project_reference(case, request):
  attention = _project_reference()
  if attention is None:
    pytest.skip("jaxflash.reference.attention is not available")
  rng = np.random.default_rng(_seed(request))
  q, k, v, do, dlse = _inputs(case, rng)
  ql, kl = _lengths(case, rng)
  scale = 1.0 / math.sqrt(case.d)
  left = None if case.left < 0 else case.left
  right = None if case.right < 0 else case.right

  def ref_fn(q, k, v):
    return attention(
        q, k, v, scale=scale, local_window_size=(left, right),
        causal_alignment="bottom_right" if case.bottom_right else "top_left",
        query_seq_lengths=jnp.asarray(ql),
        key_value_seq_lengths=jnp.asarray(kl))

  @jax.jit
  def ref_vjp(q, k, v, do, dlse):
    (ro, rlse), vjp = jax.vjp(ref_fn, q, k, v)
    return (ro, rlse, *vjp((do, dlse)))

  with jax.default_matmul_precision("highest"):
    ro, rlse, rdq, rdk, rdv = ref_vjp(q, k, v, do, dlse)
  kw = dict(scale=scale, window_left=case.left, window_right=case.right,
            bottom_right=case.bottom_right, config=SMALL)
  o, lse = pallas_forward(q, k, v, jnp.asarray(ql), jnp.asarray(kl), **kw)
  dq, dk, dv = pallas_backward(q, k, v, o, lse, do, dlse, jnp.asarray(ql),
                               jnp.asarray(kl), **kw)
  tol = dict(atol=5e-5, rtol=5e-5)
  np.testing.assert_allclose(np.asarray(o), np.asarray(ro), **tol)
  np.testing.assert_array_equal(np.asarray(lse) == _EMPTY, np.asarray(rlse) == _EMPTY)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(rlse), **tol)
  for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)


# ---------------------------------------------------------------------------
# Soft-cap
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(4, 5))
def _dense_derivatives(primals, cotangents, tangents, vis, scale, softcap):
  """`_dense`'s (o, lse), its vjp of `cotangents` and its jvp of `tangents`:
  autodiff of the capped scores, independent of the kernels' formulas."""
  attend = lambda q, k, v: _dense(q, k, v, vis, scale, softcap)
  out, vjp = jax.vjp(attend, *primals)
  _, t_out = jax.jvp(attend, primals, tangents)
  return out, vjp(cotangents), t_out


def _float64_truth(fn, *args):
  """`fn(*args)` with every float array of args in float64, as numpy float64."""
  with jax.enable_x64(True):
    up = jax.tree.map(
        lambda x: jnp.asarray(x, jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        args)
    return jax.tree.map(lambda x: np.asarray(x, np.float64), fn(*up))


def _softcap_lse(lse):
  """The reference's -inf LSE of a row that sees nothing, as the kernels write it."""
  return np.where(np.isneginf(np.asarray(lse, np.float64)), _EMPTY, lse)


def _forward_kw(kernel: str, batch: int):
  """pallas_forward's keywords that reach `kernel`: "main" (forced by zero
  diagonal offsets), "decode" (the automatic choice at the small sizes here)
  or "split" (the decode kernel over two key ranges, merged)."""
  return {"main": dict(diagonal_offsets=jnp.zeros((batch,), jnp.int32)),
          "decode": {}, "split": dict(num_splits=2)}[kernel]


def _softcap_run(case, softcap, kernels, request):
  """Forward (each of `kernels`), backward and tangent against float64
  autodiff of the dense capped reference, with its run in the input dtype as
  the tolerance's baseline."""
  seed = _seed(request)
  rng = np.random.default_rng(seed)
  q, k, v, do, dlse = _inputs(case, rng)
  tq, tk, tv = _inputs(case, rng)[:3]
  ql, kl = _lengths(case, rng)
  vis = jnp.asarray(_visible(case, ql, kl))
  scale = 1.0 / math.sqrt(case.d)
  args = ((q, k, v), (do, dlse), (tq, tk, tv), vis)
  base = _dense_derivatives(*args, scale, softcap)
  truth = _float64_truth(lambda *a: _dense_derivatives(*a, scale, softcap), *args)
  lengths = (jnp.asarray(ql), jnp.asarray(kl))
  kw = dict(scale=scale, window_left=case.left, window_right=case.right,
            bottom_right=case.bottom_right, config=case.config, softcap=softcap)
  for kernel in kernels:
    o, lse = pallas_forward(q, k, v, *lengths, **kw, **_forward_kw(kernel, case.b))
    _check(f"{kernel} o", o, truth[0][0], base[0][0], case.dtype, seed)
    _check_lse(lse, _softcap_lse(truth[0][1]), base[0][1], case.dtype, seed)
  grads = pallas_backward(q, k, v, o, lse, do, dlse, *lengths, **kw)
  for name, got, want, b in zip(("dq", "dk", "dv"), grads, truth[1], base[1]):
    _check(name, got, want, b, case.dtype, seed)
  tangents = pallas_tangent(q, k, v, o, lse, *lengths, tq, tk, tv, **kw)
  for name, got, want, b in zip(("tO", "tLSE"), tangents, truth[2], base[2]):
    _check(name, got, want, b, case.dtype, seed)


def _softcap_case(case, softcap, *kernels):
  return pytest.param(case, softcap, kernels, id=f"{case}-cap{softcap:g}-{'+'.join(kernels)}")


# magnitude 3: scaled scores of about +-3 and beyond, where a cap of 5 bends
# them. Each interpreted kernel call costs about a second, so each case runs
# the forward kernels it needs (the cap is the same code in all of them).
SOFTCAP_CASES = [
    _softcap_case(Case(t=33, s=47, hq=4, hkv=2, d=16, right=0, bottom_right=True,
                       lengths="ragged", magnitude=3.0), 5.0, "main", "decode"),
    _softcap_case(Case(t=33, s=47, hq=4, hkv=2, d=16, right=0, bottom_right=True,
                       lengths="ragged", magnitude=3.0), 0.0, "decode"),
    _softcap_case(Case(t=40, s=29, hq=4, hkv=2, d=24, left=4, right=2, lengths="ragged",
                       magnitude=3.0), 5.0, "main"),
    _softcap_case(Case(t=29, s=37, hq=4, hkv=2, d=16, dtype=BF16, lengths="ragged",
                       magnitude=3.0), 5.0, "decode"),
    # One query row: the decode kernel, whole and split over the keys.
    _softcap_case(Case(t=1, s=45, hq=4, hkv=2, d=16, right=0, bottom_right=True,
                       lengths="short_kv", magnitude=3.0), 5.0, "decode", "split"),
]


@pytest.mark.parametrize("case, softcap, kernels", SOFTCAP_CASES)
def test_softcap_matches_float64_autodiff(case, softcap, kernels, request):
  _softcap_run(case, softcap, kernels, request)


def test_softcap_padding_nan_changes_no_bit(request):
  """NaN in the rows and keys past the lengths leaves every result bit for bit:
  a masked pair's NaN score is selected away, and so is its cap derivative, so
  no block falls back to the pair-by-pair recomputation."""
  rng = np.random.default_rng(_seed(request))
  case = Case(t=35, s=45, hq=4, hkv=2, d=16, left=6, right=0, magnitude=3.0)
  q, k, v, do, dlse = _inputs(case, rng)
  tq, tk, tv = _inputs(case, rng)[:3]
  ql, kl = jnp.array([35, 20], jnp.int32), jnp.array([30, 45], jnp.int32)
  kw = dict(scale=0.25, window_left=6, window_right=0, bottom_right=True, config=SMALL,
            softcap=5.0)

  def poison(x, lengths):
    past = np.arange(x.shape[1])[None, :] >= np.asarray(lengths)[:, None]
    return jnp.where(jnp.asarray(past)[:, :, None, None], jnp.nan, x)

  def results(q, k, v, do, tq, tk, tv):
    # The decode kernel's forward: its tiles are the main kernel's (_attend).
    o, lse = pallas_forward(q, k, v, ql, kl, **kw)
    return [o, lse, *pallas_backward(q, k, v, o, lse, do, dlse, ql, kl, **kw),
            *pallas_tangent(q, k, v, o, lse, ql, kl, tq, tk, tv, **kw)]

  clean = results(q, k, v, do, tq, tk, tv)
  dirty = results(poison(q, ql), poison(k, kl), poison(v, kl), poison(do, ql),
                  poison(tq, ql), poison(tk, kl), poison(tv, kl))
  for a, b in zip(clean, dirty):
    assert np.all(np.isfinite(np.asarray(b, np.float32)))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_softcap_takes_infinite_scores_to_the_cap(request):
  """tanh(+-inf) = +-1: a query with an infinite element scores +-c against
  each key, so its row stays finite and equals the float64 reference's."""
  seed = _seed(request)
  rng = np.random.default_rng(seed)
  case = Case(t=20, s=30, hq=2, hkv=1, d=16, right=0, bottom_right=True)
  q, k, v, _, _ = _inputs(case, rng)
  q = q.at[0, 7, 1, 3].set(jnp.inf).at[1, 19, 0, 0].set(-jnp.inf)
  lengths = (jnp.full((2,), 20, jnp.int32), jnp.full((2,), 30, jnp.int32))
  vis = jnp.asarray(_visible(case, *lengths))
  dense = lambda q, k, v, vis: _dense(q, k, v, vis, 0.25, 2.0)
  base = dense(q, k, v, vis)
  truth = _float64_truth(dense, q, k, v, vis)
  kw = dict(scale=0.25, window_left=-1, window_right=0, bottom_right=True, config=SMALL,
            softcap=2.0)
  o, lse = pallas_forward(q, k, v, *lengths, **kw, **_forward_kw("main", 2))
  _check("o", o, truth[0], base[0], case.dtype, seed)
  _check_lse(lse, truth[1], base[1], case.dtype, seed)


def test_softcap_nan_value_recomputed_with_the_cap(request):
  """A NaN value at key j0 reaches the rows that see it; in the tiles it also
  shares with rows that do not (0 * NaN), and those blocks are recomputed pair
  by pair, which must apply the same cap: the rows before j0 (causal), dV and
  tLSE equal the float64 truth of the clean inputs."""
  seed = _seed(request)
  rng = np.random.default_rng(seed)
  case = Case(t=24, s=24, hq=2, hkv=1, d=16, right=0, magnitude=3.0)
  q, k, v, do, dlse = _inputs(case, rng)
  tq, tk, tv = _inputs(case, rng)[:3]
  lengths = (jnp.full((2,), 24, jnp.int32), jnp.full((2,), 24, jnp.int32))
  vis = jnp.asarray(_visible(case, *lengths))
  args = ((q, k, v), (do, dlse), (tq, tk, tv), vis)
  truth = _float64_truth(lambda *a: _dense_derivatives(*a, 0.25, 5.0), *args)
  base = _dense_derivatives(*args, 0.25, 5.0)
  j0 = 10
  v = v.at[0, j0].set(jnp.nan)
  kw = dict(scale=0.25, window_left=-1, window_right=0, bottom_right=False, config=SMALL,
            softcap=5.0)
  before = lambda x: x[0, :j0]  # batch 0's rows that cannot see key j0
  o, lse = pallas_forward(q, k, v, *lengths, **kw, **_forward_kw("main", 2))
  assert np.all(np.isnan(np.asarray(o[0, j0:])))
  _check("o", before(o), before(truth[0][0]), before(base[0][0]), case.dtype, seed)
  _check("o[1]", o[1], truth[0][0][1], base[0][0][1], case.dtype, seed)
  dq, _, dv = pallas_backward(q, k, v, o, lse, do, dlse, *lengths, **kw)
  _check("dq", before(dq), before(truth[1][0]), before(base[1][0]), case.dtype, seed)
  _check("dv", dv, truth[1][2], base[1][2], case.dtype, seed)
  t_o, t_lse = pallas_tangent(q, k, v, o, lse, *lengths, tq, tk, tv, **kw)
  _check("tO", before(t_o), before(truth[2][0]), before(base[2][0]), case.dtype, seed)
  _check("tLSE", t_lse, truth[2][1], base[2][1], case.dtype, seed)


def test_softcap_must_be_finite_and_not_negative():
  q = jnp.zeros((1, 4, 2, 16))
  lens = jnp.full((1,), 4, jnp.int32)
  for cap in (-1.0, float("inf"), float("nan")):
    with pytest.raises(ValueError, match="soft-cap"):
      pallas_forward(q, q, q, lens, lens, scale=1.0, window_left=-1, window_right=-1,
                     bottom_right=False, softcap=cap)


# ---------------------------------------------------------------------------
# Support checks and configuration
# ---------------------------------------------------------------------------


def test_supported_accepts_the_contract():
  for d in (1, 8, 24, 64, 96, 128, 200, 256):
    for dtype in (F32, F16, BF16):
      assert pallas_supported((2, 17, 8, d), (2, 127, 2, d), None, dtype,
                              "cpu") is None
  for cap in (None, 0.0, 5.0):
    assert pallas_supported((2, 17, 8, 64), (2, 127, 2, 64), None, F32, "cpu",
                            logits_soft_cap=cap) is None


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(q_shape=(1, 4, 2, 520), k_shape=(1, 4, 2, 520)), "head dim"),
    (dict(q_shape=(1, 4, 3, 16), k_shape=(1, 4, 2, 16)), "multiple"),
    (dict(q_shape=(1, 4, 2, 16), k_shape=(1, 4, 2, 32)), "head dim"),
    (dict(q_shape=(1, 4, 2, 16), k_shape=(2, 4, 2, 16)), "batch"),
    (dict(q_shape=(4, 2, 16), k_shape=(4, 2, 16)), "rank"),
    (dict(q_shape=(1, 4, 2, 16), k_shape=(1, 4, 2, 16), dtype=jnp.float64),
     "float32"),
    (dict(q_shape=(1, 4, 2, 16), k_shape=(1, 4, 2, 16), k_dtype=F16),
     "dtype"),
    (dict(q_shape=(1, 4, 2, 16), k_shape=(1, 4, 2, 16), has_bias=True),
     "bias"),
    (dict(q_shape=(1, 4, 2, 16), k_shape=(1, 4, 2, 16), has_mask=True),
     "mask"),
    (dict(q_shape=(1, 4, 2, 16), k_shape=(1, 4, 2, 16),
          has_segment_ids=True), "segment"),
    (dict(q_shape=(1, 4, 2, 16), k_shape=(1, 4, 2, 16), logits_soft_cap=-5.0),
     "soft-cap"),
    (dict(q_shape=(1, 4, 2, 16), k_shape=(1, 4, 2, 16), platform="tpu"),
     "platform"),
    (dict(q_shape=(1, 4, 2, 16), k_shape=(1, 4, 2, 16), interpret_ok=False),
     "interpreter"),
])
def test_supported_names_the_reason(kwargs, fragment):
  kwargs.setdefault("platform", "cpu")
  reason = pallas_supported(**kwargs)
  assert reason is not None and fragment in reason, reason


def test_head_dims_past_256_only_on_gpus_with_the_shared_memory(monkeypatch):
  """Pallas's tiles past 256 need ~192 KiB of shared memory a block: a GPU of compute
  capability 9.x / 10.x takes them, others refuse them (the default then runs xla)."""
  device = type("Device", (), {"compute_capability": "8.6"})()
  monkeypatch.setattr(jax, "devices", lambda *a: [device])
  wide, narrow = (1, 4, 2, 320), (1, 4, 2, 256)
  assert "9.x / 10.x" in pallas_supported(wide, wide, dtype=jnp.bfloat16, platform="gpu")
  assert pallas_supported(narrow, narrow, dtype=jnp.bfloat16, platform="gpu") is None
  device.compute_capability = "9.0"
  assert pallas_supported(wide, wide, dtype=jnp.bfloat16, platform="gpu") is None


def test_unsupported_call_raises():
  q = jnp.zeros((1, 4, 3, 16))
  k = jnp.zeros((1, 4, 2, 16))
  lens = jnp.full((1,), 4, jnp.int32)
  with pytest.raises(ValueError, match="multiple"):
    pallas_forward(q, k, k, lens, lens, scale=1.0, window_left=-1,
                   window_right=-1, bottom_right=False)


@pytest.mark.parametrize("field, value", [
    ("block_q", 24), ("block_k", 8), ("block_q_dkv", 0), ("block_k_dq", 48),
    ("num_warps", 0), ("num_stages_bwd", -1), ("interpret", 1)])
def test_config_rejects_bad_values(field, value):
  with pytest.raises(ValueError, match=field):
    PallasConfig(**{field: value})


def test_default_config_is_complete():
  for d in (8, 16, 64, 100, 128, 256):
    for dtype in (F32, F16, BF16):
      for interpret in (True, False):
        cfg = default_config(d, dtype, interpret=interpret)
        assert cfg.interpret == interpret
        for f in dataclasses.fields(cfg):
          if f.name.startswith("block_"):
            assert getattr(cfg, f.name) >= 16, (d, dtype, f.name)
          elif not interpret:
            assert getattr(cfg, f.name) is not None, (d, dtype, f.name)


# ---------------------------------------------------------------------------
# Larger sweeps
# ---------------------------------------------------------------------------


def _random_case(rng, config, dtypes=(F32, F16, BF16), max_len=200):
  hkv = int(rng.choice([1, 2]))
  g = int(rng.choice([1, 2, 4]))
  left = int(rng.choice([-1, -1, 0, 3, 20]))
  right = int(rng.choice([-1, 0, 0, 5]))
  return Case(b=int(rng.integers(1, 3)), t=int(rng.integers(1, max_len)),
              s=int(rng.integers(1, max_len)), hq=hkv * g, hkv=hkv,
              d=int(rng.choice([8, 16, 40, 64, 80, 128])),
              dtype=dtypes[int(rng.integers(len(dtypes)))], left=left,
              right=right, bottom_right=bool(rng.integers(2)),
              lengths=str(rng.choice(["full", "ragged", "short_q",
                                      "short_kv"])),
              config=config)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("JAXFLASH_SLOW_TESTS") and not _ON_GPU,
    reason="interpret-mode sweep; set JAXFLASH_SLOW_TESTS=1 to run it")
@pytest.mark.parametrize("index", range(12))
def test_random_sweep_interpret(index, request):
  rng = np.random.default_rng(1000 + index)
  _run(_random_case(rng, SMALL), request, grads=True)


@gpu
@requires_gpu
@pytest.mark.parametrize("case", [
    Case(b=2, t=1000, s=1000, hq=8, hkv=2, d=128, dtype=BF16, right=0,
         config=None),
    Case(b=2, t=1000, s=1000, hq=4, hkv=4, d=64, dtype=F16, config=None),
    Case(b=1, t=127, s=1000, hq=8, hkv=1, d=96, dtype=BF16, right=0,
         bottom_right=True, lengths="ragged", config=None),
    Case(b=2, t=300, s=513, hq=4, hkv=2, d=256, dtype=BF16, left=64,
         right=0, config=None),
    # float32 through Triton: 89 s on an H100 under eight test processes.
    pytest.param(Case(b=2, t=257, s=257, hq=2, hkv=1, d=40, dtype=F32, left=16, right=16,
                      lengths="empty", config=None), marks=pytest.mark.slow),
    Case(b=1, t=1, s=4097, hq=16, hkv=2, d=128, dtype=BF16, right=0,
         bottom_right=True, config=None),
], ids=str)
def test_gpu_matches_reference(case, request):
  _run(case, request, grads=True)


@gpu
@requires_gpu
@pytest.mark.parametrize("index", tiered(range(16), range(3)))
def test_gpu_random_sweep(index, request):
  rng = np.random.default_rng(2000 + index)
  _run(_random_case(rng, None, max_len=700), request, grads=True)


@gpu
@requires_gpu
@pytest.mark.slow
def test_gpu_long_sequence(request):
  """16k keys: the forward in bf16 against the float64 reference."""
  case = Case(b=1, t=64, s=16384, hq=4, hkv=1, d=128, dtype=BF16, right=0,
              bottom_right=True, config=None)
  _run(case, request, grads=True)


@pytest.mark.parametrize("d, dtype, left, right, softcap, alibi", [  # alibi: and segment ids
    (64, BF16, -1, 0, 0.0, False), (40, F16, 5, 3, 30.0, True), (256, F32, -1, -1, 0.0, False)])
def test_kernels_lower_for_the_gpu_on_any_machine(d, dtype, left, right, softcap, alibi):
  """The Triton lowering of every kernel, checked without a GPU: JAX lowers
  for "cuda" on a CPU-only machine, which catches a primitive Pallas cannot
  lower for Triton (as `jnp.any`) before the GPU does."""
  cfg = PallasConfig(interpret=False)
  q = jax.ShapeDtypeStruct((2, 150, 4, d), dtype)
  k = jax.ShapeDtypeStruct((2, 200, 2, d), dtype)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  lse = jax.ShapeDtypeStruct((2, 4, 150), jnp.float32)
  # The ALiBi case carries segment tables too (segments.py's layout).
  tables = (jax.ShapeDtypeStruct((2, 150, 8), jnp.int32), jax.ShapeDtypeStruct((2, 200, 8), jnp.int32))
  kw = dict(scale=0.125, window_left=left, window_right=right, bottom_right=True,
            config=cfg, softcap=softcap,
            alibi=jnp.full((2, 4), 0.25, jnp.float32) if alibi else None)
  seg = lambda ts: dict(segments=ts) if alibi else {}
  fwd = lambda q, k, v, ql, kl, *ts: pallas_forward(q, k, v, ql, kl, **kw, **seg(ts))
  bwd = lambda q, k, v, o, lse, do, dlse, ql, kl, *ts: pallas_backward(
      q, k, v, o, lse, do, dlse, ql, kl, **kw, **seg(ts))
  tangent = lambda q, k, v, o, lse, ql, kl, *ts: pallas_tangent(q, k, v, o, lse, ql, kl, q, k, v,
                                                                **kw, **seg(ts))
  extra = tables if alibi else ()
  for f, args in ((fwd, (q, k, k, lengths, lengths, *extra)),
                  (bwd, (q, k, k, q, lse, q, lse, lengths, lengths, *extra)),
                  (tangent, (q, k, k, q, lse, lengths, lengths, *extra))):
    with _abstract_gpu():
      text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "jaxflash_pallas" in text


def _abstract_gpu():
  """A context naming the GPU to lower for where JAX asks for one (jax >= 0.11: the Triton
  lowering reads the GPU's kind from the abstract mesh when no GPU is attached)."""
  if not hasattr(jax.sharding, "AbstractDevice"):
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                       platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("gpu",), axis_types=(jax.sharding.AxisType.Auto,),
                                  abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 96])   # the decode kernel, the training kernels
def test_pallas_inside_shard_map_with_check_vma(q_len):
  """Inside shard_map's default check_vma, the Pallas calls' operands are cast to one
  variance and their results declare it: forward and gradient equal the plain call's.
  (On the CPU the interpreter refuses a varying ref indexed by a program id: GPU only.)"""
  import jaxflash
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, q_len, 4, 64)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((2, 128, 2, 64)), jnp.bfloat16) for _ in range(2))
  lengths = jnp.array([128, 77], jnp.int32)

  def attend(q, k, v, lengths):
    return jaxflash.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                                          causal_alignment="bottom_right", implementation="pallas")

  sharded = jax.shard_map(attend, mesh=mesh, in_specs=(P("dp"), P("dp"), P("dp"), P()),
                          out_specs=P("dp"))
  loss = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, lengths).astype(jnp.float32) ** 2),
                            argnums=(0, 1, 2))
  for got, want in [(jax.jit(sharded)(q, k, v, lengths), jax.jit(attend)(q, k, v, lengths)),
                    *zip(jax.jit(loss(sharded))(q, k, v), jax.jit(loss(attend))(q, k, v))]:
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
