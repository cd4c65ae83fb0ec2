"""``apex.contrib.transducer.transducer``: ``TransducerJoint`` and ``TransducerLoss`` on culmen's Triton
transducer ops (``culmen.ops.transducer``).

Same arguments, defaults, shapes and return conventions as Apex. Differences, all in the direction of
doing the right thing:

* Inputs may be fp16, bf16, fp32 or fp64 (Apex: no bf16); lengths, labels and batch offsets any integer
  dtype. Bad arguments raise ``ValueError`` / ``TypeError`` naming the argument, and the *values* of
  lengths, labels and batch offsets are checked on CPU tensors (GPU tensors with
  ``culmen.ops.backend.set_check_values(True)``, which costs a device sync); the kernels clamp them so
  an unchecked bad value can never read or write outside a tensor.
* The joint never stores its ReLU / dropout mask for the backward: it recomputes ReLU's from ``f + g``
  and replays dropout's random numbers from a saved ``(seed, offset)``. The mask is written only for
  ``probe_mask=True``. Dropout draws from torch's generator (``torch.manual_seed`` replays it), but not
  the same random stream as Apex's curand Philox.
* The loss never materializes the log-softmax: it keeps three ``(B, T, U)`` fp32 statistics and writes
  the gradient of the logits directly (Apex keeps a full log-softmax copy of the logits). It accepts any
  sign of the incoming gradient (Apex takes its logarithm). ``opt`` and ``fwd_tile_size`` are checked
  and otherwise ignored: one Triton schedule serves all.
* Both trace under ``torch.compile(fullgraph=True)`` as custom ops (``culmen::transducer_joint_fwd``,
  ``culmen::rnnt_loss_fwd`` and their backwards), which Inductor launches; the value checks of lengths and
  labels (a device sync) are skipped in compiled graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.transducer import rnnt_loss, transducer_joint

__all__ = ["TransducerJoint", "TransducerJointFunc", "TransducerLoss", "TransducerLossFunc"]


def _as_int(value, name: str):
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be an int or a one-element tensor, got shape {tuple(value.shape)}")
        return int(value)
    return value


class TransducerJoint(torch.nn.Module):
    """Transducer (RNN-T) joint: ``h[b, t, u] = f[b, t] + g[b, u]``, optionally ReLU'd, dropped out, packed.

    Args:
        pack_output: write only the valid ``(t < f_len, u < g_len)`` rows, as ``(packed_batch, H)``.
        relu: ReLU on the sum (needs ``opt=1``, as in Apex).
        dropout: dropout on the (ReLU'd) sum in training mode (needs ``opt=1``).
        opt: optimization level, 0 or 1 (accepted for compatibility; one kernel serves both).
        fwd_tile_size: 1, 2 or 4 (accepted for compatibility).
        dropout_prob: drop probability; kept elements are scaled by ``1 / (1 - dropout_prob)``.
        probe_mask: with ReLU or dropout, append every forward's uint8 keep-mask (``h``'s layout) to
            ``self.mask_probe``.
    """

    def __init__(self, pack_output: bool = False, relu: bool = False, dropout: bool = False, opt: int = 1,
                 fwd_tile_size: int = 4, dropout_prob: float = 0, probe_mask: bool = False):
        super().__init__()
        if opt not in (0, 1):
            raise ValueError(f"TransducerJoint: opt must be 0 or 1, got {opt!r}")
        if fwd_tile_size not in (1, 2, 4):
            raise ValueError(f"TransducerJoint: fwd_tile_size must be 1, 2 or 4, got {fwd_tile_size!r}")
        if not 0.0 <= float(dropout_prob) <= 1.0:
            raise ValueError(f"TransducerJoint: dropout_prob must be in [0, 1], got {dropout_prob!r}")
        self.pack_output = pack_output
        self.relu = relu
        self.dropout = dropout
        self.dropout_prob = dropout_prob
        self.opt = opt
        self.fwd_tile_size = fwd_tile_size
        self.dummy_batch_offset = torch.empty(0)
        masked = self.relu or self.dropout
        self.mask_probe = [] if masked and probe_mask else None
        if masked and opt != 1:
            raise NotImplementedError("ReLU and dropout fusion is only supported with opt=1")

    def forward(self, f: Tensor, g: Tensor, f_len: Tensor, g_len: Tensor, batch_offset: Tensor | None = None,
                packed_batch: int = 0) -> Tensor:
        """The joint of ``f (B, T, H)`` and ``g (B, U, H)``.

        Args:
            f_len, g_len: ``(B,)`` integer valid lengths along ``T`` and ``U``.
            batch_offset: ``(B,)`` integers, ``torch.cumsum(f_len * g_len, 0)``; required with
                ``pack_output``, ignored otherwise.
            packed_batch: rows of the packed output (``batch_offset[-1]``); required with ``pack_output``.

        Returns:
            ``(B, T, U, H)`` (``-1`` outside the lengths) or, packed, ``(packed_batch, H)``, dtype of ``f``.
        """
        if self.pack_output:
            packed_batch = _as_int(packed_batch, "packed_batch")
            if batch_offset is None or packed_batch == 0:
                raise ValueError("TransducerJoint: please specify batch_offset and packed_batch when packing is "
                                 f"enabled (got batch_offset={'None' if batch_offset is None else 'a tensor'}, "
                                 f"packed_batch={packed_batch})")
        dropout = self.dropout and self.training
        probe = self.mask_probe is not None and (self.relu or dropout)
        out = transducer_joint(f, g, f_len, g_len, batch_offset if self.pack_output else None,
                               packed_batch if self.pack_output else 0, bool(self.pack_output), bool(self.relu),
                               float(self.dropout_prob) if dropout else None, return_mask=probe)
        if probe:
            out, mask = out
            self.mask_probe.append(mask)
        return out


class TransducerLoss(torch.nn.Module):
    """Transducer (RNN-T) loss on unnormalized logits: ``-log P(label | x)`` per batch.

    Args:
        fuse_softmax_backward: ``True`` (default): the log-softmax and its backward are fused into the
            loss. ``False``: a PyTorch ``log_softmax`` (with autograd) runs first, as in Apex; the gradient
            is the same.
        opt: optimization level, -1, 0 or 1 (accepted for compatibility).
        packed_input: ``x`` is ``(N, K)`` holding only the valid ``(t, u)`` rows of each batch.
    """

    def __init__(self, fuse_softmax_backward: bool = True, opt: int = 1, packed_input: bool = False):
        super().__init__()
        if opt not in (-1, 0, 1):
            raise ValueError(f"TransducerLoss: opt must be -1, 0 or 1, got {opt!r}")
        self.fuse_softmax_backward = fuse_softmax_backward
        self.opt = opt
        self.packed_input = packed_input
        self.dummy_batch_offset = torch.empty(0)

    def forward(self, x: Tensor, label: Tensor, f_len: Tensor, y_len: Tensor, blank_idx: int,
                batch_offset: Tensor | None = None, max_f_len: int | None = None,
                debug_list: list | None = None) -> Tensor:
        """The loss of logits ``x``.

        Args:
            x: ``(B, T, U, K)`` logits, or ``(N, K)`` with ``packed_input`` (batch ``b``'s row ``(t, u)`` at
                ``batch_offset[b-1] + t * (y_len[b] + 1) + u``).
            label: ``(B, U - 1)`` integer labels. f_len: ``(B,)`` frames (``1..T``); y_len: ``(B,)`` labels
                (``0..U-1``). blank_idx: the blank symbol in ``[0, K)``.
            batch_offset: ``torch.cumsum(f_len * (y_len + 1), 0)``; required with ``packed_input``.
            max_f_len: ``max(f_len)``; required with ``packed_input`` (the ``T`` of ``alpha`` / ``beta``).
            debug_list: an empty list receives ``[alpha, beta]`` (``(B, T, U)`` fp32 log-space lattices).

        Returns:
            ``(B,)`` losses in ``x.dtype``, differentiable in ``x``.
        """
        if self.packed_input:
            if batch_offset is None or max_f_len is None:
                raise ValueError("TransducerLoss: please specify batch_offset and max_f_len when packing is enabled")
            max_f_len = _as_int(max_f_len, "max_f_len")
        if not self.fuse_softmax_backward:
            x = torch.nn.functional.log_softmax(x, dim=-1)
        dbg = debug_list if isinstance(debug_list, list) and not debug_list else None
        blank_idx = _as_int(blank_idx, "blank_idx")
        return rnnt_loss(x, label, f_len, y_len, blank_idx, batch_offset if self.packed_input else None,
                         max_f_len if self.packed_input else None, bool(self.packed_input), dbg)


class TransducerLossFunc:
    """Stand-in for Apex's autograd function: ``TransducerLossFunc.apply(x, label, f_len, y_len,
    batch_offset, max_f_len, blank_idx, fuse_softmax_backward, debug_list, opt, packed_input)``."""

    @staticmethod
    def apply(x, label, f_len, y_len, batch_offset, max_f_len, blank_idx, fuse_softmax_backward, debug_list, opt,
              packed_input):
        mod = TransducerLoss(fuse_softmax_backward, opt, packed_input)
        return mod(x, label, f_len, y_len, blank_idx, batch_offset, max_f_len, debug_list)


class TransducerJointFunc:
    """Stand-in for Apex's autograd function: ``TransducerJointFunc.apply(f, g, f_len, g_len, pack_output,
    relu, dropout, batch_offset, packed_batch, opt, fwd_tile_size, dropout_prob, mask_probe)``."""

    @staticmethod
    def apply(f, g, f_len, g_len, pack_output, relu, dropout, batch_offset, packed_batch, opt, fwd_tile_size,
              dropout_prob, mask_probe):
        masked = relu or dropout
        probe = mask_probe is not None and masked
        out = transducer_joint(f, g, f_len, g_len, batch_offset if pack_output else None,
                               _as_int(packed_batch, "packed_batch") if pack_output else 0, bool(pack_output),
                               bool(relu), float(dropout_prob) if dropout else None, return_mask=probe)
        if probe:
            out, mask = out
            mask_probe.append(mask)
        return out
