"""The project's Pallas attention kernels (GPU via Triton, CPU via the interpreter)."""

from jaxflash.pallas.attention import MAX_HEAD_DIM
from jaxflash.pallas.attention import PallasConfig
from jaxflash.pallas.attention import default_config
from jaxflash.pallas.attention import pallas_backward
from jaxflash.pallas.attention import pallas_forward
from jaxflash.pallas.attention import pallas_supported
from jaxflash.pallas.tangent import pallas_tangent

from jaxflash.pallas.attention import __all__ as _attention_all

__all__ = [*_attention_all, "pallas_tangent"]
