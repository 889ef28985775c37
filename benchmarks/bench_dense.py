"""A dense bias and a block-sparse mask: jaxflash against jax.nn (cuDNN and xla), one run.

    python benchmarks/bench_dense.py [--seq 4096] [--heads 16] [--head-dim 128] [--batch 2]
                                     [--dtype bfloat16] [--bias-axes NTS]

Prints, for bf16 inputs (by default) and a bias [1, N, T, S] (one per head, shared by the batch;
--bias-axes names the axes it has, BTS for [B, 1, T, S]):
forward and forward+backward times (the backward differentiates the bias too) of
`jaxflash.dot_product_attention` as users call it (implementation=None) and with native and
pallas named, jax.nn's cuDNN and xla paths, and the default's ratios to each; then the time of a mask that hides half of the 128 x 128
tiles (a checkerboard) against an all-visible one, and each call's scratch memory (XLA's temporary
buffers: the arguments, the bias among them, and the results, its gradient among them, are not
counted), beside the default's scratch for the same call without a bias.
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
  parser.add_argument("--bias-axes", default="NTS", choices=["NTS", "BTS", "BNTS", "TS"])
  args = parser.parse_args()
  B, T, N, D = args.batch, args.seq, args.heads, args.head_dim
  dtype = jnp.dtype(args.dtype)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, D)), dtype) for _ in range(3))
  shape = tuple(n if a in args.bias_axes else 1 for a, n in zip("BNTS", (B, N, T, T)))
  bias = jnp.asarray(rng.standard_normal(shape), dtype)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {dtype.name} B {B} S {T} N {N} "
        f"D {D}, bias {list(shape)} ({bias.nbytes / 2**20:.0f} MiB)")

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
  plain = jax.grad(lambda q, k, v: jaxflash.dot_product_attention(q, k, v).astype(jnp.float32).sum(),
                   argnums=(0, 1, 2))
  _, plain_mem = timed(plain, (q, k, v))
  if isinstance(plain_mem, int) and isinstance(ours[1][1], int):
    print(f"jaxflash forward+backward scratch: {ours[1][1] / 2**20:.0f} MiB with the bias, "
          f"{plain_mem / 2**20:.0f} MiB without")
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
