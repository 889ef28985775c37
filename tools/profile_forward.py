"""One native forward call at a §6 grid shape, for profiling under Nsight Compute:

    ncu --kernel-name regex:FwdKernel --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats python tools/profile_forward.py --seq 16384 --head-dim 128

The call runs twice (the first launch compiles and warms up; skip it in ncu). `--tile K` forces
tile candidate K of the forward (1-based, as tools/tune_tiles.py numbers them).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import _native


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq", type=int, default=16384)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--tile", type=int, default=0)
  args = ap.parse_args()
  S, D = args.seq, args.head_dim
  H, B = 2048 // D, max(1, 16384 // S)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16) for _ in range(3))
  f = jax.jit(lambda q, k, v: jaxflash.dot_product_attention(q, k, v, is_causal=args.causal,
                                                              implementation="native"))
  with _native.forced_tile(args.tile):  # read when the call is traced
    for _ in range(2):
      jax.block_until_ready(f(q, k, v))
  print(f"ran B={B} S={S} H={H} D={D} causal={args.causal} tile={args.tile}")


if __name__ == "__main__":
  main()
