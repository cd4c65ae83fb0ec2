"""``apex.contrib.openfold_triton.mha``: OpenFold's attention with a pair bias and a mask, and its switches.

Apex ships a Triton kernel tuned for a few OpenFold shapes (``CanSchTriMHA`` lists them) plus
``torch.compile``-d eager formulas (``AttnBiasJIT`` / ``AttnNoBiasJIT``) for the rest. culmen runs all three
entry points on one kernel, ``culmen.ops.pair_attention`` (flash-style: memory O(seq) per row block, the
bias gradient summed over the dims the bias is broadcast on, any shape, head dim up to 256, any ``inf``).

OpenFold's call site::

    if mha.is_enabled() and CanSchTriMHA(list(q.shape), bias is not None, inf, training):
        o = AttnTri(q, k, v, mask, bias, inf, training)
    else:
        o = AttnBiasJIT(q, k, v, mask, bias, inf)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from culmen.ops.pair_attention import pair_attention
from culmen.ops.pair_attention.launch import MAX_HEAD_DIM

__all__ = ["AttnBiasJIT", "AttnNoBiasJIT", "AttnTri", "CanSchTriMHA", "FusedAttenionCoreFunc", "disable", "enable",
           "is_enabled"]

# Whether OpenFold should route its attention through AttnTri (Apex's default: off).
_TRI_MHA_ENABLED = False


def is_enabled() -> bool:
    """Whether the Triton MHA path is switched on (``enable()`` / ``disable()``; off by default)."""
    return _TRI_MHA_ENABLED


def enable() -> None:
    """Switch the Triton MHA path on (OpenFold then calls ``AttnTri`` where ``CanSchTriMHA`` allows)."""
    global _TRI_MHA_ENABLED
    _TRI_MHA_ENABLED = True


def disable() -> None:
    """Switch the Triton MHA path off."""
    global _TRI_MHA_ENABLED
    _TRI_MHA_ENABLED = False


def CanSchTriMHA(in_shape: Sequence[int], has_bias: bool = True, inf: float = 1e9, training: bool = True) -> bool:
    """Whether ``AttnTri`` can run attention whose q has shape ``in_shape`` (``[*, H, N, D]``).

    Apex answers ``True`` only for the dozen OpenFold shapes its kernel was tuned for, with a bias and
    ``inf == 1e9``. culmen's kernel runs any ``[*, H, N, D]`` with ``D <= 256``, with or without a bias and
    for any finite ``inf``, so this is ``True`` for every such shape (``has_bias``, ``inf`` and
    ``training`` are accepted for compatibility).
    """
    try:
        dims = [int(s) for s in in_shape]
    except TypeError as exc:
        raise TypeError(f"CanSchTriMHA: in_shape must be a sequence of ints, got {in_shape!r}") from exc
    return len(dims) >= 3 and all(s >= 0 for s in dims) and 0 < dims[-1] <= MAX_HEAD_DIM and inf > 0


def AttnTri(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, bias: Tensor | None = None,
            inf: float = 1e9, is_training: bool = True) -> Tensor:
    """Apex's fused OpenFold attention (``FusedAttenionCoreFunc.apply``), positional arguments as in Apex.

    Args:
        q, k, v: ``[*, H, N, D]`` (Apex: ``[Z, H, N, D]`` or ``[1, Z, H, N, D]``), fp16/bf16/fp32.
        mask: broadcastable to the logits ``[*, H, N, N]`` (OpenFold: ``[1, Z, 1, 1, N]``), 1 keep / 0 mask.
        bias: broadcastable to the logits (OpenFold: ``[1, 1, H, N, N]``); its gradient is summed over
            the broadcast dims and has the bias' shape.
        inf: the mask's "infinity".
        is_training: ``False`` runs without recording autograd (Apex then saves nothing for backward).

    Returns ``[*, H, N, D]`` in q's dtype.
    """
    if not is_training:
        with torch.no_grad():
            return pair_attention(q, k, v, bias, mask, inf)
    return pair_attention(q, k, v, bias, mask, inf)


class FusedAttenionCoreFunc:
    """Apex's autograd function behind ``AttnTri`` (the name keeps Apex's spelling); ``apply`` is ``AttnTri``."""

    apply = staticmethod(AttnTri)


def AttnBiasJIT(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, bias: Tensor | None,
                inf: float) -> Tensor:
    """``softmax(query key^T / sqrt(D) + (mask - 1) * inf + bias) value`` (Apex: the ``torch.compile``-d
    eager formula; culmen: the fused kernel, same arguments). Shapes as in ``AttnTri``."""
    return pair_attention(query, key, value, bias, mask, inf)


def AttnNoBiasJIT(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, inf: float) -> Tensor:
    """``AttnBiasJIT`` without a bias."""
    return pair_attention(query, key, value, None, mask, inf)


def schedule_triton_mha(in_shape: Sequence[int], fwd: bool = True) -> tuple[int, int, int, int]:
    """The GPU tiles culmen's pair-attention kernels use for ``in_shape`` (``[..., H, N, D]``, as Apex's tuning
    table takes): ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the forward kernel (``fwd=True``) or of the
    dK/dV backward kernel. Apex looks these up per OpenFold workload; culmen derives them from the head dim
    ``D`` (read from ``culmen.ops.pair_attention.launch.TUNING``), so any shape has an answer. Informational:
    ``AttnTri`` picks its tiles itself.
    """
    from culmen.ops.pair_attention.launch import TUNING as T

    try:
        d = int(in_shape[-1])
    except (TypeError, IndexError, ValueError) as exc:
        raise TypeError(f"schedule_triton_mha: in_shape must be a sequence of ints, got {in_shape!r}") from exc
    if d <= 0:
        raise ValueError(f"schedule_triton_mha: head dim in_shape[-1] must be positive, got {d}")
    bd = max(16, 1 << (d - 1).bit_length())
    if fwd:
        return (T["fwd_block_m"] if bd <= 64 else T["fwd_block_m_wide"], T["fwd_block_n"] if bd <= 128 else 32,
                T["fwd_warps"] if bd <= 64 else 8, T["fwd_stages"])
    if bd <= T["kv_small_d"]:
        return T["kv_block_m"], T["kv_block_n"], T["kv_warps"], T["kv_stages"]
    return 64, (64 if bd <= 128 else 32), (4 if bd <= 64 else 8), T["kv_stages"]
