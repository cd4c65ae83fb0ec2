"""Which culmen op breaks under torch.compile (Inductor) at the train_step shapes: each piece compiled
fwd+bwd in its own process with CUDA_LAUNCH_BLOCKING=1. ``python scripts/compile_isolate.py [piece]``."""

import os
import subprocess
import sys

import torch

B, S, D, H, V = 8, 512, 512, 8, 32000
PIECES = ("rms_prenorm", "rotary_qkv", "attention", "swiglu", "flce")


def run(piece: str) -> None:
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    if piece == "rms_prenorm":
        from culmen.flash_attn.ops.triton.layer_norm import rms_norm_fn

        x, r = (torch.randn(B, S, D, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
        w = torch.randn(D, device=dev, dtype=bf, requires_grad=True)
        def fn(x, r, w):
            return sum(t.float().sum() for t in rms_norm_fn(x, w, None, residual=r, prenorm=True))

        args = (x, r, w)
    elif piece == "rotary_qkv":
        from culmen.flash_attn.layers.rotary import apply_rotary_emb_qkv_

        lin = torch.randn(B, S, 3 * D, device=dev, dtype=bf, requires_grad=True)
        cos, sin = (torch.randn(S, D // H // 2, device=dev, dtype=bf) for _ in range(2))
        fn, args = (lambda t: apply_rotary_emb_qkv_((t * 1).view(B, S, 3, H, D // H), cos, sin).float().sum()), (lin,)
    elif piece == "attention":
        from culmen.flash_attn import flash_attn_func

        q, k, v = (torch.randn(B, S, H, D // H, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
        fn, args = (lambda q, k, v: flash_attn_func(q, k, v, causal=True).float().sum()), (q, k, v)
    elif piece == "swiglu":
        from culmen.flash_attn.ops.activations import swiglu

        a, b = (torch.randn(B * S, 1376, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
        fn, args = (lambda a, b: swiglu(a * 1, b * 1).float().sum()), (a, b)
    else:
        from culmen.ops.cross_entropy import fused_linear_cross_entropy

        h = torch.randn(B * S, D, device=dev, dtype=bf, requires_grad=True)
        w = (torch.randn(V, D, device=dev, dtype=bf) * 0.02).requires_grad_()
        lab = torch.randint(0, V, (B * S,), device=dev)
        fn, args = (lambda h, w: fused_linear_cross_entropy(h, w, lab)), (h, w)
    c = torch.compile(fn, fullgraph=True)
    for f in (fn, c):
        out = f(*args)
        g = torch.autograd.grad(out, args)
        torch.cuda.synchronize()
        print(piece, "eager" if f is fn else "compiled", float(out), [float(t.float().norm()) for t in g], flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
        for p in PIECES:
            r = subprocess.run([sys.executable, __file__, p], env=env, capture_output=True, text=True, timeout=100)
            lines = [ln for ln in (r.stdout + r.stderr).splitlines() if p in ln or "Error" in ln or "error" in ln]
            print(f"== {p}: rc={r.returncode}", *lines[:6], sep="\n", flush=True)
