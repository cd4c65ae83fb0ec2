"""``FlashSelfAttention`` / ``FlashCrossAttention`` of ``flash_attn.modules.mha`` (2.8 signatures).

Unlike flash_attn's, they accept CPU tensors and fp32 inputs.
"""

from __future__ import annotations

from torch import Tensor, nn

from culmen.flash_attn.flash_attn_interface import (
    _window_pair,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__all__ = ["FlashCrossAttention", "FlashSelfAttention"]


class FlashSelfAttention(nn.Module):
    """Scaled dot-product self-attention on packed qkv.

    Args:
        causal: bottom-right aligned causal mask (overridable per call).
        softmax_scale: default ``headdim ** -0.5``.
        attention_dropout: dropout on the attention probabilities (training mode only).
        window_size: ``(left, right)`` sliding window, -1 = unbounded; any two-element sequence of ints
            (tuple, list, 1-D integer tensor or numpy array).
        alibi_slopes: fp32 ``(nheads,)`` or ``(batch, nheads)``, or ``None``.
        deterministic: bitwise reproducible backward.
    """

    def __init__(self, causal: bool = False, softmax_scale: float | None = None, attention_dropout: float = 0.0,
                 window_size: tuple[int, int] = (-1, -1), alibi_slopes: Tensor | None = None,
                 deterministic: bool = False):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        # Any pair flash_attn takes (list, tensor, numpy array), stored as a tuple of ints: plan-cache keys
        # must be hashable, and a plain tuple passes the interface with no normalization call.
        self.window_size = _window_pair(window_size)
        self.deterministic = deterministic

    def forward(self, qkv: Tensor, causal: bool | None = None, cu_seqlens: Tensor | None = None,
                max_seqlen: int | None = None) -> Tensor:
        """``qkv``: ``(B, S, 3, H, D)``, or ``(total, 3, H, D)`` with int32 ``cu_seqlens`` ``(B + 1,)``
        and ``max_seqlen``. Returns ``(B, S, H, D)`` or ``(total, H, D)``."""
        causal = self.causal if causal is None else causal
        kw = dict(softmax_scale=self.softmax_scale, causal=causal, alibi_slopes=self.alibi_slopes,
                  window_size=self.window_size, deterministic=self.deterministic)
        p = self.drop.p if self.training else 0.0
        if cu_seqlens is not None:
            if max_seqlen is None:
                raise ValueError("max_seqlen is required with cu_seqlens")
            return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, p, **kw)
        return flash_attn_qkvpacked_func(qkv, p, **kw)


class FlashCrossAttention(nn.Module):
    """Scaled dot-product attention of ``q`` over packed ``kv`` (MQA/GQA allowed).

    Args: as ``FlashSelfAttention``.
    """

    def __init__(self, causal: bool = False, softmax_scale: float | None = None, attention_dropout: float = 0.0,
                 alibi_slopes: Tensor | None = None, window_size: tuple[int, int] = (-1, -1),
                 deterministic: bool = False):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        # Any pair flash_attn takes (list, tensor, numpy array), stored as a tuple of ints: plan-cache keys
        # must be hashable, and a plain tuple passes the interface with no normalization call.
        self.window_size = _window_pair(window_size)
        self.deterministic = deterministic

    def forward(self, q: Tensor, kv: Tensor, causal: bool | None = None, cu_seqlens: Tensor | None = None,
                max_seqlen: int | None = None, cu_seqlens_k: Tensor | None = None,
                max_seqlen_k: int | None = None) -> Tensor:
        """``q``: ``(B, Sq, H, D)``, ``kv``: ``(B, Sk, 2, H_k, D)``; or packed ``(total_q, H, D)`` /
        ``(total_k, 2, H_k, D)`` with ``cu_seqlens``/``max_seqlen`` (q) and ``cu_seqlens_k``/
        ``max_seqlen_k``. Returns q-shaped output."""
        causal = self.causal if causal is None else causal
        kw = dict(softmax_scale=self.softmax_scale, causal=causal, alibi_slopes=self.alibi_slopes,
                  window_size=self.window_size, deterministic=self.deterministic)
        p = self.drop.p if self.training else 0.0
        if cu_seqlens is not None:
            if max_seqlen is None or cu_seqlens_k is None or max_seqlen_k is None:
                raise ValueError("varlen FlashCrossAttention needs max_seqlen, cu_seqlens_k and max_seqlen_k")
            return flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, p, **kw)
        return flash_attn_kvpacked_func(q, kv, p, **kw)


