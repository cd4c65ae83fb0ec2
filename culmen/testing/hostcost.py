"""Measure the host path of culmen's ops without a GPU: fake kernels and a count of the calls made.

``fake_kernels()`` makes every ``culmen.ops.common.launch.Launch`` on CPU tensors behave like a bound
CUDA launch whose kernel does nothing (the call is recorded), so an op's cached eager path runs exactly
as it would on a GPU, minus the kernel. ``count_calls(fn)`` runs ``fn`` under ``sys.setprofile`` and
counts the Python functions culmen calls and the C functions (torch ops, tensor methods) culmen's code
calls: on the GPU test machine each torch call costs 3-11 us of host time, a Python call 0.2 us, so
these two numbers are what the host cost of a cached call is made of.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import culmen

_ROOT = os.path.dirname(os.path.abspath(culmen.__file__)) + os.sep
_SKIP = (os.path.join(_ROOT, "testing") + os.sep,)


@dataclass
class CallCount:
    """What one run of a function cost in calls made from culmen's code."""

    python: int = 0
    """Python functions of culmen entered (``call`` events in culmen's files)."""
    c: int = 0
    """C functions (torch ops, tensor methods, builtins) called from culmen's frames."""
    py_names: Counter = field(default_factory=Counter)
    c_names: Counter = field(default_factory=Counter)

    def __str__(self) -> str:
        py = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in self.py_names.most_common())
        c = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in self.c_names.most_common())
        return f"{self.python} Python calls [{py}]; {self.c} C calls [{c}]"


def _in_culmen(filename: str) -> bool:
    return filename.startswith(_ROOT) and not filename.startswith(_SKIP)


def count_calls(fn: Callable[[], Any]) -> CallCount:
    """Run ``fn()`` once and count the calls culmen's code makes (see ``CallCount``)."""
    out = CallCount()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if _in_culmen(code.co_filename):
                out.python += 1
                out.py_names[code.co_qualname if hasattr(code, "co_qualname") else code.co_name] += 1
        elif event == "c_call":
            if _in_culmen(frame.f_code.co_filename):
                out.c += 1
                out.c_names[getattr(arg, "__qualname__", getattr(arg, "__name__", repr(arg)))] += 1

    prev = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(prev)
    return out


@contextlib.contextmanager
def fake_kernels() -> Iterator[list]:
    """Run culmen's Triton plans on CPU tensors with kernels that do nothing; yields the list of
    recorded launches (grid and stream of each). Plans built inside the block are dropped on exit.
    Needs ``TRITON_INTERPRET=1`` (set by the test suite on machines without a GPU)."""
    from culmen.ops import backend
    from culmen.ops.common import launch
    from culmen.ops.common.plans import clear_plans

    launched: list = []

    def fake_run(gx, gy, gz, stream, *args):
        launched.append((gx, gy, gz, stream))

    prev = launch._FAKE_RUN
    launch._FAKE_RUN = fake_run
    clear_plans()
    try:
        with backend.use_backend("triton"):
            yield launched
    finally:
        launch._FAKE_RUN = prev
        clear_plans()


def assert_host_budget(fn: Callable[[], Any], python: int, c: int, warmup: int = 2) -> CallCount:
    """Run ``fn`` ``warmup`` times (plans get built and cached), then count one more call and fail when
    culmen made more Python or C calls than the budget. Returns the count (for reports)."""
    for _ in range(warmup):
        fn()
    n = count_calls(fn)
    assert n.python <= python and n.c <= c, f"host path over budget ({python} Python, {c} C calls): {n}"
    return n
