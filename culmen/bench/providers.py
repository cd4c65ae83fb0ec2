"""Provider helpers shared by the benchmarks: the ``torch.compile`` peer, the fwd / fwd+bwd wrapper and the
peak-memory probe."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def compile_peer(fn: Callable[..., Any], device: torch.device, notes: list[str]) -> Callable[..., Any] | None:
    """``torch.compile(fn)`` for CUDA; a fresh dynamo cache per case so shapes never share a graph."""
    if device.type != "cuda":
        notes.append("compile: not timed on CPU (inductor's CPU build is slow and not a peer there)")
        return None
    try:
        torch._dynamo.reset()
        # dynamic=False: each case gets a graph specialised to its shape, as a user's model would.
        return torch.compile(fn, dynamic=False)
    except Exception as exc:
        notes.append(f"compile: skipped ({type(exc).__name__}: {exc})")
        return None


def grad_provider(fn: Callable[[], Tensor | tuple[Tensor, ...]], mode: str, leaves: dict[str, Tensor],
                  grad_out: Tensor | tuple[Tensor, ...] | None) -> Callable[[], Any]:
    """``fn() -> y`` (or a tuple of outputs) as a timed provider. ``fwd`` runs it without autograd;
    ``fwd+bwd`` back-propagates ``grad_out`` into ``leaves`` and returns ``{"y" | "y0", "y1", ..., "d<leaf>"}``.
    Grads are reset to ``None`` before each run so every run writes them fresh (no accumulation)."""
    if mode == "fwd":
        def run_fwd():
            with torch.no_grad():
                return fn()
        return run_fwd

    def run_fwd_bwd():
        for t in leaves.values():
            t.grad = None
        out = fn()
        torch.autograd.backward(out, grad_out)
        ys = {"y": out.detach()} if isinstance(out, Tensor) else {f"y{i}": o.detach() for i, o in enumerate(out)}
        return {**ys, **{f"d{k}": t.grad for k, t in leaves.items()}}

    return run_fwd_bwd


def peak_extra_bytes(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Bytes allocated at the peak of one call of ``fn`` beyond what was allocated before it (the inputs);
    None off CUDA. The call's outputs count (they are alive at the peak)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return peak
