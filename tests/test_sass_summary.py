"""tools/sass_summary.py on a stand-in of ncu's per-instruction table: the main loop found by
its execution count, its opcodes per step and per 64 rows, and the stalls listed."""

import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(__file__), os.pardir, "tools", "sass_summary.py")
HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"# Samples","Instructions Executed"')


def write_table(path, loop_runs, loop, other):
  """A table as `ncu --page source --csv --print-source sass` writes it: a kernel line, the
  header, then one row per instruction (loop instructions run loop_runs times)."""
  lines = ['"Kernel Name","void K(P)"', HEADER]
  for i, (text, stalls) in enumerate(loop):
    lines.append(f'"0x{i:05x}","      {text}","{stalls}","0","0","{loop_runs}"')
  for i, (text, runs) in enumerate(other):
    lines.append(f'"0x{0x1000 + i:05x}","      {text}","1","0","0","{runs}"')
  path.write_text("\n".join(lines) + "\n")


def test_the_loop_and_its_opcodes_side_by_side(tmp_path):
  ours, theirs = tmp_path / "ours.csv", tmp_path / "theirs.csv"
  write_table(ours, 1000, [("HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], RZ", 50), ("I2F.RP R0, R7", 30),
                           ("@!P0 IMAD R1, R2, R3, RZ", 5), ("IMAD R4, R2, R3, RZ", 2)],
              # a spin loop runs more often, but fewer instructions: not the loop
              [("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R0], R2", 1500), ("EXIT", 8)])
  write_table(theirs, 800, [("HGMMA.64x80x16.F32.BF16 R0, gdesc[UR4], RZ", 60),
                            ("HGMMA.64x80x16.F32.BF16 R0, gdesc[UR4], R0", 10)], [("EXIT", 8)])
  out = subprocess.run([sys.executable, TOOL, str(ours), str(theirs), "--rows", "64", "80", "--top", "2"],
                       check=True, capture_output=True, text=True).stdout
  assert "the loop runs 1000 times (4 instructions" in out
  assert "the loop runs 800 times (2 instructions" in out
  rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line and not line.startswith(("/", " "))}
  assert rows["IMAD"] == ["2", "0", "2.0", "0.0"]  # the predicated one counted with its opcode
  assert rows["HGMMA.64x80x16.F32.BF16"] == ["0", "2", "0.0", "1.6"]  # 2 a step of 80 rows
  assert rows["(all)"] == ["4", "2", "4.0", "1.6"]
  stalls = out.split("the 2 instructions with the most stall samples")[1]
  assert stalls.index("HGMMA") < stalls.index("I2F.RP")


def test_refuses_rows_that_do_not_match_the_tables(tmp_path):
  ours = tmp_path / "ours.csv"
  write_table(ours, 10, [("EXIT", 1)], [])
  run = subprocess.run([sys.executable, TOOL, str(ours), "--rows", "64", "80"], capture_output=True, text=True)
  assert run.returncode != 0 and "--rows one count per table" in run.stderr
