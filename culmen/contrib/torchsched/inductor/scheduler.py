"""``apex.contrib.torchsched.inductor.scheduler``: Apex's Inductor ``Scheduler`` subclass (not needed by culmen)."""

from __future__ import annotations

from typing import Any

from culmen.contrib.torchsched.inductor._common import USE_INSTEAD

__all__ = ["MultiCudaStreamScheduler"]


class MultiCudaStreamScheduler:
    """Apex: Inductor's scheduler with the critical path on the default stream and other nodes on side streams.

    culmen's equivalent works on the AOTAutograd graph: ``culmen.contrib.torchsched.scheduler.plan_streams``
    (critical path by a cost model, side streams, events). Constructing this class raises
    ``NotImplementedError`` naming it.
    """

    def __init__(self, operations: list[Any]) -> None:
        raise NotImplementedError(f"MultiCudaStreamScheduler (an Inductor Scheduler subclass): {USE_INSTEAD}")
