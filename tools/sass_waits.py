"""Which instructions wait, and for what, from a kernel's SASS (no GPU needed):

    cuobjdump -sass -fun KERNEL build/.../bwd_d128.cu.o | python tools/sass_waits.py --from 2400 --to 2800

Every sm_70+ instruction carries control bits beside its encoding: the cycles the
scheduler stalls after issuing it, the variable-latency scoreboard (SB0-SB5) it sets when
its result is written (`wb`) or its sources are read (`rb`), and the scoreboards it waits
on before it issues. A wait is where a warp sits on the latency of a load, a shuffle or a
barrier query, so it explains a stall that ncu's source page pins on an innocent
instruction: in the fused D 128 backward an `@P0 FMUL` held 5.5% of the consumers' samples
because it waited on the scoreboard that six of the step's LSE loads and the ALiBi slope's
load shared (docs/performance-log.md, sixtieth session). Each printed line gives the
instruction's stall count, the scoreboards it sets and waits on, and for each wait the
instructions since the last wait on that scoreboard that set it.
"""

from __future__ import annotations

import argparse
import re
import sys

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]{16}) \*/")
HIGH = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
NONE = 7  # a scoreboard field of 7: none


def control(high: int) -> dict:
  """The control fields of an instruction's high 64-bit word."""
  c = high >> 41
  return {"stall": c & 0xF, "wb": (c >> 5) & 7, "rb": (c >> 8) & 7,
          "wait": [sb for sb in range(6) if (c >> (11 + sb)) & 1]}


def parse(text: str):
  """[(address, instruction, control)] from cuobjdump -sass output."""
  lines = text.splitlines()
  out = []
  for i, line in enumerate(lines[:-1]):
    m = LINE.search(line)
    h = HIGH.match(lines[i + 1])
    if m and h:
      out.append((int(m.group(1), 16), m.group(2).strip(), control(int(h.group(1), 16))))
  return out


def annotate(instructions):
  """Each instruction with, per scoreboard it waits on, the instructions that set it since the
  last wait on it (a scoreboard counts its writers: one wait covers them all), in address
  order: a branch is not followed, so at a loop's head the setters before its back edge are
  not listed. One kernel's listing (`cuobjdump -fun`): addresses start again per function."""
  pending = {sb: [] for sb in range(6)}
  rows = []
  for address, text, ctl in instructions:
    waits = {sb: pending[sb] for sb in ctl["wait"]}
    for sb in ctl["wait"]:
      pending[sb] = []
    rows.append((address, text, ctl, waits))
    opcode = " ".join(text.split()[:2 if text.startswith("@") else 1])  # with its predicate
    for field in ("wb", "rb"):
      if ctl[field] != NONE:
        pending[ctl[field]].append(f"{address:04x} {opcode}")
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("sass", nargs="?", help="cuobjdump -sass output (default: stdin)")
  ap.add_argument("--from", dest="lo", default="0", help="first address to print (hex)")
  ap.add_argument("--to", dest="hi", default="ffffffff", help="last address to print (hex)")
  ap.add_argument("--waits-only", action="store_true", help="print only instructions that wait")
  args = ap.parse_args(argv)
  text = open(args.sass).read() if args.sass else sys.stdin.read()
  lo, hi = int(args.lo, 16), int(args.hi, 16)
  for address, instruction, ctl, waits in annotate(parse(text)):
    if not lo <= address <= hi or (args.waits_only and not waits):
      continue
    sets = " ".join(f"{f}=SB{ctl[f]}" for f in ("wb", "rb") if ctl[f] != NONE)
    print(f"{address:04x}  stall {ctl['stall']:2d}  {sets:14s} {instruction}")
    for sb, setters in waits.items():
      print(f"{'':8s}waits on SB{sb}: {', '.join(setters) if setters else '(none since its last wait)'}")


if __name__ == "__main__":
  main()
