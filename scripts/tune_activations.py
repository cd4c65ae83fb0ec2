"""Sweep the launch settings of the activation kernels over the registered benchmark cases.

Usage (GPU machine): ``python3 scripts/tune_activations.py [--timer graph|wall] [NAME ...]``
(default: ``bias_gelu relu swiglu``). Times only culmen's provider of each case (``culmen bench`` has
the peers) under one-at-a-time changes of ``culmen.ops.activations.launch.TUNING`` and prints the
default time, its GB/s and the best few settings.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from culmen.bench.registry import BenchConfig, load_benchmarks, select_benchmarks  # noqa: E402
from culmen.bench.runner import default_device, time_ms  # noqa: E402
from culmen.ops.activations import launch  # noqa: E402

GRID = {
    "block_elems": [1024, 2048, 8192, 16384],
    "warps": [2, 8, 16],
    "max_block_n": [256, 512, 2048],
    "dbias_block_m": [8, 16, 64],
    "dbias_block_n": [64, 256, 512],
    "dbias_warps": [2, 8],
    "dbias_programs_per_sm": [2, 4, 16],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=["bias_gelu", "relu", "swiglu"])
    ap.add_argument("--timer", choices=("wall", "graph"), default="graph")
    args = ap.parse_args()
    load_benchmarks()
    dev = default_device()
    base = dict(launch.TUNING)
    for bench in select_benchmarks(args.names):
        for case in bench.cases(BenchConfig(device=dev)):
            results = []
            for key, values in GRID.items():
                for v in values:
                    launch.TUNING.update(base)
                    launch.TUNING[key] = v
                    try:
                        results.append((time_ms(case.providers["culmen"], dev, timer=args.timer), key, v))
                    except Exception as exc:  # a setting that fails to compile must not stop the sweep
                        print(f"  {key}={v} failed: {type(exc).__name__}")
            launch.TUNING.update(base)
            results.sort()
            default = time_ms(case.providers["culmen"], dev, timer=args.timer)
            gbps = case.bytes / (default * 1e6) if case.bytes else float("nan")
            print(f"{bench.name} {case.label}: default {default:.4f} ms ({gbps:.0f} GB/s); best " +
                  ", ".join(f"{k}={v}:{t:.4f}" for t, k, v in results[:5]), flush=True)
            del case
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
