"""Contrib-op benchmarks: ``group_norm`` (GroupNorm + SiLU), ``focal_loss`` and ``index_mul_2d``.

Peers, all on the same tensors: ``torch`` (eager: ``F.group_norm`` [+ ``F.silu``], the textbook focal
loss with an fp32 upcast, ``in1[idx] * in2``), ``compile`` (``torch.compile`` of the eager function, CUDA
only) and ``liger`` (Liger-Kernel's GroupNorm [+ eager SiLU], NCHW only, when it imports). Bytes count
the fewest a kernel must move: every input read once and every output written once (statistics
and the per-channel parameters are negligible and not counted).

GroupNorm shapes are Stable Diffusion's UNet/VAE activations with 32 groups, in NCHW and
channels-last (``nhwc``); the issue's goal is at least 85% of the copy roofline and 1.2x the best peer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.bench.providers import compile_peer, grad_provider
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark
from culmen.testing import randn

_DT_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

GN_GROUPS = 32
GN_EPS = 1e-5
# (shape, layout, dtype, silu, mode)
GN_CASES: list[tuple[tuple[int, int, int, int], str, torch.dtype, bool, str]] = [
    *[(shape, layout, torch.bfloat16, silu, "fwd+bwd")
      for shape in ((8, 512, 64, 64), (8, 1280, 32, 32), (16, 320, 128, 128))
      for layout in ("nchw", "nhwc") for silu in (False, True)],
    *[((8, 512, 64, 64), layout, torch.float16, True, "fwd+bwd") for layout in ("nchw", "nhwc")],
    *[((8, 512, 64, 64), layout, torch.bfloat16, True, "fwd") for layout in ("nchw", "nhwc")],
    # A small batch: the split schedule (few groups per multiprocessor).
    ((1, 640, 64, 64), "nhwc", torch.bfloat16, True, "fwd+bwd"),
]
GN_QUICK_CASES = [((2, 64, 8, 8), layout, torch.bfloat16, True, mode)
                  for layout in ("nchw", "nhwc") for mode in ("fwd", "fwd+bwd")]


def _liger_group_norm(device: torch.device, notes: list[str]) -> Callable[..., Tensor] | None:
    if device.type != "cuda":
        return None
    try:
        from liger_kernel.ops.group_norm import LigerGroupNormFunction
    except ImportError:
        return None
    except Exception as exc:
        notes.append(f"liger: skipped ({type(exc).__name__}: {exc})")
        return None
    return lambda x, w, b: LigerGroupNormFunction.apply(x, w, b, x.shape[1], GN_GROUPS, GN_EPS)


@register_benchmark("group_norm", "normalization")
def group_norm_bench(cfg: BenchConfig) -> Iterator[Case]:
    """GroupNorm(32) [+ SiLU] on Stable-Diffusion shapes, NCHW and channels-last, fwd and fwd+bwd."""
    from culmen.ops.group_norm import group_norm

    dev = cfg.device
    for shape, layout, dtype, silu, mode in (GN_QUICK_CASES if cfg.quick else GN_CASES):
        grad = mode == "fwd+bwd"
        C = shape[1]
        x = randn(shape, dtype, dev)
        if layout == "nhwc":
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_(grad)
        w = (1.0 + 0.1 * randn(C, torch.float32, dev)).to(dtype).requires_grad_(grad)
        b = randn(C, dtype, dev, 0.1).requires_grad_(grad)
        dy = None
        if grad:
            dy = randn(shape, dtype, dev)
            if layout == "nhwc":  # the gradient arriving from the next channels-last layer
                dy = dy.contiguous(memory_format=torch.channels_last)

        def eager(x, w, b, silu=silu):
            y = F.group_norm(x, GN_GROUPS, w, b, GN_EPS)
            return F.silu(y) if silu else y

        def ours(x, w, b, silu=silu):
            return group_norm(x, GN_GROUPS, w, b, GN_EPS, "silu" if silu else "")

        notes: list[str] = []
        liger = _liger_group_norm(dev, notes) if layout == "nchw" else None
        if layout == "nhwc" and dev.type == "cuda":
            notes.append("liger: not timed on channels-last (its GroupNorm views the input as NCHW)")
        fns: dict[str, Callable[..., Tensor] | None] = {
            CULMEN: ours,
            "torch": eager,
            "compile": compile_peer(eager, dev, notes),
            "liger": (lambda x, w, b, f=liger, silu=silu: F.silu(f(x, w, b)) if silu else f(x, w, b))
            if liger is not None else None,
        }
        leaves = {"x": x, "w": w, "b": b}
        providers = {name: grad_provider(lambda f=f, x=x, w=w, b=b: f(x, w, b), mode, leaves, dy)
                     for name, f in fns.items() if f is not None}
        nbytes = x.numel() * x.element_size() * (2 if mode == "fwd" else 5)
        label = f"{'x'.join(map(str, shape))} {layout} {_DT_NAME[dtype]}{' silu' if silu else ''} {mode}"
        yield Case(label, providers, bytes=nbytes, notes=notes)


# ---------------------------------------------------------------------------------------------- focal loss

FL_ALPHA, FL_GAMMA = 0.25, 2.0


def _focal_eager(num_real: int):
    """The textbook focal loss (torchvision's ``sigmoid_focal_loss`` with Apex's ignore/padding masks), fp32."""
    def fn(x: Tensor, labels: Tensor, nps: Tensor) -> Tensor:
        xf = x.float()
        cls = torch.arange(x.shape[-1], device=x.device)
        pos = labels[:, None] == cls
        valid = (labels[:, None] != -2) & (cls < num_real)
        p = torch.sigmoid(xf)
        ce = F.binary_cross_entropy_with_logits(xf, pos.float(), reduction="none")
        p_t = torch.where(pos, p, 1.0 - p)
        alpha = torch.where(pos, FL_ALPHA, 1.0 - FL_ALPHA)
        loss = alpha * ce * (1.0 - p_t) ** FL_GAMMA
        return torch.where(valid, loss, 0.0).sum() / nps.reshape(())
    return fn


@register_benchmark("focal_loss", "loss")
def focal_loss_bench(cfg: BenchConfig) -> Iterator[Case]:
    """RetinaNet sigmoid focal loss over all anchors of 4 images (264 real classes padded to 272)."""
    from culmen.ops.focal_loss import focal_loss

    dev = cfg.device
    R, C, num_real = (1000, 24, 20) if cfg.quick else (4 * 120087, 272, 264)
    for dtype in (torch.float16, torch.bfloat16):
        for mode in ("fwd", "fwd+bwd"):
            grad = mode == "fwd+bwd"
            x = randn((R, C), dtype, dev, 2.0).requires_grad_(grad)
            u = torch.rand(R, device=dev)
            labels = torch.randint(0, num_real, (R,), device=dev)
            labels = torch.where(u < 0.98, -1, labels)  # ~2% positive anchors
            labels = torch.where(u < 0.05, -2, labels)  # ~5% ignored
            nps = (labels >= 0).sum().float().clamp(min=1.0).reshape(1)
            dy = torch.ones((), device=dev) if grad else None
            eager = _focal_eager(num_real)

            def ours(x, labels, nps, num_real=num_real):
                return focal_loss(x, labels, nps, num_real, FL_ALPHA, FL_GAMMA)

            notes: list[str] = ["liger: no focal loss"]
            fns = {CULMEN: ours, "torch": eager, "compile": compile_peer(eager, dev, notes)}
            providers = {name: grad_provider(lambda f=f, x=x, lab=labels, n=nps: f(x, lab, n), mode, {"x": x}, dy)
                         for name, f in fns.items() if f is not None}
            es = x.element_size()
            nbytes = R * C * es + R * 8 + (2 * R * C * es + R * 8 if grad else 0)
            yield Case(f"{R}x{C} {_DT_NAME[dtype]} {mode}", providers, bytes=nbytes, notes=notes)


# -------------------------------------------------------------------------------------------- index_mul_2d

@register_benchmark("index_mul_2d", "indexing")
def index_mul_2d_bench(cfg: BenchConfig) -> Iterator[Case]:
    """``in1[idx] * in2`` with in1 ``(M, F)``, in2 ``(N, F)``, N = 4 M random indices, fwd and fwd+bwd."""
    from culmen.ops.index_mul_2d import index_mul_2d

    dev = cfg.device
    shapes = [(250, 1000, 64)] if cfg.quick else [(262144, 1048576, 64), (262144, 1048576, 128)]
    for M, N, Fd in shapes:
        for dtype in (torch.float32, torch.float16):
            for mode in ("fwd", "fwd+bwd"):
                grad = mode == "fwd+bwd"
                in1 = randn((M, Fd), dtype, dev).requires_grad_(grad)
                in2 = randn((N, Fd), dtype, dev).requires_grad_(grad)
                idx = torch.randint(0, M, (N,), device=dev)
                dy = randn((N, Fd), dtype, dev) if grad else None

                def eager(a, b, i):
                    return a[i] * b

                notes: list[str] = ["liger: no index_mul_2d"]
                fns = {CULMEN: index_mul_2d, "torch": eager, "compile": compile_peer(eager, dev, notes)}
                providers = {name: grad_provider(lambda f=f, a=in1, b=in2, i=idx: f(a, b, i), mode,
                                             {"in1": in1, "in2": in2}, dy)
                             for name, f in fns.items() if f is not None}
                es = in1.element_size()
                fwd = (M * Fd + 2 * N * Fd) * es + N * 8  # read in1 (once) and in2, write out; the indices
                bwd = (2 * M * Fd + 4 * N * Fd) * es + N * 8  # read dy, in1, in2; write din1, din2
                yield Case(f"{M}x{N}x{Fd} {_DT_NAME[dtype]} {mode}", providers, bytes=fwd + (bwd if grad else 0),
                           notes=notes)
