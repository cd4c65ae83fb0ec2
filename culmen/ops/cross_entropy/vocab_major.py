"""Cross-entropy kernels on logits with any ``(token, vocab)`` strides, for the fused linear path.

``fused_linear_cross_entropy`` keeps the logits of its first tokens *vocab-major* (``(V, T)``, tokens
contiguous) inside the storage of ``grad_weight`` before that gradient is written, and recomputes
vocab slices of the logits as ``(V_slice, T)`` blocks (see ``fused_linear.py``). The row-major kernels
of ``kernels.py`` need the vocab contiguous; these take both strides, so the same code serves a
``(T, V)`` view with strides ``(1, ld)``. The tile is ``(BLOCK_M tokens, BLOCK_V classes)``; Triton
vectorizes along whichever axis has stride 1 (a stride equal to 1 is specialized), so token-contiguous
logits are read in 16-byte vectors along the tokens.

* ``_vm_stats_kernel``: program ``(m, s)`` runs an online softmax over the columns of split ``s`` for
  ``BLOCK_M`` rows and writes partial ``(max, sum exp, sum z)``;
* ``kernels._cross_entropy_combine_kernel`` (shared, it takes both strides) merges the splits of a block
  of rows into LSE, loss and z-loss;
* ``_vm_grad_kernel``: ``d loss / d logits`` of one tile from the LSE, in place, with a vocab offset so a
  slice ``[vocab_start, vocab_start + V)`` of a larger vocabulary can be processed, and an element offset
  and a row offset so a block inside a larger buffer / batch needs no view.

``StatsLaunches`` / ``grad_launch`` build the bound launches a plan of the fused linear path keeps;
``vm_loss_lse`` / ``vm_grad`` are unplanned calls of the same kernels for tests and sweeps (fp32 outputs,
labels int32/int64, ``dloss`` of any stride, 0 included).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from culmen.ops.backend import num_programs_hint
from culmen.ops.common.launch import Launch, PlanTuning, aligned_16, cdiv, next_pow2, stream_getter
from culmen.ops.common.plans import clear_plans
from culmen.ops.cross_entropy.kernels import _cross_entropy_combine_kernel, _grad_tile, _row_labels, _softcap


@triton.jit(do_not_specialize=["N"])
def _vm_stats_kernel(LOGITS, PART, stride_t, stride_v, N, V, cols_per_split, logit_scale, softcap,
                     HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """Partial ``(max, sum exp(z - max), sum z)`` of rows block ``m`` over the columns of split ``s``."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    logit_scale = tl.cast(logit_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    # Rows are not clamped: a clamp would hide their contiguity from the vectorizer; masks instead.
    row_off = rows * stride_t
    pid_s = tl.program_id(1)
    c_start = pid_s * cols_per_split
    c_end = tl.minimum(c_start + cols_per_split, V)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc_l = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    sum_l = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    for c0 in range(c_start, c_end, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)[None, :]
        mask = row_ok[:, None] & (cols < c_end)
        x = tl.load(LOGITS + row_off[:, None] + cols.to(tl.int64) * stride_v, mask=mask, other=0.0).to(tl.float32)
        z = tl.where(mask, _softcap(x * logit_scale, softcap, HAS_SOFTCAP), float("-inf"))
        # Rows past the end are all -inf: keep their max finite so no NaN appears (nothing is stored).
        m_new = tl.maximum(tl.maximum(m, tl.max(z, axis=1)), -3.0e38)
        acc_l = acc_l * tl.exp(m - m_new)[:, None] + tl.exp(z - m_new[:, None])
        m = m_new
        if HAS_SMOOTHING:
            sum_l += tl.where(mask, z, 0.0)
    plane = tl.num_programs(1).to(tl.int64) * N
    part = PART + pid_s.to(tl.int64) * N + rows
    tl.store(part, m, mask=row_ok)
    tl.store(part + plane, tl.sum(acc_l, axis=1), mask=row_ok)
    tl.store(part + 2 * plane, tl.sum(sum_l, axis=1), mask=row_ok)


@triton.jit(do_not_specialize=["N", "row0", "vocab_start", "stride_dloss", "dloss_off"])
def _vm_grad_kernel(X, DLOSS, LSE, LABELS, off, stride_t, stride_v, stride_label, stride_dloss, dloss_off, N, row0, V,
                    vocab_start, total_classes, ignore_index, label_smoothing, logit_scale, lse_square_scale, softcap,
                    HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program ``(m, v)`` overwrites the logits of rows block ``m``, columns block ``v`` with their gradient.

    Logit ``(r, c)`` lives at ``X[off + r * stride_t + c * stride_v]``; it is column ``vocab_start + c`` of
    ``total_classes`` and row ``row0 + r`` of the per-row arrays (LSE, labels, ``DLOSS[dloss_off + (row0 + r)
    * stride_dloss]``: stride 0 for the scale of a reduced loss)."""
    # Inductor passes Python floats as fp64: keep the math in fp32 (a no-op in eager launches).
    label_smoothing = tl.cast(label_smoothing, tl.float32)
    logit_scale = tl.cast(logit_scale, tl.float32)
    lse_square_scale = tl.cast(lse_square_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    g_rows = row0 + tl.minimum(rows, N - 1)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    mask = row_ok[:, None] & (cols < V)
    valid, local, _, bad = _row_labels(LABELS, g_rows * stride_label, row_ok, V, vocab_start, total_classes,
                                       ignore_index)
    dloss = tl.load(DLOSS + dloss_off + g_rows * stride_dloss).to(tl.float32)
    coef = tl.where(valid, dloss * logit_scale, 0.0)
    lse = tl.load(LSE + g_rows).to(tl.float32)
    zfac = 1.0 + 2.0 * lse_square_scale * lse
    # Rows are not clamped in the address: a clamp would hide their contiguity from the vectorizer.
    ptr = X + off + rows[:, None] * stride_t + cols.to(tl.int64) * stride_v
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    z = _softcap(x * logit_scale, softcap, HAS_SOFTCAP)
    g = _grad_tile(z, cols, lse, zfac, coef, local, bad, label_smoothing, total_classes, softcap,
                   HAS_SMOOTHING, HAS_SOFTCAP)
    tl.store(ptr, g.to(X.dtype.element_ty), mask=mask)


TUNING = PlanTuning({
    # Gradient tiles: rows (tokens) x columns (classes); 64 x 64 bf16 = 8 KiB, 16-byte vectors along the
    # tokens.
    "block_m": 64,
    "block_v": 64,
    "num_warps": 4,
    # Statistics tiles: 1024 tokens x 4 classes puts every warp along the tokens (8 per thread, 32 threads,
    # 4 warps), so the per-step max over the classes stays inside a thread: no shuffles, no barriers.
    "stats_block_m": 1024,
    "stats_block_v": 4,
    # The statistics pass splits the vocab until it has this many programs per multiprocessor.
    "programs_per_sm": 4,
    "finish_block_m": 64,
}, clear_plans)


def flags(label_smoothing: float, softcap: float) -> dict:
    """The constexpr flags every kernel of the op shares."""
    return dict(HAS_SMOOTHING=label_smoothing > 0.0, HAS_SOFTCAP=softcap > 0.0)


def _block_m(N: int, key: str = "block_m") -> int:
    return max(1, min(TUNING[key], next_pow2(N)))


class StatsLaunches:
    """The bound launches of loss / z-loss / LSE for ``N`` rows of ``V`` classes in any layout: the split
    online softmax (``stats``, writing ``part_elems`` fp32 partials) and the combine kernel (``combine``).

    ``stats`` takes ``(logits, part, stride_t, stride_v, N, V, cols_per_split, logit_scale, softcap)``;
    ``combine`` the arguments of ``kernels._cross_entropy_combine_kernel``."""

    __slots__ = ("stats", "combine", "n_splits", "cols_per_split", "part_elems")

    def __init__(self, N: int, V: int, flag: dict, device: torch.device) -> None:
        bm, bv = _block_m(N, "stats_block_m"), TUNING["stats_block_v"]
        row_programs = cdiv(N, bm)
        want = max(1, min(cdiv(V, bv), cdiv(num_programs_hint(device) * TUNING["programs_per_sm"], row_programs)))
        self.cols_per_split = cdiv(cdiv(V, want), bv) * bv
        self.n_splits = cdiv(V, self.cols_per_split)
        self.part_elems = 3 * self.n_splits * N
        self.stats = Launch(_vm_stats_kernel, (row_programs, self.n_splits), dict(**flag, BLOCK_M=bm, BLOCK_V=bv),
                            TUNING["num_warps"], device=device)
        fm = max(1, min(TUNING["finish_block_m"], next_pow2(N)))
        self.combine = Launch(_cross_entropy_combine_kernel, (cdiv(N, fm),),
                              dict(**flag, ADD_LSE=True, BLOCK_M=fm, BLOCK_S=next_pow2(self.n_splits)), 4,
                              device=device)


def grad_launch(N: int, V: int, flag: dict, device: torch.device) -> Launch:
    """The bound in-place gradient launch of ``N`` rows x ``V`` classes (``_vm_grad_kernel``'s arguments)."""
    bm, bv = _block_m(N), TUNING["block_v"]
    return Launch(_vm_grad_kernel, (cdiv(N, bm), cdiv(V, bv)), dict(**flag, BLOCK_M=bm, BLOCK_V=bv),
                  TUNING["num_warps"], device=device)


def vm_loss_lse(logits: Tensor, labels: Tensor, label_smoothing: float, logit_scale: float, lse_square_scale: float,
                ignore_index: int, softcap: float, vocab_start: int, total_classes: int,
                workspace: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 ``(loss, z_loss, lse)`` ``(N,)`` of ``logits (N, V)`` with any strides (an unplanned call, for
    tests and sweeps; the fused linear path holds its launches in its plan).

    ``workspace``: a free contiguous buffer (any dtype) for the per-split partials when it is large enough."""
    N, V = logits.shape
    dev = logits.device
    loss, zloss, lse = (torch.empty((N,), device=dev, dtype=torch.float32) for _ in range(3))
    if N == 0:
        return loss, zloss, lse
    st = StatsLaunches(N, V, flags(label_smoothing, softcap), dev)
    per = 4 // workspace.element_size() if workspace is not None and workspace.element_size() <= 4 else 0
    if per and workspace.is_contiguous() and workspace.numel() >= st.part_elems * per:
        part = workspace.view(-1)[: st.part_elems * per].view(torch.float32)
    else:
        part = torch.empty((st.part_elems,), device=dev, dtype=torch.float32)
    s_t, s_v = logits.stride()
    stream = stream_getter(dev)()
    aligned = aligned_16(logits, labels, part)
    st.stats(stream, aligned, logits, part, s_t, s_v, N, V, st.cols_per_split, logit_scale, softcap)
    st.combine(stream, aligned, logits, labels, part, loss, zloss, lse, s_t, s_v, labels.stride(0), N, 0, V,
               st.n_splits, vocab_start, total_classes, ignore_index, label_smoothing, logit_scale, lse_square_scale,
               softcap)
    return loss, zloss, lse


def vm_grad(dloss: Tensor, logits: Tensor, lse: Tensor, labels: Tensor, label_smoothing: float, logit_scale: float,
            lse_square_scale: float, ignore_index: int, softcap: float, vocab_start: int, total_classes: int) -> Tensor:
    """Overwrite ``logits (N, V)`` (any strides; columns ``[vocab_start, vocab_start + V)`` of
    ``total_classes``) with ``dloss * d loss / d logits`` for ``dloss (N,)`` of any stride (an unplanned call,
    for tests and sweeps)."""
    N, V = logits.shape
    if N == 0 or V == 0:
        return logits
    la = grad_launch(N, V, flags(label_smoothing, softcap), logits.device)
    s_t, s_v = logits.stride()
    la(stream_getter(logits.device)(), aligned_16(logits, dloss, lse, labels), logits, dloss, lse, labels, 0, s_t, s_v,
       labels.stride(0), dloss.stride(0), 0, N, 0, V, vocab_start, total_classes, ignore_index, label_smoothing,
       logit_scale, lse_square_scale, softcap)
    return logits


__all__ = ["TUNING", "StatsLaunches", "flags", "grad_launch", "vm_grad", "vm_loss_lse"]
