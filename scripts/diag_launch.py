"""Diagnose the fast-launch path and the host cost floor of Python autograd Functions."""

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from culmen.ops.common import launch as fl  # noqa: E402
from culmen.ops.layer_norm import launch, layer_norm  # noqa: E402

print("launch hooks:", end=" ")
try:
    print(fl._launch_hooks())
except Exception:
    traceback.print_exc()
x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
for _ in range(3):
    o = layer_norm(x, w, b)
    torch.autograd.grad(o.y, [x, w, b], dy)
for n in ("_fwd", "_bwd"):
    lau = getattr(launch, n)
    print(n, "fast_ok", lau._fast_ok(), "cache", len(lau.cache), "disabled", lau.disabled, "error", lau.error)


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def section(name, fn, n=300):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    print(f"{name:34s} {(time.perf_counter() - t) / n * 1e6:8.1f} us")


section("trivial Function fwd+bwd", lambda: torch.autograd.grad(Twice.apply(x), [x], dy))
section("torch x*2 fwd+bwd", lambda: torch.autograd.grad(x * 2, [x], dy))
section("culmen layer_norm fwd+bwd", lambda: torch.autograd.grad(layer_norm(x, w, b).y, [x, w, b], dy))
section("torch layer_norm fwd+bwd",
        lambda: torch.autograd.grad(torch.nn.functional.layer_norm(x, (4096,), w, b), [x, w, b], dy))
try:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    section("liger layer_norm fwd+bwd",
            lambda: torch.autograd.grad(LigerLayerNormFunction.apply(x, w, b, 1e-5), [x, w, b], dy))
except Exception as e:
    print("liger:", e)
