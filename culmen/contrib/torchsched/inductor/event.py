"""``apex.contrib.torchsched.inductor.event``: symbolic CUDA events of a multi-stream schedule.

A ``CudaEventFactory`` hands out ``CudaEventSym`` objects numbered in creation order; an event recorded on one
stream and waited on by others is "materialized" (given a variable name in generated code) only when something
waits on it, and a name is reused once its last waiter has run. ``record`` / ``wait`` return line objects whose
``codegen(code)`` writes the Python statements to any buffer with a ``writeline(str)`` method (Inductor's
``IndentedBuffer`` has one). Generate every ``wait`` of an event before generating its ``record`` line, as
Inductor's two-pass wrapper does: the record only materializes an event that has waiters.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import culmen.contrib.torchsched.config as torchsched_config
from culmen.contrib.torchsched.inductor._common import (
    DEFAULT_STREAM_IDX,
    ENTRANCE_EVENT,
    EVENT_NAME_TEMPLATE,
    get_stream_name,
)

__all__ = ["CudaEventFactory", "CudaEventSym"]


@functools.total_ordering
@dataclasses.dataclass(eq=False)
class CudaEventSym:
    """One symbolic event.

    Args:
        factory: the ``CudaEventFactory`` that made it (events of different factories do not compare).
        idx: creation order (0 is the graph's entrance event).
        originate_stream_idx: the stream it is recorded on.
        ref_count: waits still to generate.
        materialized_event: its variable name in generated code, while materialized.
    """

    factory: CudaEventFactory
    idx: int
    originate_stream_idx: int
    ref_count: int = 0
    materialized_event: str | None = None

    def _key(self) -> tuple[int, int]:
        return self.idx, self.originate_stream_idx

    def __lt__(self, rhs: object) -> bool:
        if not isinstance(rhs, CudaEventSym) or rhs.factory is not self.factory:
            return NotImplemented
        return self._key() < rhs._key()

    def __eq__(self, rhs: object) -> bool:
        if not isinstance(rhs, CudaEventSym):
            return NotImplemented
        return rhs.factory is self.factory and rhs._key() == self._key()

    def __hash__(self) -> int:
        return hash((id(self.factory), *self._key()))

    def record(self, stream_idx: int) -> _EventRecordLine:
        """The line recording this event on stream ``stream_idx`` (emitted only if the event has waiters, or
        when the factory does not reuse events)."""
        return _EventRecordLine(self, get_stream_name(stream_idx))

    def wait(self, stream_idx: int) -> _EventWaitLine:
        """The line making stream ``stream_idx`` wait for this event; counts one more waiter."""
        if stream_idx == self.originate_stream_idx:
            raise ValueError(f"stream {stream_idx} cannot wait on its own event {self}")
        self.ref_count += 1
        return _EventWaitLine(self, get_stream_name(stream_idx))


@dataclasses.dataclass
class _EventRecordLine:
    event: CudaEventSym
    stream: str

    def codegen(self, code: Any) -> None:
        ev = self.event
        if ev.ref_count or not ev.factory.reuse_cuda_event:
            ev.materialized_event = ev.factory.get_materialized_event(code)
            code.writeline(f"{ev.materialized_event}.record({self.stream})")


@dataclasses.dataclass
class _EventWaitLine:
    event: CudaEventSym
    stream: str

    def codegen(self, code: Any) -> None:
        ev = self.event
        if ev.materialized_event is None or ev.ref_count <= 0:
            raise RuntimeError(f"wait on {ev} generated before its record")
        line = f"{ev.materialized_event}.wait({self.stream})"
        ev.ref_count -= 1
        if ev.ref_count == 0:
            ev.factory.deposit_materialized_event(ev.materialized_event)
            ev.materialized_event = None
        code.writeline(line)


class CudaEventFactory:
    """Makes ``CudaEventSym`` objects in order and manages the pool of materialized event names
    (``config.reuse_cuda_event`` at construction decides whether names are reused)."""

    def __init__(self) -> None:
        self.symbolic_event_idx = itertools.count(start=1)
        self.materialized_event_idx = itertools.count(start=1)
        self.available_materialized_events: set[str] = set()
        self.reuse_cuda_event = bool(torchsched_config.reuse_cuda_event)
        self._entrance_event: CudaEventSym | None = None

    def get_entrance_event(self) -> CudaEventSym:
        """The event recorded on the default stream when the graph starts (always materialized)."""
        if self._entrance_event is None:
            self._entrance_event = CudaEventSym(self, 0, DEFAULT_STREAM_IDX, materialized_event=ENTRANCE_EVENT)
        return self._entrance_event

    def get_sym_event(self, originate_stream_idx: int) -> CudaEventSym:
        """A new event recorded on stream ``originate_stream_idx``."""
        return CudaEventSym(self, next(self.symbolic_event_idx), originate_stream_idx)

    def get_materialized_event(self, code: Any) -> str:
        """A free event name (a reused one, or a new ``torch.cuda.Event()`` written to ``code``)."""
        if self.reuse_cuda_event and self.available_materialized_events:
            return self.available_materialized_events.pop()
        name = EVENT_NAME_TEMPLATE.format(event_idx=next(self.materialized_event_idx))
        code.writeline(f"{name} = torch.cuda.Event()")
        return name

    def deposit_materialized_event(self, event: str) -> None:
        """Give back the name ``event`` once its last waiter has been generated."""
        if event in self.available_materialized_events:
            raise ValueError(f"event {event!r} was already given back")
        self.available_materialized_events.add(event)
