"""``flash_attn.losses.cross_entropy``: the ``CrossEntropyLoss`` module, plus culmen's fused linear loss.

``CrossEntropyLoss`` has flash_attn 2.8's arguments, defaults and return convention (the loss, or
``(loss, z_loss)`` with ``return_z_loss``; ``mean`` divides by the number of non-ignored rows).
Differences: it runs on CPU too, accepts ``(..., vocab)`` input with ``(...)`` targets, and invalid
labels raise / give NaN (see ``culmen.flash_attn.ops.triton.cross_entropy``). Both modules call
culmen's ops directly (``culmen.ops.cross_entropy``), whose cached plans hold every check.

``FusedLinearCrossEntropyLoss`` is culmen's addition (flash_attn has none): the loss of
``hidden @ weight.T + bias`` computed in token chunks without materialising the logits, see
:func:`culmen.ops.cross_entropy.fused_linear_cross_entropy`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from culmen.ops.cross_entropy import cross_entropy, fused_linear_cross_entropy
from culmen.ops.cross_entropy.launch import check_scalars

__all__ = ["CrossEntropyLoss", "FusedLinearCrossEntropyLoss"]

_REDUCTIONS = ("mean", "none", "sum")


class CrossEntropyLoss(nn.Module):
    """Softmax cross-entropy with label smoothing, logit scale, z-loss and a vocab-parallel mode.

    Args:
        ignore_index: rows with this target get loss 0 (and are not counted by ``mean``).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        label_smoothing: in ``[0, 1]``. logit_scale: multiplies the logits first.
        lse_square_scale: adds ``lse_square_scale * lse^2`` (z-loss) to the loss.
        inplace_backward: write the gradient into the input logits (saves memory).
        process_group: tensor parallel: each rank's input is its equal, contiguous slice of the vocab.
        return_z_loss: also return the z-loss part (reduced the same way; for logging).

    The reduction runs inside the op (a one-program kernel on the GPU), not as PyTorch ops.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 logit_scale: float = 1.0, lse_square_scale: float = 0.0, inplace_backward: bool = False,
                 process_group: dist.ProcessGroup | None = None, return_z_loss: bool = False):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise NotImplementedError(f"Only support reduction = 'mean' or 'none' or 'sum', got {reduction!r}")
        check_scalars(label_smoothing, lse_square_scale, None, logit_scale)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.logit_scale = logit_scale
        self.lse_square_scale = lse_square_scale
        self.inplace_backward = inplace_backward
        self.process_group = process_group
        self.return_z_loss = return_z_loss

    def forward(self, input: Tensor, target: Tensor, precomputed_lse: Tensor | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        """``input (..., vocab)`` logits (this rank's vocab slice with a process group), ``target (...)``.

        Returns the fp32 loss (0-dim, or ``target``'s shape for ``"none"``), or ``(loss, z_loss)``.
        """
        dim = input.dim() if isinstance(input, Tensor) else 0
        if dim < 1:
            raise ValueError(f"input must be a tensor (..., vocab), got {getattr(input, 'shape', type(input))}")
        lead = getattr(target, "shape", None)
        if lead != input.shape[:-1]:
            raise ValueError(f"target must have shape {tuple(input.shape[:-1])} (input's without the vocab dim), "
                             f"got {tuple(lead or ())}")
        flat = dim != 2
        if flat:
            input, target = input.reshape(-1, input.shape[-1]), target.reshape(-1)
        out = cross_entropy(input, target, label_smoothing=self.label_smoothing, logit_scale=self.logit_scale,
                            lse_square_scale=self.lse_square_scale, ignore_index=self.ignore_index,
                            precomputed_lse=precomputed_lse, inplace_backward=self.inplace_backward,
                            process_group=self.process_group, reduction=self.reduction)
        loss, z_loss = out.loss, out.z_loss
        if flat and self.reduction == "none":
            loss, z_loss = loss.reshape(lead), z_loss.reshape(lead)
        return (loss, z_loss) if self.return_z_loss else loss


class FusedLinearCrossEntropyLoss(nn.Module):
    """culmen's addition: ``CrossEntropy(hidden @ weight.T + bias, target)`` without the logits tensor.

    Args:
        ignore_index, reduction, label_smoothing, lse_square_scale, return_z_loss: as ``CrossEntropyLoss``.
        softcap: final-logit softcap ``softcap * tanh(logits / softcap)`` (None: off).
        chunk_size: tokens per chunk (default: from a 128 MiB logits-buffer budget).
        accum_dtype: ``grad_weight`` accumulation dtype, ``None`` (the weight's) or ``torch.float32``.

    ``forward(hidden (..., H), weight (V, H), target (...), bias (V,) | None)`` returns the fp32 loss
    (or ``(loss, z_loss)``). The gradients of ``hidden``, ``weight`` and ``bias`` are computed during the
    forward of a ``mean``/``sum`` loss, so call ``backward`` once per forward.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
                 chunk_size: int | None = None, accum_dtype: torch.dtype | None = None):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        check_scalars(label_smoothing, lse_square_scale, softcap)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.chunk_size = chunk_size
        self.accum_dtype = accum_dtype

    def forward(self, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        """See the class docstring."""
        return fused_linear_cross_entropy(
            hidden, weight, target, bias, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            lse_square_scale=self.lse_square_scale, softcap=self.softcap, reduction=self.reduction,
            return_z_loss=self.return_z_loss, chunk_size=self.chunk_size, accum_dtype=self.accum_dtype)
