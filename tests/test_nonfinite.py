"""NaN and Inf inputs: they reach exactly the outputs and gradients a dense
softmax over the visible pairs puts them in, and never come from what a row
cannot see.

The truth is `numpy_reference.exact` (IEEE float64, sums over visible pairs
only). Where nothing is masked it must agree with jax.nn's xla implementation
element for element, and the tests check that it does; with masks jax.nn also
multiplies masked pairs' zero weights into NaN (0 * NaN), so there the truth
is a subset of jax.nn's pattern (README, "documented differences"). The fused
implementations (native, pallas) must match the truth exactly; the dense
`xla` implementation matches it wherever padding is the only mask and lies
between it and jax.nn otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from conftest import numpy_reference, tiered
from jaxflash import _native

POISONS = {  # (tensor, value)
    "q_nan": ("q", np.nan), "k_nan": ("k", np.nan), "v_nan": ("v", np.nan),
    "do_nan": ("do", np.nan), "q_inf": ("q", np.inf), "k_neginf": ("k", -np.inf),
    "v_inf": ("v", np.inf), "v_neginf": ("v", -np.inf),
}

# (keyword arguments, compared with jax.nn, padding is the only mask)
MASKS = {
    "none": (dict(), True, True),
    "causal": (dict(is_causal=True), True, False),
    "causal_bottom_right": (dict(is_causal=True, causal_alignment="bottom_right"), False, False),
    "window": (dict(local_window_size=(9, 4)), True, False),
    "lengths": (dict(lengths=True), True, True),
    "lengths_causal": (dict(lengths=True, is_causal=True), True, False),
}


def _mask_kwargs(name, rng, B, T, S):
  kw = dict(MASKS[name][0])
  if kw.pop("lengths", False):
    kw["query_seq_lengths"] = rng.integers(T // 2, T + 1, size=B).astype(np.int32)
    kw["key_value_seq_lengths"] = rng.integers(S // 2, S + 1, size=B).astype(np.int32)
    # Padding in the first element; something to attend in the last, even
    # with one query row (decode shapes, where T // 2 draws 0).
    kw["query_seq_lengths"][0], kw["key_value_seq_lengths"][-1] = max(T - 3, 0), max(S - 5, 1)
    kw["query_seq_lengths"][-1] = max(kw["query_seq_lengths"][-1], 1)
  return kw


def _numpy_mask(kw):
  left = right = -1
  if kw.get("local_window_size") is not None:
    left, right = kw["local_window_size"]
  if kw.get("is_causal"):
    right = 0
  return dict(left=left, right=right, bottom_right=kw.get("causal_alignment") == "bottom_right",
              q_lengths=kw.get("query_seq_lengths"), kv_lengths=kw.get("key_value_seq_lengths"))


def _poison(rng, arrays, poison, kw, padding: bool):
  """Puts the poison value in one element: a row/key inside the lengths, or
  (padding=True) one past them."""
  name, value = POISONS[poison]
  x = np.array(arrays[name], np.float64)
  B, L = x.shape[:2]
  lengths = kw.get("key_value_seq_lengths" if name in "kv" else "query_seq_lengths")
  valid = np.full(B, L) if lengths is None else np.asarray(lengths)
  # A batch element with something to poison (padding, or a real row/key).
  b = int(rng.choice(np.flatnonzero(valid < L) if padding else np.flatnonzero(valid > 0)))
  pos = int(rng.integers(valid[b], L)) if padding else int(rng.integers(valid[b]))
  x[b, pos, int(rng.integers(x.shape[2])), int(rng.integers(x.shape[3]))] = value
  arrays[name] = x


def _inputs(rng, shape, dtype):
  B, T, S, N, K, D = shape
  return dict(q=rng.standard_normal((B, T, N, D)), k=rng.standard_normal((B, S, K, D)),
              v=rng.standard_normal((B, S, K, D)), do=rng.standard_normal((B, T, N, D)))


def _run(impl, arrays, dtype, kw):
  """(o, lse [B, N, T], dq, dk, dv) from the public API."""
  q, k, v, do = (jnp.asarray(arrays[n], dtype) for n in ("q", "k", "v", "do"))
  lengths = {n: kw[n] for n in ("query_seq_lengths", "key_value_seq_lengths") if n in kw}
  static = tuple(sorted((n, x) for n, x in kw.items() if n not in lengths))
  return _run_jit(q, k, v, do, lengths, impl=impl, static=static, tile=_native.forced_tile_attr())


@functools.partial(jax.jit, static_argnames=("impl", "static", "tile"))
def _run_jit(q, k, v, do, lengths, *, impl, static, tile):
  # jitted, so the cases of one mask structure share one compilation (the
  # forced tile is part of the key: it is read when the call is traced).
  del tile
  kw = dict(static, **lengths)
  f = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, implementation=impl, **kw)
  o, vjp = jax.vjp(f, q, k, v)
  _, lse = jaxflash.dot_product_attention(q, k, v, implementation=impl, return_residual=True,
                                          residual_dtype=jnp.float32, **kw)
  return (o, jnp.transpose(lse, (0, 2, 1)), *vjp(do))


def _truth(arrays, dtype, kw):
  cast = {n: np.asarray(jnp.asarray(arrays[n], dtype), np.float64) for n in arrays}
  return numpy_reference.exact(cast["q"], cast["k"], cast["v"], cast["do"],
                               scale=1 / np.sqrt(cast["q"].shape[-1]), **_numpy_mask(kw))


def _pattern(x):
  x = np.asarray(x, np.float64)
  return np.isnan(x), np.isposinf(x), np.isneginf(x)


NAMES = ("o", "lse", "dq", "dk", "dv")


def assert_same_nonfinite(got, want, what):
  """Identical NaN / +Inf / -Inf elements, and finite elements that agree
  (a None in `got` is not compared)."""
  for name, g, w in zip(NAMES, got, want):
    if g is None:
      continue
    for kind, gp, wp in zip(("NaN", "+Inf", "-Inf"), _pattern(g), _pattern(w)):
      bad = np.argwhere(gp != wp)
      assert not bad.size, (f"{what} {name}: {kind} differs at {len(bad)} elements, first "
                            f"{bad[0].tolist()} (got {gp[tuple(bad[0])]})")
    fin = np.isfinite(np.asarray(w, np.float64))
    g, w = np.asarray(g, np.float64)[fin], np.asarray(w, np.float64)[fin]
    scale = max(1.0, float(np.max(np.abs(w), initial=0)))
    tol = 2e-3 if got[0].dtype == jnp.float32 else 6e-2
    assert np.max(np.abs(g - w), initial=0) <= tol * scale, f"{what} {name}: finite values differ"


def _subset(a, b):
  """Every non-finite element of a is non-finite in b."""
  return all(not np.any(~np.isfinite(np.asarray(x, np.float64)) &
                        np.isfinite(np.asarray(y, np.float64))) for x, y in zip(a, b))


SHAPE = (2, 70, 90, 4, 2, 16)  # several CPU tiles and Pallas blocks, GQA 2


def check_case(rng, impl, poison, mask_name, dtype, shape=SHAPE, padding=False, **extra):
  """`extra`: keywords for jaxflash only (num_splits)."""
  B, T, S = shape[:3]
  kw = _mask_kwargs(mask_name, rng, B, T, S)
  arrays = _inputs(rng, shape, dtype)
  _poison(rng, arrays, poison, kw, padding)
  got = _run(impl, arrays, dtype, dict(kw, **extra))
  want = _truth(arrays, dtype, kw)
  with_jax_nn, padding_only = MASKS[mask_name][1:]
  if impl != "xla" or padding_only:
    assert_same_nonfinite(got, want, f"{impl} {poison} {mask_name}")
  else:
    assert _subset(want, got), f"xla misses a non-finite element the visible pairs give"
  if with_jax_nn and not padding:
    theirs = _run_jax_nn(arrays, dtype, kw)
    if mask_name == "none":  # the truth is jax.nn's pattern
      assert_same_nonfinite(theirs, want, f"jax.nn {poison}")
    # jax.nn adds masked-pair leaks (0 * NaN), never removes a NaN, except on
    # rows whose visible scores are all -inf: 0 / 0 = NaN here, while jax.nn
    # gives such a row that has masked keys the average of their values.
    zero_over_zero = np.isneginf(want[1])  # [B, N, T]
    if zero_over_zero.any():
      keep = ~np.transpose(zero_over_zero, (0, 2, 1))[..., None]
      want, got, theirs = ([np.where(keep, np.asarray(x[0], np.float64), 0)] for x in (want, got, theirs))
    assert _subset(want[:1] + want[2:], theirs[:1] + theirs[2:])
    if impl == "xla":
      assert _subset(got[:1] + got[2:], theirs[:1] + theirs[2:])
  return got, want


def _run_jax_nn(arrays, dtype, kw):
  q, k, v, do = (jnp.asarray(arrays[n], dtype) for n in ("q", "k", "v", "do"))
  f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
  with jax.default_matmul_precision("highest"):
    o, vjp = jax.vjp(f, q, k, v)
    return (o, None, *vjp(do))


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("impl", ["native", "xla"])
def test_nonfinite_inputs(rng, impl, poison, mask_name):
  check_case(rng, impl, poison, mask_name, jnp.float32)


@pytest.mark.parametrize("mask_name", ["causal", "window", "lengths"])
@pytest.mark.parametrize("poison", ["q_nan", "k_nan", "v_nan", "v_inf", "do_nan"])
def test_nonfinite_inputs_pallas_interpret(rng, poison, mask_name):
  check_case(rng, "pallas", poison, mask_name, jnp.float32)


@pytest.mark.parametrize("poison", ["q_nan", "v_nan", "v_neginf", "do_nan"])
def test_nonfinite_inputs_native_bfloat16(rng, poison):
  check_case(rng, "native", poison, "lengths_causal", jnp.bfloat16)


@pytest.mark.parametrize("impl", ["native", "pallas", "xla"])
@pytest.mark.parametrize("poison", ["q_nan", "k_nan", "v_nan", "v_inf", "do_nan"])
def test_padding_never_leaks(rng, impl, poison):
  """NaN or Inf past the sequence lengths changes nothing at all."""
  check_padding(rng, impl, poison, SHAPE, jnp.float32)


def check_padding(rng, impl, poison, shape, dtype, **extra):
  arrays = _inputs(rng, shape, dtype)
  kw = _mask_kwargs("lengths_causal", rng, *shape[:3])
  clean = _run(impl, dict(arrays), dtype, dict(kw, **extra))
  _poison(rng, arrays, poison, kw, padding=True)
  dirty = _run(impl, arrays, dtype, dict(kw, **extra))
  for name, a, b in zip(NAMES, clean, dirty):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=name)


@pytest.mark.parametrize("impl", ["native", "pallas", "xla"])
def test_nan_query_row_is_not_hidden(rng, impl):
  """The reported bug: a NaN in one query row came out as finite numbers."""
  q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 32)), jnp.float32) for _ in range(3))
  q = q.at[0, 10, 1, 3].set(jnp.nan)
  out, lse = jaxflash.dot_product_attention(q, k, v, implementation=impl, return_residual=True)
  bad = ~np.isfinite(np.asarray(out))
  assert bad[0, 10, 1].all() and bad.sum() == 32 and np.isnan(np.asarray(lse)[0, 10, 1])


@pytest.mark.parametrize("splits", [None, 2])
@pytest.mark.parametrize("impl", ["native", "pallas", "xla"])
def test_visible_scores_all_minus_inf_is_nan(impl, splits):
  """0 / 0: a row that sees keys whose scores are all -inf is NaN (jax.nn's
  dense softmax gives NaN too); a row that sees no key is zero. Split in two,
  the second split sees no key at all: it adds nothing, and the row stays
  0 / 0."""
  q = jnp.zeros((1, 4, 1, 8), jnp.float32).at[0, 1].set(1e30).at[0, 1, 0, 1:].set(0)
  k = jnp.zeros((1, 4, 1, 8), jnp.float32).at[:, :, :, 0].set(-1e30)
  v = jnp.ones((1, 4, 1, 8), jnp.float32)
  out, lse = jaxflash.dot_product_attention(
      q, k, v, implementation=impl, return_residual=True, residual_dtype=jnp.float32,
      query_seq_lengths=jnp.array([3]), num_splits=splits)
  out, lse = np.asarray(out), np.asarray(lse)
  assert np.isnan(out[0, 1]).all() and np.isneginf(lse[0, 1, 0])
  assert np.all(out[0, 3] == 0) and lse[0, 3, 0] == np.finfo(np.float32).min
  assert np.all(out[0, [0, 2]] == 1)


# ------------------------------------------------------------------ decode steps
# Short queries with GQA packing (the query heads of a K/V head stacked into
# one tile) and split-KV: the partials' row rules and their merge.

DECODE_SHAPE = (2, 3, 200, 8, 2, 16)  # q_len 3, 4 query heads per K/V head, several key tiles
DECODE_MASKS = ["none", "causal_bottom_right", "window", "lengths_causal"]


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("mask_name", DECODE_MASKS)
@pytest.mark.parametrize("poison", list(POISONS))
def test_nonfinite_decode_native(rng, poison, mask_name, splits):
  check_case(rng, "native", poison, mask_name, jnp.float32, DECODE_SHAPE, num_splits=splits)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mask_name", ["causal_bottom_right", "lengths_causal"])
@pytest.mark.parametrize("poison", ["q_nan", "k_nan", "v_nan", "v_inf", "k_neginf"])
def test_nonfinite_decode_pallas_interpret(rng, poison, mask_name, splits):
  check_case(rng, "pallas", poison, mask_name, jnp.float32, DECODE_SHAPE, num_splits=splits)


@pytest.mark.parametrize("impl", ["native", "pallas"])
@pytest.mark.parametrize("poison", ["q_nan", "k_nan", "v_nan"])
def test_padding_never_leaks_split(rng, impl, poison):
  check_padding(rng, impl, poison, DECODE_SHAPE, jnp.float32, num_splits=4)


@pytest.mark.parametrize("impl", ["native", "pallas"])
def test_minus_inf_scores_in_one_split_only(impl):
  """A split whose visible scores are all -inf weighs 0 in the merge: the row
  is the softmax over the other split's keys, finite, as unsplit."""
  B, S, D = 1, 256, 8
  q = jnp.zeros((B, 1, 2, D), jnp.float32).at[..., 0].set(1e30)
  k = jax.random.normal(jax.random.PRNGKey(0), (B, S, 1, D), jnp.float32)
  k = k.at[:, :128, :, 0].set(-1e30).at[:, 128:, :, 0].set(0)  # scores -inf, then finite
  v = jax.random.normal(jax.random.PRNGKey(1), (B, S, 1, D), jnp.float32)
  call = functools.partial(jaxflash.dot_product_attention, q, k, v, implementation=impl,
                           return_residual=True, residual_dtype=jnp.float32)
  out, lse = call(num_splits=2)
  want_o, want_lse = call(num_splits=1)
  assert np.all(np.isfinite(np.asarray(out))) and np.all(np.isfinite(np.asarray(lse)))
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_o), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6)


def _paged(arrays, page_size, rng):
  """K/V of `arrays` in shuffled pages of a pool with one spare page (last)."""
  B, S, K, D = arrays["k"].shape
  pages = -(-S // page_size)
  table = rng.permutation(B * pages).reshape(B, pages).astype(np.int32)
  pool = {}
  for name in ("k", "v"):
    x = np.pad(arrays[name], ((0, 0), (0, pages * page_size - S), (0, 0), (0, 0)))
    pool[name] = np.zeros((B * pages + 1, page_size, K, D))
    pool[name][table.reshape(-1)] = x.reshape(B * pages, page_size, K, D)
  return pool, table


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("poison", ["q_nan", "k_nan", "v_nan", "v_inf"])
def test_nonfinite_paged_native(rng, poison, splits):
  """paged_attention follows the row rules too: a poisoned element reaches
  exactly the rows that see it; a page in no table and the keys past
  kv_lengths reach nothing."""
  B, T, S, N, K, D = DECODE_SHAPE
  arrays = _inputs(rng, DECODE_SHAPE, jnp.float32)
  kv_lengths = rng.integers(T, S + 1, size=B).astype(np.int32)
  kv_lengths[0] = S - 7
  _poison(rng, arrays, poison, dict(key_value_seq_lengths=kv_lengths), padding=False)
  pool, table = _paged(arrays, 16, rng)
  pool["v"][-1] = np.nan  # the spare page
  for pos in range(kv_lengths[0], S):  # sequence 0's keys past its length
    pool["v"][table[0, pos // 16], pos % 16] = np.nan
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  out = jaxflash.paged_attention(f32(arrays["q"]), f32(pool["k"]), f32(pool["v"]),
                                 jnp.asarray(table), jnp.asarray(kv_lengths),
                                 implementation="native", num_splits=splits)
  truth = numpy_reference.exact(arrays["q"], arrays["k"], arrays["v"], arrays["do"],
                                scale=1 / np.sqrt(D), left=-1, right=0, bottom_right=True,
                                q_lengths=None, kv_lengths=kv_lengths)
  assert_same_nonfinite((out,), truth[:1], f"paged {poison}")


# ------------------------------------------------------------------ GPU
# The CUDA families (wgmma on Hopper, mma.sync forced with sm80=True, SIMT for
# float32) and the Pallas kernels on Triton, on shapes with several query and
# key tiles so that partly masked tiles occur; the NaN check in their
# epilogues and the exact recomputation are what is under test.

GPU_SHAPES = {64: (1, 150, 200, 4, 2, 64), 128: (1, 130, 170, 4, 2, 128)}
# The fast GPU tier poisons each tensor once, with NaN and both infinities among them.
FAST_POISONS = ["q_nan", "k_neginf", "v_inf", "do_nan"]
GPU_MASKS = ["none", "causal", "window", "lengths_causal", "causal_bottom_right"]
_ids = lambda x: getattr(x, "__name__", str(x))


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name", tiered(GPU_MASKS, ["causal", "window", "lengths_causal"]))
@pytest.mark.parametrize("poison", tiered(list(POISONS), FAST_POISONS))
@pytest.mark.parametrize("D", tiered([64, 128], [128]))
def test_nonfinite_cuda_tensor_cores(rng, D, poison, mask_name):
  check_case(rng, "native", poison, mask_name, jnp.bfloat16, GPU_SHAPES[D])


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name", ["causal", "window", "lengths_causal"])
@pytest.mark.parametrize("poison", tiered(["q_nan", "k_nan", "v_nan", "v_inf", "do_nan"],
                                           FAST_POISONS))
@pytest.mark.parametrize("dtype", tiered([jnp.bfloat16, jnp.float16], [jnp.bfloat16]), ids=_ids)
def test_nonfinite_cuda_sm80_family(rng, dtype, poison, mask_name):
  with _native.forced_tile(0, sm80=True):
    check_case(rng, "native", poison, mask_name, dtype, GPU_SHAPES[128])


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name", ["causal", "window", "lengths_causal"])
@pytest.mark.parametrize("poison", tiered(["q_nan", "k_nan", "v_nan", "v_inf", "do_nan"],
                                           FAST_POISONS))
@pytest.mark.parametrize("impl", ["native", "pallas"])
def test_nonfinite_gpu_float32_and_pallas(rng, impl, poison, mask_name):
  dtype = jnp.float32 if impl == "native" else jnp.bfloat16  # SIMT kernels; Triton
  check_case(rng, impl, poison, mask_name, dtype, GPU_SHAPES[64])


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["native", "pallas"])
@pytest.mark.parametrize("poison", ["q_nan", "k_nan", "v_nan", "do_nan"])
def test_padding_never_leaks_gpu(rng, impl, poison):
  arrays = _inputs(rng, GPU_SHAPES[64], jnp.bfloat16)
  kw = _mask_kwargs("lengths_causal", rng, *GPU_SHAPES[64][:3])
  clean = _run(impl, dict(arrays), jnp.bfloat16, kw)
  _poison(rng, arrays, poison, kw, padding=True)
  for name, a, b in zip(NAMES, clean, _run(impl, arrays, jnp.bfloat16, kw)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


# The persistent Hopper forward walks several work tiles per CTA, and its
# epilogue recomputes NaN entries per tile while the next tile's Q and the
# previous tile's store are in flight. These shapes give each of an H100's 132
# CTAs more than one tile at D 64: 3 x 32 heads x 2 row blocks of 256 rows
# for the causal pick up to 8k rows (four consumers). Tiles of one key tile
# (the first row blocks), empty ones (lengths), and poison in every head at
# keys that most tiles mask.
@pytest.mark.gpu
@pytest.mark.parametrize("mask_name", tiered(["causal", "lengths_causal", "window", "causal_bottom_right"],
                                             ["causal", "lengths_causal"]))
@pytest.mark.parametrize("poison", ["v_nan", "k_nan"])
def test_nonfinite_cuda_many_work_tiles(rng, poison, mask_name):
  B, T, S, N, K, D = shape = (3, 300, 300, 32, 4, 64)
  kw = _mask_kwargs(mask_name, rng, B, T, S)
  if "query_seq_lengths" in kw:
    kw["query_seq_lengths"][1] = 100  # the last row blocks of element 1 see no key: empty tiles
  arrays = _inputs(rng, shape, jnp.bfloat16)
  name, value = POISONS[poison]
  for key in (130, 200, T - 10):  # one element per batch element and K/V head at each
    arrays[name][:, key, :, int(rng.integers(D))] = value
  got = _run("native", arrays, jnp.bfloat16, kw)
  assert_same_nonfinite(got, _truth(arrays, jnp.bfloat16, kw), f"native {poison} {mask_name}")
  assert np.isnan(np.asarray(got[0], np.float32)).any()  # the poison reached some rows


# Decode steps on the GPU: the tensor-core decode kernel (16-row CTAs for a
# few packed rows, 64-row ones beyond), its epilogue's exact recomputation
# and the merge kernel; the Pallas decode kernel on Triton.
GPU_DECODE_SHAPES = {"rows4": (2, 1, 300, 8, 2, 128), "rows24": (2, 3, 300, 16, 2, 128)}


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("mask_name", tiered(DECODE_MASKS, ["causal_bottom_right", "lengths_causal"]))
@pytest.mark.parametrize("poison", tiered(list(POISONS), FAST_POISONS))
@pytest.mark.parametrize("rows", list(GPU_DECODE_SHAPES))
def test_nonfinite_cuda_decode(rng, rows, poison, mask_name, splits):
  check_case(rng, "native", poison, mask_name, jnp.bfloat16, GPU_DECODE_SHAPES[rows],
             num_splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("poison", ["q_nan", "k_nan", "v_nan", "v_inf"])
def test_nonfinite_pallas_decode_gpu(rng, poison, splits):
  check_case(rng, "pallas", poison, "causal_bottom_right", jnp.bfloat16,
             GPU_DECODE_SHAPES["rows24"], num_splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["native", "pallas"])
@pytest.mark.parametrize("poison", ["q_nan", "k_nan", "v_nan"])
def test_padding_never_leaks_split_gpu(rng, impl, poison):
  check_padding(rng, impl, poison, GPU_DECODE_SHAPES["rows24"], jnp.bfloat16, num_splits=4)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_name", ["causal", "window", "lengths_causal"])
@pytest.mark.parametrize("poison", tiered(list(POISONS), FAST_POISONS))
def test_nonfinite_cuda_fused_backward(rng, fused_backward, poison, mask_name):
  """The fused backward's dQ sums meet a masked pair's 0 * NaN too: the
  conversion recomputes such rows exactly, as the dQ kernel does."""
  check_case(rng, "native", poison, mask_name, jnp.bfloat16, GPU_SHAPES[128])
