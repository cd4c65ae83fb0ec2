"""Launchers of the dense FlashAttention kernels: allocate, pick blocks, launch.

``attention_fwd`` / ``attention_bwd`` take BSHD tensors (any strides; a head dim that is not
unit-stride is copied) and follow the conventions of ``reference.py``. The block sizes in ``TUNING``
are first guesses, not yet swept on a GPU; the CPU interpreter uses ``interp_block`` so small test
shapes still cross several blocks.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from culmen.ops.attention.kernels import (
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_kernel,
    _attn_bwd_preprocess_kernel,
    _attn_fwd_kernel,
)
from culmen.ops.backend import device_guard
from culmen.ops.common.launch import FastLauncher

_fwd = FastLauncher(_attn_fwd_kernel)
_pre = FastLauncher(_attn_bwd_preprocess_kernel)
_dkdv = FastLauncher(_attn_bwd_dkdv_kernel)
_dq = FastLauncher(_attn_bwd_dq_kernel)

MAX_KERNEL_HEADDIM = 256

TUNING = {
    # (max padded head dim, BLOCK_M, BLOCK_N, num_warps, num_stages), first row that fits wins.
    "fwd": [(64, 128, 64, 4, 3), (128, 128, 64, 8, 2), (256, 64, 32, 4, 2)],
    "bwd": [(64, 64, 64, 4, 2), (128, 64, 64, 8, 2), (256, 32, 32, 4, 1)],
    "pre_block_m": 64,
    # Block size under the CPU interpreter (tests): small, so odd seqlens span several blocks.
    "interp_block": 16,
}


def supported(q: Tensor, return_probs: bool) -> bool:
    """Whether the kernels handle this call (else the caller runs the reference)."""
    return (not return_probs and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and q.shape[-1] <= MAX_KERNEL_HEADDIM)


def _blocks(kind: str, block_d: int, device: torch.device) -> tuple[int, int, int, int]:
    if device.type != "cuda":
        b = TUNING["interp_block"]
        return b, b, 4, 1
    for dmax, bm, bn, w, st in TUNING[kind]:
        if block_d <= dmax:
            return bm, bn, w, st
    raise ValueError(f"head dim {block_d} too large for the attention kernels")


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _flags(q: Tensor, sk: int, softcap: float, alibi: Tensor | None, dropout_p: float, left: int, right: int):
    if left >= sk:
        left = -1
    return dict(
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.device.type == "cpu" and q.dtype == torch.bfloat16,
        SOFTCAP=softcap > 0.0, ALIBI=alibi is not None, DROPOUT=dropout_p > 0.0,
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
    ), max(left, 0), max(right, 0)


def _alibi_args(alibi: Tensor | None, q: Tensor) -> tuple[Tensor, int]:
    if alibi is None:
        return q, 0
    alibi = alibi.to(device=q.device, dtype=torch.float32).contiguous()
    return alibi, (alibi.stride(0) if alibi.dim() == 2 else 0)


def _rng_arg(rng_state: Tensor | None, q: Tensor) -> Tensor:
    if rng_state is None:
        return q  # never read: DROPOUT is off
    return rng_state.to(device=q.device, dtype=torch.int64).reshape(2).contiguous()


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: float, window_left: int = -1,
                  window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
                  dropout_p: float = 0.0, rng_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Dense forward on ``q (B, sq, h, d)``, ``k``/``v`` ``(B, sk, hk, d)`` -> ``(out, lse (B, h, sq) fp32)``.

    ``window_right`` must already be 0 for causal attention (``op._window`` does that).
    """
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, sq, H, D = q.shape
    sk, HK = k.shape[1], k.shape[2]
    out = torch.empty(B, sq, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, sq, dtype=torch.float32, device=q.device)
    if B * H * sq == 0:
        return out, lse
    block_d = max(16, triton.next_power_of_2(D))
    bm, bn, warps, stages = _blocks("fwd", block_d, q.device)
    meta, left, right = _flags(q, sk, softcap, alibi_slopes, dropout_p, window_left, window_right)
    alibi, stride_ab = _alibi_args(alibi_slopes, q)
    rng = _rng_arg(rng_state if dropout_p > 0.0 else None, q)
    grid = (triton.cdiv(sq, bm), B * H)
    with device_guard(q.device):
        _fwd(grid, (q, k, v, out, lse, alibi, rng,
                    q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                    v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                    stride_ab, H, H // HK, sq, sk, D,
                    float(softmax_scale), float(softcap) if softcap > 0 else 1.0, float(dropout_p), left, right),
             dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, **meta), num_warps=warps, num_stages=stages)
    return out, lse


def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, softmax_scale: float,
                  window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                  alibi_slopes: Tensor | None = None, dropout_p: float = 0.0,
                  rng_state: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Dense backward -> ``(dq, dk, dv)`` in the dtypes and shapes of ``q``, ``k``, ``v`` (dK/dV per KV head).

    Deterministic: every gradient element is written by one program, no atomics.
    """
    q, k, v, dout, out = (_unit_last(t) for t in (q, k, v, dout, out))
    lse = lse.to(torch.float32).contiguous()
    B, sq, H, D = q.shape
    sk, HK = k.shape[1], k.shape[2]
    dq = torch.empty(B, sq, H, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, sk, HK, D, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, sk, HK, D, dtype=v.dtype, device=q.device)
    if B * H * sq == 0 or sk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    block_d = max(16, triton.next_power_of_2(D))
    bm, bn, warps, stages = _blocks("bwd", block_d, q.device)
    meta, left, right = _flags(q, sk, softcap, alibi_slopes, dropout_p, window_left, window_right)
    alibi, stride_ab = _alibi_args(alibi_slopes, q)
    rng = _rng_arg(rng_state if dropout_p > 0.0 else None, q)
    delta = torch.empty(B, H, sq, dtype=torch.float32, device=q.device)
    pbm = TUNING["pre_block_m"] if q.device.type == "cuda" else TUNING["interp_block"]
    scal = (float(softmax_scale), float(softcap) if softcap > 0 else 1.0, float(dropout_p), left, right)
    qkv_strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2))
    with device_guard(q.device):
        _pre((triton.cdiv(sq, pbm), B * H),
             (out, dout, delta, out.stride(0), out.stride(1), out.stride(2),
              dout.stride(0), dout.stride(1), dout.stride(2), H, sq, D),
             dict(BLOCK_M=pbm, BLOCK_D=block_d), num_warps=4, num_stages=1)
        _dkdv((triton.cdiv(sk, bn), B * HK),
              (q, k, v, dout, lse, delta, dk, dv, alibi, rng, *qkv_strides,
               dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
               stride_ab, H, HK, H // HK, sq, sk, D, *scal),
              dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, **meta), num_warps=warps, num_stages=stages)
        _dq((triton.cdiv(sq, bm), B * H),
            (q, k, v, dout, lse, delta, dq, alibi, rng, *qkv_strides, dq.stride(0), dq.stride(1), dq.stride(2),
             stride_ab, H, H // HK, sq, sk, D, *scal),
            dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, **meta), num_warps=warps, num_stages=stages)
    return dq, dk, dv
