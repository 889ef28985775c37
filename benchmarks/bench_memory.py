"""Peak device memory of attention forward+backward, against the bytes it cannot avoid.

    python benchmarks/bench_memory.py                         # S = 16k and 128k, native and cuDNN
    python benchmarks/bench_memory.py --seqs 16384 --impls native,cudnn,pallas

For each (implementation, S) a fresh process builds q, k, v, dO (bf16, B = 1, H = 16, D = 128,
H·D = 2048 as in the §6 grid), runs one jitted forward+backward that returns dq, dk, dv, and
reads the allocator's `peak_bytes_in_use`. The floor is the bytes of q, k, v, o, dO, dq, dk, dv
(bf16) and the float32 LSE: what any exact attention must hold at once. A fresh process per
row keeps one row's peak from hiding behind another's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import json, sys
import jax, jax.numpy as jnp
import jaxflash
impl, S, H, D, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
B = 1
def attn(q, k, v):
  if impl in ("native", "pallas"):
    return jaxflash.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
def loss(q, k, v, do):
  return jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
keys = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in keys)
jax.block_until_ready((q, k, v, do))
dev = jax.devices()[0]
before = dev.memory_stats()["bytes_in_use"]
jax.block_until_ready(step(q, k, v, do))
stats = dev.memory_stats()
print(json.dumps({"peak": stats["peak_bytes_in_use"], "inputs": before}))
"""


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seqs", default="16384,131072")
  ap.add_argument("--impls", default="native,cudnn")
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--causal", action="store_true")
  args = ap.parse_args()
  H, D = args.heads, args.head_dim
  print("| implementation | S | peak MiB | floor MiB | peak / floor |")
  print("|---|---|---|---|---|")
  for S in (int(s) for s in args.seqs.split(",")):
    floor = 8 * S * H * D * 2 + S * H * 4
    for impl in args.impls.split(","):
      proc = subprocess.run([sys.executable, "-c", _CHILD, impl, str(S), str(H), str(D), str(int(args.causal))],
                            capture_output=True, text=True)
      if proc.returncode != 0:
        err = (proc.stderr.strip().splitlines() or ["?"])[-1][:120]
        print(f"| {impl} | {S} | failed: {err} | {floor / 2**20:.0f} | — |")
        continue
      peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak"]
      print(f"| {impl} | {S} | {peak / 2**20:.0f} | {floor / 2**20:.0f} | {peak / floor:.2f} |", flush=True)


if __name__ == "__main__":
  main()
