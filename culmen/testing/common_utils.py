"""``apex.testing.common_utils`` (ROCm Apex's test helpers, which Apex's own test files import).

``TEST_WITH_ROCM`` is true when ``APEX_TEST_WITH_ROCM`` is set to a non-zero value or the running torch is
a ROCm build; ``skipIfRocm`` skips a test then. ``SKIP_FLAKY_TEST`` follows ``APEX_SKIP_FLAKY_TEST``;
``skipFlakyTest`` skips a test then.
"""

from __future__ import annotations

import functools
import os
import unittest
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SKIP_FLAKY_TEST", "TEST_WITH_ROCM", "skipFlakyTest", "skipIfRocm"]


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no")


TEST_WITH_ROCM = _flag("APEX_TEST_WITH_ROCM") or getattr(torch.version, "hip", None) is not None
SKIP_FLAKY_TEST = _flag("APEX_SKIP_FLAKY_TEST")


def _skip_when(condition: bool, reason: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if condition:
                raise unittest.SkipTest(reason)
            return fn(*args, **kwargs)

        return wrapper

    return deco


def skipIfRocm(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Skip the decorated test on ROCm (see ``TEST_WITH_ROCM``)."""
    return _skip_when(TEST_WITH_ROCM, "test doesn't currently work on the ROCm stack")(fn)


def skipFlakyTest(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Skip the decorated test when ``APEX_SKIP_FLAKY_TEST`` is set."""
    return _skip_when(SKIP_FLAKY_TEST, "test is flaky (APEX_SKIP_FLAKY_TEST is set)")(fn)
