"""Shared test setup: the gpu marker, fresh random seeds, tolerance rule."""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import os
import shutil
import tempfile

# The GPU tests compile hundreds of small XLA programs (baselines, gradients,
# references); autotuning each one's GEMMs and fusions cost seconds per program
# under eight test processes and changes no tested result (XLA's baselines only
# set error budgets). Set before jax creates a backend.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
# Without a CUDA build of jaxlib (the CPU suite, CI), XLA's own programs compile
# with LLVM's optimisations off: the suite's programs are small, compiling
# them is most of its time and running them little (test_native's forward and
# gradient checks 114 -> 75 s on a 2-core machine); the native kernels are
# built ahead and unaffected, and no float semantics change (fast math stays off).
_CUDA_JAXLIB = any((d.metadata["Name"] or "").lower().replace("_", "-").startswith("jax-cuda")
                   for d in importlib.metadata.distributions())
if not _CUDA_JAXLIB:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# JAX takes 75% of a GPU's memory for its pool when it starts, which several
# test processes (pytest -n) cannot all do: under -n 16 on an H200 all 20 GPU
# segment tests failed in 34 s (one of them runs no attention kernel); with
# pools grown as needed, none of those that finished failed. Each process
# grows its pool as needed, unless told otherwise.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax

# The CPU suite compiles many XLA programs identical to one compiled before,
# under a new function each time: the Pallas wrappers build their kernels per
# call (an interpreted kernel compiles in ~1 s, whatever its shapes), and
# tests rebuild closures per case. JAX's compilation cache, kept for one run
# (shared by the xdist workers and the child processes, removed at the end),
# loads those instead of compiling them again. Loading an executable changes
# nothing it computes. JAXFLASH_TEST_COMPILE_CACHE=off compiles everything.
if not _CUDA_JAXLIB and os.environ.get("JAXFLASH_TEST_COMPILE_CACHE") != "off":
  if not os.environ.get("JAXFLASH_TEST_COMPILE_CACHE"):
    os.environ["JAXFLASH_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="jaxflash-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXFLASH_TEST_COMPILE_CACHE"], ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", os.environ["JAXFLASH_TEST_COMPILE_CACHE"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_reference

# Tests see the built-in tile tables, never a tile cache the machine happens to
# have (test_tile_cache.py points the cache at its own files).
os.environ["JAXFLASH_TILE_CACHE"] = "off"


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


HAS_GPU = _has_gpu()


def pytest_runtest_logreport(report):
  """With JAXFLASH_TEST_TIMES=<file>, one line per finished test (seconds,
  outcome, id), written as it finishes: a tier stopped at its time limit
  still says where its time went (pytest's --durations prints only at the end)."""
  path = os.environ.get("JAXFLASH_TEST_TIMES")
  # Under xdist both the worker and the controller see each report: only the
  # controller (no PYTEST_XDIST_WORKER) writes, once per test.
  if path and report.when == "call" and "PYTEST_XDIST_WORKER" not in os.environ:
    with open(path, "a") as f:
      f.write(f"{report.duration:8.2f} {report.outcome:7s} {report.nodeid}\n")


# Tests of several minutes each, started first: the 8-device sharding child (~315 s
# on a 2-core machine) collected in file order began last and ran alone for the
# suite's final ~170 s under `-n 2`.
_START_FIRST = ("test_sharding.py::test_on_8_cpu_devices",)


def pytest_collection_modifyitems(config, items):
  items.sort(key=lambda item: not item.nodeid.endswith(_START_FIRST))  # stable: the rest keep their order
  if HAS_GPU:
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def fused_backward(monkeypatch):
  """Native backward calls traced in the test leave room for the fused Hopper
  backward's dQ sums (JAXFLASH_FUSED_BACKWARD=1); skips where it would not run
  (not an sm90 GPU)."""
  from jaxflash import _native
  monkeypatch.setenv("JAXFLASH_FUSED_BACKWARD", "1")
  if (jax.devices()[0].platform != "gpu" or
      not _native.dq_sums_room(jnp.bfloat16, (1, 64, 2, 128), (1, 64, 2, 128), False)):
    pytest.skip("the fused backward runs on sm90 GPUs")


@pytest.fixture
def rng(request):
  """A fresh generator per test; JAXFLASH_TEST_SEED=<n> replays one."""
  seed = int(os.environ.get("JAXFLASH_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
  request.node.user_properties.append(("seed", seed))
  print(f"seed={seed}")
  return np.random.default_rng(seed)


def tiered(values, fast):
  """`values` as parametrize arguments, each one not in `fast` marked `slow`.

  The GPU suite runs in two tiers: `-m "gpu and not slow"` covers every
  family, dtype and mask at least once and must stay under five minutes on an
  H100 with -n 8; `-m "gpu and slow"` is the rest of the sweep. Marks of
  several parametrize axes add up, so a test is fast only where every axis is.
  """
  return [v if any(v is f or v == f for f in fast) else pytest.param(v, marks=pytest.mark.slow)
          for v in values]


def diagonal(rows, columns):
  """Parametrize arguments for each pair of `rows` x `columns` (each a tuple, or a single
  value), the pair (row i, column i mod len(columns)) of the fast tier and the rest `slow`:
  every row and, with at least as many rows as columns, every column once in the fast tier."""
  as_tuple = lambda x: x if isinstance(x, tuple) else (x,)
  return [pytest.param(*as_tuple(row), *as_tuple(column),
                       marks=() if i % len(columns) == j else pytest.mark.slow)
          for i, row in enumerate(rows) for j, column in enumerate(columns)]


def max_abs(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))


def assert_within_budget(actual, truth, baseline, name: str, slack: float = 2.0,
                         max_logit: float = 0.0, roundings: int = 0, magnitude: float = 0.0):
  """DESIGN.md §5: |actual - truth| <= 2 |baseline - truth| + a small absolute term.

  `baseline` is the `xla` implementation run in the input dtype; `truth` is
  float64. The absolute term is a few float32 ulps of the truth's magnitude,
  so exact-in-float32 baselines do not demand more than float32 can give,
  plus half an ulp of `actual`'s own dtype when that is a 16-bit one: no
  kernel beats the rounding of its output, though on a handful of elements a
  baseline may land closer by luck. `max_logit` (the largest |scaled score|)
  widens it by the conditioning of exp: a float32 score of magnitude x
  carries an error of x ulps, which no float32 kernel avoids, though a
  baseline may by luck (a power-of-two scale multiplies exactly; a kernel
  folding log2(e) into it does not). `roundings` adds that many further
  half-ulps of `actual`'s dtype: for results summed from kernel outputs that
  are each rounded to that dtype first (ring attention's blocks).
  `magnitude` raises the scale of the absolute term above the truth's own:
  the gradients of one call come from the same products, so one whose truth
  is 0 by cancellation (dK with a single key: dP - delta) still carries
  float32 rounding at the size of its siblings.
  """
  dtype = np.dtype(getattr(actual, "dtype", np.float64))
  rounding = float(jnp_finfo_eps(dtype)) / 2 if dtype.itemsize < 4 else 0.0
  actual = np.asarray(actual, np.float64)
  assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
  err = max_abs(actual, truth)
  absolute = (1e-5 + rounding + 4 * float(np.finfo(np.float32).eps) * max_logit
              + roundings * float(jnp_finfo_eps(dtype)) / 2)
  size = max(1.0, magnitude, float(np.max(np.abs(truth), initial=0)))
  budget = slack * max_abs(baseline, truth) + absolute * size
  assert err <= budget, f"{name}: error {err:.3g} exceeds budget {budget:.3g}"


def jnp_finfo_eps(dtype) -> float:
  import jax.numpy as jnp
  return float(jnp.finfo(dtype).eps)


def random_inputs(rng, B, T, S, N, K, D, dtype, magnitude=1.0):
  import jax.numpy as jnp
  q = rng.standard_normal((B, T, N, D)) * magnitude
  k = rng.standard_normal((B, S, K, D)) * magnitude
  v = rng.standard_normal((B, S, K, D))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def value_width_case(rng, B, T, S, N, K, dqk, dv, dtype, **kw):
  """An MLA-style call, the value's head dim `dv` its own: its inputs (q, k, v and an output
  cotangent do) and, jitted, run(q, k, v, implementation) -> (o, lse) and
  grads(q, k, v, implementation) -> (dq, dk, dv) of sum(o * do), with the keywords `kw`."""
  import jaxflash
  shapes = ((B, T, N, dqk), (B, S, K, dqk), (B, S, K, dv), (B, T, N, dv))
  q, k, v, do = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes)

  @functools.partial(jax.jit, static_argnames="implementation")
  def run(q, k, v, implementation):
    return jaxflash.dot_product_attention(q, k, v, implementation=implementation, return_residual=True,
                                          residual_dtype=jnp.float32, **kw)

  @functools.partial(jax.jit, static_argnames="implementation")
  def grads(q, k, v, implementation):
    loss = lambda q, k, v: jnp.sum(run(q, k, v, implementation)[0].astype(jnp.float32) * do.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  return (q, k, v, do), run, grads


def check_value_width_case(case, implementation):
  """Output, LSE and every gradient of a value_width_case through `implementation` against
  float64 (xla) under the tolerance rule, the baseline xla in the inputs' dtype."""
  (q, k, v, _), run, grads = case
  f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
  with jax.enable_x64(True):
    truth = run(f64(q), f64(k), f64(v), "xla")
    truth_grads = grads(f64(q), f64(k), f64(v), "xla")
  out, lse = run(q, k, v, implementation)
  assert out.shape == q.shape[:-1] + v.shape[-1:] and lse.shape == q.shape[:-1]
  base, base_lse = run(q, k, v, "xla")
  assert_within_budget(out, truth[0], base, "o")
  assert_within_budget(lse, truth[1], base_lse, "lse")
  for name, g, t, b in zip("qkv", grads(q, k, v, implementation), truth_grads, grads(q, k, v, "xla")):
    assert g.shape == t.shape
    assert_within_budget(g, t, b, f"d{name}")


def v_operand(hlo: str, target: str) -> str:
  """The type of the v operand (the third) of the one traced call of FFI `target` in `hlo`."""
  call, = [line for line in hlo.splitlines() if target in line]
  return call.split(" : (")[1].split(")")[0].split(", ")[2]


__all__ = ["HAS_GPU", "assert_within_budget", "check_value_width_case", "max_abs", "numpy_reference",
           "random_inputs", "tiered", "v_operand", "value_width_case"]
