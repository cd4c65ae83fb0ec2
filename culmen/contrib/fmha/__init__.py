"""``apex.contrib.fmha``: ``FMHAFun`` (and the ``FMHA`` module of ``apex.contrib.fmha.fmha``), attention
over packed variable-length sequences on culmen's varlen FlashAttention."""

from culmen.contrib.fmha.fmha import FMHA, FMHAFun

__all__ = ["FMHA", "FMHAFun"]
