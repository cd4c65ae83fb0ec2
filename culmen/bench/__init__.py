"""Benchmark registry and runner behind ``culmen bench``.

Each benchmark times culmen and every available peer (PyTorch eager, ``torch.compile``,
Liger-Kernel, Apex) in the same process on the same inputs, against a measured copy-bandwidth
roofline. Register one with ``@register_benchmark(name, family)`` over a generator of ``Case``
objects and list its module in ``culmen.bench.registry.BENCH_MODULES``.
"""

from culmen.bench.registry import (
    CULMEN,
    BenchConfig,
    Benchmark,
    Case,
    load_benchmarks,
    register_benchmark,
    registered_benchmarks,
    select_benchmarks,
)
from culmen.bench.runner import BenchReport, Record, measure_roofline, run_benchmarks, time_ms

__all__ = [
    "CULMEN",
    "BenchConfig",
    "BenchReport",
    "Benchmark",
    "Case",
    "Record",
    "load_benchmarks",
    "measure_roofline",
    "register_benchmark",
    "registered_benchmarks",
    "run_benchmarks",
    "select_benchmarks",
    "time_ms",
]
