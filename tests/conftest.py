"""Shared test setup: the gpu marker, fresh random seeds, tolerance rule."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_reference


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
  if HAS_GPU:
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def rng(request):
  """A fresh generator per test; JAXFLASH_TEST_SEED=<n> replays one."""
  seed = int(os.environ.get("JAXFLASH_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
  request.node.user_properties.append(("seed", seed))
  print(f"seed={seed}")
  return np.random.default_rng(seed)


def max_abs(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))


def assert_within_budget(actual, truth, baseline, name: str, slack: float = 2.0,
                         roundings: int = 0, dtype=None):
  """DESIGN.md §5: |actual - truth| <= 2 |baseline - truth| + a small absolute term.

  `baseline` is the `xla` implementation run in the input dtype; `truth` is
  float64. The absolute term is a few float32 ulps of the truth's magnitude,
  so exact-in-float32 baselines do not demand more than float32 can give.
  `roundings` adds that many half-ulps of `dtype` at the truth's magnitude:
  for results summed from kernel outputs that are each rounded to the input
  dtype first (ring attention's blocks).
  """
  actual = np.asarray(actual, np.float64)
  assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
  err = max_abs(actual, truth)
  scale = max(1.0, float(np.max(np.abs(truth), initial=0)))
  budget = slack * max_abs(baseline, truth) + 1e-5 * scale
  if roundings:
    budget += roundings * float(jnp.finfo(dtype).eps) / 2 * scale
  assert err <= budget, f"{name}: error {err:.3g} exceeds budget {budget:.3g}"


def random_inputs(rng, B, T, S, N, K, D, dtype, magnitude=1.0):
  import jax.numpy as jnp
  q = rng.standard_normal((B, T, N, D)) * magnitude
  k = rng.standard_normal((B, S, K, D)) * magnitude
  v = rng.standard_normal((B, S, K, D))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


__all__ = ["HAS_GPU", "assert_within_budget", "max_abs", "numpy_reference", "random_inputs"]
