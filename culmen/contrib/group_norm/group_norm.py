"""``apex.contrib.group_norm.group_norm`` on culmen's GroupNorm op (``culmen.ops.group_norm``).

Apex's fast path needs channels-last input, 16 or 32 groups, a channel count from a fixed list and
an affine module; everything else falls back to ``F.group_norm``. culmen runs its fused kernels for
every case: NCHW and channels-last (without converting), any group and channel count, affine or not,
any (input, parameter) dtype pair, with fp32 statistics. The output keeps the input's dtype and
memory format.

``sums``, which the Apex-named ``group_norm_nhwc_fprop`` returns and ``group_norm_nhwc_bprop`` takes,
holds culmen's per-group ``(mean, rstd)`` pairs: ``(2 * N * G,)`` fp32, interleaved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import init
from torch.nn.parameter import Parameter

from culmen.ops.group_norm.op import group_norm, group_norm_backward, parse_act

__all__ = ["GroupNorm", "cuda_group_norm_nhwc", "cuda_group_norm_nhwc_one_pass", "cuda_group_norm_nhwc_two_pass",
           "cuda_group_norm_v2_nhwc", "group_norm_nhwc_bprop", "group_norm_nhwc_fprop", "torch_group_norm"]


def torch_group_norm(x: Tensor, g: int, w: Tensor | None, b: Tensor | None, eps: float, act: str | None = "") -> Tensor:
    """Apex's PyTorch fallback: ``F.group_norm`` in the parameter dtype (+ SiLU), cast back to ``x.dtype``."""
    xdtype = x.dtype
    wdtype = w.dtype if w is not None else xdtype
    y = F.group_norm(x.to(wdtype), g, w, b, eps)
    if parse_act(act):
        y = F.silu(y)
    return y.to(xdtype)


def _sums(mean: Tensor, rstd: Tensor) -> Tensor:
    return torch.stack((mean.float(), rstd.float()), dim=-1).reshape(-1)


def _unpack_sums(sums: Tensor, N: int, G: int) -> tuple[Tensor, Tensor]:
    if sums.numel() != 2 * N * G:
        raise ValueError(f"group_norm: sums must have 2 * N * G = {2 * N * G} elements, got {sums.numel()}")
    pairs = sums.reshape(N, G, 2)
    return pairs[..., 0], pairs[..., 1]


def group_norm_nhwc_fprop(x: Tensor, G: int, weight: Tensor, bias: Tensor, eps: float, act: str | None = None,
                          passes: int = 1, use_group_norm_v2: bool = False) -> tuple[Tensor, Tensor]:
    """``(y, sums)``: GroupNorm (+ SiLU) of ``x`` and the per-group statistics; ``y`` is differentiable.
    ``passes`` and ``use_group_norm_v2`` (Apex's kernel choices) are accepted and ignored."""
    if passes not in (1, 2):
        raise ValueError(f"group_norm: passes must be 1 or 2, got {passes}")
    y, mean, rstd = group_norm(x, G, weight, bias, eps, act, return_stats=True)
    return y, _sums(mean, rstd)


def group_norm_nhwc_bprop(grad_output: Tensor, sums: Tensor, x: Tensor, G: int, weight: Tensor, bias: Tensor,
                          eps: float, act: str | None = None, passes: int = 1,
                          use_group_norm_v2: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(dx, dweight, dbias)`` from the ``sums`` of ``group_norm_nhwc_fprop``; not differentiable."""
    mean, rstd = _unpack_sums(sums, x.shape[0], G)
    return group_norm_backward(grad_output, x, G, weight, bias, mean, rstd, act)


def cuda_group_norm_nhwc_one_pass(x: Tensor, G: int, weight: Tensor, bias: Tensor, eps: float,
                                  act: str | None = None) -> Tensor:
    """GroupNorm (+ SiLU); Apex's one-pass kernel entry point (culmen picks its schedule itself)."""
    return group_norm(x, G, weight, bias, eps, act)


def cuda_group_norm_nhwc_two_pass(x: Tensor, G: int, weight: Tensor, bias: Tensor, eps: float,
                                  act: str | None = None) -> Tensor:
    """GroupNorm (+ SiLU); Apex's two-pass kernel entry point."""
    return group_norm(x, G, weight, bias, eps, act)


def cuda_group_norm_v2_nhwc(x: Tensor, G: int, weight: Tensor, bias: Tensor, eps: float,
                            act: str | None = None) -> Tensor:
    """GroupNorm (+ SiLU); Apex's Blackwell "v2" kernel entry point (any GPU and shape here)."""
    return group_norm(x, G, weight, bias, eps, act)


def cuda_group_norm_nhwc(x: Tensor, G: int, weight: Tensor, bias: Tensor, eps: float, act: str | None = "",
                         algo: int = 1) -> Tensor:
    """GroupNorm (+ SiLU); older Apex's ``GroupNormNHWC.apply`` with an ``algo`` (ignored)."""
    return group_norm(x, G, weight, bias, eps, act)


class GroupNorm(torch.nn.Module):
    """``apex.contrib.group_norm.GroupNorm``: GroupNorm with an optional fused SiLU/Swish.

    Args:
        num_groups: divides ``num_channels``.
        num_channels: ``C`` of the ``(N, C, *spatial)`` input.
        eps: added to the variance.
        affine: learnable per-channel ``weight`` (ones) and ``bias`` (zeros).
        device, dtype: factory kwargs of the parameters (any float dtype, independent of the input's).
        act: ``None`` / ``""`` or ``"silu"`` / ``"swish"`` (any case).

    Shape: input ``(N, C, *spatial)`` in NCHW or channels-last; output the same shape, dtype and
    memory format.
    """

    __constants__ = ["num_groups", "num_channels", "eps", "affine", "act"]
    num_groups: int
    num_channels: int
    eps: float
    affine: bool
    act: str | None

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True, device=None,
                 dtype=None, act: str | None = None) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        if num_groups <= 0 or num_channels % num_groups != 0:
            raise ValueError(f"num_channels must be divisible by num_groups, got num_channels={num_channels} and "
                             f"num_groups={num_groups}")
        parse_act(act)
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        self.act = act.lower() if act else act
        if self.affine:
            self.weight = Parameter(torch.empty(num_channels, **factory_kwargs))
            self.bias = Parameter(torch.empty(num_channels, **factory_kwargs))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        # Everything else is checked once per input signature by the op's cached plan; this compares two
        # tuples (no torch call), for the channel count that a module without parameters cannot show the op.
        if input.shape[1:2] != (self.num_channels,):
            raise ValueError(f"GroupNorm: expected input of shape (N, {self.num_channels}, *), got "
                             f"{tuple(input.shape)}")
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps, self.act)

    def extra_repr(self) -> str:
        s = f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"
        return s + (f", act={self.act}" if self.act else "")
