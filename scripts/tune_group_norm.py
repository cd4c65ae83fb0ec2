# ruff: noqa: B023  (closures over loop variables run inside their own iteration)
"""Sweep the GroupNorm launch rules on a GPU (run on the lent machine).

    python3 scripts/tune_group_norm.py [--mode fwd,bwd] [--configs "name:key=val,key=val name2:..."]
                                       [--shapes 8x512x64x64,...] [--layouts nchw,nhwc] [--peers] [--warm]
    python3 scripts/tune_group_norm.py --wall
    python3 scripts/tune_group_norm.py --select SWEEP_LOG > choice.json
    python3 scripts/tune_group_norm.py --tuning choice.json --bench [--json out.json]

For each (shape, layout) and config it sets ``culmen.ops.group_norm.launch.TUNING`` and times the
plan's launches themselves (``GNPlan.forward`` / ``GNPlan.backward``, GroupNorm(32) + SiLU, bf16) with
``triton.testing.do_bench``: the L2 is flushed before every run and the flush (a 256 MB memset) covers
the host cost of the launch, so the times are device times with cold caches. It checks ``y`` and the
gradients against an fp32 PyTorch computation (``err``: max abs difference, largest over the outputs)
and prints GB/s (fewest bytes: fwd reads x and writes y; bwd reads dy and x and writes dx) and the
percentage of the measured copy bandwidth. The fastest config per case is marked. ``--peers`` adds
torch eager (fwd, and the backward as (fwd+bwd) - fwd). ``--warm`` runs every config once without
timing (to fill Triton's compile cache from several processes at once). ``--wall`` times the
``culmen bench group_norm`` cases (host cost included) against torch eager and Liger, without the
``torch.compile`` peer.

Config keys ``tile``, ``chunk`` and ``warps`` set that knob for both kernel families and directions
(``tile``, ``bwd_tile``, ``cl_tile``, ``cl_bwd_tile`` ...); full ``TUNING`` names set one key. ``--select``
reads a sweep log and prints, as JSON, the ``TUNING`` entries of the fastest config per kernel family
(NCHW cases: rows kernels; NHWC: channels-last kernels) and direction (geometric mean over the shapes of
the time relative to ``base``; configs with a wrong result are left out). ``--tuning`` applies such a
JSON file first; ``--bench`` then runs ``culmen bench group_norm`` with it (the table of the notes).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = "8x512x64x64,8x1280x32x32,16x320x128x128,1x640x64x64"
DEFAULT_CONFIGS = ("base: c8k:chunk=8192 c32k:chunk=32768 c64k:chunk=65536 t8k:tile=8192,warps=8,chunk=32768 "
                   "t8kw16:tile=8192,warps=16,chunk=32768 t2kw4:tile=2048,warps=4,chunk=8192 "
                   "t4kw8:tile=4096,warps=8 t4kw4:tile=4096,warps=4 nogather:gather=0")
_FAMILIES = ("", "bwd_", "cl_", "cl_bwd_")
_SHORT = {"tile": "tile", "chunk": "chunk", "warps": "num_warps"}
# (layout, mode) of the sweep -> the TUNING prefix of the kernels that ran
_PREFIX = {("nchw", "fwd"): "", ("nchw", "bwd"): "bwd_", ("nhwc", "fwd"): "cl_", ("nhwc", "bwd"): "cl_bwd_"}


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
            val = float(v) if "." in v or "e" in v else int(v)
            for key in ([f + _SHORT[k] for f in _FAMILIES] if k in _SHORT else [k]):
                cfg[key] = val
        out.append((name, cfg))
    return out


def select(log_path: str, configs: str = DEFAULT_CONFIGS, tolerance: float = 0.05) -> dict:
    """The ``TUNING`` entries of the fastest config per (kernel family, direction) in a sweep log."""
    import math
    import re

    cfgs = dict(parse_configs(configs))
    times: dict = {}  # (layout, mode) -> config -> {shape: us}
    pat = re.compile(r"^\s*(\S+) (nchw|nhwc) (fwd|bwd)\s+(\S+): +([0-9.]+) us .* err=([0-9.e+-]+|nan)")
    for line in open(log_path):
        m = pat.match(line)
        if m and m.group(4) in cfgs and float(m.group(6)) <= tolerance:
            times.setdefault((m.group(2), m.group(3)), {}).setdefault(m.group(4), {})[m.group(1)] = float(m.group(5))
    choice: dict = {}
    for (layout, mode), per_cfg in sorted(times.items()):
        base = per_cfg.get("base")
        if not base:
            continue
        scores = {}
        for name, t in per_cfg.items():
            if set(t) >= set(base):
                scores[name] = math.exp(sum(math.log(t[k] / base[k]) for k in base) / len(base))
        best = min(scores, key=scores.get)
        pre = _PREFIX[(layout, mode)]
        print(f"# {layout} {mode}: best {best} ({scores[best]:.3f} of base); "
              + ", ".join(f"{k} {v:.3f}" for k, v in sorted(scores.items(), key=lambda kv: kv[1])), file=sys.stderr)
        choice.update({k: v for k, v in cfgs[best].items() if k.startswith(pre) and k[len(pre):] in _SHORT.values()})
        if layout == "nhwc" and "nogather" in scores and scores["nogather"] < 0.97:
            choice["gather"] = 0
    return choice


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


def _err(got, ref) -> float:
    """Largest max-abs error over the outputs, each relative to max(1, the output's largest magnitude)."""
    return max(float((a.float() - r.float()).abs().max()) / max(1.0, float(r.abs().max())) for a, r in zip(got, ref))


def main() -> None:
    from triton.testing import do_bench

    from culmen.ops.group_norm import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="fwd,bwd")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--layouts", default="nchw,nhwc")
    ap.add_argument("--peers", action="store_true")
    ap.add_argument("--warm", action="store_true", help="run every config once, no timing (compile only)")
    ap.add_argument("--rep", type=int, default=60)
    ap.add_argument("--wall", action="store_true", help="only the wall-time comparison of the bench cases")
    ap.add_argument("--select", metavar="LOG", help="print the best TUNING entries of a sweep log as JSON")
    ap.add_argument("--tuning", metavar="JSON", help="TUNING entries to apply first")
    ap.add_argument("--bench", action="store_true", help="run `culmen bench group_norm` (with --tuning)")
    ap.add_argument("--json", metavar="PATH", help="--bench: the JSON output")
    args = ap.parse_args()
    if args.select:
        import json

        print(json.dumps(select(args.select, args.configs)))
        return
    if args.tuning:
        import json

        launch.TUNING.update(json.load(open(args.tuning)))
        print(f"TUNING overrides: {json.load(open(args.tuning))}", flush=True)
    if args.bench:
        from culmen.cli import main as cli_main

        sys.exit(cli_main(["bench", "group_norm", *(["--json", args.json] if args.json else [])]))
    dtype = torch.bfloat16
    roof = 0.0 if args.warm else copy_gbps()
    if args.wall:
        wall(roof)
        return
    if not args.warm:
        print(f"copy bandwidth {roof:.0f} GB/s; bf16; GroupNorm(32) + SiLU; device time (do_bench, L2 flushed)",
              flush=True)
    base = dict(launch.TUNING)
    configs = parse_configs(args.configs)
    G, eps = 32, 1e-5
    for shape in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]:
        for layout in args.layouts.split(","):
            x = torch.randn(shape, device="cuda", dtype=dtype)
            if layout == "nhwc":
                x = x.contiguous(memory_format=torch.channels_last)
            C = shape[1]
            w = 1.0 + 0.1 * torch.randn(C, device="cuda", dtype=dtype)
            b = 0.1 * torch.randn(C, device="cuda", dtype=dtype)
            dy = torch.randn_like(x)
            xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
            yr = F.silu(F.group_norm(xr, G, wr, br, eps))
            refs = {"fwd": (yr.detach(),), "bwd": torch.autograd.grad(yr, (xr, wr, br), dy.float())}
            label = f"{'x'.join(map(str, shape)):>15} {layout}"
            for mode in args.mode.split(","):
                nbytes = x.numel() * x.element_size() * (2 if mode == "fwd" else 3)
                results = []
                for name, cfg in configs:
                    launch.TUNING.clear()
                    launch.TUNING.update(base, **cfg)
                    try:
                        plan = launch.GNPlan(x, G, w, b, eps, "silu")  # built after the TUNING change
                        y, ws = plan.forward(x, w, b)
                        if mode == "fwd":
                            fn = lambda: plan.forward(x, w, b)  # noqa: E731
                            got = (y,)
                        else:
                            fn = lambda: plan.backward(dy, x, w, b, ws, ws, plan.NG, True)  # noqa: E731
                            got = fn()
                        err = _err(got, refs[mode])
                        if args.warm:
                            continue
                        ms = do_bench(fn, warmup=10, rep=args.rep, return_mode="median")
                        results.append((ms, name, err))
                    except Exception as exc:  # report and go on with the next config
                        print(f"{label} {mode} {name} failed: {type(exc).__name__}: {exc}", flush=True)
                if args.peers and not args.warm:
                    xq = x.detach().requires_grad_()
                    wq = w.detach().requires_grad_()
                    bq = b.detach().requires_grad_()

                    def eager_fwd():
                        return F.silu(F.group_norm(x, G, w, b, eps))

                    def eager_fb():
                        yy = F.silu(F.group_norm(xq, G, wq, bq, eps))
                        return torch.autograd.grad(yy, (xq, wq, bq), dy)
                    fw = do_bench(eager_fwd, warmup=10, rep=args.rep, return_mode="median")
                    if mode == "fwd":
                        results.append((fw, "torch", 0.0))
                    else:
                        fb = do_bench(eager_fb, warmup=10, rep=args.rep, return_mode="median")
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
