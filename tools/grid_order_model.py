"""The list-scheduling model behind ffi/kernels/common/grid_order.cuh.

A grid-shaped kernel's CTAs start in the order of their linear index as SMs
free up. Under a causal mask the backward's key tile n is seen by about
(tiles - n) query tiles, so CTAs differ in work; this model times a launch as
greedy list scheduling (each CTA takes the slot that frees first; its time is
its query tiles plus a fixed cost of two) and prints the makespan over the
ideal (total work / slots) for the grid's order, for the chunked order of
grid_order.cuh, and for all CTAs heaviest first. A model, not a measurement:
docs/performance-log.md (sixteenth session) holds what the GPU did.

    python tools/grid_order_model.py [--slots 132] [--chunk-ctas 256]
"""

import argparse
import heapq


def makespan(work, slots):
  free = [0.0] * slots
  for w in work:
    heapq.heappush(free, heapq.heappop(free) + w)
  return max(free) / (sum(work) / slots)


def orders(tiles, groups, heads_per_group, seq, chunk_ctas, key_tile=128, query_tile=64):
  weight = [heads_per_group * (seq - key_tile * n) // query_tile + 2 for n in range(tiles)]
  grid = [weight[n] for _ in range(groups) for n in range(tiles)]
  chunk = -(-chunk_ctas // tiles)
  chunked = [weight[n] for first in range(0, groups, chunk) for n in range(tiles)
             for _ in range(first, min(groups, first + chunk))]
  return grid, chunked, sorted(grid, reverse=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--slots", type=int, default=132, help="CTAs running at once (SMs x CTAs per SM)")
  ap.add_argument("--chunk-ctas", type=int, default=256, help="grid_order.cuh's kChunkCtas")
  args = ap.parse_args()
  # The DESIGN.md §6 grid at D 128 (B·S = 16k tokens, 16 heads), then the GQA training shape.
  shapes = [(f"S {s}, B {16384 // s}, 16 heads", s, 16384 // s * 16, 1) for s in (1024, 2048, 4096, 8192, 16384)]
  shapes.append(("GQA: S 8192, B 2, 32 / 8 heads", 8192, 16, 4))
  print(f"{'causal backward, key tiles of 128':36s} {'grid':>6s} {'chunked':>8s} {'heavy first':>12s}")
  for name, seq, groups, per in shapes:
    spans = [makespan(o, args.slots) for o in orders(seq // 128, groups, per, seq, args.chunk_ctas)]
    print(f"{name:36s} " + " ".join(f"{x:{w}.3f}" for x, w in zip(spans, (6, 8, 12))))


if __name__ == "__main__":
  main()
