"""A small sweep of every CUDA kernel family, forward and backward, for
compute-sanitizer. Run as

    XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \
        --kernel-name kns=jaxflash python tools/sanitizer_sweep.py

(the platform allocator gives each buffer its own allocation, so an
out-of-bounds access is not hidden inside XLA's pool). `--head-dims 128
--training-only` narrows it to the forward and backward of those head dims
(a quick check of one kernel under the three tools); `--dense-only` runs the
dense bias and mask calls alone. Each configuration
runs the backward twice: as a default call, which takes the fused backward
where it exists (switched on here), and deterministic, which takes the two
kernels.
"""

import argparse
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

# Past 128 packed rows (q_len x query heads per K/V head) but the first, so the
# training kernels run, not the decode one (ffi/kernels/decode/launch_decode.h).
SHAPES = [(1, 1, 17, 2, 1, 64), (2, 37, 45, 8, 2, 128), (1, 70, 70, 4, 2, 40), (1, 33, 65, 8, 1, 256),
          (1, 150, 333, 2, 1, 128),  # walks several K/V tiles through both pipeline stages
          # more work tiles than SMs (192 of the D 64 pick's 256 rows against an H100's 132):
          # persistent CTAs take several
          (3, 300, 260, 32, 4, 64),
          # 240 work tiles of the D 128 segment tile's 128 rows: with segment ids its
          # CTAs claim them one by one where the dynamic walk is on (sm90/tile_scheduler.cuh)
          (2, 640, 640, 24, 8, 128),
          (1, 150, 333, 4, 2, 192),  # D 192's forward and backward tiles
          (1, 300, 333, 4, 2, 192, 128),  # MLA's widths (v 128): the (192, 128) pair's kernels
          # head dims past 256: Hopper's column-split forward (16-bit, plain masks; its
          # gradients go through XLA's products), rows and keys past whole tiles, zero-padded columns
          (2, 130, 97, 4, 2, 512), (1, 70, 200, 2, 1, 264)]
MASKS = [dict(), dict(is_causal=True, causal_alignment="bottom_right"),
         dict(local_window_size=(5, 3), query_seq_lengths=np.array([0], np.int32)[:1]),
         dict(key_value_seq_lengths=None),  # ragged keys: padding inside the tensor
         # segment ids: packed documents (sorted), and ids at random (intervals with gaps)
         dict(is_causal=True, segments="packed", key_value_seq_lengths=None),
         dict(local_window_size=(9, 4), segments="scattered"),
         # ALiBi slopes (per query head), alone and with a soft-cap and packed ids
         dict(is_causal=True, causal_alignment="bottom_right", alibi=True, key_value_seq_lengths=None),
         dict(alibi=True, logits_soft_cap=5.0, segments="packed"),
         # a soft-cap alone (D 256's pick takes it, not ALiBi)
         dict(is_causal=True, logits_soft_cap=5.0, key_value_seq_lengths=None)]
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--head-dims", default="", help="comma-separated; only these shapes (default: all), "
                  "the decode sweep's by q/k's head dim")
  ap.add_argument("--training-only", action="store_true", help="skip the tile-candidate and decode sweeps")
  ap.add_argument("--decode-only", action="store_true", help="only the decode sweep (split-KV, paged)")
  ap.add_argument("--dense-only", action="store_true", help="only the dense bias and mask sweep")
  ap.add_argument("--segments-only", action="store_true",
                  help="the training sweep's calls with segment ids only")
  ap.add_argument("--score-mods-only", "--alibi-only", dest="score_mods_only", action="store_true",
                  help="the training sweep's calls with ALiBi slopes or a soft-cap only")
  ap.add_argument("--dtypes", default="",
                  help="comma-separated (bfloat16, float16, float32); the training sweep's only these "
                       "(racecheck of the Hopper kernels: bfloat16 alone runs each kernel once a mask)")
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  dims = {int(d) for d in args.head_dims.split(",") if d}
  if args.dense_only:
    print(f"sanitizer sweep: {dense_sweep(rng, dims)} dense bias / mask configurations, forward and backward")
    return
  if not args.decode_only:
    masks = ([m for m in MASKS if "segments" in m] if args.segments_only else
             [m for m in MASKS if "alibi" in m or "logits_soft_cap" in m] if args.score_mods_only else MASKS)
    dtypes = [jnp.dtype(d) for d in args.dtypes.split(",") if d] or DTYPES
    print(f"sanitizer sweep: {training_sweep(rng, dims, masks, dtypes)} configurations, forward and backward")
    if args.training_only:
      return
    print(f"sanitizer sweep: {candidate_sweep(rng)} forward tile candidates on many work tiles")
    print(f"sanitizer sweep: {dense_sweep(rng, dims)} dense bias / mask configurations, forward and backward")
  print(f"sanitizer sweep: {decode_sweep(rng, dims)} decode configurations (split-KV, paged)")


def with_head_dims(shapes, dims):
  """The (B, T, S, N, K, D, ...) shapes whose q/k head dim D is in `dims` (all when empty)."""
  return [s for s in shapes if not dims or s[5] in dims]


def training_sweep(rng, dims, masks=MASKS, dtypes=DTYPES):
  """Forward and backward (default and deterministic) of every shape whose head
  dim is in `dims` (all when empty), mask of `masks` and dtype of `dtypes`;
  returns the count."""
  os.environ.setdefault("JAXFLASH_FUSED_BACKWARD", "1")   # read when each call is traced
  n = 0
  for shape, mask, dtype in itertools.product(with_head_dims(SHAPES, dims), masks, dtypes):
    (B, T, S, N, K, D), Dv = shape[:6], shape[6] if len(shape) > 6 else shape[5]  # Dv: the value's
    if D > 256 and (dtype == jnp.float32 or {"segments", "alibi", "logits_soft_cap"} & set(mask)):
      continue  # native refuses these past 256 (_native.wide_refusal)
    if "query_seq_lengths" in mask:
      mask = dict(mask, query_seq_lengths=rng.integers(0, T + 1, B).astype(np.int32))
    if "key_value_seq_lengths" in mask:
      mask = dict(mask, key_value_seq_lengths=rng.integers(1, S + 1, B).astype(np.int32))
    if "segments" in mask:
      kind = mask.pop("segments")
      ids = [np.sort(rng.integers(0, 4, (B, L)), axis=1) if kind == "packed" else rng.integers(0, 3, (B, L))
             for L in (T, S)]
      mask = dict(mask, query_segment_ids=ids[0].astype(np.int32),
                  key_value_segment_ids=ids[1].astype(np.int32))
    if mask.pop("alibi", False):
      mask = dict(mask, alibi_slopes=(2.0 ** -rng.uniform(0, 8, N)).astype(np.float32))
    q = jnp.asarray(rng.standard_normal((B, T, N, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, S, K, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, S, K, Dv)), dtype)
    loss = lambda q, k, v: jnp.sum(jaxflash.dot_product_attention(
        q, k, v, implementation="native", **mask).astype(jnp.float32))
    jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    f = lambda q: jnp.sum(jaxflash.dot_product_attention(
        q, k, v, implementation="native", deterministic=True, **mask).astype(jnp.float32))
    jax.block_until_ready(jax.grad(f)(q))
    n += 1
    if n % (len(masks) * len(dtypes)) == 0:  # progress, so a tool's time limit names the shape it reached
      print(f"sanitizer sweep: shape {shape} done", flush=True)
  return n


# Dense terms (16-bit): a bias the Hopper forward's dense tile stages (keys
# contiguous, S a multiple of 8; full and broadcast over batch and heads) and,
# on the sm80 kernels, a bias beside a mask, a mask alone and a bias whose
# rows are not whole 16-byte copies (S 86): forward, dQ and the bias's gradient
# (at D 64 and 128 on Hopper, of a bias shared by at most two items, the dense
# backward's one pass with dB out: stored for BNTS, added over the batch for NTS).
DENSE_SHAPES = [(2, 300, 296, 4, 2, 64), (2, 129, 200, 4, 4, 128), (1, 100, 88, 4, 1, 256),
                (1, 70, 86, 4, 2, 128)]
DENSE_TERMS = [("BNTS", False), ("NTS", False), ("TS", True), (None, True)]


def dense_sweep(rng, dims=()):
  """Each dense term of DENSE_TERMS on each shape of DENSE_SHAPES whose head dim is
  in `dims` (all when empty), causal; returns the count."""
  n = 0
  for (B, T, S, N, K, D), (axes, with_mask) in itertools.product(with_head_dims(DENSE_SHAPES, dims), DENSE_TERMS):
    q = jnp.asarray(rng.standard_normal((B, T, N, D)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, D)), jnp.bfloat16) for _ in range(2))
    size = lambda axes: tuple(m if a in axes else 1 for a, m in zip("BNTS", (B, N, T, S)))
    bias = None if axes is None else jnp.asarray(rng.standard_normal(size(axes)), jnp.bfloat16)
    mask = jnp.asarray(rng.random((B, 1, T, S)) < 0.7) if with_mask else None
    loss = lambda q, bias: jnp.sum(jaxflash.dot_product_attention(
        q, k, v, bias, mask, implementation="native", is_causal=True).astype(jnp.float32))
    jax.block_until_ready(jax.grad(loss, argnums=(0, 1) if bias is not None else 0)(q, bias))
    n += 1
  return n


def candidate_sweep(rng):
  """Every forward tile candidate of the bf16 head-dim buckets (not only the
  table's pick) on a causal, ragged shape with more work tiles than SMs, so a
  persistent CTA walks several and its Q / O buffers turn over: 132 pairs of
  two row blocks, which the scheduler walks paired on a 132-SM GPU (H100 SXM,
  H200; sm90/tile_scheduler.cuh)."""
  from jaxflash import _native
  n = 0
  for D in (64, 128, 192, 256):
    B, T, S, N, K = 1, 256, 260, 132, 12
    q, k, v = (jnp.asarray(rng.standard_normal((B, L, H, D)), jnp.bfloat16)
               for L, H in ((T, N), (S, K), (S, K)))
    lengths = rng.integers(1, S + 1, B).astype(np.int32)

    def run(candidate):
      with _native.forced_tile(candidate):
        jax.block_until_ready(jaxflash.dot_product_attention(
            q, k, v, implementation="native", is_causal=True, key_value_seq_lengths=lengths))
    n += len(_native.each_compiled_candidate(run))
  return n


# Decode shapes (q_len 1..16, GQA 1/4/8), forced splits including more splits
# than key tiles (and merges whose last block has rows past the end), and
# paged caches whose tables hold out-of-range entries and whose lengths run
# past the table: the kernels must clamp, never read outside. A seventh entry
# is the value's head dim (MLA: the decode kernels read v at its own).
DECODE_SHAPES = [(2, 1, 100, 8, 8, 64), (1, 3, 333, 16, 2, 128), (2, 16, 70, 8, 2, 32),
                 (1, 5, 200, 4, 1, 256), (1, 1, 300, 5, 1, 128), (1, 2, 333, 8, 2, 192, 128),
                 (2, 1, 150, 4, 1, 64, 96)]


def decode_sweep(rng, dims=()):
  """The decode steps of DECODE_SHAPES whose q/k head dim is in `dims` (all when empty)."""
  n = 0
  for (B, T, S, N, K, D, *Dv), dtype, splits in itertools.product(
      with_head_dims(DECODE_SHAPES, dims), [jnp.bfloat16, jnp.float32], [1, 3, 20, 40]):
    Dv = Dv[0] if Dv else D
    q = jnp.asarray(rng.standard_normal((B, T, N, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, S, K, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, S, K, Dv)), dtype)
    lengths = rng.integers(0, S + 1, B).astype(np.int32)
    jax.block_until_ready(jaxflash.dot_product_attention(
        q, k, v, implementation="native", is_causal=True, causal_alignment="bottom_right",
        key_value_seq_lengths=lengths, num_splits=splits))
    page_size = (1, 16, 24, 64, 8)[n % 5]  # 8+ (powers of two): the TMA loader's boxes on sm_90a
    pages = -(-S // page_size)
    kp = jnp.asarray(rng.standard_normal((pages, page_size, K, D)), dtype)
    vp = jnp.asarray(rng.standard_normal((pages, page_size, K, Dv)), dtype)
    table = rng.integers(-3, pages + 3, (B, pages + 2)).astype(np.int32)  # some out of range
    kv_lengths = rng.integers(0, 2 * S, B).astype(np.int32)            # some past the table
    paged = jax.jit(lambda q, t, n: jaxflash.paged_attention(q, kp, vp, t, n, num_splits=splits))
    jax.block_until_ready(paged(q, table, kv_lengths))
    n += 1
  return n


if __name__ == "__main__":
  main()
