"""Wall-clock timers for pipeline steps (Apex's ``apex.transformer.pipeline_parallel._timers``).

``_Timers()(name)`` returns (creating on first use) a ``_Timer``; ``start``/``stop`` accumulate the
elapsed seconds. On a GPU each start/stop synchronizes the device first, so the time covers the
kernels queued before it, as in Apex; on a CPU-only machine nothing is synchronized.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["_Timer", "_Timers"]


def _sync() -> None:
    # Only a device that was actually used has queued work; initializing CUDA here would be a side effect.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Timer:
    """One named timer: ``start()``, ``stop()``, ``elapsed(reset=True)`` (seconds), ``reset()``."""

    def __init__(self, name: str):
        self.name_ = name
        self.elapsed_ = 0.0
        self.started_ = False
        self.start_time = time.time()

    def start(self) -> None:
        """Start timing; raises ``RuntimeError`` if already started."""
        if self.started_:
            raise RuntimeError(f"timer {self.name_!r} has already been started")
        _sync()
        self.start_time = time.time()
        self.started_ = True

    def stop(self) -> None:
        """Stop timing and add the interval; raises ``RuntimeError`` if not started."""
        if not self.started_:
            raise RuntimeError(f"timer {self.name_!r} is not started")
        _sync()
        self.elapsed_ += time.time() - self.start_time
        self.started_ = False

    def reset(self) -> None:
        """Forget the accumulated time and stop."""
        self.elapsed_ = 0.0
        self.started_ = False

    def elapsed(self, reset: bool = True) -> float:
        """Accumulated seconds (a running timer is stopped, read and restarted); ``reset`` clears them."""
        running = self.started_
        if running:
            self.stop()
        value = self.elapsed_
        if reset:
            self.reset()
        if running:
            self.start()
        return value


class _Timers:
    """A group of ``_Timer`` by name: ``timers("forward").start()``; ``log`` / ``write`` report them."""

    def __init__(self):
        self.timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        timer = self.timers.get(name)
        if timer is None:
            timer = self.timers[name] = _Timer(name)
        return timer

    def write(self, names: list[str], writer: Any, iteration: int, normalizer: float = 1.0,
              reset: bool = False) -> None:
        """Add ``<name>-time`` scalars (seconds / ``normalizer``) to a TensorBoard-style ``writer``."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        for name in names:
            writer.add_scalar(name + "-time", self.timers[name].elapsed(reset=reset) / normalizer, iteration)

    def log(self, names: list[str], normalizer: float = 1.0, reset: bool = True) -> None:
        """Print ``time (ms) | name: t | ...`` on the last rank (or the only process)."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        parts = ["time (ms)"]
        for name in names:
            parts.append(f"{name}: {self.timers[name].elapsed(reset=reset) * 1000.0 / normalizer:.2f}")
        line = " | ".join(parts)
        if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
            print(line, flush=True)
