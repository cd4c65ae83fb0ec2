"""Vision-contrib benchmarks: ``conv_bias_relu`` (Apex's ``ConvBiasReLU``: convolution + bias + ReLU) and
``groupbn`` (Apex's ``BatchNorm2d_NHWC``: batch norm [+ residual add] + ReLU), at ResNet-50 shapes, fp16
channels-last.

Peers on the same tensors: ``torch`` (eager: ``F.relu(F.conv2d(x, w, b))``; ``F.relu(F.batch_norm(x) + z)`` on the
channels-last NCHW view of the NHWC tensor) and ``compile`` (``torch.compile`` of the eager function, CUDA only).
culmen runs the convolution through the same cuDNN call as the peers, so ``conv_bias_relu``'s fwd ratio measures the
epilogue (one Triton pass) against PyTorch's separate bias add and ReLU. fwd+bwd at these batch-32 shapes is
host-bound and routed (``culmen.contrib.conv_bias_relu.ROUTING``) to PyTorch's formulation with an in-place ReLU:
expect about 1.0x there; ``scripts/sweep_conv_epilogue.py`` times the fused autograd function against it.
``groupbn`` bytes count x (and z) read twice (statistics, normalization) and y
written once forward; dy, x (and y) read twice and dx (dz) written backward.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from culmen.bench.providers import compile_peer, grad_provider
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark
from culmen.testing import randn

CL = torch.channels_last
_DT = {torch.float16: "fp16", torch.float32: "fp32"}  # fp32 off CUDA (CPU half convolutions are not a peer)
# (N, C, H, W, K, kernel, stride, pad): ResNet-50's convolutions of each stage at batch 32.
CONV_CASES = [
    (32, 64, 56, 56, 64, 3, 1, 1),
    (32, 256, 56, 56, 64, 1, 1, 0),
    (32, 128, 28, 28, 128, 3, 1, 1),
    (32, 512, 28, 28, 128, 1, 1, 0),
    (32, 256, 14, 14, 256, 3, 1, 1),
    (32, 512, 7, 7, 512, 3, 1, 1),
]
CONV_QUICK = [(2, 8, 6, 5, 8, 3, 1, 1)]
# (N, H, W, C): the bottleneck outputs (the add + ReLU after bn3) of each stage at batch 32.
BN_CASES = [(32, 56, 56, 256), (32, 28, 28, 512), (32, 14, 14, 1024), (32, 7, 7, 2048)]
BN_QUICK = [(2, 3, 4, 8)]


@register_benchmark("conv_bias_relu", "convolution")
def conv_bias_relu_bench(cfg: BenchConfig) -> Iterator[Case]:
    """``ConvBiasReLU`` (cuDNN convolution + Triton epilogue) vs ``F.relu(F.conv2d(x, w, b))``, fp16 channels-last."""
    from culmen.contrib.conv_bias_relu import ConvBiasReLU

    dev = cfg.device
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    for N, C, H, W, K, k, st, pad in (CONV_QUICK if cfg.quick else CONV_CASES):
        for mode in ("fwd", "fwd+bwd"):
            grad = mode == "fwd+bwd"
            x = randn((N, C, H, W), dtype, dev).contiguous(memory_format=CL).requires_grad_(grad)
            w = randn((K, C, k, k), dtype, dev, (2.0 / (C * k * k)) ** 0.5).contiguous(memory_format=CL)
            w.requires_grad_(grad)
            b = randn((1, K, 1, 1), dtype, dev, 0.1).requires_grad_(grad)
            Ho, Wo = (H + 2 * pad - k) // st + 1, (W + 2 * pad - k) // st + 1
            dy = randn((N, K, Ho, Wo), dtype, dev).contiguous(memory_format=CL) if grad else None

            def eager(x, w, b, st=st, pad=pad):
                return F.relu(F.conv2d(x, w, b.reshape(-1), st, pad))

            def ours(x, w, b, st=st, pad=pad):
                return ConvBiasReLU(x, w, b, pad, st)

            notes: list[str] = []
            fns = {CULMEN: ours, "torch": eager, "compile": compile_peer(eager, dev, notes)}
            leaves = {"x": x, "w": w, "b": b}
            providers = {name: grad_provider(lambda f=f, x=x, w=w, b=b: f(x, w, b), mode, leaves, dy)
                         for name, f in fns.items() if f is not None}
            flops = 2 * N * K * Ho * Wo * C * k * k * (3 if grad else 1)
            label = f"{N}x{C}x{H}x{W} k{k}s{st} ->{K} {_DT[dtype]} {mode}"
            yield Case(label, providers, flops=flops, notes=notes)


@register_benchmark("groupbn", "normalization")
def groupbn_bench(cfg: BenchConfig) -> Iterator[Case]:
    """``BatchNorm2d_NHWC`` (+ add) + ReLU vs ``F.relu(F.batch_norm(x) + z)``, training, fp16 NHWC."""
    from culmen.contrib.groupbn import BatchNorm2d_NHWC

    dev = cfg.device
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    for N, H, W, C in (BN_QUICK if cfg.quick else BN_CASES):
        for add in (True, False):
            for mode in ("fwd", "fwd+bwd"):
                grad = mode == "fwd+bwd"
                x = randn((N, H, W, C), dtype, dev).requires_grad_(grad)
                z = randn((N, H, W, C), dtype, dev).requires_grad_(grad) if add else None
                bn = BatchNorm2d_NHWC(C, fuse_relu=True).to(dev)
                ref = torch.nn.BatchNorm2d(C).to(dev)
                dy = randn((N, H, W, C), dtype, dev) if grad else None

                def eager(x, z, ref=ref):
                    y = ref(x.permute(0, 3, 1, 2))  # the NCHW view of NHWC memory: channels-last
                    if z is not None:
                        y = y + z.permute(0, 3, 1, 2)
                    return F.relu(y).permute(0, 2, 3, 1)

                def ours(x, z, bn=bn):
                    return bn(x, z)

                notes: list[str] = []
                fns = {CULMEN: ours, "torch": eager, "compile": compile_peer(eager, dev, notes)}
                leaves = {"x": x, **({"z": z} if add else {})}
                providers = {name: grad_provider(lambda f=f, x=x, z=z: f(x, z), mode, leaves, dy)
                             for name, f in fns.items() if f is not None}
                n = x.numel() * x.element_size()
                fwd = n * (3 + (1 if add else 0))
                bwd = n * (5 + (1 if add else 0))
                label = f"{N}x{H}x{W}x{C} {'add+relu' if add else 'relu'} {_DT[dtype]} {mode}"
                yield Case(label, providers, bytes=fwd + (bwd if grad else 0), notes=notes)
