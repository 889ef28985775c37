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
    reference.soft_cap, times its slope; ALiBi adds a constant to S, a dense
    bias B adds B to S and its tangent tB to tS; a dense mask hides pairs)
    tLSE = Σ_j P tS,   tO = Σ_j P (tS V_j + tV_j) - tLSE O.

The transpose with respect to tB is the bias gradient dB = dS = P (dP - delta)
reduced over the bias's broadcast axes (`bias_gradient`): the kernels compute
dQ, dK and dV, a pass of their own dB where they have one (else this blockwise
one), and only when the bias is differentiated. Kernels that emit dB beside dQ,
dK and dV (`emits_db`: the native Hopper dense tiles, the CPU backward) give it
with no pass of its own where both are wanted (`_joint_backward`).
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad, batching, mlir

from jaxflash import dense as _dense, reference, segments as _segments

_BLOCK = 128  # keys per scan step
_HIGHEST = lax.Precision.HIGHEST


# ------------------------------------------------------------------ the blockwise computations

class _KeyBlocks:
  """A call's geometry, cut into blocks of keys, in `dtype` with the query
  heads grouped over their key/value head ([B, T, K, G, H])."""

  # The operands' type in the products: float32 (IEEE products, HIGHEST), or for the
  # bias gradient of 16-bit calls the inputs' own type with float32 sums, as the
  # kernels multiply (`_ScoreGradients`).
  dtype = jnp.float32

  def __init__(self, q, k, q_lengths, kv_lengths, spec, offsets=None, segments=None, alibi=None,
               dense=None, block=_BLOCK):
    self.B, self.T, self.N, self.H = q.shape
    self.S, self.K = k.shape[1], k.shape[2]
    self.G = self.N // self.K
    self.block = min(block, max(self.S, 1))
    self.count = -(-self.S // self.block)
    self.q_lengths = reference.given_lengths(q_lengths)
    self.kv_lengths = reference.given_lengths(kv_lengths)
    self.spec = spec
    self.offsets = offsets   # the kernels' diagonal offsets (params.h); None: 0
    # The segment tables' (q_ids, kv_ids), or None.
    self.segments = None if segments is None else _segments.ids_of(segments)
    self.alibi = alibi       # ALiBi slopes [B, N] float32, or None
    self.dense = dense       # the call's dense bias / mask (dense.py), or None

  def grouped(self, x):
    """[B, T, N, H] -> [B, T, K, G, H] in `dtype` (H: x's own, the value's for o and dO)."""
    return x.astype(self.dtype).reshape(self.B, self.T, self.K, self.G, x.shape[-1])

  def rows(self, x):
    """[B, N, T] -> [B, K, G, T] float32."""
    return x.astype(jnp.float32).reshape(self.B, self.K, self.G, self.T)

  def split(self, x):
    """[B, S, K, H] -> [blocks, B, block, K, H] float32, zero past S."""
    pad = self.count * self.block - self.S
    x = jnp.pad(x.astype(self.dtype), ((0, 0), (0, pad), (0, 0), (0, 0)))
    return jnp.moveaxis(x.reshape(self.B, self.count, self.block, self.K, x.shape[-1]), 1, 0)

  def join(self, x, dtype):
    """[blocks, B, block, K, H] -> [B, S, K, H] in dtype."""
    x = jnp.moveaxis(x, 0, 1).reshape(self.B, self.count * self.block, self.K, x.shape[-1])
    return x[:, :self.S].astype(dtype)

  def visible(self, j0):
    """Boolean [B, 1, 1, T, block]: the pairs of key block [j0, j0 + block)."""
    left, right = self.spec.window_left, self.spec.window_right
    vis = reference.visible_mask(
        self.T, self.S, query_seq_lengths=self.q_lengths, key_value_seq_lengths=self.kv_lengths,
        window_left=None if left < 0 else left, window_right=None if right < 0 else right,
        bottom_right=self.spec.bottom_right, batch=self.B,
        keys=j0 + jnp.arange(self.block, dtype=jnp.int32), diagonal_offsets=self.offsets,
        segment_ids=self.segments)[:, :, None]
    mask = self.dense_block("mask", j0)
    return vis if mask is None else vis & mask

  def product(self, spec: str, a, b):
    """A float32 einsum of two operands of `dtype`."""
    precision = _HIGHEST if self.dtype == jnp.float32 else lax.Precision.DEFAULT
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)

  def dense_block(self, name: str, j0):
    """Key block j0 of the call's dense bias or mask (`name`), broadcastable to
    [B, K, G, T, block]; None when the call has none."""
    x = None if self.dense is None else getattr(self.dense, name)
    return None if x is None else _dense.key_block(x, self.N, self.K, j0, self.block)

  def starts(self):
    return jnp.arange(self.count, dtype=jnp.int32) * self.block

  def probabilities(self, q, k, lse, vis, j0):
    """(P, slope) [B, K, G, T, block]: P = exp(S - LSE) of the visible pairs, with S the
    (soft-capped, ALiBi-biased) scores of key block j0, and dS / d(c q.k), the cap's
    slope (None without a cap)."""
    s = reference.soft_cap(self.product("btkgh,bskh->bkgts", q, k) * self.spec.scale,
                           self.spec.softcap)
    slope = reference.soft_cap_slope(s, self.spec.softcap)
    if self.alibi is not None:
      bias = reference.alibi_bias(
          self.alibi, self.T, self.S, query_seq_lengths=self.q_lengths,
          key_value_seq_lengths=self.kv_lengths, bottom_right=self.spec.bottom_right,
          batch=self.B, keys=j0 + jnp.arange(self.block, dtype=jnp.int32),
          diagonal_offsets=self.offsets)
      s = s + bias.reshape(self.B, self.K, self.G, self.T, self.block)
    bias = self.dense_block("bias", j0)
    if bias is not None:
      s = s + bias.astype(jnp.float32)
    # exp sees visible pairs only; rows with no key (LSE = the empty value)
    # have none, so nothing overflows.
    p = jnp.where(vis, jnp.exp(jnp.where(vis, s - lse[..., None], 0)), 0)
    return p, slope


def tangent_sums(q, k, v, lse, q_lengths, kv_lengths, tq, tk, tv, *, spec, offsets=None,
                 segments=None, alibi=None, dense=None, t_bias=None):
  """The three sums over keys of the tangent, float32: (Σ_j P (tS V_j + tV_j)
  [B, T, N, H], tLSE = Σ_j P tS [B, N, T], O = Σ_j P V_j [B, T, N, H]).

  With the LSE of the whole row given, all are sums over keys, so a call over
  part of the keys (a ring block, placed by `offsets`, the kernels' per-batch
  diagonal offsets; None for 0) gives that part's share exactly. `t_bias` is the
  tangent of the dense bias (shaped like it), None for none.
  """
  g = _KeyBlocks(q, k, q_lengths, kv_lengths, spec, offsets, segments, alibi, dense)
  qg, tqg = g.grouped(q), g.grouped(tq)

  def step(carry, block):
    acc, t_lse, o_sum = carry
    kb, vb, tkb, tvb, j0 = block
    vis = g.visible(j0)
    p, slope = g.probabilities(qg, kb, g.rows(lse), vis, j0)
    ts = spec.scale * (jnp.einsum("btkgh,bskh->bkgts", tqg, kb, precision=_HIGHEST) +
                       jnp.einsum("btkgh,bskh->bkgts", qg, tkb, precision=_HIGHEST))
    ts = ts if slope is None else ts * slope
    if t_bias is not None:
      ts = ts + _dense.key_block(t_bias, g.N, g.K, j0, g.block).astype(jnp.float32)
    pts = jnp.where(vis, p * ts, 0)
    acc = acc + (jnp.einsum("bkgts,bskh->btkgh", pts, vb, precision=_HIGHEST) +
                 jnp.einsum("bkgts,bskh->btkgh", p, tvb, precision=_HIGHEST))
    o_sum = o_sum + jnp.einsum("bkgts,bskh->btkgh", p, vb, precision=_HIGHEST)
    return (acc, t_lse + pts.sum(-1), o_sum), None

  # Zeros made from the operands, so that inside shard_map the carry varies
  # over the same manual axes as the sums (ring attention's blocks).
  # (The output sums take the value's head dim.)
  out = jnp.zeros_like(qg[..., :1]) + jnp.zeros(v.shape[-1], qg.dtype)
  init = (out, jnp.zeros_like(g.rows(lse)), out)
  (acc, t_lse, o_sum), _ = lax.scan(step, init, (g.split(k), g.split(v), g.split(tk),
                                                 g.split(tv), g.starts()))
  o_shape = q.shape[:-1] + v.shape[-1:]
  return acc.reshape(o_shape), t_lse.reshape(lse.shape), o_sum.reshape(o_shape)


def finish_tangent(sums, t_lse, o_sum, dtype):
  """tO = sums - tLSE O in `dtype`, from `tangent_sums`' three results.

  O is the float32 sum, not the call's output: rounded to 16 bits it would
  cost |tLSE| / 512 of an output ulp-scale error where tLSE is large and the
  two terms nearly cancel (one dominant key).
  """
  t_o = sums - jnp.transpose(t_lse, (0, 2, 1))[..., None] * o_sum
  return t_o.astype(dtype)


def tangent(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, *, spec, offsets=None,
            segments=None, alibi=None, dense=None, t_bias=None):
  """(tO [B, T, N, H] in o's dtype, tLSE [B, N, T] float32), linear in tq, tk, tv
  (and `t_bias`, the dense bias's tangent, None for none).

  `offsets` are the kernels' per-batch diagonal offsets (params.h), None for 0;
  `segments` the call's segment tables (segments.py), None without; `alibi` its ALiBi
  slopes [B, N], None without; `dense` its dense bias / mask (dense.py), None without.
  Only o's dtype is read (see `finish_tangent`).
  """
  sums, t_lse, o_sum = tangent_sums(q, k, v, lse, q_lengths, kv_lengths, tq, tk, tv, spec=spec,
                                    offsets=offsets, segments=segments, alibi=alibi, dense=dense,
                                    t_bias=t_bias)
  return finish_tangent(sums, t_lse, o_sum, o.dtype), t_lse


class _ScoreGradients(_KeyBlocks):
  """The backward's blocks: dS = P (dP - delta) of key block j0 with the rows' delta."""

  def __init__(self, q, k, o, lse, do, dlse, q_lengths, kv_lengths, spec, offsets, segments,
               alibi, dense, dtype=jnp.float32, block=_BLOCK):
    self.dtype = dtype
    super().__init__(q, k, q_lengths, kv_lengths, spec, offsets, segments, alibi, dense, block)
    self.qg, self.dog = self.grouped(q), self.grouped(do)
    self.lse_g = self.rows(lse)
    delta = (self.product("btkgh,btkgh->bkgt", self.dog, self.grouped(o)) - self.rows(dlse))
    # Rows that see no key carry no gradient.
    self.delta = jnp.where(self.lse_g == reference.empty_lse(jnp.float32), 0, delta)

  def scores_of(self, kb, vb, j0, rows=slice(None)):
    """(P, dS with respect to the score, dS with respect to scale * q.k) [B, K, G, T,
    block], zero on hidden pairs; the two differ by a soft-cap's slope. `rows`: a static
    slice of the query rows (calls without ALiBi), T its length then."""
    vis = self.visible(j0)[..., rows, :]
    p, slope = self.probabilities(self.qg[:, rows], kb, self.lse_g[..., rows], vis, j0)
    dp = self.product("btkgh,bskh->bkgts", self.dog[:, rows], vb)
    ds = jnp.where(vis, p * (dp - self.delta[..., rows, None]), 0)
    # The cap's slope of a hidden pair may be NaN (a padded key): it never multiplies in.
    return p, ds, (ds if slope is None else jnp.where(vis, ds * slope, 0))


def backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, *, spec, offsets=None,
             segments=None, alibi=None, dense=None, dtype=jnp.float32, block=_BLOCK, rows=None):
  """(dQ, dK, dV) as the kernels' backward computes them, in jnp (`offsets`,
  `segments`, `alibi` and `dense` as for `tangent`): `block` keys a step, products of
  `dtype` operands (float32: IEEE; a 16-bit type: P and dS rounded to it, as the
  kernels multiply) with float32 sums. A scan over the key blocks; or, given `rows`
  (no ALiBi or dense terms), groups (j0, j1, lo, hi) of consecutive key blocks [j0, j1)
  whose steps visit only the query rows [lo, hi) (static: a scan's steps share one
  shape), a scan a group and a plain step for a group of one block."""
  g = _ScoreGradients(q, k, o, lse, do, dlse, q_lengths, kv_lengths, spec, offsets, segments,
                      alibi, dense, dtype, block)

  def grads(kb, vb, j0, part=slice(None)):   # dQ's share of rows `part`, dK and dV of the block
    p, _, ds = g.scores_of(kb, vb, j0, part)
    p, ds = p.astype(g.dtype), ds.astype(g.dtype)
    return (spec.scale * g.product("bkgts,bskh->btkgh", ds, kb),
            spec.scale * g.product("bkgts,btkgh->bskh", ds, g.qg[:, part]),
            g.product("bkgts,btkgh->bskh", p, g.dog[:, part]))

  def scan(dq, blocks, part=slice(None)):
    def step(dq, block):
      dq_part, dk, dv = grads(*block, part)
      return dq + dq_part, (dk, dv)
    return lax.scan(step, dq, blocks)

  ks, vs, starts, dq = g.split(k), g.split(v), g.starts(), jnp.zeros_like(g.qg, jnp.float32)
  if rows is None:
    dq, (dk, dv) = scan(dq, (ks, vs, starts))
  else:
    assert alibi is None and dense is None
    dk, dv = jnp.zeros_like(ks, jnp.float32), jnp.zeros_like(vs, jnp.float32)
    for j0, j1, lo, hi in rows:
      if hi <= lo:   # no row sees these keys
        continue
      part = slice(lo, hi)
      if j1 - j0 == 1:
        dq_part, dk_j, dv_j = grads(ks[j0], vs[j0], j0 * g.block, part)
        dk_j, dv_j = dk_j[None], dv_j[None]
      else:
        dq_part, (dk_j, dv_j) = scan(jnp.zeros_like(g.qg[:, part], jnp.float32),
                                     (ks[j0:j1], vs[j0:j1], starts[j0:j1]), part)
      # Static slices through lax: `.at[:, lo:hi].add` lowers to a scatter whose empty index
      # array is a constant, which custom_partitioning's rules (several devices) refuse.
      dq = lax.dynamic_update_slice_in_dim(dq, lax.slice_in_dim(dq, lo, hi, axis=1) + dq_part, lo, axis=1)
      dk, dv = (lax.dynamic_update_slice_in_dim(x, x_j, j0, axis=0) for x, x_j in ((dk, dk_j), (dv, dv_j)))
  return dq.reshape(q.shape).astype(q.dtype), g.join(dk, k.dtype), g.join(dv, v.dtype)


def bias_gradient(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, *, spec, dense,
                  offsets=None, segments=None, alibi=None):
  """The gradient of the dense bias `dense.bias` [Bb, Nb, Tb, Sb], in its dtype: the
  score gradient dS of every pair, summed over the bias's broadcast axes block by
  block (memory: dB and one [B, N, T, 128] block). The products of 16-bit calls take
  their operands as they are with float32 sums, like the kernels (with float32 IEEE
  products the pass took ~9 of a 16 ms forward+backward on an H200 at S 4k, D 128).
  A bias of one key has its gradient in closed form (`dense.gradient_over_keys`)."""
  if dense.bias.shape[-1] == 1:
    return _dense.gradient_over_keys(o, lse, do, dlse, dense.bias.shape).astype(dense.bias.dtype)
  g = _ScoreGradients(q, k, o, lse, do, dlse, q_lengths, kv_lengths, spec, offsets, segments,
                      alibi, dense, dtype=q.dtype if q.dtype.itemsize == 2 else jnp.float32)
  bias = dense.bias
  Bb, Nb, Tb, Sb = bias.shape
  block_shape = (Bb, Nb, Tb, g.block if Sb > 1 else 1)

  def step(total, block):
    kb, vb, j0 = block
    _, ds, _ = g.scores_of(kb, vb, j0)
    ds = _dense.reduce_to(ds.reshape(g.B, g.N, g.T, g.block), block_shape)
    return (total + ds, None) if Sb == 1 else (total, ds)

  total, blocks = lax.scan(step, jnp.zeros(block_shape if Sb == 1 else (), jnp.float32),
                           (g.split(k), g.split(v), g.starts()))
  if Sb > 1:
    total = jnp.moveaxis(blocks, 0, 3).reshape(Bb, Nb, Tb, g.count * g.block)[..., :Sb]
  return total.astype(bias.dtype)


# ------------------------------------------------------------------ the kernels' backward, differentiable

@functools.partial(jax.custom_jvp, nondiff_argnums=(12, 13))
def kernel_backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, segments, alibi, dense,
                    kernels, spec):
  """(dQ, dK, dV) from the kernels, differentiable by the blockwise backward."""
  return kernels.backward(q, k, v, o, lse, do.astype(q.dtype), dlse.astype(jnp.float32),
                          q_lengths, kv_lengths, spec, segments=segments, alibi=alibi,
                          dense=dense)


@kernel_backward.defjvp
def _kernel_backward_jvp(kernels, spec, primals, tangents):
  if not getattr(kernels, "second_order", True):
    raise NotImplementedError(f"{kernels.name}: second derivatives (jvp of grad, Hessians) are "
                              "not available for this call; ring attention has first ones only")
  out = kernel_backward(*primals, kernels, spec)
  *arrays, segments, alibi, dense = primals
  t_dense = tangents[-1]
  if dense is None or dense.bias is None:
    fn = functools.partial(backward, spec=spec, segments=segments, alibi=alibi, dense=dense)
    _, t_out = jax.jvp(fn, tuple(arrays), tuple(tangents[:-3]))
  else:  # the bias is an input of the backward too
    fn = lambda *xs: backward(*xs[:-1], spec=spec, segments=segments, alibi=alibi,
                              dense=_dense.Dense(xs[-1], dense.mask))
    _, t_out = jax.jvp(fn, (*arrays, dense.bias), (*tangents[:-3], t_dense.bias))
  return out, t_out


# ------------------------------------------------------------------ the tangent primitive

tangent_p = jax.extend.core.Primitive("jaxflash_attention_tangent")
tangent_p.multiple_results = True


def output_tangents(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, *, kernels, spec,
                    segments=None, alibi=None, dense=None, t_bias=None):
  """(tO, tLSE) of the fused call whose outputs are (o, lse); `t_bias` is the tangent
  of `dense.bias` (None: the call has no bias)."""
  t_bias = _dense.operands(None)[0] if t_bias is None else t_bias
  return tuple(tangent_p.bind(q, k, v, o, lse, q_lengths, kv_lengths,
                              *_segments.operands(segments), reference.alibi_operand(alibi),
                              *_dense.operands(dense), tq, tk, tv, t_bias,
                              kernels=kernels, spec=spec))


# The primitive's operands: q, k, v, o, lse, the lengths, the two segment tables,
# the ALiBi slopes, the dense bias and mask (empty arrays for none), then tq, tk, tv
# and the bias's tangent (empty without a bias).
_EXTRAS = slice(7, 12)


def _extras(q_table, kv_table, slopes, bias, mask):
  """(segments, alibi, dense) keywords from the primitive's five extra operands."""
  return dict(segments=_segments.from_operands(q_table, kv_table),
              alibi=None if slopes.size == 0 else slopes,
              dense=_dense.from_operands(bias, mask))


def _tangent_impl(q, k, v, o, lse, q_lengths, kv_lengths, q_table, kv_table, slopes, bias, mask,
                  tq, tk, tv, t_bias, *, kernels, spec):
  extras = _extras(q_table, kv_table, slopes, bias, mask)
  # Kernels with a tangent pass of their own (Pallas, ring attention's shards) use it
  # where it takes the call; for the others the blockwise jnp one is exact.
  if hasattr(kernels, "tangent") and extras["dense"] is None:
    del extras["dense"]
    return kernels.tangent(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, spec=spec,
                           **extras)
  return tangent(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, spec=spec,
                 t_bias=None if t_bias.size == 0 else t_bias, **extras)


def _tangent_abstract(*args, kernels, spec):
  del kernels, spec
  o, lse = args[3], args[4]
  # Typed like the primal outputs, whose type inside shard_map (the manual
  # axes they vary over) the tangents share.
  return o.update(weak_type=False), lse.update(weak_type=False)


def _tangent_transpose(cts, q, k, v, o, lse, q_lengths, kv_lengths, q_table, kv_table, slopes,
                       bias, mask, tq, tk, tv, t_bias, *, kernels, spec):
  """The transpose of tQ, tK, tV, tBias -> (tO, tLSE): the kernels' backward, and the
  bias gradient where the bias is differentiated."""
  ct_o, ct_lse = (ad.instantiate_zeros(ct) for ct in cts)
  extras = _extras(q_table, kv_table, slopes, bias, mask)
  args = (q, k, v, o, lse, ct_o, ct_lse, q_lengths, kv_lengths, q_table, kv_table, slopes, bias, mask)
  wanted = [ad.is_undefined_primal(t) for t in (tq, tk, tv, t_bias)]
  if (any(wanted[:3]) and wanted[3] and not _explicitly_sharded(args)
      and getattr(kernels, "emits_db", lambda *a, **kw: False)(q, k, v, spec, **extras)):
    grads = _joint_backward(kernels, spec)(*args)   # (dQ, dK, dV: computed together anyway)
    return [None] * 12 + [g if w else None for g, w in zip(grads, wanted)]
  grads = [None] * 3
  if any(wanted[:3]):
    grads = kernel_backward(q, k, v, o, lse, ct_o, ct_lse, q_lengths, kv_lengths,
                            extras["segments"], extras["alibi"], extras["dense"], kernels, spec)
  d_bias = None
  if wanted[3]:
    d_bias = _outside_explicit_axes(_bias_gradient_of(kernels, spec, bias.shape[-1]), args, bias)
  return [None] * 12 + [g if ad.is_undefined_primal(t) else None
                        for g, t in zip(grads, (tq, tk, tv))] + [d_bias]


def _bias_gradient_of(kernels, spec, keys: int):
  """fn(q, k, v, o, lse, do, dlse, lengths, tables, slopes, bias, mask) -> dB: the kernels'
  own pass where they have one (`bias_gradient`: the native CPU kernels, Pallas), vmapped and
  differentiated as the blockwise `bias_gradient`, the definition; else that one."""
  blockwise = lambda *xs: bias_gradient(*xs[:9], spec=spec, **_extras(*xs[9:]))  # noqa: E731
  own = getattr(kernels, "bias_gradient", None)
  if own is None or keys == 1:   # one key: bias_gradient's closed form
    return blockwise

  @jax.custom_batching.custom_vmap
  def run(*xs):
    return own(*xs[:9], spec=spec, **_extras(*xs[9:]))

  @run.def_vmap
  def _vmap(axis_size, in_batched, *xs):
    del axis_size
    return jax.vmap(blockwise, in_axes=[0 if b else None for b in in_batched])(*xs), True

  fn = jax.custom_jvp(lambda *xs: run(*xs))
  fn.defjvp(lambda primals, tangents: jax.jvp(blockwise, primals, tangents))
  return fn


def _joint_backward(kernels, spec):
  """fn(q, k, v, o, lse, do, dlse, lengths, tables, slopes, bias, mask) -> (dQ, dK, dV, dB)
  from one kernel pass that emits dB beside dQ, dK and dV; vmapped and differentiated
  as the separate passes."""
  def separate(*xs):
    extras = _extras(*xs[9:])
    grads = kernel_backward(*xs[:9], extras["segments"], extras["alibi"], extras["dense"], kernels, spec)
    return (*grads, _bias_gradient_of(kernels, spec, xs[12].shape[-1])(*xs))

  @jax.custom_batching.custom_vmap
  def run(*xs):
    q = xs[0]
    return kernels.backward(*xs[:5], xs[5].astype(q.dtype), xs[6].astype(jnp.float32),
                            *xs[7:9], spec, with_db=True, **_extras(*xs[9:]))

  @run.def_vmap
  def _vmap(axis_size, in_batched, *xs):
    del axis_size
    return jax.vmap(separate, in_axes=[0 if b else None for b in in_batched])(*xs), (True,) * 4

  fn = jax.custom_jvp(lambda *xs: run(*xs))
  fn.defjvp(lambda primals, tangents: jax.jvp(separate, primals, tangents))
  return fn


def _explicitly_sharded(args) -> bool:
  """Whether an argument's type is sharded over a mesh's explicit axes."""
  for x in args:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if (any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
        and any(e is not None for e in sharding.spec)):
      return True
  return False


def _outside_explicit_axes(fn, args, like):
  """fn(*args), with the mesh's explicit axes made automatic where an argument's type is
  sharded over them (a blockwise jnp pass over sequence-sharded operands is refused
  there), its result typed like `like`."""
  if _explicitly_sharded(args):
    return jax.sharding.auto_axes(fn, out_sharding=jax.typeof(like).sharding)(*args)
  return fn(*args)


def _tangent_batch(args, dims, *, kernels, spec):
  """vmap folds the mapped axis into the batch, as the FFI calls do."""
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)

  def fold(x, d):  # d is None for an unmapped operand
    x = jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
    return x.reshape((size * x.shape[1],) + x.shape[2:])

  B = (args[0].shape if dims[0] is None else np.delete(args[0].shape, dims[0]))[0]  # q's batch

  # A bias is folded like its tangent (a mapped tangent gives every folded batch element
  # its own gradient, so the bias takes the folded batch too).
  t_bias_mapped = dims[15] is not None and args[15].size > 0

  def fold_dense(x, d, force=False):
    """A bias, mask or bias tangent [Bb, ...]: a batch of one stays one unless the
    vmapped axis varies it (then it is broadcast to B, like the folded q)."""
    if x.size == 0 or d is None and x.shape[0] == 1 and not force:
      return x
    if d is None:
      x = jnp.broadcast_to(x, (size,) + x.shape)
    else:
      x = jnp.moveaxis(x, d, 0)
    x = jnp.broadcast_to(x, (size, B) + x.shape[2:])
    return x.reshape((size * B,) + x.shape[2:])

  folded = [fold_dense(x, d, force=i == 10 and t_bias_mapped) if i in (10, 11, 15)
            else fold(x, d) for i, (x, d) in enumerate(zip(args, dims))]
  extras = _extras(*folded[_EXTRAS])
  t_bias = folded[15]
  t_o, t_lse = output_tangents(*folded[:7], *folded[12:15], kernels=kernels, spec=spec,
                               t_bias=None if t_bias.size == 0 else t_bias, **extras)
  unfold = lambda x: x.reshape((size, x.shape[0] // size) + x.shape[1:])
  return (unfold(t_o), unfold(t_lse)), (0, 0)


def _tangent_jvp(primals, tangents, *, kernels, spec):
  """Forward over forward: the blockwise tangent differentiated like any jnp."""
  del kernels
  tangents = [np.zeros(x.shape, jax.dtypes.float0) if not jnp.issubdtype(x.dtype, jnp.floating)
              else ad.instantiate_zeros(t) for x, t in zip(primals, tangents)]
  q_table, kv_table, slopes, _, mask = primals[_EXTRAS]

  def fn(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, bias, t_bias):
    return tangent(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, spec=spec,
                   t_bias=None if t_bias.size == 0 else t_bias,
                   **_extras(q_table, kv_table, slopes, bias, mask))

  order = (0, 1, 2, 3, 4, 5, 6, 12, 13, 14, 10, 15)  # fn's arguments among the operands
  out, t_out = jax.jvp(fn, tuple(primals[i] for i in order), tuple(tangents[i] for i in order))
  return list(out), list(t_out)


tangent_p.def_impl(_tangent_impl)
tangent_p.def_abstract_eval(_tangent_abstract)
mlir.register_lowering(tangent_p, mlir.lower_fun(_tangent_impl, multiple_results=True))
ad.primitive_transposes[tangent_p] = _tangent_transpose
ad.primitive_jvps[tangent_p] = _tangent_jvp
batching.primitive_batchers[tangent_p] = _tangent_batch
