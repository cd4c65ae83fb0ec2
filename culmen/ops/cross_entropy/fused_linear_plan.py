"""Call plans of fused linear + cross-entropy: the stage schedule, the bound launches and the stages.

``fused_linear_cross_entropy`` computes ``CE(hidden @ weight.T + bias, labels)`` without the ``(N, V)``
logits. The extra memory is the gradients themselves plus one scratch buffer of ``TUNING["chunk_bytes"]``
(``C`` rows of logits: 248 at V = 128256 bf16, under Liger-Kernel's 256-row chunk); the time is that of
the matmuls, nearly all of them large. The trick: ``grad_weight`` is ``V x H`` and, in this design,
written only at the very end, so until then its storage is free working space of ``H`` rows of logits.
Stages (``N`` tokens, ``H`` hidden, ``V`` classes, head ``N0 = min(N, H)`` tokens):

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
slices are written first. ``TUNING["recompute_dw"] = "auto"`` (the default) picks one of the two per shape
by a cost model (``FLCEPlan._recompute_pays``): stage 3 where the scratch holds few rows of a large vocab
(248 at 128k classes), the accumulation where it holds many (640-1000 rows at 32k-50k classes), at the
same peak memory.

The plan (``FLCEPlan``) fixes all of that per call signature: the chunk and slice boundaries, which
stages run, and a bound ``Launch`` per kernel geometry; a call allocates its outputs, gradients and one
scratch buffer, then walks the schedule (per chunk: two or three matmuls and one launch, whose row
offsets are kernel arguments rather than views). The per-row statistics of a ``mean`` / ``sum`` live in
one fp32 buffer ``rows`` (losses, z-losses, the gradient scale ``1 / #counted``): a one-program kernel
writes the scale before the chunks (their kernels read it from the device) and the reduced loss after.
Without Triton (CPU, float64) the same schedule runs with the PyTorch reference in place of each kernel.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from culmen.ops.backend import check_values_on, choose_backend, num_programs_hint
from culmen.ops.common.launch import Launch, PlanTuning, cdiv, stream_getter
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.cross_entropy import vocab_major as vm
from culmen.ops.cross_entropy.kernels import (
    _cross_entropy_bwd_kernel,
    _cross_entropy_fwd_kernel,
    _cross_entropy_reduce_kernel,
    _scale_by_kernel,
)
from culmen.ops.cross_entropy.launch import TUNING as CE_TUNING
from culmen.ops.cross_entropy.launch import _blocks, _warps, check_float, check_int_labels, check_scalars
from culmen.ops.cross_entropy.reference import cross_entropy_bwd_ref, cross_entropy_fwd_ref

TUNING = PlanTuning({
    # Bytes of the scratch buffer (the logits of C rows); C is rounded down to a multiple of
    # "chunk_multiple". 62 MiB: 248 rows at V = 128256 bf16, below Liger-Kernel's 256-row chunk.
    "chunk_bytes": 62 << 20,
    "chunk_multiple": 8,
    # Rows of the vocab slice used to accumulate grad_weight into an fp32 buffer (accum_dtype=float32).
    "fp32_accum_rows": 16384,
    # Stage 2 (head logits in grad_weight's storage) and stage 3 (grad_weight by vocab slices). H100, T=8192,
    # H=4096, V=128256 bf16 (bench/notes/fused_linear_cross_entropy.md): the slices 52.1 ms at 1.182 GB
    # peak extra memory (Liger-Kernel 64.4 ms, 1.183 GB), the head + accumulating chunks 54.0 ms at the same
    # memory; recompute_dw=False with chunk_bytes=128 MiB 46.7 ms at 1.258 GB (512-row chunks).
    # recompute_dw: True, False, or "auto": whichever of the two costs less by the model of _recompute_pays
    # (the slices where chunks are few rows, i.e. large vocabularies; the accumulation at 32k-50k classes).
    "vocab_major": True,
    "recompute_dw": "auto",
    # The model's machine balance: matmul flop/s over memory bytes/s (H100 bf16: ~600 TFLOP/s, ~3 TB/s).
    "flops_per_byte": 200,
    # Stage 3 needs slices of at least this many classes (scratch // N); else grad_weight accumulates.
    "min_slice_rows": 64,
    # The in-place scaling of the gradients by the upstream gradient: elements per program and step, and
    # programs per multiprocessor (a fixed grid: with an upstream gradient of 1 every program exits at once).
    "scale_block": 4096,
    "scale_programs_per_sm": 8,
}, clear_plans)

PLANS = PlanCache("fused_linear_cross_entropy")
REDUCTIONS = ("mean", "sum", "none")
_F32 = torch.float32


def chunk_rows(N: int, V: int, elem: int, chunk_size: int) -> int:
    """Rows per chunk: ``chunk_size`` when given (> 0), else what ``TUNING["chunk_bytes"]`` holds."""
    if chunk_size > 0:
        return max(1, min(N, chunk_size))
    rows = TUNING["chunk_bytes"] // max(1, V * elem)
    mult = TUNING["chunk_multiple"]
    rows = (rows // mult) * mult if rows >= mult else max(1, rows)
    return max(1, min(N, rows))


def validate(hidden, weight, labels, bias, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
             chunk_size, accum_dtype) -> None:
    """Every argument check of ``fused_linear_cross_entropy`` (``TypeError`` / ``ValueError`` naming it)."""
    for name, t in (("hidden", hidden), ("weight", weight)):
        check_float(name, t)
    if bias is not None:
        check_float("bias", bias)
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, H) with H = hidden.shape[-1]; got hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}")
    V = weight.shape[0]
    if V == 0:
        raise ValueError("weight must have at least one row (V >= 1)")
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias must have shape ({V},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_scalars(label_smoothing, lse_square_scale, softcap)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    if accum_dtype not in (None, torch.float32, weight.dtype):
        raise ValueError(f"accum_dtype must be None, torch.float32 or the weight's dtype, got {accum_dtype}")
    check_int_labels(labels, tuple(hidden.shape[:-1]), hidden.device)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"hidden, weight and bias must share one dtype; got hidden {hidden.dtype}, weight "
                        f"{weight.dtype}, bias {None if bias is None else bias.dtype}")


class _Schedule:
    """The stages of one pass (``"fwd"``: losses only; ``"fwd_grad"``: losses and the gradients of a
    reduced loss; ``"bwd"``: the gradients of ``reduction="none"`` from the saved LSE)."""

    __slots__ = ("stats", "want_grad", "recompute", "n0", "in_gw", "step", "chunks", "accumulate", "slices",
                 "head_slices", "slice_sizes", "head_sizes", "chunk_la", "head_stats", "head_grad", "part_in_scratch")


class _Call:
    """The tensors of one call that the stages share."""

    __slots__ = ("h", "w", "b", "lab", "lse", "lrows", "zrows", "zl_off", "rows", "dl", "dl_off", "dl_stride",
                 "dl_ref", "gh", "gw", "gb", "scratch", "stream", "aligned")


class FLCEPlan:
    """Everything ``fused_linear_cross_entropy`` derives from one call signature. Holds no tensors.

    Built from the caller's tensors (``hidden (..., H)``, ``labels (...)``); its passes take them flattened
    (``hidden (N, H)`` with a contiguous last dim, ``labels (N,)``: ``flatten`` / ``copy_hidden`` /
    ``flatten_labels`` say what the entry does per call)."""

    def __init__(self, hidden, weight, bias, labels, ignore_index, label_smoothing, lse_square_scale, softcap,
                 reduction, needs, chunk_size, accum_dtype) -> None:
        validate(hidden, weight, labels, bias, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
                 chunk_size, accum_dtype)
        V, H = weight.shape
        N = math.prod(hidden.shape[:-1])
        self.N, self.H, self.V = N, H, V
        self.lead = tuple(hidden.shape[:-1])
        self.flatten = hidden.dim() != 2
        h2 = hidden.reshape(-1, H)
        self.copy_hidden = h2.stride(-1) != 1 and H > 1
        self.flatten_labels = labels.dim() != 1
        self.stride_label = labels.reshape(-1).stride(0) if N else 1
        self.dtype, self.device = hidden.dtype, hidden.device
        self.has_bias = bias is not None
        self.need_h, self.need_w = bool(needs[0]), bool(needs[1])
        self.need_b = bool(needs[2]) and self.has_bias
        self.reduction = reduction
        self.reduce = reduction != "none"
        self.mean = reduction == "mean"
        self.grads_in_fwd = self.reduce and (self.need_h or self.need_w or self.need_b)
        self.acc_dtype = accum_dtype or weight.dtype
        self.C = chunk_rows(N, V, hidden.element_size(), int(chunk_size or 0))
        softcap = float(softcap or 0.0)
        self.ignore_index = int(ignore_index)
        # (vocab_start, total_classes, ignore_index, label_smoothing, logit_scale, lse_square_scale, softcap):
        # the kernels' order.
        self.consts = (0, V, self.ignore_index, float(label_smoothing), 1.0, float(lse_square_scale), softcap)
        self.flags = vm.flags(float(label_smoothing), softcap)
        self.use_kernel = (choose_backend(hidden.device) == "triton" and N > 0 and hidden.dtype != torch.float64)
        self.check_values = labels.device.type == "cpu" or check_values_on()
        self.stream = stream_getter(hidden.device)
        self._schedules: dict[str, _Schedule] = {}
        if self.use_kernel:
            dev = self.device
            self.count_la = Launch(_cross_entropy_reduce_kernel, (1,), dict(
                MEAN=self.mean, WRITE_SCALE=True, WRITE_LOSS=False, BLOCK=CE_TUNING["reduce_block"]), 4, device=dev)
            self.finish_la = Launch(_cross_entropy_reduce_kernel, (1,), dict(
                MEAN=self.mean, WRITE_SCALE=False, WRITE_LOSS=True, BLOCK=CE_TUNING["reduce_block"]), 4, device=dev)
            blk, progs = TUNING["scale_block"], num_programs_hint(dev) * TUNING["scale_programs_per_sm"]
            self.scale_n = (N * H, V * H, V)
            self.scale_la = tuple(Launch(_scale_by_kernel, (max(1, min(cdiv(n, blk), progs)),), dict(BLOCK=blk), 8,
                                         device=dev) for n in self.scale_n)

    # --------------------------------------------------------------------------- schedule
    def schedule(self, mode: str) -> _Schedule:
        """The (cached) schedule of pass ``mode``: ``"fwd"``, ``"fwd_grad"`` or ``"bwd"``."""
        sg = self._schedules.get(mode)
        if sg is None:
            sg = self._schedules[mode] = self._build(mode)
        return sg

    def _build(self, mode: str) -> _Schedule:
        N, H, V, C = self.N, self.H, self.V, self.C
        sg = _Schedule()
        sg.stats = mode != "bwd"
        sg.want_grad = want = mode != "fwd"
        low = want and self.need_w and self.acc_dtype == self.dtype
        sg.n0 = n0 = min(N, H) if low and TUNING["vocab_major"] and N > C and min(N, H) > C else 0
        rd = TUNING["recompute_dw"]
        sg.recompute = (low and N > C and (C * V) // N >= TUNING["min_slice_rows"]
                        and (self._recompute_pays(n0) if rd == "auto" else bool(rd)))
        # grad_weight is written only by stage 3, so its storage (H rows of logits) first serves the token
        # chunks beyond the head (H-row matmuls: compute-bound, where the scratch's C-row ones are bound by
        # reading the weight), then the head's vocab-major logits.
        sg.in_gw = sg.recompute and H > C
        sg.step = step = H if sg.in_gw else C
        sg.chunks = [(r0, min(N, r0 + step)) for r0 in range(n0, N, step)]
        sg.accumulate = want and self.need_w and not sg.recompute
        # Slices top-down (the order they run in); the sizes bottom-up (for one ``split`` per tensor and call).
        sg.slices = _descending(V, max(1, (C * V) // N)) if sg.recompute else []
        sg.head_slices = _descending(V, max(1, (C * V) // n0)) if n0 and not sg.recompute else []
        sg.slice_sizes = [s1 - s0 for s0, s1 in reversed(sg.slices)]
        sg.head_sizes = [s1 - s0 for s0, s1 in reversed(sg.head_slices)]
        sg.chunk_la, sg.head_stats, sg.head_grad, sg.part_in_scratch = {}, None, None, False
        if not self.use_kernel:
            sg.slices = [(s0, s1, None) for s0, s1 in sg.slices]
            return sg
        dev = self.device
        for rows in {r1 - r0 for r0, r1 in sg.chunks}:
            if sg.stats:
                bm, bv = _blocks(rows, V, CE_TUNING["fwd_block_v"], CE_TUNING["fwd_elems"])
                sg.chunk_la[rows] = Launch(_cross_entropy_fwd_kernel, (cdiv(rows, bm), 1), dict(
                    **self.flags, PRECOMPUTED_LSE=False, ADD_LSE=True, SPLIT=False, WRITE_GRAD=want, BLOCK_M=bm,
                    BLOCK_V=bv), _warps(bm * bv), device=dev)
            else:
                bm, bv = _blocks(rows, V, CE_TUNING["bwd_block_v"], CE_TUNING["bwd_elems"])
                sg.chunk_la[rows] = Launch(_cross_entropy_bwd_kernel, (cdiv(rows, bm), cdiv(V, bv)), dict(
                    **self.flags, HAS_SCALE=False, BLOCK_M=bm, BLOCK_V=bv), _warps(bm * bv), device=dev)
        if n0:
            if sg.stats:
                sg.head_stats = vm.StatsLaunches(n0, V, self.flags, dev)
                # The head's split-softmax partials go to the idle scratch when they fit (no allocation).
                sg.part_in_scratch = sg.head_stats.part_elems * 4 <= self.C * V * torch.finfo(self.dtype).bits // 8
            sg.head_grad = vm.grad_launch(n0, V, self.flags, dev)
        if N > n0:
            la = {k: vm.grad_launch(N - n0, k, self.flags, dev) for k in {s1 - s0 for s0, s1 in sg.slices}}
            sg.slices = [(s0, s1, la[s1 - s0]) for s0, s1 in sg.slices]
        else:
            sg.slices = [(s0, s1, None) for s0, s1 in sg.slices]
        return sg

    def _recompute_pays(self, n0: int) -> bool:
        """Whether stage 3 (grad_weight by recomputed vocab slices) costs less than accumulating it chunk by
        chunk, in bytes moved at memory speed (matmul flops divided by ``flops_per_byte``). Stage 3 pays one
        more logits matmul and one more gradient pass over the tokens beyond the head, plus a copy of the
        head's gradient; accumulating pays a read and a write of grad_weight per chunk of ``C`` rows (the
        measured cost of ``addmm_`` at 248-row chunks: bench/notes/fused_linear_cross_entropy.md)."""
        N, H, V, C = self.N, self.H, self.V, self.C
        elem = torch.finfo(self.dtype).bits // 8
        rest = N - n0
        recompute = rest * V * (2 * H / TUNING["flops_per_byte"] + 2 * elem) + 2 * elem * n0 * V
        accumulate = cdiv(rest, C) * 2 * elem * V * H
        return recompute < accumulate

    # ------------------------------------------------------------------------------ passes
    def _alloc_grads(self, call: _Call) -> None:
        """grad_hidden (each chunk writes its rows), grad_weight (empty in the weight's dtype: every element
        is written before it is read; zeros for an fp32 accumulator), fp32 grad_bias (accumulated)."""
        dev = self.device
        call.gh = torch.empty((self.N, self.H), dtype=self.dtype, device=dev) if self.need_h else None
        call.gw = None
        if self.need_w:
            fresh = self.acc_dtype == self.dtype and self.N > 0
            call.gw = (torch.empty if fresh else torch.zeros)((self.V, self.H), device=dev, dtype=self.acc_dtype)
        call.gb = torch.zeros((self.V,), device=dev, dtype=_F32) if self.need_b else None

    def _start(self, h: Tensor, w: Tensor, b: Tensor | None, lab: Tensor) -> _Call:
        call = _Call()
        call.h, call.w, call.b, call.lab = h, w, b, lab
        call.stream = self.stream()
        call.aligned = lab.data_ptr() & 15 == 0
        call.scratch = torch.empty((self.C * self.V,), device=self.device, dtype=self.dtype) if self.N else None
        return call

    def _finish_grads(self, call: _Call, w: Tensor, b: Tensor | None):
        gw, gb = call.gw, call.gb
        if gw is not None and gw.dtype != w.dtype:
            gw = gw.to(w.dtype)
        if gb is not None:
            gb = gb.to(b.dtype)
        return call.gh, gw, gb

    def forward(self, h: Tensor, w: Tensor, b: Tensor | None, lab: Tensor):
        """Losses of ``h (N, H)``, ``w (V, H)``, ``b (V,)``, ``lab (N,)``, and for a reduced loss with a
        needed gradient all gradients (for an upstream gradient of 1).

        Returns ``(loss, z_loss, lse, grad_hidden, grad_weight, grad_bias)``: fp32 losses, 0-dim for mean /
        sum and ``(N,)`` for none; fp32 ``lse (N,)``; the gradients (``None`` where not computed)."""
        sg = self.schedule("fwd_grad" if self.grads_in_fwd else "fwd")
        N, dev = self.N, self.device
        call = self._start(h, w, b, lab)
        call.lse = torch.empty((N,), dtype=_F32, device=dev)
        if self.reduce:
            call.rows = call.lrows = call.zrows = torch.empty((2 * N + 1,), dtype=_F32, device=dev)
            call.zl_off = N
            loss = torch.empty((), dtype=_F32, device=dev)
            zl = torch.empty((), dtype=_F32, device=dev)
        else:
            call.rows = None
            call.lrows = loss = torch.empty((N,), dtype=_F32, device=dev)
            call.zrows = zl = torch.empty((N,), dtype=_F32, device=dev)
            call.zl_off = 0
        call.gh = call.gw = call.gb = None
        if sg.want_grad:
            self._alloc_grads(call)
            # The gradient kernels read a row's scale (1 / #counted, or 1) from rows[2N]: stride 0.
            call.dl, call.dl_off, call.dl_stride = call.rows, 2 * N, 0
            if self.use_kernel:
                self.count_la(call.stream, call.aligned, call.rows, call.rows, lab, None, None, N, N, 2 * N,
                              self.stride_label, self.ignore_index)
            else:
                self._scale_ref(call)
        self._run(sg, call)
        if self.reduce:
            if self.use_kernel:
                self.finish_la(call.stream, call.aligned, call.rows, call.rows, lab, loss, zl, N, N, 2 * N,
                               self.stride_label, self.ignore_index)
            else:
                self._reduce_ref(call, loss, zl)
        return (loss, zl, call.lse) + self._finish_grads(call, w, b)

    def backward(self, dloss: Tensor, h: Tensor, w: Tensor, b: Tensor | None, lab: Tensor, lse: Tensor):
        """Gradients ``(grad_hidden, grad_weight, grad_bias)`` of ``reduction="none"`` for the upstream
        ``dloss (N,)`` (any stride): the stages again, from the saved ``lse``."""
        sg = self.schedule("bwd")
        call = self._start(h, w, b, lab)
        if dloss.dtype != _F32:
            dloss = dloss.to(_F32)
        call.lse, call.rows = lse, None
        call.dl, call.dl_off, call.dl_stride, call.dl_ref = dloss, 0, dloss.stride(0) if self.N else 1, dloss
        call.aligned = call.aligned and dloss.data_ptr() & 15 == 0
        self._alloc_grads(call)
        self._run(sg, call)
        return self._finish_grads(call, w, b)

    def scale_grads(self, dloss: Tensor, gh: Tensor | None, gw: Tensor | None, gb: Tensor | None) -> None:
        """Multiply the gradients a reduced loss's forward computed by the upstream ``dloss`` (0-dim), in
        place; on the kernels nothing moves when ``dloss == 1``."""
        if dloss.dtype != _F32:
            dloss = dloss.to(_F32)
        if not self.use_kernel:
            for g in (gh, gw, gb):
                if g is not None:
                    g.mul_(dloss.to(g.dtype))
            return
        stream = self.stream()
        aligned = dloss.data_ptr() & 15 == 0
        for g, la, n in zip((gh, gw, gb), self.scale_la, self.scale_n):
            if g is not None:
                la(stream, aligned, g, dloss, n)

    # -------------------------------------------------------------------- reference pieces
    def _scale_ref(self, call: _Call) -> None:
        N = self.N
        scale = call.rows[2 * N:]
        if self.mean:
            n = (call.lab != self.ignore_index).sum().to(_F32)
            scale.copy_((1.0 / n.clamp_min(1.0)).reshape(1))
        else:
            scale.fill_(1.0)
        call.dl_ref = scale.expand(N)

    def _reduce_ref(self, call: _Call, loss: Tensor, zl: Tensor) -> None:
        N = self.N
        sl, sz = call.rows[:N].sum(), call.rows[N:2 * N].sum()
        if self.mean:
            n = (call.lab != self.ignore_index).sum().to(_F32)
            sl, sz = sl / n, sz / n
        loss.copy_(sl)
        zl.copy_(sz)

    # ------------------------------------------------------------------------------ stages
    def _run(self, sg: _Schedule, call: _Call) -> None:
        """All stages of ``sg``."""
        if not self.N:
            return
        if sg.recompute:
            self._chunks(sg, call, call.gw.view(-1) if sg.in_gw else call.scratch)
            lt = self._head(sg, call) if sg.n0 else None
            self._slices_dw(sg, call, lt)
            return
        if sg.n0:
            lt = self._head(sg, call)
            self._head_dw(sg, call, lt)
        self._chunks(sg, call, call.scratch)

    def _chunks(self, sg: _Schedule, call: _Call, buf: Tensor) -> None:
        """Stage 1: rows ``[n0, N)`` in row-major chunks of ``sg.step`` rows in ``buf``: loss / LSE (forward)
        or the gradient from the saved LSE (backward), then ``grad_hidden`` / ``grad_bias`` (and with
        ``accumulate`` ``grad_weight``) of each chunk."""
        if not sg.chunks:
            return
        V, n0, step = self.V, sg.n0, sg.step
        h, w, b = call.h, call.w, call.b
        hs = (h[n0:] if n0 else h).split(step)
        ghs = (call.gh[n0:] if n0 else call.gh).split(step) if call.gh is not None and sg.want_grad else None
        wt = w.t()
        full = full_t = None
        if sg.chunks[0][1] - sg.chunks[0][0] == step:
            full = buf[: step * V].view(step, V)
            full_t = full.t() if sg.accumulate else None
        for i, (r0, r1) in enumerate(sg.chunks):
            rows = r1 - r0
            lg, lgt = (full, full_t) if rows == step else (buf[: rows * V].view(rows, V), None)
            if b is None:
                torch.mm(hs[i], wt, out=lg)
            else:
                torch.addmm(b, hs[i], wt, out=lg)
            if self.use_kernel:
                la = sg.chunk_la[rows]
                if sg.stats:
                    la(call.stream, call.aligned, buf, call.lab, None, call.rows, call.lrows, call.zrows, call.lse,
                       None, V, self.stride_label, 0, rows, r0, call.zl_off, 2 * self.N, V, V, *self.consts)
                else:
                    la(call.stream, call.aligned, buf, call.dl, None, buf, call.lse, call.lab, V, V, self.stride_label,
                       call.dl_stride, 0, rows, r0, V, *self.consts)
            else:
                self._chunk_ref(sg, call, lg, r0, r1)
            if not sg.want_grad:
                continue
            if ghs is not None:
                torch.mm(lg, w, out=ghs[i])
            if sg.accumulate:
                self._chunk_dw(call, lg.t() if lgt is None else lgt, hs[i], first=r0 == 0)
            if call.gb is not None:
                call.gb.add_(lg.sum(0, dtype=_F32))

    def _chunk_ref(self, sg: _Schedule, call: _Call, lg: Tensor, r0: int, r1: int) -> None:
        _, V, ignore, ls, _, zsq, cap = self.consts
        lab = call.lab[r0:r1]
        if sg.stats:
            scale = call.rows[2 * self.N:] if sg.want_grad else None
            loss, zl, lse = cross_entropy_fwd_ref(lg, lab, None, ls, 1.0, zsq, ignore, cap, 0, V, True,
                                                  grad_scale=scale)
            call.lrows[r0:r1], call.zrows[call.zl_off + r0:call.zl_off + r1], call.lse[r0:r1] = loss, zl, lse
        else:
            cross_entropy_bwd_ref(call.dl_ref[r0:r1], lg, call.lse[r0:r1], lab, ls, 1.0, zsq, ignore, cap, 0, V, out=lg)

    def _head(self, sg: _Schedule, call: _Call) -> Tensor:
        """Stage 2: the head's logits, vocab-major in ``grad_weight``'s storage, turned into their gradient;
        ``grad_hidden`` / ``grad_bias`` of the head. Returns the ``(V, n0)`` gradient view (still needed)."""
        V, n0, gw = self.V, sg.n0, call.gw
        lt = gw.view(-1)[: V * n0].view(V, n0)
        h0t = call.h[:n0].t()
        if call.b is None:
            torch.mm(call.w, h0t, out=lt)
        else:
            torch.addmm(call.b.unsqueeze(1), call.w, h0t, out=lt)
        lg = lt.t()
        c = self.consts
        if self.use_kernel:
            stream, aligned = call.stream, call.aligned
            if sg.stats:
                st = sg.head_stats
                if sg.part_in_scratch:
                    per = 4 // call.scratch.element_size()
                    part = call.scratch[: st.part_elems * per].view(_F32)
                else:
                    part = torch.empty((st.part_elems,), dtype=_F32, device=self.device)
                st.stats(stream, aligned, gw, part, 1, n0, n0, V, st.cols_per_split, 1.0, c[6])
                st.combine(stream, aligned, gw, call.lab, part, call.lrows, call.zrows, call.lse, 1, n0,
                           self.stride_label, n0, call.zl_off, V, st.n_splits, *c)
            sg.head_grad(stream, aligned, gw, call.dl, call.lse, call.lab, 0, 1, n0, self.stride_label, call.dl_stride,
                         call.dl_off, n0, 0, V, 0, *c[1:])
        else:
            _, _, ignore, ls, _, zsq, cap = c
            lab = call.lab[:n0]
            if sg.stats:
                loss, zl, lse = cross_entropy_fwd_ref(lg, lab, None, ls, 1.0, zsq, ignore, cap, 0, V, True)
                call.lrows[:n0], call.zrows[call.zl_off:call.zl_off + n0], call.lse[:n0] = loss, zl, lse
            cross_entropy_bwd_ref(call.dl_ref[:n0], lg, call.lse[:n0], lab, ls, 1.0, zsq, ignore, cap, 0, V, out=lg)
        if call.gh is not None:
            torch.mm(lg, call.w, out=call.gh[:n0])
        if call.gb is not None:
            call.gb.add_(lt.sum(1, dtype=_F32))
        return lt

    def _head_dw(self, sg: _Schedule, call: _Call, lt: Tensor) -> None:
        """``grad_weight = head dlogits.T @ hidden_head`` by vocab slices, each copied out of the storage it
        is about to overwrite (descending: lower slices' logits lie below every output written so far)."""
        n0, sizes = sg.n0, sg.head_sizes
        h0 = call.h[:n0]
        lts, gws = lt.split(sizes), call.gw.split(sizes)
        last = len(sizes) - 1
        views: dict = {}
        for j, (s0, s1) in enumerate(sg.head_slices):
            i, k = last - j, s1 - s0
            tmp = views.get(k)
            if tmp is None:
                tmp = views[k] = call.scratch[: k * n0].view(k, n0)
            tmp.copy_(lts[i])
            torch.mm(tmp, h0, out=gws[i])

    def _slices_dw(self, sg: _Schedule, call: _Call, lt: Tensor | None) -> None:
        """Stage 3: ``grad_weight[slice] = dlogits[:, slice].T @ hidden`` for descending vocab slices; the
        head's columns copied from ``lt``, the others recomputed from the LSE. Every view a slice needs is
        made once per call (one ``split`` per tensor; the scratch views per slice width)."""
        N, n0, V, sizes = self.N, sg.n0, self.V, sg.slice_sizes
        h, b, scratch = call.h, call.b, call.scratch
        ws, gws = call.w.split(sizes), call.gw.split(sizes)
        bs = b.split(sizes) if b is not None else None
        lts = lt.split(sizes) if n0 else None
        rest_t = h[n0:].t() if N > n0 else None
        last = len(sizes) - 1
        views: dict = {}
        c = self.consts
        for j, (s0, s1, la) in enumerate(sg.slices):
            i, k = last - j, s1 - s0
            v = views.get(k)
            if v is None:
                tmp = scratch[: k * N].view(k, N)
                v = views[k] = (tmp, tmp[:, :n0] if n0 else None, tmp[:, n0:] if n0 else tmp)
            tmp, head, rest = v
            if n0:
                head.copy_(lts[i])
            if N > n0:
                if bs is None:
                    torch.mm(ws[i], rest_t, out=rest)
                else:
                    torch.addmm(bs[i].unsqueeze(1), ws[i], rest_t, out=rest)
                if self.use_kernel:
                    # Logit (token n0 + r, class s0 + c) at scratch[n0 + r + c * N]: no view reaches the kernel.
                    la(call.stream, call.aligned, scratch, call.dl, call.lse, call.lab, n0, 1, N, self.stride_label,
                       call.dl_stride, call.dl_off, N - n0, n0, k, s0, *c[1:])
                else:
                    _, _, ignore, ls, _, zsq, cap = c
                    cross_entropy_bwd_ref(call.dl_ref[n0:], rest.t(), call.lse[n0:], call.lab[n0:], ls, 1.0, zsq,
                                          ignore, cap, s0, V, out=rest.t())
            torch.mm(tmp, h, out=gws[i])

    def _chunk_dw(self, call: _Call, lgt: Tensor, h_c: Tensor, first: bool) -> None:
        """Accumulating path: ``grad_weight += lgt @ h_c`` (``lgt``: a chunk's transposed gradient; the first
        write needs no zero-fill)."""
        gw = call.gw
        if gw.dtype == lgt.dtype:
            if first:
                torch.mm(lgt, h_c, out=gw)
            else:
                gw.addmm_(lgt, h_c)
        else:
            # fp32 accumulation of low-precision products: cuBLAS cannot add a bf16 product into an fp32 C
            # everywhere, so the product is formed per vocab slice and added (bounded temp).
            step = TUNING["fp32_accum_rows"]
            for v0 in range(0, gw.shape[0], step):
                gw[v0:v0 + step].add_(torch.mm(lgt[v0:v0 + step], h_c))


def _descending(V: int, step: int) -> list[tuple[int, int]]:
    """Vocab slices ``[s0, s1)`` of ``step`` classes from the top down (the last one may be shorter)."""
    return [(max(0, s1 - step), s1) for s1 in range(V, 0, -step)]
