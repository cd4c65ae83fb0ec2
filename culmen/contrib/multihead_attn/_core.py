"""The fast path of ``culmen.contrib.multihead_attn`` on culmen's FlashAttention, fused softmax and LayerNorm.

Apex's attention works on sequence-first activations ``(seq, batch, embed)`` and lays the input
projection's output out per head: for self-attention the ``3 * embed`` features of a token are
``(heads, 3, head_dim)`` (q, k, v of head 0, then of head 1 ...), for encoder-decoder attention the
query projection is ``(heads, head_dim)`` and the key/value projection ``(heads, 2, head_dim)``. The
fast path keeps that layout: the attention kernels read q, k and v straight out of the projection's
output through strides (no split, no transpose copy), and the backward writes one packed gradient in the
same layout, so the projection's backward gets a single contiguous tensor instead of three partial
gradients that autograd would zero-fill and add up.

Masks pick the kernel:

* none: dense FlashAttention;
* a time mask equal to ``triu(ones, 1)`` (the usual future mask): dense causal FlashAttention. The check
  reads the mask once (a host sync) and is remembered for that tensor while it is alive and unchanged;
* a boolean key-padding mask ``(batch, seq_k)`` (nonzero = padding): varlen FlashAttention. The kept keys
  are packed batch by batch with a stable device sort (any pattern of padding, no host sync), every
  query stays; a batch row with no key left gets zeros (Apex's kernels give NaN there);
* an additive key-padding mask, or any other time mask: the scores are materialized and go through
  culmen's fused scaled masked softmax (a masked score becomes -10000 as in Apex's fused softmax
  kernels; the ``default`` path uses -inf: the two differ only where a row keeps no key).

Nothing here is Apex's code: the layouts and argument conventions are the contract, the implementation
is culmen's.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.contrib.multihead_attn._block import block_forward, block_plan, self_attn_block
from culmen.flash_attn.ops.triton.layer_norm import layer_norm_fn
from culmen.ops.attention.launch import AttnPlan
from culmen.ops.common.function import raw_apply
from culmen.ops.common.plans import PlanCache
from culmen.ops.softmax import scaled_masked_softmax

PLANS = PlanCache("multihead_attn")
LN_EPS = 1e-5
"""LayerNorm epsilon of the ``include_norm_add`` variants (Apex's fused kernels use 1e-5)."""

_MASK_DTYPES = (torch.bool, torch.uint8)

USE_BLOCK = True
"""Self-attention without a mask, with the future mask or with boolean key padding runs as one autograd
node (``_block``). ``False`` runs the chain ``F.linear -> attention node -> F.linear`` instead (the same
kernels; kept for ``scripts/sweep_multihead_attn.py`` to compare the two on a GPU)."""


def rng_state(dropout_p: float, device: torch.device) -> Tensor | None:
    """int64 ``(seed, offset)`` of the attention kernels' Philox dropout (drawn from torch's generator, so
    ``torch.manual_seed`` replays it); ``None`` without dropout."""
    if dropout_p <= 0.0:
        return None
    return torch.randint(0, 2**62, (2,), device=device, dtype=torch.int64)


def attn_plan(kind: str, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None, cu_k: Tensor | None,
              max_q: int | None, max_k: int | None, dropout_p: float, scale: float, causal: bool) -> AttnPlan:
    """The cached ``AttnPlan`` of one call signature (checks run when it is first built)."""
    key = (kind, q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device,
           None if cu_q is None else (cu_q.shape, cu_q.dtype, cu_k.dtype, cu_q.device), max_q, max_k,
           dropout_p, scale, causal)
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.put(key, AttnPlan(kind, q, k, v, None, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p,
                                       softmax_scale=scale, causal=causal, return_lse=True))
    return plan


def _padded_plan(b: int, sq: int, sk: int, h: int, d: int, like: Tensor, cu_q: Tensor, cu_k: Tensor,
                 dropout_p: float, scale: float) -> AttnPlan:
    """The varlen plan of ``_PaddedAttn`` (packed contiguous ``(B * s, h, d)`` queries and keys)."""
    key = ("padded", b, sq, sk, h, d, like.dtype, like.device, dropout_p, scale)
    plan = PLANS.get(key)
    if plan is None:
        q = like.new_empty(b * sq, h, d)
        k = like.new_empty(b * sk, h, d)
        plan = PLANS.put(key, AttnPlan("varlen", q, k, k, None, cu_q, cu_k, sq, sk, dropout_p=dropout_p,
                                       softmax_scale=scale, causal=False, return_lse=True))
    return plan


def _qkv_views(qkv: Tensor, kv: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(seq, batch, heads, head_dim)`` views of q, k, v inside the packed projection outputs."""
    if kv is None:
        return qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    return qkv[:, :, :, 0], kv[:, :, :, 0], kv[:, :, :, 1]


def _packed_grads(qkv: Tensor, kv: Tensor | None, dq_sb: Tensor, write_kv) -> tuple[Tensor, Tensor | None]:
    """Gradients shaped like ``qkv`` / ``kv`` (contiguous): ``dq_sb`` is ``(seq_q, batch, heads, d)``;
    ``write_kv(rows_k, rows_v)`` fills the key / value parts given their ``(seq_k * batch, heads, d)`` views."""
    gq = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    gq[:, :, :, 0] = dq_sb
    if kv is None:
        rows = gq.view(-1, *qkv.shape[2:])
        write_kv(rows[:, :, 1], rows[:, :, 2])
        return gq, None
    gkv = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    rows = gkv.view(-1, *kv.shape[2:])
    write_kv(rows[:, :, 0], rows[:, :, 1])
    return gq, gkv


class _DenseAttn(torch.autograd.Function):
    """Dense (optionally causal) attention on the packed projections: ``qkv (sq, B, h, 3 | 1, d)`` and, for
    encoder-decoder attention, ``kv (sk, B, h, 2, d)``. Returns the context ``(sq, B, h * d)``."""

    @staticmethod
    def forward(ctx, plan, rng, qkv, kv):
        q, k, v = (t.transpose(0, 1) for t in _qkv_views(qkv, kv))
        out, lse, _ = plan.forward(q, k, v, None, rng, None, None, True)
        ctx.plan = plan
        ctx.save_for_backward(qkv, kv, out, lse, rng)
        sq, b, h, _, d = qkv.shape
        return out.transpose(0, 1).reshape(sq, b, h * d)

    @staticmethod
    def backward(ctx, dy):
        qkv, kv, out, lse, rng = ctx.saved_tensors
        sq, b, h, _, d = qkv.shape
        q, k, v = (t.transpose(0, 1) for t in _qkv_views(qkv, kv))
        # The kernels take any strides: the (sq, B) gradient is read in place as (B, sq).
        dout = dy.reshape(sq, b, h, d).transpose(0, 1)
        dq, dk, dv = ctx.plan.backward(dout, q, k, v, out, lse, None, rng)

        def write_kv(rk, rv):
            sk = dk.shape[1]
            rk.view(sk, b, h, d).copy_(dk.transpose(0, 1))
            rv.view(sk, b, h, d).copy_(dv.transpose(0, 1))

        gq, gkv = _packed_grads(qkv, kv, dq.transpose(0, 1), write_kv)
        return None, None, gq, gkv


class _PaddedAttn(torch.autograd.Function):
    """Key-padding attention through the varlen kernels: every query of a batch row attends to the row's
    kept keys, gathered (``src``: seq-major row of each packed key, kept keys first, batch by batch) into
    ``(B * sk, h, d)``; ``cu_k`` delimits each row's keys and ``keep`` flags the packed rows in use."""

    @staticmethod
    def forward(ctx, plan, rng, qkv, kv, src, keep, cu_q, cu_k):
        sq, b, h, _, d = qkv.shape
        qv, kv_, vv = _qkv_views(qkv, kv)
        q = qv.transpose(0, 1).reshape(b * sq, h, d)
        sk = kv_.shape[0]
        k = kv_.reshape(sk * b, h, d).index_select(0, src)
        v = vv.reshape(sk * b, h, d).index_select(0, src)
        out, lse, _ = plan.forward(q, k, v, None, rng, cu_q, cu_k, True)
        ctx.plan = plan
        ctx.save_for_backward(qkv, kv, q, k, v, out, lse, rng, src, keep, cu_q, cu_k)
        return out.view(b, sq, h * d).transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, dy):
        qkv, kv, q, k, v, out, lse, rng, src, keep, cu_q, cu_k = ctx.saved_tensors
        sq, b, h, _, d = qkv.shape
        dout = dy.transpose(0, 1).reshape(b * sq, h, d)
        dq, dk, dv = ctx.plan.backward(dout, q, k, v, out, lse, None, rng, cu_q, cu_k)
        # Packed rows past the last kept key belong to no sequence: their gradients are unspecified, and
        # they are the padded keys, whose gradient is zero.
        drop = ~keep[:, None, None]
        dk = dk.masked_fill(drop, 0.0)
        dv = dv.masked_fill(drop, 0.0)

        def write_kv(rk, rv):
            rk.index_copy_(0, src, dk)
            rv.index_copy_(0, src, dv)

        gq, gkv = _packed_grads(qkv, kv, dq.view(b, sq, h, d).transpose(0, 1), write_kv)
        return None, None, gq, gkv, None, None, None, None


_dense = raw_apply(_DenseAttn)
_padded = raw_apply(_PaddedAttn)


class _CausalCache:
    """Whether a time mask is the future mask ``triu(ones, 1)``, remembered per live, unmodified tensor (the
    check reads the mask back, a host sync; a training loop passes the same mask every step)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref, int, bool]] = {}

    def __call__(self, mask: Tensor) -> bool:
        entry = self._seen.get(id(mask))
        if entry is not None and entry[0]() is mask and entry[1] == mask._version:
            return entry[2]
        sq, sk = mask.shape
        future = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
        causal = sq == sk and bool(torch.equal(mask.ne(0), future))
        if len(self._seen) > 64:
            self._seen.clear()
        key = id(mask)
        self._seen[key] = (weakref.ref(mask, lambda _r, key=key: self._seen.pop(key, None)), mask._version, causal)
        return causal


is_future_mask = _CausalCache()

_CU_Q: dict[tuple, Tensor] = {}


def _cu_dense(b: int, s: int, device: torch.device) -> Tensor:
    """int32 ``[0, s, 2s, ..., b*s]``: every query of every batch row (cached per shape and device)."""
    key = (b, s, device)
    cu = _CU_Q.get(key)
    if cu is None:
        if len(_CU_Q) > 256:
            _CU_Q.clear()
        cu = _CU_Q[key] = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)
    return cu


def check_mask(mask, name: str, shape: tuple[int, int], additive: bool = False) -> None:
    """``TypeError`` / ``ValueError`` for a mask that is not a ``shape`` tensor (float when additive)."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(mask.shape)}")
    if additive and not mask.is_floating_point():
        raise TypeError(f"an additive {name} must be a floating-point tensor, got {mask.dtype}")


def _scores_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, time_mask: bool, additive: bool,
                      dropout_p: float, scale: float) -> Tensor:
    """Materialized attention for masks the flash kernels cannot take: ``q (sq, B, h, d)``, ``k``/``v``
    ``(sk, B, h, d)`` (views); returns the context ``(sq, B, h * d)``."""
    sq, b, h, d = q.shape
    s = torch.matmul(q.permute(1, 2, 0, 3), k.permute(1, 2, 3, 0))  # (B, h, sq, sk)
    if additive:
        bias = mask.view(1, 1, *mask.shape) if time_mask else mask.view(b, 1, 1, -1)
        s = torch.add(bias.to(s.dtype), s, alpha=scale)
        p = scaled_masked_softmax(s, None, 1.0)
    else:
        m = mask if mask.dtype in _MASK_DTYPES else mask.ne(0)
        m = m.view(1, 1, *m.shape) if time_mask else m.view(b, 1, 1, -1)
        p = scaled_masked_softmax(s, m, scale)
    if dropout_p > 0.0:
        p = F.dropout(p, dropout_p)
    o = torch.matmul(p, v.permute(1, 2, 0, 3))  # (B, h, sq, d)
    return o.permute(2, 0, 1, 3).reshape(sq, b, h * d)


def attend(qkv: Tensor, kv: Tensor | None, mask: Tensor | None, use_time_mask: bool, mask_additive: bool,
           dropout_p: float) -> Tensor:
    """Attention of the packed projections (see the module docstring for the layouts and the mask rules).

    Args:
        qkv: ``(sq, B, h, 3, d)`` for self-attention, ``(sq, B, h, 1, d)`` (the queries) with ``kv``.
        kv: ``(sk, B, h, 2, d)`` keys and values of encoder-decoder attention, or ``None``.
        mask: ``None``; a time mask ``(sq, sk)`` (nonzero = masked) when ``use_time_mask``; else a key
            padding mask ``(B, sk)``: nonzero = padding, or, with ``mask_additive``, added to the scores.
        dropout_p: attention-probability dropout (0 for evaluation).

    Returns the context ``(sq, B, h * d)`` in the projections' dtype, contiguous.
    """
    sq, b, h, _, d = qkv.shape
    sk = qkv.shape[0] if kv is None else kv.shape[0]
    scale = d ** -0.5
    if mask is None or (use_time_mask and not mask_additive and is_future_mask(mask)):
        causal = mask is not None
        q, k, v = (t.transpose(0, 1) for t in _qkv_views(qkv, kv))
        plan = attn_plan("dense", q, k, v, None, None, None, None, dropout_p, scale, causal)
        return _dense(plan, rng_state(dropout_p, qkv.device), qkv, kv)
    if use_time_mask or mask_additive:
        q, k, v = _qkv_views(qkv, kv)
        return _scores_attention(q, k, v, mask, use_time_mask, mask_additive, dropout_p, scale)
    pad = mask.reshape(-1).ne(0)
    order = torch.sort(pad.to(torch.uint8), stable=True).indices  # kept keys first, batch-major
    src = (order % sk) * b + order // sk
    counts = (~pad).view(b, sk).sum(1, dtype=torch.int32)
    cu_k = F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))
    keep = torch.arange(b * sk, device=qkv.device) < cu_k[-1]
    cu_q = _cu_dense(b, sq, qkv.device)
    plan = _padded_plan(b, sq, sk, h, d, qkv, cu_q, cu_k, dropout_p, scale)
    return _padded(plan, rng_state(dropout_p, qkv.device), qkv, kv, src, keep, cu_q, cu_k)


# ------------------------------------------------------------------------- projections and checks


def check_heads(embed_dim, num_heads) -> int:
    """``head_dim`` of a valid ``(embed_dim, num_heads)``; ``ValueError`` / ``TypeError`` otherwise."""
    for name, n in (("embed_dim", embed_dim), ("num_heads", num_heads)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        if n <= 0:
            raise ValueError(f"{name} must be positive, got {n}")
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
    return embed_dim // num_heads


def check_dropout(p) -> float:
    """``p`` as a float in ``[0, 1)``; ``ValueError`` / ``TypeError`` otherwise."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"dropout must be a float in [0, 1), got {type(p).__name__}")
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p}")
    return float(p)


def check_activations(name: str, x, weight: Tensor, heads: int) -> None:
    """``x`` must be ``(seq, batch, embed)`` with ``embed == weight.shape[1]`` divisible by ``heads``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D (seq, batch, embed_dim), got shape {tuple(x.shape)}")
    if x.shape[2] != weight.shape[1]:
        raise ValueError(f"{name} has embed dim {x.shape[2]} but the input weights expect {weight.shape[1]}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0 or x.shape[2] % heads:
        raise ValueError(f"heads must be a positive int dividing embed_dim ({x.shape[2]}), got {heads!r}")


def check_attn_mask(mask, use_time_mask: bool, additive: bool, sq: int, sk: int, b: int) -> None:
    """The mask of a call: a time mask ``(sq, sk)`` or a key-padding mask ``(batch, sk)``."""
    if mask is None:
        return
    if use_time_mask:
        if additive:
            raise ValueError("mask_additive applies to key padding masks; a time mask (attn_mask) is boolean")
        check_mask(mask, "attn_mask", (sq, sk))
    else:
        check_mask(mask, "key_padding_mask", (b, sk), additive)


def out_projection(ctx: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
                   dropout_p: float) -> Tensor:
    """``linear(ctx)``, or with ``residual`` ``residual + dropout(linear(ctx))`` (the add folded into the
    GEMM when nothing sits between them)."""
    if residual is None:
        return F.linear(ctx, weight, bias)
    if dropout_p > 0.0 or bias is not None:
        y = F.linear(ctx, weight, bias)
        return residual + (F.dropout(y, dropout_p) if dropout_p > 0.0 else y)
    e = ctx.shape[-1]
    return torch.addmm(residual.reshape(-1, weight.shape[0]), ctx.reshape(-1, e), weight.t()).view(residual.shape)


def self_attention(inputs: Tensor, heads: int, in_w: Tensor, in_b: Tensor | None, out_w: Tensor,
                   out_b: Tensor | None, mask: Tensor | None, use_time_mask: bool, mask_additive: bool,
                   dropout_p: float, norm: tuple[Tensor, Tensor] | None = None,
                   out_dropout_p: float = 0.0) -> Tensor:
    """Fast self-attention of ``inputs (seq, batch, embed)``; ``norm = (gamma, beta)`` adds Apex's
    ``include_norm_add`` (pre-LayerNorm, then ``inputs + dropout(out, out_dropout_p)``).

    No mask, the future mask and boolean key padding run as one autograd node (``_block``); other masks
    materialize the scores (``_scores_attention``) between two ``F.linear``."""
    check_activations("inputs", inputs, in_w, heads)
    s, b, e = inputs.shape
    check_attn_mask(mask, use_time_mask, mask_additive, s, s, b)
    x = inputs if norm is None else layer_norm_fn(inputs, norm[0], norm[1], eps=LN_EPS)
    causal = padded = False
    if mask is not None and not mask_additive:
        if use_time_mask:
            causal = is_future_mask(mask)
        else:
            padded = True
    if USE_BLOCK and (mask is None or causal or padded):
        residual = inputs if norm is not None and out_dropout_p == 0.0 else None
        rng = rng_state(dropout_p, inputs.device) if dropout_p > 0.0 else None
        if padded:
            if mask.dtype is not torch.bool and mask.dtype is not torch.uint8:
                mask = mask.ne(0)  # bool / uint8 masks are read as they are
            bp = block_plan(x, heads, True, False, dropout_p, mask)
            idx, cu_k = bp.key_order(mask)
        else:
            bp = block_plan(x, heads, False, causal, dropout_p)
            idx = cu_k = None
        if torch.is_grad_enabled():
            out = self_attn_block(bp, rng, x, in_w, in_b, out_w, out_b, residual, idx, cu_k)
        else:  # inference: no autograd node, no log-sum-exp
            out = block_forward(bp, rng, x, in_w, in_b, out_w, out_b, residual, idx, cu_k, False)[0]
        if norm is None or residual is not None:
            return out
        return inputs + F.dropout(out, out_dropout_p)
    qkv = F.linear(x, in_w, in_b).reshape(s, b, heads, 3, e // heads)
    ctx = attend(qkv, None, mask, use_time_mask, mask_additive, dropout_p)
    return out_projection(ctx, out_w, out_b, None if norm is None else inputs, out_dropout_p)


def encdec_attention(inputs_q: Tensor, inputs_kv: Tensor, heads: int, w_q: Tensor, w_kv: Tensor, out_w: Tensor,
                     b_q: Tensor | None, b_kv: Tensor | None, out_b: Tensor | None, mask: Tensor | None,
                     use_time_mask: bool, mask_additive: bool, dropout_p: float,
                     norm: tuple[Tensor, Tensor] | None = None, out_dropout_p: float = 0.0) -> Tensor:
    """Fast encoder-decoder attention: queries from ``inputs_q (sq, batch, embed)``, keys and values from
    ``inputs_kv (sk, batch, embed)``; ``norm`` normalizes the queries' input (``include_norm_add``)."""
    check_activations("inputs_q", inputs_q, w_q, heads)
    check_activations("inputs_kv", inputs_kv, w_kv, heads)
    sq, b, e = inputs_q.shape
    sk = inputs_kv.shape[0]
    if inputs_kv.shape[1] != b:
        raise ValueError(f"inputs_kv batch size {inputs_kv.shape[1]} must equal inputs_q's ({b})")
    check_attn_mask(mask, use_time_mask, mask_additive, sq, sk, b)
    x = inputs_q if norm is None else layer_norm_fn(inputs_q, norm[0], norm[1], eps=LN_EPS)
    d = e // heads
    q = F.linear(x, w_q, b_q).reshape(sq, b, heads, 1, d)
    kv = F.linear(inputs_kv, w_kv, b_kv).reshape(sk, b, heads, 2, d)
    ctx = attend(q, kv, mask, use_time_mask, mask_additive, dropout_p)
    return out_projection(ctx, out_w, out_b, None if norm is None else inputs_q, out_dropout_p)
