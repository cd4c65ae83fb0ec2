"""Custom ops ``culmen::flash_attn_fwd`` / ``_bwd`` (+ ``_varlen_`` forms), their autograd, and the
op-level entry points ``flash_attn`` / ``flash_attn_varlen`` that ``culmen.flash_attn`` calls.

Dispatch of the dense ops (``_fwd_impl`` / ``_bwd_impl``): when ``choose_backend(q.device)`` says
``"triton"`` the Triton kernels of ``launch.py`` run (fp16/bf16/fp32, head dim <= 512, no
``return_probs``; anything else runs the reference). On CPU that is ``CULMEN_BACKEND=triton`` under
``TRITON_INTERPRET=1`` (the tests). ``CULMEN_FLASH_TRITON=0`` sends GPU calls to the reference (an
escape hatch for bisecting numerics); so do fp64 inputs and ``return_attn_probs``, with a one-time
warning. Dense and varlen ops share the kernels. All paths share these conventions:

* ``lse`` is fp32 (fp64 for fp64 inputs), ``(B, h, sq)`` dense / ``(h, total_q)`` varlen, ``+inf``
  on rows that see no key (their output is 0);
* dropout replays the mask of ``culmen.ops.attention.dropout`` from the saved int64
  ``rng_state = (seed, offset)``;
* the probabilities (``return_probs``) are ``(B, h, round128(sq), round128(sk))`` in q's dtype,
  normalized, zero in the padding, dropped entries negated.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from culmen.ops.attention.reference import (
    attention_bwd_ref,
    attention_fwd_ref,
    attention_varlen_bwd_ref,
    attention_varlen_fwd_ref,
    round_multiple,
)
from culmen.ops.backend import choose_backend, register_op
from culmen.ops.common.outputs import nothing

register_op("flash_attn_fwd", "attention", "FlashAttention forward (causal/window/softcap/ALiBi/GQA/dropout)")
register_op("flash_attn_bwd", "attention", "FlashAttention backward (dq, dk, dv; GQA reduced per KV head)")
register_op("flash_attn_varlen_fwd", "attention", "FlashAttention forward on packed variable-length sequences")
register_op("flash_attn_varlen_bwd", "attention", "backward of flash_attn_varlen_fwd")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEADDIM = 512


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _opt(t: Tensor | None) -> Tensor | None:
    return t if (t is not None and t.numel() > 0) else None


def _pad_probs(p: Tensor | None, q: Tensor) -> Tensor:
    if p is None:
        return nothing(q.device, q.dtype)
    sq, sk = p.shape[-2:]
    return torch.nn.functional.pad(p, (0, round_multiple(sk, 128) - sk, 0, round_multiple(sq, 128) - sq))


def _kw(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state):
    return dict(softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                softcap=softcap, alibi_slopes=_opt(alibi_slopes), dropout_p=dropout_p, rng_state=_opt(rng_state))


# ---------------------------------------------------------------------------------------------- dense


_WARNED_NO_KERNEL = False


def _warn_reference_on_gpu(q: Tensor) -> None:
    """Say once that a GPU call runs the PyTorch reference: correct, but slow and O(seqlen^2) memory."""
    global _WARNED_NO_KERNEL
    if q.device.type != "cpu" and not _WARNED_NO_KERNEL:
        _WARNED_NO_KERNEL = True
        warnings.warn(f"culmen.flash_attn: this call ({q.dtype}, head dim {q.shape[-1]}, or return_attn_probs, or "
                      "CULMEN_FLASH_TRITON=0) runs the PyTorch reference: correct, but slow and O(seqlen^2) memory",
                      RuntimeWarning, stacklevel=3)


def _use_kernels(q: Tensor, return_probs: bool = False) -> bool:
    """Whether the Triton kernels run this call (see the module docstring)."""
    if choose_backend(q.device) != "triton":
        return False
    if q.device.type != "cpu" and os.environ.get("CULMEN_FLASH_TRITON", "1") == "0":
        return False  # an escape hatch to the reference on GPUs
    from culmen.ops.attention.launch import supported

    return supported(q, return_probs)


def _kernel_kw(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state):
    return dict(softmax_scale=softmax_scale, window_left=window_left, window_right=window_right, softcap=softcap,
                alibi_slopes=_opt(alibi_slopes), dropout_p=dropout_p, rng_state=_opt(rng_state))


def _fwd_impl(q, k, v, alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left, window_right,
              softcap, return_probs, deterministic):
    if _use_kernels(q, return_probs):
        from culmen.ops.attention.launch import attention_fwd

        wr = 0 if causal else window_right
        out, lse = attention_fwd(q, k, v, **_kernel_kw(softmax_scale, window_left, wr, softcap, alibi_slopes,
                                                       dropout_p, rng_state))
        return out, lse, nothing(q.device, q.dtype)
    _warn_reference_on_gpu(q)
    out, lse, probs = attention_fwd_ref(q, k, v, return_probs=return_probs,
                                        **_kw(softmax_scale, causal, window_left, window_right, softcap,
                                              alibi_slopes, dropout_p, rng_state))
    return out, lse, _pad_probs(probs, q)


def _bwd_impl(dout, q, k, v, out, lse, alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left,
              window_right, softcap, deterministic):
    if _use_kernels(q):
        from culmen.ops.attention.launch import attention_bwd

        wr = 0 if causal else window_right
        return attention_bwd(dout, q, k, v, out, lse, **_kernel_kw(softmax_scale, window_left, wr, softcap,
                                                                    alibi_slopes, dropout_p, rng_state),
                             deterministic=deterministic)
    return attention_bwd_ref(dout, q, k, v, out, lse, **_kw(softmax_scale, causal, window_left, window_right,
                                                            softcap, alibi_slopes, dropout_p, rng_state))


@torch.library.custom_op("culmen::flash_attn_fwd", mutates_args=())
def flash_attn_fwd_op(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Tensor | None, rng_state: Tensor | None,
                      dropout_p: float, softmax_scale: float, causal: bool, window_left: int, window_right: int,
                      softcap: float, return_probs: bool, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Dense forward: ``q (B, sq, h, d)``, ``k``/``v`` ``(B, sk, hk, d)`` -> ``(out, lse, probs)``
    (``probs`` empty unless ``return_probs``). ``deterministic`` only matters for the backward."""
    return _fwd_impl(q, k, v, alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left, window_right,
                     softcap, return_probs, deterministic)


@flash_attn_fwd_op.register_fake
def _(q, k, v, alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
      return_probs, deterministic):
    B, sq, h, d = q.shape
    sk = k.shape[1]
    out = torch.empty_like(q)
    lse = q.new_empty((B, h, sq), dtype=_lse_dtype(q))
    probs = (q.new_empty((B, h, round_multiple(sq, 128), round_multiple(sk, 128))) if return_probs
             else nothing(q.device, q.dtype))
    return out, lse, probs


@torch.library.custom_op("culmen::flash_attn_bwd", mutates_args=())
def flash_attn_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      alibi_slopes: Tensor | None, rng_state: Tensor | None, dropout_p: float, softmax_scale: float,
                      causal: bool, window_left: int, window_right: int, softcap: float,
                      deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Dense backward -> ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v`` (dk/dv per KV head)."""
    return _bwd_impl(dout, q, k, v, out, lse, alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left,
                     window_right, softcap, deterministic)


@flash_attn_bwd_op.register_fake
def _(dout, q, k, v, out, lse, alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left, window_right,
      softcap, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_FWD_ARGS = ("q", "k", "v", "alibi_slopes", "rng_state", "dropout_p", "softmax_scale", "causal", "window_left",
             "window_right", "softcap", "return_probs", "deterministic")
_SCALARS = ("dropout_p", "softmax_scale", "causal", "window_left", "window_right", "softcap", "deterministic")


def _setup_context(ctx, inputs, output):
    a = dict(zip(_FWD_ARGS, inputs))
    ctx.save_for_backward(a["q"], a["k"], a["v"], output[0], output[1], a["alibi_slopes"], a["rng_state"])
    ctx.scalars = tuple(a[n] for n in _SCALARS)


def _backward(ctx, dout, dlse, dprobs, bwd=None):
    q, k, v, out, lse, alibi, rng = ctx.saved_tensors
    dropout_p, scale, causal, wl, wr, softcap, det = ctx.scalars
    dout = dout.contiguous() if dout is not None else torch.zeros_like(out)
    dq, dk, dv = (bwd or flash_attn_bwd_op)(dout, q, k, v, out, lse, alibi, rng, dropout_p, scale, causal, wl, wr,
                                            softcap, det)
    return (dq, dk, dv) + (None,) * (len(_FWD_ARGS) - 3)


torch.library.register_autograd("culmen::flash_attn_fwd", _backward, setup_context=_setup_context)


class _FlashAttnFn(torch.autograd.Function):
    """Eager path: the same implementation and backward as the custom ops without ``torch.library``
    dispatch overhead (see ``culmen/ops/layer_norm/op.py``); ``torch.compile`` traces the ops."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _fwd_impl(*inputs)
        _setup_context(ctx, inputs, out)
        ctx.mark_non_differentiable(out[1], out[2])
        return out

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, *grads, bwd=_bwd_impl)


# --------------------------------------------------------------------------------------------- varlen


def _varlen_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k)


def _vfwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, rng_state, dropout_p,
               softmax_scale, causal, window_left, window_right, softcap, return_probs, deterministic):
    if _use_kernels(q, return_probs):
        from culmen.ops.attention.launch import attention_fwd

        wr = 0 if causal else window_right
        out, lse = attention_fwd(q, k, v, **_kernel_kw(softmax_scale, window_left, wr, softcap, alibi_slopes,
                                                       dropout_p, rng_state),
                                 **_varlen_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
        return out, lse, nothing(q.device, q.dtype)
    _warn_reference_on_gpu(q)
    out, lse, probs = attention_varlen_fwd_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               return_probs=return_probs,
                                               **_kw(softmax_scale, causal, window_left, window_right, softcap,
                                                     alibi_slopes, dropout_p, rng_state))
    return out, lse, _pad_probs(probs, q)


def _vbwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
               rng_state, dropout_p, softmax_scale, causal, window_left, window_right, softcap, deterministic):
    if _use_kernels(q):
        from culmen.ops.attention.launch import attention_bwd

        wr = 0 if causal else window_right
        return attention_bwd(dout, q, k, v, out, lse, **_kernel_kw(softmax_scale, window_left, wr, softcap,
                                                                    alibi_slopes, dropout_p, rng_state),
                             **_varlen_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                             deterministic=deterministic)
    return attention_varlen_bwd_ref(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    **_kw(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                                          dropout_p, rng_state))


@torch.library.custom_op("culmen::flash_attn_varlen_fwd", mutates_args=())
def flash_attn_varlen_fwd_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Tensor | None,
                             rng_state: Tensor | None, dropout_p: float, softmax_scale: float, causal: bool,
                             window_left: int, window_right: int, softcap: float, return_probs: bool,
                             deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Varlen forward: packed ``q (total_q, h, d)``, ``k``/``v`` ``(total_k, hk, d)``, int32
    ``cu_seqlens`` ``(B + 1,)`` -> ``(out (total_q, h, d), lse (h, total_q), probs)``."""
    return _vfwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, rng_state,
                      dropout_p, softmax_scale, causal, window_left, window_right, softcap, return_probs,
                      deterministic)


@flash_attn_varlen_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, rng_state, dropout_p,
      softmax_scale, causal, window_left, window_right, softcap, return_probs, deterministic):
    total_q, h, d = q.shape
    B = cu_seqlens_q.shape[0] - 1
    lse = q.new_empty((h, total_q), dtype=_lse_dtype(q))
    probs = (q.new_empty((B, h, round_multiple(max_seqlen_q, 128), round_multiple(max_seqlen_k, 128)))
             if return_probs else nothing(q.device, q.dtype))
    return torch.empty_like(q), lse, probs


@torch.library.custom_op("culmen::flash_attn_varlen_bwd", mutates_args=())
def flash_attn_varlen_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                             alibi_slopes: Tensor | None, rng_state: Tensor | None, dropout_p: float,
                             softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                             deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Varlen backward -> packed ``(dq, dk, dv)``."""
    return _vbwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                      rng_state, dropout_p, softmax_scale, causal, window_left, window_right, softcap, deterministic)


@flash_attn_varlen_bwd_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, rng_state,
      dropout_p, softmax_scale, causal, window_left, window_right, softcap, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_VFWD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "alibi_slopes",
              "rng_state", "dropout_p", "softmax_scale", "causal", "window_left", "window_right", "softcap",
              "return_probs", "deterministic")


def _vsetup_context(ctx, inputs, output):
    a = dict(zip(_VFWD_ARGS, inputs))
    ctx.save_for_backward(a["q"], a["k"], a["v"], output[0], output[1], a["cu_seqlens_q"], a["cu_seqlens_k"],
                          a["alibi_slopes"], a["rng_state"])
    ctx.max_seqlens = (a["max_seqlen_q"], a["max_seqlen_k"])
    ctx.scalars = tuple(a[n] for n in _SCALARS)


def _vbackward(ctx, dout, dlse, dprobs, bwd=None):
    q, k, v, out, lse, cu_q, cu_k, alibi, rng = ctx.saved_tensors
    dropout_p, scale, causal, wl, wr, softcap, det = ctx.scalars
    dout = dout.contiguous() if dout is not None else torch.zeros_like(out)
    dq, dk, dv = (bwd or flash_attn_varlen_bwd_op)(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.max_seqlens, alibi,
                                                   rng, dropout_p, scale, causal, wl, wr, softcap, det)
    return (dq, dk, dv) + (None,) * (len(_VFWD_ARGS) - 3)


torch.library.register_autograd("culmen::flash_attn_varlen_fwd", _vbackward, setup_context=_vsetup_context)


class _FlashAttnVarlenFn(torch.autograd.Function):
    """Eager path of ``culmen::flash_attn_varlen_fwd`` (see ``_FlashAttnFn``)."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _vfwd_impl(*inputs)
        _vsetup_context(ctx, inputs, out)
        ctx.mark_non_differentiable(out[1], out[2])
        return out

    @staticmethod
    def backward(ctx, *grads):
        return _vbackward(ctx, *grads, bwd=_vbwd_impl)


# ------------------------------------------------------------------------------------ entry points


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_common(q, k, v, dropout_p, window_size, softcap, alibi_slopes, batch: int, rank: int, layout: str):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if q.dtype not in _FLOATS:
        raise TypeError(f"q must be float16/bfloat16/float32/float64, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {t.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all inputs must share a device")
    d = q.shape[-1]
    if not 0 < d <= MAX_HEADDIM:
        raise ValueError(f"q head dim must be in [1, {MAX_HEADDIM}], got {d}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[-1] != d:
            raise ValueError(f"{name} head dim {t.shape[-1]} must equal q's head dim {d}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v shape {tuple(v.shape)} must match k shape {tuple(k.shape)}")
    h, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or h % hk != 0:
        raise ValueError(f"nheads of q ({h}) must be a multiple of nheads of k/v ({hk})")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if window_size[0] < -1 or window_size[1] < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {tuple(window_size)}")
    if float(softcap) < 0.0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if alibi_slopes is not None:
        _check_tensor("alibi_slopes", alibi_slopes)
        if not alibi_slopes.is_floating_point():
            raise TypeError(f"alibi_slopes must be a float tensor (fp32), got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((h,), (batch, h)):
            raise ValueError(f"alibi_slopes must have shape ({h},) or ({batch}, {h}), got "
                             f"{tuple(alibi_slopes.shape)}")
        alibi_slopes = alibi_slopes.to(torch.float32).contiguous()
    return alibi_slopes


def _rng_state(dropout_p: float, device) -> Tensor | None:
    if dropout_p <= 0.0:
        return None
    return torch.randint(0, 2**62, (2,), device=device, dtype=torch.int64)


def _window(causal: bool, window_size) -> tuple[int, int]:
    left, right = int(window_size[0]), int(window_size[1])
    return left, (0 if causal else right)


def flash_attn(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
               causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
               alibi_slopes: Tensor | None = None, deterministic: bool = False,
               return_attn_probs: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Validated, differentiable dense attention; returns ``(out, softmax_lse, S_dmask)``.

    ``q``: ``(B, sq, h, d)``, ``k``/``v``: ``(B, sk, hk, d)``, fp16/bf16/fp32/fp64, ``d <= 512``.
    ``S_dmask`` is empty unless ``return_attn_probs``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    alibi = _check_common(q, k, v, dropout_p, window_size, softcap, alibi_slopes, q.shape[0] if q.dim() else 0, 4,
                          "(batch, seqlen, nheads, headdim)")
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} batch size {t.shape[0]} must equal q's batch size {q.shape[0]}")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    wl, wr = _window(causal, window_size)
    rng = _rng_state(float(dropout_p), q.device)
    fn = flash_attn_fwd_op if torch.compiler.is_compiling() else _FlashAttnFn.apply
    return fn(q, k, v, alibi, rng, float(dropout_p), scale, bool(causal), wl, wr, float(softcap),
              bool(return_attn_probs), bool(deterministic))


def flash_attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: float | None = None,
                      causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      alibi_slopes: Tensor | None = None, deterministic: bool = False,
                      return_attn_probs: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Validated, differentiable varlen attention on packed ``(total, heads, d)`` inputs with int32
    ``cu_seqlens_q/k`` ``(B + 1,)``; returns ``(out, softmax_lse (h, total_q), S_dmask)``."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(name, t)
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.dim() != 1 or t.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D of length batch + 1 >= 2, got shape {tuple(t.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
                         "must have the same length (batch + 1)")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"{name} must be a non-negative Python int, got {m!r}")
    batch = cu_seqlens_q.shape[0] - 1
    alibi = _check_common(q, k, v, dropout_p, window_size, softcap, alibi_slopes, batch, 3,
                          "(total, nheads, headdim)")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    wl, wr = _window(causal, window_size)
    rng = _rng_state(float(dropout_p), q.device)
    fn = flash_attn_varlen_fwd_op if torch.compiler.is_compiling() else _FlashAttnVarlenFn.apply
    return fn(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), alibi, rng,
              float(dropout_p), scale, bool(causal), wl, wr, float(softcap), bool(return_attn_probs),
              bool(deterministic))
