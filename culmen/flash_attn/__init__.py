"""The ``flash_attn`` API on culmen (``import culmen.flash_attn as flash_attn``).

Today it holds the normalization ops (``culmen.flash_attn.ops.triton.layer_norm`` and the legacy
``culmen.flash_attn.ops.layer_norm`` / ``ops.rms_norm``) and the attention interface of
``flash_attn_interface`` (``flash_attn_func`` and its packed / varlen forms, exported here as
flash_attn exports them, plus ``flash_attn_with_kvcache``) with the modules
``culmen.flash_attn.modules.mha``, and ``bert_padding`` (``unpad_input`` / ``pad_input``). ``__version__`` is
the flash_attn release whose API this package follows. ``flash_attn_interface`` also holds the internals
other libraries import (``_flash_attn_forward`` / ``_flash_attn_backward`` and their varlen forms, the
``FlashAttn*Func`` autograd classes, ``flash_attn_gpu``: the extension ``flash_attn_2_cuda`` of this
package), and ``ops.triton.rotary.rotary_kernel`` is the rotary Triton kernel.
"""

__version__ = "2.8.3"

from culmen.flash_attn.flash_attn_interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "__version__",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
