"""``apex.contrib.multihead_attn.self_multihead_attn``: ``SelfMultiheadAttn``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import Parameter

from culmen.contrib.multihead_attn._core import check_dropout, check_heads, self_attention
from culmen.contrib.multihead_attn.self_multihead_attn_func import self_attn_func
from culmen.normalization import FusedLayerNorm


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_impl(impl) -> str:
    if impl not in ("fast", "default"):
        raise ValueError(f"impl must be 'fast' or 'default', got {impl!r}")
    return impl


def pick_mask(key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> tuple[Tensor | None, bool]:
    """Apex's rule: one mask at most; ``(mask, use_time_mask)``."""
    if key_padding_mask is not None:
        if attn_mask is not None:
            raise ValueError("attn_mask and key_padding_mask cannot both be given")
        return key_padding_mask, False
    return attn_mask, attn_mask is not None


def residual_dropout_add(x: Tensor, residual: Tensor, p: float, is_training: bool) -> Tensor:
    """``residual + dropout(x, p)`` (dropout only when ``is_training``)."""
    return residual + (F.dropout(x, p) if is_training and p > 0.0 else x)


def set_attn_settings(module: nn.Module, embed_dim: int, num_heads: int, dropout: float, bias: bool,
                      include_norm_add: bool, impl: str, mask_additive: bool) -> None:
    """Check the constructor arguments both attention modules share and keep them under Apex's attribute names
    (plus ``head_dim`` and ``scaling = head_dim ** -0.5``)."""
    module.head_dim = check_heads(embed_dim, num_heads)
    module.embed_dim = embed_dim
    module.num_heads = num_heads
    module.dropout = check_dropout(dropout)
    module.bias = _check_flag("bias", bias)
    module.include_norm_add = _check_flag("include_norm_add", include_norm_add)
    module.impl = check_impl(impl)
    module.mask_additive = _check_flag("mask_additive", mask_additive)
    module.scaling = module.head_dim ** -0.5


def add_norm_params(module: nn.Module, embed_dim: int, include_norm_add: bool, impl: str) -> None:
    """The pre-LayerNorm's parameters under Apex's names: ``lyr_nrm_gamma_weights`` / ``lyr_nrm_beta_weights``
    ``(embed_dim,)`` for the fast path, a ``FusedLayerNorm`` ``lyr_nrm`` for the default one."""
    if not include_norm_add:
        return
    fast = impl == "fast"
    module.lyr_nrm_gamma_weights = Parameter(torch.empty(embed_dim)) if fast else None
    module.lyr_nrm_beta_weights = Parameter(torch.empty(embed_dim)) if fast else None
    module.lyr_nrm = None if fast else FusedLayerNorm(embed_dim)


def reset_norm_params(module: nn.Module) -> None:
    """LayerNorm parameters back to ``(1, 0)`` (those ``add_norm_params`` made)."""
    if not module.include_norm_add:
        return
    if module.impl == "fast":
        nn.init.ones_(module.lyr_nrm_gamma_weights)
        nn.init.zeros_(module.lyr_nrm_beta_weights)
    else:
        module.lyr_nrm.reset_parameters()


def default_norm_input(module: nn.Module, query: Tensor, time: bool) -> Tensor:
    """The default path's checks and pre-LayerNorm: the input its attention function reads."""
    if time and module.mask_additive:
        raise ValueError("mask_additive applies to key padding masks; a time mask (attn_mask) is boolean")
    return module.lyr_nrm(query) if module.include_norm_add else query


class SelfMultiheadAttn(nn.Module):
    """Multi-head self-attention on sequence-first activations, Apex's ``SelfMultiheadAttn``.

    Args:
        embed_dim: model width ``E``; num_heads: heads (divide ``E``).
        dropout: attention-probability dropout (and, with ``include_norm_add``, the output's before the
            residual add), applied when ``forward``'s ``is_training`` is true.
        bias: biases on the input (``3E``) and output (``E``) projections.
        include_norm_add: pre-LayerNorm on the input and ``input + dropout(attention)`` on the output.
        impl: ``"fast"`` (culmen's FlashAttention / fused softmax / LayerNorm kernels) or ``"default"``
            (plain PyTorch).
        separate_qkv_params: ``q_weight``/``k_weight``/``v_weight`` (and biases) ``(E, E)`` instead of one
            ``in_proj_weight (3E, E)`` (whose rows are per-head ``(q, k, v)`` triples).
        mask_additive: a key-padding mask is a float added to the scores (e.g. 0 / -10000) rather than
            a boolean (nonzero = padding).

    Parameters keep Apex's names: ``in_proj_weight`` / ``q_weight``..., ``out_proj_weight``, the biases
    ``in_proj_bias`` / ``q_bias``... and ``out_proj_bias``, and ``lyr_nrm_gamma_weights`` /
    ``lyr_nrm_beta_weights`` (fast) or ``lyr_nrm`` (a ``FusedLayerNorm``, default). Where Apex refuses
    (``mask_additive`` with ``include_norm_add``, or fast without bias) culmen runs the combination.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = False,
                 include_norm_add: bool = False, impl: str = "fast", separate_qkv_params: bool = False,
                 mask_additive: bool = False) -> None:
        super().__init__()
        set_attn_settings(self, embed_dim, num_heads, dropout, bias, include_norm_add, impl, mask_additive)
        self.separate_qkv_params = _check_flag("separate_qkv_params", separate_qkv_params)
        e = embed_dim
        if separate_qkv_params:
            self.q_weight = Parameter(torch.empty(e, e))
            self.k_weight = Parameter(torch.empty(e, e))
            self.v_weight = Parameter(torch.empty(e, e))
        else:
            self.in_proj_weight = Parameter(torch.empty(3 * e, e))
        self.out_proj_weight = Parameter(torch.empty(e, e))
        names = ("q_bias", "k_bias", "v_bias") if separate_qkv_params else ("in_proj_bias",)
        sizes = (e, e, e) if separate_qkv_params else (3 * e,)
        for name, n in zip(names, sizes):
            self.register_parameter(name, Parameter(torch.empty(n)) if bias else None)
        self.register_parameter("out_proj_bias", Parameter(torch.empty(e)) if bias else None)
        add_norm_params(self, e, include_norm_add, impl)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections (the packed ``(3E, E)`` weight with gain ``sqrt(2)``, so each of its
        ``(E, E)`` parts gets the spread of a square matrix), zero biases, LayerNorm ``(1, 0)``."""
        if self.separate_qkv_params:
            for w in (self.q_weight, self.k_weight, self.v_weight):
                nn.init.xavier_uniform_(w)
        else:
            nn.init.xavier_uniform_(self.in_proj_weight, gain=math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj_weight)
        if self.bias:
            for b in self._in_biases():
                nn.init.zeros_(b)
            nn.init.zeros_(self.out_proj_bias)
        reset_norm_params(self)

    def _in_biases(self) -> tuple:
        return (self.q_bias, self.k_bias, self.v_bias) if self.separate_qkv_params else (self.in_proj_bias,)

    def input_weights(self) -> tuple[Tensor, Tensor | None]:
        """The packed ``(3E, E)`` input weight and ``(3E,)`` bias (interleaved per head from the separate
        parameters when ``separate_qkv_params``)."""
        if not self.separate_qkv_params:
            return self.in_proj_weight, self.in_proj_bias
        h, d, e = self.num_heads, self.head_dim, self.embed_dim
        w = torch.stack([t.view(h, d, e) for t in (self.q_weight, self.k_weight, self.v_weight)], 1)
        b = None
        if self.bias:
            b = torch.stack([t.view(h, d) for t in (self.q_bias, self.k_bias, self.v_bias)], 1).reshape(3 * e)
        return w.reshape(3 * e, e), b

    def forward(self, query: Tensor, key: Tensor | None, value: Tensor | None,
                key_padding_mask: Tensor | None = None, need_weights: bool = False,
                attn_mask: Tensor | None = None, is_training: bool = True) -> tuple[Tensor, None]:
        """Self-attention of ``query (seq, batch, embed)`` (``key`` and ``value`` are ignored, as in Apex).

        Args:
            key_padding_mask: ``(batch, seq)``: nonzero = padded key (bool/uint8), or the float scores'
                addend when ``mask_additive``.
            need_weights: ignored (the weights are never returned).
            attn_mask: time mask ``(seq, seq)``, nonzero = masked (``triu(ones, 1)`` runs causal
                FlashAttention). Not together with ``key_padding_mask``.
            is_training: apply dropout.

        Returns ``(output (seq, batch, embed), None)``.
        """
        mask, time = pick_mask(key_padding_mask, attn_mask)
        w, b = self.input_weights()
        p = self.dropout if is_training else 0.0
        if self.impl == "fast":
            norm = (self.lyr_nrm_gamma_weights, self.lyr_nrm_beta_weights) if self.include_norm_add else None
            out = self_attention(query, self.num_heads, w, b, self.out_proj_weight, self.out_proj_bias, mask, time,
                                 self.mask_additive, p, norm=norm, out_dropout_p=p)
            return out, None
        x = default_norm_input(self, query, time)
        out = self_attn_func(time, is_training, self.num_heads, self.scaling, x, w, self.out_proj_weight, b,
                             self.out_proj_bias, mask, self.mask_additive, self.dropout)
        if self.include_norm_add:
            out = residual_dropout_add(out, query, self.dropout, is_training)
        return out, None


__all__ = ["SelfMultiheadAttn", "jit_dropout_add"]


def jit_dropout_add(x: Tensor, residual: Tensor, prob: float, is_training: bool) -> Tensor:
    """``residual + dropout(x, prob)`` (the residual add of the ``impl="default"`` norm-add path). As in Apex,
    dropout is applied whatever ``is_training`` says (callers only use it when training). ``x`` and ``residual``:
    same shape, any float dtype; returns that shape and dtype."""
    return residual + F.dropout(x, p=prob, training=True)
