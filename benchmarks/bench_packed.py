"""Packed sequences: jaxflash with segment ids against its peers on the same documents.

    python benchmarks/bench_packed.py              # bf16, D 128, S 8k, 8 documents a row, causal

Each row of S tokens holds --docs documents of random length (cut points drawn
uniformly, seeded); B * S = 16k tokens and H * D = 2048, as in bench_attention.py.
In the same process, forward and forward+backward:

* native     jaxflash.dot_product_attention(..., query_segment_ids=ids), the default path
* fa3_varlen FlashAttention-3's varlen entry (flash_attn3_jax.flash_mha_varlen) on the same
             tokens as [B * S, H, D] with the documents' cumulative lengths
* xla_mask   jax.nn.dot_product_attention(implementation="xla") with the equivalent dense mask
* unpacked   jaxflash on rows of the mean document length L (B * S / L rows, causal): the
             rate packing should keep

Rates are counted over in-document pairs only (half of n^2 per causal document of n
tokens, as bench_attention.py counts a causal row), so a kernel that computed the
whole S x S square and masked it would show a low rate. Printed: milliseconds, TFLOP/s,
and the ratios the issue's targets name (native / fa3_varlen time, native rate /
unpacked rate, xla_mask time / native time).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import _measure


def documents(rng, rows: int, S: int, docs: int):
  """(segment ids [rows, S] int32, document lengths per row [rows, docs])."""
  cuts = np.sort(np.stack([rng.choice(np.arange(1, S), docs - 1, replace=False) for _ in range(rows)]),
                 axis=1)
  edges = np.concatenate([np.zeros((rows, 1), int), cuts, np.full((rows, 1), S)], axis=1)
  ids = (np.arange(S)[None, None] >= cuts[:, :, None]).sum(1).astype(np.int32)
  return ids, np.diff(edges, axis=1)


def fa3_varlen(lengths, causal: bool):
  """attention(q, k, v) through FlashAttention-3's varlen entry on rows packed with documents of
  `lengths` ([rows, docs]): each row's documents laid end to end, as one flat sequence."""
  import flash_attn3_jax
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths.reshape(-1))]), jnp.int32)
  longest = int(lengths.max())
  flat = lambda x: x.reshape((-1,) + x.shape[2:])
  return lambda q, k, v: flash_attn3_jax.flash_mha_varlen(
      flat(q), flat(k), flat(v), cu, max_seqlen_q=longest, max_seqlen_k=longest,
      is_causal=causal).reshape(q.shape)


def in_document_flops(lengths, H: int, D: int, causal: bool, backward: bool) -> float:
  pairs = float(np.sum(lengths.astype(np.float64) ** 2)) * (0.5 if causal else 1.0)
  return 4.0 * H * D * pairs * (3.5 if backward else 1.0)


def timed(attn, args, backward, reps, repeats):
  if backward:
    def loss(q, k, v, do):
      return jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  else:
    fn = jax.jit(attn)
    args = args[:3]
  return _measure.time_jitted(fn, args, reps, repeats)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq", type=int, default=8192)
  ap.add_argument("--docs", type=int, default=8)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--non-causal", action="store_true")
  ap.add_argument("--peers", default="native,fa3_varlen,xla_mask,unpacked")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()

  S, D, causal = args.seq, args.head_dim, not args.non_causal
  B, H = max(1, 16384 // S), 2048 // D
  rng = np.random.default_rng(args.seed)
  ids, lengths = documents(rng, B, S, args.docs)
  q, k, v, do = (jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16) for _ in range(4))
  inputs = (q, k, v, do)
  mean = int(round(S / args.docs))
  print(f"device: {jax.devices()[0].device_kind}; B {B} x S {S}, H {H}, D {D}, causal {causal}; "
        f"{args.docs} documents a row, lengths {lengths.min()}..{lengths.max()} (mean {mean})")

  peers = args.peers.split(",")
  calls = {}
  if "native" in peers:
    calls["native"] = lambda q, k, v: jaxflash.dot_product_attention(q, k, v, is_causal=causal,
                                                                    query_segment_ids=ids)
  if "fa3_varlen" in peers:
    try:
      calls["fa3_varlen"] = fa3_varlen(lengths, causal)
    except Exception as e:  # not installed, or not for this jax
      print(f"fa3_varlen: skipped ({type(e).__name__}: {str(e)[:100]})")
  if "xla_mask" in peers:
    same = ids[:, :, None] == ids[:, None, :]
    mask = jnp.asarray(same & (np.tril(np.ones((S, S), bool)) if causal else same))[:, None]
    calls["xla_mask"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask,
                                                                     implementation="xla")

  for backward in (False, True):
    work = in_document_flops(lengths, H, D, causal, backward)
    times = {}
    for name, attn in calls.items():
      try:
        times[name] = timed(attn, inputs, backward, args.reps, args.repeats)
      except Exception as e:  # a peer that cannot run this shape is reported, not fatal
        print(f"  {name}: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
    rates = {n: work / t / 1e12 for n, t in times.items()}
    if "unpacked" in peers:
      rows = B * (S // mean)
      shaped = lambda x: x[:, :S // mean * mean].reshape((rows, mean) + x.shape[2:])
      unpacked = tuple(shaped(x) for x in inputs)
      t = timed(lambda q, k, v: jaxflash.dot_product_attention(q, k, v, is_causal=causal), unpacked,
                backward, args.reps, args.repeats)
      rates["unpacked"] = _measure.attention_flops(rows, H, mean, mean, D, causal, backward) / t / 1e12
      times["unpacked"] = t
    line = "  ".join(f"{n}={times[n] * 1e3:.3f} ms ({rates[n]:.1f} TFLOP/s)" for n in times)
    ratios = []
    if "native" in times and "fa3_varlen" in times:
      ratios.append(f"native vs fa3_varlen {times['fa3_varlen'] / times['native']:.3f}x")
    if "native" in rates and "unpacked" in rates:
      ratios.append(f"native rate / unpacked rate {rates['native'] / rates['unpacked']:.3f}")
    if "native" in times and "xla_mask" in times:
      ratios.append(f"native vs xla_mask {times['xla_mask'] / times['native']:.2f}x")
    print(f"{'fwd+bwd' if backward else 'fwd':7s} {line}  |  " + ";  ".join(ratios), flush=True)


if __name__ == "__main__":
  main()
