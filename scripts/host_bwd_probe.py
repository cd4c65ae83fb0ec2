"""Where the host time of a culmen backward goes (GPU machine): the autograd engine's cost for a Python
node against a C++ one, and the time spent inside culmen's own backward code.

    python3 scripts/host_bwd_probe.py

Tiny shapes, so the GPU never limits the host; µs per fwd+bwd call, medians of 7 runs of 300 calls.
Rows: PyTorch's RMSNorm; a C++-backward op (``clone``) against a Python ``autograd.Function`` doing the
same; culmen's RMSNorm (flash_attn ``rms_norm_fn``) with the time inside ``_LayerNormFn.backward`` and inside
the plan's backward measured by wrapping them.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_probe import fwd_bwd, host_us  # noqa: E402  (the same timing as the per-family probe)


class _PyClone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.clone()


class _PyCloneSave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w, None, None)
        ctx.extra = 1
        ctx.set_materialize_grads(False)
        return x.clone(), None, None

    @staticmethod
    def backward(ctx, g, _a, _b):
        x, w, _, _ = ctx.saved_tensors
        return g.clone(), torch.empty_like(w)


class Timer:
    def __init__(self):
        self.total = 0.0
        self.calls = 0

    def wrap(self, fn):
        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total += time.perf_counter() - t0
                self.calls += 1
        return inner

    def us(self):
        return self.total / max(self.calls, 1) * 1e6


def main() -> None:
    from culmen.flash_attn.ops.triton.layer_norm import rms_norm_fn
    from culmen.ops.layer_norm import launch as ln_launch
    from culmen.ops.layer_norm import op as ln_op

    dev, bf = "cuda", torch.bfloat16
    M, N = 64, 1024
    x = torch.randn(M, N, device=dev, dtype=bf, requires_grad=True)
    r = torch.randn(M, N, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(N, device=dev, dtype=bf, requires_grad=True)
    g = torch.randn(M, N, device=dev, dtype=bf)
    rows = []
    rows.append(("torch clone fwd+bwd (C++ node)", host_us(fwd_bwd(lambda: x.clone(), [x], g))))
    rows.append(("python Function clone fwd+bwd", host_us(fwd_bwd(lambda: _PyClone.apply(x), [x], g))))
    rows.append(("python Function clone, 3 outputs + saves", host_us(fwd_bwd(lambda: _PyCloneSave.apply(x, w)[0],
                                                                             [x, w], g))))
    rows.append(("torch RMS fwd+bwd", host_us(fwd_bwd(lambda: F.rms_norm(x, (N,), w), [x, w], g))))
    rows.append(("torch add+RMS fwd+bwd", host_us(fwd_bwd(lambda: F.rms_norm(x + r, (N,), w), [x, r, w], g))))
    rows.append(("culmen rms_norm_fn fwd+bwd", host_us(fwd_bwd(lambda: rms_norm_fn(x, w, None), [x, w], g))))
    rows.append(("culmen add+rms_norm_fn fwd+bwd",
                 host_us(fwd_bwd(lambda: rms_norm_fn(x, w, None, residual=r), [x, r, w], g))))
    with torch.no_grad():
        rows.append(("culmen rms_norm_fn fwd (no grad)", host_us(lambda: rms_norm_fn(x, w, None))))
    rows.append(("culmen rms_norm_fn fwd (grad)", host_us(lambda: rms_norm_fn(x, w, None))))
    tb, tp = Timer(), Timer()
    orig_b = ln_op._LayerNormFn.backward
    orig_p = ln_launch.NormPlan.backward
    ln_op._LayerNormFn.backward = staticmethod(tb.wrap(orig_b))
    ln_launch.NormPlan.backward = tp.wrap(orig_p)
    try:
        us = host_us(fwd_bwd(lambda: rms_norm_fn(x, w, None), [x, w], g))
    finally:
        ln_op._LayerNormFn.backward = staticmethod(orig_b)
        ln_launch.NormPlan.backward = orig_p
    rows.append(("culmen rms_norm_fn fwd+bwd (timed)", us))
    rows.append(("   inside _LayerNormFn.backward", tb.us()))
    rows.append(("   inside NormPlan.backward", tp.us()))
    for name, v in rows:
        print(f"{name:50s} {v:8.2f} us")


if __name__ == "__main__":
    main()
