"""LayerNorms that record ``sequence_parallel_enabled`` on themselves and on their parameters.

Under sequence parallelism each tensor-parallel rank normalizes its own slice of the sequence with a
replicated weight and bias, so each rank's weight/bias gradients are partial sums: the training loop (or
Megatron's grad all-reduce) must sum them over the tensor-parallel group. These modules are culmen's
:class:`culmen.normalization.FusedLayerNorm`, :class:`culmen.normalization.MixedFusedLayerNorm` and
:class:`culmen.contrib.layer_norm.FastLayerNorm` (same kernels, same forward) with the keyword
``sequence_parallel_enabled``, stored as ``module.sequence_parallel_enabled`` and as the attribute
``param.sequence_parallel_enabled`` on ``weight`` and ``bias`` so that code can find those parameters.

Unlike Apex, ``MixedFusedLayerNorm`` marks its parameters with ``False`` too (Apex left them unmarked),
and ``FastLayerNorm`` is always the fast kernel (culmen's takes any hidden size; Apex fell back to
``FusedLayerNorm`` when its extension was missing).
"""

from __future__ import annotations

from typing import Any

import torch

from culmen.contrib.layer_norm import FastLayerNorm as _BaseFastLayerNorm
from culmen.normalization import FusedLayerNorm as _BaseFusedLayerNorm
from culmen.normalization import MixedFusedLayerNorm as _BaseMixedFusedLayerNorm

__all__ = ["FusedLayerNorm", "FastLayerNorm", "MixedFusedLayerNorm"]


def _mark(module: torch.nn.Module, enabled: Any) -> None:
    if not isinstance(enabled, bool):
        raise TypeError(f"sequence_parallel_enabled must be a bool, got {enabled!r}")
    module.sequence_parallel_enabled = enabled
    for p in (getattr(module, "weight", None), getattr(module, "bias", None)):
        if p is not None:
            p.sequence_parallel_enabled = enabled


class FusedLayerNorm(_BaseFusedLayerNorm):
    """:class:`culmen.normalization.FusedLayerNorm` with ``sequence_parallel_enabled`` marking its parameters.

    Args:
        normalized_shape, eps, elementwise_affine: as ``apex.normalization.FusedLayerNorm``.
        sequence_parallel_enabled: the input is a sequence shard; the parameters' gradients need a sum
            over the tensor-parallel group.
        memory_efficient, device, dtype: passed to the base module (keyword only).

    Shape: input ``(*, *normalized_shape)``, output the same shape and dtype.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, *,
                 sequence_parallel_enabled: bool = False, memory_efficient: bool = False,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=elementwise_affine,
                         memory_efficient=memory_efficient, device=device, dtype=dtype)
        _mark(self, sequence_parallel_enabled)


class MixedFusedLayerNorm(_BaseMixedFusedLayerNorm):
    """:class:`culmen.normalization.MixedFusedLayerNorm` (output in the parameter dtype) with
    ``sequence_parallel_enabled`` (a keyword in ``**kwargs``, as in Apex) marking its parameters."""

    def __init__(self, normalized_shape, eps: float = 1e-5, **kwargs: Any) -> None:
        enabled = kwargs.pop("sequence_parallel_enabled", False)
        super().__init__(normalized_shape=normalized_shape, eps=eps, **kwargs)
        _mark(self, enabled)


class FastLayerNorm(_BaseFastLayerNorm):
    """:class:`culmen.contrib.layer_norm.FastLayerNorm` (LayerNorm over the last dim, output in the parameter
    dtype) with ``sequence_parallel_enabled`` marking its parameters.

    Shape: input ``(*, hidden_size)``, output the same shape.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, sequence_parallel_enabled: bool = False,
                 memory_efficient: bool = False, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size=hidden_size, eps=eps, memory_efficient=memory_efficient, device=device,
                         dtype=dtype)
        _mark(self, sequence_parallel_enabled)
