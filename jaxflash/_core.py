"""What a call is: its description and validation, the kernels, the fused rule, the choice.

The layer under the public entry points (attention.py, ring.py, paged.py):

* `validate` turns the arguments of a call into a `Call` in [B, T, N, H] form,
  raising every error about a bad input at trace time, before any kernel can
  see it; `MaskSpec` is its static part (scale, mask rule, backward mode).
* `NativeKernels` and `PallasKernels` (`KERNELS`) bind the two fused
  implementations: forward, backward and, where there is one, the tangent.
* `fused` runs a kernel table inside one `custom_jvp`: its value comes from the forward
  kernels, its tangent from a primitive that is linear in the input tangents and whose
  transpose is the backward kernels (derivatives.py). Reverse mode therefore saves (q, k, v,
  o, lse) and runs the backward kernels, as a custom_vjp would; forward mode and
  Hessian-vector products work too. Ring attention and the partition rules hand it their own tables.
* `fused_unsupported` and `choose` say which implementation serves a call;
  `finish` puts a result back into the caller's layout.
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

from jaxflash import (_native, _splits, choice, dense as _dense, derivatives, pallas as _pallas, reference,
                      segments as _segments, wide_gradients)

Implementation = Literal["native", "pallas", "xla", "cudnn"]
# What `implementation=` takes: a name, None (automatic) or a sequence of them.
IMPLEMENTATIONS = (None, "native", "pallas", "xla", "cudnn")
FUSED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
MAX_FUSED_HEAD_DIM = 512   # the CPU kernels (params.h, kMaxCpuHeadDim) and Pallas's
MAX_CUDA_HEAD_DIM = 256    # the CUDA kernels both ways (past it: _native.wide_refusal)


def max_head_dim(name: str) -> int:
  """The widest head dim implementation `name` takes (native past 256 on a GPU: `_native.wide_refusal`)."""
  return MAX_FUSED_HEAD_DIM


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of a call: scale and the mask rule (see reference.py).

  window_left / window_right are -1 for an unbounded side; num_splits is 0
  for the automatic split-KV choice (jaxflash/_splits.py) or the forced count;
  softcap is 0 for none, else the cap c of a score: s = c * tanh(scale * q.k / c)
  (`score` in reference.py says it once for every implementation).
  """
  scale: float
  window_left: int = -1
  window_right: int = -1
  bottom_right: bool = False
  deterministic: bool = False
  num_splits: int = 0
  softcap: float = 0.0


# ------------------------------------------------------------------ validation

def as_array(x, name: str) -> jax.Array:
  try:
    return jnp.asarray(x)
  except TypeError as e:
    raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e


def _batch_axes(arrays: dict[str, jax.Array]) -> tuple[int, ...]:
  """The leading batch axes that query, key and value share: [*batch, seq, heads, head_dim].

  A rank-3 input has a batch of one, as in jax.nn (a rank-3 query may meet rank-4 keys).
  Only the first batch axis may be sharded: flattening the batch axes gathers the others.
  """
  for name, x in arrays.items():
    if x.ndim < 3:
      raise ValueError(f"{name} must have rank 3 or more [*batch, seq, heads, head_dim]; got "
                       f"shape {x.shape}")
  batches = {name: x.shape[:-3] or (1,) for name, x in arrays.items()}
  (first, batch), *rest = batches.items()
  for name, other in rest:
    if other != batch:
      raise ValueError(f"{first} and {name} must have the same batch axes, got {batch} and "
                       f"{other}")
  return batch


def flatten_batch(x: jax.Array) -> jax.Array:
  """[*batch, T, N, H] as [prod(batch), T, N, H] (a rank-3 input: a batch of one)."""
  return x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:])


def _lengths(x, name: str, batch: tuple[int, ...]) -> jax.Array | None:
  """Lengths of shape `batch`, flattened like the inputs."""
  if x is None:
    return None
  x = as_array(x, name)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")
  if x.shape != batch:
    raise ValueError(f"{name} must have the batch shape {batch}, got {x.shape}")
  return x.reshape(-1).astype(jnp.int32)


def check_heads_and_dtypes(q_heads: int, kv_heads: int, arrays: dict[str, jax.Array]) -> None:
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


# Window sides are capped here (and as kMaxWindow in the FFI handlers): past every
# sequence a side bounds nothing, and 2^29 keeps 32-bit position arithmetic exact.
MAX_WINDOW = 1 << 29


def parse_window(local_window_size) -> tuple[int, int] | None:
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


def _static_number(x, name: str) -> float:
  """x as a float, known when the call is traced (a Tracer is refused)."""
  if isinstance(x, jax.core.Tracer):
    raise TypeError(f"{name} must be a static Python number, not a traced value")
  try:
    return float(x)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{name} must be a number, got {x!r}") from e


def resolve_scale(scale, head_dim: int) -> float:
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  value = _static_number(scale, "scale")
  if not math.isfinite(value):
    raise ValueError(f"scale must be finite, got {value}")
  return value


@dataclasses.dataclass(frozen=True)
class Call:
  """A validated call, in [B, T, N, H] form: its batch axes (none, one or several)
  flattened into B; `output_shape` is the query's own shape with the value's head dim,
  which `finish` restores."""
  q: jax.Array
  k: jax.Array
  v: jax.Array
  bias: jax.Array | None
  mask: jax.Array | None
  q_lengths: jax.Array | None
  kv_lengths: jax.Array | None
  segments: tuple[jax.Array, jax.Array] | None  # (q_ids [B, T], kv_ids [B, S]) int32
  alibi: jax.Array | None                       # ALiBi slopes [B, N] float32 (`alibi_slopes`)
  is_causal: bool
  window: tuple[int, int] | None
  spec: MaskSpec
  output_shape: tuple[int, ...]

  @property
  def width(self) -> int:
    """The head dim padded kernels run at: the wider of q/k's and v's (`run_fused`)."""
    return max(self.q.shape[-1], self.v.shape[-1])

  @functools.cached_property
  def dense(self) -> _dense.Dense | None:
    """The dense bias and mask as the fused kernels take them: a float64 bias in
    float32 (the kernels' score precision), or None when the call has neither."""
    bias = self.bias
    if bias is not None and bias.dtype not in FUSED_DTYPES:
      bias = bias.astype(jnp.float32)
    return _dense.make(bias, self.mask)

  @property
  def empty(self) -> bool:
    """Nothing to attend to, or nothing asks: no kernel runs (`empty_result`)."""
    B, T, N, _ = self.q.shape
    return B * T * N == 0 or self.k.shape[1] == 0


def resolve_softcap(logits_soft_cap) -> float:
  """The logit soft-cap as MaskSpec keeps it: 0.0 for None, else a finite float > 0."""
  if logits_soft_cap is None:
    return 0.0
  value = _static_number(logits_soft_cap, "logits_soft_cap")
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"logits_soft_cap must be finite and > 0 (None: no cap), got {value}")
  return value


def resolve_alibi(alibi_slopes, batch: tuple[int, ...], heads: int) -> jax.Array | None:
  """ALiBi slopes `[heads]` or `[*batch, heads]` as the kernels read them: float32
  [prod(batch), heads], not differentiated (ALiBi's slopes are constants of a model)."""
  if alibi_slopes is None:
    return None
  x = as_array(alibi_slopes, "alibi_slopes")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"alibi_slopes must be a floating-point array, got dtype {x.dtype}")
  if x.shape not in ((heads,), batch + (heads,)):
    raise ValueError(f"alibi_slopes must have shape [q_heads] = {(heads,)} or [*batch, q_heads] "
                     f"= {batch + (heads,)}, got {x.shape}")
  x = jnp.broadcast_to(jax.lax.stop_gradient(x).astype(jnp.float32), batch + (heads,))
  return x.reshape(-1, heads)


def validate(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
             key_value_seq_lengths, local_window_size, causal_alignment, deterministic,
             num_splits=None, logits_soft_cap=None, query_segment_ids=None,
             key_value_segment_ids=None, alibi_slopes=None) -> Call:
  q, k, v = (as_array(x, name) for x, name in ((query, "query"), (key, "key"), (value, "value")))
  output_shape = q.shape
  batch = _batch_axes({"query": q, "key": k, "value": v})
  q, k, v = (flatten_batch(x) for x in (q, k, v))
  if k.shape[:-1] != v.shape[:-1]:
    raise ValueError(f"key and value must have the same batch, length and heads, got shapes "
                     f"{k.shape} and {v.shape}")
  (B, T, N, H), (_, S, K, Hk) = q.shape, k.shape
  if Hk != H:
    raise ValueError(f"query and key must have the same head_dim, got {H} and {Hk}")
  if H < 1 or v.shape[-1] < 1:
    raise ValueError("head_dim must be at least 1")
  # The value's head dim may differ from the query/key's (MLA): the output takes it.
  output_shape = output_shape[:-1] + (v.shape[-1],)
  check_heads_and_dtypes(N, K, {"query": q, "key": k, "value": v})
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
  if causal_alignment not in ("top_left", "bottom_right"):
    raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', got "
                     f"{causal_alignment!r}")
  window = parse_window(local_window_size)
  left, right = reference.window_bounds(bool(is_causal), window)
  spec = MaskSpec(scale=resolve_scale(scale, H), window_left=-1 if left is None else left,
                  window_right=-1 if right is None else right,
                  bottom_right=causal_alignment == "bottom_right",
                  deterministic=bool(deterministic), num_splits=_splits.validate(num_splits),
                  softcap=resolve_softcap(logits_soft_cap))
  segments = _segments.validate(query_segment_ids, key_value_segment_ids, batch, T, S)
  if segments is not None and spec.num_splits > 1:
    raise ValueError("num_splits > 1 (split-KV) does not take segment ids")
  return Call(q=q, k=k, v=v, bias=_dense.validate(bias, "bias", batch, (N, T, S)),
              mask=_dense.validate(mask, "mask", batch, (N, T, S)),
              q_lengths=_lengths(query_seq_lengths, "query_seq_lengths", batch),
              kv_lengths=_lengths(key_value_seq_lengths, "key_value_seq_lengths", batch),
              segments=segments, alibi=resolve_alibi(alibi_slopes, batch, N),
              is_causal=bool(is_causal), window=window, spec=spec, output_shape=output_shape)


# ------------------------------------------------------------------ kernels

class NativeKernels:
  """The XLA FFI targets: CUDA on GPU, C++ on CPU. `offsets` ([batch] int32, default 0)
  moves the mask's diagonal; ring attention uses it to place one (query shard, key shard) block."""

  name = "native"

  @staticmethod
  def _attrs(spec: MaskSpec) -> dict[str, Any]:
    return dict(scale=np.float32(spec.scale), window_left=np.int64(spec.window_left),
                window_right=np.int64(spec.window_right), bottom_right=bool(spec.bottom_right),
                softcap=np.float32(spec.softcap))

  takes_value_width = staticmethod(_native.takes_value_width)   # v at its own head dim (else padded)
  emits_db = staticmethod(_native.emits_db)   # backward(..., with_db=True) gives dB after dV

  @staticmethod
  def out_types(q, splits: int, v_dim: int | None = None):
    """o (of the value's head dim `v_dim`, default the query's), lse, and the split-KV
    partials (empty unless split), as the FFI returns them."""
    B, T, N, D = *q.shape[:3], (q.shape[3] if v_dim is None else v_dim)
    s = splits if splits > 1 else 0
    return (jax.ShapeDtypeStruct((B, T, N, D), q.dtype), jax.ShapeDtypeStruct((B, N, T), jnp.float32),
            jax.ShapeDtypeStruct((B, s, T, N, D), jnp.float32),
            jax.ShapeDtypeStruct((B, s, T, N), jnp.float32))

  @staticmethod
  def _target(index: int, dense):
    """The forward (0) or backward (1) target: v5 for calls with a dense term, else v4."""
    if dense is None:
      return (_native.FORWARD_TARGET, _native.BACKWARD_TARGET)[index], ()
    return _native.DENSE_TARGETS[index], _dense.operands(dense)

  @classmethod
  def forward(cls, q, k, v, q_lengths, kv_lengths, spec: MaskSpec, offsets=None, segments=None,
              alibi=None, dense=None):
    splits = (1 if segments is not None or dense is not None else
              _splits.native(spec.num_splits, q.shape, k.shape, q.dtype, platform()))
    target, dense_operands = cls._target(0, dense)
    # broadcast_all: under vmap every operand gains the leading axes the handlers fold.
    call = jax.ffi.ffi_call(target, cls.out_types(q, splits, v.shape[-1]), vmap_method="broadcast_all")
    o, lse, _, _ = call(q, k, v, q_lengths, kv_lengths, reference.per_batch_operand(offsets),
                        *_segments.operands(segments), reference.alibi_operand(alibi),
                        *dense_operands, **cls._attrs(spec),
                        tile=np.int64(_native.tile_attr("fwd", q.shape[-1], spec.window_right >= 0)),
                        num_splits=np.int64(splits))
    return o, lse

  @classmethod
  def backward(cls, q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec: MaskSpec,
               offsets=None, segments=None, alibi=None, dense=None, with_db=False):
    if platform() != "cpu" and max(q.shape[-1], v.shape[-1]) > MAX_CUDA_HEAD_DIM:   # the wide forward's
      return wide_gradients.backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec=spec, offsets=offsets,
                                     exact=lambda: PallasKernels.backward(q, k, v, o, lse, do, dlse, q_lengths,
                                                                          kv_lengths, spec, offsets))
    if w := _native.backward_pad_width(q.shape, k.shape, v.shape[-1], q.dtype, dense is not None):
      pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, w - x.shape[-1])])   # exact, as `run_fused`
      g = cls.backward(pad(q), pad(k), pad(v), pad(o), lse, pad(do), dlse, q_lengths, kv_lengths,
                       spec, offsets, segments, alibi, dense)
      return tuple(d[..., :x.shape[-1]] for d, x in zip(g, (q, k, v)))
    # Results dQ, dK, dV, two workspaces (delta, and float32 dQ sums like q or of last dim 0), [dB]
    sums = _native.dq_sums_room(q.dtype, q.shape, k.shape, bool(spec.deterministic))
    out_types = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(lse.shape, jnp.float32),
                 jax.ShapeDtypeStruct((*q.shape[:-1], q.shape[-1] if sums else 0), jnp.float32))
    db = [jax.ShapeDtypeStruct(dense.bias.shape, dense.bias.dtype)] if with_db else []
    target, dense_operands = cls._target(1, dense)
    call = jax.ffi.ffi_call(_native.DB_TARGET if with_db else target, (*out_types, *db), vmap_method="broadcast_all")
    dq, dk, dv, _, _, *db = call(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths,
                         reference.per_batch_operand(offsets),
                         *_segments.operands(segments), reference.alibi_operand(alibi),
                         *dense_operands, **cls._attrs(spec), deterministic=bool(spec.deterministic),
                         tile=np.int64(_native.tile_attr("bwd", q.shape[-1], spec.window_right >= 0)))
    return (dq, dk, dv, *db)

  @classmethod
  def bias_gradient(cls, q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, *, spec: MaskSpec,
                    dense, offsets=None, segments=None, alibi=None):
    """The dense bias's gradient (dS summed over its broadcast axes in float32, stored in the
    bias's dtype; with a delta workspace); derivatives.bias_gradient is the definition."""
    out_types = (jax.ShapeDtypeStruct(dense.bias.shape, dense.bias.dtype), jax.ShapeDtypeStruct(lse.shape, jnp.float32))
    dbias, _ = jax.ffi.ffi_call(_native.BIAS_GRADIENT_TARGET, out_types)(
        q, k, v, o, lse, do.astype(q.dtype), dlse.astype(jnp.float32), q_lengths, kv_lengths,
        reference.per_batch_operand(offsets), *_segments.operands(segments),
        reference.alibi_operand(alibi), *_dense.operands(dense), **cls._attrs(spec))
    return dbias


class PallasKernels:
  """The project's Pallas kernels (Triton on GPU, the interpreter on CPU)."""

  name = "pallas"
  takes_value_width = staticmethod(lambda call=None: False)   # one head dim (`run_fused` pads)

  @staticmethod
  def _kw(spec: MaskSpec) -> dict[str, Any]:
    return dict(scale=float(spec.scale), window_left=int(spec.window_left),
                window_right=int(spec.window_right), bottom_right=bool(spec.bottom_right),
                softcap=float(spec.softcap))

  @classmethod
  def forward(cls, q, k, v, q_lengths, kv_lengths, spec: MaskSpec, offsets=None, segments=None,
              alibi=None, dense=None):
    return _pallas.pallas_forward(q, k, v, q_lengths, kv_lengths, **cls._kw(spec),
                                  diagonal_offsets=offsets, num_splits=spec.num_splits or None,
                                  alibi=alibi, segments=segments, dense=dense)

  @classmethod
  def backward(cls, q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, spec: MaskSpec,
               offsets=None, segments=None, alibi=None, dense=None):   # no atomics: deterministic
    return _pallas.pallas_backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths,
                                   **cls._kw(spec), diagonal_offsets=offsets, alibi=alibi,
                                   segments=segments, dense=dense)

  @classmethod
  def bias_gradient(cls, *arrays, spec: MaskSpec, offsets=None, **extras):
    """The dense bias's gradient (pallas/bias_grad.py)."""
    return _pallas.pallas_bias_gradient(*arrays, **cls._kw(spec), diagonal_offsets=offsets, **extras)

  @classmethod
  def tangent(cls, *arrays, spec: MaskSpec, offsets=None, **extras):
    """Forward mode's (tO, tLSE) as a flash pass (pallas/tangent.py)."""
    return _pallas.pallas_tangent(*arrays, **cls._kw(spec), diagonal_offsets=offsets, **extras)


@functools.partial(jax.custom_jvp, nondiff_argnums=(8, 9))
def fused(q, k, v, q_lengths, kv_lengths, segments, alibi, dense, kernels, spec):
  """`segments`: None, or the segment tables (q [B, T, 8], kv [B, S, 8] int32) of a call with
  segment ids, computed once for both directions; everything below reads the ids from them.
  `alibi`: None, or the ALiBi slopes [B, N] float32 (`resolve_alibi`; constants, their tangent
  is dropped). `dense`: None, or the call's dense bias and mask (dense.py; the bias is
  differentiable)."""
  return kernels.forward(q, k, v, q_lengths, kv_lengths, spec, segments=segments, alibi=alibi,
                         dense=dense)


@fused.defjvp
def _fused_jvp(kernels, spec, primals, tangents):
  q, k, v, q_lengths, kv_lengths, segments, alibi, dense = primals
  tq, tk, tv = tangents[:3]  # the lengths' and ids' tangents are float0, the slopes' dropped
  t_bias = None if dense is None or dense.bias is None else tangents[7].bias
  # Through fused itself, so that an outer jvp (a Hessian-vector product) uses this rule.
  o, lse = fused(q, k, v, q_lengths, kv_lengths, segments, alibi, dense, kernels, spec)
  return (o, lse), derivatives.output_tangents(q, k, v, o, lse, q_lengths, kv_lengths, tq, tk, tv,
                                               kernels=kernels, spec=spec, segments=segments,
                                               alibi=alibi, dense=dense, t_bias=t_bias)


KERNELS = {"native": NativeKernels, "pallas": PallasKernels}


# ------------------------------------------------------------------ choice

def platform() -> str:
  return jax.default_backend()


def fused_unsupported(call: Call, name: str, explicit: bool = True) -> str | None:
  """Why implementation `name` cannot serve `call` here, or None. `explicit` is False when
  choosing automatically: Pallas on the CPU runs in the (slow) interpreter, never picked unasked."""
  if call.q.dtype not in FUSED_DTYPES:
    return f"implementation={name!r} supports float32, float16 and bfloat16, got {call.q.dtype}"
  if name == "native" and platform() != "cpu" and call.width > MAX_CUDA_HEAD_DIM:
    return _native.wide_refusal(call) or _native.unavailable_reason(platform())  # None: Hopper's
  if call.width > max_head_dim(name):
    return (f"implementation={name!r} supports head_dim <= {max_head_dim(name)} here, got "
            f"{call.width}")
  if call.dense is not None and call.spec.num_splits > 1:
    return f"implementation={name!r}: num_splits > 1 (split-KV) does not take a dense bias or mask"
  if name == "native":
    why = call.dense is not None and platform() != "cpu" and _native.dense_gpu_refusal(
        call.q, call.k, call.width, call.dense.bias is not None, call.spec.softcap)
    return why or _native.unavailable_reason(platform())
  if name == "pallas":
    q, k, v = (x.shape[:-1] + (call.width,) for x in (call.q, call.k, call.v))
    return _pallas.pallas_supported(q, k, v, call.q.dtype, platform(), k_dtype=call.k.dtype,
                                    v_dtype=call.v.dtype, interpret_ok=explicit)
  return None


def automatic_order(call: Call) -> tuple[str, ...]:
  """The fused implementations in the order `implementation=None` tries them (choice.py),
  measured on plain calls. A dense term on a GPU puts Pallas first (sm80: 2.4x / 2.0x slower,
  H200) unless Hopper's dense tiles take both ways (`_native.hopper_dense`). A decode step with
  ids or ALiBi slopes puts native first (Pallas's decode kernel takes no ids; slopes 2.3x). Past
  256 on a GPU, native's Hopper forward where it takes the call, else Pallas. A small CPU call
  that hides no pair may take xla (choice.SMALL_SCORES: its dense softmax keeps the NaN rules)."""
  if call.width > max_head_dim("native"):
    return ("pallas",)
  if call.width > MAX_CUDA_HEAD_DIM and platform() != "cpu":
    return ("native", "pallas")   # native: the Hopper forward, where it takes the call
  hides = (call.spec.window_left >= 0 or call.spec.window_right >= 0 or call.dense is not None
           or any(x is not None for x in (call.q_lengths, call.kv_lengths, call.segments)))
  small = not hides and platform() == "cpu" and math.prod(call.q.shape[:-1]) * call.k.shape[-3] <= choice.SMALL_SCORES
  order = choice.order(jax.devices()[0].device_kind, _native.build_id, call.q.dtype, call.width,
                       call.spec.window_right >= 0, call.q.shape[-3], small)
  if (call.alibi is not None or call.segments is not None) and choice.is_decode(call.q.shape[-3]):
    order = tuple(sorted(order, key=lambda name: name != "native"))
  if call.dense is not None and platform() != "cpu" and not _native.call_hopper_dense(call):
    order = tuple(sorted(order, key=lambda name: name != "pallas"))
  return order


def choose(call: Call, implementation, cudnn_unsupported: str | None = None) -> str:
  """The implementation that runs `call`: the one named (ValueError if it cannot serve
  the call), the first of a sequence that can (one ValueError with each one's reason if
  none can), or for None the first of the measured order (choice.py) that can, else xla.
  `cudnn_unsupported` is why "cudnn" cannot serve the call (the entry point knows).
  """
  if isinstance(implementation, (list, tuple)):
    if not implementation or any(name not in IMPLEMENTATIONS for name in implementation):
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or a non-empty "
                       f"sequence of them, got {implementation!r}")
    reasons = []
    for name in implementation:
      try:
        return choose(call, name, cudnn_unsupported)
      except ValueError as e:
        reasons.append(f"{name!r}: {e}")
    raise ValueError(f"no implementation of {tuple(implementation)} serves this call: "
                     + "; ".join(reasons))
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if implementation in ("native", "pallas"):
    reason = fused_unsupported(call, implementation)
    if reason:
      raise ValueError(reason)
    return implementation
  if implementation == "cudnn" and cudnn_unsupported:
    raise ValueError(cudnn_unsupported)
  if implementation is not None:
    return implementation
  # An order may name some implementations only (some could not run): the fallback order follows.
  for name in dict.fromkeys((*automatic_order(call), *choice.FALLBACK)):
    if name == "xla" or fused_unsupported(call, name, explicit=False) is None:
      return name
  return "xla"


# ------------------------------------------------------------------ result

def full_lengths(batch: int, length: int) -> jax.Array:
  """[batch] lengths that cover the whole sequence (where the kernels need an array)."""
  return jnp.full((batch,), length, jnp.int32)


def empty_result(call: Call):
  """(o, lse) of an empty call: zeros, and the statistics of rows that see no key."""
  B, T, N, _ = call.q.shape
  return (jnp.zeros((B, T, N, call.v.shape[-1]), call.q.dtype),
          jnp.full((B, N, T), reference.empty_lse(jnp.float32)))


def run_fused(call: Call, q_lengths, kv_lengths, tables, kernels):
  """(o, lse) of `call` through `fused` with `kernels`.

  A value head dim that differs from q/k's (MLA) goes as it is to kernels that take it
  (`takes_value_width`); the others run at `call.width`, the narrower side zero-padded.
  Exact: zero columns of q and k add nothing to q.k, zero columns of v make output
  columns that are sliced off, and autodiff routes it all back.
  """
  own = kernels.takes_value_width(call)
  pad = lambda x: (x if own or x.shape[-1] == call.width else
                   jnp.pad(x, [(0, 0)] * 3 + [(0, call.width - x.shape[-1])]))
  out, lse = fused(pad(call.q), pad(call.k), pad(call.v), q_lengths, kv_lengths, tables,
                   call.alibi, call.dense, kernels, call.spec)
  return (out[..., :call.v.shape[-1]] if call.width > call.v.shape[-1] else out), lse


def finish(call: Call, out, lse, return_residual: bool, residual_dtype,
           differentiable_residual: bool = False):
  """The caller's layout: the output shaped like the query, the residual [B, T, N]."""
  out = out.reshape(call.output_shape)
  if not return_residual:
    return out
  lse = jnp.transpose(lse, (0, 2, 1)).reshape(call.output_shape[:-1])
  lse = reference.cast_lse(lse, residual_dtype if residual_dtype is not None else call.q.dtype)
  return out, (lse if differentiable_residual else jax.lax.stop_gradient(lse))
