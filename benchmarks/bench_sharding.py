"""Sharded attention on every visible GPU against one GPU: speed, memory, overlap.

    python benchmarks/bench_sharding.py            # everything below (about 4 min on 2 GPUs)
    python benchmarks/bench_sharding.py --quick    # S = 64k only, no overlap study

Sections (bf16, H = 16, D = 128 as in the DESIGN.md §6 grid; n = the number of GPUs):

1. batch sharding: forward+backward of B = 2n, S = 8k split over the batch on n GPUs, against
   B = 2 on one GPU. Equal times mean each GPU runs at the single-GPU speed (target +-5%).
2. ring attention: forward+backward at S = 64k and 128k, causal and not, B = 1, the sequence
   sharded over n GPUs (the partition rule runs the ring) against the whole sequence on one
   GPU: speed-up and peak memory per GPU (targets at 128k on 2 GPUs: >= 1.8x, <= 0.55x).
   At 128k causal also `ring_attention` under shard_map with the data in the zigzag layout
   (no re-layout), and the automatic ring with 4 K/V heads.
3. overlap: the 128k causal ring once more with XLA's asynchronous collective permutes
   turned off (`--xla_gpu_disable_async_collectives=COLLECTIVEPERMUTE`) and once with the
   latency-hiding scheduler on; the time the transfers cost when they are not hidden is the
   difference. `--trace DIR` also writes a jax.profiler trace of one sharded step.
4. a correctness check at S = 8k: the ring's output and gradients against one GPU's.

Every measurement runs in a fresh process, so each peak-memory figure is that run's own.
Works with any number of GPUs (with one, the "n GPUs" rows repeat the single-GPU run).

    python benchmarks/bench_sharding.py --cpu-memory [--devices 2 --seq 4096 --heads 16]

needs no GPU: XLA's buffer assignment on host devices (`memory_analysis()` of the compiled
forward+backward), one device against the automatic ring and `ring_attention` in shard_map,
in units of X = one q-sized tensor. A statement about the program XLA builds, not a GPU
measurement (the GPU's own scheduler and allocator decide the real peak).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxflash
from jaxflash import _measure

cfg = json.loads(sys.argv[1])
devices = jax.devices()[:cfg["devices"]]
B, S, H, D, causal = cfg["B"], cfg["S"], cfg["H"], cfg["D"], cfg["causal"]
mesh = jax.make_mesh((len(devices),), ("x",), devices=devices,
                     axis_types=(jax.sharding.AxisType.Auto,))
spec = P("x") if cfg["split"] == "batch" else P(None, "x")
rows = NamedSharding(mesh, spec)

def attn(q, k, v):
  return jaxflash.dot_product_attention(q, k, v, is_causal=causal)

def loss(q, k, v, do):
  return jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

if cfg.get("explicit"):
  # ring_attention in shard_map, the zigzag layout given (data order does not
  # change the timing of random inputs): no re-layout inside.
  import functools
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=P())
  def loss(q, k, v, do):
    o = jaxflash.ring_attention(q, k, v, axis_name="x", is_causal=causal, layout="zigzag")
    return jax.lax.psum(jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), "x")

step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), out_shardings=(rows, rows, rows))
keys = jax.random.split(jax.random.key(0), 4)
K = cfg.get("K", H)
q, k, v, do = (jax.device_put(jax.random.normal(kk, (B, S, h, D), jnp.bfloat16), rows)
               for kk, h in zip(keys, (H, K, K, H)))
jax.block_until_ready((q, k, v, do))
compiled = step.lower(q, k, v, do).compile()
hlo = compiled.as_text()
collectives = sorted({c for c in ("all-gather", "all-to-all", "collective-permute", "all-reduce",
                                  "reduce-scatter") if c + "(" in hlo or c + "-start(" in hlo})
reps = cfg["reps"]
seconds = _measure.time_jitted(step, (q, k, v, do), reps=reps, repeats=3)
if cfg.get("trace"):
  jax.profiler.start_trace(cfg["trace"])
  jax.block_until_ready(step(q, k, v, do))
  jax.profiler.stop_trace()
stats = [d.memory_stats() or {} for d in devices]          # None on the CPU
peak = max(st.get("peak_bytes_in_use", 0) for st in stats)
print(json.dumps(dict(seconds=seconds, peak=peak, collectives=collectives)))
"""

_CHECK = r"""
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxflash
n = len(jax.devices())
S, H, D = json.loads(sys.argv[1])["S"], 8, 128
mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
rows = NamedSharding(mesh, P(None, "x"))
out = {}
for causal in (True, False):
  def fwd_bwd(q, k, v, do):
    o, vjp = jax.vjp(lambda q, k, v: jaxflash.dot_product_attention(q, k, v, is_causal=causal),
                     q, k, v)
    return (o,) + vjp(do)
  keys = jax.random.split(jax.random.key(1), 4)
  args = [jax.random.normal(kk, (1, S, H, D), jnp.bfloat16) for kk in keys]
  one = jax.jit(fwd_bwd)(*args)
  ring = jax.jit(fwd_bwd)(*(jax.device_put(a, rows) for a in args))
  # Each error next to the largest magnitude of that result (bf16 keeps 8 bits).
  out["causal" if causal else "full"] = {
      name: "%.2g of %.2g" % (float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))),
                              float(jnp.max(jnp.abs(b.astype(jnp.float32)))))
      for name, a, b in zip(("o", "dq", "dk", "dv"), ring, one)}
print(json.dumps(out))
"""


_CPU_MEMORY = r"""
import functools, json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxflash
cfg = json.loads(sys.argv[1])
n, S, H, D = len(jax.devices()), cfg["S"], cfg["H"], 128
X = S * H * D * 2                                  # one q-sized bf16 tensor, B = 1
auto = lambda devs: jax.make_mesh((len(devs),), ("x",), devices=devs,
                                  axis_types=(jax.sharding.AxisType.Auto,))
mesh = auto(jax.devices())
seq, whole = NamedSharding(mesh, P(None, "x")), NamedSharding(auto(jax.devices()[:1]), P())

def loss_of(causal, explicit):
  if not explicit:
    return lambda q, k, v, do: jnp.sum(jaxflash.dot_product_attention(q, k, v, is_causal=causal)
                                       .astype(jnp.float32) * do.astype(jnp.float32))
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, "x"), out_specs=P())
  def loss(q, k, v, do):
    o = jaxflash.ring_attention(q, k, v, axis_name="x", is_causal=causal,
                                layout="zigzag" if causal else "contiguous")
    return jax.lax.psum(jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), "x")
  return loss

arg = jax.ShapeDtypeStruct((1, S, H, D), jnp.bfloat16)
rows = []
for causal in (True, False):
  for name, sharding, explicit in (("one device", whole, False), ("automatic ring", seq, False),
                                   ("ring_attention", seq, True)):
    step = jax.jit(jax.grad(loss_of(causal, explicit), argnums=(0, 1, 2)),
                   in_shardings=(sharding,) * 4, out_shardings=(sharding,) * 3)
    m = step.lower(arg, arg, arg, arg).compile().memory_analysis()
    sizes = [m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
             m.alias_size_in_bytes]
    rows.append(dict(name=name, causal=causal, sizes=[b / X for b in sizes]))
print(json.dumps(dict(devices=n, rows=rows)))
"""


def _cpu_memory(devices, S, H):
  r = _run(_CPU_MEMORY, dict(S=S, H=H), f"--xla_force_host_platform_device_count={devices}",
           dict(JAX_PLATFORMS="cpu"))
  if "error" in r:
    print(f"failed: {r['error']}")
    return
  print(f"## XLA buffer assignment per device, {r['devices']} host devices, forward+backward, "
        f"B = 1, S = {S}, H = {H}, D = 128, bf16; X = one q-sized tensor "
        f"({S * H * 256 / 2**20:.0f} MiB)")
  print("| call | causal | args X | outputs X | temps X | aliased X | total X | vs one device |")
  print("|---|---|---|---|---|---|---|---|")
  one = {}
  for row in r["rows"]:
    args, outs, temps, alias = row["sizes"]
    total = args + outs + temps - alias
    one.setdefault(row["causal"], total)
    print(f"| {row['name']} | {row['causal']} | {args:.2f} | {outs:.2f} | {temps:.2f} | "
          f"{alias:.2f} | {total:.2f} | {total / one[row['causal']]:.2f}x |")


def _run(code, cfg, env_flags="", env_extra=None):
  env = dict(os.environ, **(env_extra or {}))
  if env_flags:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + env_flags).strip()
  proc = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], capture_output=True,
                        text=True, env=env)
  if proc.returncode != 0:
    return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:160]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _gib(b):
  return b / 2**30


def _ring_row(label, one, many):
  if "error" in one or "error" in many:
    print(f"| {label} | failed: {one.get('error', '')} {many.get('error', '')} |", flush=True)
    return
  ratio = many["peak"] / one["peak"] if one["peak"] else float("nan")
  print(f"| {label} | {one['seconds'] * 1e3:.1f} | {_gib(one['peak']):.2f} | "
        f"{many['seconds'] * 1e3:.1f} | {_gib(many['peak']):.2f} | "
        f"{one['seconds'] / many['seconds']:.2f}x | {ratio:.2f} | "
        f"{', '.join(many['collectives']) or 'none'} |", flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="S = 64k only, no overlap study")
  ap.add_argument("--seqs", default="65536,131072", help="ring sequence lengths")
  ap.add_argument("--batch-seq", type=int, default=8192, help="sequence length of section 1")
  ap.add_argument("--check-seq", type=int, default=8192, help="sequence length of section 4")
  ap.add_argument("--trace", default="", help="write a profiler trace of the sharded 128k step")
  ap.add_argument("--cpu-memory", action="store_true",
                  help="no GPU: XLA buffer assignment on host devices, then exit")
  ap.add_argument("--devices", type=int, default=2, help="host devices of --cpu-memory")
  ap.add_argument("--seq", type=int, default=4096, help="sequence length of --cpu-memory")
  ap.add_argument("--heads", type=int, default=16, help="heads of --cpu-memory")
  args = ap.parse_args()
  if args.cpu_memory:
    _cpu_memory(args.devices, args.seq, args.heads)
    return

  import jax
  n = len(jax.devices())
  print(f"jax {jax.__version__}, {n} x {jax.devices()[0].device_kind}", flush=True)
  H, D = 16, 128

  print(f"\n## batch sharding: forward+backward, S = {args.batch_seq}, causal, 2 sequences per GPU")
  print("| GPUs | batch | ms | collectives |\n|---|---|---|---|")
  res = {}
  for d in sorted({1, n}):
    r = _run(_CHILD, dict(devices=d, B=2 * d, S=args.batch_seq, H=H, D=D, causal=True, split="batch",
                          reps=5))
    res[d] = r
    print(f"| {d} | {2 * d} | " + (f"{r['seconds'] * 1e3:.2f} | {', '.join(r['collectives']) or 'none'} |"
                                   if "error" not in r else f"failed: {r['error']} | |"), flush=True)
  if n > 1 and all("error" not in r for r in res.values()):
    print(f"per-GPU speed with {n} GPUs / one GPU: {res[1]['seconds'] / res[n]['seconds']:.3f}")

  print("\n## ring attention: forward+backward, B = 1, sequence sharded over the GPUs")
  print("| S | causal | 1 GPU ms | 1 GPU peak GiB | n GPUs ms | peak GiB per GPU | speed-up | "
        "memory ratio | collectives |\n|---|---|---|---|---|---|---|---|---|")
  seqs = [int(x) for x in args.seqs.split(",")][:1 if args.quick else None]
  overlapped = {"error": "not measured"}
  for S in seqs:
    for causal in (True, False):
      one = _run(_CHILD, dict(devices=1, B=1, S=S, H=H, D=D, causal=causal, split="seq", reps=2))
      trace = args.trace if (S == seqs[-1] and causal) else ""
      many = _run(_CHILD, dict(devices=n, B=1, S=S, H=H, D=D, causal=causal, split="seq", reps=2,
                               trace=trace))
      _ring_row(f"{S} | {causal}", one, many)
      if S == seqs[-1] and causal:
        overlapped = many
      if S == seqs[-1] and causal and not args.quick:
        # The same call as ring_attention in shard_map with the data already in
        # the zigzag layout, and with 4 K/V heads (GQA 4).
        explicit = _run(_CHILD, dict(devices=n, B=1, S=S, H=H, D=D, causal=True, split="seq",
                                     reps=2, explicit=True))
        _ring_row(f"{S} | True, ring_attention zigzag", one, explicit)
        gqa = [_run(_CHILD, dict(devices=d, B=1, S=S, H=H, K=4, D=D, causal=True, split="seq",
                                 reps=2)) for d in (1, n)]
        _ring_row(f"{S} | True, GQA 4", *gqa)

  if not args.quick and n > 1:
    print(f"\n## overlap: S = {seqs[-1]} causal ring, forward+backward")
    print("| XLA flags | ms |\n|---|---|")
    base = dict(devices=n, B=1, S=seqs[-1], H=H, D=D, causal=True, split="seq", reps=2)
    for flags in ("", "--xla_gpu_enable_latency_hiding_scheduler=true",
                  "--xla_gpu_disable_async_collectives=COLLECTIVEPERMUTE"):
      r = overlapped if not flags else _run(_CHILD, base, flags)
      print(f"| {flags or '(default)'} | " +
            (f"{r['seconds'] * 1e3:.1f} |" if "error" not in r else f"failed: {r['error']} |"),
            flush=True)

  print(f"\n## ring check, S = {args.check_seq}, bf16: max |ring - one GPU|")
  r = _run(_CHECK, dict(S=args.check_seq))
  print(json.dumps(r))


if __name__ == "__main__":
  main()
