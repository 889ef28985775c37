"""The public entry point: a drop-in for `jax.nn.dot_product_attention`.

`dot_product_attention` validates its arguments (`_core.validate`: every bad
input raises at trace time, before any kernel can see it), picks an
implementation (`_core.choose`), and runs the fused ones (`native`, `pallas`)
through `_core.fused` with their kernels wrapped in the partition rules
(sharding.py), so a sharded call stays on its shards under `jax.jit`.
"""

from __future__ import annotations

from typing import Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import _core, checks, reference, sharding
from jaxflash._core import Implementation


def dot_product_attention(
    query, key, value, bias=None, mask=None, *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Implementation | Sequence[Implementation | None] | None = None,
    return_residual: bool = False,
    causal_alignment: Literal["top_left", "bottom_right"] = "top_left",
    residual_dtype=None,
    differentiable_residual: bool = False,
    deterministic: bool = False,
    num_splits: int | None = None,
    logits_soft_cap: float | None = None,
    query_segment_ids=None,
    key_value_segment_ids=None,
    alibi_slopes=None,
):
  r"""Scaled dot-product attention that never materialises the score matrix.

  A drop-in for :func:`jax.nn.dot_product_attention`: same arguments, layouts
  (``[batch, seq, heads, head_dim]`` or without the batch axis; also any number
  of leading batch axes ``[*batch, seq, heads, head_dim]``, with sequence
  lengths of shape ``batch`` and bias/mask broadcastable to
  ``[*batch, heads, q_len, kv_len]``), GQA rule,
  top-left ``is_causal``, ``(left, right)`` ``local_window_size`` and sequence
  lengths. ``implementation``:

  * ``None`` — the first of ``native`` and ``pallas`` that supports the call
    here, in the order measured fastest for the call's class (device, dtype
    width, head-dim bucket, causal, decode step or not: jaxflash/choice.py;
    ``python -m jaxflash.tune --orders`` measures it on your GPU), else
    ``xla``. Where no one measured the class, ``native`` comes first. On a
    CPU, ``xla`` competes too for calls of at most 2^14 scores that hide no
    pair (``choice.SMALL_SCORES``).
  * ``"native"`` — the jaxflash kernels (CUDA on GPU, C++ on CPU) via XLA FFI.
  * ``"pallas"`` — the jaxflash Pallas kernels.
  * ``"xla"`` — plain ``jax.numpy`` (materialises the scores; supports
    ``bias``, ``mask`` and float64).
  * ``"cudnn"`` — forwarded to ``jax.nn.dot_product_attention``.

  Naming an implementation that cannot serve the call raises ``ValueError``; it
  never silently falls back. A sequence (``("native", "xla")``) runs the first
  that can serve the call, or raises one ``ValueError`` with each one's reason. Sequence lengths outside ``[0, length]`` are
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
    logits_soft_cap: ``c`` > 0 caps every score (Gemma-style): ``scale * q.k``
      becomes ``c * tanh(scale * q.k / c)`` before masking (and before a dense
      ``bias`` is added); the backward multiplies by ``1 - tanh^2``. ``None``:
      no cap. Fused in every implementation but ``cudnn``.
    query_segment_ids, key_value_segment_ids: integer ``[*batch, q_len]`` /
      ``[*batch, kv_len]`` ids of packed sequences: row ``i`` sees key ``j``
      only if their ids are equal (and the mask, window and lengths let it).
      For self-attention the key ids may be omitted (they default to the query
      ids). Key tiles of other segments are skipped, not computed and masked;
      ids sorted within a row (documents one after another) skip the most,
      any other order is as correct. Native (GPU and CPU), Pallas and ``xla``;
      not with ``num_splits`` > 1.
    alibi_slopes: float ``[heads]`` (or ``[*batch, heads]``) ALiBi slopes: the
      score of row ``i`` and key ``j`` gets ``-slope * |i + offset - j|`` added,
      where ``i + offset`` is the row's diagonal under ``causal_alignment`` (and
      the lengths, for bottom-right), after the soft-cap and before masking.
      Computed in the kernels, never materialised; the slopes are constants
      (no gradient flows to them). Native (GPU and CPU; decode steps and
      split-KV included), Pallas and ``xla``.

  Returns:
    The output, shaped like ``query``; with ``return_residual=True`` a tuple
    ``(output, lse)`` where ``lse`` is ``[*batch, q_len, heads]``: the natural
    log-sum-exp of each row's scaled logits.
  """
  call = _core.validate(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
                        key_value_seq_lengths, local_window_size, causal_alignment, deterministic,
                        num_splits, logits_soft_cap, query_segment_ids, key_value_segment_ids,
                        alibi_slopes)
  if not isinstance(differentiable_residual, (bool, np.bool_)):
    raise TypeError(f"differentiable_residual must be a bool, got {differentiable_residual!r}")
  if differentiable_residual and not return_residual:
    raise ValueError("differentiable_residual=True needs return_residual=True")
  # Lengths outside [0, len] are clamped (as jax.nn's masks treat them);
  # jaxflash.checked turns these into errors.
  checks.lengths_in_range(call.q_lengths, "query_seq_lengths", call.q.shape[1])
  checks.lengths_in_range(call.kv_lengths, "key_value_seq_lengths", call.k.shape[1])
  chosen = _core.choose(call, implementation, _cudnn_unsupported(
      call, residual_dtype is not None or deterministic or differentiable_residual
      or num_splits is not None or logits_soft_cap is not None or call.segments is not None
      or call.alibi is not None))

  if chosen == "cudnn":
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation="cudnn",
        return_residual=return_residual)

  if call.empty:
    out, lse = _core.empty_result(call)
  elif chosen == "xla":
    out, lse = reference.attention(
        call.q, call.k, call.v, scale=call.spec.scale, bias=call.bias, mask=call.mask,
        is_causal=call.is_causal,
        causal_alignment="bottom_right" if call.spec.bottom_right else "top_left",
        local_window_size=call.window, query_seq_lengths=call.q_lengths,
        key_value_seq_lengths=call.kv_lengths, logits_soft_cap=call.spec.softcap or None,
        segment_ids=call.segments, alibi_slopes=call.alibi)
  else:
    B, T = call.q.shape[:2]
    q_lengths = call.q_lengths if call.q_lengths is not None else _no_lengths(B, T)
    kv_lengths = call.kv_lengths if call.kv_lengths is not None else _no_lengths(B, call.k.shape[1])
    # The partition rules (sharding.py) keep a sharded call on its shards under jit.
    kernels = sharding.partitioned(_core.KERNELS[chosen])
    tables = None if call.segments is None else sharding.segment_tables(
        call.segments, call.q_lengths, call.kv_lengths, call.spec)
    out, lse = _core.run_fused(call, q_lengths, kv_lengths, tables, kernels)
  return _core.finish(call, out, lse, return_residual, residual_dtype, differentiable_residual)


def _cudnn_unsupported(call: _core.Call, extra_keywords: bool) -> str | None:
  """Why implementation="cudnn" (jax.nn's, called with the caller's arguments) cannot
  serve the call, or None."""
  if extra_keywords or call.spec.bottom_right:
    return ("implementation='cudnn' forwards to jax.nn.dot_product_attention and takes none "
            "of jaxflash's extra keywords")
  if len(call.output_shape) > 4:
    return "implementation='cudnn' takes rank 3 or 4 inputs (jax.nn's layouts)"
  if call.q.dtype not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
    return f"implementation='cudnn' takes float16 and bfloat16, got {call.q.dtype}"
  if _core.platform() != "gpu":
    return "implementation='cudnn' runs on GPUs only"
  return None


def _no_lengths(batch: int, length: int) -> jax.Array:
  """The lengths of a call that gave none: `reference.no_lengths()`, except
  inside `shard_map`, where they are `length` for every batch element, as in
  ring attention (one small fill per call).

  The lengths leave the manual computation: as residuals for the backward,
  and under eager shard_map as operands of each primitive's own one. An empty
  operand there crashes XLA (jaxlib 0.11's Shardy, in
  ManualComputationUnusedInputsPattern, after zero-sized HLO elimination).
  """
  if jax.sharding.get_abstract_mesh().manual_axes:
    return _core.full_lengths(batch, length)
  return reference.no_lengths()
