"""FlashAttention forward and backward kernels written with Pallas.

This is the project's second, independent implementation of the attention
contract (the first is the native FFI path, the third the plain-jnp
reference). It runs on NVIDIA GPUs through the Pallas Triton lowering and on
the CPU through the Pallas interpreter (``interpret=True``), which CI uses.

Layouts and semantics are the project's:

* ``q``/``o``/``do``/``dq``: ``[B, T, Hq, D]``; ``k``/``v``/``dk``/``dv``:
  ``[B, S, Hkv, D]``; ``Hq`` a multiple of ``Hkv`` (grouped-query attention is
  index arithmetic in the block index maps, K/V are never repeated).
* ``lse``/``dlse``: float32 ``[B, Hq, T]``, natural-log units.
* Row ``i < q_len_b`` of batch ``b`` sees key ``j`` iff ``j < kv_len_b`` and
  ``(left < 0 or j >= i + off - left)`` and ``(right < 0 or j <= i + off + right)``
  with ``off = kv_len_b - q_len_b`` when ``bottom_right`` else ``0``, plus the
  optional per-batch ``diagonal_offsets[b]`` (ring attention's blocks). Causal
  attention is ``window_right = 0``. Rows with nothing visible produce zeros,
  the lowest finite float32 as ``lse`` and zero gradients.
* Non-finite inputs propagate over the visible pairs only (IEEE arithmetic,
  as a dense softmax would), and never from a key a row cannot see: padding
  rows and keys are zeroed where a masked tile loads them, and a block whose
  result shows a NaN (a masked pair's 0 * NaN in a tile product) is
  recomputed pair by pair.

Kernels
-------
forward   grid (q blocks, B, Hq). Online softmax in base 2 (``log2(e)`` folded
          into the scale) over the K/V blocks the mask lets the query block
          see; fp32 accumulators; writes O and LSE.
dK/dV     grid (kv blocks, B, Hkv). For one K/V block, walks the query heads
          of its group and the query blocks that can see it, recomputing P
          from the LSE; the group sum of dK/dV happens in the fp32 accumulator.
dQ        grid (q blocks, B, Hq). Same walk as the forward, accumulates dS K.
tangent   grid (q blocks, B, Hq). Same walk as the forward, forward mode's
          (tO, tLSE) from O, the LSE and (tQ, tK, tV); in tangent.py.

Every kernel splits its walk into three ranges of blocks: a masked range at
each end and an unmasked interior of tiles that are entirely visible, so the
per-element mask is evaluated only on boundary tiles. Blocks the mask
excludes entirely are never visited. T, S are padded to the block size and the
head dim to a power of two (at least 16) in the wrapper; the padding is
masked (rows/keys) or zero (head dim) and sliced off again.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxflash import _splits, reference

try:  # The Triton-specific module; present on every jax this package supports.
  from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover
  _plgpu = None

__all__ = [
    "MAX_HEAD_DIM",
    "PallasConfig",
    "default_config",
    "pallas_backward",
    "pallas_forward",
    "pallas_supported",
]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# The LSE of a row that sees no key (params.h kEmptyRowLse): finite, so that
# jax.debug_infs stays quiet, and low enough to act as log 0.
_EMPTY_LSE = float(np.finfo(np.float32).min)
_SUPPORTED_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
MAX_HEAD_DIM = 256
_MIN_BLOCK = 16  # Triton's dot needs every dimension >= 16.
_MAX_OFFSET = 1 << 30  # bound of the diagonal offsets (sequences are shorter)


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


_BLOCK_FIELDS = ("block_q", "block_k", "block_q_dkv", "block_k_dkv",
                 "block_q_dq", "block_k_dq")
_INT_FIELDS = ("num_warps", "num_stages", "num_warps_bwd", "num_stages_bwd")


@dataclasses.dataclass(frozen=True)
class PallasConfig:
  """Tuning knobs of the Pallas attention kernels.

  Every field left as ``None`` is filled by :func:`default_config` from the
  head dim, the dtype and the platform. Block sizes must be powers of two and
  at least 16; a block larger than the (padded) sequence is shrunk to it, so
  short sequences (decoding) do not pay for padding. Results do not depend on
  the block sizes beyond floating-point summation order.

  Attributes:
    block_q: query rows per program of the forward kernel.
    block_k: keys per inner-loop step of the forward kernel.
    block_q_dkv: query rows per inner-loop step of the dK/dV kernel.
    block_k_dkv: keys per program of the dK/dV kernel.
    block_q_dq: query rows per program of the dQ kernel.
    block_k_dq: keys per inner-loop step of the dQ kernel.
    num_warps: warps per program of the forward kernel (GPU only).
    num_stages: software-pipelining depth of the forward kernel (GPU only).
    num_warps_bwd: warps per program of the backward kernels (GPU only).
    num_stages_bwd: pipelining depth of the backward kernels (GPU only).
    interpret: run the kernels in the Pallas interpreter. ``None`` chooses it
      automatically when the default backend is the CPU.
  """

  block_q: int | None = None
  block_k: int | None = None
  block_q_dkv: int | None = None
  block_k_dkv: int | None = None
  block_q_dq: int | None = None
  block_k_dq: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  num_warps_bwd: int | None = None
  num_stages_bwd: int | None = None
  interpret: bool | None = None

  def __post_init__(self):
    for name in _BLOCK_FIELDS:
      value = getattr(self, name)
      if value is None:
        continue
      if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
          or value < _MIN_BLOCK or (value & (value - 1))):
        raise ValueError(
            f"PallasConfig.{name} must be a power of two >= {_MIN_BLOCK}, "
            f"got {value!r}")
    for name in _INT_FIELDS:
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool)
                                or not isinstance(value, (int, np.integer))
                                or value < 1):
        raise ValueError(
            f"PallasConfig.{name} must be a positive int, got {value!r}")
    if self.interpret is not None and not isinstance(self.interpret, bool):
      raise ValueError(
          f"PallasConfig.interpret must be a bool or None, got "
          f"{self.interpret!r}")


def _next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _padded_head_dim(head_dim: int) -> int:
  return max(_MIN_BLOCK, _next_pow2(head_dim))


# Shared memory the estimates below may use per program: below the 163 KiB an
# A100 grants one block, leaving room for Triton's own layout conversions.
_SMEM_BUDGET = 128 * 1024


def _fit_smem(itemsize: int, dp: int, major: int, minor: int, stages: int,
              resident: int, streamed: int = 2) -> tuple[int, int, int]:
  """Shrinks (stages, minor block, major block) until the tiles fit.

  ``resident`` tiles of ``major x dp`` stay for the whole program and
  ``streamed`` tiles of ``minor x dp`` are buffered ``stages`` deep.
  """
  def smem(major, minor, stages):
    return itemsize * dp * (resident * major + streamed * minor * stages)

  while smem(major, minor, stages) > _SMEM_BUDGET:
    if stages > 1:
      stages -= 1
    elif minor > _MIN_BLOCK:
      minor //= 2
    elif major > _MIN_BLOCK:
      major //= 2
    else:
      break
  return major, minor, stages


def default_config(head_dim: int, dtype=jnp.bfloat16, *,
                   interpret: bool | None = None) -> PallasConfig:
  """The configuration used for the fields a caller leaves as ``None``.

  GPU choices: the program's resident tiles plus the pipelined K/V (or Q/dO)
  tiles are kept within an A100's shared memory at every head dim and dtype;
  the backward kernels use a long resident block and a short streamed one.
  """
  if interpret is None:
    interpret = _default_interpret()
  dp = _padded_head_dim(head_dim)
  if interpret:
    # The interpreter's cost is per grid step and per loop iteration, so
    # larger blocks are faster; the numerics do not depend on them.
    return PallasConfig(64, 64, 64, 64, 64, 64, None, None, None, None, True)
  itemsize = jnp.dtype(dtype).itemsize
  if dp <= 64:
    fwd, bwd, warps, warps_bwd = (128, 64, 3), (128, 32, 3), 4, 4
  elif dp <= 128:
    fwd, bwd, warps, warps_bwd = (128, 64, 3), (128, 32, 2), 8, 8
  else:
    fwd, bwd, warps, warps_bwd = (64, 32, 2), (64, 32, 2), 8, 8
  bq, bk, stages = _fit_smem(itemsize, dp, *fwd, resident=1)
  major, minor, stages_bwd = _fit_smem(itemsize, dp, *bwd, resident=2)
  return PallasConfig(
      block_q=bq, block_k=bk, block_q_dkv=minor, block_k_dkv=major,
      block_q_dq=major, block_k_dq=minor, num_warps=warps, num_stages=stages,
      num_warps_bwd=warps_bwd, num_stages_bwd=stages_bwd, interpret=False)


def _default_interpret() -> bool:
  return jax.default_backend() == "cpu"


def _resolve_config(config: PallasConfig | None, head_dim: int,
                    dtype) -> PallasConfig:
  if config is None:
    config = PallasConfig()
  if not isinstance(config, PallasConfig):
    raise TypeError(
        f"config must be a jaxflash.pallas.PallasConfig or None, got "
        f"{type(config).__name__}")
  interpret = config.interpret
  if interpret is None:
    interpret = _default_interpret()
  base = default_config(head_dim, dtype, interpret=interpret)
  fields = {
      f.name: (getattr(config, f.name) if getattr(config, f.name) is not None
               else getattr(base, f.name))
      for f in dataclasses.fields(PallasConfig)
  }
  fields["interpret"] = bool(interpret)
  return PallasConfig(**fields)


def _compiler_params(num_warps, num_stages, tile_m: int, tile_n: int):
  """Triton compiler parameters, spelled as the installed jax spells them.

  ``tile_m x tile_n`` is the kernel's score tile: warps beyond one per 256
  elements of it would only replicate work, so small tiles (short sequences,
  tiny test blocks) get fewer warps.
  """
  if num_warps is not None:
    num_warps = max(1, min(int(num_warps), (tile_m * tile_n) // 256))
  if _plgpu is None:
    return None
  cls = getattr(_plgpu, "CompilerParams", None)
  if cls is None:  # Older spelling.
    cls = getattr(_plgpu, "TritonCompilerParams", None)
  if cls is None:
    return None
  return cls(num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------------------
# Support check
# ---------------------------------------------------------------------------


def pallas_supported(q_shape, k_shape, v_shape=None, dtype=jnp.float32,
                     platform: str | None = None, *, k_dtype=None,
                     v_dtype=None, has_bias: bool = False,
                     has_mask: bool = False, has_segment_ids: bool = False,
                     logits_soft_cap=None, interpret_ok: bool = True
                     ) -> str | None:
  """Why the Pallas kernels cannot serve a call, or ``None`` when they can.

  Args:
    q_shape, k_shape, v_shape: shapes ``[B, T, Hq, D]``, ``[B, S, Hkv, D]``,
      ``[B, S, Hkv, D]`` (``v_shape`` defaults to ``k_shape``).
    dtype: dtype of ``q`` (``k_dtype``/``v_dtype`` default to it).
    platform: ``"cpu"``, ``"gpu"``/``"cuda"``, ... ; ``None`` means the
      default backend.
    has_bias, has_mask, has_segment_ids, logits_soft_cap: features of the
      public API the kernels do not implement; any of them makes the call
      unsupported.
    interpret_ok: whether running in the Pallas interpreter (the CPU path,
      exact but slow) is acceptable. Automatic selection should pass False.
  """
  if has_bias:
    return "the pallas implementation does not support `bias`"
  if has_mask:
    return "the pallas implementation does not support a boolean `mask`"
  if has_segment_ids:
    return "the pallas implementation does not support segment ids"
  if logits_soft_cap is not None:
    return "the pallas implementation does not support a logits soft-cap"
  v_shape = k_shape if v_shape is None else v_shape
  shapes = {"query": tuple(q_shape), "key": tuple(k_shape),
            "value": tuple(v_shape)}
  for name, shape in shapes.items():
    if len(shape) != 4:
      return f"`{name}` must have rank 4 [batch, seq, heads, head_dim]"
  (b, _, hq, d), (bk, s, hkv, dk), (bv, sv, hv, dv) = (
      shapes["query"], shapes["key"], shapes["value"])
  if not (b == bk == bv):
    return "query, key and value must have the same batch size"
  if s != sv or hkv != hv:
    return "key and value must have the same sequence length and heads"
  if not (d == dk == dv):
    return "the pallas implementation needs one head dim for q, k and v"
  if d < 1 or d > MAX_HEAD_DIM:
    return f"the pallas implementation supports head dims 1..{MAX_HEAD_DIM}"
  if hkv < 1 or hq % hkv:
    return "query heads must be a multiple of key/value heads"
  dtypes = [jnp.dtype(dtype), jnp.dtype(k_dtype or dtype),
            jnp.dtype(v_dtype or dtype)]
  if any(t != dtypes[0] for t in dtypes):
    return "the pallas implementation needs one dtype for q, k and v"
  if dtypes[0] not in [jnp.dtype(t) for t in _SUPPORTED_DTYPES]:
    return (f"the pallas implementation supports float32, float16 and "
            f"bfloat16, got {dtypes[0]}")
  platform = (platform or jax.default_backend()).lower()
  if platform == "cpu":
    if not interpret_ok:
      return ("the pallas implementation runs on the CPU only in the Pallas "
              "interpreter, which is slow; name it explicitly to use it")
    return None
  if platform not in ("gpu", "cuda"):
    return f"the pallas implementation does not run on platform {platform!r}"
  if _plgpu is None:
    return "this jax has no Pallas Triton backend"
  try:
    devices = jax.devices(platform)
  except RuntimeError:
    devices = []
  for device in devices[:1]:
    cc = getattr(device, "compute_capability", None)
    if cc is None:
      return "the pallas implementation needs an NVIDIA GPU"
    try:
      major = int(str(cc).split(".")[0])
    except ValueError:
      return f"unrecognised GPU compute capability {cc!r}"
    if major < 8:
      return ("the pallas implementation needs an NVIDIA GPU of compute "
              f"capability 8.0 or newer, got {cc}")
  return None


# ---------------------------------------------------------------------------
# Mask arithmetic (scalars and vectors of int32; left/right are static ints)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Mask:
  """The mask rule for one batch element, evaluated inside a kernel."""

  q_valid: jax.Array    # rows [0, q_valid) are real queries
  kv_valid: jax.Array   # keys [0, kv_valid) exist
  offset: jax.Array     # diagonal position of row 0
  left: int             # static; < 0 unbounded
  right: int            # static; < 0 unbounded

  @classmethod
  def make(cls, q_valid, kv_valid, extra, left, right, bottom_right):
    # Saturated at +-2^30 like the native kernels' MaskPolicy.
    extra = jnp.clip(extra, -_MAX_OFFSET, _MAX_OFFSET)
    offset = (kv_valid - q_valid if bottom_right else jnp.int32(0)) + extra
    return cls(q_valid, kv_valid, jnp.clip(offset, -_MAX_OFFSET, _MAX_OFFSET), left, right)

  # Keys visible to row r: [key_begin(r), key_end(r)); both non-decreasing.
  def key_begin(self, row):
    if self.left < 0:
      return jnp.zeros_like(row)
    return jnp.maximum(row + self.offset - self.left, 0)

  def key_end(self, row):
    if self.right < 0:
      return jnp.broadcast_to(self.kv_valid, jnp.shape(row))
    return jnp.clip(row + self.offset + (self.right + 1), 0, self.kv_valid)

  # Rows that see key c: [row_begin(c), row_end(c)) for c < kv_valid.
  def row_begin(self, col):
    if self.right < 0:
      return jnp.zeros_like(col)
    return jnp.clip(col - self.offset - self.right, 0, self.q_valid)

  def row_end(self, col):
    if self.left < 0:
      return jnp.broadcast_to(self.q_valid, jnp.shape(col))
    return jnp.clip(col - self.offset + (self.left + 1), 0, self.q_valid)

  def visible(self, rows, cols):
    """Element mask for rows [bq, 1] x cols [1, bk]."""
    vis = (rows < self.q_valid) & (cols < self.kv_valid)
    if self.left >= 0:
      vis &= cols >= rows + self.offset - self.left
    if self.right >= 0:
      vis &= cols <= rows + self.offset + self.right
    return vis

  def has_keys(self, rows):
    """Rows that see at least one key (the others output zeros)."""
    return (rows < self.q_valid) & (self.key_begin(rows) < self.key_end(rows))


def _cdiv(a, b: int):
  return lax.div(a + (b - 1), jnp.int32(b))


def _three_ranges(lo_elem, hi_elem, full_lo_elem, full_hi_elem, all_full,
                  block: int):
  """Splits the element range [lo_elem, hi_elem) into block ranges.

  Returns (lo, a, b, hi): blocks [lo, a) and [b, hi) need the element mask,
  blocks [a, b) are entirely visible. ``full_lo_elem``/``full_hi_elem`` bound
  the elements that every row/column of the tile sees; ``all_full`` is a
  scalar bool saying whether full tiles can exist at all.
  """
  nonempty = hi_elem > lo_elem
  lo = lax.div(lo_elem, jnp.int32(block))
  hi = jnp.where(nonempty, _cdiv(hi_elem, block), lo)
  a = jnp.clip(_cdiv(full_lo_elem, block), lo, hi)
  b = jnp.clip(lax.div(full_hi_elem, jnp.int32(block)), a, hi)
  b = jnp.where(all_full, b, a)
  return lo, a, b, hi


def _key_blocks(mask, r0, block_q: int, block_k: int):
  """Key blocks the query rows [r0, r0 + block_q) visit, as _three_ranges
  splits them (masked head, unmasked interior, masked tail). Shared by the
  forward and dQ kernels, which walk keys for a fixed block of rows."""
  last_row = jnp.minimum(r0 + block_q, mask.q_valid) - 1
  rows_exist = last_row >= r0
  lo_elem = mask.key_begin(r0)
  hi_elem = jnp.where(rows_exist, mask.key_end(jnp.maximum(last_row, 0)), 0)
  all_rows = r0 + block_q <= mask.q_valid
  return _three_ranges(lo_elem, hi_elem, mask.key_begin(r0 + block_q - 1), mask.key_end(r0),
                       all_rows, block_k)


def _dot(a, b, contract_a: int, contract_b: int):
  # HIGHEST: float32 operands get IEEE products on GPU (Triton's default for
  # them is TF32, whose 1e-3 error is amplified in dS = P * (dP - delta)).
  # Half-precision operands are unaffected.
  return lax.dot_general(
      a, b, (((contract_a,), (contract_b,)), ((), ())),
      precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
      preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------
# Forward kernel
# ---------------------------------------------------------------------------


def _attend(q, k_ref, v_ref, rows, mask, ranges, *, qk_scale: float,
            block_k: int):
  """Online softmax of q against the key blocks of ``ranges`` = (lo, a, b, hi):
  [lo, a) and [b, hi) element-masked, [a, b) entirely visible. ``rows`` [bq, 1]
  are the query rows the mask knows for q's rows (q's padding rows zeroed).
  Returns (acc, m, l): the unnormalised output, the running max (log2 units)
  and sum per row."""
  lo, a, bb, hi = ranges

  def step(masked, kb, carry):
    acc, m, l = carry
    start = pl.multiple_of(kb * block_k, block_k)
    k = k_ref[pl.ds(start, block_k), :]
    v = v_ref[pl.ds(start, block_k), :]
    s = _dot(q, k, 1, 1) * qk_scale
    if masked:
      cols = start + jnp.arange(block_k, dtype=jnp.int32)[None, :]
      s = jnp.where(mask.visible(rows, cols), s, -jnp.inf)
      v = _zero_padding(v, cols.T, mask.kv_valid)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A row may have seen only masked (or -inf) scores so far: shift by 0.
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_ref)
    p = jnp.exp2(s - m_ref[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, 1, 0)
    return acc, m_new, l

  block_q, dp = q.shape
  carry = (jnp.zeros((block_q, dp), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  carry = lax.fori_loop(lo, a, functools.partial(step, True), carry)
  carry = lax.fori_loop(a, bb, functools.partial(step, False), carry)
  return lax.fori_loop(bb, hi, functools.partial(step, True), carry)


def _finish(q, k_ref, v_ref, rows, mask, seen, keys, carry, *, qk_scale: float,
            partial: bool):
  """The rows of an `_attend` pass: (o float32, LSE in natural units).

  `seen` [bq] says which rows see a key of the pass's element range `keys` =
  (begin, end); it comes from the mask, never from the sum: a +inf or NaN
  score makes l NaN (and the row and its LSE NaN, as in a dense softmax) even
  where the running max dropped it (Triton's max ignores NaN). Rows that see
  nothing give o = 0 and _EMPTY_LSE. A row whose visible scores are all -inf
  has l = 0: a whole pass gives it 0 / 0 = NaN (LSE -inf), as a dense softmax
  does; a split (`partial`) keeps acc (0, or NaN from a non-finite value) with
  LSE -inf, so the merge weighs it 0 and decides the row from all splits.
  """
  acc, m, l = carry
  div = jnp.where(l == 0.0, 1.0, l) if partial else l
  o = jnp.where(seen[:, None], acc / div[:, None], 0.0)
  lse = jnp.where(seen, m * _LN2 + jnp.log(jnp.where(seen, div, 1.0)), _EMPTY_LSE)
  # Rows whose LSE says the row is NaN (or 0/0) anyway need no recomputation.
  rows_ok = ~jnp.isnan(lse) if partial else jnp.isfinite(lse)

  def exact(xs):
    # Key by key over the visible pairs only, with P from the (correct) LSE;
    # an all -inf row of a split weighs its values by 0.
    o, = xs
    lse2 = lse * _LOG2E
    qf = q.astype(jnp.float32)

    def key(j, acc):
      kj = k_ref[pl.ds(j, 1), :].astype(jnp.float32)
      vj = v_ref[pl.ds(j, 1), :].astype(jnp.float32)
      p = jnp.exp2(jnp.sum(qf * kj, axis=1) * qk_scale - lse2)
      p = jnp.where(lse == -jnp.inf, 0.0, p)
      return acc + jnp.where(mask.visible(rows, j), p[:, None] * vj, 0.0)

    acc = lax.fori_loop(keys[0], keys[1], key, jnp.zeros_like(o))
    return (jnp.where(rows_ok[:, None], acc, o),)

  o, = _exact_where_nan((o,), rows_ok, exact)
  return o, lse


def _query_block(q_len_ref, kv_len_ref, off_ref, *, left: int, right: int, bottom_right: bool,
                 block_q: int, block_k: int, num_q_blocks: int):
  """The query block of this program (grid axis 0, heaviest causal blocks
  first; axis 1 the batch element): its mask, first row, rows [bq, 1] and the
  key-block ranges (lo, a, b, hi) of `_key_blocks`."""
  qi = num_q_blocks - 1 - pl.program_id(0)
  b = pl.program_id(1)
  mask = _Mask.make(q_len_ref[b], kv_len_ref[b], off_ref[b], left, right, bottom_right)
  r0 = qi * block_q
  rows = r0 + jnp.arange(block_q, dtype=jnp.int32)[:, None]
  return mask, r0, rows, _key_blocks(mask, r0, block_q, block_k)


def _fwd_kernel(q_len_ref, kv_len_ref, off_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                qk_scale: float, left: int, right: int, bottom_right: bool,
                block_q: int, block_k: int, num_q_blocks: int):
  mask, _, rows, ranges = _query_block(q_len_ref, kv_len_ref, off_ref, left=left, right=right,
                                       bottom_right=bottom_right, block_q=block_q,
                                       block_k=block_k, num_q_blocks=num_q_blocks)
  q = _zero_padding(q_ref[...], rows, mask.q_valid)
  carry = _attend(q, k_ref, v_ref, rows, mask, ranges, qk_scale=qk_scale, block_k=block_k)
  o, lse = _finish(q, k_ref, v_ref, rows, mask, mask.has_keys(rows[:, 0]),
                   (ranges[0] * block_k, ranges[3] * block_k), carry,
                   qk_scale=qk_scale, partial=False)
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse


def _zero_padding(x, index, valid):
  """Rows of a loaded tile at or past `valid` (padding) set to 0, so that a
  masked pair's zero weight never meets a NaN there."""
  return jnp.where(index < valid, x, jnp.zeros_like(x))


def _exact_where_nan(xs, rows_ok, exact):
  """`xs` (a tuple of [rows, cols] or [rows] results), or `exact(xs)` when a
  NaN shows in a row that `rows_ok` flags.

  A product over a partly masked tile multiplies masked pairs by an exact
  zero weight, and 0 * NaN (or Inf) of a key the row cannot see would be NaN.
  Any such leak leaves a NaN in the result, so a block that has one is
  recomputed pair by pair over the visible pairs only: exact, and slow, but
  run only when an input is not finite.
  """
  # A max over int32 flags: Triton has no lowering for jnp.any.
  bad = functools.reduce(jnp.maximum, [
      jnp.max((jnp.isnan(x) & (rows_ok if x.ndim == 1 else rows_ok[:, None])).astype(jnp.int32))
      for x in xs]) > 0
  return lax.cond(bad, exact, lambda xs: xs, xs)


def _decode_kernel(q_len_ref, kv_len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                   qk_scale: float, left: int, right: int, bottom_right: bool,
                   block_r: int, block_k: int, group: int, total_rows: int,
                   row_tiles: int, num_splits: int):
  """One split of one tile of packed rows (the query heads of a K/V head's
  group stacked over the query rows: packed row r is query row r // group).
  Writes the split's normalised output (float32) and natural LSE, _EMPTY_LSE
  for rows that see no key of the split (the merge skips those)."""
  # Integer division as lax.div/lax.rem (operands are non-negative), which the
  # Triton lowering takes directly.
  div = lambda x, n: lax.div(x, jnp.int32(n))
  i = pl.program_id(0)
  split = div(i, row_tiles)
  r0 = lax.rem(i, jnp.int32(row_tiles)) * block_r
  b = pl.program_id(1)
  mask = _Mask.make(q_len_ref[b], kv_len_ref[b], 0, left, right, bottom_right)
  rows = div(r0 + jnp.arange(block_r, dtype=jnp.int32)[:, None], group)
  # The query rows of the tile's real packed rows: [q0, q0 + q_rows).
  q0 = div(r0, group)
  q_rows = div(jnp.minimum(r0 + block_r, total_rows) - 1, group) + 1 - q0
  lo, a, bb, hi = _key_blocks(mask, q0, q_rows, block_k)
  # This split's blocks (spans differ by at most one block), and the three
  # ranges cut to them.
  n = hi - lo
  s_lo = lo + lax.div(n * split, jnp.int32(num_splits))
  s_hi = lo + lax.div(n * (split + 1), jnp.int32(num_splits))
  cut = lambda x: jnp.clip(x, s_lo, s_hi)
  q = _zero_padding(q_ref[...], rows, mask.q_valid)
  carry = _attend(q, k_ref, v_ref, rows, mask, (cut(lo), cut(a), cut(bb), cut(hi)),
                  qk_scale=qk_scale, block_k=block_k)
  k0, k1 = s_lo * block_k, s_hi * block_k
  r = rows[:, 0]
  seen = ((r < mask.q_valid) &
          (jnp.maximum(mask.key_begin(r), k0) < jnp.minimum(mask.key_end(r), k1)))
  o, lse = _finish(q, k_ref, v_ref, rows, mask, seen, (k0, k1), carry, qk_scale=qk_scale,
                   partial=True)
  o_ref[...] = o
  lse_ref[...] = lse



# ---------------------------------------------------------------------------
# Backward kernels
# ---------------------------------------------------------------------------


def _dq_kernel(q_len_ref, kv_len_ref, off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
               delta_ref, dq_ref, *, scale: float, qk_scale: float, left: int,
               right: int, bottom_right: bool, block_q: int, block_k: int,
               num_q_blocks: int):
  mask, r0, rows, (lo, a, bb, hi) = _query_block(
      q_len_ref, kv_len_ref, off_ref, left=left, right=right, bottom_right=bottom_right,
      block_q=block_q, block_k=block_k, num_q_blocks=num_q_blocks)
  q = _zero_padding(q_ref[...], rows, mask.q_valid)
  do = _zero_padding(do_ref[...], rows, mask.q_valid)
  lse = lse_ref[...]
  lse2 = _lse_log2(lse)
  delta = delta_ref[...]
  dp = q.shape[-1]

  def step(masked, kb, dq):
    start = pl.multiple_of(kb * block_k, block_k)
    k = k_ref[pl.ds(start, block_k), :]
    v = v_ref[pl.ds(start, block_k), :]
    s = _dot(q, k, 1, 1) * qk_scale
    p = jnp.exp2(s - lse2[:, None])
    if masked:
      cols = start + jnp.arange(block_k, dtype=jnp.int32)[None, :]
      p = jnp.where(mask.visible(rows, cols), p, 0.0)
      k = _zero_padding(k, cols.T, mask.kv_valid)
      v = _zero_padding(v, cols.T, mask.kv_valid)
    dpv = _dot(do, v, 1, 1)
    ds = p * (dpv - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k, 1, 0)

  dq = jnp.zeros((block_q, dp), jnp.float32)
  dq = lax.fori_loop(lo, a, functools.partial(step, True), dq)
  dq = lax.fori_loop(a, bb, functools.partial(step, False), dq)
  dq = lax.fori_loop(bb, hi, functools.partial(step, True), dq)

  # Rows whose LSE or delta is not finite are NaN throughout anyway.
  rows_ok = jnp.isfinite(lse) & jnp.isfinite(delta)

  def exact(xs):
    dq, = xs
    qf, dof = q.astype(jnp.float32), do.astype(jnp.float32)

    def key(j, acc):
      kj = k_ref[pl.ds(j, 1), :].astype(jnp.float32)
      vj = v_ref[pl.ds(j, 1), :].astype(jnp.float32)
      p = jnp.exp2(jnp.sum(qf * kj, axis=1) * qk_scale - lse2)
      ds = p * (jnp.sum(dof * vj, axis=1) - delta)
      return acc + jnp.where(mask.visible(rows, j), ds[:, None] * kj, 0.0)

    acc = lax.fori_loop(lo * block_k, hi * block_k, key, jnp.zeros_like(dq))
    return (jnp.where(rows_ok[:, None], acc, dq),)

  dq, = _exact_where_nan((dq,), rows_ok, exact)
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _lse_log2(lse):
  """Base-2 LSE; rows that saw nothing get +inf, so that P underflows to 0."""
  return jnp.where(lse == _EMPTY_LSE, jnp.inf, lse * _LOG2E)


def _dkdv_kernel(q_len_ref, kv_len_ref, off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                 delta_ref, dk_ref, dv_ref, *, scale: float, qk_scale: float,
                 left: int, right: int, bottom_right: bool, block_q: int,
                 block_k: int, group: int):
  kj = pl.program_id(0)
  b = pl.program_id(1)
  mask = _Mask.make(q_len_ref[b], kv_len_ref[b], off_ref[b], left, right, bottom_right)
  c0 = kj * block_k
  last_col = jnp.minimum(c0 + block_k, mask.kv_valid) - 1
  cols_exist = last_col >= c0
  lo_elem = jnp.where(cols_exist, mask.row_begin(c0), 0)
  hi_elem = jnp.where(cols_exist, mask.row_end(jnp.maximum(last_col, 0)), 0)
  all_cols = c0 + block_k <= mask.kv_valid
  lo, a, bb, hi = _three_ranges(
      lo_elem, hi_elem, mask.row_begin(c0 + block_k - 1), mask.row_end(c0),
      all_cols, block_q)

  cols = c0 + jnp.arange(block_k, dtype=jnp.int32)[:, None]  # [bk, 1]
  k = _zero_padding(k_ref[...], cols, mask.kv_valid)
  v = _zero_padding(v_ref[...], cols, mask.kv_valid)
  dp = k.shape[-1]

  def step(g, masked, qb, carry):
    dk, dv = carry
    start = pl.multiple_of(qb * block_q, block_q)
    q = q_ref[pl.ds(start, block_q), g, :]
    do = do_ref[pl.ds(start, block_q), g, :]
    lse = lse_ref[g, pl.ds(start, block_q)]
    delta = delta_ref[g, pl.ds(start, block_q)]
    lse2 = _lse_log2(lse)
    # Transposed tiles [bk, bq], so that no P^T is ever formed.
    st = _dot(k, q, 1, 1) * qk_scale
    pt = jnp.exp2(st - lse2[None, :])
    if masked:
      rows = start + jnp.arange(block_q, dtype=jnp.int32)[None, :]
      pt = jnp.where(mask.visible(rows, cols), pt, 0.0)
      q = _zero_padding(q, rows.T, mask.q_valid)
      do = _zero_padding(do, rows.T, mask.q_valid)
    dv = dv + _dot(pt.astype(do.dtype), do, 1, 0)
    dpt = _dot(v, do, 1, 1)
    dst = pt * (dpt - delta[None, :])
    dk = dk + _dot(dst.astype(q.dtype), q, 1, 0)
    return dk, dv

  def head(g, carry):
    carry = lax.fori_loop(lo, a, functools.partial(step, g, True), carry)
    carry = lax.fori_loop(a, bb, functools.partial(step, g, False), carry)
    return lax.fori_loop(bb, hi, functools.partial(step, g, True), carry)

  carry = (jnp.zeros((block_k, dp), jnp.float32),
           jnp.zeros((block_k, dp), jnp.float32))
  if group == 1:
    dk, dv = head(0, carry)
  else:
    dk, dv = lax.fori_loop(0, group, head, carry)

  def exact(both):
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)

    def row(g, i, carry):
      dk, dv = carry
      qi = q_ref[pl.ds(i, 1), g, :].astype(jnp.float32)
      doi = do_ref[pl.ds(i, 1), g, :].astype(jnp.float32)
      lse2 = _lse_log2(lse_ref[g, pl.ds(i, 1)])
      pt = jnp.exp2(jnp.sum(kf * qi, axis=1) * qk_scale - lse2)
      dst = pt * (jnp.sum(vf * doi, axis=1) - delta_ref[g, pl.ds(i, 1)])
      vis = mask.visible(i, cols)
      return (dk + jnp.where(vis, dst[:, None] * qi, 0.0),
              dv + jnp.where(vis, pt[:, None] * doi, 0.0))

    def head(g, carry):
      return lax.fori_loop(lo_elem, hi_elem, functools.partial(row, g), carry)

    return lax.fori_loop(0, group, head, tuple(jnp.zeros_like(x) for x in both))

  dk, dv = _exact_where_nan((dk, dv), jnp.ones((block_k,), jnp.bool_), exact)
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------


def _check_static_args(q, k, v, scale, window_left, window_right):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError("q, k, v must have rank 4")
  reason = pallas_supported(q.shape, k.shape, v.shape, q.dtype, platform="cpu",
                            k_dtype=k.dtype, v_dtype=v.dtype)
  if reason is not None:
    raise ValueError(reason)
  if not isinstance(window_left, (int, np.integer)) or not isinstance(
      window_right, (int, np.integer)):
    raise TypeError("window_left and window_right must be Python ints")
  if not np.isfinite(float(scale)):
    raise ValueError(f"scale must be finite, got {scale!r}")


def _round_up(n: int, block: int) -> int:
  return max(block, -(-n // block) * block)


def _block_sizes(length: int, block: int) -> tuple[int, int]:
  """(block, padded length): the block shrinks for short sequences."""
  block = min(block, max(_MIN_BLOCK, _next_pow2(length)))
  return block, _round_up(length, block)


def _pad_to(x, axis_sizes: dict[int, int], value=0):
  pads = [(0, 0)] * x.ndim
  need = False
  for axis, size in axis_sizes.items():
    if x.shape[axis] != size:
      pads[axis] = (0, size - x.shape[axis])
      need = True
  return jnp.pad(x, pads, constant_values=value) if need else x


def _clamped_lengths(lengths, batch: int, limit: int):
  if reference.given_lengths(lengths) is not None and jnp.shape(lengths) != (batch,):
    raise ValueError(
        f"sequence lengths must have shape ({batch},), got {jnp.shape(lengths)}")
  return reference.clamped_lengths(lengths, batch, limit)


def _offsets(offsets, batch: int):
  if offsets is None:
    return jnp.zeros((batch,), jnp.int32)
  offsets = jnp.asarray(offsets)
  if offsets.shape != (batch,):
    raise ValueError(
        f"diagonal offsets must have shape ({batch},), got {offsets.shape}")
  return offsets.astype(jnp.int32)


def _length_spec(batch: int):
  return pl.BlockSpec((batch,), lambda *_: (0,))


def _padded_kv(k, v, block_k: int, dp: int):
  """(key block, padded length, k, v): K/V padded to whole key blocks and dp."""
  bk, s_pad = _block_sizes(k.shape[1], block_k)
  return bk, s_pad, _pad_to(k, {1: s_pad, 3: dp}), _pad_to(v, {1: s_pad, 3: dp})


def _merge_splits(o_part, lse_part):
  """Combines split partials [..., S, rows, dp] / [..., S, rows] (normalised
  outputs, natural LSEs, _EMPTY_LSE where a split saw no key of the row) by
  the online-softmax rule; returns (o, lse) with main's row rules: O = 0 and
  _EMPTY_LSE for rows no split saw, 0 / 0 = NaN (LSE -inf) for rows whose
  visible scores are all -inf, NaN from any split's NaN. Every intermediate
  stays finite on finite inputs."""
  valid = lse_part != _EMPTY_LSE
  seen = jnp.any(valid, axis=-2)
  m = jnp.max(lse_part, axis=-2, keepdims=True)
  shift = jnp.where(m == -jnp.inf, 0.0, m)
  w = jnp.where(valid, jnp.exp(jnp.where(valid, lse_part - shift, 0.0)), 0.0)
  total = jnp.sum(w, axis=-2)
  num = jnp.sum(jnp.where(valid[..., None], w[..., None] * o_part, 0.0), axis=-3)
  total_safe = jnp.where(seen, total, 1.0)
  o = jnp.where(seen[..., None], num / total_safe[..., None], 0.0)
  lse = jnp.where(seen, jnp.log(total_safe) + shift[..., 0, :], _EMPTY_LSE)
  return o, lse


def _decode_forward(q, k, v, q_len, kv_len, cfg: PallasConfig, *, splits: int,
                    scale: float, window_left: int, window_right: int,
                    bottom_right: bool):
  """The forward over packed rows (GQA heads stacked, so a K/V block is read
  once per K/V head) in `splits` key ranges, merged in jnp."""
  batch, t, hq, d = q.shape
  _, s, hkv, _ = k.shape
  group = hq // hkv
  dp = _padded_head_dim(d)
  total = t * group
  br = max(_MIN_BLOCK, min(_splits.decode_tile_rows(total), _next_pow2(total)))
  r_pad = _round_up(total, br)
  row_tiles = r_pad // br
  bk, s_pad, kp, vp = _padded_kv(k, v, cfg.block_k, dp)
  # [B, T, Hkv * G, D] -> [B, Hkv, T * G, D]: packed row r = query row r // G, head r % G.
  qp = q.reshape(batch, t, hkv, group, d).transpose(0, 2, 1, 3, 4).reshape(batch, hkv, total, d)
  qp = _pad_to(qp, {2: r_pad, 3: dp})

  kernel = functools.partial(
      _decode_kernel, qk_scale=float(scale) * _LOG2E, left=int(window_left),
      right=int(window_right), bottom_right=bool(bottom_right), block_r=br,
      block_k=bk, group=group, total_rows=total, row_tiles=row_tiles,
      num_splits=splits)
  split_of = lambda i: lax.div(i, jnp.int32(row_tiles))
  tile_of = lambda i: lax.rem(i, jnp.int32(row_tiles))
  q_spec = pl.BlockSpec((None, None, br, dp), lambda i, b, h: (b, h, tile_of(i), 0))
  kv_spec = pl.BlockSpec((None, s_pad, None, dp), lambda i, b, h: (b, 0, h, 0))
  o_spec = pl.BlockSpec((None, None, None, br, dp),
                        lambda i, b, h: (b, h, split_of(i), tile_of(i), 0))
  lse_spec = pl.BlockSpec((None, None, None, br),
                          lambda i, b, h: (b, h, split_of(i), tile_of(i)))
  o_part, lse_part = pl.pallas_call(
      kernel,
      grid=(row_tiles * splits, batch, hkv),
      in_specs=[_length_spec(batch), _length_spec(batch), q_spec, kv_spec, kv_spec],
      out_specs=[o_spec, lse_spec],
      out_shape=[jax.ShapeDtypeStruct((batch, hkv, splits, r_pad, dp), jnp.float32),
                 jax.ShapeDtypeStruct((batch, hkv, splits, r_pad), jnp.float32)],
      interpret=cfg.interpret,
      compiler_params=(None if cfg.interpret else
                       _compiler_params(cfg.num_warps, cfg.num_stages, br, bk)),
      name="jaxflash_pallas_decode",
  )(q_len, kv_len, qp, kp, vp)
  o, lse = _merge_splits(o_part[..., :total, :d], lse_part[..., :total])
  # Back to [B, T, Hq, D] and [B, Hq, T].
  o = o.reshape(batch, hkv, t, group, d).transpose(0, 2, 1, 3, 4).reshape(q.shape)
  lse = lse.reshape(batch, hkv, t, group).transpose(0, 1, 3, 2).reshape(batch, hq, t)
  return o.astype(q.dtype), lse


def pallas_forward(q, k, v, q_lengths, kv_lengths, *, scale: float,
                   window_left: int, window_right: int, bottom_right: bool,
                   config: PallasConfig | None = None, num_splits: int | None = None,
                   diagonal_offsets=None):
  """Attention forward with the Pallas kernel.

  Args:
    q: ``[B, T, Hq, D]``; k, v: ``[B, S, Hkv, D]``; one dtype out of float32,
      float16, bfloat16.
    q_lengths, kv_lengths: int32 ``[B]`` (clamped to ``[0, T]``/``[0, S]``).
    scale: multiplier of ``q . k``.
    window_left, window_right: ints, ``-1`` unbounded; causal is
      ``window_right = 0``.
    bottom_right: align the diagonal to the end of the sequences.
    config: optional :class:`PallasConfig`.
    num_splits: split-KV (see :func:`jaxflash.dot_product_attention`):
      ``None`` automatic, an int >= 1 forced. Split calls, and short queries
      (query rows x query heads per K/V head <= 128), run the decode kernel,
      which stacks the query heads of a K/V head into one block of rows.
    diagonal_offsets: optional int32 ``[B]`` added to each batch element's
      diagonal (``None``: 0); places one block of a larger problem (ring
      attention). Such calls run the unsplit kernel (splitting only changes
      speed; the decode kernel has no offsets).

  Returns:
    ``(o, lse)``: ``o`` ``[B, T, Hq, D]`` in the input dtype, ``lse`` float32
    ``[B, Hq, T]`` in natural-log units (the lowest finite float32 for rows
    that see nothing).
  """
  _check_static_args(q, k, v, scale, window_left, window_right)
  batch, t, hq, d = q.shape
  _, s, hkv, _ = k.shape
  group = hq // hkv
  if batch * t * hq * s == 0:  # nothing to attend to, or nobody asks
    return (jnp.zeros(q.shape, q.dtype),
            jnp.full((batch, hq, t), _EMPTY_LSE, jnp.float32))
  cfg = _resolve_config(config, d, q.dtype)
  q_len = _clamped_lengths(q_lengths, batch, t)
  kv_len = _clamped_lengths(kv_lengths, batch, s)
  offsets = _offsets(diagonal_offsets, batch)
  splits = _splits.pallas(_splits.validate(num_splits), q.shape, k.shape,
                          "cpu" if cfg.interpret else "gpu")
  if diagonal_offsets is None and (splits > 1 or t * group <= _splits.DECODE_MAX_ROWS):
    return _decode_forward(q, k, v, q_len, kv_len, cfg, splits=splits, scale=scale,
                           window_left=window_left, window_right=window_right,
                           bottom_right=bottom_right)
  dp = _padded_head_dim(d)
  bq, t_pad = _block_sizes(t, cfg.block_q)
  bk, s_pad, kp, vp = _padded_kv(k, v, cfg.block_k, dp)
  nq = t_pad // bq
  qp = _pad_to(q, {1: t_pad, 3: dp})

  kernel = functools.partial(
      _fwd_kernel, qk_scale=float(scale) * _LOG2E, left=int(window_left),
      right=int(window_right), bottom_right=bool(bottom_right), block_q=bq,
      block_k=bk, num_q_blocks=nq)
  q_spec = pl.BlockSpec((None, bq, None, dp),
                        lambda i, b, h: (b, nq - 1 - i, h, 0))
  kv_spec = pl.BlockSpec((None, s_pad, None, dp),
                         lambda i, b, h: (b, 0, h // group, 0))
  lse_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, nq - 1 - i))
  o, lse = pl.pallas_call(
      kernel,
      grid=(nq, batch, hq),
      in_specs=[_length_spec(batch), _length_spec(batch), _length_spec(batch),
                q_spec, kv_spec, kv_spec],
      out_specs=[q_spec, lse_spec],
      out_shape=[jax.ShapeDtypeStruct((batch, t_pad, hq, dp), q.dtype),
                 jax.ShapeDtypeStruct((batch, hq, t_pad), jnp.float32)],
      interpret=cfg.interpret,
      compiler_params=(None if cfg.interpret else
                       _compiler_params(cfg.num_warps, cfg.num_stages, bq,
                                        bk)),
      name="jaxflash_pallas_fwd",
  )(q_len, kv_len, offsets, qp, kp, vp)
  if t_pad != t or dp != d:
    o = o[:, :t, :, :d]
  if t_pad != t:
    lse = lse[:, :, :t]
  return o, lse


def pallas_backward(q, k, v, o, lse, do, dlse, q_lengths, kv_lengths, *,
                    scale: float, window_left: int, window_right: int,
                    bottom_right: bool, config: PallasConfig | None = None,
                    diagonal_offsets=None):
  """Attention backward with the Pallas kernels.

  Args:
    q, k, v, q_lengths, kv_lengths, scale, window_left, window_right,
    bottom_right, config, diagonal_offsets: as for :func:`pallas_forward`.
    o, lse: the outputs of :func:`pallas_forward` (or of any implementation
      of the same contract).
    do: cotangent of ``o``, ``[B, T, Hq, D]``.
    dlse: cotangent of ``lse``, float32 ``[B, Hq, T]``, or ``None`` for zero.

  Returns:
    ``(dq, dk, dv)`` in the dtypes of ``q``, ``k``, ``v``; the dK/dV of a
    key/value head is summed over its group of query heads.
  """
  _check_static_args(q, k, v, scale, window_left, window_right)
  batch, t, hq, d = q.shape
  _, s, hkv, _ = k.shape
  group = hq // hkv
  if batch * t * hq * s == 0:
    return (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype),
            jnp.zeros(v.shape, v.dtype))
  cfg = _resolve_config(config, d, q.dtype)
  dp = _padded_head_dim(d)
  q_len = _clamped_lengths(q_lengths, batch, t)
  kv_len = _clamped_lengths(kv_lengths, batch, s)
  offsets = _offsets(diagonal_offsets, batch)

  # delta_i = rowsum(dO * O)_i - dlse_i, fp32 [B, Hq, T]; 0 on rows that see
  # no key, whose dO (padding, say) must not reach any key.
  delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32),
                     o.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
  if dlse is not None:
    delta = delta - dlse.astype(jnp.float32)
  mask = _Mask.make(q_len[:, None], kv_len[:, None], offsets[:, None], int(window_left),
                    int(window_right), bool(bottom_right))
  has_keys = mask.has_keys(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t)))
  delta = jnp.where(has_keys[:, None, :], delta, 0.0)
  lse = lse.astype(jnp.float32)

  common = dict(scale=float(scale), qk_scale=float(scale) * _LOG2E,
                left=int(window_left), right=int(window_right),
                bottom_right=bool(bottom_right))
  def params(tile_m, tile_n):
    if cfg.interpret:
      return None
    return _compiler_params(cfg.num_warps_bwd, cfg.num_stages_bwd, tile_m,
                            tile_n)

  bq_dq, _ = _block_sizes(t, cfg.block_q_dq)
  bk_dq, _ = _block_sizes(s, cfg.block_k_dq)
  bq_dkv, _ = _block_sizes(t, cfg.block_q_dkv)
  bk_dkv, _ = _block_sizes(s, cfg.block_k_dkv)
  # Blocks are powers of two, so padding to the larger serves both kernels.
  t_all = _round_up(t, max(bq_dq, bq_dkv))
  s_all = _round_up(s, max(bk_dq, bk_dkv))

  qp = _pad_to(q, {1: t_all, 3: dp})
  dop = _pad_to(do, {1: t_all, 3: dp})
  kp = _pad_to(k, {1: s_all, 3: dp})
  vp = _pad_to(v, {1: s_all, 3: dp})
  lsep = _pad_to(lse, {2: t_all}, value=_EMPTY_LSE)
  deltap = _pad_to(delta, {2: t_all})

  nq = t_all // bq_dq
  q_spec = pl.BlockSpec((None, bq_dq, None, dp),
                        lambda i, b, h: (b, nq - 1 - i, h, 0))
  kv_spec = pl.BlockSpec((None, s_all, None, dp),
                         lambda i, b, h: (b, 0, h // group, 0))
  row_spec = pl.BlockSpec((None, None, bq_dq),
                          lambda i, b, h: (b, h, nq - 1 - i))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_q=bq_dq, block_k=bk_dq,
                        num_q_blocks=nq,
                        **common),
      grid=(nq, batch, hq),
      in_specs=[_length_spec(batch), _length_spec(batch), _length_spec(batch),
                q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct((batch, t_all, hq, dp), q.dtype),
      interpret=cfg.interpret,
      compiler_params=params(bq_dq, bk_dq),
      name="jaxflash_pallas_bwd_dq",
  )(q_len, kv_len, offsets, qp, kp, vp, dop, lsep, deltap)

  nk = s_all // bk_dkv
  qg_spec = pl.BlockSpec((None, t_all, group, dp),
                         lambda j, b, h: (b, 0, h, 0))
  rowg_spec = pl.BlockSpec((None, group, t_all), lambda j, b, h: (b, h, 0))
  kblk_spec = pl.BlockSpec((None, bk_dkv, None, dp),
                           lambda j, b, h: (b, j, h, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, block_q=bq_dkv, block_k=bk_dkv,
                        group=group,
                        **common),
      grid=(nk, batch, hkv),
      in_specs=[_length_spec(batch), _length_spec(batch), _length_spec(batch),
                qg_spec, kblk_spec, kblk_spec, qg_spec, rowg_spec, rowg_spec],
      out_specs=[kblk_spec, kblk_spec],
      out_shape=[jax.ShapeDtypeStruct((batch, s_all, hkv, dp), k.dtype),
                 jax.ShapeDtypeStruct((batch, s_all, hkv, dp), v.dtype)],
      interpret=cfg.interpret,
      compiler_params=params(bk_dkv, bq_dkv),
      name="jaxflash_pallas_bwd_dkdv",
  )(q_len, kv_len, offsets, qp, kp, vp, dop, lsep, deltap)

  if t_all != t or dp != d:
    dq = dq[:, :t, :, :d]
  if s_all != s or dp != d:
    dk = dk[:, :s, :, :d]
    dv = dv[:, :s, :, :d]
  return dq, dk, dv
