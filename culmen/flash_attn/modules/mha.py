"""flash_attn 2.8's ``flash_attn.modules.mha`` on culmen: ``MHA``, ``ParallelMHA``, the inner attention
modules (``FlashSelfAttention`` / ``FlashCrossAttention`` on culmen's attention kernels, ``SelfAttention`` /
``CrossAttention`` in plain PyTorch), ``get_alibi_slopes`` and ``LinearResidual``.

Parameter names and ``state_dict`` keys are flash_attn's (``Wqkv`` or ``Wq``/``Wkv``, ``out_proj``,
``dwconv_qkv`` or ``dwconv_q``/``dwconv_kv``; rotary tables and ALiBi slopes are non-persistent
buffers), so flash_attn checkpoints load as they are.

Differences from flash_attn, on purpose:

* The inner modules accept CPU tensors and fp32/fp64 inputs; ALiBi slopes stay fp32 through
  ``module.to(dtype)`` (flash_attn re-casts them on every call).
* ``SelfAttention`` / ``CrossAttention`` run ``F.scaled_dot_product_attention`` with flash_attn's
  masking conventions (an additive ``-10000`` for padded or future keys, so a fully padded row stays
  finite, as flash_attn's does); dropout draws from PyTorch's SDPA stream.
* ``MHA`` with ``dwconv`` and GQA/MQA or cross-attention convolves the projections before splitting
  heads (flash_attn's code for that case cannot run); varlen self-attention with GQA/MQA defaults
  ``cu_seqlens_k`` / ``max_seqlen_k`` to ``cu_seqlens`` / ``max_seqlen`` (flash_attn requires them).
* Decoding with XPos rotary takes the unfused path instead of failing an assertion.
* Bad arguments raise ``ValueError`` (flash_attn asserts).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from culmen.flash_attn.flash_attn_interface import (
    _window_pair,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from culmen.flash_attn.layers.rotary import RotaryEmbedding
from culmen.flash_attn.ops.fused_dense import ColumnParallelLinear, FusedDense, RowParallelLinear
from culmen.flash_attn.utils.distributed import get_dim_for_local_rank

__all__ = [
    "MHA",
    "CrossAttention",
    "FlashCrossAttention",
    "FlashSelfAttention",
    "LinearResidual",
    "ParallelMHA",
    "SelfAttention",
    "get_alibi_slopes",
]

# flash_attn's plain-PyTorch attention masks with a large finite penalty rather than -inf.
_MASK_PENALTY = -10000.0


def get_alibi_slopes(nheads: int) -> list[float]:
    """ALiBi head slopes (Press et al.) as a list of ``nheads`` Python floats.

    For a power of two ``n`` the slopes are the geometric series ``r, r^2, ..., r^n`` with
    ``r = 2 ** (-8 / n)``; otherwise the series of the largest power of two below ``n`` is followed by
    every other slope of the series for twice that power, until there are ``nheads``.
    """
    if not isinstance(nheads, int) or isinstance(nheads, bool) or nheads <= 0:
        raise ValueError(f"nheads must be a positive int, got {nheads!r}")
    base = 1 << (nheads.bit_length() - 1)  # the largest power of two <= nheads
    ratio = 2.0 ** (-8.0 / base)
    slopes = [ratio ** (i + 1) for i in range(base)]
    if base != nheads:
        ratio2 = 2.0 ** (-8.0 / (2 * base))
        slopes += [ratio2 ** (i + 1) for i in range(0, 2 * base, 2)][: nheads - base]
    return slopes


class _Fp32Slopes(nn.Module):
    """Keeps an ``alibi_slopes`` buffer in fp32 whatever ``module.to(dtype)`` / ``.half()`` do: the
    kernels read fp32 slopes, and converting once here saves a cast per call."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        slopes = self._buffers.get("alibi_slopes")
        if slopes is not None and slopes.dtype != torch.float32 and slopes.is_floating_point():
            self._buffers["alibi_slopes"] = slopes.float()
        return self


class FlashSelfAttention(_Fp32Slopes):
    """Scaled dot-product self-attention on packed qkv (culmen's attention kernels).

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
        if alibi_slopes is not None and alibi_slopes.is_floating_point():
            alibi_slopes = alibi_slopes.float()
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


class FlashCrossAttention(_Fp32Slopes):
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
        if alibi_slopes is not None and alibi_slopes.is_floating_point():
            alibi_slopes = alibi_slopes.float()
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


# ------------------------------------------------------------------------------ plain PyTorch


def _padding_bias(key_padding_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``(B, 1, 1, Sk)`` additive bias: 0 where the key is kept, the penalty where it is padding."""
    keep = key_padding_mask.to(torch.bool)[:, None, None, :]
    return torch.zeros((), dtype=dtype, device=keep.device).masked_fill(~keep, _MASK_PENALTY)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal_top_left: bool, scale: float | None,
          dropout_p: float) -> Tensor:
    """SDPA on ``(B, S, H, D)`` layouts (heads of ``k``/``v`` may divide those of ``q``); returns
    ``(B, Sq, H, D)`` (a transposed view)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = k.shape[1] != q.shape[1]
    if gqa:
        # Query head i reads key/value head i // group, as flash_attn's kernels do.
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p,
                                         is_causal=causal_top_left, scale=scale)
    return out.transpose(1, 2)


class SelfAttention(nn.Module):
    """Softmax attention on packed qkv in plain PyTorch (the ``use_flash_attn=False`` path of ``MHA``).

    Args:
        causal: causal mask (overridable per call).
        softmax_scale: default ``headdim ** -0.5`` (also used when 0 or None, as flash_attn).
        attention_dropout: dropout on the attention probabilities (training mode only).
    """

    def __init__(self, causal: bool = False, softmax_scale: float | None = None, attention_dropout: float = 0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, qkv: Tensor, causal: bool | None = None, key_padding_mask: Tensor | None = None) -> Tensor:
        """``qkv``: ``(B, S, 3, H, D)``; ``key_padding_mask``: bool ``(B, S)``, True = keep. Padded keys
        get an additive ``-10000``, future keys too when causal. Returns ``(B, S, H, D)`` in qkv's dtype."""
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got shape {tuple(qkv.shape)}")
        causal = self.causal if causal is None else causal
        q, k, v = qkv.unbind(2)
        p = self.drop.p if self.training else 0.0
        scale = self.softmax_scale or None
        if key_padding_mask is None:
            return _sdpa(q, k, v, None, bool(causal), scale, p)
        bias = _padding_bias(key_padding_mask, q.dtype)
        if causal:
            s = qkv.shape[1]
            future = torch.ones(s, s, dtype=torch.bool, device=qkv.device).triu_(1)
            bias = bias + torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(future, _MASK_PENALTY)
        return _sdpa(q, k, v, bias, False, scale, p)


class CrossAttention(nn.Module):
    """Softmax attention of ``q`` over packed ``kv`` in plain PyTorch (MQA/GQA allowed).

    Args: as ``SelfAttention``. With ``causal``, query ``i`` of ``Sq`` sees keys ``j <= i + Sk - Sq``
    (bottom-right aligned), where ``Sk`` is each row's kept-key count when a ``key_padding_mask`` is given.
    """

    def __init__(self, causal: bool = False, softmax_scale: float | None = None, attention_dropout: float = 0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, q: Tensor, kv: Tensor, causal: bool | None = None,
                key_padding_mask: Tensor | None = None) -> Tensor:
        """``q``: ``(B, Sq, H, D)``; ``kv``: ``(B, Sk, 2, H_k, D)`` with ``H % H_k == 0``;
        ``key_padding_mask``: bool ``(B, Sk)``, True = keep. Returns ``(B, Sq, H, D)`` in q's dtype."""
        if q.dim() != 4 or kv.dim() != 5 or kv.shape[2] != 2 or kv.shape[0] != q.shape[0] \
                or kv.shape[4] != q.shape[3] or q.shape[2] % kv.shape[3]:
            raise ValueError(f"q must be (B, Sq, H, D) and kv (B, Sk, 2, H_k, D) with H % H_k == 0, got "
                             f"{tuple(q.shape)} and {tuple(kv.shape)}")
        causal = self.causal if causal is None else causal
        k, v = kv.unbind(2)
        p = self.drop.p if self.training else 0.0
        scale = self.softmax_scale or None
        bias = None if key_padding_mask is None else _padding_bias(key_padding_mask, q.dtype)
        if causal:
            sq, sk = q.shape[1], kv.shape[1]
            rows = torch.arange(sq, device=q.device).view(sq, 1)
            cols = torch.arange(sk, device=q.device)
            if key_padding_mask is None:
                future = cols > rows + (sk - sq)
            else:
                kept = key_padding_mask.sum(-1).view(-1, 1, 1, 1)
                future = cols > rows + kept - sq
            penalty = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(future, _MASK_PENALTY)
            # A future key is penalised once (flash_attn replaces, it does not add, the causal penalty).
            bias = penalty if bias is None else torch.where(future, penalty, bias)
        return _sdpa(q, k, v, bias, False, scale, p)


class LinearResidual(nn.Linear):
    """``nn.Linear`` whose forward returns ``(linear(x), x)`` (the ``return_residual`` form of ``FusedDense``)."""

    def forward(self, input: Tensor) -> tuple[Tensor, Tensor]:  # noqa: A002 (nn.Linear's argument name)
        return super().forward(input), input


# ------------------------------------------------------------------------------- KV cache


def _update_kv_cache(kv: Tensor, inference_params: Any, layer_idx: int) -> Tensor:
    """Write ``kv`` ``(B, S_new, 2, H_k, D)`` into ``inference_params.key_value_memory_dict[layer_idx]``
    (allocated ``(max_batch_size, max_seqlen, 2, H_k, D)`` on first use) at rows
    ``batch_size_offset:`` and positions ``seqlen_offset:``; returns the cache's filled part
    ``(B, seqlen_offset + S_new, 2, H_k, D)``."""
    cache = inference_params.key_value_memory_dict.get(layer_idx)
    if cache is None:
        cache = torch.empty(inference_params.max_batch_size, inference_params.max_seqlen, 2, *kv.shape[-2:],
                            dtype=kv.dtype, device=kv.device)
        inference_params.key_value_memory_dict[layer_idx] = cache
    b0 = inference_params.batch_size_offset
    b1 = b0 + kv.shape[0]
    s0 = inference_params.seqlen_offset
    s1 = s0 + kv.shape[1]
    if b1 > cache.shape[0] or s1 > cache.shape[1]:
        raise ValueError(f"the kv cache of layer {layer_idx} holds {tuple(cache.shape[:2])} (batch, seqlen); "
                         f"writing rows {b0}:{b1} at positions {s0}:{s1} does not fit")
    cache[b0:b1, s0:s1] = kv
    return cache[b0:b1, :s1]


def _seqlen_offset(inference_params: Any, batch: int) -> int | Tensor:
    # The cache (and lengths_per_sample) may be allocated for a larger batch than this call's.
    lengths = inference_params.lengths_per_sample
    return lengths[:batch] if lengths is not None else inference_params.seqlen_offset


class _AttentionCore(nn.Module):
    """What ``MHA`` and ``ParallelMHA`` share: the attention call (with checkpointing) and decoding."""

    # set by the subclasses' __init__
    layer_idx: int | None
    rotary_emb_dim: int
    use_flash_attn: bool
    checkpointing: bool
    _fused_rotary_decode: bool

    def _attend_packed(self, qkv: Tensor, kwargs: dict) -> Tensor:
        if self.checkpointing:
            return torch.utils.checkpoint.checkpoint(self.inner_attn, qkv, use_reentrant=False, **kwargs)
        return self.inner_attn(qkv, **kwargs)

    def _attend(self, q: Tensor, kv: Tensor, kwargs: dict) -> Tensor:
        if self.checkpointing:
            return torch.utils.checkpoint.checkpoint(self.inner_cross_attn, q, kv, use_reentrant=False, **kwargs)
        return self.inner_cross_attn(q, kv, **kwargs)

    def _update_kv_cache(self, kv: Tensor, inference_params: Any) -> Tensor:
        """``kv``: ``(B, S_new, 2, H_k, D)``; writes it into the cache of ``self.layer_idx`` and returns
        the filled part of the cache (see the module-level ``_update_kv_cache``)."""
        if getattr(self, "dwconv", False):
            raise ValueError("generation (inference_params) does not support dwconv")
        if self.layer_idx is None:
            raise ValueError("generation (inference_params) needs layer_idx in the constructor")
        return _update_kv_cache(kv, inference_params, self.layer_idx)

    def _kvcache_call(self, q: Tensor, kv: Tensor, inference_params: Any, rotary: bool) -> Tensor:
        batch = q.shape[0]
        cache = inference_params.key_value_memory_dict[self.layer_idx][:batch]
        lengths = inference_params.lengths_per_sample
        cache_seqlens = lengths[:batch] if lengths is not None else inference_params.seqlen_offset
        attn = self.inner_cross_attn
        if rotary:
            self.rotary_emb._update_cos_sin_cache(inference_params.max_seqlen, device=q.device, dtype=q.dtype)
            cos, sin = self.rotary_emb._cos_cached, self.rotary_emb._sin_cached
            interleaved = self.rotary_emb.interleaved
        else:
            cos = sin = None
            interleaved = False
        return flash_attn_with_kvcache(
            q, cache[:, :, 0], cache[:, :, 1], kv[:, :, 0], kv[:, :, 1], rotary_cos=cos, rotary_sin=sin,
            cache_seqlens=cache_seqlens, softmax_scale=attn.softmax_scale, causal=attn.causal,
            window_size=getattr(attn, "window_size", (-1, -1)), rotary_interleaved=interleaved,
            alibi_slopes=getattr(attn, "alibi_slopes", None))

    def _apply_rotary_update_kvcache_attention(self, q: Tensor, kv: Tensor, inference_params: Any) -> Tensor:
        """One ``flash_attn_with_kvcache`` call rotating the new Q and K, appending K/V to the cache and
        attending. ``q``: ``(B, S_q, H, D)``, ``kv``: ``(B, S_q, 2, H_k, D)``; returns ``(B, S_q, H, D)``."""
        if inference_params is None or inference_params.seqlen_offset <= 0 or not self.use_flash_attn:
            raise ValueError("the fused rotary + kv-cache path needs use_flash_attn and seqlen_offset > 0")
        return self._kvcache_call(q, kv, inference_params, self.rotary_emb_dim > 0)

    def _update_kvcache_attention(self, q: Tensor, kv: Tensor, inference_params: Any) -> Tensor:
        """Append ``kv`` to the cache, then attend ``q`` over everything cached (prefill, or the plain
        path); with flash attention after the prompt, one ``flash_attn_with_kvcache`` call."""
        if inference_params.seqlen_offset == 0 or not self.use_flash_attn:
            # Like flash_attn, this path positions the write by seqlen_offset, not lengths_per_sample.
            return self.inner_cross_attn(q, self._update_kv_cache(kv, inference_params))
        return self._kvcache_call(q, kv, inference_params, False)

    def _decode_step(self, q: Tensor | None, kv: Tensor | None, qkv: Tensor | None, inference_params: Any) -> Tensor:
        """Attention with a kv cache: from packed ``qkv`` ``(B, S, 3, H, D)`` or ``q`` + ``kv``."""
        if inference_params.seqlen_offset > 0 and self._fused_rotary_decode:
            if qkv is not None:
                q, kv = qkv[:, :, 0], qkv[:, :, 1:]
            return self._apply_rotary_update_kvcache_attention(q, kv, inference_params)
        if self.rotary_emb_dim > 0:
            batch = (qkv if qkv is not None else q).shape[0]
            offset, max_seqlen = _seqlen_offset(inference_params, batch), inference_params.max_seqlen
            if qkv is not None:
                qkv = self.rotary_emb(qkv, seqlen_offset=offset, max_seqlen=max_seqlen)
            else:
                q, kv = self.rotary_emb(q, kv, seqlen_offset=offset, max_seqlen=max_seqlen)
        if qkv is not None:
            q, kv = qkv[:, :, 0], qkv[:, :, 1:]
        return self._update_kvcache_attention(q, kv, inference_params)


def _check_heads(embed_dim: int, num_heads: int, num_heads_kv: int | None) -> int:
    if num_heads <= 0 or embed_dim % num_heads:
        raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
    num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
    if num_heads_kv <= 0 or num_heads % num_heads_kv:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_heads_kv ({num_heads_kv})")
    return num_heads_kv


def _causal_dwconv(conv: nn.Conv1d, x: Tensor) -> Tensor:
    """Depthwise causal convolution along the sequence of ``x`` ``(B, S, C)`` (the conv pads both sides by
    2; the last two outputs look ahead and are dropped)."""
    return conv(x.transpose(1, 2))[..., :-2].transpose(1, 2).contiguous()


def _inner_classes(use_flash_attn: bool, alibi_slopes: Tensor | None, window_size) -> tuple:
    if use_flash_attn:
        return (partial(FlashSelfAttention, alibi_slopes=alibi_slopes, window_size=window_size),
                partial(FlashCrossAttention, alibi_slopes=alibi_slopes, window_size=window_size))
    return SelfAttention, CrossAttention


def _check_flash_only(use_alibi: bool, window_size, use_flash_attn: bool) -> tuple[int, int]:
    window_size = _window_pair(window_size)
    if use_alibi and not use_flash_attn:
        raise ValueError("use_alibi=True needs use_flash_attn=True (the plain path has no ALiBi)")
    if window_size != (-1, -1) and not use_flash_attn:
        raise ValueError(f"window_size={window_size} (local attention) needs use_flash_attn=True")
    return window_size


class MHA(_AttentionCore):
    """Multi-head self- or cross-attention with input and output projections (flash_attn's ``MHA``).

    Args:
        embed_dim: model width ``E``; ``head_dim = E // num_heads``.
        num_heads: query heads. num_heads_kv: key/value heads (MQA / GQA); default ``num_heads``.
        cross_attn: queries from ``x``, keys/values from ``x_kv`` (``Wq`` + ``Wkv`` instead of ``Wqkv``).
        qkv_proj_bias, out_proj_bias: biases of the projections.
        dropout: attention dropout. softmax_scale: default ``head_dim ** -0.5``. causal: causal mask.
        layer_idx: this layer's key in ``inference_params.key_value_memory_dict`` (generation).
        dwconv: depthwise causal convolution (kernel 3) over the projected q/k/v.
        rotary_emb_dim: rotary dims per head (0 = none; may be less than ``head_dim``);
            rotary_emb_base, rotary_emb_scale_base (XPos), rotary_emb_interleaved: ``RotaryEmbedding``'s.
        use_alibi: ALiBi slopes from ``get_alibi_slopes(num_heads)`` (flash path only).
        window_size: ``(left, right)`` local attention (flash path only).
        fused_bias_fc: projections are culmen ``FusedDense``. use_flash_attn: culmen's attention kernels
            (``FlashSelfAttention``); else ``SelfAttention`` / ``CrossAttention`` in PyTorch.
        return_residual: ``forward`` returns ``(out, x)`` (lets a post-norm block fuse the residual).
        checkpointing: recompute the attention in the backward pass.
        device, dtype: factory kwargs of the parameters.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_heads_kv: int | None = None, cross_attn: bool = False,
                 qkv_proj_bias: bool = True, out_proj_bias: bool = True, dropout: float = 0.0,
                 softmax_scale: float | None = None, causal: bool = False, layer_idx: int | None = None,
                 dwconv: bool = False, rotary_emb_dim: int = 0, rotary_emb_base: float = 10000.0,
                 rotary_emb_scale_base: float | None = None, rotary_emb_interleaved: bool = False,
                 use_alibi: bool = False, window_size: tuple[int, int] = (-1, -1), fused_bias_fc: bool = False,
                 use_flash_attn: bool = False, return_residual: bool = False, checkpointing: bool = False,
                 device=None, dtype=None) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.cross_attn = cross_attn
        self.causal = causal
        self.layer_idx = layer_idx
        self.dwconv = dwconv
        self.rotary_emb_dim = rotary_emb_dim
        self.use_flash_attn = use_flash_attn
        self.return_residual = return_residual
        self.checkpointing = checkpointing
        window_size = _check_flash_only(use_alibi, window_size, use_flash_attn)
        alibi_slopes = (torch.tensor(get_alibi_slopes(num_heads), dtype=torch.float32, device=device)
                        if use_alibi else None)
        self.num_heads = num_heads
        self.num_heads_kv = _check_heads(embed_dim, num_heads, num_heads_kv)
        self.head_dim = embed_dim // num_heads
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        kv_dim = 2 * self.head_dim * self.num_heads_kv
        if rotary_emb_dim > 0:
            if cross_attn:
                raise ValueError("MHA with rotary embeddings (rotary_emb_dim > 0) does not support cross_attn")
            self.rotary_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base, scale_base=rotary_emb_scale_base,
                                              interleaved=rotary_emb_interleaved, device=device)
        # flash_attn_with_kvcache rotates K/V itself; flash_attn takes that path for rotary dims that are
        # multiples of 16. XPos (separate K tables) is not one of its forms: the unfused path serves it.
        self._fused_rotary_decode = (use_flash_attn and rotary_emb_dim > 0 and rotary_emb_dim % 16 == 0
                                     and rotary_emb_scale_base is None)
        linear_cls = FusedDense if fused_bias_fc else nn.Linear
        linear_resid_cls = partial(FusedDense, return_residual=True) if fused_bias_fc else LinearResidual
        wqkv_cls = linear_resid_cls if return_residual else linear_cls
        if not cross_attn:
            self.Wqkv = wqkv_cls(embed_dim, qkv_dim, bias=qkv_proj_bias, **factory)
        else:
            self.Wq = linear_cls(embed_dim, embed_dim, bias=qkv_proj_bias, **factory)
            self.Wkv = wqkv_cls(embed_dim, kv_dim, bias=qkv_proj_bias, **factory)
        if dwconv:
            if self.num_heads_kv == self.num_heads and not cross_attn:
                self.dwconv_qkv = nn.Conv1d(qkv_dim, qkv_dim, kernel_size=3, padding=2, groups=qkv_dim, **factory)
            else:
                self.dwconv_q = nn.Conv1d(embed_dim, embed_dim, kernel_size=3, padding=2, groups=embed_dim, **factory)
                self.dwconv_kv = nn.Conv1d(kv_dim, kv_dim, kernel_size=3, padding=2, groups=kv_dim, **factory)
        self_cls, cross_cls = _inner_classes(use_flash_attn, alibi_slopes, window_size)
        self.inner_attn = self_cls(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout)
        self.inner_cross_attn = cross_cls(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout)
        self.out_proj = linear_cls(embed_dim, embed_dim, bias=out_proj_bias, **factory)
        self._packed = not cross_attn and self.num_heads_kv == self.num_heads

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype: torch.dtype | None = None) -> Tensor:
        """An empty kv cache ``(batch_size, max_seqlen, 2, num_heads_kv, head_dim)`` on the parameters'
        device, in ``dtype`` (default: ``out_proj``'s weight dtype)."""
        weight = self.out_proj.weight
        return torch.empty(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim,
                           dtype=weight.dtype if dtype is None else dtype, device=weight.device)

    def _check_call(self, key_padding_mask, cu_seqlens, max_seqlen, inference_params) -> None:
        if cu_seqlens is not None:
            if max_seqlen is None:
                raise ValueError("max_seqlen is required with cu_seqlens")
            if key_padding_mask is not None:
                raise ValueError("key_padding_mask cannot be combined with cu_seqlens")
            if not self.use_flash_attn:
                raise ValueError("cu_seqlens (varlen input) needs use_flash_attn=True")
            if self.dwconv or self.rotary_emb_dim > 0:
                raise ValueError("cu_seqlens (varlen input) does not support dwconv or rotary embeddings")
        if key_padding_mask is not None and self.use_flash_attn:
            raise ValueError("key_padding_mask needs use_flash_attn=False (unpad the batch and pass cu_seqlens "
                             "for the flash path)")
        if inference_params is not None:
            if key_padding_mask is not None or cu_seqlens is not None or max_seqlen is not None:
                raise ValueError("inference_params cannot be combined with key_padding_mask or cu_seqlens")
            if self.dwconv:
                raise ValueError("generation (inference_params) does not support dwconv")

    def forward(self, x: Tensor, x_kv: Tensor | None = None, key_padding_mask: Tensor | None = None,
                cu_seqlens: Tensor | None = None, max_seqlen: int | None = None, mixer_subset=None,
                inference_params: Any = None, **kwargs) -> Tensor | tuple[Tensor, Tensor]:
        """Attention of ``x`` over itself, or over ``x_kv`` with ``cross_attn``.

        Args:
            x: ``(B, S, E)``, or ``(total, E)`` with ``cu_seqlens`` (flash path).
            x_kv: ``(B, S_k, E)`` keys/values source for cross-attention (default ``x``).
            key_padding_mask: bool ``(B, S)``, True = keep (plain path only).
            cu_seqlens: int32 ``(B + 1,)`` starts of the packed sequences; max_seqlen: the longest.
            mixer_subset: cross-attention only: index of ``x``'s positions to compute queries for.
            inference_params: generation state (flash_attn's ``InferenceParams``, used duck-typed:
                ``max_seqlen``, ``max_batch_size``, ``seqlen_offset``, ``batch_size_offset``,
                ``key_value_memory_dict``, ``lengths_per_sample``).
            kwargs: passed to the inner attention module (e.g. ``cu_seqlens_k`` for varlen cross-attention).

        Returns ``(B, S, E)`` (``(total, E)`` varlen), or ``(out, x)`` with ``return_residual``.
        """
        if cu_seqlens is not None or key_padding_mask is not None or inference_params is not None:
            self._check_call(key_padding_mask, cu_seqlens, max_seqlen, inference_params)
        if self.use_flash_attn:
            if cu_seqlens is not None:
                kwargs = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, **kwargs}
        elif key_padding_mask is not None:
            kwargs = {"key_padding_mask": key_padding_mask, **kwargs}
        if self._packed:
            if x_kv is not None or mixer_subset is not None:
                raise ValueError("x_kv and mixer_subset are for cross_attn=True")
            if self.return_residual:
                qkv, x = self.Wqkv(x)
            else:
                qkv = self.Wqkv(x)
            if self.dwconv:
                qkv = _causal_dwconv(self.dwconv_qkv, qkv)
            qkv = qkv.unflatten(-1, (3, self.num_heads, self.head_dim))
            if inference_params is None:
                if self.rotary_emb_dim > 0:
                    qkv = self.rotary_emb(qkv)
                context = self._attend_packed(qkv, kwargs)
            else:
                context = self._decode_step(None, None, qkv, inference_params)
        else:
            if self.cross_attn:
                if not self.return_residual:
                    q = self.Wq(x if mixer_subset is None else x[:, mixer_subset])
                    kv = self.Wkv(x_kv if x_kv is not None else x)
                else:
                    if x_kv is not None:
                        kv, x_kv = self.Wkv(x_kv)
                    else:
                        kv, x = self.Wkv(x)
                    q = self.Wq(x if mixer_subset is None else x[:, mixer_subset])
            else:
                if x_kv is not None or mixer_subset is not None:
                    raise ValueError("x_kv and mixer_subset are for cross_attn=True")
                if self.return_residual:
                    qkv, x = self.Wqkv(x)
                else:
                    qkv = self.Wqkv(x)
                # Two slices, not split(): rotary rotates them in place, which autograd forbids on the
                # views of a multi-output op.
                q, kv = qkv[..., :self.embed_dim], qkv[..., self.embed_dim:]
                if cu_seqlens is not None and "cu_seqlens_k" not in kwargs:
                    kwargs["cu_seqlens_k"], kwargs["max_seqlen_k"] = cu_seqlens, max_seqlen
            if self.dwconv:
                q, kv = _causal_dwconv(self.dwconv_q, q), _causal_dwconv(self.dwconv_kv, kv)
            q = q.unflatten(-1, (self.num_heads, self.head_dim))
            kv = kv.unflatten(-1, (2, self.num_heads_kv, self.head_dim))
            if inference_params is None:
                if self.rotary_emb_dim > 0:
                    q, kv = self.rotary_emb(q, kv)
                context = self._attend(q, kv, kwargs)
            else:
                context = self._decode_step(q, kv, None, inference_params)
        out = self.out_proj(context.flatten(-2))
        return (out, x) if self.return_residual else out


class ParallelMHA(_AttentionCore):
    """Tensor-parallel ``MHA`` (flash_attn's ``ParallelMHA``): ``Wqkv`` is a ``ColumnParallelLinear`` holding
    this rank's heads (uneven splits allowed: the first ranks take one head more), ``out_proj`` a
    ``RowParallelLinear``; with ``sequence_parallel`` the input is this rank's slice of the (flattened)
    sequence and so is the output.

    Args: as ``MHA`` (no cross-attention, dwconv, fused_bias_fc or return_residual), plus
        process_group: the tensor-parallel group; sequence_parallel: see above.

    A rank's ``Wqkv`` rows are ``[q heads | k heads | v heads]`` of its own heads (for GQA: its query
    heads' groups with their kv heads); ALiBi slopes are those of the local query heads.
    """

    def __init__(self, embed_dim: int, num_heads: int, process_group, num_heads_kv: int | None = None,
                 qkv_proj_bias: bool = True, out_proj_bias: bool = True, dropout: float = 0.0,
                 softmax_scale: float | None = None, causal: bool = False, layer_idx: int | None = None,
                 rotary_emb_dim: int = 0, rotary_emb_base: float = 10000.0, rotary_emb_scale_base: float | None = None,
                 rotary_emb_interleaved: bool = False, use_alibi: bool = False,
                 window_size: tuple[int, int] = (-1, -1), use_flash_attn: bool = False, checkpointing: bool = False,
                 sequence_parallel: bool = True, device=None, dtype=None) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if process_group is None:
            raise ValueError("ParallelMHA needs a process_group")
        self.embed_dim = embed_dim
        self.causal = causal
        self.layer_idx = layer_idx
        self.rotary_emb_dim = rotary_emb_dim
        self.use_flash_attn = use_flash_attn
        self.checkpointing = checkpointing
        self.process_group = process_group
        self.world_size = torch.distributed.get_world_size(process_group)
        self.local_rank = torch.distributed.get_rank(process_group)
        self.num_heads = num_heads
        self.num_heads_kv = _check_heads(embed_dim, num_heads, num_heads_kv)
        # Heads are dealt in groups (one kv head with its query heads), to Wqkv's rows and out_proj's columns
        # alike: with an uneven split of the groups the query count follows the kv count (flash_attn splits
        # the query heads on their own, which disagrees with Wqkv's rows). Even splits are flash_attn's.
        group = self.num_heads // self.num_heads_kv
        self.num_heads_kv_per_rank = get_dim_for_local_rank(self.num_heads_kv, self.world_size, self.local_rank)
        self.num_heads_per_rank = group * self.num_heads_kv_per_rank
        self.head_dim = embed_dim // num_heads
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        window_size = _check_flash_only(use_alibi, window_size, use_flash_attn)
        if use_alibi:
            first = group * sum(get_dim_for_local_rank(self.num_heads_kv, self.world_size, r)
                                for r in range(self.local_rank))
            local = get_alibi_slopes(num_heads)[first:first + self.num_heads_per_rank]
            alibi_slopes = torch.tensor(local, dtype=torch.float32, device=device)
        else:
            alibi_slopes = None
        if rotary_emb_dim > 0:
            self.rotary_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base, scale_base=rotary_emb_scale_base,
                                              interleaved=rotary_emb_interleaved, device=device)
        self._fused_rotary_decode = (use_flash_attn and rotary_emb_dim > 0 and rotary_emb_dim % 16 == 0
                                     and rotary_emb_scale_base is None)
        self.Wqkv = ColumnParallelLinear(embed_dim, qkv_dim, process_group, bias=qkv_proj_bias,
                                         sequence_parallel=sequence_parallel,
                                         multiple_of=self.head_dim * (self.num_heads // self.num_heads_kv + 2),
                                         **factory)
        self_cls, cross_cls = _inner_classes(use_flash_attn, alibi_slopes, window_size)
        self.inner_attn = self_cls(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout)
        self.inner_cross_attn = cross_cls(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout)
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, process_group, bias=out_proj_bias,
                                          sequence_parallel=sequence_parallel, multiple_of=self.head_dim * group,
                                          **factory)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype: torch.dtype | None = None) -> Tensor:
        """An empty kv cache ``(batch_size, max_seqlen, 2, num_heads_kv_per_rank, head_dim)``."""
        weight = self.out_proj.weight
        return torch.empty(batch_size, max_seqlen, 2, self.num_heads_kv_per_rank, self.head_dim,
                           dtype=weight.dtype if dtype is None else dtype, device=weight.device)

    def forward(self, x: Tensor, seqlen: int | None = None, inference_params: Any = None, **kwargs) -> Tensor:
        """``x``: ``(B, S, E)``, or ``(B * S, E)`` (this rank's rows of it when sequence parallel) with
        ``seqlen = S``, so sequence parallelism can split the flattened batch. Returns the same layout:
        ``(B, S, E)`` or this rank's rows of ``(B * S, E)``. ``kwargs`` go to the inner attention."""
        qkv = self.Wqkv(x)
        if seqlen is not None:
            qkv = qkv.unflatten(0, (-1, seqlen))
        d = self.head_dim
        if self.num_heads_kv == self.num_heads:
            qkv = qkv.unflatten(-1, (3, self.num_heads_per_rank, d))
            if inference_params is None:
                if self.rotary_emb_dim > 0:
                    qkv = self.rotary_emb(qkv)
                context = self._attend_packed(qkv, kwargs)
            else:
                context = self._decode_step(None, None, qkv, inference_params)
        else:
            nq = self.num_heads_per_rank * d
            q, kv = qkv[..., :nq], qkv[..., nq:]
            q = q.unflatten(-1, (self.num_heads_per_rank, d))
            kv = kv.unflatten(-1, (2, self.num_heads_kv_per_rank, d))
            if inference_params is None:
                if self.rotary_emb_dim > 0:
                    q, kv = self.rotary_emb(q, kv)
                context = self._attend(q, kv, kwargs)
            else:
                context = self._decode_step(q, kv, None, inference_params)
        context = context.flatten(-2)
        if seqlen is not None:
            context = context.flatten(0, 1)
        return self.out_proj(context)
