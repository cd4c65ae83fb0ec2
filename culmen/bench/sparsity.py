"""ASP benchmark: a 2:4-pruned BERT-base MLP (768 -> 3072 -> GELU -> 768) on semi-structured sparse
tensors against the same pruned weights run dense.

Providers, all on the same input and the same pruned weights: ``culmen`` (the layers after ``ASP``'s
``semi_structured`` option, i.e. ``enable_semi_structured`` with its default backend, named in the
case notes: sparse forward GEMMs, dense backward GEMMs, trainable dense weights), ``torch`` (eager
dense ``nn.Sequential``, the reference) and, for ``fwd`` only, ``torch-sparse`` (PyTorch's own recipe:
``weight = nn.Parameter(to_sparse_semi_structured(w))``, inference only, no weight gradient). Tokens
4096 and 16384, fp16 and bf16. TFLOP/s counts the dense GEMM work (2 GEMMs forward, 4 more backward)
for every provider, so a ratio above 1 is the speed-up the sparse tensor cores give. Where the GPU
cannot run semi-structured sparsity (below SM80, ROCm, CPU), culmen falls back to dense and the case
notes why.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn

from culmen.bench.providers import grad_provider
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark
from culmen.contrib.sparsity import create_mask
from culmen.contrib.sparsity.semi_structured import enable_semi_structured, semi_structured_status
from culmen.testing import randn

D_MODEL, D_FF = 768, 3072
TOKENS = (4096, 16384)
QUICK_TOKENS = (64,)
QUICK_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
MODES: tuple[str, ...] = ("fwd", "fwd+bwd")
_DT_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _pruned_mlp(d_model: int, d_ff: int, dtype: torch.dtype, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model)).to(device, dtype)
    with torch.no_grad():
        for layer in (mlp[0], mlp[2]):
            layer.weight.mul_(create_mask(layer.weight, "m4n2_1d"))
    return mlp


def _torch_sparse(dense: nn.Sequential, notes: list[str]) -> nn.Sequential | None:
    try:
        model = copy.deepcopy(dense)
        for layer in (model[0], model[2]):
            layer.weight = nn.Parameter(torch.sparse.to_sparse_semi_structured(layer.weight.detach()),
                                        requires_grad=False)
        return model
    except Exception as exc:  # unsupported GPU / build: reported, culmen and torch still run
        notes.append(f"torch-sparse: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
        return None


@register_benchmark("sparsity_linear", "sparsity")
def sparsity_linear_bench(cfg: BenchConfig) -> Iterator[Case]:
    """2:4-pruned 768 -> 3072 -> 768 MLP: semi-structured sparse (culmen, PyTorch) vs dense, fwd and fwd+bwd."""
    dev = cfg.device
    d_model, d_ff = QUICK_DIMS if cfg.quick else (D_MODEL, D_FF)
    for dtype in DTYPES:
        for tokens in (QUICK_TOKENS if cfg.quick else TOKENS):
            for mode in MODES:
                grad = mode == "fwd+bwd"
                notes: list[str] = []
                dense = _pruned_mlp(d_model, d_ff, dtype, dev)
                sparse = copy.deepcopy(dense)
                for layer in (sparse[0], sparse[2]):
                    enable_semi_structured(layer)
                notes.append(f"culmen: {semi_structured_status(sparse[0])}")  # which backend ran
                x = randn((tokens, d_model), dtype, dev, requires_grad=grad)
                xs = x.detach().clone().requires_grad_(grad)
                dy = randn((tokens, d_model), dtype, dev) if grad else None

                def leaves(model: nn.Sequential, inp: torch.Tensor) -> dict[str, torch.Tensor]:
                    return {"x": inp, "w1": model[0].weight, "b1": model[0].bias, "w2": model[2].weight,
                            "b2": model[2].bias}

                providers = {
                    "torch": grad_provider(lambda m=dense, t=x: m(t), mode, leaves(dense, x), dy),
                    CULMEN: grad_provider(lambda m=sparse, t=xs: m(t), mode, leaves(sparse, xs), dy),
                }
                if not grad and dev.type == "cuda":
                    peer = _torch_sparse(dense, notes)
                    if peer is not None:
                        providers["torch-sparse"] = grad_provider(lambda m=peer, t=x: m(t), mode, {}, None)
                gemm = 2 * tokens * d_model * d_ff
                flops = 2 * gemm if mode == "fwd" else 6 * gemm
                yield Case(f"{tokens}x{d_model}->{d_ff} {_DT_NAME[dtype]} {mode}", providers, flops=flops, notes=notes)
