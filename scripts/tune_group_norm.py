# ruff: noqa: B023  (closures over loop variables run inside their own iteration)
"""Sweep the GroupNorm launch rules on a GPU (run on the lent machine).

    python3 scripts/tune_group_norm.py [--mode fwd,bwd] [--configs "name:key=val,key=val name2:..."]
                                       [--shapes 8x512x64x64,...] [--layouts nchw,nhwc] [--peers]

For each (shape, layout) and config it sets ``culmen.ops.group_norm.launch.TUNING`` and times the
launchers themselves (``group_norm_fwd`` / ``group_norm_bwd``, GroupNorm(32) + SiLU, bf16) as CUDA-graph
replays: device time only, no host cost. It checks ``y`` against ``F.group_norm`` + ``F.silu`` and prints
GB/s (fewest bytes: fwd reads x and writes y; bwd reads dy and x and writes dx) and the percentage of
the measured copy bandwidth. The fastest config per case is marked. ``--peers`` adds torch eager
(device time of the same work, fwd and fwd+bwd through autograd). Configs (``TUNING`` keys) by
default: the current rules, bigger and smaller tiles, no L2 cap, and the split schedule forced.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = "8x512x64x64,8x1280x32x32,16x320x128x128,1x640x64x64"
DEFAULT_CONFIGS = ("base: few8:num_warps_few=8 all16:num_warps=16 t2048:tile=2048 bt1:bwd_tile_mult=1 "
                   "bt4:bwd_tile_mult=4 l2cap:fused_l2_budget=33554432 "
                   "split8:fused_min_groups_per_sm=1e9,split_programs_per_sm=8,max_splits=128")


def copy_gbps() -> float:
    from triton.testing import do_bench

    src = torch.empty(1 << 28, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() * 4 / ms / 1e6


def parse_configs(text: str) -> list[tuple[str, dict]]:
    out = []
    for item in text.split():
        name, _, body = item.partition(":")
        cfg = {}
        for kv in filter(None, body.split(",")):
            k, v = kv.split("=")
            cfg[k] = float(v) if "." in v or "e" in v else int(v)
        out.append((name, cfg))
    return out


def wall(roof: float) -> None:
    """The ``culmen bench group_norm`` cases, wall time (``do_bench``, host cost included): culmen, torch eager
    and Liger (NCHW, when it imports); ``torch.compile`` is left to the real benchmark."""
    from triton.testing import do_bench

    from culmen.bench.group_norm import GN_CASES, GN_EPS, GN_GROUPS, _liger_group_norm, _provider
    from culmen.ops.group_norm import group_norm

    print("wall time (do_bench median, host cost included)", flush=True)
    for shape, layout, dtype, silu, mode in GN_CASES:
        grad = mode == "fwd+bwd"
        x = torch.randn(shape, device="cuda", dtype=dtype)
        if layout == "nhwc":
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_(grad)
        C = shape[1]
        w = (1.0 + 0.1 * torch.randn(C, device="cuda")).to(dtype).requires_grad_(grad)
        b = (0.1 * torch.randn(C, device="cuda")).to(dtype).requires_grad_(grad)
        dy = torch.randn_like(x) if grad else None
        liger = _liger_group_norm(x.device, []) if layout == "nchw" else None
        fns = {
            "culmen": lambda x, w, b, s=silu: group_norm(x, GN_GROUPS, w, b, GN_EPS, "silu" if s else ""),
            "torch": lambda x, w, b, s=silu: (F.silu if s else (lambda t: t))(F.group_norm(x, GN_GROUPS, w, b, GN_EPS)),
        }
        if liger is not None:
            fns["liger"] = lambda x, w, b, s=silu, f=liger: (F.silu if s else (lambda t: t))(f(x, w, b))
        nbytes = x.numel() * x.element_size() * (2 if mode == "fwd" else 5)
        times = {}
        for name, f in fns.items():
            prov = _provider(lambda f=f: f(x, w, b), mode, {"x": x, "w": w, "b": b}, dy)
            times[name] = do_bench(prov, warmup=25, rep=100, return_mode="median")
        best_peer = min(v for k, v in times.items() if k != "culmen")
        label = f"{'x'.join(map(str, shape))} {layout} {str(dtype)[6:]}{' silu' if silu else ''} {mode}"
        cells = "  ".join(f"{k} {v * 1e3:7.1f} us" for k, v in times.items())
        pct = 100 * nbytes / times["culmen"] / 1e6 / roof
        print(f"{label:36s} {cells}  culmen {pct:4.1f}% of copy, {best_peer / times['culmen']:.2f}x best peer",
              flush=True)


def main() -> None:
    from triton.testing import do_bench_cudagraph

    from culmen.ops.group_norm import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="fwd,bwd")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--layouts", default="nchw,nhwc")
    ap.add_argument("--peers", action="store_true")
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--wall", action="store_true", help="only the wall-time comparison of the bench cases")
    args = ap.parse_args()
    dtype = torch.bfloat16
    roof = copy_gbps()
    if args.wall:
        wall(roof)
        return
    print(f"copy bandwidth {roof:.0f} GB/s; bf16; GroupNorm(32) + SiLU; device time (CUDA-graph replay)", flush=True)
    base = dict(launch.TUNING)
    configs = parse_configs(args.configs)
    G = 32
    for shape in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]:
        for layout in args.layouts.split(","):
            x = torch.randn(shape, device="cuda", dtype=dtype)
            if layout == "nhwc":
                x = x.contiguous(memory_format=torch.channels_last)
            C = shape[1]
            w = torch.randn(C, device="cuda", dtype=dtype)
            b = torch.randn(C, device="cuda", dtype=dtype)
            dy = torch.randn_like(x)
            ref = F.silu(F.group_norm(x.float(), G, w.float(), b.float(), 1e-5))
            label = f"{'x'.join(map(str, shape)):>15} {layout}"
            for mode in args.mode.split(","):
                nbytes = x.numel() * x.element_size() * (2 if mode == "fwd" else 3)
                results = []
                for name, cfg in configs:
                    launch.TUNING.clear()
                    launch.TUNING.update(base, **cfg)
                    try:
                        y, mean, rstd = launch.group_norm_fwd(x, w, b, G, 1e-5, True)
                        err = (y.float() - ref).abs().max().item()
                        if mode == "fwd":
                            fn = lambda: launch.group_norm_fwd(x, w, b, G, 1e-5, True)  # noqa: E731
                        else:
                            fn = lambda: launch.group_norm_bwd(dy, x, w, b, mean, rstd, G, True, True)  # noqa: E731
                        fn()
                        ms = do_bench_cudagraph(fn, rep=args.rep, return_mode="median")
                        results.append((ms, name, err))
                    except Exception as exc:  # report and go on with the next config
                        print(f"{label} {mode} {name} failed: {type(exc).__name__}: {exc}", flush=True)
                if args.peers:
                    def eager_fwd():
                        return F.silu(F.group_norm(x, G, w, b, 1e-5))
                    xr = x.detach().requires_grad_()
                    wr = w.detach().requires_grad_()
                    br = b.detach().requires_grad_()

                    def eager_fb():
                        yy = F.silu(F.group_norm(xr, G, wr, br, 1e-5))
                        return torch.autograd.grad(yy, (xr, wr, br), dy)
                    if mode == "fwd":
                        ms = do_bench_cudagraph(eager_fwd, rep=args.rep, return_mode="median")
                        results.append((ms, "torch", 0.0))
                    else:  # eager backward = (fwd+bwd) - fwd
                        fb = do_bench_cudagraph(eager_fb, rep=args.rep, return_mode="median")
                        fw = do_bench_cudagraph(eager_fwd, rep=args.rep, return_mode="median")
                        results.append((fb - fw, "torch(fb-f)", 0.0))
                best = min(r[0] for r in results) if results else None
                for ms, name, err in results:
                    gbps = nbytes / ms / 1e6
                    mark = " <- best" if ms == best else ""
                    print(f"{label} {mode:3s} {name:>12}: {ms * 1e3:8.1f} us {gbps:6.0f} GB/s {100 * gbps / roof:5.1f}%"
                          f"  err={err:.3g}{mark}", flush=True)
    launch.TUNING.clear()
    launch.TUNING.update(base)


if __name__ == "__main__":
    main()
