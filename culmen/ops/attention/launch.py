"""Call plans of FlashAttention: validate once per call signature, then allocate and launch.

An ``AttnPlan`` holds everything the dense, varlen and KV-cache forms derive from one call signature
(shapes, strides, dtypes, device, flags, scalars): the checks passed, whether the Triton kernels or the
reference run, the kernels' integer arguments, what to allocate and the bound ``Launch`` of each kernel.
A cached no-grad forward costs one allocation (``out``; ``lse`` only when asked) and one launch; a
backward four allocations (dq, dk, dv and the ``delta`` row sums) and three launches. Inputs are read
through their strides (only a head dim that is not unit-stride is copied).

Compilation: block configs depend on the head dim, dtype and flags only (``tiles.TUNING``, swept on H100 and
H200 GPUs, see ``bench/notes/attention.md``), and sizes and strides are not specialized on (``kernels.py``), so
every sequence length and batch size shares one compiled kernel per configuration. The CPU
interpreter uses ``interp_block`` so small test shapes still cross several blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.attention import checks, launch_ws
from culmen.ops.attention.combine import _combine_kernel, _combine_rows_kernel, combine_blocks, combine_rows_blocks
from culmen.ops.attention.kernels import LOG2E_F, _attn_fwd_kernel, _transpose_rows_kernel
from culmen.ops.attention.kernels_bwd import (
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_kernel,
    _attn_bwd_preprocess_kernel,
)
from culmen.ops.attention.reference import (
    attention_bwd_ref,
    attention_fwd_ref,
    attention_range_fwd_ref,
    attention_varlen_bwd_ref,
    attention_varlen_fwd_ref,
    dequantize_fp8,
    round_multiple,
)
from culmen.ops.attention.tiles import (  # noqa: F401  (re-exported: the plans' tiles and switches live there)
    MAX_KERNEL_HEADDIM,
    MAX_SPLITS,
    SPLIT_MAX_SEQLEN_Q,
    TUNING,
    _blocks,
    _bwd_options,
    _tile_row,
    choose_num_splits,
    kvcache_splits,
    merge_chunk,
    paged_block_tile,
    set_kernels_on_gpu,
    supported,
    use_kernels,
)
from culmen.ops.attention.tma import ensure_allocator, nvidia_hopper, tma_reduce_available
from culmen.ops.backend import check_values_on, deterministic_enabled, interpreter_enabled
from culmen.ops.common.launch import Launch, cdiv, next_pow2, stream_getter, traceable_kernels
from culmen.ops.common.launch import aligned_16 as _aligned
from culmen.ops.common.plans import PlanCache

_F32 = torch.float32


def _stride_unit(strides) -> int:
    """The largest power of two <= 16 that divides every stride (the kernels' ``SU``)."""
    unit = 16
    for s in strides:
        while unit > 1 and s % unit:
            unit //= 2
    return unit


def _contiguous_strides(shape) -> tuple:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc = acc * n
    return tuple(reversed(out))


class TensorSpec:
    """Shape, strides, dtype and device of a tensor that exists only per call (a KV cache gathered
    through its page table): what a plan needs to know about it."""

    def __init__(self, shape, strides, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = torch.Size(shape)
        self._strides = tuple(strides)
        self.dtype, self.device = dtype, device

    def stride(self, dim: int | None = None):
        return self._strides if dim is None else self._strides[dim]

    def dim(self) -> int:
        return len(self.shape)

    def is_contiguous(self) -> bool:
        return self._strides == _contiguous_strides(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


class AttnPlan:
    """Everything attention derives from one call signature.

    ``kind``: ``"dense"`` (``q (B, sq, h, d)``, ``k``/``v`` ``(B, sk, hk, d)``), ``"varlen"`` (packed
    ``(total, h, d)`` with ``cu_seqlens``/``max_seqlen``) or ``"kvcache"`` (dense, batch row ``b`` attends
    to keys ``[k_start[b], k_end[b] + k_add)`` only; validated by the caller). Built from example
    arguments (real tensors in eager mode, fake ones under ``torch.compile`` with ``traced=True``). Holds no
    tensors but the fused split merge's small int32 counters (``_counters``).
    """

    def __init__(self, kind: str, q, k, v, alibi, cu_q=None, cu_k=None, max_q=None, max_k=None, *,
                 dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 deterministic=False, return_lse=True, return_probs=False, k_range: int = 0, k_add: int = 0,
                 traced: bool = False, attention_chunk: int = 0, descale: bool = False, fa3: bool = False,
                 qv: bool = False, n_splits: int = 1, page: int = 0, paged_strides=None, n_pages: int = 0,
                 out_strides: tuple | None = None, out_alloc: tuple | None = None) -> None:
        self.kind = kind
        self.varlen = varlen = kind == "varlen"
        if kind == "dense":
            checks.check_common(q, k, v, dropout_p, window_size, softcap, alibi, q.shape[0] if q.dim() else 0, 4,
                                "(batch, seqlen, nheads, headdim)", fa3, fa3)
            checks.check_dense(q, k, v)
        elif varlen:
            checks.check_cu_seqlens(cu_q, cu_k, max_q, max_k)
            checks.check_common(q, k, v, dropout_p, window_size, softcap, alibi, cu_q.shape[0] - 1, 3,
                                "(total, nheads, headdim)", fa3, fa3)
        # FA3's features (all off for flash_attn 2's calls): a V head dim DV != D, chunked-local masks,
        # float8 inputs (bf16 output) with per-(batch, kv head) descales.
        if type(attention_chunk) is not int or attention_chunk < 0:
            raise ValueError(f"attention_chunk must be an int >= 0, got {attention_chunk!r}")
        self.DV = int(v.shape[-1])
        self.split_v = self.DV != int(q.shape[-1])
        self.chunk = int(attention_chunk)
        self.fp8 = q.dtype in checks.FP8
        self.descale = bool(descale)
        # FA3's qv (MLA): scores q . k + qv . v, qv shaped like out (.., h, DV); FA3's default scale then
        # counts both head dims.
        self.qv = bool(qv)
        # Split-KV decoding (kvcache only, see kvcache_splits) and a paged cache read through its page table
        # (page size ``page``; ``paged_strides`` the caches' (page, row, head) strides; kvcache decides when).
        self.n_splits, self.page, self.paged_strides = int(n_splits), int(page), paged_strides
        self.n_pages = int(n_pages)  # the paged cache's number of pages (the kernel clamps page numbers)
        # The output's strides when the caller wants it laid out otherwise than contiguous (pack-GQA decoding
        # writes (B, G, hk, dv) straight into the (B, 1, h, dv) memory the caller returns).
        self.out_strides = None if out_strides is None else tuple(int(x) for x in out_strides)
        # ``out_alloc``: a contiguous shape with that memory layout (the caller's (B, 1, h, dv)), allocated as such
        # so the caller returns it as is.
        self.out_alloc = None if out_alloc is None else tuple(int(x) for x in out_alloc)
        if self.qv and self.fp8:
            raise ValueError("qv cannot be combined with float8 q/k/v (FA3 has no FP8 qv either)")
        self.out_dtype = torch.bfloat16 if self.fp8 else q.dtype
        self.o_shape = torch.Size((*q.shape[:-1], self.DV))
        self.device, self.dtype = q.device, q.dtype
        self.q_shape, self.k_shape, self.v_shape = q.shape, k.shape, v.shape
        D = int(q.shape[-1])  # specialized under torch.compile(dynamic=True) too: it picks the kernel config
        self.scale = ((D + (self.DV if self.qv else 0)) ** -0.5 if softmax_scale is None
                      else float(softmax_scale))
        self.dropout_p = float(dropout_p)
        self.has_dropout = self.dropout_p > 0.0
        self.causal = bool(causal)
        self.window_size = (int(window_size[0]), int(window_size[1]))
        self.left, self.right = self.window_size[0], (0 if self.causal else self.window_size[1])
        self.softcap = float(softcap)
        self.deterministic = bool(deterministic)
        self.return_probs = bool(return_probs)
        self.return_lse = bool(return_lse) or self.return_probs
        self.k_range, self.k_add = k_range, k_add
        self.has_alibi = alibi is not None
        self.alibi_2d = alibi is not None and alibi.dim() == 2
        # ALiBi slopes are read as contiguous fp32 on q's device: anything else is converted per call.
        self.alibi_fix = alibi is not None and (alibi.dtype != _F32 or alibi.device != q.device
                                                or not alibi.is_contiguous())
        self.cu_fix = varlen and not (cu_q.is_contiguous() and cu_k.is_contiguous()
                                      and cu_q.device == q.device and cu_k.device == q.device)
        if varlen:
            self.B, self.sq, self.sk = cu_q.shape[0] - 1, _as_int(max_q), _as_int(max_k)
            self.total_q, self.total_k = q.shape[0], k.shape[0]
            self.lse_shape = (q.shape[1], q.shape[0])
        else:
            self.B, self.sq, self.sk = q.shape[0], q.shape[1], k.shape[1]
            self.total_q = self.total_k = 0
            self.lse_shape = (q.shape[0], q.shape[2], q.shape[1])
        self.H, self.HK, self.D = q.shape[-2], k.shape[-2], D
        # Value checks (cu_seqlens): always on CPU; on GPUs only under the checking switch (a host sync).
        self.check_values = varlen and not traced and (q.device.type == "cpu" or check_values_on())
        self.use_kernel = use_kernels(q.device, q.dtype, max(D, self.DV), self.return_probs)
        if traced:
            self.use_kernel = self.use_kernel and traceable_kernels()
        if not self.use_kernel and q.device.type != "cpu" and not traced:
            _warn_reference_on_gpu(q)
        self.stream = stream_getter(q.device)
        self._fwd: dict = {}
        self._bwd: dict = {}
        self.grads_direct = False  # backward(grads=) writes into them (set by _plan_kernels)
        self.ws = None  # the Gluon forward's launcher when it takes this signature (set by _plan_kernels)
        self.ws_bwd = None  # the Gluon backward's tile when it takes this signature (set by _plan_kernels)
        if self.use_kernel:
            self._plan_kernels(q, k, v, alibi, traced)

    # ------------------------------------------------------------------------------------ geometry
    def _bsh(self, t) -> tuple:
        """``(batch, row, head)`` element strides of ``t`` as the kernels read it (a copy when its head
        dim is not unit-stride); dims of size 1 get stride 0 (never stepped over)."""
        shape = t.shape
        st = _contiguous_strides(shape) if _needs_copy(t) else t.stride()
        if self.varlen:
            return (0, 0 if shape[0] == 1 else st[0], 0 if shape[1] == 1 else st[1])
        return tuple(0 if shape[i] == 1 else st[i] for i in range(3))

    def _out_bsh(self, shape) -> tuple:
        st = _contiguous_strides(shape)
        if self.varlen:
            return (0, 0 if shape[0] == 1 else st[0], 0 if shape[1] == 1 else st[1])
        return tuple(0 if shape[i] == 1 else st[i] for i in range(3))

    def _plan_kernels(self, q, k, v, alibi, traced: bool) -> None:
        on_gpu = q.device.type == "cuda"
        self.copy = (_needs_copy(q), _needs_copy(k), _needs_copy(v))
        self.fix_inputs = any(self.copy) or self.alibi_fix or self.cu_fix
        self.grads_direct = not (any(self.copy) or self.qv)
        # Outputs shaped and typed like a contiguous input come from empty_like (cheaper on the host).
        self.q_like = q.is_contiguous() or self.copy[0]
        self.o_like = self.q_like and not self.split_v and not self.fp8
        self.k_like = k.is_contiguous() or self.copy[1]
        self.v_like = v.is_contiguous() or self.copy[2]
        self.qs, self.ks, self.vs = self._bsh(q), self._bsh(k), self._bsh(v)
        if self.paged_strides is not None:
            self.ks, self.vs = self.paged_strides
        # FP8 V as a transposed copy (forward only: FP8 has no backward; not for KV caches, whose copy would
        # cost a pass over the cache per call)
        self.v_t = (self.fp8 and TUNING["fp8_v_t"] and self.k_range == 0 and not self.qv
                    and self.paged_strides is None)
        if self.v_t:
            S_, H_, D_ = v.shape[-3:]
            self.vs = (0, S_, D_ * S_) if self.varlen else (H_ * D_ * S_, S_, D_ * S_)
        # (split-KV: the kernel writes contiguous partials, and only the merge writes out_strides' layout)
        self.os = (self._out_bsh(self.o_shape) if self.out_strides is None or self.n_splits > 1
                   else tuple(0 if self.o_shape[i] == 1 else self.out_strides[i] for i in range(3)))
        self.dks, self.dvs = self._out_bsh(k.shape), self._out_bsh(v.shape)
        lse_st = _contiguous_strides(self.lse_shape)
        self.slb, self.slh = (0, lse_st[0]) if self.varlen else (lse_st[0], lse_st[1])
        self.block_d = max(16, next_pow2(self.D))
        self.block_dv = max(16, next_pow2(self.DV))
        self.block_w = max(self.block_d, self.block_dv)  # the tile configs go by the wider of the two
        self.on_gpu = on_gpu
        self.stride_ab = (self.H if self.alibi_2d else 0)
        # SQ, SK (the lengths, or the max lengths of varlen), the dropout counters' row strides (the same),
        # and the packed totals (varlen).
        self.sizes = (self.sq, self.sk, self.sq, self.sk, self.total_q,
                      self.n_pages if self.page else self.total_k)  # TK: total keys (varlen) or pages
        self.scal = (self.scale * LOG2E_F, self.softcap if self.softcap > 0 else 1.0, self.dropout_p,
                     max(self.left, 0), max(self.right, 0))
        self.flags = dict(
            DOT_PREC="ieee" if q.dtype == _F32 else "tf32",
            UPCAST=q.device.type == "cpu" and (q.dtype == torch.bfloat16 or (2 if self.fp8 else False)),
            EVEN_D=self.D == self.block_d,
            SOFTCAP=self.softcap > 0.0, ALIBI=self.has_alibi, DROPOUT=self.has_dropout,
            HAS_LEFT=self.left >= 0, HAS_RIGHT=self.right >= 0, VARLEN=self.varlen,
            DV=self.DV if self.split_v else 0, BLOCK_DV=self.block_dv, EVEN_DV=self.DV == self.block_dv,
            CHUNK=self.chunk, QV=self.qv,
        )
        decode = self.kind == "kvcache" and self.sq <= SPLIT_MAX_SEQLEN_Q
        # a paged cache read with one page-table load per key block (TUNING["paged_block"]: pages a multiple of the
        # key block, keys from 0) takes the "decode_paged" tile
        paged_block = (paged_block_tile(self.page, self.k_range, self.block_w, on_gpu, q.dtype) if decode
                       else self.page and self.k_range == 1 and TUNING["paged_block"])
        tiles = (("decode_split" if self.n_splits > 1 and not self.page else "decode_paged" if paged_block
                  else "decode") if decode else "fwd_fp8" if self.fp8 else "fwd")
        bm, bn, warps, stages = _blocks(tiles, self.block_w, on_gpu, q.dtype)
        su = _stride_unit(self.qs + self.ks + self.vs + self.os)
        self.num_m = cdiv(self.sq, bm)
        self.fwd_grid = ((self.num_m * self.B * self.H, self.n_splits) if self.n_splits > 1
                         else (self.num_m * self.B * self.H,))
        self.fwd_cfg = (bm, bn, warps, stages, su)
        # Split-KV decoding merged in the split kernel (TUNING["fused_merge"]): its final output's strides (the
        # partials are contiguous), the merge's rows (a power of two >= the rows of one program) and the chunk of
        # splits it loads at once (about 64 fp32 values a thread).
        self.fused = self.n_splits > 1 and decode and TUNING["fused_merge"]
        self.fs = (self._out_bsh(self.o_shape) if self.out_strides is None
                   else tuple(0 if self.o_shape[i] == 1 else self.out_strides[i] for i in range(3)))
        self.merge_m = next_pow2(min(self.sq, bm))
        self.merge_s = merge_chunk(self.sq, bm, warps, self.block_dv)
        self.page_block = bool(paged_block and self.page % bn == 0)
        self.fwd_ints = (*(s // su for s in self.qs + self.ks + self.vs + self.os), self.slb, self.slh, self.stride_ab,
                         self.H, self.H // self.HK, *self.sizes, self.D, self.num_m, self.k_add, *self.scal,
                         *self.fs, None, None, None)  # (sfb, sfs, sfh, out, lse out, counters): the fused merge's
        self.fused_ints = self.fwd_ints[:-3]  # the fused merge's launch passes its out, lse and counters after these
        self._ctrs: dict = {}  # the fused merge's counters per stream (_counters)
        # TMA descriptors need 16-byte aligned row strides and a Hopper-class GPU (or the interpreter).
        es = q.element_size()
        # FP8 through TMA only on GPU tiles of 3+ stages: ptxas crashed (-11) on every 2-stage TMA variant swept
        # (bench/notes/attention.md v7); the d256 FP8 tile has 2 and keeps the pointer loads.
        fp8_tma = TUNING["fp8_tma"] and (not on_gpu or self.fwd_cfg[3] >= 3)
        self.tma = ((fp8_tma if self.v_t else TUNING["tma"] and not self.fp8) and not traced
                    and not self.varlen and not any(self.copy[1:]) and not self.split_v and self.n_splits == 1
                    and not self.page
                    and all((s * es) % 16 == 0 for s in self.ks + self.vs)
                    and (not on_gpu or nvidia_hopper(q.device)))
        self.fwd_empty = self.fwd_grid[0] == 0
        if self.n_splits > 1:  # the split workspace: o_part (n, B, sq, H, DV) | l_part (n, B, H, sq) | lse
            n_o, n_l = self.n_splits * self.o_shape.numel(), self.n_splits * self.B * self.H * self.sq
            self.split_l = round_multiple(n_o, 4)  # 16-byte aligned starts (the kernels assume aligned pointers)
            self.split_s = self.split_l + round_multiple(n_l, 4)
            self.split_ws = self.split_s + self.B * self.H * self.sq
        # Pointers besides q/k/v whose alignment the direct launch must check per call.
        self.extra_ptrs = self.has_alibi or self.varlen or self.k_range > 0 or self.descale or self.qv
        self.atomic_ok = (TUNING["atomic_dq"] or TUNING["tma_dq"]) and not self.deterministic and not self.qv
        # dQ's fp32 buffer (B, sq, h, d) / (total, h, d) is contiguous: its rows (and each head's start) are
        # 16-byte aligned when d % 4 == 0; TMA boxes span at most 256 elements per dim.
        self.tma_dq = (self.atomic_ok and TUNING["tma_dq"] and not traced and self.D % 4 == 0
                       and self.block_d <= 256 and tma_reduce_available(q.device))
        # The warp-specialized Gluon forward (launch_ws): plain dense softmax attention on Hopper, causal or not;
        # FP8 (with its descales) through the transposed V copy when launch_ws.WS_TUNING["fp8"] is on.
        ws_fp8 = self.fp8 and launch_ws.WS_TUNING["fp8"] and self.v_t and not self.varlen
        extras = (traced or self.kind != "dense" or self.has_dropout or self.softcap > 0.0 or self.has_alibi
                  or self.qv or (self.fp8 and not ws_fp8) or self.split_v or self.chunk or self.k_range
                  or self.k_add or self.n_splits > 1 or self.page or self.out_strides is not None
                  or (self.descale and not ws_fp8) or self.left >= 0
                  or (self.window_size[1] >= 0 and not self.causal))
        hopper = on_gpu and nvidia_hopper(q.device)
        # the tensors' own row strides: the TMA views step rows by them (the kernels' stride tuples hold 0 for a
        # dim of size 1, and a (B, 1, h, d) view's rows are its batches)
        self.ws_rows = (q.stride(1), k.stride(1), v.stride(1))
        tile = launch_ws.ws_config(q, k, v, causal=self.causal, extras=extras, on_gpu=on_gpu, hopper=hopper)
        if tile is not None:
            # (FP8 reads V's transposed copy (B, hk, d, sk): its rows are sk apart)
            rows = (*self.ws_rows[:2], k.shape[1]) if self.fp8 else self.ws_rows
            self.ws = launch_ws.WsForward(q.shape, k.shape, q.dtype, q.device, self.causal, tile,
                                          self.scale * LOG2E_F, rows, descale=self.descale)
        # The Gluon backward adds dQ with atomics: only where deterministic results were not asked for (the
        # flash_attn argument here, torch's / culmen's switch per call).
        if not self.deterministic:
            self.ws_bwd = launch_ws.ws_bwd_config(q, k, v, causal=self.causal, extras=extras, on_gpu=on_gpu,
                                                  hopper=hopper)

    def fwd_launch(self, store_lse: bool, tma: bool = False) -> Launch:
        """The forward's ``Launch`` (built on first use)."""
        key = (store_lse, True) if tma else store_lse
        la = self._fwd.get(key)
        if la is None:
            bm, bn, warps, stages, su = self.fwd_cfg
            meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=self.block_d, **self.flags, HEAVY_FIRST=self.flags["HAS_RIGHT"],
                        USE_TMA=tma, K_RANGE=self.k_range, STORE_LSE=store_lse, SU=su, DESCALE=self.descale,
                        SPLIT=self.n_splits > 1, PAGE=self.page, V_T=self.v_t,
                        EXP16=self.fp8 and self.on_gpu and TUNING["fp8_exp16"],
                        OVERLAP=(TUNING["fp8_overlap"] and tma if self.v_t else TUNING["fwd_overlap"]) and not self.qv,
                        PAGE_BLOCK=self.page_block, MERGE=0, MERGE_M=1, MERGE_S=1)
            la = self._fwd[key] = Launch(_attn_fwd_kernel, self.fwd_grid, meta, warps, stages, device=self.device)
        return la

    def fused_launch(self, store_lse: bool) -> Launch:
        """The split kernel that merges its splits itself (``fused``): writes ``out`` and, when ``store_lse``, the
        final lse (built on first use)."""
        key = ("fused", store_lse)
        la = self._fwd.get(key)
        if la is None:
            base = self.fwd_launch(True)
            meta = dict(base.meta, MERGE=2 if store_lse else 1, MERGE_M=self.merge_m, MERGE_S=self.merge_s)
            la = self._fwd[key] = Launch(_attn_fwd_kernel, self.fwd_grid, meta, base.num_warps, base.num_stages,
                                         device=self.device)
        return la

    # ------------------------------------------------------------------------------------- forward
    def _kernel_inputs(self, q, k, v, alibi, cu_q, cu_k):
        """The inputs in the layouts the plan's kernels address (copies only where the plan found them
        needed: a non-unit head-dim stride, ALiBi slopes or cu_seqlens in another dtype/device/layout)."""
        cq, ck, cv = self.copy
        if cq:
            q = q.contiguous()
        if ck:
            k = k.contiguous()
        if cv:
            v = v.contiguous()
        if self.alibi_fix:
            alibi = alibi.to(device=self.device, dtype=_F32).contiguous()
        if self.cu_fix:
            cu_q = cu_q.to(self.device).contiguous()
            cu_k = cu_k.to(self.device).contiguous()
        return q, k, v, alibi, cu_q, cu_k

    def forward(self, q, k, v, alibi, rng, cu_q=None, cu_k=None, store_lse: bool = True, k_start=None, k_end=None,
                traced: bool = False, aligned: bool | None = None, descales=None, qv=None, table=None):
        """``(out, lse, probs)``: ``out`` like ``q`` (head dim ``DV``; bf16 for float8 inputs); ``lse`` fp32
        ``(B, h, sq)`` / ``(h, total_q)`` or ``None`` when not ``store_lse`` (the reference always gives it);
        ``probs`` only with ``return_probs`` (``(B, h, round128(sq), round128(sk))``, else ``None``).
        ``aligned``: the caller's finding that every pointer given is 16-byte aligned (else it is checked
        here). ``descales``: ``(q_descale, k_descale, v_descale)``, contiguous fp32 ``(B, hk)`` (the plan's
        ``descale``), else ``None``. ``qv``: FA3's extra query ``(.., h, DV)`` when the plan has ``qv``.
        ``table``: the clamped contiguous int32 page table when the plan reads a paged cache directly."""
        if self.check_values:
            self.check_cu(q, k, cu_q, cu_k)
        if not self.use_kernel:
            return self._forward_ref(q, k, v, alibi, rng, cu_q, cu_k, k_start, k_end, descales, qv)
        if self.fix_inputs:
            q, k, v, alibi, cu_q, cu_k = self._kernel_inputs(q, k, v, alibi, cu_q, cu_k)
        if qv is not None:
            qv = qv.contiguous()  # read with out's strides
        if self.v_t:
            v = _transposed_v(v, self.varlen)
        qd, kd, vd = _NO_DESCALE if descales is None else descales
        if self.n_splits > 1 and not traced and not self.fwd_empty:  # allocates its own outputs
            return self._forward_split(q, k, v, alibi, k_start, k_end, qd, kd, vd, qv, table, store_lse, aligned)
        out = (torch.empty_like(q) if self.o_like
               else torch.empty(self.o_shape, dtype=self.out_dtype, device=self.device) if self.out_strides is None
               else self._new_out())
        lse = torch.empty(self.lse_shape, dtype=_F32, device=self.device) if store_lse else None
        if self.fwd_empty:  # no query block to run (a varlen batch of empty sequences)
            out.zero_()
            if lse is not None:
                lse.fill_(float("inf"))
            return out, lse, None
        if traced:
            self.fwd_launch(store_lse).traced(q, k, v, out, lse, alibi, rng, cu_q, cu_k, k_start, k_end, qd, kd, vd,
                                              qv, table, *self.fwd_ints)
            return out, lse, None
        if aligned is None:
            if self.extra_ptrs:
                aligned = _aligned(q, k, v, alibi, cu_q, cu_k, k_start, k_end, qd, kd, vd, qv)
            else:
                aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15 == 0
        if self.ws is not None and aligned:
            ensure_allocator(self.device)  # the kernel builds its TMA descriptors on the device
            # (it always writes lse: a scratch one when the caller did not ask for it)
            self.ws(self.stream(), q, k, v, out,
                    lse if lse is not None else torch.empty(self.lse_shape, dtype=_F32, device=self.device),
                    qd, kd, vd)
            return out, lse, None
        if self.tma and aligned:
            ensure_allocator(self.device)
            la = self.fwd_launch(store_lse, True)
        else:
            la = self._fwd.get(store_lse) or self.fwd_launch(store_lse)
        la(self.stream(), aligned, q, k, v, out, lse, alibi, rng, cu_q, cu_k, k_start, k_end, qd, kd, vd, qv, table,
           *self.fwd_ints)
        return out, lse, None

    def _forward_split(self, q, k, v, alibi, k_start, k_end, qd, kd, vd, qv, table, store_lse, aligned):
        """Split-KV (flash-decoding): one launch of ``n_splits`` programs per query block, each writing its
        split's fp32 partial output and lse, merged by the combine kernel, or (``fused``) by the last of a row
        block's split programs to finish, in the same launch. Fixed shapes, no host sync (CUDA graphs capture it).

        The fused merge counts finished splits in an int32 counter per row block (``_counters``), which the merging
        program puts back to 0: the counters are 0 between launches, so they are zeroed once (when allocated) and
        reused by every later call on the same stream (no memset per call). The rules that keeps: calls on one
        stream are ordered, and each stream has its own counters (a plan used on two streams at once is safe). A
        CUDA graph captured on a stream with no counters yet gets counters of its own for that call, allocated in
        the graph's memory pool like the call's other buffers, their zeroing captured and replayed with it (one
        small memset node); a graph captured on a stream that has counters (eager calls of this plan ran on it
        before) replays on those, so it must not be replayed on another stream while eager calls of the plan run on
        the capture stream. A launch cut short would leave counts behind, but only a device fault cuts one short,
        and that ends the CUDA context and every tensor in it, the counters included; an error raised on the host
        before the launch (a value check) leaves them untouched."""
        dev = self.device
        # One fp32 workspace holds the partial outputs, their lse and (when the caller wants no lse) the merge's
        # lse: one allocation instead of three (each ~3 us of host time on the H100 machine, a slice ~1 us).
        ws = torch.empty(self.split_ws, dtype=_F32, device=dev)
        l_part = ws[self.split_l:]
        if aligned is None:
            aligned = _aligned(q, k, v, alibi, k_start, k_end, qd, kd, vd, qv, table)
        stream = self.stream()
        if self.fused:
            out = self._new_out()
            lse = torch.empty(self.lse_shape, dtype=_F32, device=dev) if store_lse else None
            la = self._fwd.get(("fused", store_lse)) or self.fused_launch(store_lse)
            ctr = self._ctrs.get(stream)
            if ctr is None:
                ctr = self._counters(stream)
            la(stream, aligned, q, k, v, ws, l_part, alibi, None, None, None, k_start, k_end, qd, kd, vd, qv, table,
               *self.fused_ints, out, lse, ctr)
            return out, lse, None
        la = self._fwd.get(True) or self.fwd_launch(True)
        la(stream, aligned, q, k, v, ws, l_part, alibi, None, None, None, k_start, k_end, qd, kd, vd, qv,
           table, *self.fwd_ints)
        out = self._new_out()
        lse = torch.empty(self.lse_shape, dtype=_F32, device=dev) if store_lse else ws[self.split_s:]
        # the merge's planned launch (flash_attn_combine re-checks and re-binds every call: ~65 us of host time)
        comb = self._fwd.get("combine") or self._combine_launch()
        comb(stream, True, ws, l_part, out, lse, *self.combine_ints)
        return out, (lse if store_lse else None), None

    def _counters(self, stream) -> Tensor:
        """Zeroed int32 counters of the fused merge, one per row block, cached for ``stream`` (see
        ``_forward_split``); inside a CUDA graph capture on a stream without them, fresh ones for this call (their
        zeroing is captured and replayed with the graph), and past 16 streams fresh ones every call."""
        ctr = torch.zeros(self.fwd_grid[0], dtype=torch.int32, device=self.device)
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing and len(self._ctrs) < 16:
            self._ctrs[stream] = ctr
        return ctr

    def _new_out(self) -> Tensor:
        if self.out_strides is None:
            return torch.empty(self.o_shape, dtype=self.out_dtype, device=self.device)
        if self.out_alloc is not None:  # the caller's shape, whose memory is out_strides' layout (no view made)
            return torch.empty(self.out_alloc, dtype=self.out_dtype, device=self.device)
        return torch.empty_strided(self.o_shape, self.out_strides, dtype=self.out_dtype, device=self.device)

    def _combine_launch(self) -> Launch:
        """The split merge's ``Launch`` over this plan's fixed partial buffers: ``o_part (n, B, sq, H, DV)`` and
        ``l_part (n, B, H, sq)`` contiguous, ``out (B, sq, H, DV)``, ``lse (B, H, sq)``; rows with no key get
        lse ``+inf`` (culmen's convention)."""
        n, (B, S, H, DV) = self.n_splits, self.o_shape
        rows = B * S * H
        o_st = (B * S * H * DV, S * H * DV, H * DV, DV, 1)
        l_st = (B * H * S, H * S, 1, S)  # l_part read as (n, B, sq, H)
        out_st = self.out_strides or (S * H * DV, H * DV, DV, 1)
        if TUNING["combine_rows"]:
            bs, chunk, bd, warps = combine_rows_blocks(n, DV)
            self.combine_ints = (S, H, DV, n, *o_st, *l_st, *out_st, H * S, 1, S)
            la = Launch(_combine_rows_kernel, (rows, cdiv(DV, bd)),
                        dict(BLOCK_SPLIT=bs, CHUNK=chunk, BLOCK_D=bd, EMPTY_LSE=float("inf")), warps, 1,
                        device=self.device)
        else:
            bm, bd, bs = combine_blocks(n, DV)
            self.combine_ints = (rows, S, H, DV, n, *o_st, *l_st, *out_st, H * S, 1, S)
            la = Launch(_combine_kernel, (cdiv(rows, bm), cdiv(DV, bd)),
                        dict(BLOCK_M=bm, BLOCK_D=bd, BLOCK_SPLIT=bs, EMPTY_LSE=float("inf")), 4, 3, device=self.device)
        self._fwd["combine"] = la
        return la

    def check_cu(self, q, k, cu_q, cu_k) -> None:
        """Value checks of ``cu_seqlens`` (see ``checks.check_cu_values``)."""
        checks.check_cu_values("cu_seqlens_q", cu_q, q.shape[0], self.sq, "max_seqlen_q")
        checks.check_cu_values("cu_seqlens_k", cu_k, k.shape[0], self.sk, "max_seqlen_k")

    def _ref_kw(self, alibi, rng) -> dict:
        kw = dict(softmax_scale=self.scale, causal=self.causal, window_size=self.window_size, softcap=self.softcap,
                  alibi_slopes=alibi, dropout_p=self.dropout_p, rng_state=rng if self.has_dropout else None)
        if self.chunk:
            kw["attention_chunk"] = self.chunk
        return kw

    def _forward_ref(self, q, k, v, alibi, rng, cu_q, cu_k, k_start, k_end, descales=None, qv=None):
        """The plan's forward on the PyTorch reference (CPU, fp64, return_probs, ``set_kernels_on_gpu``);
        float8 inputs are dequantized to fp32 first (times their descales) and give bf16. ``qv``: the scores
        ``q . k + qv . v`` are those of ``[q, qv] . [k, v]`` (the scale is explicit, so nothing else changes)."""
        if qv is not None:
            q, k = torch.cat([q, qv.to(q.dtype)], -1), torch.cat([k, v], -1)
        if self.fp8 and q.dtype in checks.FP8:
            q, k, v = dequantize_fp8(q, k, v, descales, cu_q, cu_k)
            out, lse, probs = self._forward_ref(q, k, v, alibi, rng, cu_q, cu_k, k_start, k_end)
            return out.to(self.out_dtype), lse, probs
        if self.k_range:
            kw = self._ref_kw(alibi, None)
            del kw["dropout_p"], kw["rng_state"]
            if self.k_add:
                k_end = k_end + self.k_add
            # A cache may hold more rows than the batch (the first B are attended).
            out, lse = attention_range_fwd_ref(q, k[:self.B], v[:self.B], k_start, k_end, **kw)
            return out, lse, None
        if self.varlen:
            out, lse, probs = attention_varlen_fwd_ref(q, k, v, cu_q, cu_k, self.sq, self.sk,
                                                       return_probs=self.return_probs, **self._ref_kw(alibi, rng))
        else:
            out, lse, probs = attention_fwd_ref(q, k, v, return_probs=self.return_probs, **self._ref_kw(alibi, rng))
        if probs is not None:
            sq, sk = probs.shape[-2:]
            probs = torch.nn.functional.pad(probs, (0, round_multiple(sk, 128) - sk, 0, round_multiple(sq, 128) - sq))
        return out, lse, probs

    # ------------------------------------------------------------------------------------ backward
    def _plan_bwd(self, dout, into_inputs: bool = False) -> _BwdPlan:
        """``into_inputs``: dQ, dK, dV are written with q's, k's and v's own strides (``backward(grads=)``;
        the deterministic kernels only: the atomic dQ accumulator is a contiguous buffer)."""
        b = _BwdPlan()
        b.copy_do = _needs_copy(dout)
        dos = self._bsh(dout)
        if self.qv:  # qv and dqv are read / written with dout's strides: all three contiguous
            b.copy_do = b.copy_do or not dout.is_contiguous()
            dos = self._out_bsh(self.o_shape)
        dqs = self.qs if into_inputs else self._out_bsh(self.q_shape)  # else dq is allocated contiguous
        dks, dvs = (self.ks, self.vs) if into_inputs else (self.dks, self.dvs)
        su = _stride_unit(self.qs + self.ks + self.vs + self.os + dos + dqs + dks + dvs)
        u = (lambda st: tuple(s // su for s in st))
        dev, H, B, gpu, dt, bd = self.device, self.H, self.B, self.on_gpu, self.dtype, self.block_d
        pbm = TUNING["pre_block_m"] if gpu else TUNING["interp_block"]
        num_pm = cdiv(self.sq, pbm)
        b.pre = Launch(_attn_bwd_preprocess_kernel, (num_pm * B * H,),
                       dict(BLOCK_M=pbm, BLOCK_D=self.block_dv, VARLEN=self.varlen, SU=su), 4, 1, device=dev)
        b.pre_ints = (*u(self.os), *u(dos), self.slb, self.slh, H, self.sq, self.total_q, self.DV, num_pm)
        common = (self.slb, self.slh, self.stride_ab)
        qkvd = (*u(self.qs), *u(self.ks), *u(self.vs), *u(dos))
        b.dkdv, b.dkdv_ints = {}, {}
        for atomic in ((False, True) if self.atomic_ok and not into_inputs else (False,)):
            tma = atomic and self.tma_dq
            kind = "dkdv_tma" if tma else "dkdv_atomic" if atomic else "dkdv"
            bm, bn, warps, stages = _blocks(kind, self.block_w, gpu, dt)
            num_n = cdiv(self.sk, bn)
            b.dkdv[atomic] = Launch(_attn_bwd_dkdv_kernel, (num_n * B * self.HK,),
                                    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, **self.flags, ATOMIC_DQ=atomic, SU=su,
                                         TMA_DQ=tma),
                                    warps, stages, device=dev, options=_bwd_options(kind, self.block_w, gpu, dt))
            b.dkdv_ints[atomic] = (*qkvd, *u(dks), *u(dvs), *u(dqs), *common, H, self.HK, H // self.HK,
                                   *self.sizes, self.D, num_n, *self.scal)
        bm, bn, warps, stages = _blocks("dq", self.block_w, gpu, dt)
        num_m = cdiv(self.sq, bm)
        b.dq = Launch(_attn_bwd_dq_kernel, (num_m * B * H,),
                      dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, **self.flags, HEAVY_FIRST=self.flags["HAS_RIGHT"],
                           SU=su), warps, stages, device=dev, options=_bwd_options("dq", self.block_w, gpu, dt))
        b.dq_ints = (*qkvd, *u(dqs), *common, H, H // self.HK, *self.sizes, self.D, num_m, *self.scal)
        b.ws = None
        do_read = dout.contiguous() if b.copy_do else dout  # what the kernels will read
        if self.ws_bwd is not None and launch_ws.ws_layout_ok(do_read):
            b.ws = launch_ws.WsBackward(self.q_shape, self.k_shape, self.dtype, dev, self.causal, self.ws_bwd,
                                        self.scale, (*self.ws_rows, do_read.stride(1)),
                                        (self.slb, self.slh))
        return b

    def backward(self, dout, q, k, v, out, lse, alibi, rng, cu_q=None, cu_k=None, traced: bool = False, qv=None,
                 grads=None):
        """Gradients ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v`` (dK/dV per KV head), and ``dqv`` after them
        when the plan has ``qv``. ``dout`` may have any strides; ``out``/``lse`` are this plan's forward outputs.
        ``grads``: ``(dq, dk, dv)`` to write (and return), each with the shape, strides and dtype of its input
        (e.g. views of one packed gradient when q, k, v are views of one packed projection), so no copy gathers
        them afterwards. Checked when the kernels are planned (the first call with ``grads`` and these dout
        strides): a caller passes the same layout on every call."""
        if grads is not None and (traced or not self.grads_direct or self.atomic_ok and not deterministic_enabled()):
            for dst, src in zip(grads, self.backward(dout, q, k, v, out, lse, alibi, rng, cu_q, cu_k, traced)):
                dst.copy_(src)
            return grads
        if self.qv and not self.use_kernel:
            return self._backward_ref_qv(dout, q, k, v, out, lse, qv, cu_q, cu_k)
        if not self.use_kernel:
            kw = self._ref_kw(alibi, rng)
            if self.varlen:
                return attention_varlen_bwd_ref(dout, q, k, v, out, lse, cu_q, cu_k, self.sq, self.sk, **kw)
            return attention_bwd_ref(dout, q, k, v, out, lse, **kw)
        key = dout.stride() if grads is None else (dout.stride(), True)
        b = None if traced else self._bwd.get(key)
        if b is None:
            if grads is not None and any(g.shape != t.shape or g.stride() != t.stride() or g.dtype != t.dtype
                                         for g, t in zip(grads, (q, k, v))):
                raise ValueError("grads must have the shapes, strides and dtypes of q, k and v (the kernels are "
                                 f"planned for them), got {[(tuple(g.shape), g.stride(), g.dtype) for g in grads]}")
            b = self._plan_bwd(dout, grads is not None)
            if not traced:
                self._bwd[key] = b
        if b.copy_do:
            dout = dout.contiguous()
        if self.fix_inputs:
            q, k, v, alibi, cu_q, cu_k = self._kernel_inputs(q, k, v, alibi, cu_q, cu_k)
        dev = self.device
        if grads is not None:
            dq, dk, dv = grads
        else:
            dq = torch.empty_like(q) if self.q_like else torch.empty(self.q_shape, dtype=self.dtype, device=dev)
            dk = torch.empty_like(k) if self.k_like else torch.empty(self.k_shape, dtype=self.dtype, device=dev)
            dv = torch.empty_like(v) if self.v_like else torch.empty(self.v_shape, dtype=self.dtype, device=dev)
        delta = torch.empty(self.lse_shape, dtype=_F32, device=dev)
        dqv = None
        if self.qv:
            qv = qv.contiguous()
            dqv = torch.empty(self.o_shape, dtype=self.dtype, device=dev)
        # Per call: torch.use_deterministic_algorithms / culmen.set_deterministic may change any time.
        atomic = self.atomic_ok and not deterministic_enabled()  # False with grads (handled above)
        dq_acc = torch.zeros(self.q_shape, dtype=_F32, device=dev) if atomic else dq
        stream = None if traced else self.stream()
        if atomic and self.tma_dq:
            ensure_allocator(dev)  # per call: autograd may run this backward in another thread
        if traced:
            ok = True
        elif self.extra_ptrs:
            ok = _aligned(q, k, v, dout, alibi, cu_q, cu_k, qv, dqv)
        else:
            ok = (q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr()) & 15 == 0
        if grads is not None and not traced:
            ok = ok and (dq.data_ptr() | dk.data_ptr() | dv.data_ptr()) & 15 == 0
        if b.ws is not None and ok and not traced and not deterministic_enabled():
            ensure_allocator(dev)  # the kernel builds its TMA descriptors on the device
            b.pre(stream, ok, out, dout, delta, cu_q, *b.pre_ints)
            b.ws(stream, q, k, v, dout, lse, delta, dq, dk, dv)
            return dq, dk, dv
        launches = ((b.pre, (out, dout, delta, cu_q, *b.pre_ints), ()),
                    (b.dkdv[atomic], (q, k, v, dout, lse, delta, dk, dv, dq_acc, alibi, rng, cu_q, cu_k, qv,
                                      *b.dkdv_ints[atomic]), (dk, dv)))
        if not atomic:
            launches += ((b.dq, (q, k, v, dout, lse, delta, dq, alibi, rng, cu_q, cu_k, qv, dqv, *b.dq_ints),
                          (dq,) if dqv is None else (dq, dqv)),)
        for la, args, outs in launches:
            if la.grid[0] == 0:  # nothing to run: what it would write is all zeros (no keys / no queries)
                for t in outs:
                    t.zero_()
            elif traced:
                la.traced(*args)
            else:
                la(stream, ok, *args)
        if atomic:
            dq.copy_(dq_acc)
        if self.qv:
            return dq, dk, dv, dqv
        return dq, dk, dv

    def _backward_ref_qv(self, dout, q, k, v, out, lse, qv, cu_q, cu_k):
        """The reference backward with ``qv``: that of ``[q, qv] . [k, v]`` attention over ``v``, the gradient of
        the concatenated key's tail added to dV."""
        d = q.shape[-1]
        q2, k2 = torch.cat([q, qv.to(q.dtype)], -1), torch.cat([k, v], -1)
        kw = self._ref_kw(None, None)
        if self.varlen:
            dq2, dk2, dv = attention_varlen_bwd_ref(dout, q2, k2, v, out, lse, cu_q, cu_k, self.sq, self.sk, **kw)
        else:
            dq2, dk2, dv = attention_bwd_ref(dout, q2, k2, v, out, lse, **kw)
        return (dq2[..., :d].contiguous(), dk2[..., :d].contiguous(), (dv + dk2[..., d:]).to(v.dtype),
                dq2[..., d:].to(qv.dtype).contiguous())


_NO_DESCALE = (None, None, None)


def _transposed_v(v: Tensor, varlen: bool) -> Tensor:
    """``v`` ``(B, S, hk, d)`` / ``(T, hk, d)`` copied into ``(B, hk, d, S)`` / ``(hk, d, T)`` memory (the
    plan's ``v_t`` strides)."""
    if varlen:
        B, (S, H, D) = 1, v.shape
        sb, (ss, sh, sd) = 0, v.stride()
        out = torch.empty((H, D, S), dtype=v.dtype, device=v.device)
    else:
        B, S, H, D = v.shape
        sb, ss, sh, sd = v.stride()
        out = torch.empty((B, H, D, S), dtype=v.dtype, device=v.device)
    kernel = v.device.type == "cuda" or interpreter_enabled()
    if not kernel or sd != 1 or D & (D - 1) or not 16 <= D <= 256 or out.numel() == 0:
        return out.copy_(v.permute(1, 2, 0) if varlen else v.permute(0, 2, 3, 1))
    block = 64 if D <= 128 else 32
    key = (cdiv(S, block) * B * H, D, v.device)
    la = _TRANSPOSE_LAUNCHES.get(key)
    if la is None:
        la = _TRANSPOSE_LAUNCHES.put(key, Launch(_transpose_rows_kernel, key[:1], dict(D=D, BLOCK_S=block), 4, 1,
                                                 device=v.device))
    stream = torch.cuda.current_stream(v.device).cuda_stream if v.device.type == "cuda" else None
    la(stream, _aligned(v), v, out, S, H, sb, ss, sh)
    return out


# (varlen batches bring a new length each call: bounded like the plans)
_TRANSPOSE_LAUNCHES = PlanCache("attention_v_transpose", maxsize=64)


class _BwdPlan:
    __slots__ = ("copy_do", "pre", "pre_ints", "dkdv", "dkdv_ints", "dq", "dq_ints", "ws")


def _as_int(n):
    """``n`` as an int, or as it is when symbolic (``torch.compile(dynamic=True)``: no specialization)."""
    return n if isinstance(n, torch.SymInt) else int(n)


def _needs_copy(t) -> bool:
    """Whether the kernels must read a contiguous copy of ``t`` (its head dim is not unit-stride)."""
    return t.shape[-1] != 1 and t.stride(-1) != 1


_WARNED_NO_KERNEL = False


def _warn_reference_on_gpu(q) -> None:
    """Say once that a GPU call runs the PyTorch reference: correct, but slow and O(seqlen^2) memory."""
    import warnings

    global _WARNED_NO_KERNEL
    if not _WARNED_NO_KERNEL:
        _WARNED_NO_KERNEL = True
        warnings.warn(f"culmen.flash_attn: this call ({q.dtype}, head dim {q.shape[-1]}, or return_attn_probs, or "
                      "CULMEN_FLASH_TRITON=0) runs the PyTorch reference: correct, but slow and O(seqlen^2) memory",
                      RuntimeWarning, stacklevel=4)
