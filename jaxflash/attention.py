"""The public API: a drop-in for `jax.nn.dot_product_attention`.

`dot_product_attention` validates and normalises its arguments (every bad input
raises here, at trace time, before any kernel can see it), picks an
implementation, and for the fused ones (`native`, `pallas`) runs them inside one
`custom_jvp` (`_fused`): its value comes from the implementation's forward
kernels, its tangent from a primitive that is linear in the input tangents
and whose transpose is the implementation's backward kernels
(derivatives.py). Reverse mode therefore saves (q, k, v, o, lse) and runs the
backward kernels, as a custom_vjp would; forward mode and Hessian-vector
products work too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import _native, _splits, checks, derivatives, pallas as _pallas, reference, sharding

Implementation = Literal["native", "pallas", "xla", "cudnn"]
_IMPLEMENTATIONS = (None, "native", "pallas", "xla", "cudnn")
_FUSED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
MAX_FUSED_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of a call: scale and the mask rule (see reference.py).

  window_left / window_right are -1 for an unbounded side; num_splits is 0
  for the automatic split-KV choice (jaxflash/_splits.py) or the forced count.
  """
  scale: float
  window_left: int = -1
  window_right: int = -1
  bottom_right: bool = False
  deterministic: bool = False
  num_splits: int = 0


# ------------------------------------------------------------------ kernels

def _diagonal_offsets(offsets) -> jax.Array:
  """The kernels' per-batch diagonal shift (params.h); outside ring attention
  none, which the handlers read as 0 (an empty array, as for lengths)."""
  return reference.no_lengths() if offsets is None else offsets


class _NativeKernels:
  """The XLA FFI targets: CUDA on GPU, C++ on CPU.

  `offsets` ([batch] int32, default 0) moves the mask's diagonal; ring
  attention uses it to place one (query shard, key shard) block.
  """

  name = "native"

  @staticmethod
  def _attrs(spec: MaskSpec) -> dict[str, Any]:
    return dict(scale=np.float32(spec.scale), window_left=np.int64(spec.window_left),
                window_right=np.int64(spec.window_right), bottom_right=bool(spec.bottom_right))

  @staticmethod
  def out_types(q, splits: int):
    """o, lse, and the split-KV partials (empty unless split), as the FFI returns them."""
    B, T, N, D = q.shape
    s = splits if splits > 1 else 0
    return (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, N, T), jnp.float32),
            jax.ShapeDtypeStruct((B, s, T, N, D), jnp.float32),
            jax.ShapeDtypeStruct((B, s, T, N), jnp.float32))

  @classmethod
  def forward(cls, q, k, v, q_lengths, kv_lengths, spec: MaskSpec, offsets=None):
    splits = _splits.native(spec.num_splits, q.shape, k.shape, q.dtype, _platform())
    # broadcast_all: under vmap every operand gains the same leading axes, which
    # the handlers fold into the batch.
    call = jax.ffi.ffi_call(_native.FORWARD_TARGET, cls.out_types(q, splits),
                            vmap_method="broadcast_all")
    o, lse, _, _ = call(q, k, v, q_lengths, kv_lengths, _diagonal_offsets(offsets),
                        **cls._attrs(spec),
                        tile=np.int64(_native.tile_attr("fwd", q.shape[-1], spec.window_right >= 0)),
                        num_splits=np.int64(splits))
    return o, lse

  @classmethod
  def backward(cls, q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec: MaskSpec,
               offsets=None):
    # The last two results are the kernels' workspaces: delta (O(B * N * T))
    # and room for the fused backward's float32 dQ sums (like q, or with a
    # last dimension of 0); as outputs they keep the handlers free of run-time
    # allocation.
    sums = _native.dq_sums_room(q.dtype, q.shape[-1], bool(spec.deterministic))
    out_types = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(lse.shape, jnp.float32),
                 jax.ShapeDtypeStruct((*q.shape[:-1], q.shape[-1] if sums else 0), jnp.float32))
    call = jax.ffi.ffi_call(_native.BACKWARD_TARGET, out_types, vmap_method="broadcast_all")
    dq, dk, dv, _, _ = call(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths,
                         _diagonal_offsets(offsets), **cls._attrs(spec),
                         deterministic=bool(spec.deterministic),
                         tile=np.int64(_native.tile_attr("bwd", q.shape[-1], spec.window_right >= 0)))
    return dq, dk, dv


class _PallasKernels:
  """The project's Pallas kernels (Triton on GPU, the interpreter on CPU)."""

  name = "pallas"

  @staticmethod
  def _kw(spec: MaskSpec) -> dict[str, Any]:
    return dict(scale=float(spec.scale), window_left=int(spec.window_left),
                window_right=int(spec.window_right), bottom_right=bool(spec.bottom_right))

  @classmethod
  def forward(cls, q, k, v, q_lengths, kv_lengths, spec: MaskSpec, offsets=None):
    return _pallas.pallas_forward(q, k, v, q_lengths, kv_lengths, **cls._kw(spec),
                                  diagonal_offsets=offsets, num_splits=spec.num_splits or None)

  @classmethod
  def backward(cls, q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec: MaskSpec,
               offsets=None):
    # No atomics: always deterministic, so spec.deterministic needs nothing.
    return _pallas.pallas_backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths,
                                   **cls._kw(spec), diagonal_offsets=offsets)

  @classmethod
  def tangent(cls, q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv, *, spec: MaskSpec,
              offsets=None):
    """Forward mode's (tO, tLSE) as a flash pass (pallas/tangent.py)."""
    return _pallas.pallas_tangent(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv,
                                  **cls._kw(spec), diagonal_offsets=offsets)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6))
def _fused(q, k, v, q_lengths, kv_lengths, kernels, spec):
  return kernels.forward(q, k, v, q_lengths, kv_lengths, spec)


@_fused.defjvp
def _fused_jvp(kernels, spec, primals, tangents):
  q, k, v, q_lengths, kv_lengths = primals
  tq, tk, tv = tangents[:3]  # the lengths' tangents are float0
  # The value through _fused itself, so that an outer jvp (a Hessian-vector
  # product) differentiates it by this rule rather than the FFI call.
  o, lse = _fused(q, k, v, q_lengths, kv_lengths, kernels, spec)
  return (o, lse), derivatives.output_tangents(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv,
                                               kernels=kernels, spec=spec)


def _kernels(name: str, *, sharded: bool = True):
  """The kernels of implementation `name`; `sharded` wraps them in the partition
  rules (sharding.py) that keep sharded calls local under jit."""
  kernels = {"native": _NativeKernels, "pallas": _PallasKernels}[name]
  return sharding.partitioned(kernels) if sharded else kernels


# ------------------------------------------------------------------ validation

def _as_array(x, name: str) -> jax.Array:
  try:
    return jnp.asarray(x)
  except TypeError as e:
    raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e


def _ensure_4d(x: jax.Array, name: str) -> jax.Array:
  if x.ndim not in (3, 4):
    raise ValueError(
        f"{name} must have rank 4 [batch, seq, heads, head_dim] or rank 3 [seq, heads, "
        f"head_dim]; got shape {x.shape}")
  return x if x.ndim == 4 else x[None]


def _lengths(x, name: str, batch: int) -> jax.Array | None:
  if x is None:
    return None
  x = _as_array(x, name)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")
  if x.shape != (batch,):
    raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {x.shape}")
  return x.astype(jnp.int32)


def _check_heads_and_dtypes(q_heads: int, kv_heads: int, arrays: dict[str, jax.Array]) -> None:
  """The GQA rule, and one floating dtype for query, keys and values."""
  if kv_heads < 1 or q_heads % kv_heads != 0:
    raise ValueError(f"the number of query heads ({q_heads}) must be a positive multiple of the "
                     f"number of key/value heads ({kv_heads})")
  for name, x in arrays.items():
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")
  names, dtypes = list(arrays), [x.dtype for x in arrays.values()]
  if any(t != dtypes[0] for t in dtypes):
    raise TypeError(f"{', '.join(names[:-1])} and {names[-1]} must share one dtype, got "
                    f"{', '.join(str(t) for t in dtypes)}")


# Window sides are capped here (and as kMaxWindow in the FFI handlers): past
# every sequence a side bounds nothing, and 2^29 keeps the kernels' 32-bit
# position arithmetic exact.
MAX_WINDOW = 1 << 29


def _window(local_window_size) -> tuple[int, int] | None:
  if local_window_size is None:
    return None
  if isinstance(local_window_size, numbers.Integral) and not isinstance(local_window_size, bool):
    local_window_size = (local_window_size, local_window_size)
  if (not isinstance(local_window_size, (tuple, list)) or len(local_window_size) != 2 or
      not all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
              for w in local_window_size)):
    raise TypeError("local_window_size must be an int or a (left, right) pair of ints, got "
                    f"{local_window_size!r}")
  left, right = (int(w) for w in local_window_size)
  if left < 0 or right < 0:
    raise ValueError(f"local_window_size must be non-negative, got {(left, right)}")
  # (A window of 2**32 once reached the native kernels as 0.)
  return min(left, MAX_WINDOW), min(right, MAX_WINDOW)


def _scale(scale, head_dim: int) -> float:
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  if isinstance(scale, jax.core.Tracer):
    raise TypeError("scale must be a static Python number, not a traced value")
  try:
    value = float(scale)
  except (TypeError, ValueError) as e:
    raise TypeError(f"scale must be a number, got {scale!r}") from e
  if not math.isfinite(value):
    raise ValueError(f"scale must be finite, got {value}")
  return value


def _dense_term(x, name: str, shape4: tuple[int, ...]) -> jax.Array | None:
  """bias or mask: rank <= 4, broadcastable to [B, N, T, S]."""
  if x is None:
    return None
  x = _as_array(x, name)
  if x.ndim > 4:
    raise ValueError(f"{name} must have rank <= 4 (broadcastable to [B, N, T, S]), got {x.shape}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  try:
    np.broadcast_shapes(x.shape, shape4)
  except ValueError:
    raise ValueError(f"{name} of shape {x.shape} does not broadcast to [B, N, T, S] = {shape4}")
  if name == "mask" and x.dtype != jnp.bool_:
    raise TypeError(f"mask must be boolean (True = attend), got dtype {x.dtype}; pass additive "
                    "masks as bias")
  return x


@dataclasses.dataclass(frozen=True)
class _Call:
  """A validated call, in [B, T, N, H] form."""
  q: jax.Array
  k: jax.Array
  v: jax.Array
  bias: jax.Array | None
  mask: jax.Array | None
  q_lengths: jax.Array | None
  kv_lengths: jax.Array | None
  is_causal: bool
  window: tuple[int, int] | None
  spec: MaskSpec
  output_shape: tuple[int, ...]


def _validate(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
              key_value_seq_lengths, local_window_size, causal_alignment, deterministic,
              num_splits=None) -> _Call:
  q = _as_array(query, "query")
  k = _as_array(key, "key")
  v = _as_array(value, "value")
  output_shape = q.shape
  q, k, v = _ensure_4d(q, "query"), _ensure_4d(k, "key"), _ensure_4d(v, "value")
  if k.shape != v.shape:
    raise ValueError(f"key and value must have the same shape, got {k.shape} and {v.shape}")
  B, T, N, H = q.shape
  _, S, K, Hk = k.shape
  if k.shape[0] != B:
    raise ValueError(f"query and key must have the same batch size, got {B} and {k.shape[0]}")
  if Hk != H:
    raise ValueError(f"query and key must have the same head_dim, got {H} and {Hk}")
  if H < 1:
    raise ValueError("head_dim must be at least 1")
  _check_heads_and_dtypes(N, K, {"query": q, "key": k, "value": v})
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
  if causal_alignment not in ("top_left", "bottom_right"):
    raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', got "
                     f"{causal_alignment!r}")
  window = _window(local_window_size)
  left, right = reference.window_bounds(bool(is_causal), window)
  spec = MaskSpec(scale=_scale(scale, H), window_left=-1 if left is None else left,
                  window_right=-1 if right is None else right,
                  bottom_right=causal_alignment == "bottom_right",
                  deterministic=bool(deterministic), num_splits=_splits.validate(num_splits))
  return _Call(q=q, k=k, v=v, bias=_dense_term(bias, "bias", (B, N, T, S)),
               mask=_dense_term(mask, "mask", (B, N, T, S)),
               q_lengths=_lengths(query_seq_lengths, "query_seq_lengths", B),
               kv_lengths=_lengths(key_value_seq_lengths, "key_value_seq_lengths", B),
               is_causal=bool(is_causal), window=window, spec=spec,
               output_shape=output_shape)


# ------------------------------------------------------------------ selection

def _platform() -> str:
  return jax.default_backend()


def _fused_unsupported(call: _Call, name: str, explicit: bool = True) -> str | None:
  """Why implementation `name` cannot serve `call` here, or None.

  `explicit` is False when choosing automatically: Pallas on the CPU runs in
  the (slow) interpreter, fine when asked for, never picked unasked.
  """
  if call.bias is not None or call.mask is not None:
    return f"implementation={name!r} does not take a dense bias or mask; use 'xla'"
  if call.q.dtype not in _FUSED_DTYPES:
    return (f"implementation={name!r} supports float32, float16 and bfloat16, got "
            f"{call.q.dtype}")
  if call.q.shape[-1] > MAX_FUSED_HEAD_DIM:
    return (f"implementation={name!r} supports head_dim <= {MAX_FUSED_HEAD_DIM}, got "
            f"{call.q.shape[-1]}")
  if name == "native":
    return _native.unavailable_reason(_platform())
  if name == "pallas":
    return _pallas.pallas_supported(call.q.shape, call.k.shape, call.v.shape, call.q.dtype,
                                    _platform(), k_dtype=call.k.dtype, v_dtype=call.v.dtype,
                                    interpret_ok=explicit)
  return None


# The automatic order (implementation=None) follows same-run measurements
# (docs/performance.md, fourth session, bf16, S = 4k and 16k): on Hopper the
# Pallas kernels beat the native ones at head_dim <= 64 in 16-bit types, in the
# forward (+11-14%) and forward+backward (+29-33%); at 128 and 256 the native
# kernels win forward+backward (+6-10%, 2x). Decode steps (H100, D = 128, three
# cache shapes; ninth session, after the native decode kernel took 128 packed
# rows on two CTAs per SM): the Pallas decode kernel is faster at q_len 1 and 4
# (+2-11%), the native one at q_len 16 (0 to +13%). Elsewhere native comes first.
_PALLAS_FIRST_DEVICES = ("H100", "H200")
_PALLAS_FIRST_MAX_HEAD_DIM = 64
_PALLAS_FIRST_MAX_QUERY_LEN = 4
_PALLAS_FIRST_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _device_kind() -> str:
  return jax.devices()[0].device_kind


def _automatic_order(call: _Call) -> tuple[str, str]:
  """The fused implementations in the order `implementation=None` tries them."""
  if (_platform() == "gpu" and call.q.dtype in _PALLAS_FIRST_DTYPES
      and (call.q.shape[-1] <= _PALLAS_FIRST_MAX_HEAD_DIM
           or call.q.shape[-3] <= _PALLAS_FIRST_MAX_QUERY_LEN)
      and any(kind in _device_kind() for kind in _PALLAS_FIRST_DEVICES)):
    return ("pallas", "native")
  return ("native", "pallas")


def _choose(call: _Call, implementation) -> str:
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}")
  if implementation in ("native", "pallas"):
    reason = _fused_unsupported(call, implementation)
    if reason:
      raise ValueError(reason)
    return implementation
  if implementation is not None:
    return implementation
  for name in _automatic_order(call):
    if _fused_unsupported(call, name, explicit=False) is None:
      return name
  return "xla"


# ------------------------------------------------------------------ entry point

def dot_product_attention(
    query, key, value, bias=None, mask=None, *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Implementation | None = None,
    return_residual: bool = False,
    causal_alignment: Literal["top_left", "bottom_right"] = "top_left",
    residual_dtype=None,
    differentiable_residual: bool = False,
    deterministic: bool = False,
    num_splits: int | None = None,
):
  r"""Scaled dot-product attention that never materialises the score matrix.

  A drop-in for :func:`jax.nn.dot_product_attention`: same arguments, layouts
  (``[batch, seq, heads, head_dim]`` or without the batch axis), GQA rule,
  top-left ``is_causal``, ``(left, right)`` ``local_window_size`` and sequence
  lengths. ``implementation``:

  * ``None`` — the first implementation that supports the call here, in
    a measured order: ``native``, else ``pallas``, else ``xla``; on H100/H200
    GPUs with float16/bfloat16 and head_dim <= 64 or at most 4 query rows
    (decode steps), ``pallas`` before ``native`` (faster there;
    docs/performance.md).
  * ``"native"`` — the jaxflash kernels (CUDA on GPU, C++ on CPU) via XLA FFI.
  * ``"pallas"`` — the jaxflash Pallas kernels.
  * ``"xla"`` — plain ``jax.numpy`` (materialises the scores; supports
    ``bias``, ``mask`` and float64).
  * ``"cudnn"`` — forwarded to ``jax.nn.dot_product_attention``.

  Naming an implementation that cannot serve the call raises ``ValueError``; it
  never silently falls back. Sequence lengths outside ``[0, length]`` are
  clamped, as ``jax.nn``'s masks treat them; run under
  :func:`jaxflash.checked` to get a ``ValueError`` instead.

  Differences from ``jax.nn`` (README): a query row that can see no key (all
  masked, or beyond ``query_seq_lengths``) returns zeros with zero gradients
  and a residual of the dtype's lowest finite value (log 0 without an inf);
  ``jax.nn`` averages the values of such a row. NaN and Inf in the inputs reach
  the rows that can see them, as in ``jax.nn``, and never a row that cannot
  (``jax.nn`` lets 0 * NaN of masked keys through).

  Keyword-only extras:
    causal_alignment: ``"top_left"`` (``jax.nn``'s) or ``"bottom_right"``: put
      the diagonal used by ``is_causal`` and ``local_window_size`` at
      ``kv_len - q_len`` (per batch element, from the sequence lengths), as a
      KV-cache decode step needs.
    residual_dtype: dtype of the returned log-sum-exp; ``None`` keeps
      ``jax.nn``'s (the input dtype). ``jnp.float32`` returns the exact value
      the kernels keep.
    differentiable_residual: with ``return_residual=True``, let gradients flow
      through the log-sum-exp (its cotangent reaches q and k), for code that
      merges partial attention results. By default the residual carries no
      gradient, as in ``jax.nn``: a cotangent for it is ignored.
    deterministic: ask GPU kernels for a bit-reproducible backward (the CPU
      kernels always are).
    num_splits: split-KV for the forward of the fused implementations: the
      keys each query tile visits are cut into this many ranges computed in
      parallel, then merged. ``None`` chooses from the shape and the machine
      (it splits decode steps that would leave the GPU or CPU idle); an int in
      [1, 1024] forces it. O and the LSE equal the unsplit result up to
      rounding; the backward is unaffected. On the GPU the split applies to the
      16-bit tensor-core path; float32 (and head dims that are not a multiple
      of 8) run unsplit. ``xla`` ignores it.

  Returns:
    The output, shaped like ``query``; with ``return_residual=True`` a tuple
    ``(output, lse)`` where ``lse`` is ``[batch, q_len, heads]``: the natural
    log-sum-exp of each row's scaled logits.
  """
  call = _validate(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
                   key_value_seq_lengths, local_window_size, causal_alignment, deterministic,
                   num_splits)
  if not isinstance(differentiable_residual, (bool, np.bool_)):
    raise TypeError(f"differentiable_residual must be a bool, got {differentiable_residual!r}")
  if differentiable_residual and not return_residual:
    raise ValueError("differentiable_residual=True needs return_residual=True")
  # Lengths outside [0, len] are clamped (as jax.nn's masks treat them);
  # jaxflash.checked turns these into errors.
  checks.lengths_in_range(call.q_lengths, "query_seq_lengths", call.q.shape[1])
  checks.lengths_in_range(call.kv_lengths, "key_value_seq_lengths", call.k.shape[1])
  chosen = _choose(call, implementation)
  q = call.q
  B, T, N, _ = q.shape
  S = call.k.shape[1]

  if chosen == "cudnn":
    if (call.spec.bottom_right or residual_dtype is not None or deterministic
        or differentiable_residual or num_splits is not None):
      raise ValueError("implementation='cudnn' forwards to jax.nn.dot_product_attention and "
                       "takes none of jaxflash's extra keywords")
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation="cudnn",
        return_residual=return_residual)

  if B * T * N == 0 or S == 0:
    # Nothing to attend to (or nothing asks): zeros, and empty-row statistics.
    out = jnp.zeros_like(q)
    lse = jnp.full((B, N, T), reference.empty_lse(jnp.float32))
  elif chosen == "xla":
    out, lse = reference.attention(
        q, call.k, call.v, scale=call.spec.scale, bias=call.bias, mask=call.mask,
        is_causal=call.is_causal,
        causal_alignment="bottom_right" if call.spec.bottom_right else "top_left",
        local_window_size=call.window, query_seq_lengths=call.q_lengths,
        key_value_seq_lengths=call.kv_lengths)
  else:
    q_lengths = call.q_lengths if call.q_lengths is not None else reference.no_lengths()
    kv_lengths = call.kv_lengths if call.kv_lengths is not None else reference.no_lengths()
    out, lse = _fused(q, call.k, call.v, q_lengths, kv_lengths, _kernels(chosen), call.spec)
  return _finish(call, out, lse, return_residual, residual_dtype, differentiable_residual)


def _finish(call: _Call, out, lse, return_residual: bool, residual_dtype,
            differentiable_residual: bool = False):
  """The caller's layout: the output shaped like the query, the residual [B, T, N]."""
  out = out.reshape(call.output_shape)
  if not return_residual:
    return out
  lse = jnp.transpose(lse, (0, 2, 1)).reshape(call.output_shape[:-1])
  lse = reference.cast_lse(lse, residual_dtype if residual_dtype is not None else call.q.dtype)
  return out, (lse if differentiable_residual else jax.lax.stop_gradient(lse))
