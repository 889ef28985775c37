"""Loads the compiled extension and registers its FFI targets with XLA."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import math
import os
import sys

import jax
import numpy as np

from jaxflash import _splits, tile_cache

# The FFI targets, versioned (ffi/handlers/module.cc): an exported program names
# them, and a later jaxflash keeps serving every version it has shipped. v2 adds
# the `softcap` attribute to v1's, v3 the two segment-table operands to v2's
# forward and backward (jaxflash/segments.py), v4 the ALiBi slopes operand to v3's
# (the paged forward's too), v5 the dense bias and mask operands to v4's forward and
# backward (calls without a dense term keep v4); calls are traced with the newest,
# and the older ones stay registered for programs exported before them.
FORWARD_TARGET = "jaxflash_fwd_v4"
BACKWARD_TARGET = "jaxflash_bwd_v4"
DENSE_TARGETS = ("jaxflash_fwd_v5", "jaxflash_bwd_v5")  # (forward, backward) of calls with a bias or mask
BIAS_GRADIENT_TARGET = "jaxflash_bias_grad_v2"   # the dense bias's gradient alone, in its dtype (v5's operands)
PAGED_TARGET = "jaxflash_paged_fwd_v4"
LEGACY_TARGETS = ("jaxflash_fwd_v3", "jaxflash_bwd_v3", "jaxflash_paged_fwd_v3", "jaxflash_paged_fwd_v2",
                  "jaxflash_fwd_v2", "jaxflash_bwd_v2", "jaxflash_fwd_v1", "jaxflash_bwd_v1",
                  "jaxflash_paged_fwd_v1", "jaxflash_bias_grad_v1")
# The segment tables' kernel: on the GPU only (elsewhere XLA builds them; jaxflash/segments.py).
SEGMENT_TABLES_TARGET = "jaxflash_segment_tables_v1"
# The dense backward with dB out (the backward v5's operands; results dQ, dK, dV, the two
# workspaces, dB): the Hopper dense tile's, and the CPU backward's (`emits_db`).
DB_TARGET = "jaxflash_bwd_db_v1"
# Its predecessor (results dQ, dK, dV, the workspaces and the whole dS, which its caller
# summed): registered so that exported programs load.
LEGACY_CUDA_TARGETS = ("jaxflash_bwd_ds_v1",)
CPU_TARGETS = ((FORWARD_TARGET, BACKWARD_TARGET, PAGED_TARGET) + DENSE_TARGETS + (BIAS_GRADIENT_TARGET, DB_TARGET)
               + LEGACY_TARGETS)
TARGETS = CPU_TARGETS + (SEGMENT_TABLES_TARGET,) + LEGACY_CUDA_TARGETS

# Tile candidate the CUDA tensor-core kernels use instead of their tile tables
# (None: not forced; 0: the tables), plus TILE_SM80 to run the sm80 kernels where a newer path
# exists (FwdParams::tile, BwdParams::tile). Only the tuner and the tests set
# it, through `forced_tile`; it is read when a call is traced, so jit a fresh
# function after changing it. Without it the per-device tile cache
# (jaxflash/tile_cache.py) may name a preferred candidate.
TILE_SM80 = 64
_forced_tile: int | None = None


def tile_attr(direction: str, head_dim: int, causal: bool) -> int:
  """The `tile` attribute of a native call being traced."""
  if _forced_tile is not None:
    return _forced_tile
  device = jax.devices()[0]
  if device.platform != "gpu":
    return 0
  return tile_cache.lookup(direction, head_dim, causal, device.device_kind, build_id)


# Head-dim buckets where the fused Hopper backward runs unless
# JAXFLASH_FUSED_BACKWARD says otherwise: where it beat the two-pass backward
# on an H100 (docs/performance-log.md: D 128 since the eighth session; D 64 since
# the eleventh, warp-specialised, forward+backward +7% at S 1k to +25% at
# S 16k). D 256 keeps two passes (the warp-specialised dK/dV pass, then dQ):
# fused, its dQ atomics hold the L2 at 89% and the pass takes 5.1 ms where
# the two take 3.8 (seventeenth session).
FUSED_BACKWARD_BUCKETS = (64, 128)


def fused_backward_buckets() -> tuple[int, ...]:
  """The sm90 head-dim buckets whose backward runs fused: JAXFLASH_FUSED_BACKWARD
  =1 every sm90 bucket, =0 none, unset (or "auto") the measured winners."""
  mode = os.environ.get("JAXFLASH_FUSED_BACKWARD", "auto")
  if mode not in ("0", "1", "auto"):
    raise ValueError(f"JAXFLASH_FUSED_BACKWARD must be 0, 1 or auto, not {mode!r}")
  return {"0": (), "1": (64, 128, 192, 256), "auto": FUSED_BACKWARD_BUCKETS}[mode]


# The CPU backward's one-pass scheme (cpu/backward.cc) runs one item per (batch,
# kv head): it takes room for dQ sums only where those items fill the threads
# the call runs on (launch.h's CpuBackwardThreads, at most the CPUs) to at
# least this share (it does 5/7 of the three passes' tile products), and the
# room (a float32 copy of q) stays within CPU_DQ_SUMS_BYTES.
CPU_FUSED_BACKWARD_FILL = 0.8
CPU_DQ_SUMS_BYTES = 256 << 20


def cpu_threads() -> int:
  """The threads XLA's CPU client runs kernels on: the CPUs this process may use."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


def dq_sums_room(dtype, q_shape, k_shape, deterministic: bool) -> bool:
  """Whether a native backward call being traced leaves room for float32 dQ sums
  (BwdParams::dq_accum), so that one pass adds every key tile's dS·K into them
  instead of a second pass that recomputes the scores. The room costs a float32
  copy of q.

  On the CPU: where (batch, kv head) items fill the threads the call runs on
  (CPU_FUSED_BACKWARD_FILL; a small call runs on one, which any item count fills);
  that scheme is as deterministic as the three passes. On a GPU: the fused Hopper
  backward (sm90/bwd_kernel.cuh) of the buckets `fused_backward_buckets` names; the
  dispatch ignores the room where it does not run. Deterministic calls keep the two
  kernels there (the atomics' order varies)."""
  if _forced_tile:
    return False
  device = jax.devices()[0]
  if device.platform == "cpu":
    # Per traced call: ragged lengths (traced values) can leave the items unequal, and a
    # vmapped call's room grows with the mapped axis; both only cost speed or memory.
    batch, (q_len, q_heads, head_dim) = int(np.prod(q_shape[:-3])), q_shape[-3:]
    kv_len, kv_heads = k_shape[-3:-1]
    items, threads = batch * kv_heads, cpu_threads()
    if items == 0:
      return False
    ext, _ = _load()
    if ext is not None:  # the threads cpu/backward.cc gives the call (launch.h: CpuBackwardThreads, >= 1)
      threads = min(threads, ext.cpu_backward_threads(batch, q_len, kv_len, q_heads, head_dim))
    fill = items / (-(-items // threads) * threads)
    return fill >= CPU_FUSED_BACKWARD_FILL and np.prod(q_shape) * 4 <= CPU_DQ_SUMS_BYTES
  head_dim = q_shape[-1]
  if deterministic or np.dtype(dtype).itemsize != 2 or head_dim % 8:
    return False
  if tile_cache.bucket(head_dim) not in fused_backward_buckets():
    return False  # the sm90 buckets (dispatch.cu); the others run the sm80 kernels
  return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def hopper_dense(q, k, v, spec, segments=None, alibi=None, dense=None) -> bool:
  """Whether the Hopper dense tiles take a native call both ways (the forward's staged bias,
  sm90 TakesDenseBackward): a bias in the query's 16-bit dtype on whole rows and keys (S a
  multiple of 8), no mask, soft-cap, segment ids or ALiBi, a positive scale, head dims 33-64 or
  97-128 alike, the fused backward on an sm90 GPU."""
  bias = None if dense is None else dense.bias
  if (bias is None or dense.mask is not None or segments is not None or alibi is not None
      or spec.softcap > 0 or spec.scale <= 0 or v.shape[-1] != q.shape[-1]
      or tile_cache.bucket(q.shape[-1]) not in (64, 128)):
    return False
  T, S = q.shape[-3], k.shape[-3]
  device = jax.devices()[0]
  return (device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"
          and np.dtype(bias.dtype).itemsize == 2 and bias.dtype == q.dtype and bias.shape[-2:] == (T, S)
          and T > 1 and S > 1 and S % 8 == 0
          and dq_sums_room(q.dtype, q.shape, k.shape, bool(spec.deterministic)))


def emits_db(q, k, v, spec, segments=None, alibi=None, dense=None) -> bool:
  """Whether a native backward being traced gives the bias's gradient from the same pass
  (DB_TARGET). The device side asks the same and refuses a dB it cannot give. On a GPU: a
  `hopper_dense` call whose bias entries are each shared by at most two (batch, head)s; each
  step's dS tile is stored into dB, or added there by the copy engine in 16 bits where two
  share an entry ((B N) / (Bb Nb) = 2: one rounding, as their float32 sum's). On the CPU: a
  bias in the query's dtype with the call's rows and keys whose every entry has one (batch,
  head), no soft-cap: the backward stores each tile's dS (cpu/backward.cc). Wider sharing
  takes the separate bias-gradient pass, which sums in float32."""
  if dense is None or dense.bias is None:
    return False
  sharers = math.prod(q.shape[:-3]) * q.shape[-2] / math.prod(dense.bias.shape[:-2])
  if jax.devices()[0].platform == "cpu":
    T, S = q.shape[-3], k.shape[-3]
    return (sharers == 1 and dense.bias.shape[-2:] == (T, S) and dense.bias.dtype == q.dtype
            and spec.softcap <= 0 and T > 1 and S > 1)
  return hopper_dense(q, k, v, spec, segments, alibi, dense) and sharers <= 2


def call_hopper_dense(call) -> bool:
  """`hopper_dense` of a _core.Call (its ids and slopes, or None)."""
  return hopper_dense(call.q, call.k, call.v, call.spec, call.segments, call.alibi, call.dense)


def takes_value_width(call=None) -> bool:
  """Whether the native forward reads v at its own head dim for `call` (a _core.Call; else
  `run_fused` pads): on the CPU always, on a GPU where `value_width_on` says so."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    return True
  if call is None:
    return False
  # NativeKernels.forward: calls with segment ids run unsplit.
  splits = 1 if call.segments is not None else call.spec.num_splits
  return value_width_on(call.q.shape, call.k.shape, call.v.shape[-1], call.q.dtype,
                        dense=call.dense is not None, splits=splits)


def value_width_on(q_shape, k_shape, v_dim: int, dtype, *, dense: bool = False, splits=None,
                   backward: bool = False, paged: bool = False) -> bool:
  """Whether the native kernels read v at its own head dim, mirroring dispatch.cu's
  ForwardTakesValueWidth (`backward`: TakesValueWidth; `paged`: a paged call, which the
  decode kernels take): on the CPU always. On a GPU, 16-bit calls without a dense term whose
  head dims are multiples of 8, in the decode kernels' forward (short queries, split-KV or
  paged K/V; the tile takes the wider dim, each side's columns past its own arrive as zeros)
  and in both directions of the Hopper kernels of the (q/k 192, v 128) bucket pair, MLA's
  widths. `splits` is the call's num_splits request (None: automatic)."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    return True
  q_dim = q_shape[-1]
  if (device.platform != "gpu" or dense or np.dtype(dtype).itemsize != 2 or q_dim % 8 or v_dim % 8
      or max(q_dim, v_dim) > 256):
    return False
  B, T, N, K = q_shape[0], q_shape[1], q_shape[2], k_shape[2]
  if N > 65535 or K > 65535 or 2 * B > 65535:   # the tensor-core kernels' grid limits
    return False
  capability = getattr(device, "compute_capability", "")
  try:
    tensor_cores = float(capability) >= 8.0
  except ValueError:
    return False
  if not backward and tensor_cores and (
      paged or T * (N // K) <= _splits.DECODE_MAX_ROWS
      or _splits.native(splits, q_shape, k_shape, dtype, "gpu") > 1):
    return True   # the decode kernels (decode::UseDecodeKernel)
  return (capability == "9.0" and (_forced_tile or 0) < TILE_SM80 and tile_cache.bucket(q_dim) == 192
          and v_dim <= 128)


def backward_pad_width(q_shape, k_shape, v_dim: int, dtype, dense: bool) -> int:
  """The head dim every operand of a native backward goes in at, or 0 when they go as they
  are: a forward that kept v's own width (the decode kernels') whose backward kernels take
  one head dim gets them all at the wider, zero-padded, and its gradients sliced back."""
  if v_dim == q_shape[-1] or value_width_on(q_shape, k_shape, v_dim, dtype, dense=dense, backward=True):
    return 0
  return max(q_shape[-1], v_dim)


def forced_tile_attr() -> int:
  """The `tile` attribute of a call that takes no tile cache (the forced tile, or 0)."""
  return _forced_tile or 0


@functools.cache
def build_id() -> str:
  """A short hash of the compiled extension's file ("" without one): tile cache
  entries measured with another build are stale."""
  ext, _ = _load()
  library = getattr(ext, "__file__", None) if ext is not None else None
  if library is None:
    return ""
  digest = hashlib.sha256()
  with open(library, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()[:16]


@contextlib.contextmanager
def forced_tile(index: int, *, sm80: bool = False):
  """Trace native calls inside the block with tile candidate `index` (1-based; 0 = the table,
  ignoring the tile cache).

  With `sm80=True` the CUDA forward and backward run the sm80 (mma.sync) family even
  on a GPU that has a newer path, and the decode kernel copies K/V with cp.async
  rather than the TMA, so the Ampere code stays testable on Hopper.
  """
  global _forced_tile
  if not 0 <= index < TILE_SM80:
    raise ValueError(f"tile candidate must be in [0, {TILE_SM80}), got {index}")
  previous, _forced_tile = _forced_tile, int(index) + (TILE_SM80 if sm80 else 0)
  try:
    yield
  finally:
    _forced_tile = previous


# More than any compiled candidate list holds (ffi/kernels/*/..._launch.cuh).
MAX_CANDIDATES = 8


def each_compiled_candidate(run, last: int = MAX_CANDIDATES) -> list:
  """[run(1), run(2), ...] up to the last compiled tile candidate (or `last`):
  a call past a list's end fails with "does not exist", which ends the walk;
  any other failure propagates. `run` forces its candidate itself."""
  results = []
  for candidate in range(1, last + 1):
    try:
      results.append(run(candidate))
    except Exception as e:  # past the last compiled candidate
      if "does not exist" not in str(e):
        raise
      break
  return results


class NativeUnavailableError(RuntimeError):
  """The compiled extension is missing or cannot serve this jaxlib."""


def _version_tuple(v: str) -> tuple[int, ...]:
  parts = []
  for p in v.split(".")[:3]:
    digits = "".join(ch for ch in p if ch.isdigit())
    parts.append(int(digits) if digits else 0)
  return tuple(parts)


def _import_compiled():
  """The extension module and its build record.

  From an installed package they sit beside this file. From a source checkout
  (`python -m jaxflash` or `python -m pytest` in the repository root put the
  checkout first on sys.path) they are taken from the installed distribution.
  """
  try:
    from jaxflash import _build_config, _jaxflash
    return _jaxflash, _build_config
  except ImportError as e:
    first_error = e
  try:
    dist = importlib.metadata.distribution("jaxflash")
  except importlib.metadata.PackageNotFoundError:
    raise first_error from None
  found = {}
  for f in dist.files or ():
    if len(f.parts) == 2 and f.parts[0] == "jaxflash":
      stem = f.name.split(".")[0]
      if stem in ("_jaxflash", "_build_config") and (f.suffix in (".so", ".pyd", ".py")):
        found[stem] = dist.locate_file(f)
  if set(found) != {"_jaxflash", "_build_config"}:
    raise first_error
  modules = []
  for stem in ("_jaxflash", "_build_config"):
    spec = importlib.util.spec_from_file_location(f"jaxflash.{stem}", found[stem])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    modules.append(module)
  return tuple(modules)


@functools.cache
def _load():
  try:
    _jaxflash, _build_config = _import_compiled()
  except ImportError as e:  # neither built in place nor installed
    return None, f"the jaxflash extension is not built ({e}); run `pip install .`"
  built = _build_config.FFI_HEADERS_JAXLIB_VERSION
  runtime = importlib.metadata.version("jaxlib")
  if _version_tuple(runtime) < _version_tuple(built):
    # XLA would refuse the handlers with "No FFI handler registered"; say why.
    return None, (
        f"jaxflash was built against the XLA FFI headers of jaxlib {built}, newer than the "
        f"installed jaxlib {runtime}. Rebuild with `pip install --no-build-isolation .` in "
        "this environment.")
  for name, capsule in _jaxflash.cpu_targets().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  for name, capsule in _jaxflash.cuda_targets().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  return _jaxflash, None


def register() -> None:
  """Makes the FFI targets known to XLA (if the extension loads): at import, so that a
  program deserialized with jax.export finds them before any call is traced."""
  _load()


def disabled_export_checks() -> list:
  """The safety checks `jax.export.export` must skip for a program that calls jaxflash's
  kernels: one `DisabledSafetyCheck.custom_call` per FFI target.

      exp = jax.export.export(jax.jit(f), disabled_checks=jaxflash.disabled_export_checks())(x)

  Our targets are versioned (TARGETS): a serialized program loads in any jaxflash that
  still registers the versions it names (README, "Exporting")."""
  return [jax.export.DisabledSafetyCheck.custom_call(target) for target in TARGETS]


def dense_gpu_refusal(q, k, width: int, has_bias: bool, softcap: float) -> str | None:
  """Why the CUDA kernels' dense path (the sm80 tensor-core family: dispatch.cu's
  DenseRefusal) cannot take a call with a dense bias or mask, said before any kernel runs;
  None when it can."""
  why = None
  capability = getattr(jax.devices()[0], "compute_capability", None)
  try:
    old_gpu = capability is not None and float(capability) < 8.0
  except ValueError:
    old_gpu = False
  batch, heads = int(np.prod(q.shape[:-3])), q.shape[-2]
  if q.dtype == np.float32:
    why = "in float16 and bfloat16 only (its tensor-core kernels)"
  elif has_bias and softcap > 0:
    why = "without a bias beside logits_soft_cap"
  elif width % 8:
    why = f"for head dims that are multiples of 8, got {width}"
  elif old_gpu:
    why = f"on compute capability 8.0 or newer, got {capability}"
  elif heads > 65535 or batch > 32767 or max(q.shape[-3], k.shape[-3]) >= 2**31:
    why = "for at most 65535 heads, a batch of at most 32767 and sequences below 2^31"
  return None if why is None else (
      f"implementation='native' takes a dense bias or mask on the GPU {why}; use 'pallas'")


def wide_refusal(call) -> str | None:
  """Why the native kernels cannot take `call` (a _core.Call whose head dim is past the CUDA
  kernels' 256) on this GPU, or None. There the CUDA forward is the Hopper kernel of head dims
  257-512 (sm90/fwd_wide_kernel.cuh, dispatch.cu's WideForward) and the gradients
  wide_gradients.backward's (NativeKernels.backward)."""
  B, T, N, _ = call.q.shape
  device, why = jax.devices()[0], None
  if call.width > 512:
    why = f"head_dim <= 512, got {call.width}"
  elif getattr(device, "compute_capability", "") != "9.0" or (_forced_tile or 0) >= TILE_SM80:
    why = "a Hopper GPU (compute capability 9.0)"
  elif np.dtype(call.q.dtype).itemsize != 2:
    why = f"float16 or bfloat16, got {call.q.dtype}"
  elif call.width % 8:
    why = f"a head dim that is a multiple of 8, got {call.width}"
  elif (call.segments is not None or call.alibi is not None or call.dense is not None
        or call.spec.softcap > 0 or call.spec.num_splits > 1):
    why = "no segment ids, soft-cap, ALiBi, dense bias or mask, or split-KV"
  elif N > 65535 or B > 32767 or max(T, call.k.shape[1]) >= 2**31:
    why = "at most 65535 heads, a batch of at most 32767 and sequences below 2^31"
  return None if why is None else (
      f"implementation='native' supports head_dim <= 256 on this GPU; past it, its Hopper forward "
      f"(head dims 257-512) needs {why}; use 'pallas'")


def unavailable_reason(platform: str) -> str | None:
  """Why the native path cannot run on `platform` ("cpu", "gpu", ...), or None."""
  ext, err = _load()
  if err:
    return err
  if platform == "cpu":
    return None
  if platform in ("gpu", "cuda"):
    if not ext.with_cuda:
      return ("this jaxflash build has no CUDA kernels (no CUDA compiler was found at build "
              "time); rebuild on a machine with nvcc")
    return None
  return f"no native jaxflash kernels for platform {platform!r}"


def require(platform: str) -> None:
  reason = unavailable_reason(platform)
  if reason:
    raise NativeUnavailableError(reason)
