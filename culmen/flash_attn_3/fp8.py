"""FP8 quantization for ``culmen.flash_attn_3``'s FP8 forward, with an optional Hadamard rotation of Q and K.

FA3 takes float8_e4m3fn ``q``/``k``/``v`` that the caller quantized, with per-(batch, kv head) descales. Its paper
cuts the FP8 error with "incoherent processing": multiply Q and K by the same random orthogonal (Hadamard)
matrix before quantizing, so that a few outlier channels are spread over all of them (q.k is unchanged in exact
arithmetic, since ``(q H) . (k H) = q H H^T k = q . k``), while the quantization error, relative to each
element, no longer sits on the few largest products. FA3's interface has no switch for it; culmen offers it here
(``quantize_fp8(..., hadamard=True)``) and as ``flash_attn_func(..., quantize="fp8_hadamard")``.

The rotation is block-diagonal: Sylvester Hadamard blocks of ``hadamard_block(d)`` channels (the largest power of
two dividing the head dim, at most 256), each scaled by ``1 / sqrt(block)`` so it is orthonormal. V is never
rotated (the output would have to be rotated back).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["hadamard_block", "hadamard_matrix", "quantize_fp8", "rotate_hadamard"]

F8 = torch.float8_e4m3fn
_F8_MAX = 448.0
_TINY = 2.0 ** -60  # descale floor: an all-zero head quantizes to zeros, not NaN


def hadamard_block(d: int) -> int:
    """The block size of the rotation for head dim ``d``: the largest power of two dividing ``d``, at most 256."""
    if type(d) is not int or d < 1:
        raise ValueError(f"head dim must be a positive int, got {d!r}")
    return min(d & -d, 256)


@functools.lru_cache(maxsize=16)
def _sylvester(n: int) -> Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """The orthonormal Sylvester Hadamard matrix ``(n, n)`` (``n`` a power of two; symmetric, ``H @ H = I``)."""
    if type(n) is not int or n < 1 or n & (n - 1):
        raise ValueError(f"n must be a power of two, got {n!r}")
    return _sylvester(n).to(device=device, dtype=dtype)


def rotate_hadamard(x: Tensor, block: int | None = None) -> Tensor:
    """``x (..., d)`` times the block-diagonal Hadamard rotation (blocks of ``block`` channels, default
    ``hadamard_block(d)``), computed in fp32 (fp64 for fp64 ``x``); returns that dtype."""
    d = x.shape[-1]
    n = hadamard_block(d) if block is None else block
    if type(n) is not int or n < 1 or n & (n - 1) or d % n:
        raise ValueError(f"hadamard_block must be a power of two dividing the head dim {d}, got {block!r}")
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = hadamard_matrix(n, dt, x.device)
    return (x.to(dt).reshape(*x.shape[:-1], d // n, n) @ h).reshape(x.shape)


def _quantize(x: Tensor, nheads_k: int) -> tuple[Tensor, Tensor]:
    """``x (B, s, h, d)`` (float) -> float8 ``x / descale`` and fp32 ``descale (B, nheads_k)``: one scale per batch
    row and KV head (its query heads share it), mapping the group's largest magnitude to e4m3's 448."""
    B, s, h, d = x.shape
    xf = x.float()
    amax = xf.abs().reshape(B, s, nheads_k, h // nheads_k, d).amax(dim=(1, 3, 4))
    descale = (amax / _F8_MAX).clamp(min=_TINY)
    per_head = descale.repeat_interleave(h // nheads_k, dim=1)  # (B, h)
    q8 = (xf / per_head[:, None, :, None]).clamp(-_F8_MAX, _F8_MAX).to(F8)
    return q8, descale.contiguous()


def quantize_fp8(q: Tensor, k: Tensor, v: Tensor, *, hadamard: bool = False,
                 hadamard_block: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Quantize attention inputs to float8_e4m3fn with FA3's per-(batch, kv head) descales.

    Args:
        q: ``(B, sq, h, d)`` fp16/bf16/fp32; ``k``: ``(B, sk, hk, d)``; ``v``: ``(B, sk, hk, dv)``; ``h % hk == 0``.
        hadamard: rotate ``q`` and ``k`` by the block Hadamard matrix first (``rotate_hadamard``); the attention
            scores are the same in exact arithmetic, the FP8 error smaller when a few channels hold outliers.
        hadamard_block: the rotation's block size (a power of two dividing ``d``; default ``hadamard_block(d)``).

    Returns:
        ``(q8, k8, v8, q_descale, k_descale, v_descale)``: float8_e4m3fn tensors shaped like the inputs and fp32
        ``(B, hk)`` descales, ready for ``flash_attn_func(q8, k8, v8, q_descale=..., k_descale=..., v_descale=...)``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (batch, seqlen, nheads, headdim) tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"{name} must be fp16/bf16/fp32 to be quantized, got {t.dtype}")
    hk = k.shape[2]
    if hk == 0 or q.shape[2] % hk or v.shape[2] != hk or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit (batch, seqlen, "
                         "nheads, headdim) with nheads_k dividing nheads")
    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard must be a bool, got {hadamard!r}")
    if hadamard:
        q, k = rotate_hadamard(q, hadamard_block), rotate_hadamard(k, hadamard_block)
    elif hadamard_block is not None:
        raise ValueError("hadamard_block is given but hadamard=False")
    q8, qd = _quantize(q, hk)
    k8, kd = _quantize(k, hk)
    v8, vd = _quantize(v, hk)
    return q8, k8, v8, qd, kd, vd
