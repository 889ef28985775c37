"""Sweep the compiled tile candidates of the CUDA tensor-core kernels and print the winners.

    python tools/tune_tiles.py                         # D in {64, 128, 256}, S in {4k, 16k}, both masks
    python tools/tune_tiles.py --heads-dims 128 --seqs 16384 --direction fwd,bwd

Every head-dim bucket compiles a few tile shapes (FwdCandidates in
ffi/kernels/sm80/fwd_kernel.cuh and ffi/kernels/sm90/fwd_launch.cuh, BwdCandidates in
ffi/kernels/sm90/bwd_kernel.cuh for the Hopper backward; the sm80 backward has one shape per
bucket); the launchers pick one from a table keyed by head dim and causality. The GPU's own
family is swept unless --sm80 forces the mma.sync kernels.
This script forces each candidate in turn (1-based; `jaxflash._native.forced_tile`), times
it on the §6 grid's shapes (bf16, B*S = 16384 tokens, H*D = 2048) and prints TFLOP/s per
candidate and the winner per (direction, D, causal). "fwd" times the forward; "fwd+bwd" the
forward and backward, both with the candidate; "bwd" the same step with the forward at its
table pick, so only the backward's tile changes (rates still count forward + backward FLOPs).
Copy the winners into the tables (FwdTilePick, BwdTilePick) and the numbers into
docs/performance.md.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import _measure, _native

MAX_CANDIDATES = 8


def build(direction, causal, cand, sm80):
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


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--heads-dims", default="64,128,256")
  ap.add_argument("--seqs", default="4096,16384")
  ap.add_argument("--direction", default="fwd")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--sm80", action="store_true", help="sweep the sm80 family on a newer GPU")
  args = ap.parse_args()
  print(f"device: {jax.devices()[0].device_kind}")
  print("| direction | causal | S | D | " + " | ".join(f"tile {i}" for i in range(1, 6)) + " | winner |")
  print("|---|---|---|---|" + "---|" * 6)
  for direction in args.direction.split(","):
    for D in (int(d) for d in args.heads_dims.split(",")):
      for causal in (False, True):
        for S in (int(s) for s in args.seqs.split(",")):
          H, B = 2048 // D, max(1, 16384 // S)
          rng = np.random.default_rng(0)
          q, k, v, do = (jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16) for _ in range(4))
          inputs = (q, k, v) if direction == "fwd" else (q, k, v, do)
          flops = _measure.attention_flops(B, H, S, S, D, causal, direction != "fwd")
          rates = []
          # The sm80 backward has one tile and ignores the index: one run says all.
          last = 1 if direction == "bwd" and args.sm80 else MAX_CANDIDATES
          for cand in range(1, last + 1):
            try:
              t = _measure.time_jitted(build(direction, causal, cand, args.sm80), inputs, args.reps,
                                       args.repeats)
            except Exception as e:              # past the last compiled candidate
              if "does not exist" in str(e):
                break
              raise
            rates.append(flops / t / 1e12)
          best = int(np.argmax(rates)) + 1
          cells = " | ".join(f"{r:.1f}" for r in rates)
          print(f"| {direction} | {'yes' if causal else 'no'} | {S} | {D} | {cells} | {best} |", flush=True)


if __name__ == "__main__":
  main()
