"""Dense / MLP benchmarks: flash_attn's ``FusedMLP``, Apex's ``FusedDenseGeluDense`` and ``MLP``.

GPT-2-medium-like sizes: 8192 tokens, 1024 -> 4096 -> 1024, bf16, fwd and fwd+bwd. Peers on the same
tensors: ``torch`` (eager ``F.linear`` / activation / ``F.linear``, i.e. an ``nn.Sequential``) and
``compile`` (``torch.compile`` of it, CUDA only). TFLOP/s counts the GEMMs (2 per layer forward, 4
backward). For ReLU, ``culmen-lt0`` (informational) is culmen with the bias + ReLU GEMM epilogue
switched off (a separate in-place Triton pass instead), to check ``dense.TUNING["relu_epilogue"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.bench.providers import compile_peer, grad_provider
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark
from culmen.testing import randn

TOKENS, D_IN, D_HID = 8192, 1024, 4096
QUICK = (64, 32, 96)
DTYPE = torch.bfloat16
MODES: tuple[str, ...] = ("fwd", "fwd+bwd")
_ACT = {"gelu_approx": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu, "relu": F.relu,
        "sqrelu": lambda t: torch.square(F.relu(t)), "sigmoid": torch.sigmoid}


def _params(sizes: list[int], dev: torch.device, grad: bool) -> list[tuple[Tensor, Tensor]]:
    out = []
    for k, n in zip(sizes[:-1], sizes[1:]):
        w = (randn((n, k), DTYPE, dev) / k**0.5).requires_grad_(grad)
        b = randn(n, DTYPE, dev, scale=0.1).requires_grad_(grad)
        out.append((w, b))
    return out


def _flops(tokens: int, sizes: list[int], mode: str) -> int:
    fwd = sum(2 * tokens * k * n for k, n in zip(sizes[:-1], sizes[1:]))
    return fwd if mode == "fwd" else 3 * fwd


def _no_epilogue(fn: Callable[[], Any]) -> Callable[[], Any]:
    from culmen.ops.activations import dense

    def run():
        old = dense.TUNING["relu_epilogue"]
        dense.TUNING["relu_epilogue"] = False
        try:
            return fn()
        finally:
            dense.TUNING["relu_epilogue"] = old

    return run


def _mlp_cases(cfg: BenchConfig, act: str, ours: Callable[..., Tensor], n_layers: int = 2,
               act_on_last: bool = False) -> Iterator[Case]:
    dev = cfg.device
    tokens, d_in, d_hid = QUICK if cfg.quick else (TOKENS, D_IN, D_HID)
    sizes = [d_in] + [d_hid] * (n_layers - 1) + [d_in]
    fn_act = _ACT[act]
    for mode in MODES:
        grad = mode == "fwd+bwd"
        x = randn((tokens, d_in), DTYPE, dev, requires_grad=grad)
        params = _params(sizes, dev, grad)
        dy = randn((tokens, d_in), DTYPE, dev) if grad else None
        leaves = {"x": x, **{f"w{i}": w for i, (w, _) in enumerate(params)},
                  **{f"b{i}": b for i, (_, b) in enumerate(params)}}

        def eager(x, *flat):
            h = x
            for i in range(len(flat) // 2):
                h = F.linear(h, flat[2 * i], flat[2 * i + 1])
                if act_on_last or i < len(flat) // 2 - 1:
                    h = fn_act(h)
            return h

        notes: list[str] = []
        flat = [t for wb in params for t in wb]
        fns = {CULMEN: ours, "torch": eager, "compile": compile_peer(eager, dev, notes)}
        providers = {name: grad_provider(lambda f=f, x=x, flat=flat: f(x, *flat), mode, leaves, dy)
                     for name, f in fns.items() if f is not None}
        informational: tuple[str, ...] = ()
        if act == "relu":
            providers["culmen-lt0"] = _no_epilogue(providers[CULMEN])
            informational = ("culmen-lt0",)
        yield Case(f"{tokens}x{'-'.join(map(str, sizes))} {mode}", providers, flops=_flops(tokens, sizes, mode),
                   notes=notes, informational=informational)


@register_benchmark("fused_mlp", "mlp")
def fused_mlp_bench(cfg: BenchConfig) -> Iterator[Case]:
    """flash_attn FusedMLP (tanh GELU, checkpoint_lvl 0), 8192 x 1024-4096-1024 bf16."""
    from culmen.flash_attn.ops.fused_dense import fused_mlp_func

    def ours(x, w1, b1, w2, b2):
        return fused_mlp_func(x, w1, w2, b1, b2, activation="gelu_approx")

    return _mlp_cases(cfg, "gelu_approx", ours)


@register_benchmark("fused_mlp_relu", "mlp")
def fused_mlp_relu_bench(cfg: BenchConfig) -> Iterator[Case]:
    """flash_attn FusedMLP with ReLU (bias + ReLU in the GEMM epilogue), 8192 x 1024-4096-1024 bf16."""
    from culmen.flash_attn.ops.fused_dense import fused_mlp_func

    def ours(x, w1, b1, w2, b2):
        return fused_mlp_func(x, w1, w2, b1, b2, activation="relu")

    return _mlp_cases(cfg, "relu", ours)


@register_benchmark("fused_dense_gelu_dense", "mlp")
def fused_dense_gelu_dense_bench(cfg: BenchConfig) -> Iterator[Case]:
    """Apex FusedDenseGeluDense (exact GELU), 8192 x 1024-4096-1024 bf16."""
    from culmen.fused_dense import fused_dense_gelu_dense_function

    return _mlp_cases(cfg, "gelu", fused_dense_gelu_dense_function)


@register_benchmark("apex_mlp", "mlp")
def apex_mlp_bench(cfg: BenchConfig) -> Iterator[Case]:
    """Apex MLP (ReLU after every layer), 8192 x 1024-4096-1024 bf16."""
    from culmen.mlp import mlp_function

    def ours(x, w1, b1, w2, b2):
        return mlp_function(1, 1, x, w1, w2, b1, b2)

    return _mlp_cases(cfg, "relu", ours, act_on_last=True)
