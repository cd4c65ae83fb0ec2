"""Rotary embedding benchmarks: ``rotary`` (flash_attn / HF layout, Q and K) and ``rotary_apex`` (sbhd).

Peers on the same tensors: ``torch`` (eager: ``x * cos + rotate_half(x) * sin`` as Hugging Face and
Megatron write it), ``compile`` (``torch.compile`` of it, CUDA only) and ``liger`` (Liger-Kernel's
``LigerRopeFunction``, GPT-NeoX style with full rotary only, when it imports). Liger rotates its inputs
in place, so it gets its own copies of the (same-valued) inputs. Bytes count the fewest a kernel must
move: Q and K read and written once per pass, plus the cos/sin rows.

Shapes are Llama-3-8B's attention: batch 4, 4096 tokens, 32 query heads and 8 KV heads of 128.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from culmen.bench.providers import compile_peer, grad_provider
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark
from culmen.testing import randn

DTYPE = torch.bfloat16
MODES: tuple[str, ...] = ("fwd", "fwd+bwd")
# (batch, seqlen, q heads, kv heads, head dim)
SHAPE = (4, 4096, 32, 8, 128)
QUICK_SHAPE = (2, 64, 4, 2, 32)


def _rotate_half(x: Tensor, interleaved: bool) -> Tensor:
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _eager_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """HF / Megatron's unfused rotary in x's dtype; ``cos``/``sin`` ``(s, 1, rotary_dim)`` full width."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + _rotate_half(x, interleaved) * sin
    xr = x[..., :rd]
    return torch.cat((xr * cos + _rotate_half(xr, interleaved) * sin, x[..., rd:]), dim=-1)


def _liger(device: torch.device, notes: list[str]) -> Callable[..., Any] | None:
    if device.type != "cuda":
        return None
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError:
        notes.append("liger: not installed")
        return None
    except Exception as exc:
        notes.append(f"liger: skipped ({type(exc).__name__}: {exc})")
        return None
    return LigerRopeFunction.apply


def _tables(s: int, half: int, dev: torch.device) -> tuple[Tensor, Tensor]:
    inv = 1.0 / 10000.0 ** (torch.arange(0, 2 * half, 2, device=dev, dtype=torch.float32) / (2 * half))
    f = torch.outer(torch.arange(s, device=dev, dtype=torch.float32), inv)
    return f.cos().to(DTYPE), f.sin().to(DTYPE)


def _full(t: Tensor, interleaved: bool) -> Tensor:
    """A half table ``(s, rd/2)`` as the full-width ``(s, 1, rd)`` table the eager formula multiplies by."""
    full = t.repeat_interleave(2, -1) if interleaved else torch.cat((t, t), -1)
    return full[:, None, :]


@register_benchmark("rotary", "position")
def rotary_bench(cfg: BenchConfig) -> Iterator[Case]:
    """Rotary embedding of Q and K (b, s, h, d), GPT-NeoX and GPT-J, full and partial, fwd and fwd+bwd."""
    from culmen.flash_attn.layers.rotary import apply_rotary_emb

    dev = cfg.device
    B, S, HQ, HK, D = QUICK_SHAPE if cfg.quick else SHAPE
    for style, rd in (("neox", D), ("gptj", D), ("neox-partial", D // 2)):
        interleaved = style == "gptj"
        cos, sin = _tables(S, rd // 2, dev)
        cos_f, sin_f = _full(cos, interleaved), _full(sin, interleaved)
        for mode in MODES:
            grad = mode == "fwd+bwd"
            q = randn((B, S, HQ, D), DTYPE, dev, requires_grad=grad)
            k = randn((B, S, HK, D), DTYPE, dev, requires_grad=grad)
            grads = (randn(q.shape, DTYPE, dev), randn(k.shape, DTYPE, dev)) if grad else None
            leaves = {"q": q, "k": k}

            def ours(q=q, k=k, cos=cos, sin=sin, il=interleaved):
                return apply_rotary_emb(q, cos, sin, interleaved=il), apply_rotary_emb(k, cos, sin, interleaved=il)

            def eager(q=q, k=k, c=cos_f, s=sin_f, il=interleaved):
                return _eager_rope(q, c, s, il), _eager_rope(k, c, s, il)

            notes: list[str] = []
            fns: dict[str, Callable[[], Any] | None] = {CULMEN: ours, "torch": eager}
            comp = compile_peer(_eager_rope, dev, notes)
            if comp is not None:
                fns["compile"] = lambda q=q, k=k, c=cos_f, s=sin_f, il=interleaved, f=comp: (f(q, c, s, il),
                                                                                              f(k, c, s, il))
            liger = _liger(dev, notes) if style == "neox" else None
            providers = {n: grad_provider(f, mode, leaves, grads) for n, f in fns.items() if f is not None}
            if liger is not None:
                # Liger works in place on (b, h, s, d) views: its own copies of the inputs.
                ql, kl = q.detach().clone().requires_grad_(grad), k.detach().clone().requires_grad_(grad)
                cl, sl = cos_f[None, :, 0], sin_f[None, :, 0]  # (1, s, d)

                def lig(ql=ql, kl=kl, cl=cl, sl=sl, f=liger):
                    qo, ko = f(ql.transpose(1, 2), kl.transpose(1, 2), cl, sl)[:2]
                    return qo.transpose(1, 2), ko.transpose(1, 2)

                providers["liger"] = grad_provider(lig, mode, {"q": ql, "k": kl}, grads)
            elif style != "neox":
                notes.append("liger: GPT-NeoX full rotary only")
            es = q.element_size()
            io = 2 * (q.numel() + k.numel()) * es + 2 * cos.numel() * es  # read + write Q, K; cos/sin rows
            yield Case(f"{B}x{S}x({HQ}+{HK})x{D} {style} {mode}", providers, bytes=io if not grad else 2 * io,
                       notes=notes)


@register_benchmark("rotary_apex", "position")
def rotary_apex_bench(cfg: BenchConfig) -> Iterator[Case]:
    """Apex's fused_apply_rotary_pos_emb (sbhd, fp32 angles) vs Megatron's unfused rotary, fwd and fwd+bwd."""
    from culmen.transformer.functional import fused_apply_rotary_pos_emb

    dev = cfg.device
    B, S, H, _, D = QUICK_SHAPE if cfg.quick else SHAPE
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D)
    f = torch.outer(torch.arange(S, device=dev, dtype=torch.float32), inv)
    freqs = torch.cat((f, f), -1)[:, None, None, :]  # Megatron's (s, 1, 1, d) fp32 angles

    def eager(t, freqs):
        # Megatron's _apply_rotary_pos_emb_bshd: cos/sin of the angles, in t's dtype, every call.
        c, s = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
        return t * c + _rotate_half(t, False) * s

    for mode in MODES:
        grad = mode == "fwd+bwd"
        t = randn((S, B, H, D), DTYPE, dev, requires_grad=grad)
        grads = (randn(t.shape, DTYPE, dev),) if grad else None
        notes: list[str] = []
        fns = {CULMEN: lambda t=t: (fused_apply_rotary_pos_emb(t, freqs),), "torch": lambda t=t: (eager(t, freqs),)}
        comp = compile_peer(eager, dev, notes)
        if comp is not None:
            fns["compile"] = lambda t=t, comp=comp: (comp(t, freqs),)
        notes.append("liger: no sbhd / per-column-angle RoPE")
        providers = {n: grad_provider(fn, mode, {"t": t}, grads) for n, fn in fns.items()}
        io = 2 * t.numel() * t.element_size() + freqs.numel() * 4
        yield Case(f"{S}x{B}x{H}x{D} sbhd {mode}", providers, bytes=io if not grad else 2 * io, notes=notes)
