"""Cached call plans: what an op derives once per call signature and reuses on every later call.

Every op family keeps its plans in a ``PlanCache`` keyed by the call signature (shapes, strides,
dtypes, device, flags and scalar arguments: everything its checks and launch geometry depend on).
Building a plan runs the full validation (a bad call raises there and caches nothing); a hit costs a
dict lookup. The switches of ``culmen.ops.backend`` and the tuning tables drop every plan through
``clear_plans``, so a plan never outlives the settings it was built under.
"""

from __future__ import annotations

import atexit
from typing import Any

_CACHES: list[PlanCache] = []


class PlanCache(dict):
    """``signature -> plan`` for one op family, bounded (cleared whole when full: signatures seen in a
    training loop are few, and a flood of new ones means the cache would not help anyway)."""

    def __init__(self, name: str, maxsize: int = 4096) -> None:
        super().__init__()
        self.name = name
        self.maxsize = maxsize
        _CACHES.append(self)

    def put(self, key: Any, plan: Any) -> Any:
        """Store ``plan`` under ``key`` and return it."""
        if len(self) >= self.maxsize:
            self.clear()
        self[key] = plan
        return plan


def clear_plans() -> None:
    """Drop every cached plan of every op family (after a switch or tuning table changed)."""
    for cache in _CACHES:
        cache.clear()


# Plans hold process groups (SyncBatchNorm, vocab-parallel cross-entropy). Left to the interpreter's
# final teardown, a gloo group's destructor ran with its worker threads still joinable and the process
# aborted ("terminate called without an active exception") after a clean run; drop them at exit instead.
atexit.register(clear_plans)


def plan_caches() -> list[PlanCache]:
    """The registered caches (for tests and ``culmen info``)."""
    return list(_CACHES)
