"""Attention benchmarks: ``flash_attn`` (dense), ``flash_attn_varlen``, ``flash_attn_features``.

Peers on the same values: PyTorch SDPA forced to one backend (``sdpa-cudnn``, ``sdpa-flash``), on its
own ``(B, h, s, d)`` tensors holding the same data (SDPA's native layout; flash_attn's is ``(B, s, h,
d)``). FLOPs are flash_attn's count: ``4 * B * h * sq * sk * d`` for the forward (half when causal)
and 2.5x that for the backward. Each case's notes carry the peak memory every provider allocates
beyond its inputs (``torch.cuda.max_memory_allocated``), the issue's "O(seqlen), no seqlen^2 buffer"
check.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.bench.providers import peak_extra_bytes
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark

TOKENS = 16384
HIDDEN = 2048
# (head dim, seqlen) at batch * seqlen = 16k tokens and nheads = 2048 / head dim (the shapes).
DENSE_SHAPES: list[tuple[int, int]] = [(128, 2048), (128, 8192), (128, 16384), (64, 1024), (64, 4096), (256, 4096)]
QUICK_SHAPES: list[tuple[int, int]] = [(32, 64)]
MODES: tuple[str, ...] = ("fwd", "fwd+bwd")


def attn_flops(B: int, h: int, sq: int, sk: int, d: int, causal: bool, mode: str) -> int:
    """flash_attn's FLOP count of one call (matmuls only)."""
    f = 4 * B * h * sq * sk * d
    if causal:
        f //= 2
    return f if mode == "fwd" else int(f * 3.5)


def _sdpa_backend(name: str) -> Callable[[], Any]:
    """A context factory forcing SDPA onto one backend (an error, not a fallback, if it cannot run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name]
    return functools.partial(sdpa_kernel, backend)


def _timed(fwd: Callable[[], Tensor], inputs: tuple[Tensor, ...], mode: str, dy: Tensor,
           ctx: Callable[[], Any] = contextlib.nullcontext) -> Callable[[], Any]:
    """A provider: ``fwd`` alone under no_grad, or forward + ``torch.autograd.grad`` (no accumulation)."""
    if mode == "fwd":
        def run_fwd():
            with ctx(), torch.no_grad():
                return fwd()
        return run_fwd

    def run_fwd_bwd():
        with ctx():
            y = fwd()
            grads = torch.autograd.grad(y, inputs, dy)
        return (y.detach(), *grads)
    return run_fwd_bwd


def _peak_extra_mib(fn: Callable[[], Any], device: torch.device) -> float | None:
    peak = peak_extra_bytes(fn, device)
    return None if peak is None else peak / 2**20


def _to_bshd(x: Any) -> Any:
    """SDPA outputs ``(B, h, s, d)``: bring outputs and grads to flash_attn's layout for the check."""
    if isinstance(x, tuple):
        return tuple(t.transpose(1, 2) for t in x)
    return x.transpose(1, 2)


def _check(out: Any, ref: Any) -> dict[str, float]:
    names = ("out", "dq", "dk", "dv")
    out = out if isinstance(out, tuple) else (out,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    return {n: (a.float() - b.float()).abs().max().item() for n, a, b in zip(names, out, ref)}


def _dense_case(B: int, h: int, hk: int, sq: int, sk: int, d: int, dtype: torch.dtype, causal: bool, mode: str,
                device: torch.device, *, window: tuple[int, int] = (-1, -1), label_extra: str = "",
                peers: bool = True) -> Case:
    from culmen.flash_attn import flash_attn_func

    gen = torch.Generator(device=device).manual_seed(0)
    grad = mode != "fwd"
    q = torch.randn(B, sq, h, d, device=device, dtype=dtype, generator=gen).requires_grad_(grad)
    k = torch.randn(B, sk, hk, d, device=device, dtype=dtype, generator=gen).requires_grad_(grad)
    v = torch.randn(B, sk, hk, d, device=device, dtype=dtype, generator=gen).requires_grad_(grad)
    dy = torch.randn(B, sq, h, d, device=device, dtype=dtype, generator=gen)
    providers: dict[str, Callable[[], Any]] = {
        CULMEN: _timed(lambda: flash_attn_func(q, k, v, causal=causal, window_size=window), (q, k, v), mode, dy),
    }
    informational: tuple[str, ...] = ()
    if mode != "fwd":  # the bitwise-reproducible backward (a dQ kernel instead of fp32 atomics)
        providers["culmen-det"] = _timed(lambda: flash_attn_func(q, k, v, causal=causal, window_size=window,
                                                                 deterministic=True), (q, k, v), mode, dy)
        informational = ("culmen-det",)
    notes: list[str] = []
    reference = CULMEN
    if peers and device.type == "cuda" and window == (-1, -1) and sq == sk:
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_(grad) for t in (q, k, v))
        dyt = dy.transpose(1, 2).contiguous()
        gqa = hk != h
        for name in ("cudnn", "flash"):
            def fwd(qt=qt, kt=kt, vt=vt):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
            run = _timed(fwd, (qt, kt, vt), mode, dyt, _sdpa_backend(name))
            providers[f"sdpa-{name}"] = (lambda run=run: _to_bshd(run()))
        reference = "sdpa-flash"
    mem = {n: _peak_extra_mib(p, device) for n, p in providers.items() if device.type == "cuda"}
    if mem:
        notes.append("peak extra MiB: " + ", ".join(f"{n} {m:.0f}" for n, m in mem.items() if m is not None))
    flops = attn_flops(B, h, sq, sk, d, causal, mode)
    if window != (-1, -1):
        notes.append("window FLOPs counted as dense (not the visible band)")
    label = f"d{d} s{sq} {'causal' if causal else 'full'}{label_extra} {mode}"
    return Case(label=label, providers=providers, flops=flops, reference=reference, check=_check, notes=notes,
                informational=informational)


@register_benchmark("flash_attn", "attention")
def bench_flash_attn(cfg: BenchConfig) -> Iterator[Case]:
    """Dense attention, bf16, batch*seqlen=16k tokens, hidden 2048, vs SDPA cuDNN/flash."""
    shapes = QUICK_SHAPES if cfg.quick else DENSE_SHAPES
    dtype = torch.bfloat16 if cfg.device.type == "cuda" else torch.float32
    for d, s in shapes:
        h = (HIDDEN if not cfg.quick else 64) // d
        B = max(1, (TOKENS if not cfg.quick else 128) // s)
        for causal in (False, True):
            for mode in MODES:
                yield _dense_case(B, h, h, s, s, d, dtype, causal, mode, cfg.device)


@register_benchmark("flash_attn_features", "attention")
def bench_flash_attn_features(cfg: BenchConfig) -> Iterator[Case]:
    """GQA and sliding-window attention, bf16, d128, 16k tokens."""
    dtype = torch.bfloat16 if cfg.device.type == "cuda" else torch.float32
    d, s = (32, 64) if cfg.quick else (128, 8192)
    h = 2 if cfg.quick else 16
    B = 2 if cfg.quick else TOKENS // s
    for mode in MODES:
        yield _dense_case(B, h, h // 2 if cfg.quick else 4, s, s, d, dtype, True, mode, cfg.device,
                          label_extra=" gqa4", peers=True)
        yield _dense_case(B, h, h, s, s, d, dtype, True, mode, cfg.device, window=(1024 if not cfg.quick else 16, 0),
                          label_extra=" window1024", peers=False)


def _varlen_lengths(total: int, gen: torch.Generator, quick: bool) -> list[int]:
    """Mixed lengths summing to ``total``: uniform in [total/16, total/2] (at least 1 each)."""
    lo, hi = max(1, total // 16), max(2, total // 2)
    lens: list[int] = []
    while sum(lens) < total:
        n = int(torch.randint(lo, hi, (1,), generator=gen, device="cpu").item())
        lens.append(min(n, total - sum(lens)))
    return lens


@register_benchmark("flash_attn_varlen", "attention")
def bench_flash_attn_varlen(cfg: BenchConfig) -> Iterator[Case]:
    """Varlen on a packed batch of mixed lengths vs dense at the same token count."""
    from culmen.flash_attn import flash_attn_func, flash_attn_varlen_func

    device = cfg.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    d, h, total, dense_s = (32, 2, 128, 64) if cfg.quick else (128, 16, TOKENS, 4096)
    gen = torch.Generator().manual_seed(0)
    lens = _varlen_lengths(total, gen, cfg.quick)
    cu = torch.tensor([0] + lens, dtype=torch.int32, device="cpu").cumsum(0).to(torch.int32).to(device)
    gdev = torch.Generator(device=device).manual_seed(1)
    for causal in (False, True):
        for mode in MODES:
            grad = mode != "fwd"
            q, k, v = (torch.randn(total, h, d, device=device, dtype=dtype, generator=gdev).requires_grad_(grad)
                       for _ in range(3))
            dy = torch.randn(total, h, d, device=device, dtype=dtype, generator=gdev)
            qd, kd, vd = (t.detach().view(total // dense_s, dense_s, h, d).requires_grad_(grad) for t in (q, k, v))
            providers = {
                CULMEN: _timed(lambda q=q, k=k, v=v, c=causal: flash_attn_varlen_func(
                    q, k, v, cu, cu, max(lens), max(lens), causal=c), (q, k, v), mode, dy),
                "culmen-dense": _timed(lambda qd=qd, kd=kd, vd=vd, c=causal: flash_attn_func(qd, kd, vd, causal=c),
                                       (qd, kd, vd), mode, dy.view(total // dense_s, dense_s, h, d)),
            }
            flops = sum(attn_flops(1, h, n, n, d, causal, mode) for n in lens)
            note = (f"{len(lens)} sequences, lengths {min(lens)}..{max(lens)}; culmen-dense is {total // dense_s}x"
                    f"{dense_s} (its TFLOP/s use the varlen FLOPs: compare times per token, not TFLOP/s)")
            yield Case(label=f"varlen d{d} {total}tok {'causal' if causal else 'full'} {mode}", providers=providers,
                       flops=flops, reference=CULMEN, check=lambda a, b: {}, notes=[note],
                       informational=("culmen-dense",))


@register_benchmark("flash_attn_fp8", "attention")
def bench_flash_attn_fp8(cfg: BenchConfig) -> Iterator[Case]:
    """FA3's FP8 forward (float8_e4m3fn q/k/v, per-(batch, kv head) descales, bf16 out) vs bf16 forwards, d128."""
    from culmen.flash_attn import flash_attn_func as fa2_func
    from culmen.flash_attn_3 import flash_attn_func as fa3_func
    from culmen.flash_attn_3.fp8 import quantize_fp8

    dev = cfg.device
    if dev.type != "cuda" and not cfg.quick:
        return
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = [(64, 32)] if cfg.quick else [(8192, 128), (2048, 128)]
    for s, d in shapes:
        h = 2 if cfg.quick else HIDDEN // d
        B = 1 if cfg.quick else TOKENS // s
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(B, s, h, d, device=dev, dtype=dtype, generator=gen) for _ in range(3))
        q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
        for causal in (False, True):
            def fp8(causal=causal, q8=q8, k8=k8, v8=v8, qd=qd, kd=kd, vd=vd):
                with torch.no_grad():
                    return fa3_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)

            def bf16(causal=causal, q=q, k=k, v=v):
                with torch.no_grad():
                    return fa2_func(q, k, v, causal=causal)

            providers: dict[str, Callable[[], Any]] = {CULMEN: fp8, "culmen-bf16": bf16}
            if dev.type == "cuda":
                qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
                ctx = _sdpa_backend("cudnn")

                def cudnn(causal=causal, qt=qt, kt=kt, vt=vt, ctx=ctx):
                    with ctx(), torch.no_grad():
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
                providers["sdpa-cudnn"] = cudnn
            yield Case(label=f"d{d} s{s} {'causal' if causal else 'full'} fp8 fwd", providers=providers,
                       flops=attn_flops(B, h, s, s, d, causal, "fwd"), reference="culmen-bf16",
                       notes=["max|diff| of culmen (FP8) is its error against culmen's bf16 forward on the same "
                              "values; the issue's goal is >= 1.5x culmen-bf16"])
        del q, k, v, q8, k8, v8
