"""Launchers of the dense FlashAttention kernels: allocate, pick blocks, launch.

``attention_fwd`` / ``attention_bwd`` take BSHD tensors, or packed THD ones with ``cu_seqlens`` (any
strides; a head dim that is not unit-stride is copied), and follow the conventions of ``reference.py``.
Block sizes come from ``TUNING`` (swept on an H100, see ``bench/notes/attention.md``); the CPU
interpreter uses ``interp_block`` so small test shapes still cross several blocks.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from culmen.ops.attention.kernels import (
    LOG2E_F,
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_kernel,
    _attn_bwd_preprocess_kernel,
    _attn_fwd_kernel,
)
from culmen.ops.backend import deterministic_enabled, device_guard
from culmen.ops.common.launch import FastLauncher

_fwd = FastLauncher(_attn_fwd_kernel)
_pre = FastLauncher(_attn_bwd_preprocess_kernel)
_dkdv = FastLauncher(_attn_bwd_dkdv_kernel)
_dq = FastLauncher(_attn_bwd_dq_kernel)

MAX_KERNEL_HEADDIM = 512

TUNING = {
    # (max padded head dim, BLOCK_M, BLOCK_N, num_warps, num_stages), first row that fits wins.
    # Forward and dQ hold a BLOCK_M query block and loop over keys; dK/dV hold a BLOCK_N key block and
    # loop over queries. Measured on an H100 (bench/notes/attention.md).
    "fwd": [(64, 128, 64, 4, 3), (128, 128, 128, 8, 3), (256, 128, 64, 8, 2), (512, 64, 32, 8, 1)],
    "dkdv": [(64, 64, 64, 4, 3), (128, 64, 128, 8, 3), (256, 64, 32, 4, 2), (512, 32, 32, 8, 1)],
    "dq": [(64, 128, 32, 4, 3), (128, 128, 64, 8, 3), (256, 128, 32, 8, 2), (512, 32, 32, 8, 1)],
    "dkdv_atomic": [(64, 64, 128, 8, 3), (128, 64, 128, 8, 3), (256, 32, 64, 4, 2), (512, 32, 32, 8, 1)],
    "pre_block_m": 64,
    # Forward K/V loads through per-program TMA tensor descriptors (Hopper+, 16-byte aligned inputs).
    # Off: +2% at d128 and nothing at d64 on the H100 (Triton 3.6), and ptxas crashed on the
    # num_stages=2 variants; Triton's warp specialization on top of it gained nothing either.
    "tma": False,
    # dQ summed with fp32 atomics in the dK/dV kernel (5 matmuls per tile instead of 7, no dQ kernel)
    # when deterministic=False. Off: on the H100 it was no faster than the dQ kernel (-4% .. +3% at
    # d64/d128, 19% slower with GQA, whose dK/dV programs add into GROUP query heads) and needs an
    # fp32 dQ buffer (+50% peak memory), so every backward is the reproducible one.
    "atomic_dq": False,
    # Block size under the CPU interpreter (tests): small, so odd seqlens span several blocks.
    "interp_block": 16,
}


def supported(q: Tensor, return_probs: bool) -> bool:
    """Whether the kernels handle this call (else the caller runs the reference)."""
    # fp32 tiles take twice the shared memory: they use the configs of twice the head dim (so <= 256).
    max_d = MAX_KERNEL_HEADDIM // (2 if q.dtype == torch.float32 else 1)
    return not return_probs and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.shape[-1] <= max_d


def _blocks(kind: str, block_d: int, device: torch.device, dtype: torch.dtype) -> tuple[int, int, int, int]:
    if device.type != "cuda":
        b = TUNING["interp_block"]
        return b, b, 4, 1
    width = block_d * (2 if dtype == torch.float32 else 1)  # bytes per row / 2
    for dmax, bm, bn, w, st in TUNING[kind]:
        if width <= dmax:
            return bm, bn, w, st
    raise ValueError(f"head dim {block_d} too large for the attention kernels")


def _torch_scratch(size: int, alignment: int, stream) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _use_tma(*ts: Tensor) -> bool:
    """Whether the forward can read ``ts`` through device-side TMA descriptors: a Hopper-class GPU (or
    the interpreter), and 16-byte aligned base addresses and row/head/batch strides."""
    t0 = ts[0]
    if not TUNING["tma"]:
        return False
    if t0.device.type == "cuda" and torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    if t0.device.type == "cuda" and getattr(torch.version, "hip", None):
        return False
    es = t0.element_size()
    for t in ts:
        if t.data_ptr() % 16 or any((st * es) % 16 for st in t.stride()[:-1]):
            return False
    _ensure_allocator(t0.device)
    return True


def _ensure_allocator(device: torch.device) -> None:
    """Device-side descriptors need Triton's scratch allocator. Triton keeps it per thread context (and
    autograd runs backward in its own thread), so this is checked at every launch; an allocator the
    caller installed is left alone."""
    try:
        from triton.runtime import _allocation
    except ImportError:  # a Triton without the module cannot build descriptors anyway
        return
    current = _allocation._allocator
    current = current.get() if hasattr(current, "get") else current
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch if device.type == "cuda" else _cpu_scratch)


def _cpu_scratch(size: int, alignment: int, stream) -> Tensor:
    return torch.empty(size, dtype=torch.int8)


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _flags(q: Tensor, sk: int, softcap: float, alibi: Tensor | None, dropout_p: float, left: int, right: int,
           block_d: int, varlen: bool):
    if left >= sk and not varlen:  # a window wider than every row is no window
        left = -1
    return dict(
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.device.type == "cpu" and q.dtype == torch.bfloat16,
        EVEN_D=q.shape[-1] == block_d,
        SOFTCAP=softcap > 0.0, ALIBI=alibi is not None, DROPOUT=dropout_p > 0.0,
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, VARLEN=varlen,
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


class _Geometry:
    """Batch / sequence geometry shared by the launches of one call, dense or varlen.

    Dense tensors are ``(B, s, h, d)``; varlen ones ``(total, h, d)`` with int32 ``cu_seqlens``, seen
    by the kernels as batch stride 0 plus a per-sequence row offset.
    """

    def __init__(self, q: Tensor, k: Tensor, cu_q: Tensor | None, cu_k: Tensor | None, max_q: int | None,
                 max_k: int | None) -> None:
        self.varlen = cu_q is not None
        if self.varlen:
            self.B = cu_q.shape[0] - 1
            self.sq, self.sk = int(max_q), int(max_k)
            self.total_q = q.shape[0]
            self.cu_q = cu_q.to(device=q.device, dtype=torch.int32).contiguous()
            self.cu_k = cu_k.to(device=q.device, dtype=torch.int32).contiguous()
        else:
            self.B, self.sq = q.shape[0], q.shape[1]
            self.sk = k.shape[1]
            self.cu_q = self.cu_k = q  # never read
        self.H, self.HK, self.D = q.shape[-2], k.shape[-2], q.shape[-1]

    def strides(self, t: Tensor) -> tuple[int, int, int]:
        """``(batch, row, head)`` element strides of a dense or packed tensor."""
        if self.varlen:
            return 0, t.stride(0), t.stride(1)
        return t.stride(0), t.stride(1), t.stride(2)

    def stats(self, dtype=torch.float32, device=None) -> tuple[Tensor, int, int]:
        """A fresh ``lse``-shaped buffer and its ``(batch, head)`` strides: ``(B, H, sq)`` or ``(H, total)``."""
        if self.varlen:
            t = torch.empty(self.H, self.total_q, dtype=dtype, device=device)
            return t, 0, t.stride(0)
        t = torch.empty(self.B, self.H, self.sq, dtype=dtype, device=device)
        return t, t.stride(0), t.stride(1)

    def lse_strides(self, lse: Tensor) -> tuple[int, int]:
        return (0, lse.stride(0)) if self.varlen else (lse.stride(0), lse.stride(1))


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: float, window_left: int = -1,
                  window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
                  dropout_p: float = 0.0, rng_state: Tensor | None = None, cu_seqlens_q: Tensor | None = None,
                  cu_seqlens_k: Tensor | None = None, max_seqlen_q: int | None = None,
                  max_seqlen_k: int | None = None, k_start: Tensor | None = None,
                  k_end: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Forward -> ``(out, lse fp32)``.

    Dense: ``q (B, sq, h, d)``, ``k``/``v`` ``(B, sk, hk, d)``, ``lse (B, h, sq)``. Varlen (with
    ``cu_seqlens_q/k`` int32 ``(B + 1,)`` and the max lengths): packed ``(total, h, d)`` inputs and
    ``lse (h, total_q)``. ``window_right`` must already be 0 for causal attention (``op._window``).
    ``k_end`` (int32 ``(B,)``, dense only), with ``k_start`` (default 0): batch row ``b`` attends to
    keys ``k_start[b] .. k_end[b]`` only, its causal diagonal aligned to ``k_end[b]`` (a KV cache).
    """
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    g = _Geometry(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse, slb, slh = g.stats(device=q.device)
    if g.varlen:  # rows of empty sequences are never visited by a program
        out.zero_()
        lse.fill_(float("inf"))
    if g.B * g.H * g.sq == 0 or q.numel() == 0:
        return out, lse
    block_d = max(16, triton.next_power_of_2(g.D))
    bm, bn, warps, stages = _blocks("fwd", block_d, q.device, q.dtype)
    meta, left, right = _flags(q, g.sk, softcap, alibi_slopes, dropout_p, window_left, window_right, block_d,
                               g.varlen)
    alibi, stride_ab = _alibi_args(alibi_slopes, q)
    rng = _rng_arg(rng_state if dropout_p > 0.0 else None, q)
    num_m = triton.cdiv(g.sq, bm)
    tma = _use_tma(k, v)
    k_range = k_end is not None
    if k_range:
        k_end = k_end.to(device=q.device, dtype=torch.int32).contiguous()
        k_start = (torch.zeros_like(k_end) if k_start is None
                   else k_start.to(device=q.device, dtype=torch.int32).contiguous())
    else:
        k_start = k_end = q  # never read
    with device_guard(q.device):
        _fwd((num_m * g.B * g.H,),
             (q, k, v, out, lse, alibi, rng, g.cu_q, g.cu_k, k_start, k_end, *g.strides(q), *g.strides(k),
              *g.strides(v), *g.strides(out), slb, slh, stride_ab, g.H, g.H // g.HK, g.sq, g.sk, g.sq, g.sk, g.D, num_m,
              float(softmax_scale) * LOG2E_F, float(softcap) if softcap > 0 else 1.0, float(dropout_p), left, right),
             dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, **meta, HEAVY_FIRST=meta["HAS_RIGHT"],
                  USE_TMA=tma, K_RANGE=k_range),
             num_warps=warps, num_stages=stages)
    return out, lse


def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, softmax_scale: float,
                  window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                  alibi_slopes: Tensor | None = None, dropout_p: float = 0.0, rng_state: Tensor | None = None,
                  cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
                  max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                  deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Backward -> ``(dq, dk, dv)`` in the dtypes and shapes of ``q``, ``k``, ``v`` (dK/dV per KV head);
    dense or varlen as in ``attention_fwd``.

    dK/dV are always written by one program each. dQ is summed over key blocks with fp32 atomics
    (``TUNING["atomic_dq"]``, the fast path) unless ``deterministic``, which runs a separate dQ kernel
    whose programs each own their rows: bitwise reproducible.
    """
    q, k, v, dout, out = (_unit_last(t) for t in (q, k, v, dout, out))
    g = _Geometry(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    lse = lse.to(torch.float32).contiguous()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=q.device)
    if g.varlen:  # rows of empty sequences are never visited by a program
        dq.zero_(), dk.zero_(), dv.zero_()
    if g.B * g.H * g.sq == 0 or g.sk == 0 or q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    block_d = max(16, triton.next_power_of_2(g.D))
    meta, left, right = _flags(q, g.sk, softcap, alibi_slopes, dropout_p, window_left, window_right, block_d,
                               g.varlen)
    alibi, stride_ab = _alibi_args(alibi_slopes, q)
    rng = _rng_arg(rng_state if dropout_p > 0.0 else None, q)
    delta, _, _ = g.stats(device=q.device)
    slb, slh = g.lse_strides(lse)
    pbm = TUNING["pre_block_m"] if q.device.type == "cuda" else TUNING["interp_block"]
    scal = (float(softmax_scale) * LOG2E_F, float(softcap) if softcap > 0 else 1.0, float(dropout_p), left, right)
    qkv_strides = (*g.strides(q), *g.strides(k), *g.strides(v), *g.strides(dout))
    with device_guard(q.device):
        num_pm = triton.cdiv(g.sq, pbm)
        _pre((num_pm * g.B * g.H,),
             (out, dout, delta, g.cu_q, *g.strides(out), *g.strides(dout), slb, slh, g.H, g.sq, g.D, num_pm),
             dict(BLOCK_M=pbm, BLOCK_D=block_d, VARLEN=g.varlen), num_warps=4, num_stages=1)
        atomic = TUNING["atomic_dq"] and not deterministic and not deterministic_enabled()
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic else dq
        bm, bn, warps, stages = _blocks("dkdv_atomic" if atomic else "dkdv", block_d, q.device, q.dtype)
        num_n = triton.cdiv(g.sk, bn)
        _dkdv((num_n * g.B * g.HK,),
              (q, k, v, dout, lse, delta, dk, dv, dq_acc, alibi, rng, g.cu_q, g.cu_k, *qkv_strides, *g.strides(dk),
               *g.strides(dv), *g.strides(dq_acc), slb, slh, stride_ab, g.H, g.HK, g.H // g.HK, g.sq, g.sk, g.sq,
               g.sk, g.D, num_n, *scal),
              dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, **meta, ATOMIC_DQ=atomic), num_warps=warps,
              num_stages=stages)
        if atomic:
            dq.copy_(dq_acc)
            return dq, dk, dv
        bm, bn, warps, stages = _blocks("dq", block_d, q.device, q.dtype)
        num_m = triton.cdiv(g.sq, bm)
        _dq((num_m * g.B * g.H,),
            (q, k, v, dout, lse, delta, dq, alibi, rng, g.cu_q, g.cu_k, *qkv_strides, *g.strides(dq), slb, slh,
             stride_ab, g.H, g.H // g.HK, g.sq, g.sk, g.sq, g.sk, g.D, num_m, *scal),
            dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, **meta, HEAVY_FIRST=meta["HAS_RIGHT"]),
            num_warps=warps, num_stages=stages)
    return dq, dk, dv
