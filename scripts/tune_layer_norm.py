"""Sweep the launch settings of the layer_norm kernels over the registered benchmark cases.

Usage (GPU machine): ``python3 scripts/tune_layer_norm.py [--timer graph|wall] [NAME ...]``.
Times only culmen's provider of each ``layer_norm`` / ``rms_norm`` case (``culmen bench`` has the
peers) under each setting of ``culmen.ops.layer_norm.launch.TUNING`` below, and prints the best few.
Results feed ``bench/notes/layer_norm.md``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from culmen.bench.registry import BenchConfig, load_benchmarks, select_benchmarks  # noqa: E402
from culmen.bench.runner import default_device, time_ms  # noqa: E402
from culmen.ops.layer_norm import launch  # noqa: E402

GRID = {
    "elems_per_thread": [8, 16, 32],
    "fwd_elems": [2048, 4096, 8192],
    "bwd_elems": [2048, 4096, 8192],
    "bwd_programs_per_sm": [1, 2, 4, 8],
    "fwd_max_resident": [8192, 16384, 65536],
    "bwd_max_resident": [4096, 8192, 16384],
    "chunk": [2048, 4096, 8192],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=["layer_norm", "rms_norm"])
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
            print(f"{bench.name} {case.label}: default {default:.4f} ms; best " +
                  ", ".join(f"{k}={v}:{t:.4f}" for t, k, v in results[:5]), flush=True)
            del case
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
