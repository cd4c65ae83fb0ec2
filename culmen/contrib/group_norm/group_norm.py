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

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import init
from torch.nn.parameter import Parameter

from culmen.ops.group_norm.op import group_norm, group_norm_backward, parse_act

__all__ = ["GroupNorm", "cuda_group_norm_nhwc", "cuda_group_norm_nhwc_one_pass", "cuda_group_norm_nhwc_two_pass",
           "cuda_group_norm_v2_nhwc", "get_cc_and_sm_count", "group_norm_nhwc_bprop", "group_norm_nhwc_fprop",
           "torch_group_norm"]


@functools.cache
def get_cc_and_sm_count(device_index: int | None) -> tuple[tuple[int, int], int]:
    """``((major, minor), SM count)`` of CUDA device ``device_index`` (``None``: the current one), cached.

    Apex uses it to decide whether its "v2" kernels may run (:attr:`GroupNorm.GN_V2_SUPPORTED_LOWER_BOUND_SM_COUNT`).
    Without CUDA (or for a CPU tensor's ``device.index`` when no GPU exists) it returns ``((0, 0), 0)``,
    which no kernel table lists, instead of raising.
    """
    if not torch.cuda.is_available():
        return (0, 0), 0
    props = torch.cuda.get_device_properties(device_index)
    return (props.major, props.minor), props.multi_processor_count


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

    Apex's kernel tables are exposed as in Apex (``SUPPORTED_CHANNELS``, ``SUPPORTED_GROUPS``,
    ``SUPPORTED_DTYPES``, the ``GN_V2_*`` sets, ``sm``) with ``_check_legality(x)`` (Apex would run its NHWC
    kernels rather than ``F.group_norm``), ``_check_v2_legality(x)`` (its Blackwell "v2" kernels) and
    ``_select_algo(x)`` (Apex's choice: ``"torch"``, ``"one_pass"``, ``"two_pass"`` or ``"v2"``). They
    describe Apex's behaviour only: culmen runs its own kernel for every input, so the choice changes
    nothing here.
    """

    __constants__ = ["num_groups", "num_channels", "eps", "affine", "act", "SUPPORTED_CHANNELS", "SUPPORTED_GROUPS"]
    num_groups: int
    num_channels: int
    eps: float
    affine: bool
    act: str | None
    SUPPORTED_CHANNELS = frozenset([128, 256, 320, 384, 448, 512, 640, 768, 896, 960, 1024, 1280, 1344, 1536, 1792,
                                    1920, 2048, 2240, 2560, 2688, 3072, 3136, 3584, 4096])
    SUPPORTED_GROUPS = frozenset([16, 32])
    SUPPORTED_DTYPES = frozenset(  # (input dtype, parameter dtype)
        (x, w) for x in (torch.float32, torch.float16, torch.bfloat16)
        for w in (torch.float32, torch.float16, torch.bfloat16))
    GN_V2_SUPPORTED_CHANNELS = frozenset([  # (H * W, C)
        (8 * 8, 1280), (8 * 8, 2560), (16 * 16, 640), (16 * 16, 1280), (16 * 16, 1920), (16 * 16, 2560),
        (32 * 32, 320), (32 * 32, 640), (32 * 32, 960), (32 * 32, 1280), (32 * 32, 1920), (64 * 64, 320),
        (64 * 64, 640), (64 * 64, 960)])
    GN_V2_SUPPORTED_DTYPES = frozenset([(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)])
    GN_V2_SUPPORTED_GROUPS_SWISH = frozenset([(16, True), (32, False)])  # (num_groups, with_swish)
    GN_V2_SUPPORTED_LOWER_BOUND_SM_COUNT = {(10, 0): 148}  # compute capability -> the fewest SMs v2 runs on

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
        # Apex's ``sm`` (compute capability as major*10+minor) of the parameters' CUDA device; 0 without one.
        dev = torch.device(device) if device is not None else None
        if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
            major, minor = torch.cuda.get_device_capability(dev)
            self.sm = major * 10 + minor
        else:
            self.sm = 0

    def reset_parameters(self) -> None:
        if self.affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def _check_legality(self, input: Tensor) -> bool:
        """Whether Apex would run its NHWC kernels on ``input`` (else it falls back to ``F.group_norm``)."""
        return (input.is_contiguous(memory_format=torch.channels_last)
                and input.dtype in (torch.float16, torch.bfloat16, torch.float32)
                and self.affine and (input.dtype, self.weight.dtype) in self.SUPPORTED_DTYPES
                and self.act in (None, "", "silu", "swish")
                and self.num_groups in self.SUPPORTED_GROUPS and self.num_channels in self.SUPPORTED_CHANNELS)

    def _check_v2_legality(self, input: Tensor) -> bool:
        """Whether Apex's "v2" kernels support ``input`` (shape, groups/SiLU, dtypes) on its device's GPU."""
        if input.dim() != 4:
            return False
        cc, sm_count = get_cc_and_sm_count(input.device.index if input.device.type == "cuda" else None)
        return ((input.shape[2] * input.shape[3], self.num_channels) in self.GN_V2_SUPPORTED_CHANNELS
                and (self.num_groups, self.act in ("silu", "swish")) in self.GN_V2_SUPPORTED_GROUPS_SWISH
                and self.affine and (input.dtype, self.weight.dtype) in self.GN_V2_SUPPORTED_DTYPES
                and cc in self.GN_V2_SUPPORTED_LOWER_BOUND_SM_COUNT
                and sm_count >= self.GN_V2_SUPPORTED_LOWER_BOUND_SM_COUNT[cc])

    def _select_algo(self, input: Tensor) -> str:
        """Apex's kernel choice for ``input``: ``"torch"`` (its fallback), ``"v2"``, ``"two_pass"`` or
        ``"one_pass"`` (two passes for large ``H*W``, by its compute-capability heuristic)."""
        if not self._check_legality(input):
            return "torch"
        if self._check_v2_legality(input):
            return "v2"
        hw = 1
        for d in input.shape[2:]:
            hw *= d
        max_hw_one_pass = 1024 if self.sm >= 80 else 256
        if (hw >= 512 and input.shape[1] in (3136, 3584, 4096)) or hw > max_hw_one_pass:
            return "two_pass"
        return "one_pass"

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
