"""Masked-softmax benchmarks: ``softmax_padding``, ``softmax_causal``, ``softmax_long`` (Megatron's
``FusedScaleMaskSoftmax`` workloads) and ``softmax_plain`` (no mask, scale 1).

Peers on the same tensors: ``torch`` (Megatron's unfused path: upcast to fp32, scale,
``masked_fill(mask, -10000)``, softmax, cast back; plain ``torch.softmax`` without a mask) and
``compile`` (``torch.compile`` of it, CUDA only). Liger-Kernel has no scaled masked softmax; its
plain ``LigerSoftmaxFunction`` is a peer of ``softmax_plain`` when it imports.

Bytes count the fewest a kernel must move: the scores read once (for causal only the lower
triangle, which is all that matters), the mask once at its own (broadcast) size, the probabilities
written once; backward reads y and dy (lower triangle for causal) and writes dx.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from culmen.bench.providers import compile_peer
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark
from culmen.testing import randn

DTYPE = torch.bfloat16
MODES: tuple[str, ...] = ("fwd", "fwd+bwd")
SCALE = 0.125
_DT_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _provider(fn: Callable[[Tensor], Tensor], x: Tensor, mode: str, dy: Tensor | None) -> Callable[[], Any]:
    if mode == "fwd":
        def run_fwd():
            with torch.no_grad():
                return fn(x)
        return run_fwd

    def run_fwd_bwd():
        x.grad = None
        y = fn(x)
        y.backward(dy)
        return {"y": y.detach(), "dx": x.grad}

    return run_fwd_bwd


def _megatron_eager(x: Tensor, mask: Tensor) -> Tensor:
    """Megatron's ``forward_torch_softmax`` with its ``attention_mask_func``."""
    probs = torch.softmax((x.float() * SCALE).masked_fill(mask, -10000.0), dim=-1)
    return probs.to(x.dtype)


def _liger_softmax(device: torch.device, notes: list[str]) -> Callable[[Tensor], Tensor] | None:
    if device.type != "cuda":
        return None
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except ImportError:
        notes.append("liger: not installed (or too old for LigerSoftmaxFunction)")
        return None
    except Exception as exc:
        notes.append(f"liger: skipped ({type(exc).__name__}: {exc})")
        return None
    return LigerSoftmaxFunction.apply


@register_benchmark("softmax_plain", "softmax")
def softmax_plain_bench(cfg: BenchConfig) -> Iterator[Case]:
    """Softmax without mask or scale (Apex's ScaledSoftmax at scale 1), sk = 2048, fwd and fwd+bwd."""
    from culmen.transformer.functional.fused_softmax import scaled_masked_softmax

    dev = cfg.device
    B, NP, SQ, SK = (2, 4, 32, 100) if cfg.quick else (4, 16, 2048, 2048)
    for mode in MODES:
        grad = mode == "fwd+bwd"
        x = randn((B, NP, SQ, SK), DTYPE, dev, scale=4.0, requires_grad=grad)
        dy = randn(x.shape, DTYPE, dev) if grad else None

        def eager(x):
            return torch.softmax(x, dim=-1)

        notes: list[str] = []
        fns = {CULMEN: lambda x: scaled_masked_softmax(x, None, 1.0), "torch": eager,
               "compile": compile_peer(eager, dev, notes), "liger": _liger_softmax(dev, notes)}
        providers = {n: _provider(f, x, mode, dy) for n, f in fns.items() if f is not None}
        io = 2 * x.numel() * x.element_size()
        yield Case(f"{B}x{NP}x{SQ}x{SK} plain {_DT_NAME[DTYPE]} {mode}", providers,
                   bytes=io if not grad else io + 3 * x.numel() * x.element_size(), notes=notes)


def _cases(cfg: BenchConfig, shapes: list[tuple[int, int, int, int]], causal: bool, key_padding: bool
           ) -> Iterator[Case]:
    from culmen.transformer.functional.fused_softmax import scaled_masked_softmax, scaled_upper_triang_masked_softmax

    dev = cfg.device
    for B, NP, SQ, SK in shapes:
        if causal:
            mask = torch.ones(SQ, SK, dtype=torch.bool, device=dev).triu(1)[None, None]
        elif key_padding:  # (B, 1, 1, SK): a quarter of each row's keys are padding
            lens = torch.randint(SK // 2, SK + 1, (B,), device=dev)
            mask = (torch.arange(SK, device=dev)[None] >= lens[:, None]).view(B, 1, 1, SK)
        else:
            mask = torch.rand(B, 1, SQ, SK, device=dev) < 0.25
        for mode in MODES:
            grad = mode == "fwd+bwd"
            x = randn((B, NP, SQ, SK), DTYPE, dev, scale=4.0, requires_grad=grad)
            dy = randn(x.shape, DTYPE, dev) if grad else None

            if causal:
                def ours(x):
                    return scaled_upper_triang_masked_softmax(x, None, SCALE)
            else:
                def ours(x, mask=mask):
                    return scaled_masked_softmax(x, mask, SCALE)

            def eager(x, mask=mask):
                return _megatron_eager(x, mask)

            notes: list[str] = ["liger: no scaled masked softmax"]
            fns = {CULMEN: ours, "torch": eager, "compile": compile_peer(_megatron_eager, dev, notes)}
            if fns["compile"] is not None:
                fns["compile"] = lambda x, mask=mask, f=fns["compile"]: f(x, mask)
            providers = {n: _provider(f, x, mode, dy) for n, f in fns.items() if f is not None}
            es = x.element_size()
            rows = B * NP * SQ
            read = B * NP * (SQ * (SQ + 1) // 2) if causal else rows * SK  # causal: sq == sk
            fwd = read * es + rows * SK * es + (0 if causal else mask.numel())
            bwd = 2 * read * es + rows * SK * es
            kind = "causal" if causal else ("keypad" if key_padding else "padding")
            yield Case(f"{B}x{NP}x{SQ}x{SK} {kind} {_DT_NAME[DTYPE]} {mode}", providers,
                       bytes=fwd if not grad else fwd + bwd, notes=notes)


@register_benchmark("softmax_padding", "softmax")
def softmax_padding_bench(cfg: BenchConfig) -> Iterator[Case]:
    """Scaled softmax with a (b, 1, sq, sk) padding mask, sk = 2048 and 4096, fwd and fwd+bwd."""
    shapes = [(2, 4, 32, 100)] if cfg.quick else [(4, 16, 2048, 2048), (2, 16, 4096, 4096)]
    return _cases(cfg, shapes, causal=False, key_padding=False)


@register_benchmark("softmax_causal", "softmax")
def softmax_causal_bench(cfg: BenchConfig) -> Iterator[Case]:
    """Scaled upper-triangular (causal) softmax, sq = sk = 2048 and 4096, fwd and fwd+bwd."""
    shapes = [(2, 4, 64, 64)] if cfg.quick else [(4, 16, 2048, 2048), (2, 16, 4096, 4096)]
    return _cases(cfg, shapes, causal=True, key_padding=False)


@register_benchmark("softmax_long", "softmax")
def softmax_long_bench(cfg: BenchConfig) -> Iterator[Case]:
    """Rows past Apex's 16384 limit (chunked online softmax): sk = 32768 with key padding, and an odd sk."""
    shapes = [(1, 2, 8, 20000)] if cfg.quick else [(1, 16, 512, 32768), (4, 16, 1000, 4097)]
    return _cases(cfg, shapes, causal=False, key_padding=True)
