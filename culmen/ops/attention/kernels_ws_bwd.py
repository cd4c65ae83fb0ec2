"""Warp-specialized FlashAttention backward for Hopper, written in Gluon (the forward's companion,
``kernels_ws.py``).

Why: the Triton backward recomputes ``Q K^T`` and ``dO V^T`` in a second (dQ) kernel, 7 matmuls per tile
against FA2/FA3's 5, because every 5-matmul variant was slower while one warpgroup ran its GEMMs and softmax
back to back (``bench/notes/attention.md`` v3, v6, v8). Here a tile is a block of 128 keys of one (batch, KV
head); a one-warp TMA loader streams Q and dO blocks of 64 rows, of every query head of the group, into a
stage ring (with each block's ``lse * log2 e`` and delta in per-stage shared vectors), and each of two
consumer warpgroups, for its 64 keys, runs the scores transposed:

    S^T = K Q^T,  P^T = exp2(S^T * scale * log2 e - lse * log2 e)      (registers)
    dV += P^T dO                           (P^T as the register A operand)
    dP^T = V dO^T,  dS^T = P^T (dP^T - delta) * scale   (issued after the softmax: S^T, dP^T never both live)
    dK += dS^T Q                           (dS^T as the register A operand)
    dQ[:, half] = dS K[:, half]            (dS^T of both warpgroups, shared through shared memory)

and adds its half of the dQ columns into an fp32 accumulator with one TMA bulk reduce-add (Triton 3.6's
Gluon has the op without a wrapper: ``_tma_reduce_add_36``), FA3's layout (its hdim-128 tile is the same).
The dS^T buffer is double-buffered and guarded by one mbarrier per buffer that both warpgroups arrive on after
their store (a warpgroup that passed block ``i + 1``'s barrier knows the other finished block ``i - 1``'s
dQ, the buffer's last reader). Persistent: one program per SM walks work units; a causal unit pairs key
blocks ``n`` and ``num_n - 1 - n`` (even work per unit), and units run grouped by (batch, KV head) so the
ones in flight share a few heads' Q, dO and dQ accumulator in L2.

Measured (notes v11, v15): the untransposed form (``S = Q K^T``, P and dS through shared memory as the
operands of dV and dK) read 16 KB more shared memory per warpgroup and block at d128, near the bandwidth
limit, and spilled in its causal loop; the transposed form is 1-5% faster at d128 and 7-10% at d64 (s14,
H100 and H200) and replaced it. Before that: the look-ahead of the next block's S / dP, dV issued before dS
is computed, and dQ issued before dK gained nothing; the dQ reduce by element atomics from registers was
1.6x slower than TMA; a third Q/dO stage (it fits at d128 since P stays in registers) is slower than two.

Not deterministic (reduce order): the launcher takes this kernel only when deterministic algorithms are off.
Scope as the forward's (``launch_ws.ws_bwd_config``): dense bf16/fp16, ``D`` 64 or 128, no extras, causal
only with ``sq <= sk``. Memory safety: Q, dO, K, V are read through TMA descriptors over
``(B * s, heads * D)`` (zero past the end); query rows past ``sq`` (the next batch's) get ``lse = +inf`` so
their P and dS are 0, key rows past ``sk`` are masked to P = 0, dK/dV stores are masked to the sequence, and
the dQ accumulator has rows padded to the query block (padding rows receive zeros, the TMA clips the rest).
"""

from __future__ import annotations

from culmen.ops.attention.kernels_ws import AVAILABLE

if AVAILABLE:
    from triton._C.libtriton import ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from culmen.ops.attention.kernels_ws import _tma_load

    @builtin
    def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
        """``global[coord ..] += src`` by one TMA bulk reduce (Triton 3.6's Gluon has the op but no wrapper)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    _tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36
    # a barrier of the calling partition's threads: Triton 3.6 names it thread_barrier, later ones barrier
    _partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    @gluon.jit
    def _bwd_unit(u, NUM_N, B, HK, BH_GROUP, CAUSAL: gl.constexpr):
        """``(b, kv head, first key block, key blocks)`` of work unit ``u``: causal units pair key block ``p``
        with ``NUM_N - 1 - p`` (every unit sees about the same number of query blocks), others are one key
        block. Units run in groups of ``BH_GROUP`` (batch, KV head) pairs, so the units in flight share a few
        heads' Q, dO and dQ accumulator in L2 (with one key block per program and the heaviest first over all
        heads, every program read another head: a working set past L2, 10-50% slower)."""
        NU = NUM_N
        if CAUSAL:
            NU = (NUM_N + 1) // 2
        per_group = BH_GROUP * NU
        group = u // per_group
        size = gl.minimum(BH_GROUP, B * HK - group * BH_GROUP)
        idx = u - group * per_group
        p = idx // size
        bh = group * BH_GROUP + idx % size
        n_blocks = 1
        if CAUSAL:
            n_blocks = 2 - (2 * p + 1 == NUM_N)
        return bh // HK, bh % HK, p, n_blocks

    @gluon.jit
    def _bwd_block(pair, half, NUM_N, sq, sk, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr):
        """``(first key, first query block, query blocks per head)`` of the unit's key block ``half``."""
        n0 = (pair + half * (NUM_N - 1 - 2 * pair)) * BLOCK_N
        num_m = gl.cdiv(sq, BLOCK_M)
        m_lo = 0
        if CAUSAL:  # query row r sees key n when n <= r + sk - sq
            m_lo = gl.maximum(n0 - (sk - sq), 0) // BLOCK_M
        return n0, m_lo, num_m - m_lo

    @gluon.jit
    def _bwd_loader(args, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr):
        """Producer (one warp; its own subset of the kernel's values): per tile, K and V of its key block once
        the consumers released the last tile's, then Q and dO of every (head of the group, query block) into
        the stage ring (its counter runs on across tiles), with each block's ``lse * log2 e`` and delta into
        the stage's shared vectors (the transposed scores need 16 of each per consumer thread: read from shared
        memory at their use, they stay out of the registers) and a second arrival on ``q_ready``."""
        (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_ready, kv_empty, q_ready, do_ready,
         empty, B, HK, GROUP, BH_GROUP, sq, sk, NUM_N, n_units, lse_smem, delta_smem, lse_ptr, delta_ptr, slb,
         slh) = args
        BLOCK_N: gl.constexpr = k_smem.type.shape[0]
        D: gl.constexpr = k_smem.type.shape[1]
        NS: gl.constexpr = q_bufs.type.shape[0]
        BLOCK_M: gl.constexpr = q_bufs.type.shape[1]
        LOG2E: gl.constexpr = 1.4426950408889634
        it = 0
        tile_i = 0
        pid = gl.program_id(0)
        end = n_units if PERSISTENT else pid + 1
        for u in range(pid, end, gl.num_programs(0)):
            b, hk, pair, n_blocks = _bwd_unit(u, NUM_N, B, HK, BH_GROUP, CAUSAL)
            for half in range(n_blocks):
                n0, m_lo, cnt = _bwd_block(pair, half, NUM_N, sq, sk, CAUSAL, BLOCK_M, BLOCK_N)
                # barriers start with phase 1 complete, so the first tile's wait passes at once
                mbarrier.wait(kv_empty, (tile_i & 1) ^ 1)
                mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes)
                _tma_load(k_desc, [b * sk + n0, hk * D], kv_ready, k_smem)
                _tma_load(v_desc, [b * sk + n0, hk * D], kv_ready, v_smem)
                for j in range(GROUP * cnt):
                    h = hk * GROUP + j // cnt
                    m0 = (m_lo + j % cnt) * BLOCK_M
                    i = it + j
                    s = i % NS
                    mbarrier.wait(empty.index(s), ((i // NS) & 1) ^ 1)
                    qb = q_ready.index(s)
                    mbarrier.expect(qb, q_desc.block_type.nbytes)
                    _tma_load(q_desc, [b * sq + m0, h * D], qb, q_bufs.index(s))
                    db = do_ready.index(s)
                    mbarrier.expect(db, do_desc.block_type.nbytes)
                    _tma_load(do_desc, [b * sq + m0, h * D], db, do_bufs.index(s))
                    # rows past sq (the next batch's) get lse = +inf: P = dS = 0 there
                    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0]))
                    off = b.to(gl.int64) * slb + h * slh + rows
                    lse = gl.load(lse_ptr + off, mask=rows < sq, other=float("inf")) * LOG2E
                    lse_smem.index(s).store(lse)
                    delta_smem.index(s).store(gl.load(delta_ptr + off, mask=rows < sq, other=0.0))
                    # every lane's stores ordered before the one lane's (release) arrival
                    _partition_barrier()
                    mbarrier.arrive(qb, count=1)
                it += GROUP * cnt
                tile_i += 1

    @gluon.jit
    def _bwd_mask(s, m0, n_lo, sq, sk, CAUSAL: gl.constexpr):
        """``-inf`` where key ``n_lo + k`` is past ``sk`` or (causal) after query ``m0 + q``'s diagonal; ``s`` is
        ``(keys, queries)``."""
        rows = gl.arange(0, s.type.shape[0], layout=gl.SliceLayout(1, s.type.layout))
        cols = gl.arange(0, s.type.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        n = gl.expand_dims(n_lo + rows, 1)
        if CAUSAL:
            keep = (n < sk) & (n <= gl.expand_dims(m0 + cols + (sk - sq), 0))
        else:
            keep = (n < sk) & gl.expand_dims(cols >= 0, 0)
        return gl.where(keep, s, float("-inf"))

    @gluon.jit
    def _bwd_step(q_s, do_s, k_rows, v_rows, ds_s, k_dq, q_ready, do_ready, ds_ready, ph, ds_ph, dk, dv,
                     lse_s, delta_s, masked, m0, n_lo, sq, sk, qk_scale, sm_scale, WG: gl.constexpr,
                     CAUSAL: gl.constexpr, st_layout: gl.constexpr, a_layout: gl.constexpr,
                     dq_layout: gl.constexpr):
        """One query block: ``S^T = K Q^T``, P^T in registers
        as dV's A operand, then ``dP^T = V dO^T`` (issued after the softmax, so S^T and dP^T are never live
        together), dS^T in registers as dK's A operand and in shared memory (``ds_s``, keys by queries) for
        ``dQ = dS K``. Returns this block's dQ columns of this warpgroup and the updated dK, dV."""
        COLS: gl.constexpr = 64
        BLOCK_M: gl.constexpr = q_s.type.shape[0]
        DQ_N: gl.constexpr = k_dq.type.shape[1]
        dtype: gl.constexpr = q_s.dtype
        vec_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
        mbarrier.wait(q_ready, ph)
        s = warpgroup_mma(k_rows, q_s.permute((1, 0)), gl.zeros([COLS, BLOCK_M], gl.float32, st_layout),
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        lse = lse_s.load(vec_layout)  # lse * log2 e, +inf past sq (the loader's)
        if masked:
            s = _bwd_mask(s, m0, n_lo, sq, sk, CAUSAL)
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse, 0))
        p_a = gl.convert_layout(p.to(dtype), a_layout)
        mbarrier.wait(do_ready, ph)
        dv = warpgroup_mma(p_a, do_s, dv, is_async=True)
        dp = warpgroup_mma(v_rows, do_s.permute((1, 0)), gl.zeros([COLS, BLOCK_M], gl.float32, st_layout),
                           use_acc=False, is_async=True)
        dp, dv, p_a = warpgroup_mma_wait(0, deps=(dp, dv, p_a))
        delta = delta_s.load(vec_layout)
        ds = (p * (dp - gl.expand_dims(delta, 0)) * sm_scale).to(dtype)
        ds_s.slice(WG * COLS, COLS).store(ds)
        fence_async_shared()
        mbarrier.arrive(ds_ready, count=1)
        ds_a = gl.convert_layout(ds, a_layout)
        dk = warpgroup_mma(ds_a, q_s, dk, is_async=True)
        # dQ = dS K needs every warpgroup's dS^T of this block
        mbarrier.wait(ds_ready, ds_ph)
        dq = warpgroup_mma(ds_s.permute((1, 0)), k_dq, gl.zeros([BLOCK_M, DQ_N], gl.float32, dq_layout),
                           use_acc=False, is_async=True)
        dq, dk, ds_a = warpgroup_mma_wait(0, deps=(dq, dk, ds_a))
        return dq, dk, dv

    @gluon.jit
    def _bwd_consumer(args, WG: gl.constexpr, CAUSAL: gl.constexpr, NUM_WG: gl.constexpr,
                      PERSISTENT: gl.constexpr):
        """Consumer warpgroup ``WG``: per tile, keys ``n0 + 64 * WG ..`` of its block against every query block of
        every head of the group (``_bwd_step``); dK and dV stay in registers and are stored at the end of the
        tile."""
        (dq_desc, k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_ready, kv_empty, q_ready, do_ready, empty,
         ds_ready, dk_ptr, dv_ptr, dkb, dkn, dkh, dvb, dvn, dvh, B, HK, GROUP, BH_GROUP, sq, sk, NUM_N, n_units,
         qk_scale, sm_scale, lse_smem, delta_smem) = args
        BLOCK_N: gl.constexpr = k_smem.type.shape[0]
        D: gl.constexpr = k_smem.type.shape[1]
        NS: gl.constexpr = q_bufs.type.shape[0]
        BLOCK_M: gl.constexpr = q_bufs.type.shape[1]
        dtype: gl.constexpr = k_smem.dtype
        COLS: gl.constexpr = 64
        DQ_N: gl.constexpr = D // NUM_WG
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, D, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_N, 16])
        # S^T / dP^T are (64 keys, BLOCK_M queries); a query's lse and delta run along the columns
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        k_rows = k_smem.slice(WG * COLS, COLS)  # (64, D): S^T = K Q^T's A operand
        v_rows = v_smem.slice(WG * COLS, COLS)
        k_dq = k_smem.slice(WG * DQ_N, DQ_N, dim=1)  # dQ's columns of this warpgroup: dS K[:, cols]'s B
        dq_stage = dq_bufs.index(WG)
        num_m = gl.cdiv(sq, BLOCK_M)
        it = 0
        tile_i = 0
        pid = gl.program_id(0)
        end = n_units if PERSISTENT else pid + 1
        for u in range(pid, end, gl.num_programs(0)):
            b, hk, pair, n_blocks = _bwd_unit(u, NUM_N, B, HK, BH_GROUP, CAUSAL)
            for half in range(n_blocks):
                n0, m_lo, cnt = _bwd_block(pair, half, NUM_N, sq, sk, CAUSAL, BLOCK_M, BLOCK_N)
                q_row0 = b * (num_m * BLOCK_M)  # this batch's first row of the dQ accumulator
                n_lo = n0 + WG * COLS
                # query blocks from m_full on see all of this warpgroup's keys (causal) ...
                m_full = 0
                if CAUSAL:
                    m_full = gl.cdiv(gl.maximum(n_lo + COLS - 1 - (sk - sq), 0), BLOCK_M)
                # ... unless its keys run past sk
                tail = n_lo + COLS > sk
                dk = gl.zeros([COLS, D], gl.float32, acc_layout)
                dv = gl.zeros([COLS, D], gl.float32, acc_layout)
                mbarrier.wait(kv_ready, tile_i & 1)
                for j in range(GROUP * cnt):
                    h = hk * GROUP + j // cnt
                    mb = m_lo + j % cnt
                    m0 = mb * BLOCK_M
                    i = it + j
                    st = i % NS
                    ph = (i // NS) & 1
                    q_s = q_bufs.index(st)
                    do_s = do_bufs.index(st)
                    buf = i % 2
                    dq, dk, dv = _bwd_step(q_s, do_s, k_rows, v_rows, ds_bufs.index(buf), k_dq, q_ready.index(st),
                                           do_ready.index(st), ds_ready.index(buf), ph, (i // 2) & 1, dk, dv,
                                           lse_smem.index(st), delta_smem.index(st), (mb < m_full) | tail, m0,
                                           n_lo, sq, sk, qk_scale, sm_scale, WG, CAUSAL, st_layout, a_layout,
                                           dq_layout)
                    mbarrier.arrive(empty.index(st), count=1)
                    tma.store_wait(0)  # the last reduce has read the staging tile
                    dq_stage.store(dq)
                    fence_async_shared()
                    _tma_reduce_add(dq_desc, [q_row0 + m0, h * D + WG * DQ_N], dq_stage)
                # K and V are free: the next tile's load runs under this epilogue
                mbarrier.arrive(kv_empty, count=1)
                it += GROUP * cnt
                tile_i += 1
                rows = gl.arange(0, COLS, layout=gl.SliceLayout(1, acc_layout))
                dcols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
                n = n_lo + rows
                keep = gl.expand_dims(n < sk, 1)
                b64 = b.to(gl.int64)
                hk64 = hk.to(gl.int64)
                dk_off = gl.expand_dims(b64 * dkb + n.to(gl.int64) * dkn + hk64 * dkh, 1) + gl.expand_dims(dcols, 0)
                gl.store(dk_ptr + dk_off, dk.to(dtype), mask=keep)
                dv_off = gl.expand_dims(b64 * dvb + n.to(gl.int64) * dvn + hk64 * dvh, 1) + gl.expand_dims(dcols, 0)
                gl.store(dv_ptr + dv_off, dv.to(dtype), mask=keep)
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=["sqs", "sks", "svs", "sdos", "dkb", "dkn", "dkh", "dvb", "dvn", "dvh", "slb",
                                  "slh", "B", "H", "GROUP", "BH_GROUP", "sq", "sk", "NUM_N"])
    def _attn_bwd_ws_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, dq_ptr, lse_ptr, delta_ptr,
                            sqs, sks, svs, sdos, dkb, dkn, dkh, dvb, dvn, dvh, slb, slh,
                            B, H, GROUP, BH_GROUP, sq, sk, NUM_N, qk_scale, sm_scale,
                            CAUSAL: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                            STAGES: gl.constexpr, NUM_WG: gl.constexpr, PERSISTENT: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                            q_layout: gl.constexpr, kv_layout: gl.constexpr, ds_layout: gl.constexpr,
                            dq_layout: gl.constexpr):
        """Tiles are ``(key block of 64 * NUM_WG, batch, KV head)``: one per program, or (``PERSISTENT``) one
        program per SM walking ``t = pid, pid + grid, ..``. Q, dO ``(B, sq, H, D)`` and K, V ``(B, sk, HK, D)``
        are read through 2-D TMA descriptors over ``(B * s, heads * D)`` with row strides
        ``sqs``/``sdos``/``sks``/``svs`` (batch stride = s * row stride, head stride = D: the caller checks);
        dK / dV are stored with strides ``(dkb, dkn, dkh)`` / ``(dvb, dvn, dvh)``; ``dq_ptr`` is a zeroed fp32
        ``(B, sq rounded up to BLOCK_M, H, D)`` buffer (dQ's own layout: its conversion is a contiguous cast);
        ``lse`` (natural log) and ``delta = rowsum(dO * O)`` are fp32 ``(B, H, sq)`` with strides ``slb``, ``slh``.
        ``qk_scale = softmax_scale * log2(e)``."""
        HK = H // GROUP
        BLOCK_N: gl.constexpr = 64 * NUM_WG
        q_desc = tma.make_tensor_descriptor(q_ptr, [B * sq, H * HEAD_D], [sqs, 1], [BLOCK_M, HEAD_D], q_layout)
        do_desc = tma.make_tensor_descriptor(do_ptr, [B * sq, H * HEAD_D], [sdos, 1], [BLOCK_M, HEAD_D], q_layout)
        s_pad = gl.cdiv(sq, BLOCK_M) * BLOCK_M
        dq_desc = tma.make_tensor_descriptor(dq_ptr, [B * s_pad, H * HEAD_D], [H * HEAD_D, 1],
                                             [BLOCK_M, HEAD_D // NUM_WG], dq_layout)
        k_desc = tma.make_tensor_descriptor(k_ptr, [B * sk, HK * HEAD_D], [sks, 1], [BLOCK_N, HEAD_D], kv_layout)
        v_desc = tma.make_tensor_descriptor(v_ptr, [B * sk, HK * HEAD_D], [svs, 1], [BLOCK_N, HEAD_D], kv_layout)
        n_units = B * HK * NUM_N
        if CAUSAL:
            n_units = B * HK * ((NUM_N + 1) // 2)
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], kv_layout)
        q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_layout)
        # dS^T (keys, queries) for dQ (P^T stays in registers); lse and delta per stage
        ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_sl)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_sl)
        # fp32 staging tiles of the dQ reduce, one per consumer warpgroup
        dq_bufs = gl.allocate_shared_memory(gl.float32, [NUM_WG, BLOCK_M, HEAD_D // NUM_WG], dq_layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        mbarrier.init(kv_empty, count=NUM_WG)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=2)  # the TMA's bytes and the loader's lse/delta arrival
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=NUM_WG)  # one arrival per consumer warpgroup
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=NUM_WG)
        args = (dq_desc, k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, kv_ready, kv_empty, q_ready, do_ready,
                empty, ds_ready, dk_ptr, dv_ptr, dkb, dkn, dkh, dvb, dvn, dvh, B, HK, GROUP, BH_GROUP, sq, sk, NUM_N,
                n_units, qk_scale, sm_scale, lse_smem, delta_smem)
        loader_args = (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_ready, kv_empty, q_ready,
                       do_ready, empty, B, HK, GROUP, BH_GROUP, sq, sk, NUM_N, n_units, lse_smem, delta_smem, lse_ptr,
                       delta_ptr, slb, slh)
        gl.warp_specialize([
            (_bwd_consumer, (args, 0, CAUSAL, NUM_WG, PERSISTENT)),
            (_bwd_consumer, (args, 1, CAUSAL, NUM_WG, PERSISTENT)),
            (_bwd_loader, (loader_args, CAUSAL, PERSISTENT)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
