"""Normalization benchmarks: ``layer_norm``, ``rms_norm`` and ``dropout_add_norm``.

Peers, all on the same tensors: ``torch`` (eager), ``compile`` (``torch.compile`` of the eager
function, CUDA only: inductor's CPU build takes minutes), ``liger`` (Liger-Kernel, when it imports)
and ``apex`` (when a real Apex imports). Bytes count the fewest a kernel must move: every input
read once and every output written once (mean / rstd are recomputable, so not counted).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.bench.providers import compile_peer
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark
from culmen.testing import randn

EPS = 1e-5
SHAPES: list[tuple[int, int]] = [(16384, 1024), (16384, 4096), (16384, 8192), (4096, 65536)]
QUICK_SHAPES: list[tuple[int, int]] = [(64, 256), (33, 1000)]
DTYPES: list[torch.dtype] = [torch.bfloat16, torch.float32]
MODES: tuple[str, ...] = ("fwd", "fwd+bwd")
DROPOUT_P = 0.1

_DT_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _label(M: int, N: int, dtype: torch.dtype, mode: str) -> str:
    return f"{M}x{N} {_DT_NAME[dtype]} {mode}"


def _provider(fn: Callable[[], Any], mode: str, grads: dict[str, Tensor], dy: Tensor | None) -> Callable[[], Any]:
    """Wrap ``fn() -> y | (y, h)`` as a timed provider; ``fwd+bwd`` adds ``y.backward(dy)``.

    Grads are set to None before each run so every run allocates and writes them fresh (no
    accumulation kernel), and the returned dict holds this run's grads for the sanity check.
    """
    if mode == "fwd":
        def run_fwd():
            with torch.no_grad():
                return fn()
        return run_fwd

    def run_fwd_bwd():
        for t in grads.values():
            t.grad = None
        out = fn()
        y, extra = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        y.backward(dy)
        result = {"y": y.detach()}
        if extra:
            result["h"] = extra[0].detach()
        result.update({f"d{k}": t.grad for k, t in grads.items()})
        return result

    return run_fwd_bwd


def _liger(kind: str, device: torch.device, notes: list[str]) -> Callable[..., Any] | None:
    """Liger-Kernel's functional for ``kind`` ("layer_norm" / "rms_norm") when it imports (CUDA only)."""
    if device.type != "cuda":
        return None
    try:
        if kind == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # in_place=False: the default writes dx into dy, which would change dy between timed runs.
        return lambda x, w, b: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)
    except ImportError:
        return None
    except Exception as exc:
        notes.append(f"liger: skipped ({type(exc).__name__}: {exc})")
        return None


def real_apex_available() -> bool:
    """True when a real NVIDIA Apex (not culmen's import alias) imports."""
    mod = sys.modules.get("apex")
    if mod is None:
        try:
            mod = importlib.import_module("apex")
        except Exception:
            return False
    return getattr(mod, "__name__", "") == "apex" and "culmen" not in str(getattr(mod, "__file__", ""))


def _apex(kind: str, device: torch.device, notes: list[str]) -> Callable[..., Any] | None:
    """Apex's fused_layer_norm_affine / fused_rms_norm_affine when a real Apex is installed (CUDA only)."""
    if device.type != "cuda" or not real_apex_available():
        return None
    try:
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine
    except Exception as exc:
        notes.append(f"apex: skipped ({type(exc).__name__}: {exc})")
        return None
    if kind == "layer_norm":
        return lambda x, w, b: fused_layer_norm_affine(x, w, b, (x.shape[-1],), EPS)
    return lambda x, w, b: fused_rms_norm_affine(x, w, (x.shape[-1],), EPS)


def _norm_bytes(M: int, N: int, es: int, mode: str, rms: bool) -> int:
    nvec = 1 if rms else 2  # weight (+ bias)
    fwd = 2 * M * N * es + nvec * N * es  # read x, write y, read w (b)
    bwd = 3 * M * N * es + N * es + nvec * N * es  # read x, dy, write dx; read w; write dw (db)
    return fwd if mode == "fwd" else fwd + bwd


def _norm_cases(cfg: BenchConfig, rms: bool) -> Iterator[Case]:
    from culmen.ops.layer_norm import layer_norm

    kind = "rms_norm" if rms else "layer_norm"
    dev = cfg.device
    for M, N in (QUICK_SHAPES if cfg.quick else SHAPES):
        for dtype in DTYPES:
            for mode in MODES:
                grad = mode == "fwd+bwd"
                x = randn((M, N), dtype, dev, requires_grad=grad)
                w = (1.0 + 0.1 * randn(N, torch.float32, dev)).to(dtype).requires_grad_(grad)
                b = None if rms else randn(N, dtype, dev, 0.1).requires_grad_(grad)
                dy = randn((M, N), dtype, dev) if grad else None
                grads = {"x": x, "w": w} if rms else {"x": x, "w": w, "b": b}

                if rms:
                    def eager(x, w, b):
                        return F.rms_norm(x, (x.shape[-1],), w, EPS)
                else:
                    def eager(x, w, b):
                        return F.layer_norm(x, (x.shape[-1],), w, b, EPS)

                def ours(x, w, b):
                    return layer_norm(x, w, b, eps=EPS, is_rms_norm=rms).y

                notes: list[str] = []
                fns: dict[str, Callable[..., Any] | None] = {
                    CULMEN: ours,
                    "torch": eager,
                    "compile": compile_peer(eager, dev, notes),
                    "liger": _liger(kind, dev, notes),
                    "apex": _apex(kind, dev, notes),
                }
                # Default arguments bind this case's tensors (the generator rebinds x, w, b later).
                providers = {name: _provider(lambda f=f, x=x, w=w, b=b: f(x, w, b), mode, grads, dy)
                             for name, f in fns.items() if f is not None}
                es = x.element_size()
                yield Case(_label(M, N, dtype, mode), providers, bytes=_norm_bytes(M, N, es, mode, rms),
                           notes=notes)


@register_benchmark("layer_norm", "normalization")
def layer_norm_bench(cfg: BenchConfig) -> Iterator[Case]:
    """LayerNorm over the last dim (weight + bias), fwd and fwd+bwd."""
    return _norm_cases(cfg, rms=False)


@register_benchmark("rms_norm", "normalization")
def rms_norm_bench(cfg: BenchConfig) -> Iterator[Case]:
    """RMSNorm over the last dim (weight), fwd and fwd+bwd."""
    return _norm_cases(cfg, rms=True)


def _dropout_check(out: Any, ref: Any, *, w: Tensor, b: Tensor, res: Tensor) -> dict[str, float]:
    """Dropout makes providers disagree, so check each against itself: ``y == LN(h)`` and the drop rate.

    ``h - res`` is zero exactly where ``x`` was dropped, so the drop fraction must be near ``p``.
    """
    y, h = (out["y"], out["h"]) if isinstance(out, dict) else out
    ln = F.layer_norm(h.float(), (h.shape[-1],), w.float(), b.float(), EPS)
    dropped = (h.float() == res.float()).float().mean().item()
    return {"y-LN(h)": float((y.float() - ln).abs().max()), "|drop-p|": abs(dropped - DROPOUT_P)}


@register_benchmark("dropout_add_norm", "normalization")
def dropout_add_norm_bench(cfg: BenchConfig) -> Iterator[Case]:
    """``y = LN(dropout(x) + res)`` returning ``(y, h)`` (flash_attn's dropout_add_layer_norm), bf16."""
    from culmen.ops.layer_norm import layer_norm

    dev = cfg.device
    M, N = (64, 256) if cfg.quick else (16384, 4096)
    dtype = torch.bfloat16
    for mode in MODES:
        grad = mode == "fwd+bwd"
        x = randn((M, N), dtype, dev, requires_grad=grad)
        res = randn((M, N), dtype, dev, requires_grad=grad)
        w = (1.0 + 0.1 * randn(N, torch.float32, dev)).to(dtype).requires_grad_(grad)
        b = randn(N, dtype, dev, 0.1).requires_grad_(grad)
        dy = randn((M, N), dtype, dev) if grad else None
        grads = {"x": x, "res": res, "w": w, "b": b}

        def eager(x, res, w, b):
            h = F.dropout(x, DROPOUT_P, training=True) + res
            return F.layer_norm(h, (N,), w, b, EPS), h

        def ours(x, res, w, b):
            o = layer_norm(x, w, b, residual=res, dropout_p=DROPOUT_P, eps=EPS, return_residual=True)
            return o.y, o.residual_out

        notes: list[str] = ["liger / apex: no fused dropout+add+LayerNorm to compare"]
        fns = {CULMEN: ours, "torch": eager, "compile": compile_peer(eager, dev, notes)}
        providers = {name: _provider(lambda f=f, x=x, r=res, w=w, b=b: f(x, r, w, b), mode, grads, dy)
                     for name, f in fns.items() if f is not None}
        es = x.element_size()
        fwd = 4 * M * N * es + 2 * N * es  # read x, res; write y, h; read w, b
        bwd = 4 * M * N * es + 3 * N * es  # read dy, h; write dx, dres; read w; write dw, db
        yield Case(_label(M, N, dtype, mode), providers, bytes=fwd if mode == "fwd" else fwd + bwd,
                   check=functools.partial(_dropout_check, w=w.detach(), b=b.detach(), res=res.detach()),
                   notes=notes)
