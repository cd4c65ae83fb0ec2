"""OpenFold benchmarks: triangle attention with a pair bias (``contrib.openfold_triton.AttnTri``).

Triangle attention: q, k, v ``[B, I, H, N, D]`` (I = N = residues), a pair bias ``[B, 1, H, N, N]`` shared
by every row ``i`` (its gradient summed over ``I``) and a key mask ``[B, I, 1, 1, N]``. Timed forward and
forward+backward (gradients of q, k, v and the bias) on the same inputs by:

* ``culmen``: ``AttnTri`` (flash-style forward, O(N) memory per row block; the backward computes each
  probability tile once, stores the logits' gradient ``dS`` for ``dQ`` and sums it over ``I`` for the bias
  gradient, without atomics);
* ``torch``: OpenFold's eager formulation in the input dtype (``matmul(q * scale, k^T) + (mask - 1) * inf +
  bias``, ``softmax``, ``matmul``), which materializes ``[B, I, H, N, N]`` logits and probabilities;
* ``compile``: ``torch.compile`` of the same function (what Apex's ``AttnBiasJIT`` is);
* ``sdpa``: ``F.scaled_dot_product_attention`` with the bias and mask summed into one float
  ``attn_mask`` (which must be materialized as ``[I, H, N, N]``, and whose gradient SDPA computes).

Each case's notes carry the peak memory each provider allocates beyond its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.bench.providers import compile_peer, grad_provider, peak_extra_bytes
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark

# (B, N_res, H, D): OpenFold's triangle attention at 256 and 384 residues (4 heads of 32).
SHAPES: list[tuple[int, int, int, int]] = [(1, 256, 4, 32), (1, 384, 4, 32)]
QUICK_SHAPES: list[tuple[int, int, int, int]] = [(1, 24, 2, 16)]
DTYPE = torch.bfloat16
MODES: tuple[str, ...] = ("fwd", "fwd+bwd")
INF = 1e9


def _eager(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, bias: Tensor) -> Tensor:
    a = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))
    a = a + (mask - 1.0) * INF
    a = a + bias
    return torch.matmul(torch.softmax(a, dim=-1), v)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, bias: Tensor) -> Tensor:
    b, i, h, n, d = q.shape
    attn = (bias + (mask - 1.0) * INF).reshape(b * i, h, n, n)
    out = F.scaled_dot_product_attention(q.reshape(b * i, h, n, d), k.reshape(b * i, h, n, d),
                                         v.reshape(b * i, h, n, d), attn_mask=attn)
    return out.reshape(q.shape)


def _peak_extra_mib(fn: Callable[[], Any], device: torch.device) -> float | None:
    peak = peak_extra_bytes(fn, device)
    return None if peak is None else peak / 2**20


def _case(B: int, N: int, H: int, D: int, mode: str, dev: torch.device) -> Case:
    from culmen.contrib.openfold_triton import AttnTri

    grad = mode == "fwd+bwd"
    gen = torch.Generator(device=dev).manual_seed(0)
    # OpenFold's projections come out as [B, I, N, H, D] and are viewed as [B, I, H, N, D].
    q, k, v = ((torch.randn(B, N, N, H, D, device=dev, generator=gen) * 0.5).to(DTYPE).transpose(-2, -3)
               .requires_grad_(grad) for _ in range(3))
    bias = torch.randn(B, 1, H, N, N, device=dev, generator=gen).to(DTYPE).requires_grad_(grad)
    mask = (torch.rand(B, N, 1, 1, N, device=dev, generator=gen) > 0.1).to(DTYPE)
    mask[..., 0] = 1
    dy = torch.randn(q.shape, device=dev, dtype=DTYPE, generator=gen) if grad else None
    leaves = {"q": q, "k": k, "v": v, "bias": bias}
    notes: list[str] = []
    fns: dict[str, Callable[..., Tensor] | None] = {
        CULMEN: lambda q, k, v, m, b: AttnTri(q, k, v, m, b, INF, True),
        "torch": _eager,
        "compile": compile_peer(_eager, dev, notes),
    }
    if dev.type == "cuda":
        fns["sdpa"] = _sdpa
    providers = {name: grad_provider(lambda f=f: f(q, k, v, mask, bias), mode, leaves, dy)
                 for name, f in fns.items() if f is not None}
    if dev.type == "cuda":
        mem = {n: _peak_extra_mib(p, dev) for n, p in providers.items()}
        notes.append("peak extra MiB: " + ", ".join(f"{n} {m:.0f}" for n, m in mem.items() if m is not None))
    flops = 4 * B * N * H * N * N * D * (1 if mode == "fwd" else 3.5)
    return Case(f"B{B} N{N} H{H} d{D} bf16 {mode}", providers, flops=int(flops), reference="torch", notes=notes)


@register_benchmark("openfold_triangle_attention", "attention")
def bench_triangle_attention(cfg: BenchConfig) -> Iterator[Case]:
    """OpenFold triangle attention with a pair bias (AttnTri) vs eager, torch.compile and SDPA."""
    for B, N, H, D in (QUICK_SHAPES if cfg.quick else SHAPES):
        for mode in MODES:
            yield _case(B, N, H, D, mode, cfg.device)
