"""Benchmark registry: ``@register_benchmark`` over a generator of ``Case`` objects.

A benchmark function takes a ``BenchConfig`` and yields cases one at a time, so that only one
case's tensors are alive while it is timed. Every provider of a case (culmen and each peer) is a
zero-argument callable closed over the SAME input tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

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
    "culmen.bench.group_norm",
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
    """What a benchmark function is asked for: the device and whether to use tiny shapes."""

    device: torch.device
    quick: bool = False


@dataclass(frozen=True)
class Benchmark:
    """A registered benchmark."""

    name: str
    family: str
    fn: Callable[[BenchConfig], Iterator[Case]]
    description: str = ""

    def cases(self, cfg: BenchConfig) -> Iterator[Case]:
        """The benchmark's cases for ``cfg``, built lazily."""
        return iter(self.fn(cfg))


_BENCHMARKS: dict[str, Benchmark] = {}


def register_benchmark(name: str, family: str) -> Callable[[Callable[[BenchConfig], Iterator[Case]]], Callable]:
    """Decorator registering ``fn(cfg: BenchConfig) -> Iterator[Case]`` as benchmark ``name``."""

    def deco(fn: Callable[[BenchConfig], Iterator[Case]]) -> Callable[[BenchConfig], Iterator[Case]]:
        doc = (fn.__doc__ or "").strip().splitlines()
        _BENCHMARKS[name] = Benchmark(name, family, fn, doc[0] if doc else "")
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
    """Benchmarks matching ``names`` (benchmark names or families); all of them when empty.

    Raises ``KeyError`` naming the unknown entries.
    """
    benches = registered_benchmarks()
    if not names:
        return benches
    unknown = [n for n in names if not any(n in (b.name, b.family) for b in benches)]
    if unknown:
        known = ", ".join(b.name for b in benches)
        raise KeyError(f"unknown benchmark(s) {unknown}; known: {known}")
    return [b for b in benches if b.name in names or b.family in names]
