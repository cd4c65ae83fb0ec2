"""``flash_attn.layers.patch_embed``: ``PatchEmbed``, the ViT patchifier written as a linear layer.

A ``Conv2d`` with ``kernel_size == stride == patch_size`` is a linear map of each non-overlapping
patch, so the image is cut into patches by a reshape/permute and projected with one GEMM (faster
than a strided convolution). The weight is the conv weight flattened in ``(c, p1, p2)`` order:
``proj.weight (embed_dim, in_chans * p1 * p2)``. ``fused_bias_fc=True`` projects with culmen's
``FusedDense`` (bias in the GEMM epilogue).

Difference from flash_attn: an image of the wrong size raises ``ValueError`` (flash_attn asserts).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from culmen.flash_attn.ops.fused_dense import FusedDense

__all__ = ["PatchEmbed"]


class PatchEmbed(nn.Module):
    """2D image to patch embedding.

    Args:
        img_size: input image size, int or ``(H, W)``.
        patch_size: patch size, int or ``(p1, p2)``; ``H // p1`` by ``W // p2`` patches are taken
            (a remainder is cropped off, as a strided conv would).
        in_chans: number of image channels ``C``.
        embed_dim: output features ``D``.
        norm_layer: optional ``norm_layer(embed_dim)`` applied to the output.
        flatten: return ``(B, num_patches, D)`` instead of ``(B, H // p1, W // p2, D)``.
        bias: give the projection a bias.
        fused_bias_fc: project with ``FusedDense`` (only used with ``bias``, as flash_attn).

    ``forward(x (B, C, H, W))`` returns ``(B, num_patches, D)`` (or ``(B, gh, gw, D)``) in the
    dtype of ``x`` / the projection.
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int | tuple[int, int] = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        norm_layer: Callable[[int], nn.Module] | None = None,
        flatten: bool = True,
        bias: bool = True,
        fused_bias_fc: bool = False,
    ) -> None:
        super().__init__()
        img_size = _pair(img_size)
        patch_size = _pair(patch_size)
        for name, pair in (("img_size", img_size), ("patch_size", patch_size)):
            if len(pair) != 2 or any(not isinstance(v, int) or v <= 0 for v in pair):
                raise ValueError(f"{name} must be a positive int or a pair of them, got {pair}")
        if img_size[0] < patch_size[0] or img_size[1] < patch_size[1]:
            raise ValueError(f"patch_size {patch_size} is larger than img_size {img_size}")
        self.img_size = img_size
        self.patch_size = patch_size
        self.grid_size = (img_size[0] // patch_size[0], img_size[1] // patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.flatten = flatten
        linear_cls = FusedDense if fused_bias_fc and bias else nn.Linear
        self.proj = linear_cls(in_chans * patch_size[0] * patch_size[1], embed_dim, bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        """``x (B, C, H, W)`` -> ``(B, num_patches, embed_dim)`` (``(B, gh, gw, embed_dim)`` unflattened)."""
        b, c, h, w = x.shape
        if h != self.img_size[0] or w != self.img_size[1]:
            raise ValueError(f"Input image size ({h}x{w}) doesn't match model "
                             f"({self.img_size[0]}x{self.img_size[1]}).")
        p1, p2 = self.patch_size
        gh, gw = self.grid_size
        if h != gh * p1 or w != gw * p2:
            # A strided conv drops the pixels past the last whole patch.
            x = x[:, :, : gh * p1, : gw * p2]
        patches = x.reshape(b, c, gh, p1, gw, p2).permute(0, 2, 4, 1, 3, 5).reshape(b, gh, gw, c * p1 * p2)
        out = self.proj(patches)
        if self.flatten:
            out = out.reshape(b, gh * gw, out.shape[-1])
        return self.norm(out)
