"""`python -m jaxflash`: check the native path, then time it against jax.nn.

1. Runs jaxflash's native kernels and the float32 `xla` reference on fresh
   random inputs (forward and gradients, a few masks) and checks the error
   budget of DESIGN.md §5 against a float32 baseline.
2. Prints time and scratch memory of forward and forward+backward for a few
   sequence lengths, jaxflash vs jax.nn.dot_product_attention (xla, and cudnn
   on a GPU), on the default backend.

Exits non-zero if a check fails. Works on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import _measure, _native

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m jaxflash", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--seq", type=int, nargs="+", default=None,
                 help="sequence lengths to time (default: 256 512 1024 on CPU, 1k..8k on GPU)")
  p.add_argument("--dtype", choices=list(DTYPES), default=None,
                 help="default: float32 on CPU, bfloat16 on GPU")
  p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--skip-check", action="store_true")
  p.add_argument("--skip-bench", action="store_true")
  return p.parse_args(argv)


def _progress(i, n, label):
  print(f"  [{i}/{n}] {label:<60}", end="\r", flush=True, file=sys.stderr)


def check(dtype, head_dim) -> bool:
  """Native vs the float32 reference; returns True when every case is within budget."""
  cases = [
      ("plain", dict()),
      ("causal", dict(is_causal=True)),
      ("bottom-right causal", dict(is_causal=True, causal_alignment="bottom_right")),
      ("window (32, 8)", dict(local_window_size=(32, 8))),
      ("lengths", dict(query_seq_lengths=jnp.array([100, 0], jnp.int32),
                       key_value_seq_lengths=jnp.array([77, 150], jnp.int32))),
  ]
  rng = np.random.default_rng()
  B, T, S, N, K = 2, 150, 170, 4, 2
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), dtype)
                 for s in ((B, T, N, head_dim), (B, S, K, head_dim), (B, S, K, head_dim),
                           (B, T, N, head_dim)))
  f32 = lambda x: x.astype(jnp.float32)
  print(f"check: native vs xla reference, {jnp.dtype(dtype).name}, B={B} T={T} S={S} "
        f"heads={N}/{K} D={head_dim}")
  ok = True
  for i, (name, kw) in enumerate(cases, 1):
    _progress(i, len(cases), name)

    def outputs(impl, q, k, v):
      def loss(q, k, v):
        return jnp.sum(f32(jaxflash.dot_product_attention(q, k, v, implementation=impl, **kw))
                       * f32(do))
      o = jaxflash.dot_product_attention(q, k, v, implementation=impl, **kw)
      return (o,) + jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    native = outputs("native", q, k, v)
    truth = outputs("xla", f32(q), f32(k), f32(v))          # float32 throughout
    base = outputs("xla", q, k, v)                          # the input dtype's own rounding
    errs = [float(jnp.max(jnp.abs(f32(a) - b))) for a, b in zip(native, truth)]
    budgets = [2 * float(jnp.max(jnp.abs(f32(a) - b))) + 1e-5 * (1 + float(jnp.max(jnp.abs(b))))
               for a, b in zip(base, truth)]
    passed = all(e <= b for e, b in zip(errs, budgets))
    ok &= passed
    print(f"  {'ok  ' if passed else 'FAIL'} {name:<22} max |err| o={errs[0]:.2e} "
          f"dq={errs[1]:.2e} dk={errs[2]:.2e} dv={errs[3]:.2e}" + " " * 8, flush=True)
  return ok


def bench(args, dtype, platform):
  seqs = args.seq or ([256, 512, 1024] if platform == "cpu" else [1024, 2048, 4096, 8192])
  N, K, D, B = args.heads, args.kv_heads or args.heads, args.head_dim, args.batch
  impls = {"jaxflash": None, "jax.nn xla": "xla"}
  if platform == "gpu":
    impls["jax.nn cudnn"] = "cudnn"
  print(f"\ntiming on {platform} ({jax.devices()[0].device_kind}): {jnp.dtype(dtype).name}, "
        f"B={B} heads={N}/{K} D={D} causal={args.causal}; median ms, scratch MiB")
  header = f"{'S':>6} {'direction':<9} " + " ".join(f"{n:>22}" for n in impls) + "  speedup"
  print(header)
  rng = np.random.default_rng()
  n_runs = len(seqs) * 2 * len(impls)
  run = 0
  for S in seqs:
    q = jnp.asarray(rng.standard_normal((B, S, N, D)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, D)), dtype) for _ in range(2))
    for direction in ("fwd", "fwd+bwd"):
      cells, times = [], {}
      for name, impl in impls.items():
        run += 1
        _progress(run, n_runs, f"S={S} {direction} {name}")
        fn = _attention_fn(name, impl, args.causal, direction == "fwd+bwd")
        try:
          t = _measure.time_jitted(fn, (q, k, v), reps=3 if platform == "cpu" else 20, repeats=3)
          mem = _measure.scratch_bytes(fn, (q, k, v))
          times[name] = t
          cells.append(f"{t * 1e3:10.2f} ms {'' if mem is None else f'{mem / 2**20:7.1f}M'}")
        except Exception as e:  # a peer that cannot run this shape
          cells.append(f"{'n/a (' + type(e).__name__ + ')':>22}")
      speed = (f"{times['jax.nn xla'] / times['jaxflash']:.2f}x vs xla"
               if "jax.nn xla" in times and "jaxflash" in times else "")
      print(f"{S:>6} {direction:<9} " + " ".join(f"{c:>22}" for c in cells) + "  " + speed +
            " " * 10, flush=True)


def _attention_fn(name, impl, causal, backward):
  if name == "jaxflash":
    attn = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, is_causal=causal)
  else:
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation=impl)
  if not backward:
    return jax.jit(attn)
  loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main(argv=None) -> int:
  args = _parse(argv)
  platform = jax.default_backend()
  dtype = DTYPES[args.dtype] if args.dtype else (jnp.float32 if platform == "cpu" else jnp.bfloat16)
  print(f"jaxflash {jaxflash.__version__} on jax {jax.__version__}, backend {platform}")
  reason = _native.unavailable_reason(platform)
  if reason:
    print(f"native path unavailable: {reason}")
    return 1
  ok = True
  if not args.skip_check:
    ok = check(dtype, args.head_dim)
  if not args.skip_bench:
    bench(args, dtype, platform)
  print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
