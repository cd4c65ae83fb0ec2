"""FlashAttention-3's interface (``flash_attn_interface``, the module FA3's ``hopper/`` package installs).

``import culmen.flash_attn_3 as fa3`` or, through culmen's import alias (``culmen.compat``),
``from flash_attn_interface import flash_attn_func``. See ``culmen.flash_attn_3.interface`` for what is
honoured: FA3's arguments, a V head dim other than the QK head dim, ``attention_chunk`` (with a backward,
which FA3 lacks), the FP8 forward, ``qv`` (with a backward) and split-KV decoding. culmen's own additions:
``quantize_fp8`` (FA3-style descales, optionally after a Hadamard rotation of Q and K, ``culmen.flash_attn_3.fp8``)
and ``flash_attn_func(..., quantize="fp8" | "fp8_hadamard")``. FA3's autograd classes (``FlashAttnFunc`` & co.,
``culmen.flash_attn_3.autograd``) take FA3's ``apply`` arguments; its low-level ops ``_flash_attn_forward`` /
``_flash_attn_backward`` (what context-parallel code calls) and ``round_up_headdim`` are in
``culmen.flash_attn_3.lowlevel``.
"""

from culmen.flash_attn_3.autograd import (
    FlashAttnFunc,
    FlashAttnQKVPackedFunc,
    FlashAttnVarlenFunc,
    maybe_contiguous,
    round_multiple,
)
from culmen.flash_attn_3.combine import flash_attn_combine
from culmen.flash_attn_3.fp8 import quantize_fp8
from culmen.flash_attn_3.interface import (
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    get_scheduler_metadata,
)
from culmen.flash_attn_3.lowlevel import _flash_attn_backward as _flash_attn_backward
from culmen.flash_attn_3.lowlevel import _flash_attn_forward as _flash_attn_forward
from culmen.flash_attn_3.lowlevel import round_up_headdim

__all__ = [
    "FlashAttnFunc",
    "FlashAttnQKVPackedFunc",
    "FlashAttnVarlenFunc",
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "get_scheduler_metadata",
    "maybe_contiguous",
    "quantize_fp8",
    "round_multiple",
    "round_up_headdim",
]
