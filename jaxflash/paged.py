"""Attention over a paged KV cache: `paged_attention`.

The layout is the one serving engines use (FlashAttention's
``flash_attn_with_kvcache``, vLLM): keys and values live in fixed-size pages
``[num_pages, page_size, kv_heads, head_dim]`` shared by all sequences, and a
page table ``[batch, max_pages]`` says where each sequence's logical page p
is. The native kernels read K/V tiles through the table in place (no gather);
the ``xla`` implementation gathers the pages and runs the reference, which is
what the native one is checked against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import _core, _native, _splits, reference, segments as _segments

_PAGED_IMPLEMENTATIONS = (None, "native", "xla")


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _validate(query, key_pages, value_pages, page_table, kv_lengths):
  q = _core.as_array(query, "query")
  kp = _core.as_array(key_pages, "key_pages")
  vp = _core.as_array(value_pages, "value_pages")
  table = _core.as_array(page_table, "page_table")
  lengths = _core.as_array(kv_lengths, "kv_lengths")
  if q.ndim != 4:
    raise ValueError(f"query must be [batch, q_len, q_heads, head_dim], got shape {q.shape}")
  if kp.ndim != 4:
    raise ValueError("key_pages must be [num_pages, page_size, kv_heads, head_dim], got shape "
                     f"{kp.shape}")
  if vp.ndim != 4 or vp.shape[:3] != kp.shape[:3]:
    raise ValueError(f"value_pages must hold the pages, rows and heads of key_pages {kp.shape} "
                     f"(its head dim may differ), got {vp.shape}")
  B, T, N, D = q.shape
  P, page_size, K, Dk = kp.shape
  if Dk != D:
    raise ValueError(f"query and key_pages must have the same head_dim, got {D} and {Dk}")
  _core.check_heads_and_dtypes(N, K, {"query": q, "key_pages": kp, "value_pages": vp})
  if P < 1 or page_size < 1:
    raise ValueError(f"key_pages must hold at least one page of at least one row, got {kp.shape}")
  if not jnp.issubdtype(table.dtype, jnp.integer) or table.ndim != 2 or table.shape[0] != B:
    raise ValueError(f"page_table must be an integer [batch, max_pages] = [{B}, max_pages] array, "
                     f"got {table.dtype} {table.shape}")
  max_pages = table.shape[1]
  if max_pages < 1:
    raise ValueError("page_table must have at least one column (max_pages >= 1)")
  if max_pages * page_size >= 1 << 30:
    raise ValueError(f"max_pages * page_size must be below 2^30, got {max_pages} * {page_size}")
  if not jnp.issubdtype(lengths.dtype, jnp.integer) or lengths.shape != (B,):
    raise ValueError(f"kv_lengths must be an integer array of shape (batch,) = ({B},), got "
                     f"{lengths.dtype} {lengths.shape}")
  # Values can be checked only when known at trace time (not under jit); on
  # the device a bad entry is clamped into range, never read out of bounds.
  if _is_concrete(lengths):
    n = np.asarray(lengths)
    if np.any(n < 0) or np.any(n > max_pages * page_size):
      raise ValueError(f"kv_lengths must be in [0, max_pages * page_size] = [0, "
                       f"{max_pages * page_size}], got {n.tolist()}")
    if _is_concrete(table):
      t = np.asarray(table)
      used = np.arange(max_pages)[None, :] < -(-n[:, None] // page_size)
      bad = used & ((t < 0) | (t >= P))
      if np.any(bad):
        b, p = np.argwhere(bad)[0]
        raise ValueError(f"page_table[{b}, {p}] = {t[b, p]} is not a page index in [0, {P}) "
                         f"(sequence {b} has {n[b]} keys, so it uses its first "
                         f"{-(-n[b] // page_size)} pages)")
  return q, kp, vp, table.astype(jnp.int32), lengths.astype(jnp.int32)


def _choose(q, vp, implementation) -> str:
  if implementation not in _PAGED_IMPLEMENTATIONS:
    raise ValueError(f"paged_attention implementation must be one of {_PAGED_IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  reason = None
  if q.dtype not in _core.FUSED_DTYPES:
    reason = f"the native paged kernels take float32, float16 and bfloat16, got {q.dtype}"
  elif max(q.shape[-1], vp.shape[-1]) > (limit := _core.MAX_CUDA_HEAD_DIM if _core.platform() != "cpu"
                                          else _core.MAX_FUSED_HEAD_DIM):
    reason = f"the native paged kernels take head_dim <= {limit} here"
  elif vp.shape[-1] != q.shape[-1] and not _native.value_width_on(q.shape, vp.shape, vp.shape[-1],
                                                                   q.dtype, paged=True):
    reason = ("the native paged kernels take a value head dim that differs from the key's on "
              "the CPU, and on a GPU for 16-bit inputs whose head dims are multiples of 8")
  else:
    reason = _native.unavailable_reason(_core.platform())
  if implementation == "native" and reason:
    raise ValueError(reason)
  if implementation is None:
    return "xla" if reason else "native"
  return implementation


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _native_paged(q, kp, vp, table, lengths, tables, alibi, spec):
  keys = (q.shape[0], table.shape[1] * kp.shape[1], kp.shape[2], kp.shape[3])
  splits = (1 if tables is not None else
            _splits.native(spec.num_splits, q.shape, keys, q.dtype, _core.platform(), paged=True))
  # vmap runs the call once per element ("sequential"): the pages are shared
  # state that batching the call would have to offset.
  call = jax.ffi.ffi_call(_native.PAGED_TARGET, _core.NativeKernels.out_types(q, splits, vp.shape[-1]),
                          vmap_method="sequential")
  o, _, _, _ = call(q, kp, vp, table, lengths, *_segments.operands(tables),
                    reference.alibi_operand(alibi), scale=np.float32(spec.scale),
                    window_left=np.int64(spec.window_left),
                    window_right=np.int64(spec.window_right),
                    tile=np.int64(_native.forced_tile_attr()), num_splits=np.int64(splits),
                    softcap=np.float32(spec.softcap))
  return o


def _native_paged_fwd(q, kp, vp, table, lengths, tables, alibi, spec):
  return _native_paged(q, kp, vp, table, lengths, tables, alibi, spec), None


def _native_paged_bwd(spec, residuals, cotangent):
  raise NotImplementedError(
      "paged_attention with implementation='native' is forward-only (a decode step needs no "
      "gradient); differentiate implementation='xla', or dot_product_attention over "
      "contiguous keys and values")


_native_paged.defvjp(_native_paged_fwd, _native_paged_bwd)


def paged_attention(query, key_pages, value_pages, page_table, kv_lengths, *, scale=None,
                    is_causal: bool = True, local_window_size=None, num_splits=None,
                    logits_soft_cap=None, query_segment_ids=None, key_value_segment_ids=None,
                    alibi_slopes=None, implementation=None):
  r"""Attention of new queries against a paged KV cache (decoding, chunked prefill).

  Args:
    query: ``[batch, q_len, q_heads, head_dim]``: the newest ``q_len`` tokens of
      each sequence (``q_len`` >= 1: a decode step, speculative tokens, or a
      prefill chunk).
    key_pages, value_pages: ``[num_pages, page_size, kv_heads, head_dim]``,
      the pages of every sequence; ``q_heads`` a multiple of ``kv_heads``
      (GQA). Any ``page_size`` >= 1. The value pages' head dim may differ
      (MLA-style; the output takes it): the CPU kernels and ``xla`` take it.
    page_table: int32 ``[batch, max_pages]``: logical page p of sequence b is
      physical page ``page_table[b, p]``. Entries past a sequence's length are
      never read (any value, e.g. -1, is fine there).
    kv_lengths: int ``[batch]``: keys of each sequence, in
      ``[0, max_pages * page_size]``; they include the ``q_len`` new tokens,
      whose keys and values must already be written to the pages.
    scale: multiplies ``q . k`` (default ``1 / sqrt(head_dim)``).
    is_causal: query row i sits at position ``kv_lengths[b] - q_len + i``
      (bottom-right alignment) and sees keys up to it. With ``False`` every
      row sees all ``kv_lengths[b]`` keys.
    local_window_size: ``w`` or ``(left, right)``, relative to each row's
      position, as in :func:`jaxflash.dot_product_attention`.
    num_splits: split-KV, as in :func:`jaxflash.dot_product_attention`
      (``None`` automatic, an int in [1, 1024] forced).
    logits_soft_cap: ``c`` > 0 caps every score at ``c * tanh(score / c)``, as
      in :func:`jaxflash.dot_product_attention`.
    query_segment_ids, key_value_segment_ids: integer ``[batch, q_len]`` and
      ``[batch, max_pages * page_size]`` (the cache's logical positions) ids of
      packed sequences: a row sees only the cached keys of its own segment, as in
      :func:`jaxflash.dot_product_attention` (both must be given; not with
      ``num_splits`` > 1).
    alibi_slopes: float ``[q_heads]`` or ``[batch, q_heads]`` ALiBi slopes: the
      score of row ``i`` (at its position in the cache) and key ``j`` gets
      ``-slope * |position - j|`` added, as in
      :func:`jaxflash.dot_product_attention`; split-KV included.
    implementation: ``None`` (``native`` where it can serve the call, else
      ``xla``), ``"native"`` (reads the pages in place, CUDA on GPU and C++ on
      CPU) or ``"xla"`` (gathers the pages, then the reference; materialises
      the scores).

  Page indices and lengths are checked when their values are known at trace
  time (outside ``jit``): a used ``page_table`` entry outside
  ``[0, num_pages)`` or a length beyond the table raises ``ValueError``.
  Under ``jit`` the kernels clamp them, so a bad table gives wrong numbers but
  never an out-of-bounds read.

  ``native`` is forward-only: differentiating it raises
  ``NotImplementedError`` (``xla`` is differentiable).

  Returns:
    ``[batch, q_len, q_heads, head_dim]`` in the query's dtype. Rows that see
    no key (a sequence of length 0, or a window that covers no key) are zeros.
  """
  q, kp, vp, table, lengths = _validate(query, key_pages, value_pages, page_table, kv_lengths)
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
  window = _core.parse_window(local_window_size)
  left, right = reference.window_bounds(bool(is_causal), window)
  spec = _core.MaskSpec(scale=_core.resolve_scale(scale, q.shape[-1]),
                        window_left=-1 if left is None else left,
                        window_right=-1 if right is None else right, bottom_right=True,
                        num_splits=_splits.validate(num_splits),
                        softcap=_core.resolve_softcap(logits_soft_cap))
  B, T = q.shape[:2]
  S = table.shape[1] * kp.shape[1]
  if query_segment_ids is not None and key_value_segment_ids is None:
    raise ValueError("paged_attention needs key_value_segment_ids ([batch, max_pages * "
                     "page_size]) with query_segment_ids")
  ids = _segments.validate(query_segment_ids, key_value_segment_ids, (B,), T, S)
  if ids is not None and spec.num_splits > 1:
    raise ValueError("num_splits > 1 (split-KV) does not take segment ids")
  alibi = _core.resolve_alibi(alibi_slopes, (B,), q.shape[2])
  if _choose(q, vp, implementation) == "native":
    tables = None if ids is None else _segments.tables(*ids, None, lengths, spec)
    return _native_paged(q, kp, vp, table, lengths, tables, alibi, spec)
  k = reference.gather_pages(kp, table)
  v = reference.gather_pages(vp, table)
  out, _ = reference.attention(q, k, v, scale=spec.scale, is_causal=bool(is_causal),
                               causal_alignment="bottom_right", local_window_size=window,
                               key_value_seq_lengths=lengths, logits_soft_cap=spec.softcap or None,
                               segment_ids=ids, alibi_slopes=alibi)
  return out
