"""``TransducerProjectionLoss``: the vocabulary projection and the RNN-T loss in one op (a culmen addition;
Apex has no such module). Apex's ``TransducerLoss`` keeps Apex's signature and is unchanged."""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.contrib.transducer.transducer import _as_int
from culmen.ops.transducer import rnnt_projection_loss

__all__ = ["TransducerProjectionLoss"]


class TransducerProjectionLoss(torch.nn.Module):
    """RNN-T loss of the logits ``h @ weight.T + bias`` without materializing them (a culmen addition).

    Replaces ``TransducerLoss()(F.linear(h, weight, bias), ...)`` at the end of a transducer: the projection
    runs a chunk of joint rows at a time and the loss consumes each chunk at once, so neither the
    ``(rows, K)`` logits nor their gradient ever exist whole (``culmen.ops.transducer.projection``). The
    module holds no parameters: pass the projection layer's, e.g. ``crit(h, linear.weight, linear.bias, ...)``.

    Args:
        packed_input: ``h`` is ``(N, H)`` holding only the valid ``(t, u)`` rows of each batch, as
            ``TransducerJoint(pack_output=True)`` writes them with ``g_len = y_len + 1``.
    """

    def __init__(self, packed_input: bool = False):
        super().__init__()
        self.packed_input = packed_input

    def forward(self, h: Tensor, weight: Tensor, bias: Tensor | None, label: Tensor, f_len: Tensor, y_len: Tensor,
                blank_idx: int, batch_offset: Tensor | None = None, max_f_len: int | None = None) -> Tensor:
        """The loss of the projected joint output.

        Args:
            h: ``(B, T, U, H)`` joint output, or ``(N, H)`` with ``packed_input`` (batch ``b``'s row ``(t, u)``
                at ``batch_offset[b-1] + t * (y_len[b] + 1) + u``). fp16/bf16/fp32/fp64.
            weight: ``(K, H)`` projection weight; bias: ``(K,)`` or ``None`` (``h``'s dtype and device).
            label: ``(B, U - 1)`` integer labels. f_len: ``(B,)`` frames (``1..T``); y_len: ``(B,)`` labels
                (``0..U-1``). blank_idx: the blank symbol in ``[0, K)``.
            batch_offset: ``torch.cumsum(f_len * (y_len + 1), 0)``; required with ``packed_input``.
            max_f_len: ``max(f_len)``; required with ``packed_input``.

        Returns:
            ``(B,)`` losses in ``h.dtype``, differentiable in ``h``, ``weight`` and ``bias``.
        """
        if self.packed_input:
            if batch_offset is None or max_f_len is None:
                raise ValueError("TransducerProjectionLoss: please specify batch_offset and max_f_len when packing "
                                 f"is enabled (got batch_offset={'None' if batch_offset is None else 'a tensor'}, "
                                 f"max_f_len={max_f_len!r})")
            max_f_len = _as_int(max_f_len, "max_f_len")
        return rnnt_projection_loss(h, weight, bias, label, f_len, y_len, _as_int(blank_idx, "blank_idx"),
                                    batch_offset if self.packed_input else None,
                                    max_f_len if self.packed_input else None, bool(self.packed_input))
