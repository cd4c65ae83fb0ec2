"""``flash_attn.ops.triton.cross_entropy`` on culmen's cross-entropy op.

``cross_entropy_loss`` returns per-row ``(losses, z_losses)`` (fp32) with flash_attn's arguments and
defaults; ``CrossEntropyLoss.apply`` takes flash_attn's positional order. Both call
:func:`culmen.ops.cross_entropy.cross_entropy`.

Differences from flash_attn 2.8:

* Runs on CPU too (the reference path); logits may have any row stride.
* A label outside ``[0, total classes)`` that is not ``ignore_index`` raises ``ValueError`` for CPU
  labels and gives a NaN loss and gradient row on the GPU (flash_attn silently drops its CE term). In
  the vocab-parallel case a label outside *this rank's* shard is normal, as in flash_attn.
* Under ``torch.compile`` the op is traced as a ``triton_op`` (Inductor launches its kernels) and
  ``inplace_backward`` is ignored.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from culmen.ops.cross_entropy import cross_entropy

__all__ = ["CrossEntropyLoss", "cross_entropy_loss"]


def cross_entropy_loss(
    logits: Tensor,
    labels: Tensor,
    precomputed_lse: Tensor | None = None,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-row softmax cross-entropy of ``logits (batch, vocab)`` and ``labels (batch,)``.

    Args:
        precomputed_lse: ``(batch,)`` LSE to reuse (used only without smoothing and with scale 1).
        label_smoothing: in ``[0, 1]``. logit_scale: multiplies the logits first.
        lse_square_scale: adds ``lse_square_scale * lse^2`` (z-loss) to each loss.
        ignore_index: rows with this label get loss 0 and gradient 0.
        inplace_backward: write the gradient into ``logits`` (saves memory).
        process_group: tensor parallel: each rank holds one contiguous, equal slice of the vocab.

    Returns:
        ``(losses, z_losses)``, fp32 ``(batch,)``; ``losses`` includes the z-loss, ``z_losses`` is for
        logging (not differentiable).
    """
    out = cross_entropy(logits, labels, label_smoothing=label_smoothing, logit_scale=logit_scale,
                        lse_square_scale=lse_square_scale, ignore_index=ignore_index,
                        precomputed_lse=precomputed_lse, inplace_backward=inplace_backward,
                        process_group=process_group)
    return out.loss, out.z_loss


class CrossEntropyLoss:
    """flash_attn's autograd function ``CrossEntropyLoss``: ``CrossEntropyLoss.apply(logits, labels,
    precomputed_lse=None, smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0, ignore_index=-100,
    inplace_backward=False, process_group=None) -> (losses, z_losses)``."""

    @staticmethod
    def apply(logits: Tensor, labels: Tensor, precomputed_lse: Tensor | None = None, smoothing: float = 0.0,
              logit_scale: float = 1.0, lse_square_scale: float = 0.0, ignore_index: int = -100,
              inplace_backward: bool = False, process_group: dist.ProcessGroup | None = None) -> tuple[Tensor, Tensor]:
        """Same as ``cross_entropy_loss`` with flash_attn's positional order."""
        return cross_entropy_loss(logits, labels, precomputed_lse, smoothing, logit_scale, lse_square_scale,
                                  ignore_index, inplace_backward, process_group)
