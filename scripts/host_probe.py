"""Host cost per call of culmen's ops and their PyTorch equivalents, plus the primitives they are built from.

Run on the GPU machine: ``python scripts/host_probe.py [--out FILE]``. At tiny shapes the GPU finishes
each kernel before the host issues the next one, so the wall time of N back-to-back calls divided by N
is the host cost per call (the GPU queue never fills). Medians of several repetitions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def host_us(fn, n: int = 300, reps: int = 7) -> float:
    fn()
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((t1 - t0) / n * 1e6)
    return statistics.median(out)


def fwd_bwd(fn, leaves, grad):
    def run():
        for t in leaves:
            t.grad = None
        y = fn()
        y.backward(grad)
    return run


def primitives(rows):
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(x, y, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y + i, tl.load(x + i, mask=i < n), mask=i < n)

    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)

    def noop():
        pass

    rows.append(("python call", host_us(noop, 2000)))
    rows.append(("torch.empty cuda", host_us(lambda: torch.empty((64, 1024), device="cuda", dtype=torch.bfloat16))))
    rows.append(("torch.empty_like", host_us(lambda: torch.empty_like(x))))
    rows.append(("x.new_empty", host_us(lambda: x.new_empty((64, 1024)))))
    dev = x.device
    bf = torch.bfloat16
    xb = torch.randn(64, 1024, device="cuda", dtype=bf)
    rows.append(("torch.empty(shape, dtype, dev)", host_us(lambda: torch.empty((64, 1024), dtype=bf, device=dev))))
    rows.append(("torch.empty(Size, dtype, device obj)", host_us(lambda: torch.empty(xb.shape, dtype=bf, device=dev))))
    rows.append(("torch.empty_like(xb, dtype=f32)", host_us(lambda: torch.empty_like(xb, dtype=torch.float32))))
    rows.append(("xb.new_empty(shape, dtype=f32)", host_us(lambda: xb.new_empty((64, 1024), dtype=torch.float32))))
    rows.append(("torch.randint seed", host_us(lambda: torch.randint(0, 2**62, (1,), device=dev, dtype=torch.int64))))
    rows.append(("x.view", host_us(lambda: x.view(-1, 8))))
    rows.append(("x.reshape", host_us(lambda: x.reshape(-1, 8))))
    rows.append(("x.add(1)", host_us(lambda: x.add(1))))
    rows.append(("key (shape,stride,dtype,device)", host_us(lambda: (x.shape, x.stride(), x.dtype, x.device))))
    rows.append(("data_ptr", host_us(lambda: x.data_ptr())))
    rows.append(("current_device", host_us(lambda: torch.cuda.current_device())))
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        rows.append(("_cuda_getCurrentRawStream", host_us(lambda: raw(0))))
    rows.append(("current_stream().cuda_stream", host_us(lambda: torch.cuda.current_stream().cuda_stream)))
    rows.append(("is_grad_enabled", host_us(torch.is_grad_enabled)))
    rows.append(("compiler.is_compiling", host_us(torch.compiler.is_compiling)))

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a)
            return torch.empty_like(a)

        @staticmethod
        def backward(ctx, g):
            return g, None

    xg = torch.randn(64, device="cuda", requires_grad=True)
    rows.append(("Function.apply (grad)", host_us(lambda: Fn.apply(xg, x))))
    rows.append(("Function.apply (no grad input)", host_us(lambda: Fn.apply(x, x))))
    _copy[(1,)](x, y, 1024, BLOCK=1024)
    rows.append(("triton kernel[grid]()", host_us(lambda: _copy[(1,)](x, y, 1024, BLOCK=1024))))
    comp = _copy[(1,)](x, y, 1024, BLOCK=1024)
    stream = torch.cuda.current_stream().cuda_stream
    rows.append(("compiled.run", host_us(lambda: comp.run(1, 1, 1, stream, comp.function, comp.packed_metadata,
                                                          None, None, None, x, y, 1024, 1024))))
    try:
        import inspect

        from triton.backends.nvidia.driver import CudaLauncher

        src = inspect.getsource(CudaLauncher.__call__)
        rows.append(("CudaLauncher.__call__ source lines", len(src.splitlines())))
        print(src)
    except Exception as e:  # noqa: BLE001
        print("no CudaLauncher source:", e)

    # triton_op eager dispatch
    from torch.library import triton_op, wrap_triton

    @triton_op("probe::copy", mutates_args=())
    def tcopy(a: torch.Tensor) -> torch.Tensor:
        b = torch.empty_like(a)
        wrap_triton(_copy)[(1,)](a, b, a.numel(), BLOCK=1024)
        return b

    rows.append(("triton_op eager call", host_us(lambda: tcopy(x))))

    @torch.library.custom_op("probe::copy2", mutates_args=())
    def ccopy(a: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(a)

    rows.append(("custom_op eager call", host_us(lambda: ccopy(x))))


def ops(rows):
    from culmen.flash_attn import flash_attn_func
    from culmen.flash_attn.layers.rotary import apply_rotary_emb
    from culmen.flash_attn.ops.activations import swiglu
    from culmen.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine
    from culmen.ops.cross_entropy import cross_entropy
    from culmen.ops.layer_norm import layer_norm

    bf = torch.bfloat16
    dev = "cuda"
    M, N = 64, 1024
    x = torch.randn(M, N, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(N, device=dev, dtype=bf, requires_grad=True)
    b = torch.randn(N, device=dev, dtype=bf, requires_grad=True)
    g = torch.randn(M, N, device=dev, dtype=bf)
    with torch.no_grad():
        rows.append(("LN fwd torch", host_us(lambda: F.layer_norm(x, (N,), w, b))))
        rows.append(("LN fwd culmen apex", host_us(lambda: fused_layer_norm_affine(x, w, b, (N,), 1e-5))))
        rows.append(("LN fwd culmen op", host_us(lambda: layer_norm(x, w, b).y)))
        rows.append(("RMS fwd culmen op", host_us(lambda: layer_norm(x, w, is_rms_norm=True).y)))
        rows.append(("RMS fwd torch", host_us(lambda: F.rms_norm(x, (N,), w))))
        rows.append(("RMS fwd culmen apex", host_us(lambda: fused_rms_norm_affine(x, w, (N,), 1e-5))))
    rows.append(("LN fwd(grad) torch", host_us(lambda: F.layer_norm(x, (N,), w, b))))
    rows.append(("LN fwd(grad) culmen apex", host_us(lambda: fused_layer_norm_affine(x, w, b, (N,), 1e-5))))
    rows.append(("LN fwd+bwd torch", host_us(fwd_bwd(lambda: F.layer_norm(x, (N,), w, b), [x, w, b], g))))
    rows.append(("LN fwd+bwd culmen apex",
                 host_us(fwd_bwd(lambda: fused_layer_norm_affine(x, w, b, (N,), 1e-5), [x, w, b], g))))
    rows.append(("LN fwd+bwd culmen op", host_us(fwd_bwd(lambda: layer_norm(x, w, b).y, [x, w, b], g))))
    r = torch.randn(M, N, device=dev, dtype=bf, requires_grad=True)

    def torch_add_rms():
        h = x + r
        return F.rms_norm(h, (N,), w) + h

    def culmen_add_rms():
        o = layer_norm(x, w, residual=r, is_rms_norm=True, return_residual=True)
        return o.y + o.residual_out

    rows.append(("add+RMS fwd+bwd torch", host_us(fwd_bwd(torch_add_rms, [x, r, w], g))))
    rows.append(("add+RMS fwd+bwd culmen op", host_us(fwd_bwd(culmen_add_rms, [x, r, w], g))))
    rows.append(("RMS fwd+bwd torch", host_us(fwd_bwd(lambda: F.rms_norm(x, (N,), w), [x, w], g))))
    rows.append(("RMS fwd+bwd culmen apex",
                 host_us(fwd_bwd(lambda: fused_rms_norm_affine(x, w, (N,), 1e-5), [x, w], g))))

    B, S, H, D = 1, 128, 8, 64
    q, k, v = (torch.randn(B, S, H, D, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
    go = torch.randn(B, S, H, D, device=dev, dtype=bf)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        rows.append(("attn fwd sdpa", host_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))))
        rows.append(("attn fwd culmen", host_us(lambda: flash_attn_func(q, k, v, causal=True))))
    rows.append(("attn fwd+bwd sdpa", host_us(fwd_bwd(
        lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), [qt, kt, vt], go.transpose(1, 2)))))
    rows.append(("attn fwd+bwd culmen", host_us(fwd_bwd(lambda: flash_attn_func(q, k, v, causal=True), [q, k, v],
                                                         go))))

    V = 1000
    logits = torch.randn(M, V, device=dev, dtype=bf, requires_grad=True)
    labels = torch.randint(0, V, (M,), device=dev)
    one = torch.ones((), device=dev)
    rows.append(("CE fwd+bwd torch", host_us(fwd_bwd(lambda: F.cross_entropy(logits, labels), [logits], one))))
    rows.append(("CE fwd+bwd culmen", host_us(fwd_bwd(lambda: cross_entropy(logits, labels).loss.mean(), [logits],
                                                      one))))

    cos = torch.randn(S, D // 2, device=dev, dtype=bf)
    sin = torch.randn(S, D // 2, device=dev, dtype=bf)

    def rot_torch():
        c = torch.cat([cos, cos], -1)[None, :, None, :]
        s = torch.cat([sin, sin], -1)[None, :, None, :]
        x1, x2 = q.chunk(2, -1)
        return q * c + torch.cat([-x2, x1], -1) * s

    rows.append(("rotary fwd+bwd torch", host_us(fwd_bwd(rot_torch, [q], go))))
    rows.append(("rotary fwd+bwd culmen", host_us(fwd_bwd(lambda: apply_rotary_emb(q, cos, sin), [q], go))))

    a = torch.randn(M, N, device=dev, dtype=bf, requires_grad=True)
    u = torch.randn(M, N, device=dev, dtype=bf, requires_grad=True)
    rows.append(("swiglu fwd+bwd torch", host_us(fwd_bwd(lambda: F.silu(a) * u, [a, u], g))))
    rows.append(("swiglu fwd+bwd culmen", host_us(fwd_bwd(lambda: swiglu(a, u), [a, u], g))))

    from culmen.ops.softmax.op import scaled_masked_softmax

    sc = torch.randn(4, 8, 64, 64, device=dev, dtype=bf, requires_grad=True)
    pad = torch.rand(4, 1, 64, 64, device=dev) < 0.1
    gs = torch.randn(4, 8, 64, 64, device=dev, dtype=bf)
    rows.append(("masked softmax fwd+bwd torch", host_us(fwd_bwd(
        lambda: torch.softmax((sc * 0.125).masked_fill(pad, -10000.0), -1), [sc], gs))))
    rows.append(("masked softmax fwd+bwd culmen", host_us(fwd_bwd(
        lambda: scaled_masked_softmax(sc, pad, 0.125), [sc], gs))))
    rows.append(("softmax fwd+bwd torch", host_us(fwd_bwd(lambda: torch.softmax(sc, -1), [sc], gs))))
    rows.append(("softmax fwd+bwd culmen", host_us(fwd_bwd(lambda: scaled_masked_softmax(sc, None, 1.0), [sc], gs))))

    from culmen.optimizers import FusedAdam

    params = [torch.randn(n, device=dev, requires_grad=True) for n in (1000, 4096, 50, 77777, 12, 300) * 4]
    for p in params:
        p.grad = torch.randn_like(p)
    ta = torch.optim.AdamW(params, lr=1e-3, fused=True)
    ca = FusedAdam(params, lr=1e-3)
    rows.append(("AdamW(fused).step 24 params", host_us(ta.step, 100)))
    rows.append(("FusedAdam.step 24 params", host_us(ca.step, 100)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only", choices=["primitives", "ops"])
    ap.add_argument("--diagnose", action="store_true")
    a = ap.parse_args()
    rows: list = []
    if a.only != "ops":
        primitives(rows)
    if a.only != "primitives":
        try:
            ops(rows)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            rows.append((f"ops failed: {type(e).__name__}: {e}", 0))
    for name, us in rows:
        print(f"{name:45s} {us:9.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__" and "--diagnose" not in sys.argv:
    main()


def ln_inputs(M: int = 64, N: int = 1024):
    """``(x, w, b, g)``: a LayerNorm problem at a tiny shape, bf16 on the GPU, leaves requiring grad."""
    bf = torch.bfloat16
    x = torch.randn(M, N, device="cuda", dtype=bf, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=bf, requires_grad=True)
    b = torch.randn(N, device="cuda", dtype=bf, requires_grad=True)
    return x, w, b, torch.randn(M, N, device="cuda", dtype=bf)


def autograd_costs(rows):
    """What a Python autograd node costs in a fwd+bwd, against PyTorch's C++ one."""
    M, N = 64, 1024
    x, w, b, g = ln_inputs(M, N)

    class PyLN(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            y, mean, rstd = torch.ops.aten.native_layer_norm(x, (N,), w, b, 1e-5)
            ctx.save_for_backward(x, w, b, mean, rstd)
            return y

        @staticmethod
        def backward(ctx, gy):
            x, w, b, mean, rstd = ctx.saved_tensors
            return torch.ops.aten.native_layer_norm_backward(gy, x, (N,), mean, rstd, w, b, [True, True, True])

    class Trivial(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, gy):
            return gy

    rows.append(("fwd+bwd F.layer_norm", host_us(fwd_bwd(lambda: F.layer_norm(x, (N,), w, b), [x, w, b], g))))
    rows.append(("fwd+bwd PyFunction(aten LN)", host_us(fwd_bwd(lambda: PyLN.apply(x, w, b), [x, w, b], g))))
    rows.append(("fwd+bwd trivial PyFunction", host_us(fwd_bwd(lambda: Trivial.apply(x), [x], g))))
    rows.append(("fwd+bwd x*1 (C++ node)", host_us(fwd_bwd(lambda: x * 1, [x], g))))
    rows.append(("fwd+bwd x.view (C++ node)", host_us(fwd_bwd(lambda: x.view(M, N), [x], g))))


def diagnose():
    """Where a cached LayerNorm fwd+bwd spends host time (cProfile), and the state of every plan's launches."""
    import cProfile
    import pstats

    from culmen.ops.layer_norm import layer_norm
    from culmen.ops.layer_norm.launch import PLANS

    x, w, b, g = ln_inputs()
    run = fwd_bwd(lambda: layer_norm(x, w, b).y, [x, w, b], g)
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    for plan in PLANS.values():
        for la in list(plan._fwd.values()) + [la for bp in plan._bwd.values() for la in (bp.main, bp.dw, bp.finish)]:
            if la is not None:
                print("launch", la.fn.fn.__name__ if hasattr(la.fn, "fn") else la.fn, "bound" if la._run else "SLOW",
                      la.error, type(la._run).__name__)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        run()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__" and "--diagnose" in sys.argv:
    rows: list = []
    autograd_costs(rows)
    for name, us in rows:
        print(f"{name:45s} {us:9.2f}")
    diagnose()
