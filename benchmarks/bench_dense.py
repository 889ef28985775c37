"""A dense bias and a block-sparse mask: jaxflash against jax.nn (cuDNN and xla), one run.

    python benchmarks/bench_dense.py [--seq 4096] [--heads 16] [--head-dim 128] [--batch 2]
                                     [--dtype bfloat16]

Prints, for bf16 inputs (by default) and a bias [1, N, T, S] (one per head, shared by the batch):
forward and forward+backward times (the backward differentiates the bias too) of
`jaxflash.dot_product_attention` as users call it (implementation=None) and with native and
pallas named, jax.nn's cuDNN and xla paths, and the default's ratios to each; then the time of a mask that hides half of the 128 x 128
tiles (a checkerboard) against an all-visible one, and each call's scratch memory.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import _measure


def timed(fn, args):
  try:
    jitted = jax.jit(fn)
    return _measure.time_jitted(jitted, args), _measure.scratch_bytes(jitted, args)
  except Exception as e:  # a peer that cannot run the call here
    return None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  args = parser.parse_args()
  B, T, N, D = args.batch, args.seq, args.heads, args.head_dim
  dtype = jnp.dtype(args.dtype)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, D)), dtype) for _ in range(3))
  bias = jnp.asarray(rng.standard_normal((1, N, T, T)), dtype)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {dtype.name} B {B} S {T} N {N} "
        f"D {D}, bias [1, N, T, S]")

  def attend(impl):
    if impl in ("jaxflash", "native", "pallas"):   # jaxflash: the default, as users call it
      named = None if impl == "jaxflash" else impl
      return lambda q, k, v, b: jaxflash.dot_product_attention(q, k, v, b, implementation=named)
    return lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b, implementation=impl)

  results = {}
  for name in ("jaxflash", "native", "pallas", "cudnn", "xla"):
    f = attend(name)
    train = jax.grad(lambda q, k, v, b, f=f: f(q, k, v, b).astype(jnp.float32).sum(),
                     argnums=(0, 1, 2, 3))
    results[name] = (timed(f, (q, k, v, bias)), timed(train, (q, k, v, bias)))
  for name, ((fwd, fwd_mem), (both, both_mem)) in results.items():
    ms = lambda t: "n/a" if t is None else f"{t * 1e3:.3f} ms"
    mib = lambda m: f"{m / 2**20:.0f} MiB" if isinstance(m, int) else str(m)
    print(f"{name:9s} forward {ms(fwd):>10s} (scratch {mib(fwd_mem)}), forward+backward "
          f"{ms(both):>10s} (scratch {mib(both_mem)})")
  ours = results["jaxflash"]
  for peer in ("native", "pallas", "cudnn", "xla"):
    for i, what in enumerate(("forward", "forward+backward")):
      a, b = ours[i][0], results[peer][i][0]
      if a and b:
        print(f"jaxflash / {peer} {what}: {b / a:.2f}x")

  blocks = (np.arange(T)[:, None] // 128 + np.arange(T)[None, :] // 128) % 2 == 0
  for label, mask in (("all visible", np.ones((T, T), bool)), ("half the tiles hidden", blocks)):
    m = jnp.asarray(mask)   # an argument: as a constant XLA would fold its tile summary
    f = lambda q, k, v, m: jaxflash.dot_product_attention(q, k, v, mask=m)
    train = jax.grad(lambda q, k, v, m: f(q, k, v, m).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    (fwd, _), (both, _) = timed(f, (q, k, v, m)), timed(train, (q, k, v, m))
    results[label] = (fwd, both)
    print(f"mask, {label}: forward {fwd * 1e3:.3f} ms, forward+backward {both * 1e3:.3f} ms")
  full, half = results["all visible"], results["half the tiles hidden"]
  print(f"block-sparse speed-up: forward {full[0] / half[0]:.2f}x, "
        f"forward+backward {full[1] / half[1]:.2f}x")


if __name__ == "__main__":
  main()
