"""Activation benchmarks: ``bias_gelu`` (tanh and erf), ``relu``, ``sqrelu``, ``swiglu``, ``geglu``.

Each op is timed forward and forward+backward on the same tensors by culmen and its peers: ``torch``
(eager), ``compile`` (``torch.compile`` of the eager function, CUDA only) and ``liger`` (Liger-Kernel's
SwiGLU / GeGLU, when it imports). Bytes count the fewest a kernel must move (each input read once,
each output written once; the bias vector and its gradient are counted too), so GB/s compares with the
copy roofline the runner measures. Liger's SwiGLU/GeGLU backward writes its gradients into its inputs,
so Liger gets its own copies of the (same-valued) inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.bench.providers import compile_peer, grad_provider
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark
from culmen.testing import randn

SHAPES: list[tuple[int, int]] = [(8192, 16384), (16384, 4096)]
QUICK_SHAPES: list[tuple[int, int]] = [(64, 256), (33, 1000)]
DTYPE = torch.bfloat16
MODES: tuple[str, ...] = ("fwd", "fwd+bwd")
_DT_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _leaf(t: Tensor, grad: bool) -> Tensor:
    return t.detach().clone().requires_grad_(grad)


def _liger(kind: str, device: torch.device, notes: list[str]) -> Callable[..., Tensor] | None:
    if device.type != "cuda" or kind not in ("swiglu", "geglu"):
        return None
    try:
        if kind == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as Fn
        else:
            from liger_kernel.ops.geglu import LigerGELUMulFunction as Fn
    except ImportError:
        notes.append("liger: not installed")
        return None
    except Exception as exc:
        notes.append(f"liger: skipped ({type(exc).__name__}: {exc})")
        return None
    return Fn.apply


def _unary_cases(cfg: BenchConfig, kind: str, act: str, eager: Callable[..., Tensor], bias: bool
                 ) -> Iterator[Case]:
    from culmen.ops.activations import bias_act

    dev = cfg.device
    for M, N in (QUICK_SHAPES if cfg.quick else SHAPES):
        for mode in MODES:
            grad = mode == "fwd+bwd"
            x = randn((M, N), DTYPE, dev, scale=2.0, requires_grad=grad)
            b = randn(N, DTYPE, dev, scale=0.5, requires_grad=grad) if bias else None
            dy = randn((M, N), DTYPE, dev) if grad else None
            leaves = {"x": x, **({"b": b} if bias else {})}
            notes: list[str] = []
            fns = {CULMEN: lambda x, b: bias_act(x, b, act), "torch": eager, "compile": compile_peer(eager, dev, notes)}
            providers = {name: grad_provider(lambda f=f, x=x, b=b: f(x, b), mode, leaves, dy)
                         for name, f in fns.items() if f is not None}
            es = x.element_size()
            fwd = 2 * M * N * es + (N * es if bias else 0)  # read x (+ b), write y
            bwd = 3 * M * N * es + (2 * N * es if bias else 0)  # read dy, x (+ b), write dx (+ db)
            yield Case(f"{M}x{N} {_DT_NAME[DTYPE]} {mode}", providers, bytes=fwd if mode == "fwd" else fwd + bwd,
                       notes=notes)


def _gated_cases(cfg: BenchConfig, kind: str, act: str, eager: Callable[..., Tensor]) -> Iterator[Case]:
    from culmen.ops.activations import gated_act

    dev = cfg.device
    for M, N in (QUICK_SHAPES if cfg.quick else SHAPES):
        for mode in MODES:
            grad = mode == "fwd+bwd"
            x = randn((M, N), DTYPE, dev, scale=2.0, requires_grad=grad)
            u = randn((M, N), DTYPE, dev, requires_grad=grad)
            dy = randn((M, N), DTYPE, dev) if grad else None
            notes: list[str] = []
            fns = {CULMEN: lambda x, u: gated_act(x, u, act), "torch": eager,
                   "compile": compile_peer(eager, dev, notes)}
            providers = {name: grad_provider(lambda f=f, x=x, u=u: f(x, u), mode, {"x": x, "u": u}, dy)
                         for name, f in fns.items() if f is not None}
            liger = _liger(kind, dev, notes)
            if liger is not None:
                lx, lu = _leaf(x, grad), _leaf(u, grad)  # Liger's backward overwrites its inputs
                providers["liger"] = grad_provider(lambda lx=lx, lu=lu, f=liger: f(lx, lu), mode,
                                                   {"x": lx, "u": lu}, dy)
            es = x.element_size()
            fwd = 3 * M * N * es  # read x, u; write y
            bwd = 5 * M * N * es  # read dy, x, u; write dx, du
            yield Case(f"{M}x{N} {_DT_NAME[DTYPE]} {mode}", providers, bytes=fwd if mode == "fwd" else fwd + bwd,
                       notes=notes)


@register_benchmark("bias_gelu", "activations")
def bias_gelu_bench(cfg: BenchConfig) -> Iterator[Case]:
    """tanh-approximate GELU of x + bias (flash_attn's bias_gelu), fwd and fwd+bwd with the bias grad."""
    return _unary_cases(cfg, "bias_gelu", "gelu_tanh",
                        lambda x, b: F.gelu(x + b, approximate="tanh"), bias=True)


@register_benchmark("bias_gelu_erf", "activations")
def bias_gelu_erf_bench(cfg: BenchConfig) -> Iterator[Case]:
    """Exact (erf) GELU of x + bias, fwd and fwd+bwd with the bias grad."""
    return _unary_cases(cfg, "bias_gelu_erf", "gelu", lambda x, b: F.gelu(x + b), bias=True)


@register_benchmark("relu", "activations")
def relu_bench(cfg: BenchConfig) -> Iterator[Case]:
    """ReLU (no bias), fwd and fwd+bwd."""
    return _unary_cases(cfg, "relu", "relu", lambda x, b: F.relu(x), bias=False)


@register_benchmark("sqrelu", "activations")
def sqrelu_bench(cfg: BenchConfig) -> Iterator[Case]:
    """Squared ReLU (no bias), fwd and fwd+bwd."""
    return _unary_cases(cfg, "sqrelu", "sqrelu", lambda x, b: torch.square(F.relu(x)), bias=False)


@register_benchmark("swiglu", "activations")
def swiglu_bench(cfg: BenchConfig) -> Iterator[Case]:
    """silu(x) * u, fwd and fwd+bwd (Liger's LigerSiLUMulFunction when installed)."""
    return _gated_cases(cfg, "swiglu", "silu", lambda x, u: F.silu(x) * u)


@register_benchmark("geglu", "activations")
def geglu_bench(cfg: BenchConfig) -> Iterator[Case]:
    """tanh-GELU(x) * u, fwd and fwd+bwd (Liger's LigerGELUMulFunction when installed)."""
    return _gated_cases(cfg, "geglu", "gelu_tanh", lambda x, u: F.gelu(x, approximate="tanh") * u)
