"""Configuration and support check of the Pallas attention kernels.

The constants of the contract (head dims, dtypes, the LSE of a row that sees
no key), `PallasConfig` and `default_config` (block sizes, warps and stages
fitted to shared memory), the Triton compiler parameters, and
`pallas_supported`, which says why a call cannot be served.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

try:  # The Triton-specific module; present on every jax this package supports.
  from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover
  _plgpu = None

__all__ = [
    "MAX_HEAD_DIM",
    "PallasConfig",
    "default_config",
    "pallas_supported",
]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# The LSE of a row that sees no key (params.h kEmptyRowLse): finite, so that
# jax.debug_infs stays quiet, and low enough to act as log 0.
EMPTY_LSE = float(np.finfo(np.float32).min)
_SUPPORTED_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
MAX_HEAD_DIM = 512
MIN_BLOCK = 16  # Triton's dot needs every dimension >= 16.


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
    block_q_dq: query rows per program of the dQ kernel (and, when given, of the
      dense bias's gradient kernel; pallas/bias_grad.py).
    block_k_dq: keys per inner-loop step of the dQ kernel (the same).
    num_warps: warps per program of the forward kernel (GPU only).
    num_stages: software-pipelining depth of the forward kernel (GPU only).
    num_warps_bwd: warps per program of the backward kernels (GPU only; the bias
      gradient's too, when given).
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
          or value < MIN_BLOCK or (value & (value - 1))):
        raise ValueError(
            f"PallasConfig.{name} must be a power of two >= {MIN_BLOCK}, "
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


def next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
  return max(MIN_BLOCK, next_pow2(head_dim))


# Shared memory the estimates below may use per program: below the 163 KiB an
# A100 grants one block, leaving room for Triton's own layout conversions; and
# below the ~227 KiB of GPUs of compute capability 9.x / 10.x (Hopper,
# datacenter Blackwell), where head dims past 256 take it.
_SMEM_BUDGET = 128 * 1024
_LARGE_SMEM_BUDGET = 192 * 1024


def large_shared_memory(device=None) -> bool:
  """Whether `device` (by default the first GPU) is of compute capability 9.x or 10.x."""
  if device is None:
    try:
      device = jax.devices("gpu")[0]
    except (RuntimeError, IndexError):
      return False
  return capability_major(device) in (9, 10)


def fit_smem(itemsize: int, dp: int, major: int, minor: int, stages: int,
             resident: int, streamed: int = 2,
             budget: int = _SMEM_BUDGET) -> tuple[int, int, int]:
  """Shrinks (stages, minor block, major block) until the tiles fit `budget`.

  ``resident`` tiles of ``major x dp`` stay for the whole program and
  ``streamed`` tiles of ``minor x dp`` are buffered ``stages`` deep.
  """
  def smem(major, minor, stages):
    return itemsize * dp * (resident * major + streamed * minor * stages)

  while smem(major, minor, stages) > budget:
    if stages > 1:
      stages -= 1
    elif minor > MIN_BLOCK:
      minor //= 2
    elif major > MIN_BLOCK:
      major //= 2
    else:
      break
  return major, minor, stages


def default_config(head_dim: int, dtype=jnp.bfloat16, *,
                   interpret: bool | None = None) -> PallasConfig:
  """The configuration used for the fields a caller leaves as ``None``.

  GPU choices: the program's resident tiles plus the pipelined K/V (or Q/dO)
  tiles are kept within an A100's shared memory at head dims to 256, past 256
  within the larger budget of the GPUs that take them (pallas_supported); the
  backward kernels use a long resident block and a short streamed one.
  """
  if interpret is None:
    interpret = _default_interpret()
  dp = padded_head_dim(head_dim)
  if interpret:
    # The interpreter's cost is per grid step and per loop iteration, so
    # larger blocks are faster; the numerics do not depend on them.
    return PallasConfig(64, 64, 64, 64, 64, 64, None, None, None, None, True)
  itemsize = jnp.dtype(dtype).itemsize
  if dp <= 64:
    fwd, bwd, warps, warps_bwd = (128, 64, 3), (128, 32, 3), 4, 4
  elif dp <= 128:
    fwd, bwd, warps, warps_bwd = (128, 64, 3), (128, 32, 2), 8, 8
  elif dp <= 256:
    fwd, bwd, warps, warps_bwd = (64, 32, 2), (64, 32, 2), 8, 8
  else:   # the fastest of a sweep at D 512 (H200, bf16; performance-log.md, Head dims past 256)
    fwd, bwd, warps, warps_bwd = (64, 64, 1), (32, 32, 1), 8, 8
  budget = _LARGE_SMEM_BUDGET if dp > 256 and large_shared_memory() else _SMEM_BUDGET
  bq, bk, stages = fit_smem(itemsize, dp, *fwd, resident=1, budget=budget)
  major, minor, stages_bwd = fit_smem(itemsize, dp, *bwd, resident=2)
  return PallasConfig(
      block_q=bq, block_k=bk, block_q_dkv=minor, block_k_dkv=major,
      block_q_dq=major, block_k_dq=minor, num_warps=warps, num_stages=stages,
      num_warps_bwd=warps_bwd, num_stages_bwd=stages_bwd, interpret=False)


def _default_interpret() -> bool:
  return jax.default_backend() == "cpu"


def resolve_config(config: PallasConfig | None, head_dim: int,
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


def compiler_params(num_warps, num_stages, tile_m: int, tile_n: int, width: int = 0):
  """Triton compiler parameters, spelled as the installed jax spells them.

  ``tile_m x tile_n`` is the kernel's score tile: warps beyond one per 256
  elements of it would only replicate work, so small tiles (short sequences,
  tiny test blocks) get fewer warps. Past 256 columns (``width``, the padded
  head dim) the [tile_m, width] accumulator is the larger tile and is counted
  instead: its registers need the warps.
  """
  if num_warps is not None:
    elements = tile_m * (max(tile_n, width) if width > 256 else tile_n)
    num_warps = max(1, min(int(num_warps), elements // 256))
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


def capability_major(device) -> int | None:
  """The major compute capability of a GPU device; None where it has none readable."""
  try:
    return int(str(device.compute_capability).split(".")[0])
  except (AttributeError, ValueError):
    return None


def _valid_cap(cap) -> bool:
  # A static Python number: the kernels branch on it while tracing.
  try:
    cap = float(cap)
  except (TypeError, ValueError):
    return False
  return math.isfinite(cap) and cap >= 0


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
    has_bias, has_mask, has_segment_ids: features of the public API the
      kernels do not implement; any of them makes the call unsupported.
    logits_soft_cap: the cap of the scores (``None`` or ``0`` for none); the
      kernels take any finite cap >= 0.
    interpret_ok: whether running in the Pallas interpreter (the CPU path,
      exact but slow) is acceptable. Automatic selection should pass False.
  """
  if has_bias:
    return "the pallas implementation does not support `bias`"
  if has_mask:
    return "the pallas implementation does not support a boolean `mask`"
  if has_segment_ids:
    return "the pallas implementation does not support segment ids"
  if logits_soft_cap is not None and not _valid_cap(logits_soft_cap):
    return ("the pallas implementation needs a logits soft-cap that is a finite "
            f"number >= 0 (0 for none), got {logits_soft_cap!r}")
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
    major = capability_major(device)
    if major is None:
      return f"unrecognised GPU compute capability {cc!r}"
    if major < 8:
      return ("the pallas implementation needs an NVIDIA GPU of compute "
              f"capability 8.0 or newer, got {cc}")
    if d > 256 and not large_shared_memory(device):
      return (f"the pallas implementation takes head dims past 256 on GPUs of compute "
              f"capability 9.x / 10.x only (its tiles there need ~192 KiB of shared "
              f"memory a block), got {cc}")
  return None
