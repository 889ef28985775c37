"""The per-device tile cache: lookups, staleness, bad files, and what the handlers accept."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _native, tile_cache, tune

H100 = "NVIDIA H100 80GB HBM3"
BUILD = "build-a"


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """A fresh cache file of this test and fresh warnings (the running build is BUILD)."""
  file = tmp_path / "tiles.json"
  monkeypatch.setenv(tile_cache.ENV, str(file))
  monkeypatch.setattr(tile_cache, "_warned", set())
  tile_cache._read_cached.cache_clear()
  return file


def entry(**kw):
  fields = dict(device=H100, build=BUILD, direction="fwd", head_dim=128, causal=False, tile=2)
  fields.update(kw)
  return tile_cache.Entry(**fields)


def test_path_follows_the_environment(tmp_path, monkeypatch):
  monkeypatch.setenv(tile_cache.ENV, "off")
  assert tile_cache.path() is None
  monkeypatch.setenv(tile_cache.ENV, str(tmp_path / "x.json"))
  assert tile_cache.path() == tmp_path / "x.json"
  monkeypatch.delenv(tile_cache.ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert tile_cache.path() == tmp_path / "jaxflash" / "tiles.json"


def test_buckets_follow_the_launchers():
  assert [tile_cache.bucket(d) for d in (8, 32, 40, 64, 80, 96, 112, 128, 160, 192, 256)] == [
      32, 32, 64, 64, 96, 96, 128, 128, 192, 192, 256]
  assert tile_cache.bucket(257) is None


def test_a_written_winner_is_a_preference_for_its_cell(cache):
  tile_cache.write([entry(), entry(direction="bwd", causal=True, tile=1)])
  assert tile_cache.lookup("fwd", 128, False, H100, lambda: BUILD) == tile_cache.TILE_PREFERRED + 2
  assert tile_cache.lookup("fwd", 112, False, H100, lambda: BUILD) == tile_cache.TILE_PREFERRED + 2  # same bucket
  assert tile_cache.lookup("bwd", 128, True, H100, lambda: BUILD) == tile_cache.TILE_PREFERRED + 1
  assert tile_cache.lookup("fwd", 128, True, H100, lambda: BUILD) == 0      # not measured: the table
  assert tile_cache.lookup("fwd", 64, False, H100, lambda: BUILD) == 0
  assert tile_cache.lookup("fwd", 128, False, "NVIDIA A100-SXM4-80GB", lambda: BUILD) == 0
  assert tile_cache.lookup("fwd", 512, False, H100, lambda: BUILD) == 0     # no bucket


def test_a_stale_cache_is_ignored_with_a_warning(cache):
  tile_cache.write([entry()])
  with pytest.warns(RuntimeWarning, match="another build"):
    assert tile_cache.lookup("fwd", 128, False, H100, lambda: "build-b") == 0


@pytest.mark.parametrize("text", [
    "{not json",
    json.dumps([1, 2]),
    json.dumps({"format": 99, "entries": []}),
    json.dumps({"format": 1, "entries": [{"device": H100}]}),
    json.dumps({"format": 1, "entries": [dict(vars(entry()), tile=0)]}),
    json.dumps({"format": 1, "entries": [dict(vars(entry()), tile="2")]}),
    json.dumps({"format": 1, "entries": [dict(vars(entry()), head_dim=100)]}),
    json.dumps({"format": 1, "entries": [dict(vars(entry()), direction="sideways")]}),
    json.dumps({"format": 1, "entries": [dict(vars(entry()), extra=1)]}),
], ids=["not-json", "not-an-object", "format", "missing-fields", "tile-0", "tile-str", "head-dim",
        "direction", "unknown-field"])
def test_a_bad_cache_file_is_ignored_with_a_warning(cache, text):
  cache.write_text(text)
  with pytest.warns(RuntimeWarning, match="ignoring the tile cache"):
    assert tile_cache.lookup("fwd", 128, False, H100, lambda: BUILD) == 0
  # ... once: later lookups stay quiet and keep answering.
  assert tile_cache.lookup("fwd", 128, False, H100, lambda: BUILD) == 0


def test_no_cache_file_means_the_table(cache):
  assert not cache.exists()
  assert tile_cache.lookup("fwd", 128, False, H100, lambda: BUILD) == 0


def test_writing_replaces_its_cells_and_the_stale_entries_of_its_device(cache):
  other = "NVIDIA A100-SXM4-80GB"
  tile_cache.write([entry(tile=1), entry(causal=True, tile=1), entry(device=other, build="old", tile=3)])
  tile_cache.write([entry(tile=2)])
  cells = {(e.device, e.causal): e.tile for e in tile_cache.read()}
  assert cells == {(H100, False): 2, (H100, True): 1, (other, False): 3}
  # A new build replaces every entry of its device, measured or not.
  tile_cache.write([entry(build="build-b", tile=1)])
  cells = {(e.device, e.causal, e.build): e.tile for e in tile_cache.read()}
  assert cells == {(H100, False, "build-b"): 1, (other, False, "old"): 3}


def test_an_unreadable_cache_is_replaced_on_write(cache):
  cache.write_text("garbage")
  tile_cache.write([entry()])
  assert [e.tile for e in tile_cache.read()] == [2]


def test_winner_is_the_best_geometric_mean_over_lengths():
  assert tune.winner([[100.0, 90.0], [50.0, 60.0]]) == (2, pytest.approx(np.sqrt(90 * 60)))
  # A candidate missing at one length does not compete.
  assert tune.winner([[10.0, 20.0, 99.0], [10.0, 20.0]])[0] == 2
  with pytest.raises(ValueError):
    tune.winner([[], [1.0]])


def test_the_handlers_accept_a_preferred_tile(monkeypatch, rng):
  """A cached preference reaches the FFI call and is accepted (the CPU kernels ignore tiles)."""
  monkeypatch.setattr(_native, "_forced_tile", tile_cache.TILE_PREFERRED + tile_cache.MAX_CANDIDATE)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 33, 2, 64)), jnp.float32) for _ in range(3))
  f = jax.jit(lambda q, k, v: jaxflash.dot_product_attention(q, k, v, implementation="native"))
  got = f(q, k, v)
  want = jaxflash.dot_product_attention(q, k, v, implementation="xla")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def run_with_tile(monkeypatch, tile, fn, *args):
  """fn(*args) jitted and traced with the FFI tile attribute `tile`, as NumPy arrays."""
  monkeypatch.setattr(_native, "_forced_tile", tile)
  return jax.tree.map(np.asarray, jax.jit(fn)(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_a_missing_preferred_candidate_falls_back_to_the_table(monkeypatch, rng, D, causal):
  """No cache content can make a call fail: a preference the build lacks means the table."""
  q, k, v = (jnp.asarray(rng.standard_normal((1, 200, 4, D)), jnp.bfloat16) for _ in range(3))
  # A forced tile runs the two-kernel backward; so must the table's run, or the
  # fused pass's dQ atomics (added in a varying order) differ in the last bit.
  monkeypatch.setenv("JAXFLASH_FUSED_BACKWARD", "0")

  loss = jax.value_and_grad(lambda q, k, v: jaxflash.dot_product_attention(
      q, k, v, is_causal=causal, implementation="native").astype(jnp.float32).sum(), argnums=(0, 1, 2))
  table = run_with_tile(monkeypatch, 0, loss, q, k, v)
  preferred = run_with_tile(monkeypatch, tile_cache.TILE_PREFERRED + tile_cache.MAX_CANDIDATE, loss, q, k, v)
  for a, b in zip(jax.tree.leaves(table), jax.tree.leaves(preferred)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_a_small_grid_keeps_its_own_tile_over_a_preference(monkeypatch, rng, causal):
  """A cached preference was measured on grids that fill the GPU: a grid of few work tiles
  (here 8 at D 64) takes the small-grid tile the table would, bit for bit, not the preference.
  The preference (candidate 3) walks 64-key tiles where the small-grid tile walks 128, so its
  online softmax rounds differently: were it run, the bits would differ."""
  q, k, v = (jnp.asarray(rng.standard_normal((1, 300, 4, 64)), jnp.bfloat16) for _ in range(3))

  attend = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, is_causal=causal, implementation="native")
  np.testing.assert_array_equal(run_with_tile(monkeypatch, 0, attend, q, k, v),
                                run_with_tile(monkeypatch, tile_cache.TILE_PREFERRED + 3, attend, q, k, v))
