"""Which culmen op makes a host-bound ``train_step`` slow on the host (GPU machine): the culmen GPT-2 (or
LLaMA) model of ``culmen.bench.models`` with one op at a time swapped for its PyTorch formulation.

    python3 scripts/host_ablation.py [gpt2|llama] [d768]

Prints host ms per step (enqueue time of 5 back-to-back steps: forward + loss, backward, optimizer step) and
wall ms per step for: culmen as is, each single swap (layer norm, attention, MLP, loss, optimizer), all swaps,
and PyTorch's own model. The swaps patch the module attributes the blocks import at call time. The lent
machine's host speed varies up to 2x between processes (gpt2 d768 culmen: 31 ms in one, 23.6 ms in the next),
so compare rows of one run only.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.nn.functional as F

from culmen.bench.models import build_model, build_optimizer, make_batch, model_config


def _ln(x, weight, bias, residual=None, eps=1e-6, prenorm=False, **_):
    if residual is not None:
        x = x + residual
    y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return (y, x) if prenorm else y


def _rms(x, weight, bias=None, residual=None, eps=1e-6, prenorm=False, **_):
    if residual is not None:
        x = x + residual
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return (y, x) if prenorm else y


def _attn(q, k, v, causal=False, **_):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)


def _mlp(x, w1, w2, b1=None, b2=None, activation="gelu_approx", **_):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _ce(x, w, labels, **_):
    return F.cross_entropy(F.linear(x, w).float().reshape(-1, w.shape[0]), labels.reshape(-1))


def _swiglu(a, b):
    return F.silu(a) * b


SWAPS = {
    "layer_norm": [("culmen.flash_attn.ops.triton.layer_norm", "layer_norm_fn", _ln),
                   ("culmen.flash_attn.ops.triton.layer_norm", "rms_norm_fn", _rms)],
    "attention": [("culmen.flash_attn", "flash_attn_func", _attn)],
    "mlp": [("culmen.flash_attn.ops.fused_dense", "fused_mlp_func", _mlp),
            ("culmen.flash_attn.ops.activations", "swiglu", _swiglu)],
    "loss": [("culmen.ops.cross_entropy", "fused_linear_cross_entropy", _ce)],
}


@contextlib.contextmanager
def _swapped(names):
    import importlib

    saved = []
    for name in names:
        for mod, attr, fn in SWAPS.get(name, []):
            m = importlib.import_module(mod)
            saved.append((m, attr, getattr(m, attr)))
            setattr(m, attr, fn)
    try:
        yield
    finally:
        for m, attr, fn in saved:
            setattr(m, attr, fn)


def _measure(cfg, impl, tokens, labels, torch_adam=False):
    model = build_model(cfg, impl, torch.device("cuda"), torch.bfloat16)
    opt = build_optimizer(model, "torch" if torch_adam else impl)

    def step():
        model(tokens, labels).backward()
        opt.step()
        model.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        host.append((time.perf_counter() - t0) / 5 * 1e3)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    return min(host), (time.perf_counter() - t0) / 5 * 1e3


def main() -> None:
    style = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    size = sys.argv[2] if len(sys.argv) > 2 else "d768"
    cfg = model_config(style, size)
    tokens, labels = make_batch(cfg, torch.device("cuda"))
    rows = [("culmen", ()), *((f"- {n}", (n,)) for n in SWAPS), ("- optimizer", ("optimizer",)),
            ("- all", (*SWAPS, "optimizer")), ("torch model", None)]
    for label, swaps in rows:
        if swaps is None:
            host, wall = _measure(cfg, "torch", tokens, labels)
        else:
            with _swapped(swaps):
                host, wall = _measure(cfg, "culmen", tokens, labels, torch_adam="optimizer" in swaps)
        print(f"{style} {size} {label:14s} host {host:7.2f} ms/step  wall {wall:7.2f} ms/step", flush=True)


if __name__ == "__main__":
    main()
