"""Measure the compiled tile candidates on this GPU and keep the winners in the tile cache.

    python -m jaxflash.tune                        # D in {64, 128, 256}, S in {4k, 16k}, fwd and bwd
    python -m jaxflash.tune --head-dims 128 --seqs 16384 --direction fwd --no-write
    python -m jaxflash.tune --orders               # which implementation implementation=None runs

Every head-dim bucket of the CUDA tensor-core kernels compiles a few tile shapes
(FwdCandidates in ffi/kernels/sm80/fwd_kernel.cuh and ffi/kernels/sm90/fwd_launch.cuh,
BwdCandidates in ffi/kernels/sm90/bwd_kernel.cuh; the sm80 backward has one shape per
bucket), and the launchers pick one from a table measured on an H100. This forces each
candidate in turn (1-based; `jaxflash._native.forced_tile`), times it on the DESIGN.md §6
grid's shapes (bf16, B*S = 16384 tokens, H*D = 2048), prints TFLOP/s per candidate, and
writes the winner of each (direction, D, causal) over the sequence lengths (best geometric
mean) to the per-device tile cache (jaxflash/tile_cache.py), which later native calls on a
GPU of the same kind read when they are traced. "fwd" times the forward; "bwd" a forward
and backward step with the forward at its table pick, so only the backward's tile changes
(rates count forward + backward FLOPs); "fwd+bwd" both with the candidate (printed, not
cached). The GPU's own family is swept unless --sm80 forces the mma.sync kernels (printed,
not cached). Developers copy winners into the built-in tables and the numbers into
docs/performance-log.md.

`--orders` times the fused implementations (native, pallas) on every class of call that
`implementation=None` tells apart (jaxflash/choice.py): 16- and 32-bit inputs, each head-dim
bucket of --head-dims, causal or not, training-length queries (forward+backward on the grid's
shapes at each of --seqs, geometric mean; 32-bit inputs at the first only) and decode steps
(one query row of 32 heads against an 8k cache of 8, forward). It writes each class's order, fastest first, to the cache (and with
--shipped FILE to the package's table of shipped orders as well). `--orders --queries small`
runs on a CPU only: native against xla forward+backward on a small call that hides no pair
(B 1, 4 heads, 64 queries and keys: 16k scores), the class choice.SMALL_SCORES bounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import _measure, _native, choice, tile_cache


def build(direction: str, causal: bool, cand: int, sm80: bool):
  """The jitted step for one candidate, traced here (the tile is read at trace time)."""
  attn = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, is_causal=causal, implementation="native")
  if direction == "fwd":
    def forward(q, k, v):
      with _native.forced_tile(cand, sm80=sm80):
        return attn(q, k, v)
    return jax.jit(forward)

  def step(q, k, v, do):
    with _native.forced_tile(0 if direction == "bwd" else cand, sm80=sm80):
      _, vjp = jax.vjp(attn, q, k, v)
    with _native.forced_tile(cand, sm80=sm80):
      return vjp(do)
  return jax.jit(step)


def sweep(direction: str, D: int, S: int, causal: bool, *, sm80: bool = False, reps: int = 10,
          repeats: int = 3) -> list[float]:
  """TFLOP/s of candidates 1, 2, ... of one cell, up to the last compiled one."""
  H, B = 2048 // D, max(1, 16384 // S)
  rng = np.random.default_rng(0)
  q, k, v, do = (jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16) for _ in range(4))
  inputs = (q, k, v) if direction == "fwd" else (q, k, v, do)
  flops = _measure.attention_flops(B, H, S, S, D, causal, direction != "fwd")
  # The sm80 backward has one tile and ignores the index: one run says all.
  last = 1 if direction == "bwd" and sm80 else _native.MAX_CANDIDATES
  times = _native.each_compiled_candidate(
      lambda cand: _measure.time_jitted(build(direction, causal, cand, sm80), inputs, reps, repeats), last)
  return [flops / t / 1e12 for t in times]


def winner(rates_per_seq: list[list[float]]) -> tuple[int, float]:
  """(1-based candidate, its geometric-mean TFLOP/s) over the sequence lengths of a cell.

  Only candidates measured at every length compete.
  """
  count = min(len(r) for r in rates_per_seq)
  if count == 0:
    raise ValueError("no candidate was measured")
  means = [math.exp(sum(math.log(r[c]) for r in rates_per_seq) / len(rates_per_seq)) for c in range(count)]
  best = int(np.argmax(means))
  return best + 1, means[best]


def _order_inputs(bits: int, D: int, S: int, queries: str):
  """Random inputs of one class: the grid's shape for training, a decode step otherwise."""
  dtype = jnp.bfloat16 if bits == 16 else jnp.float32
  rng = np.random.default_rng(0)
  if queries == "train":
    B, N, K, T = max(1, 16384 // S), max(1, 2048 // D), max(1, 2048 // D), S
  elif queries == "small":
    B, N, K, T, S = 1, 4, 4, 64, 64
  else:
    B, N, K, T, S = 8, 32, 8, 1, 8192
  shapes = [(B, T, N, D), (B, S, K, D), (B, S, K, D), (B, T, N, D)]
  return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def grad_of(attn):
  """The jitted forward+backward of `attn` against a cotangent do."""
  return jax.jit(jax.grad(lambda q, k, v, do: jnp.sum(attn(q, k, v).astype(jnp.float32) * do),
                          argnums=(0, 1, 2)))


def time_class(name: str, bits: int, D: int, causal: bool, queries: str, seqs, reps: int,
               repeats: int) -> float:
  """Seconds per call of implementation `name` on one class (geometric mean over `seqs`)."""
  kw = dict(is_causal=causal, implementation=name)
  if queries == "decode":
    kw["causal_alignment"] = "bottom_right"
  attn = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, **kw)
  logs = []
  # 32-bit training shapes run one length: float32 steps take 10-100x as long.
  for S in (seqs if bits == 16 else seqs[:1]) if queries == "train" else [None]:
    q, k, v, do = _order_inputs(bits, D, S, queries)
    if queries == "decode":
      # A decode step takes ~0.1 ms: ten times the reps keep the host's share steady.
      t = _measure.time_jitted(jax.jit(attn), (q, k, v), 10 * reps, repeats)
    else:  # (a small call as short as a decode step: ten times the reps)
      t = _measure.time_jitted(grad_of(attn), (q, k, v, do.astype(jnp.float32)),
                               (10 if queries == "small" else 1) * reps, repeats)
    logs.append(math.log(t))
  return math.exp(sum(logs) / len(logs))


def measure_orders(head_dims, seqs, reps: int, repeats: int, queries_classes=("train", "decode")):
  """The Order of every class (of its choice.candidates), printed as a table row each."""
  device = jax.devices()[0]
  today = datetime.date.today().isoformat()
  names = tuple(dict.fromkeys(n for queries in queries_classes for n in choice.candidates(queries)))
  print("| bits | D | causal | queries | " + " | ".join(f"{n} ms" for n in names) + " | order |")
  print("|---|---|---|---|" + "---|" * (len(names) + 1))
  orders = []
  for bits in (16, 32):
    for D in head_dims:
      for causal in (False, True):
        for queries in queries_classes:
          if queries == "small" and causal:  # a causal call hides pairs: never small
            continue
          times = {}
          for name in choice.candidates(queries):
            try:
              times[name] = time_class(name, bits, D, causal, queries, seqs, reps, repeats)
            except Exception as e:  # cannot serve this class here: not ordered
              print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
          if not times:
            continue
          ranked = tuple(sorted(times, key=times.get))
          cells = " | ".join(f"{times[n] * 1e3:.3f}" if n in times else "—" for n in names)
          print(f"| {bits} | {D} | {'yes' if causal else 'no'} | {queries} | {cells} | "
                f"{' > '.join(ranked)} |", flush=True)
          orders.append(tile_cache.Order(device=device.device_kind, build=_native.build_id(),
                                         bits=bits, head_dim=tile_cache.bucket(D), causal=causal,
                                         queries=queries, order=ranked,
                                         ms=tuple(round(times[n] * 1e3, 4) for n in ranked),
                                         measured=today))
  return orders


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m jaxflash.tune", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--head-dims", "--heads-dims", dest="head_dims", default="64,128,256")
  ap.add_argument("--seqs", default="4096,16384")
  ap.add_argument("--direction", default="fwd,bwd", help="comma-separated: fwd, bwd, fwd+bwd")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--sm80", action="store_true", help="sweep the sm80 family on a newer GPU (not cached)")
  ap.add_argument("--no-write", dest="write", action="store_false", help="print only; leave the cache alone")
  ap.add_argument("--orders", action="store_true",
                  help="time the implementations per class of call instead of the tiles (see above)")
  ap.add_argument("--queries", default="train,decode",
                  help="with --orders, the classes of queries to measure: train, decode, small "
                       "(small alone on a CPU)")
  ap.add_argument("--shipped", default=None, metavar="FILE",
                  help="with --orders, also store the orders, build-independent, in FILE "
                       "(the package's jaxflash/orders.json)")
  args = ap.parse_args(argv)

  device = jax.devices()[0]
  queries = tuple(args.queries.split(","))
  if device.platform not in ("gpu", "cpu") or (device.platform == "cpu") != (args.orders and queries == ("small",)):
    raise SystemExit("python -m jaxflash.tune measures the CUDA kernels on a GPU, and on a CPU the "
                     "order of its small class only (--orders --queries small)")
  _native.require(device.platform)
  print(f"device: {device.device_kind}")
  if args.orders:
    seqs = [int(s) for s in args.seqs.split(",")]
    orders = measure_orders([int(d) for d in args.head_dims.split(",")], seqs, args.reps, args.repeats, queries)
    if args.write and orders:
      print(f"wrote {len(orders)} orders to {tile_cache.write(orders)}")
    if args.shipped and orders:
      shipped = [dataclasses.replace(o, build="") for o in orders]
      print(f"wrote {len(shipped)} orders to {tile_cache.write(shipped, pathlib.Path(args.shipped))}")
    return

  columns = _native.MAX_CANDIDATES  # rows with fewer candidates are padded
  print("| direction | causal | S | D | " + " | ".join(f"tile {i}" for i in range(1, columns + 1))
        + " | winner |")
  print("|---|---|---|---|" + "---|" * (columns + 1))
  entries = []
  today = datetime.date.today().isoformat()
  for direction in args.direction.split(","):
    for D in (int(d) for d in args.head_dims.split(",")):
      for causal in (False, True):
        per_seq = []
        for S in (int(s) for s in args.seqs.split(",")):
          rates = sweep(direction, D, S, causal, sm80=args.sm80, reps=args.reps, repeats=args.repeats)
          per_seq.append(rates)
          best = int(np.argmax(rates)) + 1 if rates else 0
          cells = " | ".join([f"{r:.1f}" for r in rates] + ["—"] * (columns - len(rates)))
          print(f"| {direction} | {'yes' if causal else 'no'} | {S} | {D} | {cells} | {best} |", flush=True)
        if direction in tile_cache.DIRECTIONS and not args.sm80 and tile_cache.bucket(D) == D:
          tile, rate = winner(per_seq)
          entries.append(tile_cache.Entry(device=device.device_kind, build=_native.build_id(),
                                          direction=direction, head_dim=D, causal=causal, tile=tile,
                                          tflops=round(rate, 1), measured=today))
  if args.write and entries:
    file = tile_cache.write(entries)
    print(f"wrote {len(entries)} winners for {device.device_kind!r} to {file}")
  elif entries:
    print("winners (not written): " + ", ".join(
        f"{e.direction} D={e.head_dim} {'causal' if e.causal else 'full'}: tile {e.tile}" for e in entries))


if __name__ == "__main__":
  main()
