"""One-at-a-time sweeps of a launcher's ``TUNING`` dict over registered benchmark cases.

Used by the ``scripts/tune_*.py`` scripts: each setting of ``grid`` is applied alone on top of the
defaults, culmen's provider of every case is timed (peers are ``culmen bench``'s job), and the
default time with the best few settings is printed.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from culmen.bench.registry import BenchConfig, load_benchmarks, select_benchmarks
from culmen.bench.runner import default_device, time_ms


def host_us(fn, n: int = 200, warmup: int = 10) -> float:
    """Microseconds per call of ``fn`` over ``n`` back-to-back calls, the GPU drained before and after
    (wall time per call: the host cost when the kernels are short, the device time when they are long)."""
    import time

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def sweep_tuning(tuning: dict[str, Any], grid: dict[str, Sequence[Any]], names: Sequence[str],
                 timer: str = "graph") -> None:
    """For every case of benchmarks ``names``: time each ``tuning[key] = value`` of ``grid`` (others at
    their defaults; a setting that fails is reported and skipped) and print the best five."""
    load_benchmarks()
    dev = default_device()
    base = dict(tuning)
    for bench in select_benchmarks(list(names)):
        for case in bench.cases(BenchConfig(device=dev)):
            results = []
            for key, values in grid.items():
                for v in values:
                    tuning.update(base)
                    tuning[key] = v
                    try:
                        results.append((time_ms(case.providers["culmen"], dev, timer=timer), key, v))
                    except Exception as exc:  # a setting that fails to compile must not stop the sweep
                        print(f"  {key}={v} failed: {type(exc).__name__}")
            tuning.update(base)
            results.sort()
            default = time_ms(case.providers["culmen"], dev, timer=timer)
            gbps = f" ({case.bytes / (default * 1e6):.0f} GB/s)" if case.bytes else ""
            print(f"{bench.name} {case.label}: default {default:.4f} ms{gbps}; best " +
                  ", ".join(f"{k}={v}:{t:.4f}" for t, k, v in results[:5]), flush=True)
            del case
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def sweep_main(tuning: dict[str, Any], grid: dict[str, Sequence[Any]], default_names: Sequence[str]) -> None:
    """Command line of a tuning script: ``[--timer graph|wall] [NAME ...]``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=list(default_names))
    ap.add_argument("--timer", choices=("wall", "graph"), default="graph")
    args = ap.parse_args()
    sweep_tuning(tuning, grid, args.names, args.timer)
