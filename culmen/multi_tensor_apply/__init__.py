"""Apex's ``apex.multi_tensor_apply``: ``multi_tensor_applier(op, noop_flag, tensor_lists, *args)``.

``op`` is one of the functions of :mod:`culmen.multi_tensor_apply.amp_C` (importable as ``amp_C``
through :mod:`culmen.compat`). Each call updates every tensor of the lists in a handful of Triton
launches (one per device/dtype group), whatever the number of tensors; on CPU tensors the ops run
their pure-PyTorch reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from culmen.multi_tensor_apply import amp_C

__all__ = ["MultiTensorApply", "amp_C", "multi_tensor_applier"]


class MultiTensorApply:
    """Calls ``op(chunk_size, noop_flag, tensor_lists, *args)`` (Apex's applier object).

    ``chunk_size`` is handed to the op for compatibility; culmen's kernels choose their own chunking,
    which never changes results. ``available`` is always True: nothing needs compiling.
    """

    available = True
    warned = False
    import_err = None

    def __init__(self, chunk_size: int) -> None:
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"MultiTensorApply: chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Apex raises here when its extension is missing; culmen's kernels are always available."""

    def __call__(self, op: Callable[..., Any], noop_flag_buffer, tensor_lists, *args: Any) -> Any:
        self.check_avail()
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)
