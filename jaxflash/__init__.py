"""jaxflash: exact FlashAttention for JAX.

    import jaxflash
    out = jaxflash.dot_product_attention(q, k, v, is_causal=True)

See `dot_product_attention` for the API (a drop-in for
`jax.nn.dot_product_attention`), `paged_attention` for decoding against a
paged KV cache, `ring_attention` for a sequence sharded across devices, and
`reference` for the semantics.
"""

from jaxflash import _native, reference
from jaxflash._core import MAX_FUSED_HEAD_DIM, MaskSpec
from jaxflash.attention import dot_product_attention
from jaxflash._native import disabled_export_checks
from jaxflash.checks import checked
from jaxflash.paged import paged_attention
from jaxflash.ring import ring_attention
from jaxflash.ring_layout import zigzag_order, zigzag_restore

__version__ = "0.1.0"

_native.register()

__all__ = ["dot_product_attention", "paged_attention", "checked", "ring_attention", "zigzag_order",
           "zigzag_restore", "reference", "MaskSpec", "MAX_FUSED_HEAD_DIM", "disabled_export_checks", "__version__"]
