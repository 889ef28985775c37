"""Where a kernel's instructions and stalls go, from Nsight Compute's per-instruction table.

    ncu --kernel-name-base demangled --kernel-name regex:WsBwdKernel --launch-skip 1 --launch-count 1 \
        --section SourceCounters -o ours python tools/profile_call.py --backward --fused --seq 8192
    ncu -i ours.ncu-rep --page source --csv --print-source sass > ours.csv
    python tools/sass_summary.py ours.csv [theirs.csv] [--rows 64 80]

A warp-specialised kernel's main loop runs every one of its instructions the same number of
times (once a warp a step), so the execution count that the most instruction executions share
picks out the loop; its instructions, by opcode, are "the step". With two tables (ours beside a
peer's kernel of the same call) the opcodes stand side by side, per step and, with `--rows`
(each kernel's query rows a step), per 64 rows, which is how the forty-fourth session found
the D 128 backward's per-step division (docs/performance-log.md). Then the instructions with
the most stall samples, where a step waits.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re


def read_table(path):
  """[(address, source, opcode, executions, stall samples)] of one ncu source page (CSV)."""
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  header_at = next(i for i, row in enumerate(rows) if "Source" in row and "Instructions Executed" in row)
  header = rows[header_at]
  source, executed = header.index("Source"), header.index("Instructions Executed")
  stalls = header.index("Warp Stall Sampling (All Samples)")
  table = []
  for row in rows[header_at + 1:]:
    try:
      count, samples = int(row[executed]), int(row[stalls])
    except (IndexError, ValueError):
      continue
    text = row[source].strip()
    opcode = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] if text else "?"
    table.append((row[0], text, opcode, count, samples))
  return table


def loop_count(table):
  """The execution count shared by the most instruction executions: the main loop's."""
  total = collections.Counter()
  for _, _, _, count, _ in table:
    total[count] += count
  return max(total, key=total.get)


def summary(path, table):
  count = loop_count(table)
  step = [entry for entry in table if entry[3] == count]
  executed = sum(entry[3] for entry in table)
  samples = sum(entry[4] for entry in table) or 1
  in_loop = sum(entry[4] for entry in step)
  print(f"{path}: {executed / 1e6:.1f} M instructions executed; the loop runs {count} times "
        f"({len(step)} instructions, {100 * len(step) * count / executed:.0f}% of those executed, "
        f"{100 * in_loop / samples:.0f}% of the stall samples)")
  return collections.Counter(entry[2] for entry in step), samples


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("tables", nargs="+", help="one or two CSVs of `ncu --page source --csv --print-source sass`")
  ap.add_argument("--rows", type=int, nargs="*", default=[], help="query rows a step of each kernel")
  ap.add_argument("--top", type=int, default=12, help="instructions listed by stall samples")
  args = ap.parse_args()
  if len(args.tables) > 2 or (args.rows and len(args.rows) != len(args.tables)):
    ap.error("one or two tables, and --rows one count per table")
  tables = [read_table(path) for path in args.tables]
  steps = [summary(path, table) for path, table in zip(args.tables, tables)]

  opcodes = sorted(set().union(*(s for s, _ in steps)), key=lambda o: -max(s[o] for s, _ in steps))
  scale = [64 / r for r in args.rows] if args.rows else None
  print(f"\n{'opcode':32s}" + "".join(f"{'step ' + str(i + 1):>10}" for i in range(len(steps))) +
        ("".join(f"{'/64 rows ' + str(i + 1):>13}" for i in range(len(steps))) if scale else ""))
  for opcode in opcodes + ["(all)"]:
    counts = [sum(s.values()) if opcode == "(all)" else s[opcode] for s, _ in steps]
    line = f"{opcode:32s}" + "".join(f"{c:>10d}" for c in counts)
    if scale:
      line += "".join(f"{c * f:>13.1f}" for c, f in zip(counts, scale))
    print(line)

  for path, table, (_, samples) in zip(args.tables, tables, steps):
    print(f"\n{path}: the {args.top} instructions with the most stall samples")
    for address, text, _, count, stall in sorted(table, key=lambda e: -e[4])[:args.top]:
      print(f"  {address[-6:]} {count:>10d} runs {100 * stall / samples:5.1f}%  {text[:70]}")


if __name__ == "__main__":
  main()
