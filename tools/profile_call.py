"""One native call at a §6 grid shape, for profiling under Nsight Compute:

    ncu --kernel-name regex:FwdKernel --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats python tools/profile_call.py --seq 16384 --head-dim 128
    ncu --kernel-name "regex:WsBwdKernel|DkDvKernel" --launch-skip 1 --launch-count 1 ... \
        python tools/profile_call.py --backward --fused

The call runs twice (the first launch compiles and warms up; skip it in ncu), or `--calls N`
times (to average N - 1 launches). `--backward`
runs forward+backward (a gradient); `--fused` traces it with the one-pass Hopper backward
(JAXFLASH_FUSED_BACKWARD=1), and without it with the two-kernel one (=0). `--tile K` forces
tile candidate K (1-based, as `python -m jaxflash.tune` numbers them; a forced tile runs the
two-kernel backward); `--heads` / `--kv-heads` set a GQA shape (the issue's training shape:
`--seq 8192 --heads 32 --kv-heads 8 --causal --backward --fused`). `--decode B,KV,HQ,HKV`
runs a decode step instead. `--softcap C` gives the call a logit soft-cap, `--alibi` ALiBi slopes
(the paper's, for the query heads), `--docs N` packed
rows of N documents (segment ids as benchmarks/bench_packed.py draws them), `--bias-axes BTS` a
bf16 bias over those of (B, N, T, S) ([B, 1, T, S] here; differentiated with --backward, so
`AB_KERNEL=BiasGradKernel` A/Bs the bias-gradient pass). `--peer cudnn` (or
`pallas`, or `fa3`: flash_attn3_jax.flash_mha, or with `--docs` its varlen entry on the same
documents; training calls only) runs the same call (a decode step:
contiguous) through that implementation, for a side-by-side profile (`ncu --clock-control
none --metrics gpu__time_duration.sum ...` lists every kernel of the call). `--time` then
prints the call's time as the benchmarks measure it (`_measure.time_jitted`: back-to-back
calls, one block; for a small shape that is dispatch and launch more than the kernel).
"""

from __future__ import annotations

import argparse
import os
import sys

# Under ncu a replayed kernel has the device memory it may write saved and
# restored, which with JAX's preallocated pool (75% of the GPU) we take to be
# the whole pool: profiles that take 8 s with the pool grown as needed ran
# past an 80 s limit with it, and each killed process's memory left the next
# one none (H200, sixty-first session). So the pool grows as needed unless
# the caller says otherwise.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after the allocator's setting)
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import _measure, _native


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq", type=int, default=16384)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--v-head-dim", type=int, default=0,
                  help="the value's head dim where it differs (MLA; default: --head-dim); with "
                       "--pad-v the call gets v zero-padded to --head-dim, as a user padding it would")
  ap.add_argument("--pad-v", action="store_true")
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--backward", action="store_true")
  ap.add_argument("--fused", action="store_true")
  ap.add_argument("--tile", type=int, default=0)
  ap.add_argument("--calls", type=int, default=2,
                  help="calls after tracing (profile with --launch-skip 1 to leave the first out)")
  ap.add_argument("--heads", type=int, default=0, help="query heads (default 2048 / head dim)")
  ap.add_argument("--batch", type=int, default=0, help="batch (default 16384 / seq; the latency shape: "
                                                        "--batch 1 --heads 8 --seq 512 --head-dim 64)")
  ap.add_argument("--kv-heads", type=int, default=0, help="K/V heads (default: as many as query heads)")
  ap.add_argument("--decode", default="", help="B,KV_LEN,Q_HEADS,KV_HEADS: a decode step")
  ap.add_argument("--q-len", type=int, default=1)
  ap.add_argument("--page", type=int, default=0)
  ap.add_argument("--splits", type=int, default=0)
  ap.add_argument("--peer", choices=("native", "pallas", "cudnn", "fa3"), default="native",
                  help="implementation of the call (a decode step's: contiguous)")
  ap.add_argument("--softcap", type=float, default=None, help="logits_soft_cap of the call")
  ap.add_argument("--alibi", action="store_true", help="ALiBi slopes 2^(-8 (h + 1) / H) of the call")
  ap.add_argument("--docs", type=int, default=0,
                  help="packed rows: N documents a row marked with segment ids, as benchmarks/bench_packed.py "
                       "draws them (seed 0)")
  ap.add_argument("--bias-axes", default="",
                  help="a bf16 bias over these of B, N, T, S (BTS: [B, 1, T, S]); with --backward its gradient too")
  ap.add_argument("--time", action="store_true",
                  help="also print call_us=, the median µs a call as the benchmarks time it")
  args = ap.parse_args()
  if args.decode:
    if args.peer == "fa3":
      ap.error("--peer fa3: training calls only (flash_mha)")
    return decode_step(args)
  S, D = args.seq, args.head_dim
  H, B = args.heads or 2048 // D, args.batch or max(1, 16384 // S)
  K = args.kv_heads or H
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16)
  Dv = args.v_head_dim or D
  k = jnp.asarray(rng.standard_normal((B, S, K, D)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((B, S, K, Dv)), jnp.bfloat16)
  if args.pad_v:
    v = jnp.pad(v, [(0, 0)] * 3 + [(0, D - Dv)])
  library = jax.nn if args.peer == "cudnn" else jaxflash
  extras = {} if args.softcap is None else dict(logits_soft_cap=args.softcap)
  if args.alibi:
    if args.peer not in ("native", "pallas"):
      ap.error("--alibi: only jaxflash's implementations take ALiBi slopes")
    extras["alibi_slopes"] = jnp.asarray(2.0 ** (-8.0 * (np.arange(H) + 1) / H), jnp.float32)
  if args.docs:
    if args.peer not in ("native", "pallas", "fa3"):
      ap.error("--docs: jaxflash's implementations (segment ids) and fa3 (its varlen entry) only")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    from bench_packed import documents, fa3_varlen  # the benchmark's documents and peer
    ids, lengths = documents(np.random.default_rng(0), B, S, args.docs)
    extras["query_segment_ids"] = jnp.asarray(ids)
  operands = (q, k, v)
  if args.bias_axes:
    if args.peer == "fa3":
      ap.error("--bias-axes: jaxflash's implementations and cudnn only")
    shape = tuple(m if a in args.bias_axes else 1 for a, m in zip("BNTS", (B, H, S, S)))
    operands += (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),)
  attention = lambda q, k, v, *bias: library.dot_product_attention(q, k, v, *bias, is_causal=args.causal,
                                                                   implementation=args.peer, **extras)
  if args.peer == "fa3":
    import flash_attn3_jax  # FlashAttention-3's Hopper kernels through XLA FFI
    attention = lambda q, k, v: flash_attn3_jax.flash_mha(q, k, v, is_causal=args.causal)
    if args.docs:  # the same documents through its varlen entry
      attention = fa3_varlen(lengths, args.causal)
  if args.backward:
    f = jax.jit(jax.grad(lambda *x: jnp.sum(attention(*x).astype(jnp.float32)),
                         argnums=tuple(range(len(operands)))))
  else:
    f = jax.jit(attention)
  os.environ["JAXFLASH_FUSED_BACKWARD"] = "1" if args.fused else "0"
  with _native.forced_tile(args.tile):  # both read when the call is traced
    for _ in range(args.calls):
      jax.block_until_ready(f(*operands))
    if args.time:
      print(f"call_us={1e6 * _measure.time_jitted(f, operands):.2f}")
  print(f"ran {args.peer} B={B} S={S} H={H}/{K} D={D} Dv={v.shape[-1]} causal={args.causal} backward={args.backward} "
        f"fused={args.fused} tile={args.tile}" + (f" bias={operands[3].shape}" if args.bias_axes else ""))


def decode_step(args):
  B, S, N, K = (int(x) for x in args.decode.split(","))
  D, T, splits = args.head_dim, args.q_len, args.splits or None
  Dv = args.v_head_dim or D
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (B, T, N, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, S, K, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (B, S, K, Dv), jnp.bfloat16)
  if args.pad_v:
    v = jnp.pad(v, [(0, 0)] * 3 + [(0, D - Dv)])
  if args.page:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    from bench_decode import paged_layout  # the benchmark's shuffled pages
    kp, vp, table = paged_layout(k, v, args.page)
    lengths = jnp.full((B,), S, jnp.int32)
    f = jax.jit(lambda q, kp, vp, table, n: jaxflash.paged_attention(
        q, kp, vp, table, n, is_causal=False, num_splits=splits, implementation="native"))
    call_args = (q, kp, vp, table, lengths)
  elif args.peer == "cudnn":
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    call_args = (q, k, v)
  else:
    f = jax.jit(lambda q, k, v: jaxflash.dot_product_attention(q, k, v, num_splits=splits,
                                                               implementation=args.peer))
    call_args = (q, k, v)
  for _ in range(2):
    jax.block_until_ready(f(*call_args))
  if args.time:
    print(f"call_us={1e6 * _measure.time_jitted(f, call_args):.2f}")
  print(f"ran decode {args.peer} B={B} kv={S} heads={N}/{K} D={D} Dv={v.shape[-1]} q_len={T} page={args.page} "
        f"splits={args.splits or 'auto'}")


if __name__ == "__main__":
  main()
