"""Where does a rotary benchmark case spend its time? Device time vs wall time vs host cost.

Usage (GPU machine): ``python3 scripts/profile_rotary.py [--sweep] [--trace] [--only SUBSTR,...]``.
For every case of the ``rotary`` and ``rotary_apex`` benchmarks prints, per provider: ``wall`` (``do_bench``, host cost
included, what ``culmen bench`` reports), ``graph`` (CUDA-graph replay: device time only) and
``host`` (wall time per call at the quick shape, where the device work is negligible). ``--trace``
lists culmen's kernels of one call (torch.profiler); ``--sweep`` times culmen's device time under
one-at-a-time changes of ``culmen.ops.rotary.launch.TUNING``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from culmen.bench.registry import BenchConfig, load_benchmarks, select_benchmarks  # noqa: E402
from culmen.bench.tuning import host_us  # noqa: E402
from culmen.ops.rotary import launch as rotary_launch  # noqa: E402

SWEEP = {"elems": [2048, 8192, 16384], "elems_per_thread": [4, 16], "max_warps": [4, 16]}


def trace(fn):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]
    return "; ".join(f"{k[:60]} x{c} {t:.1f}us" for k, c, t in sorted(rows, key=lambda r: -r[2])[:8])


def main() -> None:
    from triton.testing import do_bench, do_bench_cudagraph

    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--providers", default="culmen,liger,compile")
    ap.add_argument("--only", default="", help="comma-separated substrings: time only cases whose label has one")
    args = ap.parse_args()
    want = args.providers.split(",")
    load_benchmarks()
    dev = torch.device("cuda")
    for bench in select_benchmarks(["rotary", "rotary_apex"]):
        quick = {c.label.split(" ", 1)[1]: c for c in bench.cases(BenchConfig(device=dev, quick=True))}
        for case in bench.cases(BenchConfig(device=dev)):
            tag = case.label.split(" ", 1)[1]
            if args.only and not any(o in case.label for o in args.only.split(",")):
                continue
            line = []
            for name in want:
                fn = case.providers.get(name)
                if fn is None:
                    continue
                w = do_bench(fn, warmup=25, rep=100, return_mode="median")
                g = do_bench_cudagraph(fn, rep=100, return_mode="median")
                q = quick.get(tag)
                h = host_us(q.providers[name]) if q is not None and name in q.providers else float("nan")
                gbps = case.bytes / (g * 1e6)
                line.append(f"{name}: wall {w:.4f} graph {g:.4f} ms ({gbps:.0f} GB/s dev) host {h:.0f} us")
            print(f"{bench.name} {case.label}: " + " | ".join(line), flush=True)
            if args.trace:
                print("   kernels:", trace(case.providers["culmen"]), flush=True)
            if args.sweep:
                base = dict(rotary_launch.TUNING)
                res = []
                for key, values in SWEEP.items():
                    for v in values:
                        rotary_launch.TUNING.update(base)
                        rotary_launch.TUNING[key] = v
                        rotary_launch.clear_cache()
                        _clear_plans()
                        res.append((do_bench_cudagraph(case.providers["culmen"], rep=60, return_mode="median"),
                                    key, v))
                rotary_launch.TUNING.update(base)
                rotary_launch.clear_cache()
                _clear_plans()
                res.sort()
                print("   sweep:", ", ".join(f"{k}={v}:{t:.4f}" for t, k, v in res[:6]), flush=True)
            del case
            torch.cuda.empty_cache()


def _clear_plans() -> None:
    from culmen.ops.rotary import op

    op._PLANS.clear()


if __name__ == "__main__":
    main()
