"""Host-side (Python) cost of one layer_norm fwd+bwd at a tiny shape, by function (tottime)."""

import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from culmen.ops.layer_norm import layer_norm  # noqa: E402

x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)


def fwdbwd():
    o = layer_norm(x, w, b)
    torch.autograd.grad(o.y, [x, w, b], dy)


def fwd_only():
    o = layer_norm(x, w, b)
    return o


def section(name, fn, n=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    print(f"{name:28s} {(time.perf_counter() - t) / n * 1e6:8.1f} us")


o = fwd_only()
section("fwd (grad mode)", fwd_only)
section("backward only (retain)", lambda: torch.autograd.grad(o.y, [x, w, b], dy, retain_graph=True))
section("fwd+bwd", fwdbwd)
section("torch.empty x4", lambda: [torch.empty(4096, 4096 // 16, device="cuda") for _ in range(4)])
section("current_stream", lambda: torch.cuda.current_stream().cuda_stream)
section("tensor.data_ptr x20", lambda: [x.data_ptr() for _ in range(20)])
section("os.environ.get x10", lambda: [os.environ.get("CULMEN_BACKEND") for _ in range(10)])
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    fwdbwd()
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
