"""Derivatives of the fused implementations beyond the kernels' VJP.

The kernels compute O and the log-sum-exp, and their backward the
vector-Jacobian product. Forward mode (`jax.jvp`, `jax.jacfwd`) needs the
Jacobian-vector product, and a Hessian-vector product (a jvp of a grad) the
derivative of the backward. Both are computed here in jnp, flash-style: a
scan over blocks of keys that never holds more than a [T, block] slice of
scores, so memory stays O(T · block), not O(T · S).

How it fits (`_core.fused` is a `jax.custom_jvp`):

* `tangent_p` gives (tO, tLSE) for tangents (tQ, tK, tV). It is linear in
  them, and its transpose is the kernels' backward, so reverse mode
  (linearize, then transpose) still runs only the fast kernels, while forward
  mode evaluates the implementation's tangent kernel where it has one (the
  Pallas kernels: pallas/tangent.py; ring attention: its own pass), else the
  scan below.
* `kernel_backward` is that backward as a `custom_jvp`: its value comes from
  the kernels, its tangent from differentiating `backward`, the same
  quantities in jnp. That is the second-order rule a Hessian-vector product
  needs.

With the LSE known the tangent needs one pass and no rescaling (natural
log, scale c, sums over visible keys j):

    P = exp(S - LSE),  S = c Q Kᵀ,  tS = c (tQ Kᵀ + Q tKᵀ),
    (with a logit soft-cap S and tS are the capped score and its tangent:
    reference.soft_cap, times its slope; ALiBi adds a constant to S)
    tLSE = Σ_j P tS,   tO = Σ_j P (tS V_j + tV_j) - tLSE O.
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad, batching, mlir

from jaxflash import reference, segments as _segments

_BLOCK = 128  # keys per scan step
_HIGHEST = lax.Precision.HIGHEST


# ------------------------------------------------------------------ the blockwise computations

class _KeyBlocks:
  """A call's geometry, cut into blocks of keys, in float32 with the query
  heads grouped over their key/value head ([B, T, K, G, H])."""

  def __init__(self, q, k, q_lengths, kv_lengths, spec, offsets=None, segments=None, alibi=None):
    self.B, self.T, self.N, self.H = q.shape
    self.S, self.K = k.shape[1], k.shape[2]
    self.G = self.N // self.K
    self.block = min(_BLOCK, max(self.S, 1))
    self.count = -(-self.S // self.block)
    self.q_lengths = reference.given_lengths(q_lengths)
    self.kv_lengths = reference.given_lengths(kv_lengths)
    self.spec = spec
    self.offsets = offsets   # the kernels' diagonal offsets (params.h); None: 0
    # The segment tables' (q_ids, kv_ids), or None.
    self.segments = None if segments is None else _segments.ids_of(segments)
    self.alibi = alibi       # ALiBi slopes [B, N] float32, or None

  def grouped(self, x):
    """[B, T, N, H] -> [B, T, K, G, H] float32."""
    return x.astype(jnp.float32).reshape(self.B, self.T, self.K, self.G, self.H)

  def rows(self, x):
    """[B, N, T] -> [B, K, G, T] float32."""
    return x.astype(jnp.float32).reshape(self.B, self.K, self.G, self.T)

  def split(self, x):
    """[B, S, K, H] -> [blocks, B, block, K, H] float32, zero past S."""
    pad = self.count * self.block - self.S
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    return jnp.moveaxis(x.reshape(self.B, self.count, self.block, self.K, self.H), 1, 0)

  def join(self, x, dtype):
    """[blocks, B, block, K, H] -> [B, S, K, H] in dtype."""
    x = jnp.moveaxis(x, 0, 1).reshape(self.B, self.count * self.block, self.K, self.H)
    return x[:, :self.S].astype(dtype)

  def visible(self, j0):
    """Boolean [B, 1, 1, T, block]: the pairs of key block [j0, j0 + block)."""
    left, right = self.spec.window_left, self.spec.window_right
    vis = reference.visible_mask(
        self.T, self.S, query_seq_lengths=self.q_lengths, key_value_seq_lengths=self.kv_lengths,
        window_left=None if left < 0 else left, window_right=None if right < 0 else right,
        bottom_right=self.spec.bottom_right, batch=self.B,
        keys=j0 + jnp.arange(self.block, dtype=jnp.int32), diagonal_offsets=self.offsets,
        segment_ids=self.segments)
    return vis[:, :, None]

  def starts(self):
    return jnp.arange(self.count, dtype=jnp.int32) * self.block

  def probabilities(self, q, k, lse, vis, j0):
    """(P, slope) [B, K, G, T, block]: P = exp(S - LSE) of the visible pairs, with S the
    (soft-capped, ALiBi-biased) scores of key block j0, and dS / d(c q.k), the cap's
    slope (None without a cap)."""
    s = reference.soft_cap(jnp.einsum("btkgh,bskh->bkgts", q, k, precision=_HIGHEST)
                           * self.spec.scale, self.spec.softcap)
    slope = reference.soft_cap_slope(s, self.spec.softcap)
    if self.alibi is not None:
      bias = reference.alibi_bias(
          self.alibi, self.T, self.S, query_seq_lengths=self.q_lengths,
          key_value_seq_lengths=self.kv_lengths, bottom_right=self.spec.bottom_right,
          batch=self.B, keys=j0 + jnp.arange(self.block, dtype=jnp.int32),
          diagonal_offsets=self.offsets)
      s = s + bias.reshape(self.B, self.K, self.G, self.T, self.block)
    # exp sees visible pairs only; rows with no key (LSE = the empty value)
    # have none, so nothing overflows.
    p = jnp.where(vis, jnp.exp(jnp.where(vis, s - lse[..., None], 0)), 0)
    return p, slope


def tangent_sums(q, k, v, lse, q_lengths, kv_lengths, tq, tk, tv, *, spec, offsets=None,
                 segments=None, alibi=None):
  """The three sums over keys of the tangent, float32: (Σ_j P (tS V_j + tV_j)
  [B, T, N, H], tLSE = Σ_j P tS [B, N, T], O = Σ_j P V_j [B, T, N, H]).

  With the LSE of the whole row given, all are sums over keys, so a call over
  part of the keys (a ring block, placed by `offsets`, the kernels' per-batch
  diagonal offsets; None for 0) gives that part's share exactly.
  """
  g = _KeyBlocks(q, k, q_lengths, kv_lengths, spec, offsets, segments, alibi)
  qg, tqg = g.grouped(q), g.grouped(tq)

  def step(carry, block):
    acc, t_lse, o_sum = carry
    kb, vb, tkb, tvb, j0 = block
    vis = g.visible(j0)
    p, slope = g.probabilities(qg, kb, g.rows(lse), vis, j0)
    ts = spec.scale * (jnp.einsum("btkgh,bskh->bkgts", tqg, kb, precision=_HIGHEST) +
                       jnp.einsum("btkgh,bskh->bkgts", qg, tkb, precision=_HIGHEST))
    ts = ts if slope is None else ts * slope
    pts = jnp.where(vis, p * ts, 0)
    acc = acc + (jnp.einsum("bkgts,bskh->btkgh", pts, vb, precision=_HIGHEST) +
                 jnp.einsum("bkgts,bskh->btkgh", p, tvb, precision=_HIGHEST))
    o_sum = o_sum + jnp.einsum("bkgts,bskh->btkgh", p, vb, precision=_HIGHEST)
    return (acc, t_lse + pts.sum(-1), o_sum), None

  # Zeros made from the operands, so that inside shard_map the carry varies
  # over the same manual axes as the sums (ring attention's blocks).
  init = (jnp.zeros_like(qg), jnp.zeros_like(g.rows(lse)), jnp.zeros_like(qg))
  (acc, t_lse, o_sum), _ = lax.scan(step, init, (g.split(k), g.split(v), g.split(tk),
                                                 g.split(tv), g.starts()))
  return acc.reshape(q.shape), t_lse.reshape(lse.shape), o_sum.reshape(q.shape)


def finish_tangent(sums, t_lse, o_sum, dtype):
  """tO = sums - tLSE O in `dtype`, from `tangent_sums`' three results.

  O is the float32 sum, not the call's output: rounded to 16 bits it would
  cost |tLSE| / 512 of an output ulp-scale error where tLSE is large and the
  two terms nearly cancel (one dominant key).
  """
  t_o = sums - jnp.transpose(t_lse, (0, 2, 1))[..., None] * o_sum
  return t_o.astype(dtype)


def tangent(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, *, spec, offsets=None,
            segments=None, alibi=None):
  """(tO [B, T, N, H] in o's dtype, tLSE [B, N, T] float32), linear in tq, tk, tv.

  `offsets` are the kernels' per-batch diagonal offsets (params.h), None for 0;
  `segments` the call's segment tables (segments.py), None without; `alibi` its ALiBi
  slopes [B, N], None without. Only o's dtype is read (see `finish_tangent`).
  """
  sums, t_lse, o_sum = tangent_sums(q, k, v, lse, q_lengths, kv_lengths, tq, tk, tv, spec=spec,
                                    offsets=offsets, segments=segments, alibi=alibi)
  return finish_tangent(sums, t_lse, o_sum, o.dtype), t_lse


def backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, *, spec, offsets=None,
             segments=None, alibi=None):
  """(dQ, dK, dV) as the kernels' backward computes them, in jnp (`offsets`,
  `segments` and `alibi` as for `tangent`)."""
  g = _KeyBlocks(q, k, q_lengths, kv_lengths, spec, offsets, segments, alibi)
  qg, dog = g.grouped(q), g.grouped(do)
  lse_g = g.rows(lse)
  delta = jnp.einsum("btkgh,btkgh->bkgt", dog, g.grouped(o), precision=_HIGHEST) - g.rows(dlse)
  delta = jnp.where(lse_g == reference.empty_lse(jnp.float32), 0, delta)  # rows that see no key

  def step(dq, block):
    kb, vb, j0 = block
    vis = g.visible(j0)
    p, slope = g.probabilities(qg, kb, lse_g, vis, j0)
    dp = jnp.einsum("btkgh,bskh->bkgts", dog, vb, precision=_HIGHEST)
    ds = p * (dp - delta[..., None])
    ds = jnp.where(vis, ds if slope is None else ds * slope, 0)
    dq = dq + spec.scale * jnp.einsum("bkgts,bskh->btkgh", ds, kb, precision=_HIGHEST)
    dk = spec.scale * jnp.einsum("bkgts,btkgh->bskh", ds, qg, precision=_HIGHEST)
    dv = jnp.einsum("bkgts,btkgh->bskh", p, dog, precision=_HIGHEST)
    return dq, (dk, dv)

  dq, (dk, dv) = lax.scan(step, jnp.zeros_like(qg), (g.split(k), g.split(v), g.starts()))
  return dq.reshape(q.shape).astype(q.dtype), g.join(dk, k.dtype), g.join(dv, v.dtype)


# ------------------------------------------------------------------ the kernels' backward, differentiable

@functools.partial(jax.custom_jvp, nondiff_argnums=(11, 12))
def kernel_backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, segments, alibi, kernels,
                    spec):
  """(dQ, dK, dV) from the kernels, differentiable by the blockwise backward."""
  return kernels.backward(q, k, v, o, lse, do.astype(q.dtype), dlse.astype(jnp.float32),
                          q_lengths, kv_lengths, spec, segments=segments, alibi=alibi)


@kernel_backward.defjvp
def _kernel_backward_jvp(kernels, spec, primals, tangents):
  if not getattr(kernels, "second_order", True):
    raise NotImplementedError(f"{kernels.name}: second derivatives (jvp of grad, Hessians) are "
                              "not available for this call; ring attention has first ones only")
  out = kernel_backward(*primals, kernels, spec)
  *arrays, segments, alibi = primals
  _, t_out = jax.jvp(functools.partial(backward, spec=spec, segments=segments, alibi=alibi),
                     tuple(arrays), tuple(tangents[:-2]))
  return out, t_out


# ------------------------------------------------------------------ the tangent primitive

tangent_p = jax.extend.core.Primitive("jaxflash_attention_tangent")
tangent_p.multiple_results = True


def output_tangents(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, *, kernels, spec,
                    segments=None, alibi=None):
  """(tO, tLSE) of the fused call whose outputs are (o, lse)."""
  return tuple(tangent_p.bind(q, k, v, o, lse, q_lengths, kv_lengths,
                              *_segments.operands(segments), reference.alibi_operand(alibi),
                              tq, tk, tv, kernels=kernels, spec=spec))


# The primitive's operands: q, k, v, o, lse, the lengths, the two segment tables
# and the ALiBi slopes (empty arrays for none), then tq, tk, tv.
_EXTRAS = slice(7, 10)


def _extras(q_table, kv_table, slopes):
  """(segments, alibi) keywords from the primitive's three extra operands."""
  return dict(segments=_segments.from_operands(q_table, kv_table),
              alibi=None if slopes.size == 0 else slopes)


def _tangent_impl(q, k, v, o, lse, q_lengths, kv_lengths, q_table, kv_table, slopes, tq, tk, tv, *,
                  kernels, spec):
  # Kernels with a tangent pass of their own (Pallas, ring attention's
  # shards) use it; for the others the blockwise jnp one is exact.
  fn = kernels.tangent if hasattr(kernels, "tangent") else tangent
  return fn(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, spec=spec,
            **_extras(q_table, kv_table, slopes))


def _tangent_abstract(*args, kernels, spec):
  del kernels, spec
  o, lse = args[3], args[4]
  # Typed like the primal outputs, whose type inside shard_map (the manual
  # axes they vary over) the tangents share.
  return o.update(weak_type=False), lse.update(weak_type=False)


def _tangent_transpose(cts, q, k, v, o, lse, q_lengths, kv_lengths, q_table, kv_table, slopes,
                       tq, tk, tv, *, kernels, spec):
  """The transpose of tQ, tK, tV -> (tO, tLSE): the kernels' backward."""
  ct_o, ct_lse = (ad.instantiate_zeros(ct) for ct in cts)
  extras = _extras(q_table, kv_table, slopes)
  grads = kernel_backward(q, k, v, o, lse, ct_o, ct_lse, q_lengths, kv_lengths,
                          extras["segments"], extras["alibi"], kernels, spec)
  return [None] * 10 + [g if ad.is_undefined_primal(t) else None
                       for g, t in zip(grads, (tq, tk, tv))]


def _tangent_batch(args, dims, *, kernels, spec):
  """vmap folds the mapped axis into the batch, as the FFI calls do."""
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)

  def fold(x, d):  # d is None for an unmapped operand
    x = jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
    return x.reshape((size * x.shape[1],) + x.shape[2:])

  folded = [fold(x, d) for x, d in zip(args, dims)]
  t_o, t_lse = output_tangents(*folded[:7], *folded[10:], kernels=kernels, spec=spec,
                               **_extras(*folded[_EXTRAS]))
  unfold = lambda x: x.reshape((size, x.shape[0] // size) + x.shape[1:])
  return (unfold(t_o), unfold(t_lse)), (0, 0)


def _tangent_jvp(primals, tangents, *, kernels, spec):
  """Forward over forward: the blockwise tangent differentiated like any jnp."""
  del kernels
  tangents = [np.zeros(x.shape, jax.dtypes.float0) if not jnp.issubdtype(x.dtype, jnp.floating)
                   else ad.instantiate_zeros(t) for x, t in zip(primals, tangents)]
  primals = list(primals)
  extras = _extras(*primals[_EXTRAS])
  del primals[_EXTRAS], tangents[_EXTRAS]
  out, t_out = jax.jvp(functools.partial(tangent, spec=spec, **extras), tuple(primals),
                       tuple(tangents))
  return list(out), list(t_out)


tangent_p.def_impl(_tangent_impl)
tangent_p.def_abstract_eval(_tangent_abstract)
mlir.register_lowering(tangent_p, mlir.lower_fun(_tangent_impl, multiple_results=True))
ad.primitive_transposes[tangent_p] = _tangent_transpose
ad.primitive_jvps[tangent_p] = _tangent_jvp
batching.primitive_batchers[tangent_p] = _tangent_batch
