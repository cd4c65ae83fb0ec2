"""Fused linear + cross-entropy: ``CE(hidden @ weight.T + bias, labels)`` without the ``(N, V)`` logits.

culmen's addition (flash_attn and Apex have no such op). The extra memory is the gradients themselves
plus one scratch buffer of ``TUNING["chunk_bytes"]`` (``C`` rows of logits: 248 at V = 128256 bf16,
under Liger-Kernel's 256-row chunk); the time is that of the matmuls, nearly all of them large. The
trick: ``grad_weight`` is ``V x H`` and, in this design, written only at the very end, so until then its
storage is free working space of ``H`` rows of logits. Stages (``N`` tokens, ``H`` hidden, ``V`` classes,
head ``N0 = min(N, H)`` tokens):

1. **Token chunks** (tokens ``[N0, N)``): ``logits_c = hidden_c @ weight.T`` (cuBLAS) into
   ``grad_weight``'s storage, ``H`` rows at a time; the fused kernel of ``kernels.py`` computes loss and
   LSE and overwrites the chunk with ``d loss / d logits``; ``grad_hidden_c = dlogits_c @ weight``,
   ``grad_bias += dlogits_c.sum(0)``. The chunk's gradient is then dropped.
2. **Vocab-major head** (``TUNING["vocab_major"]``; tokens ``[0, N0)``): their logits are kept, so they
   are stored vocab-major (``(V, N0)``, tokens contiguous) in ``grad_weight``'s storage; the strided
   kernels of ``vocab_major.py`` compute loss / LSE and the gradient in place; ``grad_hidden`` of the
   head is one matmul with ``K = V``.
3. **grad_weight by vocab slices** (``TUNING["recompute_dw"]``): for each slice of classes, top-down, the
   scratch holds the slice's ``d loss / d logits`` for all ``N`` tokens, the head's part copied out of
   ``grad_weight``'s storage (top-down: a slice never overwrites head rows still to be read) and the
   rest recomputed (a matmul, the saved LSE, the strided gradient kernel); then
   ``grad_weight[slice] = dlogits_slice @ hidden`` (``K = N``) writes that slice once.

Matmul work: ``3 N + (N - N0)`` logits-sized products (the tokens beyond the head are recomputed once),
against ``3 N`` for the unfused loss. The classic scheme (``recompute_dw`` off, fp32 accumulation or a
frozen weight: chunks of ``C`` rows in the scratch, ``grad_weight += dlogits_c.T @ hidden_c``) reads and
writes all of ``grad_weight`` per chunk, which at a chunk small enough to stay under Liger-Kernel's
memory costs more than the recomputation (at twice that chunk it costs less: see ``TUNING``); with
``vocab_major`` on it still takes its first ``N0`` tokens as a vocab-major head, whose ``grad_weight``
slices are written first.

For ``reduction="mean"``/``"sum"`` all of this happens in the forward (the backward scales the saved
gradients by the incoming scalar); ``reduction="none"`` computes only the losses in the forward and runs
the same stages in the backward with the per-row upstream gradient.

Precision: logits and their gradient are in the input dtype (as in the unfused bf16 matmul), softmax
statistics in fp32 (safe at any vocab size). ``grad_weight`` and ``grad_hidden`` come from single
matmuls with fp32 accumulation, except on the accumulating path, where ``accum_dtype`` chooses the
weight's dtype (one rounding per chunk) or ``torch.float32`` (one rounding in all, ``4 V H`` more bytes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import register_op
from culmen.ops.common.outputs import nothing
from culmen.ops.cross_entropy.op import (
    _use_triton,
    bwd_impl,
    check_float,
    check_int_labels,
    check_labels,
    check_scalars,
    fwd_impl,
)

register_op("fused_linear_cross_entropy", "loss", "hidden @ W.T (+ b) -> cross-entropy in token chunks, "
            "gradients computed in the forward")
register_op("fused_linear_cross_entropy_bwd", "loss", "recompute-based backward of the reduction='none' case")

TUNING = {
    # Bytes of the scratch buffer (the logits of C rows); C is rounded down to a multiple of
    # "chunk_multiple". 62 MiB: 248 rows at V = 128256 bf16, below Liger-Kernel's 256-row chunk.
    "chunk_bytes": 62 << 20,
    "chunk_multiple": 8,
    # Rows of the vocab slice used to accumulate grad_weight into an fp32 buffer (accum_dtype=float32).
    "fp32_accum_rows": 16384,
    # Stage 2 (head logits in grad_weight's storage) and stage 3 (grad_weight by vocab slices). H100, T=8192,
    # H=4096, V=128256 bf16 (bench/notes/fused_linear_cross_entropy.md): these defaults 52.1 ms at 1.182 GB
    # peak extra memory (Liger-Kernel 64.4 ms, 1.183 GB); recompute_dw=False with chunk_bytes=128 MiB
    # 46.7 ms at 1.258 GB (the head, then 512-row chunks accumulating grad_weight).
    "vocab_major": True,
    "recompute_dw": True,
    # Stage 3 needs slices of at least this many classes (scratch // N); else grad_weight accumulates.
    "min_slice_rows": 64,
}

_REDUCTIONS = ("mean", "sum", "none")


def _chunk_rows(N: int, V: int, elem: int, chunk_size: int) -> int:
    if chunk_size > 0:
        return max(1, min(N, chunk_size))
    rows = TUNING["chunk_bytes"] // max(1, V * elem)
    mult = TUNING["chunk_multiple"]
    rows = (rows // mult) * mult if rows >= mult else max(1, rows)
    return max(1, min(N, rows))


class _Ctx:
    """What the stages share: inputs, CE constants, gradient buffers and the upstream gradient."""

    def __init__(self, hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap,
                 gh, gw, gb, dloss):
        self.hidden, self.weight, self.bias, self.labels = hidden, weight, bias, labels
        self.V = weight.shape[0]
        # (label_smoothing, logit_scale, lse_square_scale, ignore_index, softcap): the bwd_impl order.
        self.ls, self.zsq, self.ignore, self.cap = label_smoothing, lse_square_scale, ignore_index, softcap
        self.gh, self.gw, self.gb = gh, gw, gb
        self.dloss = dloss  # (N,) rows of any stride (0 for the scale of a mean / sum)

    def fwd(self, lg: Tensor, r0: int, r1: int, grad_scale: Tensor | None):
        """Loss / z-loss / LSE of rows ``[r0, r1)`` whose logits ``lg`` are row-major (in-place grad)."""
        return fwd_impl(lg, self.labels[r0:r1], None, self.ls, 1.0, self.zsq, self.ignore, self.cap, 0, self.V,
                        True, grad_scale=grad_scale)

    def fwd_strided(self, lg: Tensor, r0: int, r1: int, workspace: Tensor | None = None):
        """Loss / z-loss / LSE of rows ``[r0, r1)`` from logits ``lg (rows, V)`` of any strides."""
        lab = self.labels[r0:r1]
        if _use_triton(lg):
            from culmen.ops.cross_entropy.vocab_major import vm_loss_lse

            return vm_loss_lse(lg, lab, self.ls, 1.0, self.zsq, self.ignore, self.cap, 0, self.V, workspace)
        return fwd_impl(lg, lab, None, self.ls, 1.0, self.zsq, self.ignore, self.cap, 0, self.V, True)

    def grad_(self, lg: Tensor, lse: Tensor, r0: int, r1: int, vocab_start: int = 0) -> None:
        """Overwrite ``lg`` (rows ``[r0, r1)``, classes ``[vocab_start, vocab_start + lg.shape[1])``, any
        strides) with ``dloss * d loss / d logits``."""
        args = (self.dloss[r0:r1], lg, lse, self.labels[r0:r1], self.ls, 1.0, self.zsq, self.ignore, self.cap,
                vocab_start, self.V)
        if _use_triton(lg) and not (lg.stride(1) == 1 and vocab_start == 0):
            from culmen.ops.cross_entropy.vocab_major import vm_grad

            vm_grad(*args, out=lg)
        else:
            bwd_impl(*args, out=lg)

    def logits(self, out: Tensor, r0: int, r1: int, vocab_major: bool = False, v0: int = 0, v1: int | None = None):
        """Logits of rows ``[r0, r1)`` and classes ``[v0, v1)`` into ``out``: ``(rows, classes)``, or
        ``(classes, rows)`` with ``vocab_major`` (``out`` may have a row stride)."""
        v1 = self.V if v1 is None else v1
        h, w = self.hidden[r0:r1], self.weight[v0:v1]
        b = None if self.bias is None else self.bias[v0:v1]
        if vocab_major:
            if b is None:
                torch.mm(w, h.t(), out=out)
            else:
                torch.addmm(b.unsqueeze(1), w, h.t(), out=out)
        elif b is None:
            torch.mm(h, w.t(), out=out)
        else:
            torch.addmm(b, h, w.t(), out=out)
        return out


def _head(cx: _Ctx, n0: int, lse: Tensor, stats: tuple | None, scratch: Tensor) -> Tensor:
    """Stage 2: the head's logits, vocab-major in ``grad_weight``'s storage, turned into their gradient;
    ``grad_hidden`` / ``grad_bias`` of the head. Returns the ``(V, n0)`` gradient view (still needed).
    ``scratch`` is idle here: it holds the statistics kernel's partials."""
    V = cx.V
    lt = cx.gw.view(-1)[: V * n0].view(V, n0)
    cx.logits(lt, 0, n0, vocab_major=True)
    lg = lt.t()
    if stats is not None:
        loss_rows, z_rows = stats
        loss_rows[:n0], z_rows[:n0], lse[:n0] = cx.fwd_strided(lg, 0, n0, scratch)
    cx.grad_(lg, lse[:n0], 0, n0)
    if cx.gh is not None:
        torch.mm(lg, cx.weight, out=cx.gh[:n0])
    if cx.gb is not None:
        cx.gb.add_(lt.sum(1, dtype=torch.float32))
    return lt


def _head_dw(cx: _Ctx, lt: Tensor, scratch: Tensor, n0: int) -> None:
    """``grad_weight = head dlogits.T @ hidden_head`` by vocab slices, each copied out of the storage it
    is about to overwrite (descending: lower slices' logits lie below every output written so far)."""
    V = cx.V
    step = max(1, scratch.numel() // n0)
    h0 = cx.hidden[:n0]
    for s1 in range(V, 0, -step):
        s0 = max(0, s1 - step)
        tmp = scratch[: (s1 - s0) * n0].view(s1 - s0, n0)
        tmp.copy_(lt[s0:s1])
        torch.mm(tmp, h0, out=cx.gw[s0:s1])


def _slices_dw(cx: _Ctx, lt: Tensor | None, scratch: Tensor, n0: int, lse: Tensor) -> None:
    """Stage 3: ``grad_weight[slice] = dlogits[:, slice].T @ hidden`` for descending vocab slices; the
    head's columns copied from ``lt``, the others recomputed from the LSE."""
    N, V = cx.hidden.shape[0], cx.V
    step = max(1, scratch.numel() // N)
    for s1 in range(V, 0, -step):
        s0 = max(0, s1 - step)
        tmp = scratch[: (s1 - s0) * N].view(s1 - s0, N)
        if n0:
            tmp[:, :n0].copy_(lt[s0:s1])
        if N > n0:
            rest = tmp[:, n0:]
            cx.logits(rest, n0, N, vocab_major=True, v0=s0, v1=s1)
            cx.grad_(rest.t(), lse[n0:], n0, N, vocab_start=s0)
        torch.mm(tmp, cx.hidden, out=cx.gw[s0:s1])


def _chunk_dw(cx: _Ctx, lg: Tensor, h_c: Tensor, first: bool) -> None:
    """Accumulating path: ``grad_weight += lg.T @ h_c`` (the first write needs no zero-fill)."""
    gw = cx.gw
    if gw.dtype == lg.dtype:
        if first:
            torch.mm(lg.t(), h_c, out=gw)
        else:
            gw.addmm_(lg.t(), h_c)
    else:
        # fp32 accumulation of low-precision products: cuBLAS cannot add a bf16 product into an fp32 C
        # everywhere, so the product is formed per vocab slice and added (bounded temp).
        step = TUNING["fp32_accum_rows"]
        for v0 in range(0, gw.shape[0], step):
            gw[v0:v0 + step].add_(torch.mm(lg[:, v0:v0 + step].t(), h_c))


def _chunks(cx: _Ctx, buf: Tensor, step: int, r_start: int, lse: Tensor, stats: tuple | None,
            grad_scale: Tensor | None, want_grad: bool, accumulate: bool) -> None:
    """Stage 1: rows ``[r_start, N)`` in row-major chunks of ``step`` rows in ``buf``: loss / LSE (forward)
    or the gradient from the saved LSE (backward), then ``grad_hidden`` / ``grad_bias`` (and with
    ``accumulate`` ``grad_weight``) of each chunk."""
    hidden, V = cx.hidden, cx.V
    N = hidden.shape[0]
    for r0 in range(r_start, N, step):
        r1 = min(N, r0 + step)
        lg = cx.logits(buf[: (r1 - r0) * V].view(r1 - r0, V), r0, r1)
        if stats is not None:
            stats[0][r0:r1], stats[1][r0:r1], lse[r0:r1] = cx.fwd(lg, r0, r1, grad_scale if want_grad else None)
        elif want_grad:
            bwd_impl(cx.dloss[r0:r1], lg, lse[r0:r1], cx.labels[r0:r1], cx.ls, 1.0, cx.zsq, cx.ignore, cx.cap, 0, V,
                     out=lg)
        if not want_grad:
            continue
        if cx.gh is not None:
            torch.mm(lg, cx.weight, out=cx.gh[r0:r1])
        if accumulate:
            _chunk_dw(cx, lg, hidden[r0:r1], first=r0 == 0)
        if cx.gb is not None:
            cx.gb.add_(lg.sum(0, dtype=torch.float32))


def _run(cx: _Ctx, chunk_size: int, lse: Tensor, stats: tuple | None, grad_scale: Tensor | None,
         want_grad: bool) -> None:
    """All stages. ``stats=(loss_rows, z_rows)`` (forward): fill them and ``lse``; else ``lse`` is given.
    ``want_grad``: fill the gradient buffers of ``cx`` (scaled by ``cx.dloss``)."""
    hidden = cx.hidden
    N, H = hidden.shape
    V = cx.V
    if N == 0:
        return
    C = _chunk_rows(N, V, hidden.element_size(), chunk_size)
    gw = cx.gw if want_grad else None
    low = gw is not None and gw.dtype == hidden.dtype
    recompute = low and TUNING["recompute_dw"] and N > C and (C * V) // N >= TUNING["min_slice_rows"]
    n0 = min(N, H) if low and TUNING["vocab_major"] and N > C and min(N, H) > C else 0
    scratch = torch.empty((C * V,), device=hidden.device, dtype=hidden.dtype)
    if recompute:
        # grad_weight is written only by stage 3, so its storage (H rows of logits) first serves the token
        # chunks beyond the head (H-row matmuls: compute-bound, where the scratch's C-row ones are bound by
        # reading the weight), then the head's vocab-major logits.
        buf, step = (gw.view(-1), H) if H > C else (scratch, C)
        _chunks(cx, buf, step, n0, lse, stats, grad_scale, want_grad, accumulate=False)
        lt = _head(cx, n0, lse, stats, scratch) if n0 else None
        _slices_dw(cx, lt, scratch, n0, lse)
        return
    if n0:
        lt = _head(cx, n0, lse, stats, scratch)
        _head_dw(cx, lt, scratch, n0)
    _chunks(cx, scratch, C, n0, lse, stats, grad_scale, want_grad, accumulate=gw is not None)


def _alloc_grads(hidden: Tensor, weight: Tensor, need_hidden: bool, need_weight: bool, need_bias: bool,
                 accum_dtype: torch.dtype | None):
    """Gradient buffers: grad_hidden (each chunk writes its rows), grad_weight (empty in the weight's dtype:
    every element is written before it is read; zeros for an fp32 accumulator), fp32 grad_bias."""
    V, H = weight.shape
    acc = accum_dtype or weight.dtype
    gh = torch.empty_like(hidden) if need_hidden else None
    gw = None
    if need_weight:
        fresh = acc == hidden.dtype and hidden.shape[0] > 0
        gw = (torch.empty if fresh else torch.zeros)((V, H), device=hidden.device, dtype=acc)
    gb = torch.zeros((V,), device=hidden.device, dtype=torch.float32) if need_bias else None
    return gh, gw, gb


def _finish_grads(gw: Tensor | None, gb: Tensor | None, weight: Tensor, bias: Tensor | None):
    if gw is not None and gw.dtype != weight.dtype:
        gw = gw.to(weight.dtype)
    if gb is not None:
        gb = gb.to(bias.dtype)
    return gw, gb


def flce_fwd_impl(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, ignore_index: int,
                  label_smoothing: float, lse_square_scale: float, softcap: float, reduction: str,
                  need_hidden: bool, need_weight: bool, need_bias: bool, chunk_size: int,
                  accum_dtype: torch.dtype | None):
    """Forward (and, for mean/sum with a needed gradient, all gradients) on ``hidden (N, H)``.

    Returns ``(loss, z_loss, lse, grad_hidden, grad_weight, grad_bias)``: losses fp32, 0-dim for
    mean/sum and ``(N,)`` for none; ``lse (N,)`` fp32; gradients (``None`` where not computed) are
    of ``d (reduced loss) / d input`` for an upstream gradient of 1.
    """
    N = hidden.shape[0]
    dev = hidden.device
    want_grad = reduction != "none" and (need_hidden or need_weight or need_bias)
    loss_rows = torch.empty((N,), device=dev, dtype=torch.float32)
    z_rows = torch.empty((N,), device=dev, dtype=torch.float32)
    lse = torch.empty((N,), device=dev, dtype=torch.float32)
    n_valid = (labels != ignore_index).sum().to(torch.float32)
    gh = gw = gb = scale = None
    if want_grad:
        # The mean's 1/#valid is applied inside the kernels so the gradients come out final (clamped:
        # with every row ignored the loss is NaN like PyTorch's, but the gradients are 0, not NaN).
        scale = (1.0 / n_valid.clamp_min(1.0)) if reduction == "mean" else torch.ones((), device=dev)
        scale = scale.reshape(1).to(torch.float32)
        gh, gw, gb = _alloc_grads(hidden, weight, need_hidden, need_weight, need_bias, accum_dtype)
    cx = _Ctx(hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap, gh, gw, gb,
              None if scale is None else scale.expand(N))
    _run(cx, chunk_size, lse, (loss_rows, z_rows), scale, want_grad)
    gw, gb = _finish_grads(gw, gb, weight, bias)
    if reduction == "none":
        loss, zl = loss_rows, z_rows
    elif reduction == "sum":
        loss, zl = loss_rows.sum(), z_rows.sum()
    else:
        loss, zl = loss_rows.sum() / n_valid, z_rows.sum() / n_valid
    return loss, zl, lse, gh, gw, gb


def flce_bwd_impl(dloss: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, lse: Tensor,
                  ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float,
                  need_hidden: bool, need_weight: bool, need_bias: bool, chunk_size: int,
                  accum_dtype: torch.dtype | None):
    """Backward of ``reduction="none"``: recompute the logits, apply ``dloss (N,)``.

    Returns ``(grad_hidden, grad_weight, grad_bias)`` (``None`` where not needed).
    """
    gh, gw, gb = _alloc_grads(hidden, weight, need_hidden, need_weight, need_bias, accum_dtype)
    cx = _Ctx(hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap, gh, gw, gb,
              dloss)
    _run(cx, chunk_size, lse, None, None, True)
    gw, gb = _finish_grads(gw, gb, weight, bias)
    return gh, gw, gb


# ------------------------------------------------------------------------------------ custom ops


def _filled(ts, like: Tensor):
    return tuple(t if t is not None else nothing(like.device, like.dtype) for t in ts)


@torch.library.custom_op("culmen::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    chunk_size: int,
    accum_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, z_loss, lse, grad_hidden, grad_weight, grad_bias)``; absent gradients are empty tensors."""
    out = flce_fwd_impl(hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap,
                        reduction, need_hidden, need_weight, need_bias, chunk_size, accum_dtype)
    return out[:3] + _filled(out[3:], hidden)


@fused_linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
      need_hidden, need_weight, need_bias, chunk_size, accum_dtype):
    N = hidden.shape[0]
    f32 = torch.float32
    shape = (N,) if reduction == "none" else ()
    grads = reduction != "none"
    return (hidden.new_empty(shape, dtype=f32), hidden.new_empty(shape, dtype=f32), hidden.new_empty((N,), dtype=f32),
            torch.empty_like(hidden) if grads and need_hidden else nothing(hidden.device, hidden.dtype),
            torch.empty_like(weight) if grads and need_weight else nothing(hidden.device, hidden.dtype),
            torch.empty_like(bias) if grads and need_bias else nothing(hidden.device, hidden.dtype))


@torch.library.custom_op("culmen::fused_linear_cross_entropy_bwd", mutates_args=())
def fused_linear_cross_entropy_bwd_op(
    dloss: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    lse: Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    chunk_size: int,
    accum_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_hidden, grad_weight, grad_bias)`` of ``reduction="none"``; absent ones are empty tensors."""
    return _filled(flce_bwd_impl(dloss, hidden, weight, bias, labels, lse, ignore_index, label_smoothing,
                                 lse_square_scale, softcap, need_hidden, need_weight, need_bias, chunk_size,
                                 accum_dtype), hidden)


@fused_linear_cross_entropy_bwd_op.register_fake
def _(dloss, hidden, weight, bias, labels, lse, ignore_index, label_smoothing, lse_square_scale, softcap,
      need_hidden, need_weight, need_bias, chunk_size, accum_dtype):
    return (torch.empty_like(hidden) if need_hidden else nothing(hidden.device, hidden.dtype),
            torch.empty_like(weight) if need_weight else nothing(hidden.device, hidden.dtype),
            torch.empty_like(bias) if need_bias else nothing(hidden.device, hidden.dtype))


_OP_ARGS = ("hidden", "weight", "bias", "labels", "ignore_index", "label_smoothing", "lse_square_scale", "softcap",
            "reduction", "need_hidden", "need_weight", "need_bias", "chunk_size", "accum_dtype")


def _setup_context(ctx, inputs, output):
    a = dict(zip(_OP_ARGS, inputs))
    ctx.reduction = a["reduction"]
    ctx.needs = (a["need_hidden"], a["need_weight"], a["need_bias"] and a["bias"] is not None)
    if a["reduction"] == "none":
        ctx.save_for_backward(a["hidden"], a["weight"], a["bias"], a["labels"], output[2])
        ctx.consts = (a["ignore_index"], a["label_smoothing"], a["lse_square_scale"], a["softcap"])
        ctx.chunk = (a["chunk_size"], a["accum_dtype"])
    else:
        ctx.save_for_backward(*output[3:])


def _op_backward(ctx, dloss, dzl, dlse, *_):
    n_in = len(_OP_ARGS)
    if dloss is None:
        return (None,) * n_in
    if ctx.reduction == "none":
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        gh, gw, gb = fused_linear_cross_entropy_bwd_op(dloss, hidden, weight, bias, labels, lse, *ctx.consts,
                                                       *ctx.needs, *ctx.chunk)
    else:
        gh, gw, gb = (g * dloss.to(g.dtype) for g in ctx.saved_tensors)
    hn, wn, bn = ctx.needs
    return (gh if hn else None, gw if wn else None, gb if bn else None) + (None,) * (n_in - 3)


torch.library.register_autograd("culmen::fused_linear_cross_entropy", _op_backward, setup_context=_setup_context)


class _FusedLinearCEFn(torch.autograd.Function):
    """Eager path: the implementations without dispatch cost; the backward scales the saved gradients
    in place (they belong to this call), so it may run only once per forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap,
                reduction, need_hidden, need_weight, need_bias, chunk_size, accum_dtype):
        loss, zl, lse, gh, gw, gb = flce_fwd_impl(hidden, weight, bias, labels, ignore_index, label_smoothing,
                                                  lse_square_scale, softcap, reduction, need_hidden, need_weight,
                                                  need_bias, chunk_size, accum_dtype)
        ctx.reduction = reduction
        ctx.needs = (need_hidden, need_weight, need_bias)
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
            ctx.consts = (ignore_index, label_smoothing, lse_square_scale, softcap)
            ctx.chunk = (chunk_size, accum_dtype)
        else:
            ctx.grads = [gh, gw, gb]
        ctx.mark_non_differentiable(zl, lse)
        ctx.set_materialize_grads(False)
        return loss, zl, lse

    @staticmethod
    def backward(ctx, dloss, dzl, dlse):
        if dloss is None:
            return (None,) * 14
        if ctx.reduction == "none":
            hidden, weight, bias, labels, lse = ctx.saved_tensors
            gh, gw, gb = flce_bwd_impl(dloss, hidden, weight, bias, labels, lse, *ctx.consts, *ctx.needs, *ctx.chunk)
        else:
            if ctx.grads is None:
                raise RuntimeError("fused_linear_cross_entropy: backward through the same forward twice "
                                   "(retain_graph=True) is not supported; its gradients were computed in the "
                                   "forward and handed out by the first backward")
            # Scale in place (no second copy of grad_weight); then drop our reference so autograd owns it.
            gh, gw, gb = (None if g is None else g.mul_(dloss.to(g.dtype)) for g in ctx.grads)
            ctx.grads = None
        return (gh, gw, gb) + (None,) * 11


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    return_z_loss: bool = False,
    chunk_size: int | None = None,
    accum_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of ``hidden @ weight.T + bias`` without materialising the ``(N, V)`` logits.

    Args:
        hidden: ``(..., H)`` fp16/bf16/fp32 activations (any row stride).
        weight: ``(V, H)``, the dtype of ``hidden``. bias: ``(V,)`` or ``None``, same dtype.
        labels: ``hidden.shape[:-1]`` integer class ids; ``ignore_index`` rows add nothing.
        label_smoothing: in ``[0, 1]``. lse_square_scale: z-loss weight (adds ``scale * lse^2``).
        softcap: ``softcap * tanh(logits / softcap)`` before the softmax (None: off).
        reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"`` (per row).
        return_z_loss: also return the z-loss part (reduced the same way, not differentiable).
        chunk_size: rows per chunk (default: from ``TUNING["chunk_bytes"]``).
        accum_dtype: ``grad_weight`` accumulator dtype: ``None`` (the weight's) or ``torch.float32``.

    Under CUDA autocast the inputs are cast to the autocast dtype first. Returns the fp32 loss (0-dim,
    or ``labels.shape`` for ``"none"``), or ``(loss, z_loss)``.
    """
    for name, t in (("hidden", hidden), ("weight", weight)):
        check_float(name, t)
    if bias is not None:
        check_float("bias", bias)
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, H) with H = hidden.shape[-1]; got hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}")
    V, H = weight.shape
    if V == 0:
        raise ValueError("weight must have at least one row (V >= 1)")
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias must have shape ({V},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    check_scalars(label_smoothing, lse_square_scale, softcap)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    if accum_dtype not in (None, torch.float32, weight.dtype):
        raise ValueError(f"accum_dtype must be None, torch.float32 or the weight's dtype, got {accum_dtype}")
    lead = tuple(hidden.shape[:-1])
    check_int_labels(labels, lead, hidden.device)
    check_labels(labels, V, ignore_index)
    dev_type = hidden.device.type
    if dev_type in ("cuda", "cpu") and torch.is_autocast_enabled(dev_type):
        dt = torch.get_autocast_dtype(dev_type)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"hidden, weight and bias must share one dtype; got hidden {hidden.dtype}, weight "
                        f"{weight.dtype}, bias {None if bias is None else bias.dtype}")
    h2 = hidden.reshape(-1, H)
    if h2.stride(-1) != 1 and H > 1:
        h2 = h2.contiguous()
    lab = labels.reshape(-1).contiguous()
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    args = (h2, weight, bias, lab, int(ignore_index), float(label_smoothing), float(lse_square_scale),
            float(softcap or 0.0), reduction, *needs, int(chunk_size or 0), accum_dtype)
    if torch.compiler.is_compiling():
        loss, zl, _ = fused_linear_cross_entropy_op(*args)[:3]
    else:
        loss, zl, _ = _FusedLinearCEFn.apply(*args)
    if reduction == "none":
        loss, zl = loss.reshape(lead), zl.reshape(lead)
    return (loss, zl) if return_z_loss else loss


def default_chunk_rows(n_rows: int, vocab: int, dtype: torch.dtype) -> int:
    """The chunk the default budget gives for ``n_rows`` tokens of ``vocab`` classes (for benchmarks)."""
    return _chunk_rows(n_rows, vocab, torch.empty((), dtype=dtype).element_size(), 0)


__all__ = ["TUNING", "default_chunk_rows", "fused_linear_cross_entropy"]
