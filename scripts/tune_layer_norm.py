"""Sweep launch settings of the layer_norm kernels on a GPU and compare with torch eager / compile.

Usage (on the GPU machine): ``python3 scripts/tune_layer_norm.py [--sweep] [--quick]``.
Prints one table per (op, dtype, mode); numbers feed ``bench/notes/layer_norm.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from culmen.ops.layer_norm import launch, layer_norm  # noqa: E402

SHAPES = [(16384, 1024), (16384, 4096), (16384, 8192), (4096, 65536)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    src = torch.empty(2**28, device="cuda", dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6  # GB/s


def providers(M, N, dtype, rms, mode):
    x = torch.randn(M, N, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=dtype, requires_grad=True)
    b = None if rms else torch.randn(N, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=dtype)
    params = [x, w] + ([b] if b is not None else [])

    def eager(x, w, b):
        return F.rms_norm(x, (N,), w, 1e-5) if rms else F.layer_norm(x, (N,), w, b, 1e-5)

    compiled = torch.compile(eager)

    def ours(x, w, b):
        return layer_norm(x, w, b, eps=1e-5, is_rms_norm=rms).y

    fns = {"culmen": ours, "torch": eager, "compile": compiled}
    try:
        if rms:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            fns["liger"] = lambda x, w, b: LigerRMSNormFunction.apply(x, w, 1e-5)
        else:
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            fns["liger"] = lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)
    except Exception:
        pass
    out = {}
    for name, f in fns.items():
        if mode == "fwd":
            def run(f=f):
                with torch.no_grad():
                    return f(x, w, b)
        else:
            def run(f=f):
                y = f(x, w, b)
                return torch.autograd.grad(y, params, dy)
        out[name] = run
    return out, (x, w, b, dy)


def check(M, N, dtype, rms):
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    w = torch.randn(N, device="cuda", dtype=dtype)
    b = None if rms else torch.randn(N, device="cuda", dtype=dtype)
    y = layer_norm(x, w, b, eps=1e-5, is_rms_norm=rms).y
    xd, wd = x.double(), w.double()
    if rms:
        ref = F.rms_norm(xd, (N,), wd, 1e-5)
        low = F.rms_norm(x, (N,), w, 1e-5)
    else:
        ref = F.layer_norm(xd, (N,), wd, b.double(), 1e-5)
        low = F.layer_norm(x, (N,), w, b, 1e-5)
    return (y.double() - ref).abs().max().item(), (low.double() - ref).abs().max().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"copy bandwidth {bw:.0f} GB/s")
    records = []
    shapes = SHAPES[:2] if args.quick else SHAPES
    for (M, N), dtype, rms in itertools.product(shapes, (torch.bfloat16, torch.float32), (False, True)):
        err, err_lo = check(M, N, dtype, rms)
        for mode in ("fwd", "fwd+bwd"):
            fns, _ = providers(M, N, dtype, rms, mode)
            s = torch.finfo(dtype).bits // 8
            nbytes = M * N * s * (2 if mode == "fwd" else 5)
            times = {}
            for name, fn in fns.items():
                try:
                    times[name] = bench(fn)
                except Exception as e:  # a peer that fails must not stop the sweep
                    print(f"  {name} failed: {type(e).__name__}: {e}"[:200])
            best_peer = min(v for k, v in times.items() if k != "culmen")
            op = "rms" if rms else "ln"
            row = " ".join(f"{k}={v:.3f}" for k, v in times.items())
            gbs = nbytes / times["culmen"] / 1e6
            print(f"{op:3s} {M}x{N} {str(dtype)[6:]:8s} {mode:7s} {row}  culmen {gbs:.0f} GB/s "
                  f"({gbs / bw:.0%})  vs best peer x{best_peer / times['culmen']:.2f}  "
                  f"vs eager x{times['torch'] / times['culmen']:.2f}  err {err:.2e} (torch {err_lo:.2e})")
            records.append(dict(op=op, M=M, N=N, dtype=str(dtype), mode=mode, times=times, gbs=gbs,
                                roofline=bw, err=err, err_torch=err_lo))
    if args.sweep:
        sweep()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


def sweep():
    """Time culmen alone over launch settings for the shapes that matter most."""
    base = dict(launch.TUNING)
    grid = {
        "elems_per_thread": [8, 16, 32],
        "fwd_elems": [2048, 4096, 8192],
        "bwd_programs_per_sm": [1, 2, 4, 8],
    }
    for (M, N), rms, mode in itertools.product(SHAPES[:3], (False, True), ("fwd", "fwd+bwd")):
        dtype = torch.bfloat16
        results = []
        for key, values in grid.items():
            if key == "bwd_programs_per_sm" and mode == "fwd":
                continue
            for v in values:
                launch.TUNING.clear()
                launch.TUNING.update(base)
                launch.TUNING[key] = v
                fns, _ = providers(M, N, dtype, rms, mode)
                results.append((bench(fns["culmen"]), key, v))
        launch.TUNING.clear()
        launch.TUNING.update(base)
        results.sort()
        print(f"sweep {'rms' if rms else 'ln'} {M}x{N} {mode}: " +
              ", ".join(f"{k}={v}:{t:.3f}" for t, k, v in results[:6]))
    # Resident vs chunked for the wide rows.
    for rms, mode in itertools.product((False, True), ("fwd", "fwd+bwd")):
        M, N = 4096, 65536
        for key in ("fwd_max_resident", "bwd_max_resident"):
            for v, chunk in ((8192, 4096), (8192, 8192), (16384, 2048), (65536, 4096)):
                launch.TUNING.clear()
                launch.TUNING.update(base)
                launch.TUNING[key] = v
                launch.TUNING["chunk"] = chunk
                fns, _ = providers(M, N, torch.bfloat16, rms, mode)
                try:
                    t = bench(fns["culmen"])
                except Exception as e:
                    t = float("nan")
                    print("  failed", key, v, type(e).__name__)
                print(f"wide {'rms' if rms else 'ln'} {mode} {key}={v} chunk={chunk}: {t:.3f}")
    launch.TUNING.clear()
    launch.TUNING.update(base)


if __name__ == "__main__":
    main()
