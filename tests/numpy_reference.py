"""Float64 NumPy attention, forward and backward: the ground truth in tests.

Written independently of jaxflash.reference (which is jax.numpy) so that a
shared misunderstanding of the mask rule cannot hide in both.
"""

from __future__ import annotations

import numpy as np

# The LSE of a row that sees no key: the lowest finite float32 (params.h).
EMPTY_LSE = float(np.finfo(np.float32).min)


def visible(B, T, S, *, left=-1, right=-1, bottom_right=False, q_lengths=None, kv_lengths=None,
            offsets=None, segments=None):
  """[B, T, S] bool. left/right < 0 mean unbounded; offsets[b] shifts the diagonal;
  segments = (q_ids [B, T], kv_ids [B, S]): a row sees only keys with its id."""
  out = np.zeros((B, T, S), bool)
  for b in range(B):
    qv = T if q_lengths is None else int(np.clip(q_lengths[b], 0, T))
    kv = S if kv_lengths is None else int(np.clip(kv_lengths[b], 0, S))
    off = (kv - qv if bottom_right else 0) + (0 if offsets is None else int(offsets[b]))
    for i in range(qv):
      lo = 0 if left < 0 else max(0, i + off - left)
      hi = kv if right < 0 else min(kv, i + off + right + 1)
      if hi > lo:
        out[b, i, lo:hi] = True
  if segments is not None:
    q_ids, kv_ids = (np.asarray(x) for x in segments)
    out &= q_ids[:, :, None] == kv_ids[:, None, :]
  return out


def _expand(x, N):
  """[B, S, K, D] -> [B, S, N, D] by repeating each kv head over its group."""
  return np.repeat(x, N // x.shape[2], axis=2)


def _scores(q, ke):
  """[B, T, N, D] x [B, S, N, D] -> [B, N, T, S]: the dot of every row with every key.

  np.matmul, not np.einsum: einsum keeps batch axes out of BLAS and runs its
  own loop, about 5x slower at the largest test shapes (8 x 66 heads x 256 x
  384 keys x D 256: 5.5 s against 1.1 s on a 2-core CPU); only the float64
  summation order differs (1e-13 relative).
  """
  return np.matmul(q.transpose(0, 2, 1, 3), ke.transpose(0, 2, 3, 1))


def _cap(s, softcap):
  """The logit soft-cap (0: none): softcap * tanh(s / softcap)."""
  return softcap * np.tanh(s / softcap) if softcap else s


def alibi_bias(B, N, T, S, slopes, *, bottom_right=False, q_lengths=None, kv_lengths=None,
               offsets=None, **_):
  """ALiBi's [B, N, T, S] bias -slope[b, n] * |i + off_b - j| (0 without slopes), the
  diagonal off_b as in `visible`."""
  if slopes is None:
    return 0.0
  slopes = np.broadcast_to(np.asarray(slopes, np.float64), (B, N))
  out = np.zeros((B, N, T, S))
  for b in range(B):
    qv = T if q_lengths is None else int(np.clip(q_lengths[b], 0, T))
    kv = S if kv_lengths is None else int(np.clip(kv_lengths[b], 0, S))
    off = (kv - qv if bottom_right else 0) + (0 if offsets is None else int(offsets[b]))
    distance = np.abs(np.arange(T)[:, None] + off - np.arange(S)[None, :])
    out[b] = -slopes[b][:, None, None] * distance
  return out


def forward(q, k, v, *, scale, softcap=0.0, alibi=None, bias=None, dense_mask=None, **mask):
  """(o, lse [B, N, T], p). `bias` and `dense_mask` (jax.nn's bias and boolean mask,
  broadcastable to [B, N, T, S]): the bias is added after the cap and ALiBi, the mask
  hides pairs like the mask rule."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, D = q.shape
  S = k.shape[1]
  ke, ve = _expand(k, N), _expand(v, N)
  vis = visible(B, T, S, **mask)[:, None]
  if dense_mask is not None:
    vis = vis & np.asarray(dense_mask, bool)
  s = _cap(_scores(q, ke) * scale, softcap) + alibi_bias(B, N, T, S, alibi, **mask)
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  s = np.where(vis, s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.exp(s - m)
  l = p.sum(-1, keepdims=True)
  p = p / np.where(l > 0, l, 1.0)
  o = np.matmul(p, ve.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # BLAS, as in _scores
  lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)),
                 EMPTY_LSE)
  return o, lse, p


def in_dtype(q, k, v, do, dlse, dtype, *, scale, softcap=0.0, alibi=None, **mask):
  """Forward and backward computed in `dtype`: every operation rounded to it.

  The error yardstick of the tolerance rule (docs/design.md §5) without a
  JAX compilation per shape: the same formulas as `forward` / `backward`,
  each intermediate rounded to the input dtype (sums and products taken in
  float64 first, then rounded once, as an accumulator would). Returns
  (o, lse [B, N, T], dq, dk, dv) as float64; empty rows get EMPTY_LSE.
  """
  r = lambda x: np.asarray(x, np.float64).astype(dtype).astype(np.float64)
  q, k, v, do = (r(x) for x in (q, k, v, do))
  B, T, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  ke, ve = _expand(k, N), _expand(v, N)
  vis = visible(B, T, S, **mask)[:, None]
  sees = vis.any(-1)
  with np.errstate(all="ignore"):
    u = r(r(np.einsum("btnd,bsnd->bnts", q, ke)) * r(scale))
    capped = r(_cap(u, softcap))
    s = np.where(vis, r(capped + alibi_bias(B, N, T, S, alibi, **mask)), -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(vis, r(np.exp(r(s - m))), 0.0)
    l = r(e.sum(-1, keepdims=True))
    p = r(e / np.where(l > 0, l, 1.0))
    o = r(np.einsum("bnts,bsnd->btnd", p, ve))
    lse = np.where(sees, r(m[..., 0] + r(np.log(np.where(sees, l[..., 0], 1.0)))), EMPTY_LSE)
    dv = r(np.einsum("bnts,btnd->bsnd", p, do))
    dp = r(np.einsum("btnd,bsnd->bnts", do, ve))
    delta = r(np.einsum("btnd,btnd->bnt", do, o))
    if dlse is not None:
      delta = r(delta - np.asarray(dlse, np.float64))
    ds = r(p * r(dp - delta[..., None]))
    if softcap:
      ds = r(ds * r(1 - np.square(np.where(vis, capped, 0) / softcap)))
    dq = r(r(np.einsum("bnts,bsnd->btnd", ds, ke)) * scale)
    dk = r(r(np.einsum("bnts,btnd->bsnd", ds, q)) * scale)
  fold = lambda x: r(x.reshape(B, S, K, N // K, D).sum(3))
  return o, lse, dq, fold(dk), fold(dv)


def backward(q, k, v, do, dlse=None, *, scale, o_stored=None, softcap=0.0, alibi=None,
             bias=None, dense_mask=None, **mask):
  """Gradients of <o, do> + <lse, dlse> with respect to q, k, v, and with a `bias` (as
  for `forward`) a fourth: the bias's, summed over its broadcast axes.

  `o_stored` (the output as an implementation stored it, say rounded to
  bfloat16) replaces the exact output in delta = rowsum(dO * O): the
  gradients a fused backward that reads its stored output computes at best.
  """
  q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
  B, T, N, D = q.shape
  K = k.shape[2]
  o, lse, p = forward(q, k, v, scale=scale, softcap=softcap, alibi=alibi, bias=bias,
                      dense_mask=dense_mask, **mask)
  if o_stored is not None:
    o = np.asarray(o_stored, np.float64)
  ke, ve = _expand(k, N), _expand(v, N)
  dv = np.einsum("bnts,btnd->bsnd", p, do)
  dp = np.einsum("btnd,bsnd->bnts", do, ve)
  delta = np.einsum("btnd,btnd->bnt", do, o)
  if dlse is not None:
    delta = delta - np.asarray(dlse, np.float64)
  ds = p * (dp - delta[..., None])
  d_bias = ds
  if softcap:   # times the cap's slope 1 - tanh^2 (masked pairs have p = 0)
    ds = ds * (1 - np.square(_cap(_scores(q, ke) * scale, softcap) / softcap))
  dq = np.einsum("bnts,bsnd->btnd", ds, ke) * scale
  dk = np.einsum("bnts,btnd->bsnd", ds, q) * scale
  fold = lambda x: x.reshape(B, x.shape[1], K, N // K, D).sum(3)
  if bias is None:
    return dq, fold(dk), fold(dv)
  shape = np.shape(bias)
  shape = (1,) * (4 - len(shape)) + shape
  axes = tuple(i for i in range(4) if shape[i] == 1 and d_bias.shape[i] != 1)
  return dq, fold(dk), fold(dv), d_bias.sum(axis=axes, keepdims=True).reshape(np.shape(bias))



def exact(q, k, v, do, dlse=None, *, scale, **mask):
  """Forward and backward in IEEE float64 over the visible pairs only.

  The definition jaxflash's kernels follow for non-finite inputs: every sum
  runs over the pairs (i, j) the mask admits, so a NaN or Inf reaches a row
  exactly when a dense softmax would put it there, and never from a key the
  row cannot see (no 0 * NaN from masked pairs). Softmax as jax.nn writes it:
  shift by the row max (by 0 when it is -inf), normalise by the sum; a +inf
  or NaN score therefore makes the whole row's probabilities, and its LSE, NaN.
  Returns (o, lse [B, N, T], dq, dk, dv); rows that see nothing get o = 0,
  lse = EMPTY_LSE and no gradient. Materialises [B, N, T, S, D]: small shapes.
  """
  q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
  B, T, N, D = q.shape
  S, K = k.shape[1], k.shape[2]
  ke, ve = _expand(k, N), _expand(v, N)
  vis = np.broadcast_to(visible(B, T, S, **mask)[:, None], (B, N, T, S))
  sees = vis.any(-1)
  with np.errstate(all="ignore"):
    s = np.where(vis, np.sum(q.transpose(0, 2, 1, 3)[:, :, :, None, :] *
                             ke.transpose(0, 2, 1, 3)[:, :, None, :, :], -1) * scale, -np.inf)
    m = np.max(np.where(vis, s, -np.inf), axis=-1, keepdims=True)
    shift = np.where(m == -np.inf, 0.0, m)
    e = np.where(vis, np.exp(np.where(vis, s - shift, 0.0)), 0.0)
    l = e.sum(-1, keepdims=True)
    p = np.where(vis, e / np.where(sees[..., None], l, 1.0), 0.0)
    lse = np.where(sees, np.log(np.where(sees, l[..., 0], 1.0)) + shift[..., 0], EMPTY_LSE)

    def pair_sum(weights, x, over):  # sum over visible pairs of weights * x rows
      # weights [B, N, T, S]; x [B, S or T, N, D]; over = "keys" or "rows"
      xt = x.transpose(0, 2, 1, 3)                    # [B, N, S or T, D]
      if over == "keys":
        prod = weights[..., None] * xt[:, :, None, :, :]         # [B, N, T, S, D]
        return np.where(vis[..., None], prod, 0.0).sum(3).transpose(0, 2, 1, 3)
      prod = weights[..., None] * xt[:, :, :, None, :]           # [B, N, T, S, D]
      return np.where(vis[..., None], prod, 0.0).sum(2).transpose(0, 2, 1, 3)

    o = pair_sum(p, ve, "keys")
    dv = pair_sum(p, do, "rows")
    dp = np.sum(do.transpose(0, 2, 1, 3)[:, :, :, None, :] *
                ve.transpose(0, 2, 1, 3)[:, :, None, :, :], -1)
    delta = np.einsum("btnd,btnd->bnt", do, o)
    if dlse is not None:
      delta = delta - np.asarray(dlse, np.float64)
    ds = np.where(vis, p * (dp - delta[..., None]), 0.0)
    dq = pair_sum(ds, ke, "keys") * scale
    dk = pair_sum(ds, q, "rows") * scale
    fold = lambda x: x.reshape(B, S, K, N // K, D).sum(3)
    return o, lse, dq, fold(dk), fold(dv)


def exact_tangent(q, k, v, tq, tk, tv, *, scale, **mask):
  """Forward mode in IEEE float64 over the visible pairs only: (tO, tLSE [B, N, T])
  for tangents (tq, tk, tv), from `exact`'s O and LSE. With P = exp(S - LSE)
  and tS = scale (tQ Kᵀ + Q tKᵀ): tLSE = Σ_j P tS, tO = Σ_j P (tS V_j + tV_j) - tLSE O;
  rows that see nothing get 0. Materialises [B, N, T, S, D]: small shapes.
  """
  q, k, v, tq, tk, tv = (np.asarray(x, np.float64) for x in (q, k, v, tq, tk, tv))
  B, T, N, D = q.shape
  S = k.shape[1]
  o, lse = exact(q, k, v, np.zeros_like(q), scale=scale, **mask)[:2]
  ke, ve, tke, tve = (_expand(x, N) for x in (k, v, tk, tv))
  vis = np.broadcast_to(visible(B, T, S, **mask)[:, None], (B, N, T, S))
  with np.errstate(all="ignore"):
    s = np.einsum("btnd,bsnd->bnts", q, ke) * scale
    p = np.where(vis, np.exp(np.where(vis, s - lse[..., None], 0.0)), 0.0)
    ts = (np.einsum("btnd,bsnd->bnts", tq, ke) + np.einsum("btnd,bsnd->bnts", q, tke)) * scale
    pts = np.where(vis, p * ts, 0.0)

    def key_sum(weights, x):  # Σ over visible keys of weights * x rows: [B, T, N, D]
      prod = weights[..., None] * x.transpose(0, 2, 1, 3)[:, :, None, :, :]
      return np.where(vis[..., None], prod, 0.0).sum(3).transpose(0, 2, 1, 3)

    t_lse = pts.sum(-1)
    t_o = key_sum(pts, ve) + key_sum(p, tve) - t_lse.transpose(0, 2, 1)[..., None] * o
  return t_o, t_lse
