"""``flash_attn`` / ``flash_attn_varlen``, the op-level entry points of ``culmen.flash_attn``, their eager
autograd, and the ``torch.library`` ops ``culmen::flash_attn_fwd`` / ``culmen::flash_attn_varlen_fwd``
that ``torch.compile`` traces.

The call path (DESIGN.md): an eager call builds a key from its signature and looks up a cached
``AttnPlan`` (validation ran when the plan was built); with autograd recording it goes through
``_AttnFn`` (a plain ``autograd.Function`` taking the plan and tensors), otherwise straight to the
plan's forward, which then stores no ``lse`` unless asked. Under ``torch.compile`` the ops are
``triton_op``s whose bodies launch through ``wrap_triton`` (Inductor launches the kernels itself), and
their backward (``register_autograd``) calls the plan's traced backward.

Where it runs: the Triton kernels when ``choose_backend(q.device)`` says ``"triton"`` (CUDA, or CPU
under ``CULMEN_BACKEND=triton`` + ``TRITON_INTERPRET=1``) for fp16/bf16/fp32, head dim <= 512 (256 for
fp32) and no ``return_attn_probs``; the reference otherwise (and on GPUs after
``launch.set_kernels_on_gpu(False)`` / ``CULMEN_FLASH_TRITON=0``, with a one-time warning). Conventions:

* ``lse`` is fp32 (fp64 for fp64 inputs), ``(B, h, sq)`` dense / ``(h, total_q)`` varlen, ``+inf``
  on rows that see no key (their output is 0);
* dropout replays the mask of ``culmen.ops.attention.dropout`` from the int64 ``rng_state = (seed,
  offset)`` drawn per call (one small kernel, CUDA-graph and compile safe; none when ``dropout_p == 0``);
* ``S_dmask`` (``return_probs``) is ``(B, h, round128(sq), round128(sk))`` in q's dtype (``max_seqlen``
  rounded for varlen, each sequence from row/column 0), ``+0`` in the padding. With dropout it is
  flash_attn 2.x's: ``exp(s - m)`` with ``m`` the forward's running row max over 128-key blocks walked
  from the last (``reference._flash_layout_probs``), dropped entries negated (the sign bit is the
  keep-mask applied to ``out``, masked entries ``+-0``). Without dropout (flash_attn returns an empty
  tensor) it holds the normalized probabilities;
* ``out`` is contiguous ``(B, sq, h, d)`` / ``(total_q, h, d)`` on every path (the fake implementations
  of the ``torch.library`` ops give the same strides);
* varlen rows outside every sequence (past ``cu_seqlens[-1]``) are left unwritten by the kernels (their
  ``out``, ``lse`` and gradients), as in flash_attn; the reference gives 0 (``lse = +inf``) there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.attention import checks, launch_ws
from culmen.ops.attention.launch import AttnPlan, use_kernels
from culmen.ops.attention.tma import nvidia_hopper
from culmen.ops.backend import register_op
from culmen.ops.common.function import raw_apply
from culmen.ops.common.outputs import nothing
from culmen.ops.common.plans import PlanCache

register_op("flash_attn_fwd", "attention", "FlashAttention forward (causal/window/softcap/ALiBi/GQA/dropout)")
register_op("flash_attn_bwd", "attention", "FlashAttention backward (dq, dk, dv; GQA reduced per KV head)")
register_op("flash_attn_varlen_fwd", "attention", "FlashAttention forward on packed variable-length sequences")
register_op("flash_attn_varlen_bwd", "attention", "backward of flash_attn_varlen_fwd")

PLANS = PlanCache("attention")
MAX_HEADDIM = checks.MAX_HEADDIM


def _rng_state(dropout_p: float, device) -> Tensor:
    """int64 ``(seed, offset)`` for the dropout mask, drawn from torch's generator of ``device`` (so
    ``torch.manual_seed`` replays it). A device tensor rather than host integers: CUDA-graph replays and
    compiled graphs draw a fresh mask each time."""
    return torch.randint(0, 2**62, (2,), device=device, dtype=torch.int64)


# ------------------------------------------------------------------------------------------- eager


class _AttnFn(torch.autograd.Function):
    """Eager autograd: the plan's kernels called directly (no ``torch.library`` dispatch). Returns
    ``out``, or ``(out, lse[, probs])`` when the plan returns them (not differentiable)."""

    @staticmethod
    def forward(ctx, plan, q, k, v, alibi, rng, cu_q, cu_k):
        out, lse, probs = plan.forward(q, k, v, alibi, rng, cu_q, cu_k, True)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse, alibi, rng, cu_q, cu_k)
        ctx.set_materialize_grads(False)
        if not plan.return_lse:
            return out
        if probs is None:
            ctx.mark_non_differentiable(lse)
            return out, lse
        ctx.mark_non_differentiable(lse, probs)
        return out, lse, probs

    @staticmethod
    def backward(ctx, dout, *_):
        if dout is None:
            return None, None, None, None, None, None, None, None
        q, k, v, out, lse, alibi, rng, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = ctx.plan.backward(dout, q, k, v, out, lse, alibi, rng, cu_q, cu_k)
        return None, dq, dk, dv, None, None, None, None


_apply = raw_apply(_AttnFn)


def _run(plan: AttnPlan, q, k, v, alibi, cu_q, cu_k):
    rng = _rng_state(plan.dropout_p, plan.device) if plan.has_dropout else None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        res = _apply(plan, q, k, v, alibi, rng, cu_q, cu_k)
        if not plan.return_lse:
            return res
        out, lse, probs = res if plan.return_probs else (*res, None)
    else:
        out, lse, probs = plan.forward(q, k, v, alibi, rng, cu_q, cu_k, plan.return_lse)
        if not plan.return_lse:
            return out
    return out, lse, (probs if probs is not None else nothing(plan.device, plan.dtype))


def attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
              alibi_slopes: Tensor | None = None, deterministic: bool = False, return_lse: bool = False,
              return_probs: bool = False):
    """Dense attention (``flash_attn_func``'s semantics): ``out``, or with ``return_lse`` /
    ``return_probs`` ``(out, softmax_lse, S_dmask)``. Shapes and options as ``flash_attn``."""
    if torch.compiler.is_compiling():
        return _attention_compiled(q, k, v, None, None, None, None, dropout_p, softmax_scale, causal, window_size,
                                   softcap, alibi_slopes, deterministic, return_lse, return_probs)
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device,
               None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
                                                  alibi_slopes.device),
               dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_lse, return_probs)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable arguments: the plan reports or handles it
        key, plan = None, None
    if plan is None:
        plan = AttnPlan("dense", q, k, v, alibi_slopes, dropout_p=dropout_p, softmax_scale=softmax_scale,
                        causal=causal, window_size=window_size, softcap=softcap, deterministic=deterministic,
                        return_lse=return_lse, return_probs=return_probs)
        if key is not None:
            PLANS.put(key, plan)
    return _run(plan, q, k, v, alibi_slopes, None, None)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: float | None = None,
                     causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     alibi_slopes: Tensor | None = None, deterministic: bool = False, return_lse: bool = False,
                     return_probs: bool = False):
    """Varlen attention (``flash_attn_varlen_func``'s semantics) on packed ``(total, heads, d)`` inputs:
    ``out``, or with ``return_lse`` / ``return_probs`` ``(out, softmax_lse (h, total_q), S_dmask)``."""
    if torch.compiler.is_compiling():
        return _attention_compiled(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                   return_lse, return_probs)
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device, cu_seqlens_q.shape, cu_seqlens_q.stride(),
               cu_seqlens_q.dtype, cu_seqlens_q.device, cu_seqlens_k.shape, cu_seqlens_k.stride(),
               cu_seqlens_k.dtype, cu_seqlens_k.device, max_seqlen_q, max_seqlen_k,
               None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
                                                  alibi_slopes.device),
               dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_lse, return_probs)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        plan = AttnPlan("varlen", q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap, deterministic=deterministic, return_lse=return_lse,
                        return_probs=return_probs)
        if key is not None:
            PLANS.put(key, plan)
    return _run(plan, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k)


def flash_attn(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
               causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
               alibi_slopes: Tensor | None = None, deterministic: bool = False,
               return_attn_probs: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Validated, differentiable dense attention; returns ``(out, softmax_lse, S_dmask)``.

    ``q``: ``(B, sq, h, d)``, ``k``/``v``: ``(B, sk, hk, d)``, fp16/bf16/fp32/fp64, ``d <= 512``,
    ``h % hk == 0``; ``out`` like ``q``, ``softmax_lse`` fp32 ``(B, h, sq)``. ``S_dmask`` is empty unless
    ``return_attn_probs``.
    """
    return attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                     True, return_attn_probs)


def flash_attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: float | None = None,
                      causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      alibi_slopes: Tensor | None = None, deterministic: bool = False,
                      return_attn_probs: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Validated, differentiable varlen attention on packed ``(total, heads, d)`` inputs with int32
    ``cu_seqlens_q/k`` ``(B + 1,)``; returns ``(out, softmax_lse (h, total_q), S_dmask)``."""
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, True,
                            return_attn_probs)


# ----------------------------------------------------------------------------------- torch.compile


def _traced_plan(q, k, v, alibi, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_left,
                 window_right, softcap, return_probs, deterministic) -> AttnPlan:
    """An uncached plan for traced code (sizes may be symbolic). Triton's CPU interpreter cannot be
    traced, so there the compiled graph takes the (traceable) reference path."""
    return AttnPlan("dense" if cu_q is None else "varlen", q, k, v, alibi, cu_q, cu_k, max_q, max_k,
                    dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                    window_size=(window_left, window_right), softcap=softcap, deterministic=deterministic,
                    return_lse=True, return_probs=return_probs, traced=True)


def _probs_out(probs: Tensor | None, q: Tensor) -> Tensor:
    """Custom ops cannot return ``None``: absent probabilities are a fresh empty tensor."""
    return probs if probs is not None else nothing(q.device, q.dtype)


@torch.library.triton_op("culmen::flash_attn_fwd", mutates_args=())
def flash_attn_fwd_op(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Tensor | None, rng_state: Tensor | None,
                      dropout_p: float, softmax_scale: float, causal: bool, window_left: int, window_right: int,
                      softcap: float, return_probs: bool, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Dense forward for ``torch.compile``: ``q (B, sq, h, d)``, ``k``/``v`` ``(B, sk, hk, d)`` -> ``(out,
    lse, probs)`` (``probs`` empty unless ``return_probs``)."""
    plan = _traced_plan(q, k, v, alibi_slopes, None, None, None, None, dropout_p, softmax_scale, causal,
                        window_left, window_right, softcap, return_probs, deterministic)
    out, lse, probs = plan.forward(q, k, v, alibi_slopes, rng_state, None, None, True, traced=True)
    return out, lse, _probs_out(probs, q)


@torch.library.triton_op("culmen::flash_attn_varlen_fwd", mutates_args=())
def flash_attn_varlen_fwd_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Tensor | None,
                             rng_state: Tensor | None, dropout_p: float, softmax_scale: float, causal: bool,
                             window_left: int, window_right: int, softcap: float, return_probs: bool,
                             deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Varlen forward for ``torch.compile``: packed ``q (total_q, h, d)``, ``k``/``v`` ``(total_k, hk, d)``,
    int32 ``cu_seqlens`` ``(B + 1,)`` -> ``(out (total_q, h, d), lse (h, total_q), probs)``."""
    plan = _traced_plan(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                        softmax_scale, causal, window_left, window_right, softcap, return_probs, deterministic)
    out, lse, probs = plan.forward(q, k, v, alibi_slopes, rng_state, cu_seqlens_q, cu_seqlens_k, True, traced=True)
    return out, lse, _probs_out(probs, q)


# Runs while torch.compile traces: the plan rides on ctx to the backward, which launches the kernels
# itself through wrap_triton (no backward custom op needed).
def _setup_context(ctx, inputs, output):
    q, k, v, alibi, rng = inputs[:5]
    ctx.plan = _traced_plan(q, k, v, alibi, None, None, None, None, *inputs[5:])
    ctx.save_for_backward(q, k, v, output[0], output[1], alibi, rng)


def _compiled_backward(ctx, dout, _dlse, _dprobs):
    q, k, v, out, lse, alibi, rng = ctx.saved_tensors
    dq, dk, dv = ctx.plan.backward(dout, q, k, v, out, lse, alibi, rng, traced=True)
    return (dq, dk, dv) + (None,) * 10


def _setup_context_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, alibi, rng = inputs[:9]
    ctx.plan = _traced_plan(q, k, v, alibi, cu_q, cu_k, max_q, max_k, *inputs[9:])
    ctx.save_for_backward(q, k, v, output[0], output[1], alibi, rng, cu_q, cu_k)


def _compiled_backward_varlen(ctx, dout, _dlse, _dprobs):
    q, k, v, out, lse, alibi, rng, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = ctx.plan.backward(dout, q, k, v, out, lse, alibi, rng, cu_q, cu_k, traced=True)
    return (dq, dk, dv) + (None,) * 14


torch.library.register_autograd("culmen::flash_attn_fwd", _compiled_backward, setup_context=_setup_context)
torch.library.register_autograd("culmen::flash_attn_varlen_fwd", _compiled_backward_varlen,
                                setup_context=_setup_context_varlen)


def _attention_compiled(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi, deterministic, return_lse, return_probs):
    """``attention`` / ``attention_varlen`` while ``torch.compile`` traces: the ``triton_op``s, no plan cache
    (the checks run here too, so a bad call fails with the eager path's message)."""
    if cu_q is None:
        checks.check_common(q, k, v, dropout_p, window_size, softcap, alibi, q.shape[0] if q.dim() else 0, 4,
                            "(batch, seqlen, nheads, headdim)")
        checks.check_dense(q, k, v)
    else:
        checks.check_cu_seqlens(cu_q, cu_k, max_q, max_k)
        checks.check_common(q, k, v, dropout_p, window_size, softcap, alibi, cu_q.shape[0] - 1, 3,
                            "(total, nheads, headdim)")
    scale = int(q.shape[-1]) ** -0.5 if softmax_scale is None else float(softmax_scale)
    if cu_q is None and _ws_under_compile(q, k, v, dropout_p, causal, window_size, softcap, alibi, deterministic,
                                          return_probs):
        out, lse = flash_attn_ws_fwd_op(q, k, v, scale, bool(causal))
        return (out, lse, nothing(q.device, q.dtype)) if return_lse else out
    rng = _rng_state(dropout_p, q.device) if dropout_p > 0.0 else None
    tail = (alibi, rng, float(dropout_p), scale, bool(causal), int(window_size[0]), int(window_size[1]),
            float(softcap), bool(return_probs), bool(deterministic))
    if cu_q is None:
        out, lse, probs = flash_attn_fwd_op(q, k, v, *tail)
    else:
        out, lse, probs = flash_attn_varlen_fwd_op(q, k, v, cu_q, cu_k, max_q, max_k, *tail)
    return (out, lse, probs) if (return_lse or return_probs) else out


def _ws_under_compile(q, k, v, dropout_p, causal, window_size, softcap, alibi, deterministic,
                      return_probs) -> bool:
    """Whether a dense call traced by ``torch.compile`` runs as the opaque ``culmen::flash_attn_ws_*`` ops
    (``launch_ws.WS_TUNING["compile"]``): the eager plans inside, so the Gluon kernels serve compiled models too.
    The ``triton_op`` path's plans never take them (tracing is one of ``ws_config``'s extras): Inductor re-emits
    the kernels of ``wrap_triton`` in its own generated code, untried with Gluon's explicit layouts, warp
    specialization and device-side TMA descriptors. Only calls the Gluon forward takes eagerly, with static
    shapes (the plans are keyed by them)."""
    if not launch_ws.WS_TUNING["compile"] or q.device.type != "cuda":
        return False
    if (dropout_p > 0.0 or softcap > 0.0 or alibi is not None or deterministic or return_probs
            or tuple(window_size) != (-1, -1)):
        return False
    if not all(isinstance(n, int) for t in (q, k, v) for n in (*t.shape, *t.stride())):
        return False
    if not use_kernels(q.device, q.dtype, int(q.shape[-1])):
        return False
    return launch_ws.ws_config(q, k, v, causal=bool(causal), extras=False, on_gpu=True,
                               hopper=nvidia_hopper(q.device)) is not None


def _ws_plan(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> AttnPlan:
    """The eager plan of an opaque op's call (cached like ``attention``'s)."""
    key = ("ws-compile", q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, v.shape, v.stride(),
           scale, causal)
    plan = PLANS.get(key)
    if plan is None:
        plan = AttnPlan("dense", q, k, v, None, softmax_scale=scale, causal=causal, return_lse=True)
        PLANS.put(key, plan)
    return plan


@torch.library.custom_op("culmen::flash_attn_ws_fwd", mutates_args=())
def flash_attn_ws_fwd_op(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Dense forward for ``torch.compile`` through the eager plan (``_ws_under_compile``): ``q (B, sq, h, d)``,
    ``k``/``v`` ``(B, sk, hk, d)`` -> contiguous ``out`` like ``q`` and fp32 ``lse (B, h, sq)``."""
    out, lse, _ = _ws_plan(q, k, v, softmax_scale, causal).forward(q, k, v, None, None, None, None, True)
    return out.contiguous(), lse.contiguous()


@flash_attn_ws_fwd_op.register_fake
def _(q, k, v, softmax_scale, causal):
    B, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, h, sq), dtype=torch.float32)


@torch.library.custom_op("culmen::flash_attn_ws_bwd", mutates_args=())
def flash_attn_ws_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         softmax_scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``flash_attn_ws_fwd``: contiguous ``(dq, dk, dv)`` like ``q``, ``k``, ``v``, by the eager plan
    (the Gluon backward unless deterministic algorithms are on, checked per call as in eager)."""
    dq, dk, dv = _ws_plan(q, k, v, softmax_scale, causal).backward(dout, q, k, v, out, lse, None, None)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@flash_attn_ws_bwd_op.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context_ws(ctx, inputs, output):
    q, k, v, scale, causal = inputs
    ctx.scale, ctx.causal = scale, causal
    ctx.save_for_backward(q, k, v, *output)


def _compiled_backward_ws(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attn_ws_bwd_op(dout, q, k, v, out, lse, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None


torch.library.register_autograd("culmen::flash_attn_ws_fwd", _compiled_backward_ws, setup_context=_setup_context_ws)


# ------------------------------------------------------------------------------------ FA3 features

FA3_PLANS = PlanCache("attention_fa3")


class _AttnQVFn(torch.autograd.Function):
    """Eager autograd of attention with FA3's ``qv`` (a fifth differentiable input). Returns ``out`` or
    ``(out, lse)`` (``lse`` not differentiable)."""

    @staticmethod
    def forward(ctx, plan, q, k, v, qv, cu_q, cu_k):
        out, lse, _ = plan.forward(q, k, v, None, None, cu_q, cu_k, True, qv=qv)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, qv, out, lse, cu_q, cu_k)
        ctx.set_materialize_grads(False)
        if not plan.return_lse:
            return out
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, *_):
        if dout is None:
            return (None,) * 7
        q, k, v, qv, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv, dqv = ctx.plan.backward(dout, q, k, v, out, lse, None, None, cu_q, cu_k, qv=qv)
        return None, dq, dk, dv, dqv, None, None


def check_qv(qv, q: Tensor, v: Tensor) -> None:
    """FA3's ``qv``: q's dtype and device, ``q``'s shape but for the last dim, which is V's head dim."""
    if not isinstance(qv, Tensor):
        raise TypeError(f"qv must be a torch.Tensor, got {type(qv).__name__}")
    want = (*q.shape[:-1], v.shape[-1])
    if tuple(qv.shape) != want:
        raise ValueError(f"qv must have shape {want} (q's with V's head dim), got {tuple(qv.shape)}")
    if qv.dtype != q.dtype or qv.device != q.device:
        raise TypeError(f"qv must have q's dtype {q.dtype} and device {q.device}, got {qv.dtype} on {qv.device}")


def fa3_descales(q_descale, k_descale, v_descale, batch: int, nheads_k: int, device):
    """FA3's descales as the kernels read them: contiguous fp32 ``(batch, nheads_k)`` on ``device`` (a
    missing one is 1). Each may be any tensor that broadcasts to ``(batch, nheads_k)``, as FA3 takes them."""
    out = []
    for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if d is None:
            out.append(torch.ones(batch, nheads_k, dtype=torch.float32, device=device))
            continue
        if not isinstance(d, Tensor) or not d.is_floating_point():
            raise TypeError(f"{name} must be a float tensor of shape ({batch}, {nheads_k}), got "
                            f"{getattr(d, 'dtype', type(d).__name__)}")
        try:
            out.append(d.to(device=device, dtype=torch.float32).expand(batch, nheads_k).contiguous())
        except RuntimeError:
            raise ValueError(f"{name} must have shape ({batch}, {nheads_k}) (batch, nheads_k), got "
                             f"{tuple(d.shape)}") from None
    return tuple(out)


def fa3_plan(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
             max_seqlen_q: int | None, max_seqlen_k: int | None, softmax_scale: float | None, causal: bool,
             window_size: tuple[int, int], softcap: float, deterministic: bool, return_lse: bool,
             attention_chunk: int = 0, has_desc: bool = False, has_qv: bool = False) -> AttnPlan:
    """The cached plan of an FA3-featured call (``attention_fa3``; also the backward FA3's low-level
    ``_flash_attn_backward`` runs on given ``out``/``lse``): dense, or varlen when ``cu_seqlens_q`` is given."""
    varlen = cu_seqlens_q is not None
    try:
        key = (has_qv, q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device, varlen and (cu_seqlens_q.shape, cu_seqlens_q.device,
                                                                   cu_seqlens_k.shape, cu_seqlens_k.device),
               max_seqlen_q, max_seqlen_k, softmax_scale, causal, tuple(window_size), softcap, deterministic,
               return_lse, attention_chunk, has_desc)
        plan = FA3_PLANS.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        plan = AttnPlan("varlen" if varlen else "dense", q, k, v, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                        softcap=softcap, deterministic=deterministic, return_lse=return_lse,
                        attention_chunk=attention_chunk, descale=has_desc, fa3=True, qv=has_qv)
        if key is not None:
            FA3_PLANS.put(key, plan)
    return plan


def attention_fa3(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None = None,
                  cu_seqlens_k: Tensor | None = None, max_seqlen_q: int | None = None,
                  max_seqlen_k: int | None = None, softmax_scale: float | None = None, causal: bool = False,
                  window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, deterministic: bool = False,
                  return_lse: bool = False, attention_chunk: int = 0, q_descale: Tensor | None = None,
                  k_descale: Tensor | None = None, v_descale: Tensor | None = None, qv: Tensor | None = None):
    """Attention with FlashAttention-3's extra features, dense (``q (B, sq, h, d)``, ``k (B, sk, hk, d)``,
    ``v (B, sk, hk, dv)``) or varlen (packed ``(total, heads, ...)`` with int32 ``cu_seqlens_q/k``):

    * ``dv != d``: a V head dim other than the QK head dim (DeepSeek's 192/128); ``out`` is ``(..., dv)``;
      forward and backward.
    * ``attention_chunk = C > 0``: chunked-local attention; query ``i`` (at key position ``i + sk - sq``)
      sees key ``j`` only when both lie in the same chunk of ``C`` positions (``j // C == (i + sk - sq) // C``),
      on top of ``causal`` / ``window_size``. Differentiable (FA3 has no backward for it; here it is the
      same kernels with one more mask term, so it costs nothing extra).
    * float8_e4m3fn ``q``/``k``/``v`` with ``q_descale``/``k_descale``/``v_descale`` (fp32, broadcastable to
      ``(B, hk)``; missing = 1): the forward computes ``softmax(scale * (q * qd) . (k * kd)) (v * vd)``
      with fp8 tensor-core products (P is rounded to fp8 for the second one, as FA3 does) and returns bf16.
      No backward (as FA3).
    * ``qv`` (FA3's MLA-style extra query, ``(B, sq, h, dv)`` / ``(total_q, h, dv)``, q's dtype): every score is
      ``scale * (q . k + qv . v)``, ``scale`` defaulting to ``(d + dv) ** -0.5`` as in FA3. Differentiable
      here (dq, dk, dv, dqv; FA3's backward ignores qv); not with float8 inputs.

    Returns ``out``, or with ``return_lse`` ``(out, lse)`` (fp32 ``(B, h, sq)`` / ``(h, total_q)``). Runs
    eagerly (``torch.compile`` calls it outside the graph).
    """
    if type(attention_chunk) is not int or attention_chunk < 0:
        raise ValueError(f"attention_chunk must be an int >= 0, got {attention_chunk!r}")
    has_desc = q_descale is not None or k_descale is not None or v_descale is not None
    fp8 = isinstance(q, Tensor) and q.dtype in checks.FP8
    if has_desc and not fp8:
        raise ValueError(f"q_descale/k_descale/v_descale apply to float8_e4m3fn inputs only, q is "
                         f"{getattr(q, 'dtype', type(q).__name__)}")
    if qv is not None:
        check_qv(qv, q, v)
    plan = fa3_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_size, softcap, deterministic, return_lse, attention_chunk, has_desc, qv is not None)
    if qv is not None:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or qv.requires_grad):
            return _AttnQVFn.apply(plan, q, k, v, qv, cu_seqlens_q, cu_seqlens_k)
        out, lse, _ = plan.forward(q, k, v, None, None, cu_seqlens_q, cu_seqlens_k, return_lse, qv=qv)
        return (out, lse) if return_lse else out
    if plan.fp8:
        desc = fa3_descales(q_descale, k_descale, v_descale, plan.B, plan.HK, plan.device) if has_desc else None
        out, lse, _ = plan.forward(q, k, v, None, None, cu_seqlens_q, cu_seqlens_k, return_lse, descales=desc)
        return (out, lse) if return_lse else out
    res = _run(plan, q, k, v, None, cu_seqlens_q, cu_seqlens_k)
    return (res[0], res[1]) if return_lse else res


attention_fa3 = torch.compiler.disable(attention_fa3)
