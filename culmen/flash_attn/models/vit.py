"""``flash_attn.models.vit``: the timm-style Vision Transformer built from culmen's modules.

``VisionTransformer`` takes flash_attn 2.8's arguments and has its parameter names (``patch_embed.proj``
as a linear layer, ``blocks.N.mixer.Wqkv`` / ``out_proj``, ``blocks.N.norm1`` / ``norm2`` / ``mlp.fc1`` /
``fc2``, ``norm``, ``head``); ``load_state_dict`` also accepts timm's names and its conv patch weight.

The blocks use the fused ordering of ``Block(prenorm=True)``: each block starts with dropout + add +
LayerNorm of the previous sub-layer's output and returns ``(hidden, residual)``; the residual stream is
kept in fp32. The model is the same function as timm's ViT (``x + attn(norm1(x))``, ``x + mlp(norm2(x))``,
final ``norm``), only the dropout / drop-path probabilities are attached one block later. ``forward``
needs only the class token, so the last block runs as cross-attention whose single query is the class
token (``mixer_subset=slice(0, 1)``) and its MLP runs on that one row.

Supported, as in flash_attn: ``global_pool='token'`` with a class token, ``no_embed_class``, no
LayerScale / pre-norm / fc-norm, ``weight_init=''``. Other values raise ``ValueError`` (flash_attn asserts).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn.init import trunc_normal_

from culmen.flash_attn.layers.patch_embed import PatchEmbed
from culmen.flash_attn.modules.block import Block, StochasticDepth
from culmen.flash_attn.modules.mha import MHA
from culmen.flash_attn.modules.mlp import Mlp
from culmen.flash_attn.ops.fused_dense import FusedMLP
from culmen.flash_attn.ops.layer_norm import dropout_add_layer_norm

__all__ = ["VisionTransformer", "create_block", "create_mixer_cls", "create_mlp_cls", "init_weights_vit_timm",
           "vit_base_patch16_224"]


def create_mixer_cls(num_heads: int, qkv_bias: bool, attn_drop: float, use_flash_attn: bool, fused_bias_fc: bool,
                     cross_attn: bool = False):
    """``partial(MHA, ...)`` for a ViT block (bidirectional attention)."""
    return partial(MHA, num_heads=num_heads, cross_attn=cross_attn, qkv_proj_bias=qkv_bias, dropout=attn_drop,
                   fused_bias_fc=fused_bias_fc, use_flash_attn=use_flash_attn)


def create_mlp_cls(embed_dim: int, mlp_ratio: float, act_layer: Callable[[], nn.Module], fused_mlp: bool):
    """``partial(Mlp, ...)`` with ``act_layer()`` as activation, or ``partial(FusedMLP, ...)`` (tanh GELU)."""
    inner_dim = int(embed_dim * mlp_ratio)
    if not fused_mlp:
        return partial(Mlp, hidden_features=inner_dim, activation=act_layer())
    return partial(FusedMLP, hidden_features=inner_dim)


def create_block(embed_dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, drop_rate: float,
                 attn_drop_rate: float, drop_path1: float, drop_path2: float, norm_layer, act_layer,
                 use_flash_attn: bool, fused_bias_fc: bool, fused_mlp: bool, fused_dropout_add_ln: bool,
                 layer_idx: int | None = None, n_layer: int | None = None, last_layer_subset: bool = False) -> Block:
    """One ViT block; the last one (``layer_idx == n_layer - 1``) is cross-attention with ``last_layer_subset``."""
    cross_attn = last_layer_subset and layer_idx == n_layer - 1
    return Block(
        embed_dim,
        create_mixer_cls(num_heads, qkv_bias, attn_drop_rate, use_flash_attn, fused_bias_fc, cross_attn=cross_attn),
        create_mlp_cls(embed_dim, mlp_ratio, act_layer, fused_mlp),
        norm_cls=norm_layer,
        prenorm=True,
        resid_dropout1=drop_rate,
        resid_dropout2=drop_rate,
        drop_path1=drop_path1,
        drop_path2=drop_path2,
        fused_dropout_add_ln=fused_dropout_add_ln,
        residual_in_fp32=True,
    )


def _check(name: str, ok: bool, value, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not supported: {why}")


class VisionTransformer(nn.Module):
    """Vision Transformer (Dosovitskiy et al., 2020) with flash_attn's arguments.

    Args:
        img_size, patch_size, in_chans: image and patch geometry (see ``PatchEmbed``).
        num_classes: classifier outputs (``0``: ``head`` is ``nn.Identity``).
        global_pool: ``"token"`` (the class token's features) is the only pooling supported.
        embed_dim, depth, num_heads, mlp_ratio: width, number of blocks, heads, MLP width / ``embed_dim``.
        qkv_bias: bias in the query/key/value projection.
        init_values, pre_norm, fc_norm, weight_init: must keep their defaults (``None``, ``False``,
            ``None``, ``""``), as in flash_attn.
        class_token: must be True. no_embed_class: the position embedding covers only the patches
            (added before the class token is prepended).
        drop_rate, attn_drop_rate, drop_path_rate: residual dropout, attention dropout, stochastic
            depth (rising linearly to ``drop_path_rate`` over the blocks).
        embed_layer: patch embedding class (``PatchEmbed`` gets ``fused_bias_fc`` too).
        norm_layer: default ``partial(nn.LayerNorm, eps=1e-6)``. act_layer: MLP activation class,
            default ``nn.GELU``.
        use_flash_attn, fused_bias_fc, fused_mlp, fused_dropout_add_ln: culmen's attention kernels,
            ``FusedDense`` projections, ``FusedMLP`` (tanh GELU), fused dropout + add + LayerNorm.

    ``forward(x (B, in_chans, H, W))`` returns logits ``(B, num_classes)`` (features ``(B, embed_dim)``
    with ``num_classes=0``), in the parameters' dtype.
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int | tuple[int, int] = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "token",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        init_values: float | None = None,
        class_token: bool = True,
        no_embed_class: bool = False,
        pre_norm: bool = False,
        fc_norm: bool | None = None,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        weight_init: str = "",
        embed_layer: type[nn.Module] = PatchEmbed,
        norm_layer: Callable[[int], nn.Module] | None = None,
        act_layer: Callable[[], nn.Module] | None = None,
        use_flash_attn: bool = False,
        fused_bias_fc: bool = False,
        fused_mlp: bool = False,
        fused_dropout_add_ln: bool = False,
    ) -> None:
        super().__init__()
        _check("global_pool", global_pool == "token", global_pool, "only pooling with the CLS token ('token')")
        _check("class_token", class_token is True, class_token, "a class token is required")
        _check("init_values", init_values is None, init_values, "LayerScale is not supported")
        _check("weight_init", weight_init == "", weight_init, "only the default timm init ('')")
        _check("fc_norm", fc_norm is None, fc_norm, "no norm after pooling")
        _check("pre_norm", not pre_norm, pre_norm, "no norm before the blocks (each block starts with one)")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if num_classes < 0:
            raise ValueError(f"num_classes must be >= 0, got {num_classes}")
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        act_layer = act_layer or nn.GELU

        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.no_embed_class = no_embed_class

        extra = {"fused_bias_fc": fused_bias_fc} if embed_layer is PatchEmbed else {}
        self.patch_embed = embed_layer(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                       embed_dim=embed_dim, bias=not pre_norm, **extra)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        embed_len = num_patches if no_embed_class else num_patches + self.num_prefix_tokens
        self.pos_embed = nn.Parameter(torch.randn(1, embed_len, embed_dim) * 0.02)

        dpr = torch.linspace(0, drop_path_rate, depth).tolist()
        # Block i opens with the dropout/drop-path of block i-1's MLP output (the fused ordering), so
        # drop_path1 of block i is dpr[i-1] and the last MLP's comes after the blocks.
        self.blocks = nn.ModuleList([
            create_block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate,
                         drop_path1=dpr[i - 1] if i > 0 else 0.0, drop_path2=dpr[i], norm_layer=norm_layer,
                         act_layer=act_layer, use_flash_attn=use_flash_attn, fused_bias_fc=fused_bias_fc,
                         fused_mlp=fused_mlp, fused_dropout_add_ln=fused_dropout_add_ln, layer_idx=i,
                         n_layer=depth, last_layer_subset=global_pool == "token")
            for i in range(depth)
        ])
        self.dropout = nn.Dropout(p=drop_rate)
        self.drop_path = StochasticDepth(p=dpr[-1], mode="row")
        self.norm = norm_layer(embed_dim)
        self.fused_dropout_add_ln = fused_dropout_add_ln
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights(weight_init)

    def init_weights(self, mode: str = "") -> None:
        """timm's original ViT init: truncated-normal (std 0.02) position embedding and linear
        weights, zero linear biases, class token N(0, 1e-6); norms keep their defaults."""
        _check("mode", mode == "", mode, "only the default timm init ('')")
        trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        _named_apply(init_weights_vit_timm, self)

    def _init_weights(self, m: nn.Module) -> None:
        init_weights_vit_timm(m)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameter names conventionally excluded from weight decay."""
        return {"pos_embed", "cls_token"}

    def _pos_embed(self, x: Tensor) -> Tensor:
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        if self.no_embed_class:
            return torch.cat((cls, x + self.pos_embed), dim=1)
        return torch.cat((cls, x), dim=1) + self.pos_embed

    def forward_features(self, x: Tensor, all_tokens: bool = True) -> Tensor:
        """``x (B, C, H, W)`` -> normalized features ``(B, 1 + num_patches, D)``; with
        ``all_tokens=False`` only the class token's ``(B, 1, D)`` (the last block computes only it)."""
        hidden_states = self._pos_embed(self.patch_embed(x))
        residual = None
        if all_tokens:
            for block in self.blocks:
                hidden_states, residual = block(hidden_states, residual)
        else:
            for block in self.blocks[:-1]:
                hidden_states, residual = block(hidden_states, residual)
            hidden_states, residual = self.blocks[-1](hidden_states, residual, mixer_subset=slice(0, 1))
        if not self.fused_dropout_add_ln:
            residual = self.drop_path(self.dropout(hidden_states)) + residual
            return self.norm(residual.to(dtype=self.norm.weight.dtype))
        rowscale = None
        if self.training and self.drop_path.p > 0:
            rowscale = self.drop_path(hidden_states.new_ones(hidden_states.shape[:-1]))
        return dropout_add_layer_norm(hidden_states, residual, self.norm.weight, self.norm.bias,
                                      self.dropout.p if self.training else 0.0, self.norm.eps, rowscale=rowscale,
                                      prenorm=False, residual_in_fp32=True)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """``(B, L, D)`` features -> the class token's ``(B, D)`` (``pre_logits``) or ``head`` of it."""
        x = x[:, 0]
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        """``x (B, C, H, W)`` -> ``(B, num_classes)``."""
        return self.forward_head(self.forward_features(x, all_tokens=False))

    def load_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` that also takes timm ViT checkpoints: a conv
        ``patch_embed.proj.weight (D, C, p1, p2)``, ``blocks.N.attn.qkv`` / ``attn.proj`` names, and a
        fused ``Wqkv`` for the last (cross-attention) block, split into ``Wq`` / ``Wkv``.
        The mapping passed in is not modified."""
        sd = OrderedDict((_TIMM_ATTN.sub(_timm_attn_name, k), v) for k, v in state_dict.items())
        w = sd.get("patch_embed.proj.weight")
        if w is not None and w.dim() == 4:
            sd["patch_embed.proj.weight"] = w.reshape(w.shape[0], -1)
        last = f"blocks.{len(self.blocks) - 1}.mixer."
        if getattr(self.blocks[-1].mixer, "cross_attn", False) and f"{last}Wqkv.weight" in sd:
            for kind in ("weight", "bias"):
                fused = sd.pop(f"{last}Wqkv.{kind}", None)
                if fused is not None:
                    sd[f"{last}Wq.{kind}"] = fused[: self.embed_dim]
                    sd[f"{last}Wkv.{kind}"] = fused[self.embed_dim:]
        return super().load_state_dict(sd, strict=strict, assign=assign)


_TIMM_ATTN = re.compile(r"^blocks\.(\d+)\.attn\.(qkv|proj)\.")


def _timm_attn_name(m: re.Match) -> str:
    return f"blocks.{m.group(1)}.mixer.{'Wqkv' if m.group(2) == 'qkv' else 'out_proj'}."


def _named_apply(fn: Callable[..., None], module: nn.Module, name: str = "") -> None:
    # timm's named_apply(depth_first=True, include_root=False): children first, never the root
    # (the root's own init_weights is what calls this).
    for child_name, child in module.named_children():
        full = f"{name}.{child_name}" if name else child_name
        _named_apply(fn, child, full)
        fn(module=child, name=full)


def init_weights_vit_timm(module: nn.Module, name: str = "") -> None:
    """timm's original ViT init of one module: truncated-normal (std 0.02) linear weights and zero
    biases; a module with its own ``init_weights`` runs that."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "init_weights"):
        module.init_weights()


def vit_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-Base/16 at 224x224 (patch 16, width 768, depth 12, 12 heads); ``kwargs`` go to
    ``VisionTransformer`` and may override those four (flash_attn raises a duplicate-argument
    ``TypeError`` then). Pretrained weights are not bundled (``pretrained=True`` raises, as flash_attn)."""
    if pretrained:
        raise ValueError("pretrained=True is not supported: load a checkpoint with load_state_dict")
    return VisionTransformer(**{"patch_size": 16, "embed_dim": 768, "depth": 12, "num_heads": 12, **kwargs})
