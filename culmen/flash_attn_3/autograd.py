"""FA3's autograd classes of ``flash_attn_interface``: ``FlashAttnFunc``, ``FlashAttnVarlenFunc`` and
``FlashAttnQKVPackedFunc``, with FA3's ``apply`` arguments (what ``flash_attn_func`` & co. pass them), for
code that calls the classes directly (context-parallel and custom-op wrappers do).

Each class runs culmen's FA3 function of the same arguments on detached inputs inside its forward, keeping
that small graph, and its backward differentiates it: the numbers are the function's, forward and backward,
and the classes stay in step with every feature the functions have (``qv``, ``attention_chunk``, FP8 in the
forward). Besides the classes: FA3's helpers ``maybe_contiguous`` and ``round_multiple``.
"""

from __future__ import annotations

import torch
from torch import Tensor

# FA3's helpers are flash_attn 2's, under the same names
from culmen.flash_attn.flash_attn_interface import maybe_contiguous, round_multiple

__all__ = ["FlashAttnFunc", "FlashAttnQKVPackedFunc", "FlashAttnVarlenFunc", "maybe_contiguous", "round_multiple"]


def _detached(t):
    return t.detach().requires_grad_() if isinstance(t, Tensor) and t.requires_grad else t


def _forward(ctx, fn, args: tuple, positions: tuple, n_args: int, return_softmax: bool):
    """Run ``fn(*args, return_attn_probs=True)`` on detached copies of the first ``len(positions)`` arguments
    (the differentiable ones, at those positions of the class's ``apply`` arguments, ``n_args`` in all), keep
    its graph on ``ctx``, return ``out`` (and ``lse``) detached."""
    n = len(positions)
    inputs = tuple(_detached(a) for a in args[:n])
    with torch.enable_grad():
        out, lse, *_ = fn(*inputs, *args[n:], return_attn_probs=True)
    keep = tuple(isinstance(i, Tensor) and i.requires_grad for i in inputs)
    ctx.graph = (out, tuple(i for i, k in zip(inputs, keep) if k))
    ctx.where = (tuple(p for p, k in zip(positions, keep) if k), n_args)
    lse = lse.detach()
    ctx.mark_non_differentiable(lse)
    return (out.detach(), lse) if return_softmax else out.detach()


class _ReplayFunction(torch.autograd.Function):
    """The backward of the classes below: differentiate the graph their forward kept (``_forward``)."""

    @staticmethod
    def forward(ctx, *args):  # pragma: no cover - each subclass has its own
        raise NotImplementedError

    @staticmethod
    def backward(ctx, dout, *_) -> tuple:
        out, wanted = ctx.graph
        ctx.graph = None
        where, n_args = ctx.where
        grads = [None] * n_args
        if wanted and out.requires_grad:
            for p, g in zip(where, torch.autograd.grad(out, wanted, dout, allow_unused=True)):
                grads[p] = g
        return tuple(grads)


class FlashAttnFunc(_ReplayFunction):
    """``FlashAttnFunc.apply(q, k, v, softmax_scale, causal, qv=None, q_descale=None, k_descale=None,
    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
    deterministic=False, sm_margin=0, return_softmax=False)`` -> ``out`` or ``(out, softmax_lse)``; as
    ``flash_attn_3.flash_attn_func`` (gradients for q, k, v and qv)."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, qv=None, q_descale=None, k_descale=None, v_descale=None,
                window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                deterministic=False, sm_margin=0, return_softmax=False):
        from culmen.flash_attn_3.interface import flash_attn_func

        def fn(q, k, v, qv, *rest, return_attn_probs):
            return flash_attn_func(q, k, v, rest[0], rest[1], qv, *rest[2:], return_attn_probs=return_attn_probs)

        return _forward(ctx, fn, (q, k, v, qv, softmax_scale, causal, q_descale, k_descale, v_descale, window_size,
                                  attention_chunk, softcap, num_splits, pack_gqa, deterministic, sm_margin),
                        (0, 1, 2, 5), 17, return_softmax)


class FlashAttnVarlenFunc(_ReplayFunction):
    """``FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
    max_seqlen_k, softmax_scale, causal, qv=None, q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
    sm_margin=0, return_softmax=False)``; as ``flash_attn_3.flash_attn_varlen_func`` (note the class takes
    ``seqused_*`` before the max lengths, as FA3's does)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, qv=None, q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1),
                attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                return_softmax=False):
        from culmen.flash_attn_3.interface import flash_attn_varlen_func

        def fn(q, k, v, qv, cu_q, cu_k, used_q, used_k, max_q, max_k, *rest, return_attn_probs):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, rest[0], rest[1], qv,
                                          *rest[2:], return_attn_probs=return_attn_probs)

        return _forward(ctx, fn, (q, k, v, qv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale, causal, q_descale, k_descale, v_descale, window_size,
                                  attention_chunk, softcap, num_splits, pack_gqa, deterministic, sm_margin),
                        (0, 1, 2, 11), 23, return_softmax)


class FlashAttnQKVPackedFunc(_ReplayFunction):
    """``FlashAttnQKVPackedFunc.apply(qkv, softmax_scale, causal, q_descale=None, k_descale=None,
    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, deterministic=False,
    num_heads_q=None, sm_margin=0, return_softmax=False)``; as ``flash_attn_3.flash_attn_qkvpacked_func``."""

    @staticmethod
    def forward(ctx, qkv, softmax_scale, causal, q_descale=None, k_descale=None, v_descale=None,
                window_size=(-1, -1), attention_chunk=0, softcap=0.0, deterministic=False, num_heads_q=None,
                sm_margin=0, return_softmax=False):
        from culmen.flash_attn_3.interface import flash_attn_qkvpacked_func

        return _forward(ctx, flash_attn_qkvpacked_func, (qkv, softmax_scale, causal, q_descale, k_descale,
                                                         v_descale, window_size, attention_chunk, softcap,
                                                         deterministic, num_heads_q, sm_margin), (0,), 13,
                        return_softmax)
