"""The list-scheduling model behind ffi/kernels/common/grid_order.cuh.

A grid-shaped kernel's CTAs start in the order of their linear index as SMs
free up. Under a causal mask the backward's key tile n is seen by about
(tiles - n) query tiles, so CTAs differ in work; this model times a launch as
greedy list scheduling (each CTA takes the slot that frees first; its time is
its query tiles plus a fixed cost of two) and prints the makespan over the
ideal (total work / slots) for the grid's order, for the chunked order of
grid_order.cuh, and for all CTAs heaviest first. A model, not a measurement:
docs/performance-log.md (sixteenth session) holds what the GPU did.

`--packed` models the warp-specialised forward's persistent walks
(sm90/tile_scheduler.cuh) on bench_packed.py's documents instead: a work tile's
cost is the key tiles it walks (D 128's 128 x 128 tile) plus two for its fixed
cost where a CTA claims a tile ahead, and it prints the busiest CTA's
work over the mean for the paired static walk (CTA c takes positions c, c +
ctas, ...) and for the dynamic walk (CTAs claim the next position: chunks of
heads, heads inner, row blocks last first or ranked heaviest first), chunks of
4-16 heads (forty-third and fiftieth sessions in the log). The kernel claims a
tile ahead (as each tile starts), which the first model left out: with it
the last-first walk came out near the measured imbalance.

    python tools/grid_order_model.py [--slots 132] [--chunk-ctas 256]
    python tools/grid_order_model.py --packed [--seq 8192 --docs 8 --heads 16 --seed 0]
"""

import argparse
import heapq
import os
import sys

import numpy as np


def makespan(work, slots):
  free = [0.0] * slots
  for w in work:
    heapq.heappush(free, heapq.heappop(free) + w)
  return max(free) / (sum(work) / slots)


def makespan_claimed_ahead(work, slots, fixed=0.0):
  """The dynamic walk's protocol (fwd_ws_kernel.cuh, WsWalk): CTA c starts
  with position c and claims its next position as it starts each tile, so it
  commits a tile ahead. `fixed`: a work tile's cost beside its key tiles."""
  queue = [[work[c]] if c < len(work) else [] for c in range(slots)]
  claimed, events, end = slots, [(0.0, c) for c in range(slots)], [0.0] * slots
  while events:
    t, c = heapq.heappop(events)
    if not queue[c]:
      end[c] = t
      continue
    w = queue[c].pop(0)
    if claimed < len(work):
      queue[c].append(work[claimed])
      claimed += 1
    heapq.heappush(events, (t + fixed + w, c))
  return max(end) / ((sum(work) + fixed * len(work)) / slots)


def orders(tiles, groups, heads_per_group, seq, chunk_ctas, key_tile=128, query_tile=64):
  weight = [heads_per_group * (seq - key_tile * n) // query_tile + 2 for n in range(tiles)]
  grid = [weight[n] for _ in range(groups) for n in range(tiles)]
  chunk = -(-chunk_ctas // tiles)
  chunked = [weight[n] for first in range(0, groups, chunk) for n in range(tiles)
             for _ in range(first, min(groups, first + chunk))]
  return grid, chunked, sorted(grid, reverse=True)


def packed_walks(seq, docs, heads, seed, ctas, rows=128, keys=128):
  """Busiest CTA over the mean, the paired static walk and the dynamic walk by chunk size."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
  from bench_packed import documents
  batch = max(1, 16384 // seq)
  ids, _ = documents(np.random.default_rng(seed), batch, seq, docs)
  blocks = seq // rows
  cost = np.zeros((batch, blocks))
  for b in range(batch):
    first = np.r_[0, np.flatnonzero(np.diff(ids[b])) + 1]   # each document's first position
    begin = first[np.searchsorted(first, np.arange(seq), side="right") - 1]   # causal, in-document
    for m in range(blocks):   # the work tile's rows walk from their first key tile to their diagonal's
      r0 = m * rows           # (the D 128 packed tile, 128 x 128: both consumers walk the tile's range)
      cost[b, m] = (r0 + rows - 1) // keys + 1 - begin[r0:r0 + rows].min() // keys
  groups = batch * heads
  # The paired walk (TileScheduler::Get): round r's unit (r / 2) * ctas + c, heavy then light.
  pairs = blocks // 2
  static = np.zeros(ctas)
  for index in range(2 * -(-pairs * groups // ctas) * ctas):
    rnd, c = divmod(index, ctas)
    unit = rnd // 2 * ctas + c
    if unit // pairs < groups:
      j = unit % pairs
      static[c] += cost[unit // pairs // heads, blocks - 1 - j if rnd % 2 == 0 else j]
  mean = cost.sum() * heads / ctas
  dynamic = {}
  last_first = [list(reversed(range(blocks)))] * batch
  ranked = [sorted(range(blocks), key=lambda m: (-cost[b, m], -m)) for b in range(batch)]  # RankRowBlocks
  for chunk in (4, 8, 16):
    walks = [[cost[g // heads, order[g // heads][r]] for first in range(0, groups, chunk) for r in range(blocks)
              for g in range(first, min(groups, first + chunk))] for order in (last_first, ranked)]
    dynamic[chunk] = (makespan(walks[0], ctas), makespan_claimed_ahead(walks[0], ctas, 2.0),
                      makespan_claimed_ahead(walks[1], ctas, 2.0))
  return static.max() / mean, dynamic


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--slots", type=int, default=132, help="CTAs running at once (SMs x CTAs per SM)")
  ap.add_argument("--chunk-ctas", type=int, default=256, help="grid_order.cuh's kChunkCtas")
  ap.add_argument("--packed", action="store_true", help="the forward's walks on packed documents")
  ap.add_argument("--seq", type=int, default=8192)
  ap.add_argument("--docs", type=int, default=8)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  if args.packed:
    static, dynamic = packed_walks(args.seq, args.docs, args.heads, args.seed, args.slots)
    print(f"forward, packed S {args.seq}, {args.docs} documents a row: busiest CTA / mean work: "
          f"paired static walk {static:.3f}; dynamic walk, chunks of 4 / 8 / 16 heads:")
    for i, name in enumerate(("row blocks last first, claimed as the CTA frees up",
                              "row blocks last first, claimed a tile ahead (the kernel's protocol)",
                              "row blocks heaviest first, claimed a tile ahead (the kernel's order)")):
      print(f"  {name}: " + " / ".join(f"{x[i]:.3f}" for x in dynamic.values()))
    return
  # The DESIGN.md §6 grid at D 128 (B·S = 16k tokens, 16 heads), then the GQA training shape.
  shapes = [(f"S {s}, B {16384 // s}, 16 heads", s, 16384 // s * 16, 1) for s in (1024, 2048, 4096, 8192, 16384)]
  shapes.append(("GQA: S 8192, B 2, 32 / 8 heads", 8192, 16, 4))
  print(f"{'causal backward, key tiles of 128':36s} {'grid':>6s} {'chunked':>8s} {'heavy first':>12s}")
  for name, seq, groups, per in shapes:
    spans = [makespan(o, args.slots) for o in orders(seq // 128, groups, per, seq, args.chunk_ctas)]
    print(f"{name:36s} " + " ".join(f"{x:{w}.3f}" for x, w in zip(spans, (6, 8, 12))))


if __name__ == "__main__":
  main()
