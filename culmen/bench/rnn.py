"""``apex.RNN`` benchmark: culmen's stacked LSTM / GRU (fused Triton cell, cuBLAS GEMMs) against cuDNN.

Peers on the same inputs and the same weights (copied into the peer, whose parameter layout is the
same): ``torch`` is ``torch.nn.LSTM`` / ``torch.nn.GRU`` (cuDNN's persistent / fused RNN kernels on GPUs).
Every call starts from zero hidden states (culmen's cells keep their state between calls, as Apex's do,
so the culmen provider calls ``reset_hidden`` first). Eager wall clock, fwd and fwd+bwd; fwd+bwd writes
the gradients of the input and of every weight. TFLOP/s counts the GEMMs: ``2 T B (I + H) G`` per layer
forward (``G`` gates), three times that for fwd+bwd.

culmen's layers replay each forward / backward time loop as one CUDA graph from a layer signature's second
call on (``culmen.RNN.set_cuda_graphs``; the warm-up calls capture): the eager step loop launches two
kernels per step and is host-bound at these shapes. Inside the runner's own CUDA-graph capture (the
``graph`` column) culmen runs the eager loop, which that capture records.

Issue 18's target shape is the first case: LSTM, 2 layers, hidden 1024, seq 512, batch 64. On fp32 cuDNN
may use TF32 (``torch.backends.cudnn.allow_tf32``, on by default) while culmen's GEMMs follow
``torch.backends.cuda.matmul.allow_tf32``; the fp32 case prints which.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn

from culmen.bench.providers import grad_provider
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark
from culmen.testing import randn

# (kind, seq_len, batch, input, hidden, layers, dtype)
SHAPES = [
    ("lstm", 512, 64, 1024, 1024, 2, torch.bfloat16),
    ("lstm", 512, 64, 1024, 1024, 2, torch.float16),
    ("lstm", 128, 32, 256, 256, 2, torch.bfloat16),
    ("lstm", 128, 32, 256, 256, 2, torch.float32),
    ("gru", 512, 64, 1024, 1024, 2, torch.bfloat16),
]
QUICK_SHAPES = [("lstm", 6, 3, 8, 16, 2, torch.float32), ("gru", 5, 2, 8, 12, 1, torch.float32)]
MODES: tuple[str, ...] = ("fwd", "fwd+bwd")
_DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _models(kind: str, In: int, H: int, layers: int, dtype: torch.dtype, dev: torch.device):
    from culmen.RNN import GRU, LSTM

    ours = (LSTM if kind == "lstm" else GRU)(In, H, layers).to(dev, dtype)
    peer = (nn.LSTM if kind == "lstm" else nn.GRU)(In, H, layers).to(dev, dtype)
    with torch.no_grad():
        for k, cell in enumerate(ours.rnns):
            getattr(peer, f"weight_ih_l{k}").copy_(cell.w_ih)
            getattr(peer, f"weight_hh_l{k}").copy_(cell.w_hh)
            getattr(peer, f"bias_ih_l{k}").copy_(cell.b_ih)
            getattr(peer, f"bias_hh_l{k}").copy_(cell.b_hh)
    if dev.type == "cuda":
        peer.flatten_parameters()
    return ours, peer


def _leaves(ours, peer, x_ours, x_peer) -> tuple[dict, dict]:
    """Same names for the same tensors of both models, so the runner compares every gradient."""
    lo, lp = {"x": x_ours}, {"x": x_peer}
    for k, cell in enumerate(ours.rnns):
        for a, b in (("w_ih", "weight_ih"), ("w_hh", "weight_hh"), ("b_ih", "bias_ih"), ("b_hh", "bias_hh")):
            lo[f"{a}{k}"] = getattr(cell, a)
            lp[f"{a}{k}"] = getattr(peer, f"{b}_l{k}")
    return lo, lp


@register_benchmark("rnn", "rnn")
def rnn_bench(cfg: BenchConfig) -> Iterator[Case]:
    """culmen.RNN LSTM / GRU (fused Triton cell) vs torch.nn.LSTM / GRU (cuDNN), fwd and fwd+bwd."""
    dev = cfg.device
    for kind, T, B, In, H, layers, dtype in (QUICK_SHAPES if cfg.quick else SHAPES):
        ours, peer = _models(kind, In, H, layers, dtype, dev)
        gates = 4 if kind == "lstm" else 3
        fwd_flops = sum(2 * T * B * ((In if k == 0 else H) + H) * gates * H for k in range(layers))
        for mode in MODES:
            grad = mode == "fwd+bwd"
            x = randn((T, B, In), dtype, dev, requires_grad=grad)
            xp = x.detach().clone().requires_grad_(grad)
            dy = randn((T, B, H), dtype, dev) if grad else None
            lo, lp = _leaves(ours, peer, x, xp)

            def run_ours(x=x, B=B, ours=ours):
                ours.reset_hidden(B)
                return ours(x)[0]

            providers = {CULMEN: grad_provider(run_ours, mode, lo, dy),
                         "torch": grad_provider(lambda xp=xp, peer=peer: peer(xp)[0], mode, lp, dy)}
            notes = []
            if dtype == torch.float32 and dev.type == "cuda":
                notes.append(f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}, "
                             f"matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}")
            label = f"{kind} L{layers} T{T} B{B} I{In} H{H} {_DT[dtype]} {mode}"
            yield Case(label, providers, flops=fwd_flops if mode == "fwd" else 3 * fwd_flops, notes=notes)
