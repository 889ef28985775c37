"""Attention throughput: jaxflash native vs its peers, forward and forward+backward.

    python benchmarks/bench_attention.py                  # DESIGN.md §6 grid
    python benchmarks/bench_attention.py --quick          # one shape per head dim
    python benchmarks/bench_attention.py --csv out.csv --png out.png

Grid: bf16 (or --dtype float16), B*S = 16384 tokens, H*D = 2048, D in {64, 128, 256}, S in {1k..16k},
causal on/off, plus the latency shape B=1, H=8, S=512, D=64. FLOPs:
forward 4*B*H*T*S*D (halved for causal), backward 2.5x forward.

`native` is the native path as a user gets it; `native_fused` and
`native_two_kernel` force its Hopper backward to the fused pass or to two
kernels, dK/dV then dQ (JAXFLASH_FUSED_BACKWARD=1 / 0 while it is compiled);
`native_deterministic` is a `deterministic=True` call (bit-reproducible, the
same two kernels); `default` is jaxflash as a user gets it (`implementation=None`).
Peers in the same process and harness: jax.nn.dot_product_attention with
implementation="cudnn" and "xla", FlashAttention-3 (`fa3`: flash_attn3_jax.flash_mha),
tokamax (`tokamax`: tokamax.dot_product_attention with implementation="mosaic"), and
torch SDPA's flash and cuDNN backends; a peer whose package does not import is skipped.
`--check-default` adds native, pallas and default and prints, per cell, the default's
rate over the fastest jaxflash implementation's. Device time is measured by timing `reps` back-to-back
calls of a jitted function and blocking once; the median of `repeats` such
runs is reported.
"""

from __future__ import annotations

import argparse
import csv
import os

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import _measure


flops = _measure.attention_flops
time_fn = _measure.time_jitted
time_torch = _measure.time_torch


# Peers that are the native path with its Hopper backward forced one way.
BACKWARD_MODES = {"native_fused": "1", "native_two_kernel": "0"}


def compiled_with_backward(mode, fn, args):
  """`fn` compiled with JAXFLASH_FUSED_BACKWARD=mode (read while a call is traced)."""
  before = os.environ.get("JAXFLASH_FUSED_BACKWARD")
  os.environ["JAXFLASH_FUSED_BACKWARD"] = mode
  try:
    return fn.lower(*args).compile()
  finally:
    if before is None:
      del os.environ["JAXFLASH_FUSED_BACKWARD"]
    else:
      os.environ["JAXFLASH_FUSED_BACKWARD"] = before


# jaxflash's own implementations (what --check-default compares the default with).
JAXFLASH_IMPLEMENTATIONS = ("native", "pallas")
# Peers whose package may be missing: name -> module.
OPTIONAL_PEERS = {"fa3": "flash_attn3_jax", "tokamax": "tokamax"}


# The logit soft-cap of the `*_softcap` peers (set from --softcap in main).
SOFTCAP = 30.0
# Score modifiers a jaxflash peer's name may end with: the call then takes it.
MODIFIERS = ("_softcap", "_alibi")


def alibi_slopes(heads: int) -> np.ndarray:
  """The `*_alibi` peers' slopes: the ALiBi paper's 2^(-8 (n + 1) / heads)."""
  return (2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)).astype(np.float32)


def jax_impl(name, causal, backward, heads=None):
  extra = {}
  if name.endswith("_softcap"):   # default_softcap, native_softcap, pallas_softcap
    name, extra = name[:-len("_softcap")], dict(logits_soft_cap=SOFTCAP)
  elif name.endswith("_alibi"):   # default_alibi, native_alibi
    name, extra = name[:-len("_alibi")], dict(alibi_slopes=alibi_slopes(heads))
  if name in JAXFLASH_IMPLEMENTATIONS or name == "default":
    impl = None if name == "default" else name
    attn = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, is_causal=causal,
                                                           implementation=impl, **extra)
  elif name == "fa3":
    import flash_attn3_jax
    attn = lambda q, k, v: flash_attn3_jax.flash_mha(q, k, v, is_causal=causal)
  elif name == "tokamax":
    import tokamax
    attn = lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation="mosaic")
  elif name == "native_deterministic":  # bit-reproducible: dK/dV, then a dQ kernel
    attn = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, is_causal=causal,
                                                           implementation="native", deterministic=True)
  else:
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation=name)
  if not backward:
    return jax.jit(attn)

  def loss(q, k, v, do):
    return jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def torch_impl(backend_name, causal, backward):
  import torch
  from torch.nn.attention import SDPBackend, sdpa_kernel
  backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]

  def run(q, k, v, do):
    with sdpa_kernel(backend):
      o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
      if backward:
        return torch.autograd.grad(o, (q, k, v), do)
      return o
  return run


def bench_shape(B, H, S, D, causal, backward, peers, reps, repeats, kv_heads=None, dtype="bfloat16"):
  """TFLOP/s per peer at one shape; kv_heads < H is grouped-query attention."""
  K = kv_heads or H
  rng = np.random.default_rng(0)
  q, do = (jnp.asarray(rng.standard_normal((B, S, H, D)), dtype) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((B, S, K, D)), dtype) for _ in range(2))
  rows = {}
  for name in peers:
    try:
      if name.startswith("torch_"):
        if K != H:
          continue  # the torch rows are the MHA grid's
        import torch
        tq, tk, tv, tdo = (torch.randn(B, H, S, D, device="cuda", dtype=getattr(torch, dtype),
                                       requires_grad=backward) for _ in range(4))
        t = time_torch(torch_impl(name[6:], causal, backward), (tq, tk, tv, tdo), reps, repeats)
      else:
        if name == "xla" and S > 4096:
          continue  # materialises B*H*S*S scores
        args = (q, k, v, do) if backward else (q, k, v)
        if name in BACKWARD_MODES:
          fn = compiled_with_backward(BACKWARD_MODES[name], jax_impl("native", causal, backward),
                                      args)
        else:
          fn = jax_impl(name, causal, backward, heads=H)
        t = time_fn(fn, args, reps, repeats)
      rows[name] = flops(B, H, S, S, D, causal, backward) / t / 1e12
    except Exception as e:  # a peer that cannot run this shape is reported, not fatal
      print(f"  {name}: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
  return rows


def is_peer(name) -> bool:
  """A library other than jaxflash (the ratios' denominators)."""
  for suffix in MODIFIERS:
    name = name.removesuffix(suffix)
  return not (name.startswith("native") or name in JAXFLASH_IMPLEMENTATIONS or name == "default")


def ratios(rows, check_default: bool) -> str:
  """native and default over the best peer of the cell; with check_default the default
  over the fastest jaxflash implementation."""
  peers = {n: tf for n, tf in rows.items() if is_peer(n)}
  out = ""
  if peers:
    best = max(peers, key=peers.get)
    out += "".join(f"  {n}/best={rows[n] / peers[best]:.2f}" for n in ("native", "default")
                   if n in rows) + f" (best peer {best})"
  # The soft-cap's cost: the capped call's time over the same call's without it.
  out += "".join(f"  {n} {m[1:]} cost={rows[n] / rows[n + m]:.2f}x" for m in MODIFIERS
                 for n in ("default", *JAXFLASH_IMPLEMENTATIONS) if n in rows and n + m in rows)
  own = {n: rows[n] for n in JAXFLASH_IMPLEMENTATIONS if n in rows}
  if check_default and own and "default" in rows:
    fastest = max(own, key=own.get)
    out += f"  default/fastest={rows['default'] / own[fastest]:.3f} ({fastest})"
  return out


def report(results, rows, backward, causal, B, H, S, D, kv_heads=None, dtype="bfloat16",
           check_default=False):
  """Prints one shape's rates (and, for a GQA shape, milliseconds) with the
  ratios to the best peer, and adds its CSV row to `results`."""
  work = flops(B, H, S, S, D, causal, backward)
  ms = (lambda tf: f" ({work / tf / 1e9:.2f} ms)") if kv_heads else (lambda tf: "")
  line = "  ".join(f"{n}={tf:6.1f}{ms(tf)}" for n, tf in rows.items())
  ratio = ratios(rows, check_default)
  heads = f"{H}/{kv_heads}" if kv_heads else f"{H:2d}"
  kind = "" if dtype == "bfloat16" else f" {dtype}"
  print(f"{'fwd+bwd' if backward else 'fwd':7s} causal={int(causal)} B={B:2d} H={heads} S={S:5d} "
        f"D={D:3d}{kind}  TFLOP/s: {line}{ratio}", flush=True)
  results.append(dict(direction="fwd+bwd" if backward else "fwd", causal=causal, B=B, H=H, dtype=dtype,
                      **({"kv_heads": kv_heads} if kv_heads else {}), S=S, D=D,
                      **{f"tflops_{n}": round(tf, 2) for n, tf in rows.items()}))


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="S=16k only, one shape per head dim")
  ap.add_argument("--heads-dims", default="64,128,256")
  ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--no-backward", action="store_true")
  ap.add_argument("--no-forward", action="store_true", help="forward+backward rows only")
  ap.add_argument("--peers", default="default,native,pallas,cudnn,fa3,tokamax,xla,torch_flash,torch_cudnn",
                  help="comma-separated, of default, native, native_fused, native_two_kernel, "
                       "native_deterministic, pallas, cudnn, fa3, tokamax, xla, torch_flash, "
                       "torch_cudnn, and default_softcap, native_softcap, pallas_softcap (with "
                       "logits_soft_cap=--softcap), default_alibi, native_alibi (ALiBi slopes "
                       "2^(-8 (n+1) / heads)); torch_* are skipped when torch has no GPU, fa3 "
                       "and tokamax when their package does not import")
  ap.add_argument("--softcap", type=float, default=30.0,
                  help="the logit soft-cap of the *_softcap peers")
  ap.add_argument("--check-default", action="store_true",
                  help="add default, native and pallas, and print the default's rate over the "
                       "fastest of native and pallas per cell")
  ap.add_argument("--gqa", action="store_true",
                  help="also the GQA training shape: B 2, S 8k, 32 query / 8 KV heads, D 128, causal "
                       "(forward+backward, reported in ms too)")
  ap.add_argument("--matmul", action="store_true",
                  help="also the bf16 matmul ceiling of this run: an 8192^3 jnp.dot with f32 accumulation "
                       "(the D 128, S 16k forward target is a share of it)")
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                  help="the attention inputs' dtype (the matmul ceiling stays bf16)")
  ap.add_argument("--csv", default=None)
  ap.add_argument("--png", default=None)
  args = ap.parse_args()
  globals()["SOFTCAP"] = args.softcap

  peers = args.peers.split(",")
  try:
    import torch
    has_torch_gpu = torch.cuda.is_available()
  except ImportError:
    has_torch_gpu = False
  if not has_torch_gpu:
    peers = [p for p in peers if not p.startswith("torch_")]
  for name, module in OPTIONAL_PEERS.items():
    if name in peers:
      try:
        __import__(module)
      except Exception as e:  # not installed, or not for this jax
        print(f"{name}: skipped ({module} does not import: {type(e).__name__}: {str(e)[:100]})")
        peers.remove(name)
  if args.check_default:
    peers += [p for p in ("default", *JAXFLASH_IMPLEMENTATIONS) if p not in peers]

  dims = [int(x) for x in args.heads_dims.split(",")]
  seqs = [16384] if args.quick else [int(x) for x in args.seqs.split(",")]
  shapes = [(max(1, 16384 // S), 2048 // D, S, D) for D in dims for S in seqs]  # past 16k: one row
  if not args.quick:
    shapes.append((1, 8, 512, 64))
  gqa = (2, 32, 8192, 128, 8)  # B, query heads, S, D, KV heads
  results = []
  print(f"device: {jax.devices()[0].device_kind}")
  directions = [False] * (not args.no_forward) + [True] * (not args.no_backward)
  for backward in directions:
    for causal in (False, True):
      for B, H, S, D in shapes:
        rows = bench_shape(B, H, S, D, causal, backward, peers, args.reps, args.repeats, dtype=args.dtype)
        report(results, rows, backward, causal, B, H, S, D, dtype=args.dtype,
               check_default=args.check_default)

  if args.matmul:
    n = 8192
    a, b = (jnp.asarray(np.random.default_rng(i).standard_normal((n, n)), jnp.bfloat16) for i in (0, 1))
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    tf = 2 * n ** 3 / time_fn(mm, (a, b), args.reps, args.repeats) / 1e12
    print(f"matmul  bf16 {n}^3  TFLOP/s: {tf:6.1f}", flush=True)
    results.append(dict(direction="matmul", B=1, H=1, S=n, D=n, causal=False, tflops_matmul=round(tf, 2)))

  if args.gqa and not args.no_backward:
    B, H, S, D, K = gqa
    rows = bench_shape(B, H, S, D, True, True, peers, args.reps, args.repeats, kv_heads=K, dtype=args.dtype)
    report(results, rows, True, True, B, H, S, D, kv_heads=K, dtype=args.dtype,
           check_default=args.check_default)

  if args.csv:
    keys = sorted({k for r in results for k in r}, key=lambda k: (k.startswith("tflops"), k))
    with open(args.csv, "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=keys)
      w.writeheader()
      w.writerows(results)
  if args.png:
    try:
      import matplotlib
      matplotlib.use("Agg")
      import matplotlib.pyplot as plt
    except ImportError:
      print("matplotlib not importable; no plot")
      return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, direction in zip(axes, ("fwd", "fwd+bwd")):
      sel = [r for r in results if r["direction"] == direction]
      labels = [f"{'c' if r['causal'] else 'n'} S{r['S']} D{r['D']}" for r in sel]
      x = np.arange(len(sel))
      names = sorted({k for r in sel for k in r if k.startswith("tflops_")})
      for i, n in enumerate(names):
        ax.bar(x + i * 0.8 / len(names), [r.get(n, 0) for r in sel], 0.8 / len(names), label=n[7:])
      ax.set_xticks(x + 0.4, labels, rotation=90, fontsize=6)
      ax.set_title(direction)
      ax.set_ylabel("TFLOP/s")
      ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
  main()
