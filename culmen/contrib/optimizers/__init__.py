"""``apex.contrib.optimizers``: ZeRO optimizers on torch.distributed and the deprecated old-API fused optimizers.

Loaded on first attribute access (importing this package imports nothing else):

* :class:`DistributedFusedAdam` (``distributed_fused_adam``), :class:`DistributedFusedLAMB`
  (``distributed_fused_lamb``): optimizer state and gradients sharded over the data-parallel ranks;
* :class:`FusedAdam`, :class:`FusedLAMB`, :class:`FusedSGD`: Apex's pre-``apex.optimizers`` API (``step``
  taking ``grads``, ``output_params``, ``scale``, ``grad_norms``), on culmen's multi-tensor kernels;
* :class:`FP16_Optimizer` (``fp16_optimizer``): their master-weight wrapper (flat fp32 masters, loss scaling).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "DistributedFusedAdam": "distributed_fused_adam",
    "DistributedFusedLAMB": "distributed_fused_lamb",
    "FusedAdam": "fused_adam",
    "FusedLAMB": "fused_lamb",
    "FusedSGD": "fused_sgd",
    "FP16_Optimizer": "fp16_optimizer",
}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value
