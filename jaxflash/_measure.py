"""Timing and memory measurement shared by `python -m jaxflash` and the benchmarks."""

from __future__ import annotations

import statistics
import time

import jax


def time_jitted(fn, args, reps: int = 10, repeats: int = 5) -> float:
  """Median seconds per call of a jitted `fn`: warm up, then `repeats` runs of
  `reps` back-to-back calls with one block each, so Python dispatch overlaps
  device work and only the device time shows."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / reps)
  return statistics.median(times)


def time_torch(fn, args, reps: int = 10, repeats: int = 5) -> float:
  """Median seconds per call of a torch function on the GPU (the benchmarks'
  torch peers), timed with CUDA events around `reps` back-to-back calls.
  torch is imported here only, so the package never needs it."""
  import torch
  fn(*args)
  torch.cuda.synchronize()
  times = []
  for _ in range(repeats):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
      fn(*args)
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3 / reps)
  return statistics.median(times)


def scratch_bytes(fn, args) -> int | None:
  """Temporary device memory XLA allocates for one call of jitted `fn` (beyond
  its arguments and outputs), from the compiled executable's memory analysis."""
  try:
    analysis = fn.lower(*args).compile().memory_analysis()
    return int(analysis.temp_size_in_bytes)
  except Exception:  # some backends give no analysis
    return None


def attention_flops(B, N, T, S, D, causal: bool, backward: bool) -> float:
  """DESIGN.md §6: forward 4·B·N·T·S·D (half for causal), backward 2.5x forward."""
  f = 4.0 * B * N * T * S * D * (0.5 if causal else 1.0)
  return f * (3.5 if backward else 1.0)
