"""``apex.parallel`` on ``torch.distributed``: DistributedDataParallel, Reducer, SyncBatchNorm, LARC.

``python -m culmen.parallel.multiproc script.py args`` launches one process per GPU (through torchrun).
Importing this package does not initialize anything; ``LARC`` is imported on first use.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from culmen.parallel.distributed import DistributedDataParallel, ReduceOp, Reducer, flat_dist_call
from culmen.parallel.sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

__all__ = [
    "LARC",
    "DistributedDataParallel",
    "ReduceOp",
    "Reducer",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
    "flat_dist_call",
]


def __getattr__(name: str) -> Any:
    if name == "LARC":  # imported on first use: it pulls in the multi-tensor kernels
        return importlib.import_module("culmen.parallel.LARC").LARC
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """Importing the submodule ``culmen.parallel.LARC`` binds the package attribute ``LARC`` to that module;
    keep it the class (as Apex's ``from apex.parallel import LARC`` gives)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "LARC" and isinstance(value, types.ModuleType):
            value = value.LARC
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
