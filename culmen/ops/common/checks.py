"""When ops check the *values* of index / label tensors (not only their shapes and dtypes)."""

from __future__ import annotations

import os

import torch
from torch import Tensor


def check_values_enabled(t: Tensor) -> bool:
    """Whether to check the values of ``t`` (index ranges, label sets) before launching a kernel.

    Always on CPU. On a GPU the check needs a device-to-host copy that stalls the stream, so it runs
    only with ``CULMEN_CHECK_VALUES=1``, and never under ``torch.compile`` or CUDA-graph capture. Kernels
    that use the checked values must stay memory-safe on bad values either way.
    """
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cpu":
        return True
    if os.environ.get("CULMEN_CHECK_VALUES", "0") in ("", "0"):
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
