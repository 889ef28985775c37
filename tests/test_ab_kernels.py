"""tools/ab_kernels.py (stage `ab` of tools/gpu_check.sh) against a stand-in ncu: the order of
the runs, the PYTHONPATH of the base build, ncu's CSV read in its units, and the table."""

import os
import subprocess
import sys
import textwrap

TOOL = os.path.join(os.path.dirname(__file__), os.pardir, "tools", "ab_kernels.py")

# Prints what `ncu --csv --metrics gpu__time_duration.sum` prints for `--launch-count` launches
# (a base build 100 µs a launch, this one 90 µs, in nanoseconds), and logs which build it ran.
FAKE_NCU = textwrap.dedent("""\
    #!{python}
    import os, sys
    args = sys.argv[1:]
    base = "BASE_BUILD" in os.environ.get("PYTHONPATH", "")
    with open(os.environ["AB_TEST_LOG"], "a") as f:
      f.write(("base" if base else "this") + " " + " ".join(args[args.index("--calls") + 2:]) + "\\n")
    print("==PROF== Connected to process 1")
    print("ran native B=8 S=2048 H=8/8 D=256 causal=False")  # the profiled program's own line
    print('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    for i in range(int(args[args.index("--launch-count") + 1])):
      ns = (100000 if base else 90000) + 1000 * i
      print(f'"{{i}}","1","python3","127.0.0.1","void WsFwdKernel<T>(P)","1","7","(384, 1, 1)",'
            f'"(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum",'
            f'"nsecond","{{ns:,}}"')
""")


def test_ab_kernels_interleaves_and_reports(tmp_path):
  ncu = tmp_path / "ncu"
  ncu.write_text(FAKE_NCU.format(python=sys.executable))
  ncu.chmod(0o755)
  log = tmp_path / "runs.log"
  env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", AB_TEST_LOG=str(log))
  out = subprocess.run([sys.executable, TOOL, "--base-path", "/nowhere/BASE_BUILD", "--kernel", "WsFwdKernel",
                        "--shapes", "--seq 1024 --head-dim 64; --seq 2048 --causal", "--launches", "2"],
                       env=env, capture_output=True, text=True, check=True).stdout
  runs = log.read_text().splitlines()
  assert runs == ["base --seq 1024 --head-dim 64", "this --seq 1024 --head-dim 64",
                  "this --seq 1024 --head-dim 64", "base --seq 1024 --head-dim 64",
                  "base --seq 2048 --causal", "this --seq 2048 --causal",
                  "this --seq 2048 --causal", "base --seq 2048 --causal"]
  rows = [l for l in out.splitlines() if l.startswith("| --seq")]
  # Two launches a run: 100.0 and 101.0 µs (base), 90.0 and 91.0 (this).
  assert rows == ["| --seq 1024 --head-dim 64 | 100.5 | 90.5 | -10.0% | 100.5 / 100.5 | 90.5 / 90.5 |",
                  "| --seq 2048 --causal | 100.5 | 90.5 | -10.0% | 100.5 / 100.5 | 90.5 / 90.5 |"]


def test_ab_kernels_names_a_kernel_it_did_not_find(tmp_path):
  ncu = tmp_path / "ncu"
  ncu.write_text(f"#!{sys.executable}\nprint('==PROF== No kernels were profiled.')\n")
  ncu.chmod(0o755)
  env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  r = subprocess.run([sys.executable, TOOL, "--base-path", "/nowhere", "--kernel", "NoSuchKernel",
                      "--shapes", "--seq 1024"], env=env, capture_output=True, text=True)
  assert r.returncode != 0 and "NoSuchKernel" in r.stderr


def test_ab_call_time_runs_the_real_call_interleaved():
  # Without --kernel: the whole call timed by profile_call.py --time (here on the CPU kernels;
  # the base path names no build, so both sides import the installed package).
  out = subprocess.run([sys.executable, TOOL, "--base-path", "/nowhere", "--shapes",
                        "--batch 1 --heads 2 --seq 128 --head-dim 64"],
                       capture_output=True, text=True, check=True).stdout
  assert "call time" in out
  row = [l for l in out.splitlines() if l.startswith("| --batch")]
  assert len(row) == 1
  cells = [c.strip() for c in row[0].strip("|").split("|")]
  base, this = float(cells[1]), float(cells[2])
  assert base > 0 and this > 0
  assert len(cells[4].split(" / ")) == 2 and len(cells[5].split(" / ")) == 2
