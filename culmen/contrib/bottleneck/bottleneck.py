"""Apex's ``apex.contrib.bottleneck``: the ResNet-50 v1.5-style bottleneck block with frozen batch norms
(stride on the first 1x1 convolution), fused, and its spatially parallel variant.

``Bottleneck(in_channels, bottleneck_channels, out_channels, stride=1, groups=1, dilation=1, norm_func=None,
use_cudnn=False, explicit_nhwc=False)``: ``relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + identity)``,
``identity`` being ``x`` or ``bn4(conv4(x))`` (a strided 1x1 downsample, when ``stride != 1`` or the channel
counts differ). The batch norms are ``FrozenBatchNorm2d`` (buffers ``weight``, ``bias``, ``running_mean``,
``running_var``; scale ``weight / sqrt(running_var)`` with no eps, as in Apex). ``use_cudnn=True`` runs the fused
path; otherwise plain modules. ``explicit_nhwc=True``: ``x`` and the output are ``(N, H, W, C)`` and the
convolution weights are stored ``(K, R, S, C)`` (fused path only, as in Apex).

``SpatialBottleneck(..., spatial_parallel_args=None)``: the same block on a slice of the image split along H
across ``spatial_group_size`` ranks; ``spatial_parallel_args = (spatial_group_size, spatial_group_rank,
spatial_communicator, spatial_halo_exchanger, spatial_method[, use_delay_kernel])``. The 3x3 convolution sees
one row of each neighbour (exchanged by the halo exchanger; its gradient goes back the same way), so the
slices of the output and of ``x``'s gradient equal those of the unsplit block, and the weights' gradients are
this rank's share (a data-parallel all-reduce adds them up).

Differences from Apex's cuDNN-frontend version: each convolution runs through PyTorch (cuDNN) and each
epilogue (frozen-BN scale and bias, the residual or the downsample branch, ReLU) in one Triton pass
(``culmen.ops.conv_epilogue``); ``spatial_method`` 1, 2 and 3 (Apex's ways of overlapping the halo transfer)
all compute the padded convolution after the exchange, and ``use_delay_kernel`` is ignored; the plain
(``use_cudnn=False``) ``SpatialBottleneck`` exchanges halos too (Apex's ignores its neighbours there); any
device and float dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from culmen.contrib.bottleneck.halo_exchangers import halo_pad
from culmen.contrib.conv_bias_relu.conv_bias_relu import fused_conv_epilogue

__all__ = ["Bottleneck", "BottleneckFunction", "FrozenBatchNorm2d", "SpatialBottleneck", "SpatialBottleneckFunction",
           "bottleneck_function", "conv1x1", "conv3x3", "drelu_dscale1", "drelu_dscale2", "kaiming_uniform_",
           "spatial_bottleneck_function"]


def kaiming_uniform_(tensor: Tensor, a: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Tensor:
    """``nn.init.kaiming_uniform_`` (Apex's initializer of the convolution weights, with ``a=1``)."""
    return nn.init.kaiming_uniform_(tensor, a=a, mode=mode, nonlinearity=nonlinearity)


def compute_scale_bias_one(nhwc: bool, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor,
                           w_scale: Tensor, w_bias: Tensor) -> None:
    """Write a frozen batch norm's ``scale = weight / sqrt(running_var)`` and ``bias - running_mean * scale``."""
    scale = weight * running_var.rsqrt()
    w_scale.copy_(scale)
    w_bias.copy_(bias - running_mean * scale)


def compute_scale_bias_method(nhwc: bool, args) -> None:
    """``compute_scale_bias_one`` for every ``(weight, bias, running_mean, running_var, w_scale, w_bias)``."""
    for arg in args:
        compute_scale_bias_one(nhwc, *arg)


class FrozenBatchNorm2d(nn.Module):
    """Batch norm with fixed statistics and affine factors (buffers, no parameters): ``x * scale + bias`` with
    ``scale = weight / sqrt(running_var)`` (no eps) and ``bias = bias - running_mean * scale``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(n))
        self.register_buffer("bias", torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def get_scale_bias(self, nhwc: bool) -> list[Tensor]:
        """``[scale, bias]`` shaped ``(1, 1, 1, C)`` (``nhwc``) or ``(1, C, 1, 1)``."""
        scale = self.weight * self.running_var.rsqrt()
        bias = self.bias - self.running_mean * scale
        shape = (1, 1, 1, -1) if nhwc else (1, -1, 1, 1)
        return [scale.reshape(shape), bias.reshape(shape)]

    def forward(self, x: Tensor) -> Tensor:
        scale, bias = self.get_scale_bias(False)
        return x * scale + bias


def conv3x3(in_planes: int, out_planes: int, stride: int = 1, groups: int = 1, dilation: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding ``dilation``, no bias."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=dilation, groups=groups,
                     bias=False, dilation=dilation)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution, no bias."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


def _flat(v: Tensor) -> Tensor:
    return v.reshape(-1)


def _fused_block(x: Tensor, convs, scales, biases, stride: int, explicit_nhwc: bool, exchanger=None) -> Tensor:
    """The fused block on ``x`` (NCHW-shaped, or ``(N, H, W, C)`` with ``explicit_nhwc``); ``convs`` 3 or 4 weights
    (``(K, C, R, S)``, or ``(K, R, S, C)`` with ``explicit_nhwc``), ``scales`` / ``biases`` one per batch norm."""
    if explicit_nhwc:
        if x.dim() != 4:
            raise ValueError(f"x must be 4-D (N, H, W, C), got shape {tuple(x.shape)}")
        # (N, H, W, C) contiguous viewed as NCHW is channels-last memory: no copy.
        x = x.permute(0, 3, 1, 2)
        convs = [w.permute(0, 3, 1, 2) for w in convs]
    elif x.dim() != 4:
        raise ValueError(f"x must be 4-D (N, C, H, W), got shape {tuple(x.shape)}")
    s = [_flat(v) for v in scales]
    b = [_flat(v) for v in biases]
    out = fused_conv_epilogue(x, convs[0], s[0], b[0], 0, stride, True)
    pad2 = 1
    if exchanger is not None:
        out = halo_pad(out, exchanger)
        pad2 = (0, 1)
    out = fused_conv_epilogue(out, convs[1], s[1], b[1], pad2, 1, True)
    if len(convs) > 3:
        out = fused_conv_epilogue(out, convs[2], s[2], b[2] + b[3], 0, 1, True, res=x, res_weight=convs[3],
                                  res_scale=s[3], res_stride=stride)
    else:
        out = fused_conv_epilogue(out, convs[2], s[2], b[2], 0, 1, True, res=x)
    return out.permute(0, 2, 3, 1) if explicit_nhwc else out


def bottleneck_function(nhwc: bool, stride_1x1: int, scale, bias, x: Tensor, *conv: Tensor) -> Tensor:
    """Apex's functional form: the fused block with per-batch-norm ``scale`` / ``bias`` lists (3, or 4 with the
    downsample weight as ``conv[3]``)."""
    return _fused_block(x, conv, scale, bias, stride_1x1, nhwc)


def spatial_bottleneck_function(spatial_group_size, spatial_group_rank, spatial_communicator, spatial_halo_exchanger,
                                spatial_method, use_delay_kernel, explicit_nhwc, stride_1x1, scale, bias, thresholdTop,
                                thresholdBottom, x, *conv) -> Tensor:
    """Apex's functional form of the spatially parallel block (``thresholdTop`` / ``thresholdBottom`` and
    ``use_delay_kernel`` are accepted and not needed)."""
    ex = spatial_halo_exchanger if spatial_group_size > 1 else None
    return _fused_block(x, conv, scale, bias, stride_1x1, explicit_nhwc, ex)


class Bottleneck(nn.Module):
    """See the module docstring. ``forward(x)``: ``(N, in_channels, H, W)`` (channels-last for speed) or
    ``(N, H, W, in_channels)`` with ``explicit_nhwc``; returns ``out_channels`` channels at ``H / stride``."""

    def __init__(self, in_channels: int, bottleneck_channels: int, out_channels: int, stride: int = 1,
                 groups: int = 1, dilation: int = 1, norm_func=None, use_cudnn: bool = False,
                 explicit_nhwc: bool = False) -> None:
        super().__init__()
        if groups != 1:
            raise RuntimeError("Only support groups == 1")
        if dilation != 1:
            raise RuntimeError("Only support dilation == 1")
        if norm_func is not None:
            raise RuntimeError("Only support frozen BN now.")
        for name, v in (("in_channels", in_channels), ("bottleneck_channels", bottleneck_channels),
                        ("out_channels", out_channels), ("stride", stride)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        norm_func = FrozenBatchNorm2d
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(conv1x1(in_channels, out_channels, stride), norm_func(out_channels))
        self.conv1 = conv1x1(in_channels, bottleneck_channels, stride)
        self.conv2 = conv3x3(bottleneck_channels, bottleneck_channels)
        self.conv3 = conv1x1(bottleneck_channels, out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.stride = stride
        self.bn1 = norm_func(bottleneck_channels)
        self.bn2 = norm_func(bottleneck_channels)
        self.bn3 = norm_func(out_channels)
        self.w_scale = None
        self.w_bias = None
        self.use_cudnn = use_cudnn
        for w in self._convs():
            kaiming_uniform_(w, a=1)
        self.explicit_nhwc = explicit_nhwc
        if explicit_nhwc:
            for p in self.parameters():
                with torch.no_grad():
                    p.data = p.data.permute(0, 2, 3, 1).contiguous()

    @property
    def w_conv(self) -> list[Tensor]:
        """The convolution weights in Apex's order: conv1, conv2, conv3 (and the downsample's)."""
        return self._convs()

    def _convs(self) -> list[Tensor]:
        ws = [self.conv1.weight, self.conv2.weight, self.conv3.weight]
        if self.downsample is not None:
            ws.append(self.downsample[0].weight)
        return ws

    def _norms(self) -> list[FrozenBatchNorm2d]:
        bns = [self.bn1, self.bn2, self.bn3]
        if self.downsample is not None:
            bns.append(self.downsample[1])
        return bns

    def get_scale_bias_callable(self):
        """Precompute the frozen batch norms' scales and biases into fixed tensors used by every later forward
        (CUDA-graph friendly); returns the callable that recomputes them (call it after changing the norms)."""
        self.w_scale, self.w_bias, args = [], [], []
        shape = (1, 1, 1, -1) if self.explicit_nhwc else (1, -1, 1, 1)
        for bn in self._norms():
            s = torch.empty_like(bn.weight)
            b = torch.empty_like(s)
            args.append((bn.weight, bn.bias, bn.running_mean, bn.running_var, s, b))
            self.w_scale.append(s.reshape(shape))
            self.w_bias.append(b.reshape(shape))
        fn = functools.partial(compute_scale_bias_method, self.explicit_nhwc, args)
        fn()
        return fn

    def _scale_bias(self):
        if self.w_scale is not None:
            return self.w_scale, self.w_bias
        sb = [bn.get_scale_bias(self.explicit_nhwc) for bn in self._norms()]
        return [s for s, _ in sb], [b for _, b in sb]

    def _native(self, x: Tensor, exchanger=None) -> Tensor:
        if self.explicit_nhwc:
            raise RuntimeError("explicit nhwc with native ops is not supported.")
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        if exchanger is not None:
            out = F.conv2d(halo_pad(out, exchanger), self.conv2.weight, None, 1, (0, 1))
        else:
            out = self.conv2(out)
        out = self.relu(self.bn2(out))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        return self.relu(out)

    def forward(self, x: Tensor) -> Tensor:
        if self.use_cudnn:
            scales, biases = self._scale_bias()
            return _fused_block(x, self._convs(), scales, biases, self.stride, self.explicit_nhwc)
        return self._native(x)


class SpatialBottleneck(Bottleneck):
    """See the module docstring. ``x`` is this rank's slice of the image along H (every rank's slice the same
    height, a multiple of ``stride``); returns this rank's slice of the output."""

    def __init__(self, in_channels: int, bottleneck_channels: int, out_channels: int, stride: int = 1,
                 groups: int = 1, dilation: int = 1, norm_func=None, use_cudnn: bool = False,
                 explicit_nhwc: bool = False, spatial_parallel_args=None) -> None:
        super().__init__(in_channels, bottleneck_channels, out_channels, stride, groups, dilation, norm_func,
                         use_cudnn, explicit_nhwc)
        self.thresholdTop, self.thresholdBottom = None, None
        if spatial_parallel_args is None:
            spatial_parallel_args = (1, 0, None, None, 0, False)
        args = tuple(spatial_parallel_args)
        if len(args) not in (5, 6):
            raise ValueError("spatial_parallel_args must be (spatial_group_size, spatial_group_rank, "
                             "spatial_communicator, spatial_halo_exchanger, spatial_method[, use_delay_kernel]), "
                             f"got {len(args)} items")
        size, rank, _, exchanger, method = args[:5]
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"spatial_group_size must be a positive int, got {size!r}")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"spatial_group_rank must be in [0, {size}), got {rank!r}")
        if size > 1:
            if not hasattr(exchanger, "left_right_halo_exchange"):
                raise ValueError(f"spatial_halo_exchanger must be a halo exchanger, got {type(exchanger).__name__}")
            if method not in (1, 2, 3):
                raise ValueError(f"spatial_method must be 1, 2 or 3, got {method!r}")
        self.spatial_parallel_args = args if len(args) == 6 else (*args, False)
        self._exchanger = exchanger if size > 1 else None

    def forward(self, x: Tensor) -> Tensor:
        if self.use_cudnn:
            scales, biases = self._scale_bias()
            return _fused_block(x, self._convs(), scales, biases, self.stride, self.explicit_nhwc, self._exchanger)
        return self._native(x, self._exchanger)


def drelu_dscale1(grad_o: Tensor, output: Tensor, scale1: Tensor) -> tuple[Tensor, Tensor]:
    """Backward of ``relu`` then of a per-channel scale: ``(g * scale1, g)`` with ``g = grad_o * (output > 0)``.
    ``scale1`` broadcasts against ``grad_o`` (e.g. ``(1, C, 1, 1)``); results in the promoted dtype."""
    dx_relu = grad_o * (output > 0)
    return dx_relu * scale1, dx_relu


def drelu_dscale2(grad_o: Tensor, output: Tensor, scale1: Tensor, scale2: Tensor) -> tuple[Tensor, Tensor]:
    """``drelu_dscale1`` for a ReLU feeding two scaled branches (main and downsample): ``(g * scale1,
    g * scale2)``."""
    dx_relu = grad_o * (output > 0)
    return dx_relu * scale1, dx_relu * scale2


class BottleneckFunction:
    """Apex's autograd function of the fused block; ``apply`` is ``bottleneck_function`` (culmen's fused path
    records its own autograd graph: convolutions through PyTorch, epilogues through culmen's op)."""

    apply = staticmethod(bottleneck_function)


class SpatialBottleneckFunction:
    """Apex's autograd function of the spatially parallel block; ``apply`` is ``spatial_bottleneck_function``."""

    apply = staticmethod(spatial_bottleneck_function)
