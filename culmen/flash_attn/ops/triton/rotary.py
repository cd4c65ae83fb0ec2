"""``flash_attn.ops.triton.rotary``: ``apply_rotary``, the kernel entry point of flash_attn's rotary layers,
and ``rotary_kernel``, the Triton kernel behind them.

``rotary_kernel`` is culmen's one rotary kernel (``culmen.ops.rotary.kernels._rotary_kernel``, a Triton
``JITFunction``; an ``InterpretedFunction`` under ``TRITON_INTERPRET=1``): every rotary layer of
``culmen.flash_attn`` (and of the Apex API) launches it, the backward as the same kernel with
``CONJUGATE=True``. Code that watches its compilations (flash_attn's rotary test clears its cache and
counts Triton's compile hook) sees one compilation per direction and configuration: sequence lengths,
batch sizes and position offsets are not specialized on. Its arguments are culmen's, not flash_attn's:
launch it through ``apply_rotary``.
"""

from __future__ import annotations

from torch import Tensor

from culmen.ops.rotary import rotary
from culmen.ops.rotary.kernels import _rotary_kernel as rotary_kernel

__all__ = ["apply_rotary", "rotary_kernel"]


def apply_rotary(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    seqlen_offsets: int | Tensor = 0,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    interleaved: bool = False,
    inplace: bool = False,
    conjugate: bool = False,
) -> Tensor:
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` columns of ``x``.

    Args:
        x: ``(batch, seqlen, nheads, headdim)``, or ``(total_seqlen, nheads, headdim)`` with ``cu_seqlens``.
        cos, sin: ``(seqlen_ro, rotary_dim / 2)``; any float dtype (flash_attn requires x's).
        seqlen_offsets: int or ``(batch,)`` int32/int64 tensor shifting each sequence's positions.
        cu_seqlens: ``(batch + 1,)`` sequence starts of packed ``x``; needs ``max_seqlen``.
        interleaved: GPT-J pairs ``(2i, 2i+1)`` instead of GPT-NeoX halves.
        inplace: write into ``x`` and return it. conjugate: rotate by ``-theta`` (the backward).

    Returns ``x``'s shape and dtype. Differentiable in ``x`` (flash_attn's is not; harmless).
    """
    return rotary(x, cos, sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                  interleaved=interleaved, inplace=inplace, conjugate=conjugate)
