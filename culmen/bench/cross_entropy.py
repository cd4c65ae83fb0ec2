"""Cross-entropy benchmarks: ``cross_entropy`` and ``fused_linear_cross_entropy``, forward + backward.

Peers, all on the same inputs: ``torch`` (eager ``F.cross_entropy`` on fp32-upcast logits, as Hugging
Face models compute it), ``torch-bf16`` (no upcast; informational: lower precision), ``compile``
(``torch.compile`` of the torch function, CUDA only) and ``liger`` (Liger-Kernel's
``LigerCrossEntropyLoss`` / ``LigerFusedLinearCrossEntropyLoss``, when it imports). Liger writes its
gradient into the input logits, so it gets its own copy of them.

Each provider's first run (the runner's sanity pass) also records its peak extra memory on CUDA:
``torch.cuda.max_memory_allocated()`` during the call minus what was allocated before it (the inputs),
the returned gradients included; the values are printed in the case's notes. Gradients are taken with
``torch.autograd.grad``, as for the non-leaf logits of a model (no ``.grad`` accumulation copy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.bench.providers import compile_peer
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark
from culmen.testing import randn

CE_SHAPES: list[tuple[int, int, float]] = [(8192, 128256, 0.0), (8192, 128256, 0.1), (4096, 256000, 0.0)]
CE_QUICK: list[tuple[int, int, float]] = [(64, 1000, 0.0), (33, 4099, 0.1)]
FLCE_SHAPES: list[tuple[int, int, int]] = [(8192, 4096, 128256)]
FLCE_QUICK: list[tuple[int, int, int]] = [(64, 32, 1000)]
DTYPE = torch.bfloat16
IGNORE = -100


def _memory_note(name: str, fn: Callable[[], Any], device: torch.device, notes: list[str]) -> Callable[[], Any]:
    """Wrap ``fn``: its first call (the sanity pass, untimed) appends ``name``'s peak extra memory to notes."""
    if device.type != "cuda":
        return fn
    state = {"done": False}

    def run():
        if state["done"]:
            return fn()
        state["done"] = True
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        notes.append(f"peak extra memory {name}: {peak / 1e9:.3f} GB ({peak / 2**30:.3f} GiB)")
        return out

    return run


def _fwd_bwd(loss_fn: Callable[[], Tensor], grads: dict[str, Tensor]) -> Callable[[], dict[str, Tensor]]:
    """``loss_fn()`` then its gradients by ``torch.autograd.grad`` (fresh each run, and no ``.grad``
    accumulation copy, which would penalise a peer that writes its gradient into the input's storage)."""

    def run():
        loss = loss_fn()
        loss = loss if isinstance(loss, Tensor) else loss[0]
        got = torch.autograd.grad(loss, list(grads.values()))
        return {"loss": loss.detach().float(), **{f"d{k}": g for k, g in zip(grads, got)}}

    return run


def _liger(kind: str, device: torch.device, notes: list[str], **kwargs: Any) -> Any:
    """A Liger-Kernel loss module (CUDA only), or ``None`` when it does not import."""
    if device.type != "cuda":
        return None
    try:
        if kind == "ce":
            from liger_kernel.transformers import LigerCrossEntropyLoss

            return LigerCrossEntropyLoss(**kwargs)
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(**kwargs)
    except ImportError:
        notes.append("liger: not installed")
        return None
    except Exception as exc:
        notes.append(f"liger: skipped ({type(exc).__name__}: {exc})")
        return None


def _labels(n: int, v: int, device: torch.device) -> Tensor:
    y = torch.randint(0, v, (n,), device=device)
    y[::17] = IGNORE  # some ignored rows, as padding gives in practice
    return y


@register_benchmark("cross_entropy", "loss")
def cross_entropy_bench(cfg: BenchConfig) -> Iterator[Case]:
    """Softmax cross-entropy of (N, V) bf16 logits, mean over non-ignored rows, fwd+bwd."""
    from culmen.flash_attn.losses.cross_entropy import CrossEntropyLoss

    dev = cfg.device
    for n, v, smoothing in (CE_QUICK if cfg.quick else CE_SHAPES):
        x = randn((n, v), DTYPE, dev, 2.0, requires_grad=True)
        y = _labels(n, v, dev)
        notes: list[str] = []
        ours = CrossEntropyLoss(ignore_index=IGNORE, label_smoothing=smoothing)

        def upcast(x, y, smoothing=smoothing):
            return F.cross_entropy(x.float(), y, ignore_index=IGNORE, label_smoothing=smoothing)

        def low(x, y, smoothing=smoothing):
            return F.cross_entropy(x, y, ignore_index=IGNORE, label_smoothing=smoothing)

        comp = compile_peer(upcast, dev, notes)
        providers: dict[str, Callable[[], Any]] = {
            CULMEN: _fwd_bwd(lambda x=x, y=y, f=ours: f(x, y), {"x": x}),
            "torch": _fwd_bwd(lambda x=x, y=y: upcast(x, y), {"x": x}),
            "torch-bf16": _fwd_bwd(lambda x=x, y=y: low(x, y), {"x": x}),
        }
        if comp is not None:
            providers["compile"] = _fwd_bwd(lambda x=x, y=y, f=comp: f(x, y), {"x": x})
        liger = _liger("ce", dev, notes, ignore_index=IGNORE, label_smoothing=smoothing)
        if liger is not None:
            # Liger overwrites its input with the gradient: its own copy keeps the others' inputs intact.
            xl = x.detach().clone().requires_grad_()
            providers["liger"] = _fwd_bwd(lambda x=xl, y=y, f=liger: f(x, y), {"x": xl})
        providers = {k: _memory_note(k, f, dev, notes) for k, f in providers.items()}
        es = x.element_size()
        label = f"{n}x{v} bf16{f' ls={smoothing:g}' if smoothing else ''} fwd+bwd"
        # Fewest bytes: read the logits once, write their gradient once.
        yield Case(label, providers, bytes=2 * n * v * es + n * 8, notes=notes, informational=("torch-bf16",))


@register_benchmark("fused_linear_cross_entropy", "loss")
def fused_linear_cross_entropy_bench(cfg: BenchConfig) -> Iterator[Case]:
    """Cross-entropy of hidden (T, H) @ weight (V, H).T, bf16, mean, fwd+bwd (grads of hidden and weight)."""
    from culmen.flash_attn.losses.cross_entropy import FusedLinearCrossEntropyLoss
    from culmen.ops.cross_entropy.fused_linear import default_chunk_rows

    dev = cfg.device
    for t, h, v in (FLCE_QUICK if cfg.quick else FLCE_SHAPES):
        hid = randn((t, h), DTYPE, dev, 1.0, requires_grad=True)
        w = randn((v, h), DTYPE, dev, h ** -0.5, requires_grad=True)
        y = _labels(t, v, dev)
        notes = [f"culmen chunk: {default_chunk_rows(t, v, DTYPE)} tokens"]
        if dev.type == "cuda":
            # cuBLAS allocates its workspace on the process's first matmul: do it here, so that it is not
            # charged to whichever provider happens to run first.
            torch.mm(hid[:64].detach(), w[:64].detach().t())
        ours = FusedLinearCrossEntropyLoss(ignore_index=IGNORE)

        def unfused(hid, w, y):
            return F.cross_entropy((hid @ w.t()).float(), y, ignore_index=IGNORE)

        def unfused_low(hid, w, y):
            return F.cross_entropy(hid @ w.t(), y, ignore_index=IGNORE)

        grads = {"h": hid, "W": w}
        comp = compile_peer(unfused, dev, notes)
        providers: dict[str, Callable[[], Any]] = {
            CULMEN: _fwd_bwd(lambda f=ours, a=hid, b=w, c=y: f(a, b, c), grads),
            "torch": _fwd_bwd(lambda a=hid, b=w, c=y: unfused(a, b, c), grads),
            "torch-bf16": _fwd_bwd(lambda a=hid, b=w, c=y: unfused_low(a, b, c), grads),
        }
        if comp is not None:
            providers["compile"] = _fwd_bwd(lambda f=comp, a=hid, b=w, c=y: f(a, b, c), grads)
        liger = _liger("flce", dev, notes, ignore_index=IGNORE)
        if liger is not None:
            providers["liger"] = _fwd_bwd(lambda f=liger, a=hid, b=w, c=y: f(b, a, c), grads)
        providers = {k: _memory_note(k, f, dev, notes) for k, f in providers.items()}
        es = hid.element_size()
        yield Case(f"T={t} H={h} V={v} bf16 fwd+bwd", providers, flops=3 * 2 * t * h * v,
                   bytes=(2 * t * h + 2 * v * h) * es, notes=notes, informational=("torch-bf16",))
