"""``rnnt_projection_loss``: the transducer's vocabulary projection fused with the RNN-T loss, so that the
``(rows, K)`` logits never exist whole (a culmen addition: Apex has no such op).

A speech transducer's training step ends in ``joint -> Linear(H -> K) -> RNN-T loss``. Run as three ops, the
logits (``B*T*U x K``) and their gradient are the largest tensors of the step (1.5 GiB each at B=16, T=500,
U=100, K=1024 in fp16), larger than the joint output ``h`` they come from. Here the projection runs a chunk
of joint rows at a time (cuBLAS through ``torch.mm``):

* forward: ``logits_c = h_c @ W.T + b`` into a reused ``(chunk, K)`` buffer, then ``_proj_logprobs_kernel``
  reduces each row to its log-sum-exp and blank / label log-probabilities at its lattice node; the alpha /
  beta recursions of ``rnnt_loss`` (``_rnnt_alpha_beta_kernel``) then run on those ``(B, T, U)`` fp32
  statistics unchanged;
* backward: the chunk's logits are recomputed (same GEMM, same bits), overwritten in place by their gradient
  (``_proj_grad_kernel``: the softmax-fused formula of ``rnnt_loss``'s backward, scaled by the incoming
  loss gradient), and ``dh_c = dlogits_c @ W``, ``dW += dlogits_c.T @ h_c``, ``db += dlogits_c.sum(0)``
  (the last two accumulated in fp32 across chunks).

Peak memory beyond ``h`` and ``dh`` is one chunk buffer plus five ``(B, T, U)`` fp32 statistics. The numbers
equal ``rnnt_loss(F.linear(h, W, b), ...)`` up to the GEMMs' summation order: the logits are rounded to
``h.dtype`` as ``F.linear`` would round them.

fp64 inputs and CPU tensors (unless the backend is ``triton``) take the reference path, which forms the
whole logits with ``F.linear`` and calls ``rnnt_loss``'s reference (``reference.py``). Under
``torch.compile`` the op runs eagerly (a graph break): its chunk loop is host code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.ops.backend import check_values_on, choose_backend
from culmen.ops.common.function import raw_apply
from culmen.ops.common.launch import Launch, PlanTuning, aligned_16, cdiv, next_pow2, stream_getter
from culmen.ops.common.plans import PlanCache, clear_plans
from culmen.ops.transducer import reference as ref
from culmen.ops.transducer.kernels import _proj_grad_kernel, _proj_logprobs_kernel, _rnnt_alpha_beta_kernel
from culmen.ops.transducer.launch import _bad, _check_float, _contig, _pow2_le, check_loss_inputs

TUNING = PlanTuning({
    # Bytes of one chunk of logits (chunk rows = chunk_bytes // (K * itemsize)): the op's whole working set
    # beyond h and dh. 32 MiB keeps each chunk's GEMMs large enough to run near peak on an H100/H200.
    "chunk_bytes": 32 << 20,
    # Elements per program tile of the chunk kernels, and the widest vocabulary block.
    "tile": 4096,
    "max_block_k": 1024,
    "warps": 8,
}, clear_plans)

PLANS = PlanCache("transducer_projection_loss")
_OP = "rnnt_projection_loss"
_STATS = ("alpha", "beta", "lse", "lpb", "lpe")
# Whether torch.mm(a, b, out_dtype=torch.float32) runs for low-precision inputs, per device type (tried once).
_MM_FP32_OUT: dict[str, bool] = {}


def _mm_into_fp32(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and ``a``, ``b`` of any float dtype, the GEMM accumulating in fp32:
    its fp32 output where torch offers one (``out_dtype``), else the GEMM in the inputs' dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    kind = a.device.type
    if _MM_FP32_OUT.get(kind, True):
        try:
            acc += torch.mm(a, b, out_dtype=torch.float32)
            _MM_FP32_OUT[kind] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_FP32_OUT[kind] = False
    acc += torch.mm(a, b)


class ProjectionLossPlan:
    """Everything ``rnnt_projection_loss`` derives from one call signature: checks, chunking, bound launches.
    Holds no tensors."""

    __slots__ = ("B", "T", "U", "H", "K", "N", "L", "blank", "packed", "dtype", "device", "check_values",
                 "use_kernel", "stream", "chunk", "nsteps", "stats", "stats_tail", "grad", "grad_tail",
                 "alpha_beta")

    def __init__(self, h, weight, bias, label, f_len, y_len, blank_idx, batch_offset, max_f_len,
                 packed_input: bool):
        self.packed = bool(packed_input)
        _check_float("h", _OP, h, 2 if self.packed else 4)
        _check_float("weight", _OP, weight, 2)
        if weight.dtype != h.dtype or weight.device != h.device:
            raise TypeError(f"{_OP}: weight must have h's dtype and device ({h.dtype}, {h.device}), got "
                            f"({weight.dtype}, {weight.device})")
        H = h.shape[-1]
        if weight.shape[1] != H:
            raise ValueError(f"{_OP}: weight must have shape (K, {H}) (h's last dimension is {H}), got "
                             f"{tuple(weight.shape)}")
        K = weight.shape[0]
        if bias is not None:
            _check_float("bias", _OP, bias, 1)
            if bias.dtype != h.dtype or bias.device != h.device:
                raise TypeError(f"{_OP}: bias must have h's dtype and device ({h.dtype}, {h.device}), got "
                                f"({bias.dtype}, {bias.device})")
            if bias.shape[0] != K:
                raise ValueError(f"{_OP}: bias must have shape ({K},) (weight's rows), got {tuple(bias.shape)}")
        B, T, U, max_f_len = check_loss_inputs(_OP, "h", h, label, f_len, y_len, blank_idx, batch_offset, max_f_len,
                                               self.packed, K, "weight's rows")
        if K == 0 or U == 0 or T == 0 or H == 0:
            raise ValueError(f"{_OP}: h and weight must have non-empty time, label, hidden and vocabulary "
                             f"dimensions, got h {tuple(h.shape)}, weight {tuple(weight.shape)}")
        self.B, self.T, self.U, self.H, self.K, self.L, self.blank = B, T, U, H, K, label.shape[1], blank_idx
        self.N = h.shape[0] if self.packed else B * T * U
        self.dtype, self.device = h.dtype, h.device
        self.stream = stream_getter(h.device)
        self.check_values = check_values_on() or (h.device.type == "cpu" and self.stream() is None)
        self.use_kernel = h.dtype != torch.float64 and choose_backend(h.device) == "triton"
        if self.use_kernel:
            self._plan()

    def _plan(self) -> None:
        B, U, K, N, dev = self.B, self.U, self.K, self.N, self.device
        bk = _pow2_le(K, TUNING["max_block_k"])
        self.chunk = max(1, min(TUNING["chunk_bytes"] // (K * self.dtype.itemsize), N))
        br = _pow2_le(self.chunk, max(1, TUNING["tile"] // bk))
        self.nsteps = B.bit_length() if self.packed else 0
        meta = dict(PACK=self.packed, BLOCK_R=br, BLOCK_K=bk)
        warps = TUNING["warps"]
        tail = N % self.chunk
        self.stats = Launch(_proj_logprobs_kernel, (cdiv(self.chunk, br),), meta, warps, device=dev)
        self.grad = Launch(_proj_grad_kernel, (cdiv(self.chunk, br),), meta, warps, device=dev)
        self.stats_tail = Launch(_proj_logprobs_kernel, (cdiv(tail, br),), meta, warps, device=dev) if tail else None
        self.grad_tail = Launch(_proj_grad_kernel, (cdiv(tail, br),), meta, warps, device=dev) if tail else None
        bu_scan = next_pow2(U)
        self.alpha_beta = Launch(_rnnt_alpha_beta_kernel, (B, 2), dict(BLOCK_U=bu_scan),
                                 max(1, min(8, bu_scan // 32)), device=dev)

    def prepare(self, h, weight, bias, label, f_len, y_len, batch_offset):
        """The call's tensors as the kernels read them, after the value checks when they are on."""
        h, weight, label, f_len, y_len = _contig(h), _contig(weight), _contig(label), _contig(f_len), _contig(y_len)
        bias = None if bias is None else _contig(bias)
        boff = _contig(batch_offset) if self.packed else None
        if self.check_values:
            self._check_values(label, f_len, y_len, boff)
        return h, weight, bias, label, f_len, y_len, boff

    def _check_values(self, label, f_len, y_len, boff) -> None:
        T, U = self.T, self.U
        tdim = "max_f_len" if self.packed else "h.shape[1]"
        if f_len.numel() and (int(f_len.min()) < 1 or int(f_len.max()) > T):
            raise _bad("f_len", _OP, f_len, f"must be in [1, {T}] ({tdim}={T})")
        udim = "label.shape[1]" if self.packed else "h.shape[2] - 1"
        if y_len.numel() and (int(y_len.min()) < 0 or int(y_len.max()) > U - 1):
            raise _bad("y_len", _OP, y_len, f"must be in [0, {U - 1}] ({udim}={U - 1})")
        lab = label[:, :U - 1]
        used = torch.arange(lab.shape[1], device=lab.device) < y_len.to(torch.int64).view(-1, 1)
        bad = used & ((lab < 0) | (lab >= self.K))
        if bool(bad.any()):
            raise _bad("label", _OP, lab[bad], f"values must be in [0, {self.K}) (weight's rows)")
        if self.packed:
            want = torch.cumsum(f_len.to(torch.int64) * (y_len.to(torch.int64) + 1), 0)
            if not torch.equal(boff.to(torch.int64), want):
                raise _bad("batch_offset", _OP, boff, f"must be cumsum(f_len * (y_len + 1)) = {want.tolist()[:16]}")
            if self.B and int(want[-1]) > self.N:
                raise ValueError(f"{_OP}: h has {self.N} rows but the lengths need batch_offset[-1]={int(want[-1])}")

    # ------------------------------------------------------------------------------------------ kernels

    def _chunks(self, hr: Tensor, weight: Tensor, bias: Tensor | None, buf: Tensor):
        """``(r0, c, h_c, logits_c, stats launch, grad launch)`` per chunk; ``logits_c`` (a view of ``buf``)
        already holds ``h_c @ W.T + b``."""
        wt = weight.t()
        for r0 in range(0, self.N, self.chunk):
            c = min(self.chunk, self.N - r0)
            hc, xc = hr[r0:r0 + c], buf[:c]
            if bias is None:
                torch.mm(hc, wt, out=xc)
            else:
                torch.addmm(bias, hc, wt, out=xc)
            full = c == self.chunk
            yield r0, c, hc, xc, (self.stats if full else self.stats_tail), (self.grad if full else self.grad_tail)

    def forward(self, h, weight, bias, label, f_len, y_len, boff) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, saved)``: the ``(B,)`` loss (``h.dtype``) and the ``(B, T, U)`` statistics the backward reads
        (fp32; fp64 for fp64 ``h``)."""
        if not self.use_kernel:
            saved = ref.rnnt_loss_fwd_ref(self._ref_logits(h, weight, bias), label, f_len, y_len, self.blank, boff,
                                          self.T, self.packed)
            return saved.pop("loss"), saved
        B, T, U, dev = self.B, self.T, self.U, self.device
        s = {name: torch.empty((B, T, U), device=dev, dtype=torch.float32) for name in _STATS}
        loss = torch.empty((B,), device=dev, dtype=self.dtype)
        if B == 0:
            return loss, s
        boff_t = f_len if boff is None else boff
        stream = self.stream()
        if self.N:
            buf = torch.empty((self.chunk, self.K), device=dev, dtype=self.dtype)
            aligned = aligned_16(buf, label, f_len, y_len, boff_t, *s.values())
            for r0, c, _hc, xc, stats, _grad in self._chunks(h.reshape(self.N, self.H), weight, bias, buf):
                stats(stream, aligned, xc, label, f_len, y_len, boff_t, s["lse"], s["lpb"], s["lpe"], r0, c, B, T,
                      U, self.K, self.L, self.blank, self.nsteps)
            del buf
        self.alpha_beta(stream, aligned_16(f_len, y_len, loss, *s.values()),
                        f_len, y_len, s["lpb"], s["lpe"], s["alpha"], s["beta"], loss, T, U)
        return loss, s

    def backward(self, loss_grad, h, weight, bias, label, f_len, y_len, boff, saved, needs) -> tuple:
        """``(dh, dweight, dbias)`` of ``(loss_grad * loss).sum()`` (``None`` where ``needs`` says no)."""
        need_h, need_w, need_b = needs
        need_b = need_b and bias is not None
        if not self.use_kernel:
            return self._backward_ref(loss_grad, h, weight, bias, label, f_len, y_len, boff, saved,
                                      (need_h, need_w, need_b))
        B, T, U, K, H, dev = self.B, self.T, self.U, self.K, self.H, self.device
        lg = _contig(loss_grad.to(torch.float32).expand(B))
        hr = h.reshape(self.N, H)
        dh = torch.empty_like(h) if need_h else None
        dhr = dh.view(self.N, H) if need_h else None
        dw = torch.zeros((K, H), device=dev, dtype=torch.float32) if need_w else None
        db = torch.zeros((K,), device=dev, dtype=torch.float32) if need_b else None
        if B and self.N and (need_h or need_w or need_b):
            boff_t = f_len if boff is None else boff
            stream = self.stream()
            s = saved
            buf = torch.empty((self.chunk, K), device=dev, dtype=self.dtype)
            aligned = aligned_16(buf, label, f_len, y_len, boff_t, lg, *s.values())
            for r0, c, hc, xc, _stats, grad in self._chunks(hr, weight, bias, buf):
                grad(stream, aligned, xc, label, f_len, y_len, boff_t, s["lse"], s["lpb"], s["lpe"], s["alpha"],
                     s["beta"], lg, r0, c, B, T, U, K, self.L, self.blank, self.nsteps)
                if need_h:
                    torch.mm(xc, weight, out=dhr[r0:r0 + c])
                if need_w:
                    _mm_into_fp32(dw, xc.t(), hc)
                if need_b:
                    db += xc.sum(0, dtype=torch.float32)
            del buf
        elif need_h:
            dh.zero_()
        return (dh, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype))

    # ---------------------------------------------------------------------------------------- reference

    def _ref_logits(self, h, weight, bias) -> Tensor:
        """The whole logits, rounded to ``h.dtype`` as the chunked GEMMs round them."""
        return F.linear(h, weight, bias)

    def _backward_ref(self, loss_grad, h, weight, bias, label, f_len, y_len, boff, saved, needs) -> tuple:
        need_h, need_w, need_b = needs
        lg = _contig(loss_grad.to(self.dtype).expand(self.B))
        x = self._ref_logits(h, weight, bias)
        dx = ref.rnnt_loss_bwd_ref(lg, x, label, f_len, y_len, self.blank, boff, self.T, self.packed, saved)
        dxr, hr = dx.reshape(-1, self.K), h.reshape(-1, self.H)
        acc = torch.float64 if self.dtype == torch.float64 else torch.float32
        dh = (dxr @ weight).view(h.shape) if need_h else None
        dw = (dxr.to(acc).t() @ hr.to(acc)).to(weight.dtype) if need_w else None
        db = dxr.sum(0, dtype=acc).to(bias.dtype) if need_b else None
        return dh, dw, db


def _sig(t: Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _plan(h, weight, bias, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input):
    try:
        key = (_sig(h), _sig(weight), _sig(bias), _sig(label), _sig(f_len), _sig(y_len),
               _sig(batch_offset) if packed_input else None, blank_idx, max_f_len if packed_input else None,
               bool(packed_input))
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable: the plan says why
        key, plan = None, None
    if plan is None:
        plan = ProjectionLossPlan(h, weight, bias, label, f_len, y_len, blank_idx, batch_offset, max_f_len,
                                  packed_input)
        if key is not None:
            PLANS.put(key, plan)
    return plan


class _ProjectionLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, h, weight, bias, label, f_len, y_len, boff):
        loss, saved = plan.forward(h, weight, bias, label, f_len, y_len, boff)
        ctx.plan = plan
        ctx.save_for_backward(h, weight, bias, label, f_len, y_len, boff, *saved.values())
        return loss

    @staticmethod
    def backward(ctx, loss_grad):
        h, weight, bias, label, f_len, y_len, boff, *stats = ctx.saved_tensors
        saved = dict(zip(_STATS, stats))
        dh, dw, db = ctx.plan.backward(loss_grad, h, weight, bias, label, f_len, y_len, boff, saved,
                                       ctx.needs_input_grad[1:4])
        return None, dh, dw, db, None, None, None, None


_apply = raw_apply(_ProjectionLossFn)


@torch.compiler.disable
def rnnt_projection_loss(h: Tensor, weight: Tensor, bias: Tensor | None, label: Tensor, f_len: Tensor,
                         y_len: Tensor, blank_idx: int, batch_offset: Tensor | None = None,
                         max_f_len: int | None = None, packed_input: bool = False) -> Tensor:
    """RNN-T loss of the logits ``h @ weight.T + bias``, computed without materializing those logits.

    A culmen addition (Apex has no fused projection + loss): equal to
    ``rnnt_loss(F.linear(h, weight, bias), label, f_len, y_len, blank_idx, ...)`` up to the GEMMs' summation
    order, with the working memory of one chunk of logits instead of all of them (see the module docstring).

    Args:
        h: joint output, ``(B, T, U, H)``, or with ``packed_input`` ``(N, H)`` where batch ``b``'s row ``(t, u)``
            is ``batch_offset[b-1] + t * (y_len[b] + 1) + u`` (``TransducerJoint(pack_output=True)`` with
            ``g_len = y_len + 1``). fp16/bf16/fp32/fp64.
        weight: ``(K, H)`` projection weight (``nn.Linear(H, K).weight``), ``h``'s dtype and device.
        bias: ``(K,)`` or ``None``.
        label: ``(B, >= U-1)`` integer labels (``U = h.shape[2]``, or ``label.shape[1] + 1`` packed).
        f_len: ``(B,)`` frames, ``1 <= f_len <= T``; y_len: ``(B,)`` labels, ``0 <= y_len <= U-1``.
        blank_idx: the blank symbol, in ``[0, K)``.
        batch_offset: ``(B,)`` integers, ``cumsum(f_len * (y_len + 1))``; required with ``packed_input``.
        max_f_len: ``T`` of the packed input (``max(f_len)`` or more); required with ``packed_input``.

    Returns:
        ``(B,)`` losses in ``h.dtype`` (fp32 arithmetic), differentiable in ``h``, ``weight`` and ``bias``
        (``dh`` is zero on rows outside the lengths; ``dweight`` / ``dbias`` accumulate in fp32).
    """
    plan = _plan(h, weight, bias, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input)
    h, weight, bias, label, f_len, y_len, boff = plan.prepare(h, weight, bias, label, f_len, y_len, batch_offset)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        return _apply(plan, h, weight, bias, label, f_len, y_len, boff)
    return plan.forward(h, weight, bias, label, f_len, y_len, boff)[0]
