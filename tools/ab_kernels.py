"""Kernel times of two builds on one GPU, interleaved: a base build against this one.

    tools/ab_base.sh REV                                   # here: the base tree into ab_base/
    AB_KERNEL=WsBwdKernel AB_SHAPES="--seq 16384 --backward --fused;--seq 8192 --heads 32 \
        --kv-heads 8 --causal --backward --fused" tools/gpu_check.sh build ab   # on the GPU machine

The `ab` stage installs ab_base/ beside the installed package (pip --target) and runs this
script, which times every shape (tools/profile_call.py arguments) under
`ncu --clock-control none` in the order base, this, this, base: a card that drifts over a call
(clocks, heat) moves both builds alike, and the two runs of each build show how far it did. A
kernel A/B of a few percent measured "base first, then this" cannot tell that apart from a
change (docs/performance-log.md, twenty-third session). One line per shape: each build's mean over
its launches and both runs, the change, and each build's two runs. Without `--kernel` it
times the whole call instead, as the benchmarks do (profile_call.py `--time`, no ncu): the
A/B for a launch-bound shape such as the latency shape, `--batch 1 --heads 8 --seq 512
--head-dim 64`, where dispatch and launch are most of the time.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys
from statistics import fmean as mean

HERE = os.path.dirname(os.path.abspath(__file__))


def run_outside(cmd, pythonpath):
  """Runs `cmd` from outside the checkout, so the installed package is the one imported, or
  the base build's when `pythonpath` names it."""
  env = dict(os.environ)
  if pythonpath:
    env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True)


def kernel_times(shape, kernel, launches, pythonpath):
  """Durations (µs) of `launches` launches of the kernels matching `kernel` in one call
  of profile_call.py at `shape` (its first call, compiling, skipped)."""
  cmd = ["ncu", "--clock-control", "none", "--kernel-name", f"regex:{kernel}", "--launch-skip", "1",
         "--launch-count", str(launches), "--csv", "--metrics", "gpu__time_duration.sum",
         sys.executable, os.path.join(HERE, "profile_call.py"), "--calls", str(launches + 1), *shape.split()]
  run = run_outside(cmd, pythonpath)
  out = run.stdout
  # The profiled program's own lines come before ncu's table; the table starts at its header.
  rows = list(csv.reader(io.StringIO("".join(l for l in out.splitlines(True) if not l.startswith("==")))))
  header = next((i for i, r in enumerate(rows) if "Metric Name" in r), len(rows))
  col = {name: i for i, name in enumerate(rows[header])} if header < len(rows) else {}
  timed = [r for r in rows[header + 1:]
           if len(r) == len(col) and r[col["Metric Name"]] == "gpu__time_duration.sum"]
  if not timed:
    tail = (run.stdout + run.stderr).strip()[-600:]
    raise RuntimeError(f"ncu timed no launch of {kernel!r} at {shape!r} (is the kernel name right?):\n{tail}")
  scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
  return [float(r[col["Metric Value"]].replace(",", "")) * scale.get(r[col["Metric Unit"]], 1e-3)
          for r in timed]


def call_time(shape, pythonpath):
  """Median µs a call at `shape` as the benchmarks time it (profile_call.py --time)."""
  out = run_outside([sys.executable, os.path.join(HERE, "profile_call.py"), "--time", *shape.split()],
                    pythonpath)
  timed = [l for l in out.stdout.splitlines() if l.startswith("call_us=")]
  if not timed:
    raise RuntimeError(f"no call time at {shape!r}: {out.stderr.strip()[-400:]}")
  return float(timed[0].split("=")[1])


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--base-path", required=True, help="where the base build is installed (pip --target)")
  ap.add_argument("--kernel", default="",
                  help="ncu kernel-name regex, e.g. WsFwdKernel (none: the harness's call time)")
  ap.add_argument("--shapes", required=True, help="profile_call.py argument sets, separated by ';'")
  ap.add_argument("--launches", type=int, default=2, help="launches timed per run")
  args = ap.parse_args()
  if args.kernel:
    print(f"kernel {args.kernel}, {args.launches} launches a run, order base / this / this / base (µs)")
    measure = lambda shape, path: mean(kernel_times(shape, args.kernel, args.launches, path))
  else:
    print("the harness's call time (median of 5 x 10 calls), order base / this / this / base (µs)")
    measure = call_time
  print("| shape | base | this | change | base runs | this runs |")
  print("|---|---|---|---|---|---|")
  for shape in (s.strip() for s in args.shapes.split(";") if s.strip()):
    runs = {"base": [], "this": []}
    for build in ("base", "this", "this", "base"):
      runs[build].append(measure(shape, args.base_path if build == "base" else None))
    base, this = mean(runs["base"]), mean(runs["this"])
    print(f"| {shape} | {base:.1f} | {this:.1f} | {100 * (this / base - 1):+.1f}% | "
          f"{' / '.join(f'{t:.1f}' for t in runs['base'])} | {' / '.join(f'{t:.1f}' for t in runs['this'])} |",
          flush=True)


if __name__ == "__main__":
  main()
