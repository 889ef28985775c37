"""Float64 NumPy attention, forward and backward: the ground truth in tests.

Written independently of jaxflash.reference (which is jax.numpy) so that a
shared misunderstanding of the mask rule cannot hide in both.
"""

from __future__ import annotations

import numpy as np


def visible(B, T, S, *, left=-1, right=-1, bottom_right=False, q_lengths=None, kv_lengths=None,
            offsets=None):
  """[B, T, S] bool. left/right < 0 mean unbounded; offsets[b] shifts the diagonal."""
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
  return out


def _expand(x, N):
  """[B, S, K, D] -> [B, S, N, D] by repeating each kv head over its group."""
  return np.repeat(x, N // x.shape[2], axis=2)


def forward(q, k, v, *, scale, **mask):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, D = q.shape
  S = k.shape[1]
  ke, ve = _expand(k, N), _expand(v, N)
  vis = visible(B, T, S, **mask)[:, None]
  s = np.einsum("btnd,bsnd->bnts", q, ke) * scale
  s = np.where(vis, s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.exp(s - m)
  l = p.sum(-1, keepdims=True)
  p = p / np.where(l > 0, l, 1.0)
  o = np.einsum("bnts,bsnd->btnd", p, ve)
  lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)), -np.inf)
  return o, lse, p


def backward(q, k, v, do, dlse=None, *, scale, **mask):
  """Gradients of <o, do> + <lse, dlse> with respect to q, k, v."""
  q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
  B, T, N, D = q.shape
  K = k.shape[2]
  o, lse, p = forward(q, k, v, scale=scale, **mask)
  ke, ve = _expand(k, N), _expand(v, N)
  dv = np.einsum("bnts,btnd->bsnd", p, do)
  dp = np.einsum("btnd,bsnd->bnts", do, ve)
  delta = np.einsum("btnd,btnd->bnt", do, o)
  if dlse is not None:
    delta = delta - np.asarray(dlse, np.float64)
  ds = p * (dp - delta[..., None])
  dq = np.einsum("bnts,bsnd->btnd", ds, ke) * scale
  dk = np.einsum("bnts,btnd->bsnd", ds, q) * scale
  fold = lambda x: x.reshape(B, x.shape[1], K, N // K, D).sum(3)
  return dq, fold(dk), fold(dv)
