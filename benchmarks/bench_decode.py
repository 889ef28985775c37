"""Decode-step speed: share of the device's copy bandwidth reached, jaxflash vs its peers.

    python benchmarks/bench_decode.py                   # every shape, q_len 1, 4, 16
    python benchmarks/bench_decode.py --q-lens 1 --csv decode.csv --png decode.png

Shapes (bf16, head_dim 128, a full cache, as in the decode issue):
B 8 x kv 32k with 32 query / 4 K/V heads, B 1 x kv 128k with 32 / 8, B 64 x kv 4k
with 32 / 8; each at q_len 1, 4 and 16. K/V layouts: contiguous, contiguous with
key_value_seq_lengths (native: what a serving loop passes), and paged with page
sizes 16 and 64 (pages handed out in shuffled order).

Peers in the same process: jaxflash native and pallas, jax.nn.dot_product_attention
with implementation="cudnn" and "xla", and torch SDPA (enable_gqa) when torch has a
GPU. Every call attends the whole cache (is_causal=False; at q_len 1 that is the
decode step, at q_len 4 and 16 it differs from the bottom-right causal mask by a
few keys per row). The lengths and paged layouts run jaxflash native only.

Bandwidth: bytes of K and V read (B x kv x K/V heads x 128 x 2 tensors x 2 bytes)
per second, over the same run's copy bandwidth (read + write bytes per second of
an elementwise pass over a 1 GiB buffer). Time is the median of --repeats runs of
--reps back-to-back calls (jaxflash._measure.time_jitted; CUDA events for torch).
"""

from __future__ import annotations

import argparse
import csv
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import _measure, _splits

# (batch, kv_len, query heads, K/V heads)
SHAPES = [(8, 32768, 32, 4), (1, 131072, 32, 8), (64, 4096, 32, 8)]
D = 128
DTYPE = jnp.bfloat16


def copy_bandwidth(reps: int, repeats: int) -> float:
  """Bytes per second read plus written by an elementwise pass over 1 GiB."""
  x = jnp.ones((1 << 29,), DTYPE)
  t = _measure.time_jitted(jax.jit(lambda x: x + jnp.asarray(1, DTYPE)), (x,), reps, repeats)
  return 2 * x.size * x.dtype.itemsize / t


def paged_layout(k, v, page_size: int, seed: int = 0):
  """The same keys and values in shuffled pages: (key_pages, value_pages, table)."""
  B, S, K, _ = k.shape
  per_seq = S // page_size
  order = np.random.default_rng(seed).permutation(B * per_seq)
  table = jnp.asarray(order.reshape(B, per_seq), jnp.int32)
  inverse = jnp.asarray(np.argsort(order))
  to_pages = lambda x: x.reshape(B * per_seq, page_size, K, x.shape[-1])[inverse]  # v may be narrower
  return to_pages(k), to_pages(v), table


def jax_peer(name: str):
  if name in ("native", "pallas", "default"):   # default: implementation=None, as users get it
    implementation = None if name == "default" else name
    return jax.jit(functools.partial(jaxflash.dot_product_attention, implementation=implementation))
  return jax.jit(functools.partial(jax.nn.dot_product_attention, implementation=name))


def _to_torch(x):
  """A [B, T, H, D] device array as torch's [B, H, T, D], through DLPack (no host copy)."""
  import torch
  return torch.from_dlpack(x).transpose(1, 2).contiguous()


def time_torch_sdpa(q, k, v, reps: int, repeats: int) -> float:
  import torch
  tq, tk, tv = (_to_torch(x) for x in (q, k, v))
  sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, enable_gqa=True)
  t = _measure.time_torch(sdpa, (tq, tk, tv), reps, repeats)
  del tq, tk, tv
  torch.cuda.empty_cache()
  return t


def bench_shape(B, S, N, K, T, peers, page_sizes, copy_bw, reps, repeats):
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(key, shape, DTYPE)
             for key, shape in zip(keys, ((B, T, N, D), (B, S, K, D), (B, S, K, D))))
  kv_bytes = 2 * B * S * K * D * jnp.dtype(DTYPE).itemsize
  rows = []

  def record(peer, layout, seconds):
    rows.append(dict(B=B, kv_len=S, q_heads=N, kv_heads=K, q_len=T, layout=layout, peer=peer,
                     time_us=round(seconds * 1e6, 2),
                     bandwidth_tbps=round(kv_bytes / seconds / 1e12, 3),
                     of_copy=round(kv_bytes / seconds / copy_bw, 3)))

  for peer in peers:
    try:
      if peer == "torch":
        t = time_torch_sdpa(q, k, v, reps, repeats)
      else:
        t = _measure.time_jitted(jax_peer(peer), (q, k, v), reps, repeats)
      record(peer, "contiguous", t)
    except Exception as e:  # a peer that cannot run this shape is reported, not fatal
      print(f"  {peer}: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
  if "native" in peers:
    lengths = jnp.full((B,), S, jnp.int32)
    # What a serving loop passes with a contiguous cache: the same kernels,
    # plus whatever the lengths cost around them (once ~100 us of host time a
    # call; fifteenth session in docs/performance-log.md).
    with_lengths = jax.jit(lambda q, k, v, n: jaxflash.dot_product_attention(
        q, k, v, key_value_seq_lengths=n, implementation="native"))
    record("native", "lengths", _measure.time_jitted(with_lengths, (q, k, v, lengths), reps, repeats))
    for page_size in page_sizes:
      kp, vp, table = paged_layout(k, v, page_size)
      fn = jax.jit(lambda q, kp, vp, table, n: jaxflash.paged_attention(
          q, kp, vp, table, n, is_causal=False, implementation="native"))
      record("native", f"paged{page_size}", _measure.time_jitted(fn, (q, kp, vp, table, lengths),
                                                                reps, repeats))
      del kp, vp
  return rows


def plot(rows, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not importable; no plot")
    return
  series = sorted({(r["peer"], r["layout"]) for r in rows})
  cases = sorted({(r["B"], r["kv_len"], r["q_heads"], r["kv_heads"], r["q_len"]) for r in rows})
  fig, ax = plt.subplots(figsize=(max(8, len(cases) * 1.2), 4.5))
  width = 0.8 / len(series)
  x = np.arange(len(cases))
  for i, (peer, layout) in enumerate(series):
    vals = [next((r["of_copy"] for r in rows if (r["peer"], r["layout"]) == (peer, layout)
                  and (r["B"], r["kv_len"], r["q_heads"], r["kv_heads"], r["q_len"]) == c), 0)
            for c in cases]
    ax.bar(x + i * width, vals, width, label=peer if layout == "contiguous" else f"{peer} {layout}")
  ax.set_xticks(x + 0.4, [f"B{c[0]} kv{c[1] // 1024}k {c[2]}/{c[3]} q{c[4]}" for c in cases],
                rotation=60, fontsize=7, ha="right")
  ax.axhline(0.85, color="gray", lw=0.8, ls="--")
  ax.set_ylabel("K/V bytes per second / copy bandwidth")
  ax.set_title(f"decode step, bf16, head_dim {D} ({jax.devices()[0].device_kind})")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--q-lens", default="1,4,16")
  ap.add_argument("--shapes", default=None,
                  help="B:kv_len:q_heads:kv_heads,... instead of the issue's three shapes")
  ap.add_argument("--peers", default="default,native,pallas,cudnn,xla,torch",
                  help="comma-separated (default: jaxflash with implementation=None); torch is "
                       "skipped when it has no GPU")
  ap.add_argument("--page-sizes", default="16,64")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--csv", default=None)
  ap.add_argument("--png", default=None)
  args = ap.parse_args()

  peers = args.peers.split(",")
  try:
    import torch
    if not torch.cuda.is_available():
      raise ImportError
  except ImportError:
    peers = [p for p in peers if p != "torch"]
  page_sizes = [int(p) for p in args.page_sizes.split(",") if p]
  shapes = ([tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")] if args.shapes
            else SHAPES)
  copy_bw = copy_bandwidth(args.reps, args.repeats)
  print(f"device: {jax.devices()[0].device_kind}; copy bandwidth {copy_bw / 1e12:.2f} TB/s")
  rows = []
  for T in (int(t) for t in args.q_lens.split(",")):
    for B, S, N, K in shapes:
      splits = _splits.native(0, (B, T, N, D), (B, S, K, D), DTYPE, jax.default_backend())
      new = bench_shape(B, S, N, K, T, peers, page_sizes, copy_bw, args.reps, args.repeats)
      cudnn = next((r["time_us"] for r in new if r["peer"] == "cudnn"), None)
      for r in new:
        r["splits"] = splits if r["peer"] == "native" else ""
        r["vs_cudnn"] = round(cudnn / r["time_us"], 2) if cudnn else ""
      cells = "  ".join(f"{r['peer']}{'' if r['layout'] == 'contiguous' else '/' + r['layout']}="
                        f"{r['of_copy'] * 100:3.0f}% ({r['time_us']:.0f} us)" for r in new)
      own = [r["time_us"] for r in new if r["peer"] in ("native", "pallas")
             and r["layout"] == "contiguous"]
      default = next((r["time_us"] for r in new if r["peer"] == "default"), None)
      check = f"  default/fastest={min(own) / default:.3f}" if own and default else ""
      print(f"B={B:2d} kv={S:6d} heads={N}/{K} q_len={T:2d} splits={splits:2d}  {cells}{check}",
            flush=True)
      rows += new
  if args.csv:
    with open(args.csv, "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=list(rows[0]))
      w.writeheader()
      w.writerows(rows)
  if args.png:
    plot(rows, args.png)


if __name__ == "__main__":
  main()
