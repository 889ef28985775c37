"""The project's Pallas attention kernels (GPU via Triton, CPU via the interpreter).

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
* An optional soft-cap ``c > 0`` (``softcap``; ``0`` for none) bounds every
  score before the mask: ``s = c * tanh(scale * q . k / c)``, in float32; the
  softmax, the LSE and the derivatives are those of ``s``. Without a cap the
  kernels trace no tanh.
* Non-finite inputs propagate over the visible pairs only (IEEE arithmetic,
  as a dense softmax would), and never from a key a row cannot see: padding
  rows and keys are zeroed where a masked tile loads them, and a block whose
  result shows a NaN (a masked pair's 0 * NaN in a tile product) is
  recomputed pair by pair.

Modules
-------
config    constants, PallasConfig and default_config, compiler parameters,
          pallas_supported.
blocks    what the kernels share inside a program: the mask rule, the block
          ranges a program walks, tile helpers.
host      what the wrappers share: argument checks, block sizes, padding,
          lengths and diagonal offsets.
forward   the forward and decode kernels, the split merge, pallas_forward.
backward  the dQ and dK/dV kernels, pallas_backward.
bias_grad the dense bias's gradient, pallas_bias_gradient.
tangent   forward mode's tangent kernel, pallas_tangent.
"""

from jaxflash.pallas.backward import pallas_backward
from jaxflash.pallas.bias_grad import pallas_bias_gradient
from jaxflash.pallas.config import MAX_HEAD_DIM
from jaxflash.pallas.config import PallasConfig
from jaxflash.pallas.config import default_config
from jaxflash.pallas.config import pallas_supported
from jaxflash.pallas.forward import pallas_forward
from jaxflash.pallas.tangent import pallas_tangent

__all__ = [
    "MAX_HEAD_DIM",
    "PallasConfig",
    "default_config",
    "pallas_backward",
    "pallas_bias_gradient",
    "pallas_forward",
    "pallas_supported",
    "pallas_tangent",
]
