"""Benchmark registry: ``@register_benchmark`` over a generator of ``Case`` objects, and
``@register_suite`` for end-to-end benchmarks that time whole programs themselves.

A benchmark function takes a ``BenchConfig`` and yields cases one at a time, so that only one
case's tensors are alive while it is timed. Every provider of a case (culmen and each peer) is a
zero-argument callable closed over the SAME input tensors; the runner times them.

A suite function (``train_step``) takes a ``BenchConfig`` and an output stream, prints its own table
and yields one ``SuiteResult`` per case (runner ``Record`` objects for the summary, plus a detail dict
for the JSON report). Suites registered with ``default=False`` run only when named.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

# Modules whose import registers benchmarks; culmen bench imports them all (add new ones here).
BENCH_MODULES: tuple[str, ...] = (
    "culmen.bench.norms",
    "culmen.bench.optimizers",
    "culmen.bench.amp",
    "culmen.bench.rotary",
    "culmen.bench.softmax",
    "culmen.bench.cross_entropy",
    "culmen.bench.activations",
    "culmen.bench.mlp",
    "culmen.bench.attention",
    "culmen.bench.decode",
    "culmen.bench.group_norm",
    "culmen.bench.train_step",
    "culmen.bench.hf_models",
    "culmen.bench.parallel_models",
    "culmen.bench.rnn",
    "culmen.bench.transducer",
    "culmen.bench.sparsity",
    "culmen.bench.multihead_attn",
    "culmen.bench.openfold",
    "culmen.bench.conv_epilogue",
)

CULMEN = "culmen"
"""Name of culmen's own provider; every other provider of a case is a peer."""


@dataclass
class Case:
    """One timed configuration of a benchmark.

    Attributes:
        label: shape / dtype / mode, e.g. ``"16384x4096 bf16 fwd"``.
        providers: provider name (``"culmen"``, ``"torch"``, ``"compile"``, ``"liger"`` ...) →
            zero-argument callable doing the work once.
        bytes: fewest bytes the work must move (each input read once, each output written once).
        flops: floating-point operations, for compute-bound work.
        reference: the provider whose output the others are checked against.
        check: ``check(output, reference_output) -> {tensor_name: max_abs_diff}``; the default
            compares the outputs tensor by tensor. ``None`` output from a provider means "nothing to
            compare".
        notes: remarks printed under the case (a skipped peer and why).
        informational: providers timed and shown but never counted as the best peer (a different,
            non-equivalent algorithm kept for context, e.g. a lower-precision variant).
    """

    label: str
    providers: dict[str, Callable[[], Any]]
    bytes: int | None = None
    flops: int | None = None
    reference: str = "torch"
    check: Callable[[Any, Any], dict[str, float]] | None = None
    notes: list[str] = field(default_factory=list)
    informational: tuple[str, ...] = ()


@dataclass(frozen=True)
class BenchConfig:
    """What a benchmark function is asked for: the device, whether to use tiny shapes, and options
    that only some benchmarks read (``train_step``'s sizes, modes, steps ...; see ``culmen bench -h``)."""

    device: torch.device
    quick: bool = False
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass
class SuiteResult:
    """One case of a suite: runner records (``culmen.bench.runner.Record``) and a JSON-able detail row."""

    records: list[Any]
    detail: dict[str, Any]


@dataclass(frozen=True)
class Benchmark:
    """A registered benchmark: a case generator ``fn``, or a self-timing ``suite``."""

    name: str
    family: str
    fn: Callable[[BenchConfig], Iterator[Case]] | None
    description: str = ""
    suite: Callable[[BenchConfig, TextIO], Iterator[SuiteResult]] | None = None
    default: bool = True
    """Run by a plain ``culmen bench`` (no names); False: only when named (long end-to-end suites)."""

    def cases(self, cfg: BenchConfig) -> Iterator[Case]:
        """The benchmark's cases for ``cfg``, built lazily (none for a suite)."""
        return iter(self.fn(cfg)) if self.fn is not None else iter(())


_BENCHMARKS: dict[str, Benchmark] = {}


def register_benchmark(name: str, family: str) -> Callable[[Callable[[BenchConfig], Iterator[Case]]], Callable]:
    """Decorator registering ``fn(cfg: BenchConfig) -> Iterator[Case]`` as benchmark ``name``."""

    def deco(fn: Callable[[BenchConfig], Iterator[Case]]) -> Callable[[BenchConfig], Iterator[Case]]:
        doc = (fn.__doc__ or "").strip().splitlines()
        _BENCHMARKS[name] = Benchmark(name, family, fn, doc[0] if doc else "")
        return fn

    return deco


def register_suite(name: str, family: str, default: bool = False) -> Callable:
    """Decorator registering ``fn(cfg: BenchConfig, out: TextIO) -> Iterator[SuiteResult]`` as benchmark
    ``name``: it times its cases itself and prints its own table. ``default=False``: not part of a plain
    ``culmen bench``; run it by name."""

    def deco(fn: Callable[[BenchConfig, TextIO], Iterator[SuiteResult]]) -> Callable:
        doc = (fn.__doc__ or "").strip().splitlines()
        _BENCHMARKS[name] = Benchmark(name, family, None, doc[0] if doc else "", suite=fn, default=default)
        return fn

    return deco


def load_benchmarks() -> dict[str, str]:
    """Import every module of ``BENCH_MODULES``; return ``{module: error}`` for those that failed."""
    failed: dict[str, str] = {}
    for mod in BENCH_MODULES:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # a broken benchmark module must not hide the others
            failed[mod] = f"{type(exc).__name__}: {exc}"
    return failed


def registered_benchmarks() -> list[Benchmark]:
    """All registered benchmarks, grouped by family, in registration order within a family."""
    return sorted(_BENCHMARKS.values(), key=lambda b: b.family)


def select_benchmarks(names: list[str] | None) -> list[Benchmark]:
    """Benchmarks matching ``names`` (benchmark names or families); when empty, all of them except those
    registered with ``default=False``.

    Raises ``KeyError`` naming the unknown entries.
    """
    benches = registered_benchmarks()
    if not names:
        return [b for b in benches if b.default]
    unknown = [n for n in names if not any(n in (b.name, b.family) for b in benches)]
    if unknown:
        known = ", ".join(b.name for b in benches)
        raise KeyError(f"unknown benchmark(s) {unknown}; known: {known}")
    return [b for b in benches if b.name in names or b.family in names]
