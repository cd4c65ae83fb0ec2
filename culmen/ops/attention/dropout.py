"""The attention dropout mask: Triton's ``tl.rand`` (Philox-4x32, 10 rounds) reproduced in PyTorch.

Definition (what a Triton kernel must compute to replay the same mask)::

    counter = rng_offset + ((b * nheads + h) * seqlen_q_stride + i) * seqlen_k_stride + j   # int64
    u       = tl.rand(rng_seed, counter)          # default n_rounds=10; float32 in [0, 1)
    keep    = u >= dropout_p

``(rng_seed, rng_offset)`` is the int64 ``rng_state`` of shape ``(2,)`` that the forward saves for
the backward. ``b`` is the batch index (the sequence index for varlen), ``h`` the query head, ``i``
and ``j`` the row and column *inside* the sequence. The strides are ``seqlen_q`` / ``seqlen_k`` for
dense inputs and ``max_seqlen_q`` / ``max_seqlen_k`` for varlen inputs.

``philox_rand`` gives bit-identical floats to ``tl.rand(seed, offset)`` for an int64 ``offset``
(checked against Triton's interpreter in the tests): Triton splits a 64-bit offset into
``(lo, hi)`` counter words, the seed into ``(lo, hi)`` key words, runs Philox-4x32 and maps the first
output word to a float with ``uint_to_uniform_float``. Every 32-bit value is held in int64 here, so
no unsigned arithmetic is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_N_ROUNDS = 10
_TO_UNIT = 4.6566127342e-10  # Triton's int32 -> [0, 1) scale


def _mul_hi_lo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(a * b) >> 32`` and ``(a * b) & 0xffffffff`` for a 32-bit constant ``a`` and 32-bit ``b``."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_hi, p_lo = a * b_hi, a * b_lo  # both < 2**48
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = ((p_hi << 16) + p_lo) & _MASK32
    return hi, lo


def philox_rand(seed: Tensor | int, offset: Tensor, n_rounds: int = _N_ROUNDS) -> Tensor:
    """Uniform float32 in ``[0, 1)``, bit-equal to Triton's ``tl.rand(seed, offset, n_rounds)``.

    Args:
        seed: non-negative int64 scalar (Python int or 0-d / 1-element tensor), or an int64 tensor
            that broadcasts against ``offset`` (one key per element, as ``tl.rand`` with a tensor seed).
        offset: int64 tensor of any shape (the Philox counters).
        n_rounds: Philox rounds (Triton's default is 10).

    Returns:
        float32 tensor of the broadcast shape, on ``offset``'s device. Pure tensor ops: traceable.
    """
    offset = offset.to(torch.int64)
    if isinstance(seed, Tensor):
        seed = seed.to(device=offset.device, dtype=torch.int64)
        if seed.numel() == 1:
            seed = seed.reshape(())
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32
    c0 = offset & _MASK32
    c1 = (offset >> 32) & _MASK32
    c0, c1 = torch.broadcast_tensors(c0, c1 + (k0 * 0 if isinstance(k0, Tensor) else 0))
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(n_rounds):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # bitcast to int32
    x = torch.where(x < 0, -x - 1, x).to(torch.int32)
    return x.to(torch.float32) * torch.tensor(_TO_UNIT, dtype=torch.float32, device=x.device)


def dropout_counters(rng_offset: Tensor | int, batch_idx: Tensor, nheads: int, seqlen_q: int, seqlen_k: int,
                     seqlen_q_stride: int, seqlen_k_stride: int) -> Tensor:
    """int64 Philox counters ``(B, nheads, seqlen_q, seqlen_k)`` for the rows/cols of the given batches.

    ``batch_idx`` (int64 ``(B,)``) holds the global batch (sequence) index of each slice.
    """
    dev = batch_idx.device
    h = torch.arange(nheads, device=dev, dtype=torch.int64).view(1, -1, 1, 1)
    i = torch.arange(seqlen_q, device=dev, dtype=torch.int64).view(1, 1, -1, 1)
    j = torch.arange(seqlen_k, device=dev, dtype=torch.int64).view(1, 1, 1, -1)
    b = batch_idx.to(torch.int64).view(-1, 1, 1, 1)
    if isinstance(rng_offset, Tensor):
        rng_offset = rng_offset.to(device=dev, dtype=torch.int64).reshape(())
    return rng_offset + ((b * nheads + h) * seqlen_q_stride + i) * seqlen_k_stride + j


def dropout_keep_mask(rng_state: Tensor, dropout_p: float, batch_idx: Tensor, nheads: int, seqlen_q: int,
                      seqlen_k: int, seqlen_q_stride: int | None = None,
                      seqlen_k_stride: int | None = None) -> Tensor:
    """Bool keep-mask ``(B, nheads, seqlen_q, seqlen_k)`` as defined in this module's docstring.

    Args:
        rng_state: int64 ``(2,)`` tensor ``(seed, offset)``.
        dropout_p: drop probability in ``[0, 1)``.
        batch_idx: int64 ``(B,)`` global batch indices.
        seqlen_q_stride, seqlen_k_stride: counter strides (default ``seqlen_q`` / ``seqlen_k``).
    """
    counters = dropout_counters(rng_state[1], batch_idx, nheads, seqlen_q, seqlen_k,
                                seqlen_q if seqlen_q_stride is None else seqlen_q_stride,
                                seqlen_k if seqlen_k_stride is None else seqlen_k_stride)
    return philox_rand(rng_state[0], counters) >= dropout_p
