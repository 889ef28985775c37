"""tools/sass_waits.py on a stand-in of cuobjdump's SASS listing: the control bits decoded and
each wait traced to the instructions that set its scoreboard."""

import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(__file__), os.pardir, "tools", "sass_waits.py")


def listing(instructions):
  """cuobjdump -sass lines: (address, text, stall, write SB, read SB, waited SBs) each, with the
  control bits in the second 64-bit word (7: no scoreboard)."""
  lines = ["        Function : K", "        .headerflags    @\"EF_CUDA_SM90\""]
  for address, text, stall, wb, rb, waits in instructions:
    mask = sum(1 << sb for sb in waits)
    high = (stall | wb << 5 | rb << 8 | mask << 11) << 41
    lines.append(f"        /*{address:04x}*/                   {text} ;{' ' * 20}/* 0x{0x79c5:016x} */")
    lines.append(f"{' ' * 100}/* 0x{high:016x} */")
  return "\n".join(lines) + "\n"


def test_a_wait_names_the_loads_that_set_its_scoreboard(tmp_path):
  sass = tmp_path / "k.sass"
  sass.write_text(listing([
      (0x10, "LDS.64 R12, [R21+0x38000]", 4, 2, 7, []),
      (0x20, "LDS.64 R14, [R21+0x38020]", 4, 2, 7, []),
      (0x30, "@P0 LDG.E R153, desc[UR14][R16.64]", 2, 2, 7, []),
      (0x40, "S2R R3, SR_TID.X", 1, 4, 7, []),
      (0x50, "@P0 FMUL R225, R153, -1.4426950216293334961", 1, 7, 7, [2]),
      (0x60, "WARPGROUP.ARRIVE", 6, 7, 7, []),
      (0x70, "IMAD R0, R3, 0x4, RZ", 5, 7, 7, [4, 2]),
  ]))
  out = subprocess.run([sys.executable, TOOL, str(sass)], check=True, capture_output=True, text=True).stdout
  lines = out.splitlines()
  fmul = next(i for i, line in enumerate(lines) if "FMUL" in line)
  assert lines[fmul].split()[:3] == ["0050", "stall", "1"]
  assert lines[fmul + 1].strip() == "waits on SB2: 0010 LDS.64, 0020 LDS.64, 0030 @P0 LDG.E"
  assert "wb=SB4" in next(line for line in lines if "S2R" in line)
  imad = next(i for i, line in enumerate(lines) if "IMAD" in line)
  assert lines[imad + 1].strip() == "waits on SB2: (none since its last wait)"  # waited for at 0x50
  assert lines[imad + 2].strip() == "waits on SB4: 0040 S2R"
  ranged = subprocess.run([sys.executable, TOOL, str(sass), "--from", "40", "--to", "60", "--waits-only"],
                          check=True, capture_output=True, text=True).stdout
  assert [line.split()[0] for line in ranged.splitlines() if not line.startswith(" ")] == ["0050"]
