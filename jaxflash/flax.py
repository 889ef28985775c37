"""Flax integration: an ``attention_fn`` for Flax's attention modules and ready layers.

Import it explicitly (the core package never imports Flax)::

    import jaxflash.flax

Two ways in:

* ``jaxflash.flax.dot_product_attention`` takes the arguments Flax's
  ``attention_fn`` receives, so it plugs into ``flax.nnx.MultiHeadAttention``
  and ``flax.linen.MultiHeadDotProductAttention`` unchanged::

      attn = nnx.MultiHeadAttention(..., attention_fn=jaxflash.flax.dot_product_attention)
      y = attn(x, is_causal=True)          # instead of mask=nnx.make_causal_mask(...)

  ``make_attention_fn(is_causal=..., local_window_size=...)`` fixes options for
  modules that do not forward them (Linen).

* Ready layers with causal / sliding-window / GQA options built in, so no
  dense mask is ever made: ``MultiHeadAttention`` (NNX; same parameters as
  ``nnx.MultiHeadAttention``) and ``LinenMultiHeadAttention`` (Linen; same
  parameters as ``linen.MultiHeadDotProductAttention``, plus ``num_kv_heads``).

Their state holds only ordinary Flax parameters, so checkpoints move freely
between a model that uses ``jax.nn.dot_product_attention`` and the same model on
jaxflash.

Masks: a boolean (or 0/1) ``mask`` is honoured exactly, and with a ``bias``
runs fused (the CPU kernels; Pallas on a GPU, whose CUDA kernels take neither
yet): read tile by tile, never a score matrix. A mask known at trace time (a
concrete array) that is all-true or exactly the causal ``tril`` is recognised
and replaced by nothing or ``is_causal=True``, which needs no mask read at all.
For speed, say ``is_causal=True`` (or use the ready layers) instead of building
a mask.

Differences from Flax's stock attention: a query row that can see no key
returns zeros (Flax averages the values of such a row); ``precision`` is
ignored (the kernels accumulate in float32); attention dropout and sowing the
attention weights are not supported and raise ``ValueError``.
"""

from __future__ import annotations

import contextvars
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from jaxflash.attention import dot_product_attention as _attention

__all__ = ["dot_product_attention", "make_attention_fn", "MultiHeadAttention",
           "LinenMultiHeadAttention"]


# ------------------------------------------------------------------ attention_fn

def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _prepare_mask(mask, T: int, S: int, is_causal: bool):
  """A boolean mask (nonzero = attend), with a concrete all-true or causal mask folded away.

  Returns (mask or None, is_causal). Only a mask known at trace time can be
  inspected; a traced one is only converted to boolean.
  """
  if not _is_concrete(mask):
    return (mask if mask.dtype == jnp.bool_ else mask != 0), is_causal
  m = np.asarray(mask) != 0
  if m.all():
    return None, is_causal
  if m.ndim >= 2 and m.shape[-2:] == (T, S) and (m == np.tril(np.ones((T, S), bool))).all():
    return None, True
  return m, is_causal


def _flatten_batch(x, batch_shape, tail_ndim):
  """Broadcast `x` to `batch_shape + x.shape[-tail_ndim:]` and fold the batch axes into one."""
  if x is None:
    return None
  x = x.reshape((1,) * (len(batch_shape) + tail_ndim - x.ndim) + x.shape)
  x = jnp.broadcast_to(x, tuple(batch_shape) + x.shape[-tail_ndim:])
  return x.reshape((math.prod(batch_shape),) + x.shape[-tail_ndim:])


def dot_product_attention(
    query, key, value, bias=None, mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype: Callable | None = None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum: Callable | None = None,
    attn_weights_value_einsum: Callable | None = None,
    *,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    query_segment_ids=None,
    key_value_segment_ids=None,
    alibi_slopes=None,
):
  """Flax-compatible attention on jaxflash; use it as an ``attention_fn``.

  Takes what ``flax.nnx.MultiHeadAttention`` and
  ``flax.linen.MultiHeadDotProductAttention`` pass (``[batch..., length, heads,
  head_dim]`` query/key/value, ``mask``, ``bias``, dropout arguments, ``dtype``,
  ``precision``, ``module``, ``is_causal``) and computes what Flax's
  ``dot_product_attention`` computes, without the score matrix.

  Args:
    query, key, value: ``[batch..., T, N, H]``, ``[batch..., S, K, H]`` with
      ``N`` a multiple of ``K`` (GQA).
    bias: additive, broadcastable to ``[batch..., N, T, S]``.
    mask: True/nonzero = attend, broadcastable to ``[batch..., N, T, S]``
      (e.g. from ``make_causal_mask``/``make_attention_mask``).
    dropout_rate, deterministic, dropout_rng, broadcast_dropout: attention
      dropout is not supported: ``dropout_rate > 0`` with ``deterministic``
      False raises ``ValueError``; otherwise they are ignored.
    dtype: compute dtype; query/key/value are promoted to it (default: their
      common dtype), as Flax does.
    precision: accepted and ignored (float32 accumulation always).
    module: Flax passes the module when asked to sow the attention weights,
      which jaxflash never forms: a non-None ``module`` raises ``ValueError``.
    promote_dtype: Flax's dtype promotion hook (NNX); defaults to a common dtype.
    is_causal: top-left causal mask, as in ``jax.nn.dot_product_attention``.
    force_fp32_for_softmax: accepted; the softmax is float32 always.
    qk_attn_weights_einsum, attn_weights_value_einsum: custom einsums cannot
      be honoured; anything but None raises ``ValueError``.
    local_window_size, implementation, query_seq_lengths,
      key_value_seq_lengths, scale, logits_soft_cap, query_segment_ids,
      key_value_segment_ids, alibi_slopes: passed to
      :func:`jaxflash.dot_product_attention` (lengths and segment ids shaped by
      the batch axes; ALiBi slopes ``[heads]`` or ``[batch..., heads]``).

  Returns:
    ``[batch..., T, N, H]`` in the compute dtype.
  """
  if dropout_rate and not deterministic:
    raise ValueError(
        "jaxflash.flax.dot_product_attention does not implement attention dropout: got "
        f"dropout_rate={dropout_rate} with deterministic=False. Set the module's dropout_rate "
        "to 0 (or call it with deterministic=True)")
  if module is not None:
    raise ValueError(
        "jaxflash never forms the attention weights, so they cannot be sown "
        "(sow_weights=True); use Flax's stock attention_fn to inspect them")
  if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
    raise ValueError("custom attention einsums (qk_attn_weights_einsum / "
                     "attn_weights_value_einsum) cannot be used with jaxflash")
  del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax

  if promote_dtype is not None:
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
  else:
    target = dtype if dtype is not None else jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, target) for x in (query, key, value))

  if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
    raise ValueError("query, key and value must have the same rank (at least 3: "
                     f"[batch..., length, heads, head_dim]); got {query.shape}, {key.shape}, "
                     f"{value.shape}")
  T, S = query.shape[-3], key.shape[-3]

  if mask is not None:
    mask, is_causal = _prepare_mask(mask, T, S, bool(is_causal))

  batch_shape = query.shape[:-3]
  if len(batch_shape) > 1:
    # jaxflash takes one batch axis: fold the others into it.
    q4 = _flatten_batch(query, batch_shape, 3)
    k4 = _flatten_batch(key, batch_shape, 3)
    v4 = _flatten_batch(value, batch_shape, 3)
    bias4 = _flatten_batch(bias, batch_shape, 3)
    mask4 = _flatten_batch(mask, batch_shape, 3)
    lengths = [None if x is None else jnp.reshape(jnp.broadcast_to(x, batch_shape), (-1,))
               for x in (query_seq_lengths, key_value_seq_lengths)]
    ids = [None if x is None else jnp.reshape(jnp.broadcast_to(x, batch_shape + x.shape[-1:]),
                                              (-1, x.shape[-1]))
           for x in (query_segment_ids, key_value_segment_ids)]
    if alibi_slopes is not None and jnp.ndim(alibi_slopes) > 1:
      alibi_slopes = jnp.reshape(alibi_slopes, (-1, jnp.shape(alibi_slopes)[-1]))
    out = _attention(q4, k4, v4, bias4, mask4, scale=scale, is_causal=bool(is_causal),
                     query_seq_lengths=lengths[0], key_value_seq_lengths=lengths[1],
                     local_window_size=local_window_size, implementation=implementation,
                     logits_soft_cap=logits_soft_cap, query_segment_ids=ids[0],
                     key_value_segment_ids=ids[1], alibi_slopes=alibi_slopes)
    return out.reshape(query.shape[:-1] + value.shape[-1:])

  return _attention(query, key, value, bias, mask, scale=scale, is_causal=bool(is_causal),
                    query_seq_lengths=query_seq_lengths,
                    key_value_seq_lengths=key_value_seq_lengths,
                    local_window_size=local_window_size, implementation=implementation,
                    logits_soft_cap=logits_soft_cap, query_segment_ids=query_segment_ids,
                    key_value_segment_ids=key_value_segment_ids, alibi_slopes=alibi_slopes)


def make_attention_fn(*, is_causal: bool = False,
                      local_window_size: int | tuple[int, int] | None = None,
                      implementation: str | None = None,
                      scale: float | None = None,
                      logits_soft_cap: float | None = None,
                      alibi_slopes=None) -> Callable[..., jax.Array]:
  """An ``attention_fn`` with jaxflash options fixed.

  For modules that do not forward ``is_causal`` (Linen's
  ``MultiHeadDotProductAttention``)::

      linen.MultiHeadDotProductAttention(
          num_heads=8, attention_fn=jaxflash.flax.make_attention_fn(is_causal=True))

  ``alibi_slopes`` (``[heads]``, constants of the model) gives a stock layer
  ALiBi: ``nnx.MultiHeadAttention(..., attention_fn=make_attention_fn(
  is_causal=True, alibi_slopes=slopes))``.

  ``is_causal=True`` here is combined (AND) with any mask or ``is_causal`` the
  module passes.
  """
  fixed_causal = bool(is_causal)

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, promote_dtype=None, is_causal=False,
                   force_fp32_for_softmax=False, qk_attn_weights_einsum=None,
                   attn_weights_value_einsum=None):
    return dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
        deterministic, dtype, precision, module, promote_dtype, fixed_causal or is_causal,
        force_fp32_for_softmax, qk_attn_weights_einsum, attn_weights_value_einsum,
        local_window_size=local_window_size, implementation=implementation, scale=scale,
        logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes)

  return attention_fn


# ------------------------------------------------------------------ NNX layer

# The segment ids of the NNX layer's call in progress: nnx.MultiHeadAttention's
# __call__ hands its attention_fn a fixed set of arguments, so the layer leaves
# its call's ids here for its own attention_fn to read (same trace, same thread).
_CALL_SEGMENT_IDS: contextvars.ContextVar = contextvars.ContextVar("segment_ids", default=None)


def _layer_attention(*args, **kwargs):
  q_ids, kv_ids = _CALL_SEGMENT_IDS.get() or (None, None)
  return dot_product_attention(*args, **kwargs, query_segment_ids=q_ids,
                               key_value_segment_ids=kv_ids)


class MultiHeadAttention(nnx.MultiHeadAttention):
  """``flax.nnx.MultiHeadAttention`` running on jaxflash, with the mask rule built in.

  Same constructor and parameters as ``nnx.MultiHeadAttention`` (so its state
  is interchangeable with a stock layer's: ``query``, ``key``, ``value``,
  ``out``, each with ``kernel`` and optional ``bias``), plus:

  Args:
    is_causal: apply a top-left causal mask on every call (a call may still pass
      ``is_causal=True`` to a non-causal layer).
    local_window_size: ``w`` or ``(left, right)``: each query sees keys within
      ``left`` before and ``right`` after its own position.
    implementation, logits_soft_cap: forwarded to
      :func:`jaxflash.dot_product_attention`.
    num_kv_heads: number of key/value heads (GQA); ``num_heads`` must be a
      multiple of it.

  A call takes ``query_segment_ids`` / ``key_value_segment_ids`` (``[batch...,
  length]`` integers) for packed sequences: a token attends only tokens of its
  own segment (:func:`jaxflash.dot_product_attention`).

  Attention dropout is not supported (``dropout_rate`` must be 0). In decode
  mode (KV cache) the cache's own mask gives causality; a window is not
  supported there.
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None,
               in_kv_features: int | None = None, *, is_causal: bool = False,
               local_window_size: int | tuple[int, int] | None = None,
               implementation: str | None = None, logits_soft_cap: float | None = None,
               **kwargs):
    if kwargs.get("dropout_rate", 0.0):
      raise ValueError("jaxflash.flax.MultiHeadAttention does not implement attention "
                       f"dropout; got dropout_rate={kwargs['dropout_rate']}")
    if "attention_fn" in kwargs:
      raise TypeError("jaxflash.flax.MultiHeadAttention chooses its own attention_fn; use "
                      "nnx.MultiHeadAttention to pass another")
    if num_kv_heads is not None:
      kwargs["num_kv_heads"] = num_kv_heads   # nnx.MultiHeadAttention has it since flax 0.12.6
    attention_fn = functools.partial(_layer_attention, local_window_size=local_window_size,
                                     implementation=implementation, logits_soft_cap=logits_soft_cap)
    super().__init__(num_heads, in_features, qkv_features, out_features,
                     in_kv_features=in_kv_features, attention_fn=attention_fn, **kwargs)
    self.is_causal = bool(is_causal)
    self.local_window_size = local_window_size

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, is_causal: bool | None = None,
               decode: bool | None = None, query_segment_ids=None, key_value_segment_ids=None,
               **kwargs):
    causal = self.is_causal if is_causal is None else bool(is_causal)
    decoding = decode if decode is not None else self.decode
    if decoding:
      if self.local_window_size is not None:
        raise ValueError("jaxflash.flax.MultiHeadAttention: local_window_size is not supported "
                         "in decode mode")
      if query_segment_ids is not None:
        raise ValueError("jaxflash.flax.MultiHeadAttention: segment ids are not supported in "
                         "decode mode")
      # One query against the whole cache: the cache mask is the causal rule.
      causal = False
    ids = None if query_segment_ids is None else (query_segment_ids, key_value_segment_ids)
    token = _CALL_SEGMENT_IDS.set(ids)
    try:
      return super().__call__(inputs_q, inputs_k, inputs_v, is_causal=causal, decode=decode,
                              **kwargs)
    finally:
      _CALL_SEGMENT_IDS.reset(token)


# ------------------------------------------------------------------ Linen layer

class LinenMultiHeadAttention(linen.Module):
  """Linen multi-head attention on jaxflash with causal / window / GQA options.

  With ``num_kv_heads=None`` its parameters are exactly those of
  ``linen.MultiHeadDotProductAttention`` (``query``, ``key``, ``value``,
  ``out``: ``DenseGeneral`` kernels ``[in, heads, head_dim]`` and
  ``[heads, head_dim, out]``, optional biases), so checkpoints are
  interchangeable. With ``num_kv_heads`` the key/value kernels are
  ``[in, num_kv_heads, head_dim]``.

  Call: ``layer(inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
  query_seq_lengths=None, key_value_seq_lengths=None, query_segment_ids=None,
  key_value_segment_ids=None)``. Padding is best given as sequence lengths and
  packed documents as segment ids (both served by the fused kernels); a dense
  ``mask`` works but goes through the ``xla`` implementation.
  """

  num_heads: int
  num_kv_heads: int | None = None
  qkv_features: int | None = None
  out_features: int | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = linen.initializers.lecun_normal()
  out_kernel_init: Callable | None = None
  bias_init: Callable = linen.initializers.zeros_init()
  out_bias_init: Callable | None = None
  use_bias: bool = True
  precision: Any = None
  is_causal: bool = False
  local_window_size: int | tuple[int, int] | None = None
  implementation: str | None = None
  scale: float | None = None
  logits_soft_cap: float | None = None

  @linen.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
               query_seq_lengths=None, key_value_seq_lengths=None, query_segment_ids=None,
               key_value_segment_ids=None):
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("inputs_k cannot be None when inputs_v is given")
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads:
      raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads "
                       f"({self.num_heads})")
    head_dim = qkv_features // self.num_heads
    kv_heads = self.num_kv_heads or self.num_heads
    if self.num_heads % kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({kv_heads})")
    dense = functools.partial(linen.DenseGeneral, axis=-1, dtype=self.dtype,
                              param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                              bias_init=self.bias_init, use_bias=self.use_bias,
                              precision=self.precision)
    query = dense(features=(self.num_heads, head_dim), name="query")(inputs_q)
    key = dense(features=(kv_heads, head_dim), name="key")(inputs_k)
    value = dense(features=(kv_heads, head_dim), name="value")(inputs_v)
    x = dot_product_attention(query, key, value, mask=mask, dtype=self.dtype,
                              is_causal=self.is_causal, local_window_size=self.local_window_size,
                              implementation=self.implementation, scale=self.scale,
                              logits_soft_cap=self.logits_soft_cap,
                              query_seq_lengths=query_seq_lengths,
                              key_value_seq_lengths=key_value_seq_lengths,
                              query_segment_ids=query_segment_ids,
                              key_value_segment_ids=key_value_segment_ids)
    return linen.DenseGeneral(features=self.out_features or inputs_q.shape[-1], axis=(-2, -1),
                              kernel_init=self.out_kernel_init or self.kernel_init,
                              bias_init=self.out_bias_init or self.bias_init,
                              use_bias=self.use_bias, dtype=self.dtype,
                              param_dtype=self.param_dtype, precision=self.precision,
                              name="out")(x)
