"""Sweep the launch settings of the rotary and softmax kernels over their registered benchmark cases.

Usage (GPU machine): ``python3 scripts/tune_rotary_softmax.py [--timer graph|wall] [NAME ...]``
(default: ``rotary rotary_apex softmax_padding softmax_causal softmax_long``). Times only culmen's
provider of each case (``culmen bench`` has the peers) under one-at-a-time changes of
``culmen.ops.rotary.launch.TUNING`` / ``culmen.ops.softmax.launch.TUNING`` and prints the default
time, its GB/s and the best few settings.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from culmen.bench.registry import BenchConfig, load_benchmarks, select_benchmarks  # noqa: E402
from culmen.bench.runner import default_device, time_ms  # noqa: E402
from culmen.ops.rotary import launch as rotary_launch  # noqa: E402
from culmen.ops.softmax import launch as softmax_launch  # noqa: E402

GRIDS = {
    "position": (rotary_launch.TUNING, {
        "elems": [1024, 2048, 8192, 16384],
        "elems_per_thread": [4, 16],
        "max_warps": [4, 16],
    }),
    "softmax": (softmax_launch.TUNING, {
        "fwd_max_resident": [4096, 8192, 32768],
        "bwd_max_resident": [4096, 16384],
        "fwd_elems": [2048, 8192, 16384],
        "bwd_elems": [2048, 8192, 16384],
        "chunk": [1024, 2048, 8192],
        "elems_per_thread": [8, 32],
        "max_warps": [8, 32],
    }),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*",
                    default=["rotary", "rotary_apex", "softmax_padding", "softmax_causal", "softmax_long"])
    ap.add_argument("--timer", choices=("wall", "graph"), default="graph")
    args = ap.parse_args()
    load_benchmarks()
    dev = default_device()
    for bench in select_benchmarks(args.names):
        tuning, grid = GRIDS[bench.family]
        base = dict(tuning)
        for case in bench.cases(BenchConfig(device=dev)):
            results = []
            for key, values in grid.items():
                for v in values:
                    tuning.update(base)  # every change of a TUNING table drops the cached plans
                    tuning[key] = v
                    try:
                        results.append((time_ms(case.providers["culmen"], dev, timer=args.timer), key, v))
                    except Exception as exc:  # a setting that fails to compile must not stop the sweep
                        print(f"  {key}={v} failed: {type(exc).__name__}: {exc}")
            tuning.update(base)
            results.sort()
            default = time_ms(case.providers["culmen"], dev, timer=args.timer)
            gbps = case.bytes / (default * 1e6) if case.bytes else float("nan")
            print(f"{bench.name} {case.label}: default {default:.4f} ms ({gbps:.0f} GB/s); best " +
                  ", ".join(f"{k}={v}:{t:.4f}" for t, k, v in results[:5]), flush=True)
            del case
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
