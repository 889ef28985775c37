"""jaxflash.flax: the attention_fn inside Flax's modules, the ready layers, the example."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest

flax = pytest.importorskip("flax")
pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import linen, nnx  # noqa: E402

import jaxflash.flax as jf  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_transformer.py"
F32_TOL = 2e-5


def _close(a, b, tol=F32_TOL, what=""):
  err = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0))
  assert err <= tol, f"{what}: max |diff| {err:.3g} > {tol:.3g}"


def _x(rng, *shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape), dtype)


def _stock_jax_nn(query, key, value, bias=None, mask=None, *, is_causal=False, dtype=None, **_):
  """The baseline attention_fn: jax.nn.dot_product_attention."""
  if mask is not None:
    mask = mask.astype(bool)
  return jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=is_causal)


def _window_mask(T, S, left, right, causal):
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  m = (j >= i - left) & (j <= i + right)
  if causal:
    m &= j <= i
  return jnp.asarray(m)[None, None]


def _padding(rng, B, T):
  lengths = rng.integers(1, T + 1, B)
  lengths[0] = T
  return lengths, jnp.asarray(np.arange(T)[None, :] < lengths[:, None])


# ------------------------------------------------------------------ packaging

def test_core_package_does_not_import_flax():
  code = "import sys, jaxflash; assert 'flax' not in sys.modules, 'flax imported'; print('ok')"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=str(pathlib.Path("/").resolve()))
  assert out.returncode == 0, out.stderr


def test_mask_folding():
  """Concrete all-true and exactly-causal masks become nothing / is_causal; others stay."""
  T = 7
  causal = nnx.make_causal_mask(jnp.ones((2, T)))              # float32 0/1, [2, 1, T, T]
  assert jf._prepare_mask(causal, T, T, False)[0] is None
  assert jf._prepare_mask(causal, T, T, False)[1] is True
  ones = jnp.ones((1, 1, T, T), jnp.float32)
  assert jf._prepare_mask(ones, T, T, False) == (None, False)
  other = causal.at[1, 0, 3, 0].set(0)
  m, c = jf._prepare_mask(other, T, T, False)
  assert c is False and m.dtype == np.bool_ and not m[1, 0, 3, 0] and m[0, 0, 3, 0]
  # Traced masks cannot be inspected: converted to bool, passed on.
  m = jax.jit(lambda m: jf._prepare_mask(m, T, T, False)[0])(causal)
  assert m.dtype == jnp.bool_ and (np.asarray(m) == np.asarray(causal != 0)).all()


# ------------------------------------------------------------------ attention_fn in Flax modules

@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nnx_attention_fn_causal_and_padding(rng, jit):
  B, T, D, N, K = 2, 19, 48, 6, 2
  x = _x(rng, B, T, D)
  lengths, valid = _padding(rng, B, T)
  stock = nnx.MultiHeadAttention(N, D, num_kv_heads=K, decode=False, rngs=nnx.Rngs(3))
  ours = nnx.MultiHeadAttention(N, D, num_kv_heads=K, decode=False, rngs=nnx.Rngs(3),
                                attention_fn=jf.dot_product_attention)
  causal = nnx.make_causal_mask(x[..., 0])
  padded = nnx.combine_masks(causal, nnx.make_attention_mask(valid, valid))
  call = (nnx.jit(lambda m, x, mask: m(x, mask=mask)) if jit
          else (lambda m, x, mask: m(x, mask=mask)))
  _close(call(ours, x, causal), call(stock, x, causal), what="causal mask")
  got, want = call(ours, x, padded), call(stock, x, padded)
  for b, n in enumerate(lengths):    # padded query rows differ by design (zeros vs average)
    _close(got[b, :n], want[b, :n], what="padding mask")
  # is_causal forwarded by nnx.MultiHeadAttention: no mask at all.
  _close(ours(x, is_causal=True), call(stock, x, causal), what="is_causal")


def test_linen_attention_fn_causal_and_padding(rng):
  B, T, D, N = 2, 23, 32, 4
  x = _x(rng, B, T, D)
  lengths, valid = _padding(rng, B, T)
  stock = linen.MultiHeadDotProductAttention(num_heads=N)
  ours = linen.MultiHeadDotProductAttention(num_heads=N, attention_fn=jf.dot_product_attention)
  params = stock.init(jax.random.key(0), x)
  causal = linen.make_causal_mask(x[..., 0])
  padded = linen.combine_masks(causal, linen.make_attention_mask(valid, valid))
  apply = jax.jit(lambda mod, p, x, mask: mod.apply(p, x, mask=mask), static_argnums=0)
  _close(apply(ours, params, x, causal), apply(stock, params, x, causal), what="causal")
  got, want = apply(ours, params, x, padded), apply(stock, params, x, padded)
  for b, n in enumerate(lengths):
    _close(got[b, :n], want[b, :n], what="padding")
  # Options fixed in the attention_fn: no mask needed.
  fixed = linen.MultiHeadDotProductAttention(
      num_heads=N, attention_fn=jf.make_attention_fn(is_causal=True))
  _close(apply(fixed, params, x, None), apply(stock, params, x, causal), what="make_attention_fn")


def test_attention_fn_extra_batch_dims_and_dtype(rng):
  q, k, v = _x(rng, 2, 3, 9, 4, 16), _x(rng, 2, 3, 11, 2, 16), _x(rng, 2, 3, 11, 2, 16)
  mask = jnp.asarray(rng.random((3, 1, 9, 11)) < 0.7)
  mask = mask.at[..., 0].set(True)
  # Flax folds the batch axes itself and needs the mask's batch axes spelled out.
  want = nnx.dot_product_attention(q, k, v, mask=jnp.broadcast_to(mask, (2, 3, 1, 9, 11)))
  _close(jf.dot_product_attention(q, k, v, mask=mask), want, what="rank 5")
  _close(jax.jit(jf.dot_product_attention)(q, k, v, mask=mask), want, what="rank 5 jit")
  out = jf.dot_product_attention(q, k, v, dtype=jnp.bfloat16, is_causal=True)
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape


def test_dropout_and_sow_weights_raise(rng):
  x = _x(rng, 2, 8, 16)
  layer = nnx.MultiHeadAttention(2, 16, decode=False, dropout_rate=0.1, rngs=nnx.Rngs(0),
                                 attention_fn=jf.dot_product_attention)
  with pytest.raises(ValueError, match="dropout"):
    layer(x, deterministic=False)
  layer(x, deterministic=True)    # no dropout asked: fine
  with pytest.raises(ValueError, match="dropout"):
    jf.MultiHeadAttention(2, 16, dropout_rate=0.1, rngs=nnx.Rngs(0))
  lin = linen.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1,
                                           attention_fn=jf.dot_product_attention)
  params = lin.init(jax.random.key(0), x, deterministic=True)
  with pytest.raises(ValueError, match="dropout"):
    lin.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  with pytest.raises(ValueError, match="sow"):
    layer(x, deterministic=True, sow_weights=True)


# ------------------------------------------------------------------ ready layers

@pytest.mark.parametrize("window", [None, (5, 0)], ids=["causal", "causal-window"])
def test_nnx_layer_matches_jax_nn_model(rng, window):
  B, T, D, N, K = 2, 33, 64, 8, 2
  x = _x(rng, B, T, D)
  ours = jf.MultiHeadAttention(N, D, num_kv_heads=K, decode=False, is_causal=True,
                               local_window_size=window, rngs=nnx.Rngs(7))
  stock = nnx.MultiHeadAttention(N, D, num_kv_heads=K, decode=False, rngs=nnx.Rngs(7),
                                 attention_fn=_stock_jax_nn)
  s_ours, s_stock = nnx.state(ours), nnx.state(stock)
  assert jax.tree.structure(s_ours) == jax.tree.structure(s_stock)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), s_ours, s_stock)
  mask = _window_mask(T, T, *(window or (T, T)), causal=True)
  _close(nnx.jit(lambda m, x: m(x))(ours, x), stock(x, mask=mask), what="forward")

  def loss(model, x, mask=None):
    return jnp.sum(jnp.sin(model(x) if mask is None else model(x, mask=mask)))

  g_ours = nnx.grad(loss)(ours, x)
  g_stock = nnx.grad(loss)(stock, x, mask)
  jax.tree.map(lambda a, b: _close(a, b, 1e-4, "grad"), nnx.state(g_ours), nnx.state(g_stock))
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(nnx.state(g_ours)))


def test_nnx_layer_bfloat16(rng):
  B, T, D, N, K = 2, 40, 64, 4, 4
  x = _x(rng, B, T, D)
  kw = dict(num_kv_heads=K, decode=False, dtype=jnp.bfloat16)
  ours = jf.MultiHeadAttention(N, D, is_causal=True, rngs=nnx.Rngs(1), **kw)
  stock = nnx.MultiHeadAttention(N, D, rngs=nnx.Rngs(1), attention_fn=_stock_jax_nn, **kw)
  truth = nnx.MultiHeadAttention(N, D, rngs=nnx.Rngs(1), attention_fn=_stock_jax_nn,
                                 num_kv_heads=K, decode=False)
  got, base = ours(x), stock(x, is_causal=True)
  assert got.dtype == jnp.bfloat16
  want = truth(x, is_causal=True)
  err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
  budget = 2 * float(jnp.max(jnp.abs(base.astype(jnp.float32) - want))) + 1e-3
  assert err <= budget, (err, budget)


def test_nnx_layer_decode_cache(rng):
  """Decode mode: the cache supplies causality; step-by-step equals the full causal pass."""
  B, T, D, N, K = 1, 6, 32, 4, 2
  x = _x(rng, B, T, D)
  layer = jf.MultiHeadAttention(N, D, num_kv_heads=K, is_causal=True, decode=False,
                                rngs=nnx.Rngs(0))
  full = layer(x)
  layer.init_cache((B, T, D))
  steps = [layer(x[:, t:t + 1], decode=True) for t in range(T)]
  _close(jnp.concatenate(steps, axis=1), full, what="decode")


def test_linen_layer_same_params_as_stock(rng):
  B, T, D, N = 2, 17, 32, 4
  x = _x(rng, B, T, D)
  stock = linen.MultiHeadDotProductAttention(num_heads=N)
  ours = jf.LinenMultiHeadAttention(num_heads=N, is_causal=True)
  p_stock = stock.init(jax.random.key(0), x)
  p_ours = ours.init(jax.random.key(0), x)
  shapes = lambda p: jax.tree.map(lambda a: (a.shape, a.dtype), p)   # noqa: E731
  assert shapes(p_stock) == shapes(p_ours)
  causal = linen.make_causal_mask(x[..., 0])
  _close(jax.jit(ours.apply)(p_stock, x), stock.apply(p_stock, x, mask=causal), what="linen")
  # Padding by lengths (fused kernels) equals the stock padding mask on valid rows.
  lengths, valid = _padding(rng, B, T)
  got = ours.apply(p_stock, x, query_seq_lengths=jnp.asarray(lengths),
                   key_value_seq_lengths=jnp.asarray(lengths))
  want = stock.apply(p_stock, x, mask=linen.combine_masks(
      causal, linen.make_attention_mask(valid, valid)))
  for b, n in enumerate(lengths):
    _close(got[b, :n], want[b, :n], what="lengths")


def test_linen_layer_gqa_window_against_manual(rng):
  B, T, D, N, K, window = 2, 29, 48, 6, 3, (4, 2)
  x = _x(rng, B, T, D)
  layer = jf.LinenMultiHeadAttention(num_heads=N, num_kv_heads=K, local_window_size=window)
  params = layer.init(jax.random.key(2), x)
  p = params["params"]
  assert p["key"]["kernel"].shape == (D, K, D // N)
  assert p["query"]["kernel"].shape == (D, N, D // N)

  def manual(p, x):
    proj = lambda name: jnp.einsum("btd,dnh->btnh", x, p[name]["kernel"]) + p[name]["bias"]  # noqa: E731
    o = jax.nn.dot_product_attention(proj("query"), proj("key"), proj("value"),
                                     mask=_window_mask(T, T, *window, causal=False))
    return jnp.einsum("btnh,nhd->btd", o, p["out"]["kernel"]) + p["out"]["bias"]

  _close(layer.apply(params, x), manual(p, x), what="forward")
  g = jax.grad(lambda p: jnp.sum(jnp.cos(layer.apply({"params": p}, x))))(p)
  g_ref = jax.grad(lambda p: jnp.sum(jnp.cos(manual(p, x))))(p)
  jax.tree.map(lambda a, b: _close(a, b, 1e-4, "grad"), g, g_ref)


def test_layers_take_the_soft_cap(rng):
  """logits_soft_cap on both layers: the capped scores of the float64 manual computation."""
  B, T, D, N = 2, 21, 32, 4
  x = _x(rng, B, T, D) * 3
  cap = 2.0
  linen_layer = jf.LinenMultiHeadAttention(num_heads=N, is_causal=True, logits_soft_cap=cap)
  params = linen_layer.init(jax.random.key(3), x)
  p = params["params"]

  def manual(p, x):
    proj = lambda name: jnp.einsum("btd,dnh->btnh", x, p[name]["kernel"]) + p[name]["bias"]  # noqa: E731
    q, k, v = proj("query"), proj("key"), proj("value")
    s = cap * jnp.tanh(jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(D // N) / cap)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    o = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)
    return jnp.einsum("btnh,nhd->btd", o, p["out"]["kernel"]) + p["out"]["bias"]

  _close(linen_layer.apply(params, x), manual(p, x), what="linen forward")
  nnx_layer = jf.MultiHeadAttention(N, D, is_causal=True, logits_soft_cap=cap, decode=False,
                                    rngs=nnx.Rngs(0))
  _, state = nnx.split(nnx_layer)
  nnx_params = {name: {"kernel": state[name]["kernel"][...], "bias": state[name]["bias"][...]}
                for name in ("query", "key", "value", "out")}
  _close(nnx_layer(x), manual(nnx_params, x), what="nnx forward")


def test_attention_fn_takes_alibi_slopes(rng):
  """make_attention_fn(alibi_slopes=...) in a stock nnx layer: ALiBi's bias on the scores of
  the manual computation."""
  B, T, D, N = 2, 21, 32, 4
  x = _x(rng, B, T, D)
  slopes = (2.0 ** -np.arange(1, N + 1)).astype(np.float32)
  layer = nnx.MultiHeadAttention(N, D, decode=False, rngs=nnx.Rngs(0),
                                 attention_fn=jf.make_attention_fn(is_causal=True,
                                                                   alibi_slopes=slopes))
  _, state = nnx.split(layer)
  p = {name: {"kernel": state[name]["kernel"][...], "bias": state[name]["bias"][...]}
       for name in ("query", "key", "value", "out")}
  proj = lambda name: jnp.einsum("btd,dnh->btnh", x, p[name]["kernel"]) + p[name]["bias"]  # noqa: E731
  s = jnp.einsum("btnh,bsnh->bnts", proj("query"), proj("key")) / np.sqrt(D // N)
  distance = np.abs(np.arange(T)[:, None] - np.arange(T)[None, :])
  s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s - slopes[:, None, None] * distance, -jnp.inf)
  o = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), proj("value"))
  _close(layer(x), jnp.einsum("btnh,nhd->btd", o, p["out"]["kernel"]) + p["out"]["bias"],
         what="nnx alibi")


def test_layers_take_segment_ids_at_call_time(rng):
  """Packed sequences: both layers given segment ids equal the documents run apart."""
  B, D, N = 2, 32, 4
  lengths = (7, 12, 5)
  x = _x(rng, B, sum(lengths), D)
  ids = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None].repeat(B, 0), jnp.int32)
  apart = lambda layer: jnp.concatenate(  # noqa: E731
      [layer(x[:, a:a + n]) for a, n in zip(np.cumsum((0,) + lengths[:-1]), lengths)], axis=1)
  linen_layer = jf.LinenMultiHeadAttention(num_heads=N, is_causal=True)
  params = linen_layer.init(jax.random.key(3), x)
  run = lambda y, **kw: linen_layer.apply(params, y, **kw)  # noqa: E731
  _close(run(x, query_segment_ids=ids), apart(run), what="linen packed")
  nnx_layer = jf.MultiHeadAttention(N, D, is_causal=True, decode=False, rngs=nnx.Rngs(0))
  _close(nnx_layer(x, query_segment_ids=ids), apart(nnx_layer), what="nnx packed")
  assert not np.allclose(np.asarray(nnx_layer(x)), np.asarray(apart(nnx_layer)), atol=1e-3)


# ------------------------------------------------------------------ the example, short

@pytest.fixture(scope="module")
def example():
  spec = importlib.util.spec_from_file_location("train_transformer", EXAMPLE)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod          # dataclasses look their module up there
  try:
    spec.loader.exec_module(mod)
    yield mod
  finally:
    sys.modules.pop(spec.name, None)


def _tiny(example, dtype, steps):
  data = example.CharData(example.make_corpus(20_000, seed=5))
  cfg = example.Config(vocab_size=data.vocab_size, seq_len=32, d_model=32, layers=2, heads=4,
                       kv_heads=2, dtype=dtype, batch=4, steps=steps, lr=3e-3, warmup=2)
  return cfg, data


def test_example_losses_agree_float32(example, tmp_path):
  cfg, data = _tiny(example, "float32", steps=12)
  m_flash, l_flash, _ = example.train(cfg, "jaxflash", data)
  m_jax, l_jax, _ = example.train(cfg, "jax", data)
  assert l_flash[-1] < l_flash[0] - 0.3, l_flash        # it learns
  np.testing.assert_allclose(l_flash, l_jax, rtol=1e-4, atol=1e-5)
  x, _ = next(data.batches(2, cfg.seq_len, 1))
  rt = example.checkpoint_round_trip(m_jax, cfg, jnp.asarray(x), str(tmp_path))
  assert rt["max_abs_logit_diff"] <= 1e-4 * max(1.0, rt["logit_scale"]), rt
  assert rt["max_abs_logit_back"] == 0.0 and rt["identical_files"], rt


def test_example_losses_agree_bfloat16(example):
  """bf16 loss curves: jaxflash is as close to the float32 run as jax.nn's own bf16 run is."""
  steps = 6
  cfg, data = _tiny(example, "bfloat16", steps)
  truth = example.train(_tiny(example, "float32", steps)[0], "jax", data)[1]
  l_flash = example.train(cfg, "jaxflash", data)[1]
  l_jax = example.train(cfg, "jax", data)[1]
  err = np.max(np.abs(l_flash - truth))
  budget = 2 * np.max(np.abs(l_jax - truth)) + 2e-2
  assert err <= budget, (l_flash, l_jax, truth)


def test_example_packed_documents_train_as_unpacked(example):
  """--pack: documents packed with segment ids give the losses of one document a padded row."""
  cfg, data = _tiny(example, "float32", steps=5)
  runs = example.train_packed(cfg, data, documents=3)
  packed, unpacked = runs["packed"][0], runs["unpacked"][0]
  assert packed[-1] < packed[0]
  np.testing.assert_allclose(packed, unpacked, rtol=1e-5, atol=1e-6)
