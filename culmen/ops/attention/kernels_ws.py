"""Warp-specialized FlashAttention forward for Hopper, written in Gluon (Triton's explicit-layout dialect).

Why a second forward: in ``@triton.jit`` each program's warpgroup runs its two GEMMs and its softmax back
to back (``bench/notes/attention.md`` v4-v9), and Triton 3.6's automatic warp specialization gained nothing.
Gluon (``triton.experimental.gluon``, shipped in the Triton wheel, no build step) states what FA3 does by
hand: one producer warp issues TMA loads of Q and of K/V into a ring of shared-memory stages guarded by
mbarriers, and two or three consumer warpgroups (64 query rows each; ``setmaxnreg`` gives them 240 or 160
registers and the loader 24 or 32) run asynchronous ``wgmma``s. Each consumer issues ``S_j = Q K_j^T`` and
``O += P_{j-1} V_{j-1}`` together and runs the softmax of ``S_j`` while ``P V`` is on the tensor cores (FA3's
intra-warpgroup overlap); with ``PINGPONG`` the consumers take turns issuing (round robin through mbarriers),
so one's softmax runs under the others' GEMMs. ``PERSISTENT``: one program per SM walks the tiles heaviest
first, and the loader fetches the next tile's Q and K/V while the consumers finish the current one.

Scope (``launch_ws.ws_config`` decides; everything else runs the Triton kernel): dense BSHD, bf16/fp16 or FA3's
float8_e4m3fn (V through its transposed copy, descales, bf16 out; ``FP8``), head dim 64 or 128, and 256 without the
causal mask (``D == DV``; causal d256 measured no faster than the Triton kernel), no dropout, window,
softcap, ALiBi, qv or KV-cache ranges; causal only with ``sq <= sk``
(every row sees key 0, so no row is empty); batches and heads packed in memory (a contiguous tensor or a head
slice of a packed qkv). Same conventions as ``kernels.py``: scores in base 2 with
``softmax_scale * log2(e)`` folded in, the causal mask bottom-right aligned, ``lse`` fp32 natural log
``(B, H, sq)``, GQA by ``h // GROUP``.

Memory safety: Q, K and V are read only through TMA descriptors over ``(B * s, heads * D)``, which zero-fill
past the tensor's end; rows of a tile past its own sequence come from the next batch and are masked (keys,
``-inf``) or never stored (queries: the output and lse stores are masked by ``row < sq``).
"""

from __future__ import annotations

try:  # Gluon ships with Triton >= 3.5 (NVIDIA); absent elsewhere, and then this kernel is never chosen.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # pragma: no cover - depends on the Triton build
    gluon = None

# fp32 literals of the polynomial exp2 (``_exp2_asm``): 2^f ~ 1 + f (C1 + f (C2 + f C3)) on [0, 1), fitted for
# relative error
_C1, _C2, _C3 = "0f3F31F30C", "0f3E691E0A", "0f3D9DD12B"
_ONE, _M127, _MAGIC = "0f3F800000", "0fC2FE0000", "0f4B400000"


def _exp2_asm(n_poly: int) -> str:
    """PTX of 2^x for 4 packed fp32 values (``$4..$7`` in, ``$0..$3`` out), the last ``n_poly`` on the FMA pipe
    and the others by ``ex2.approx`` (MUFU), or (``n_poly`` -1, an ablation) the inputs unchanged.

    Why: per score the FP8 forward's tensor cores do 512 FLOP in as many cycles as the SM's 16 MUFU lanes need
    for its exponential, so the exp2s alone can fill as much time as the GEMMs (FA4's observation, there on
    Blackwell). The FMA pipe is 8x wider: ``2^x = 2^floor(x) * 2^f`` with ``floor`` by the 1.5 * 2^23
    round-down trick (no conversion instruction: those run at MUFU's rate too), ``2^f`` for ``f`` in [0, 1)
    by a cubic (max relative error 8.6e-5, below bf16's and far below float8's rounding), and ``2^floor(x)``
    added into the exponent bits by one integer multiply-add. ``x`` is clamped at -127 (masked scores are
    ``-inf``): the result is then below fp32's normal range and flushes to 0 like ``ex2.approx.ftz``."""
    if n_poly < 0:
        return "".join(f"mov.b32 ${i}, ${i + 4};" for i in range(4))
    out = []
    for i in range(4):
        if i < 4 - n_poly:
            out.append(f"ex2.approx.ftz.f32 ${i}, ${i + 4};")
            continue
        out.append("{.reg .b32 t, y, j, p;"
                   f"max.ftz.f32 t, ${i + 4}, {_M127};"
                   f"add.rm.ftz.f32 y, t, {_MAGIC};"
                   f"sub.ftz.f32 j, y, {_MAGIC};"
                   "sub.ftz.f32 t, t, j;"
                   f"fma.rn.ftz.f32 p, t, {_C3}, {_C2};"
                   f"fma.rn.ftz.f32 p, p, t, {_C1};"
                   f"fma.rn.ftz.f32 p, p, t, {_ONE};"
                   f"mad.lo.s32 ${i}, y, 8388608, p;}}")
    return "".join(out)



AVAILABLE = gluon is not None

if AVAILABLE:
    # Triton 3.9 renamed the TMA load (3.6: async_copy_global_to_shared).
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def _ws_exp2(x, EXP_ASM: gl.constexpr):
        """``2^x`` elementwise: ``gl.exp2`` (MUFU) when ``EXP_ASM`` is empty, else the PTX of ``_exp2_asm`` over
        4 packed values (some on the FMA pipe, or none at all: an ablation for timing only)."""
        if EXP_ASM == "":
            y = gl.exp2(x)
        else:
            y = gl.inline_asm_elementwise(EXP_ASM, "=r,=r,=r,=r,r,r,r,r", [x], gl.float32, True, 4)
        return y

    @gluon.jit
    def _ws_tile(t, NUM_M, H, GROUP, BH_GROUP, sq, sk, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, n_tiles):
        """``(b, h, kv head, first query row, key blocks)`` of tile ``t``. Causal tiles run heaviest first within
        groups of ``BH_GROUP`` (batch, head) pairs, so the tiles in flight share a few heads' K and V in L2
        (heaviest first over all heads had every tile read a different head's K/V)."""
        if CAUSAL:
            per_group = BH_GROUP * NUM_M
            group = t // per_group
            size = gl.minimum(BH_GROUP, n_tiles // NUM_M - group * BH_GROUP)
            idx = t - group * per_group
            pid_m = NUM_M - 1 - idx // size
            bh = group * BH_GROUP + idx % size
        else:
            pid_m = t % NUM_M
            bh = t // NUM_M
        h = bh % H
        m0 = pid_m * BLOCK_M
        if CAUSAL:
            n_blocks = gl.minimum(gl.cdiv(sk, BLOCK_N), gl.cdiv(m0 + BLOCK_M + sk - sq, BLOCK_N))
        else:
            n_blocks = gl.cdiv(sk, BLOCK_N)
        return bh // H, h, h // GROUP, m0, n_blocks

    @gluon.jit
    def _ws_loader(args, FP8: gl.constexpr):
        """Producer (one warp; its own subset of the kernel's values): per tile, Q into buffer ``tile % Q_BUFS`` once
        the consumers released that buffer's last tile, then K and V of every key block into the stage ring (its
        counters run on across tiles). With two Q buffers the next tile's Q (and then its first K/V blocks) load
        while the consumers still read this tile's Q. ``FP8``: V comes from its transposed copy ``(B, HK, D, sk)``,
        a ``(D, BLOCK_N)`` tile per key block."""
        (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, empty, H, GROUP,
         BH_GROUP, sq, sk, NUM_M, n_tiles, CAUSAL, NUM_WG, PERSISTENT) = args
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        D: gl.constexpr = k_bufs.type.shape[2]
        NB: gl.constexpr = k_bufs.type.shape[0]
        Q_BUFS: gl.constexpr = q_ready.type.shape[0]
        NUM_Q: gl.constexpr = q_smem.type.shape[0] // Q_BUFS  # one 64-row Q tile per consumer warpgroup
        kv_it = 0
        tile_i = 0
        pid = gl.program_id(0)
        end = n_tiles if PERSISTENT else pid + 1
        for t in range(pid, end, gl.num_programs(0)):
            b, h, hk, m0, n_blocks = _ws_tile(t, NUM_M, H, GROUP, BH_GROUP, sq, sk, CAUSAL, 64 * NUM_WG, BLOCK_N,
                                              n_tiles)
            # barriers start with phase 1 complete, so the first tile's waits pass at once
            qb = tile_i % Q_BUFS
            mbarrier.wait(q_empty.index(qb), ((tile_i // Q_BUFS) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qb), NUM_Q * q_desc.block_type.nbytes)
            for w in gl.static_range(NUM_Q):
                _tma_load(q_desc, [b * sq + m0 + w * 64, h * D], q_ready.index(qb), q_smem.index(qb * NUM_Q + w))
            for j in range(n_blocks):
                it = kv_it + j
                s = it % NB
                mbarrier.wait(empty.index(s), ((it // NB) & 1) ^ 1)
                kb = k_ready.index(s)
                mbarrier.expect(kb, k_desc.block_type.nbytes)
                _tma_load(k_desc, [b * sk + j * BLOCK_N, hk * D], kb, k_bufs.index(s))
                vb = v_ready.index(s)
                mbarrier.expect(vb, v_desc.block_type.nbytes)
                if FP8:
                    _tma_load(v_desc, [(b * (H // GROUP) + hk) * D, j * BLOCK_N], vb, v_bufs.index(s))
                else:
                    _tma_load(v_desc, [b * sk + j * BLOCK_N, hk * D], vb, v_bufs.index(s))
            kv_it += n_blocks
            tile_i += 1

    @gluon.jit
    def _ws_mask(s, j, r0, sq, sk, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
        """-inf where key ``j * BLOCK_N + col`` is past ``sk`` or (causal) after row ``r0 + row``'s diagonal.
        (The index vectors are made here, not hoisted: kept live across the loops they cost ~40 registers.)"""
        rows = gl.arange(0, s.type.shape[0], layout=gl.SliceLayout(1, s.type.layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        n = gl.expand_dims(j * BLOCK_N + cols, 0)
        if CAUSAL:
            keep = (n < sk) & (n <= gl.expand_dims(r0 + rows + (sk - sq), 1))
        else:
            keep = (n < sk) & gl.expand_dims(rows >= 0, 1)
        return gl.where(keep, s, float("-inf"))

    @gluon.jit
    def _ws_p_keep(p, p_op, p_smem, WG: gl.constexpr, j, p_layout: gl.constexpr, FP8: gl.constexpr):
        """Keep block ``j``'s probabilities for its P V (``p_smem``: the P buffers, or for bf16/fp16 any shared
        buffer of the input dtype): as the A operand in registers (bf16/fp16), or for FP8
        as a float8 tile in this warpgroup's shared-memory buffer ``j % 2`` (an 8-bit register operand cannot be
        held across the asynchronous wgmma: Triton 3.6's wgmma wait takes no 8-bit dependencies); returns what
        the loop carries (FP8: ``p_op`` unchanged, a placeholder)."""
        if FP8:
            p_smem.index(WG * 2 + j % 2).store(p.to(p_smem.dtype))
            fence_async_shared()
            kept = p_op
        else:
            kept = gl.convert_layout(p.to(p_smem.dtype), p_layout)
        return kept

    @gluon.jit
    def _ws_p_operand(p_op, p_smem, WG: gl.constexpr, j, FP8: gl.constexpr):
        """P V's A operand for block ``j``: the registers ``_ws_p_keep`` returned, or (FP8) its shared tile."""
        if FP8:
            op = p_smem.index(WG * 2 + j % 2)
        else:
            op = p_op
        return op

    @gluon.jit
    def _ws_v_operand(v_tile, FP8: gl.constexpr):
        """P V's B operand ``(BLOCK_N, D)``: the V tile, or for FP8 (whose wgmma takes K-major operands only)
        the ``(D, BLOCK_N)`` tile of the transposed copy, viewed transposed."""
        if FP8:
            op = v_tile.permute((1, 0))
        else:
            op = v_tile
        return op

    @gluon.jit
    def _ws_turn_wait(turn, slot, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: consumer ``WG`` issues its GEMMs of ``slot`` only after the previous warpgroup issued
        its own (round robin), so one warpgroup's softmax runs while the next one's GEMMs occupy the tensor
        cores. Barriers start with phase 1 complete: warpgroup 0's first wait passes at once."""
        if PINGPONG:
            par = slot & 1
            if WG == 0:
                par = par ^ 1
            mbarrier.wait(turn.index(WG), par)

    @gluon.jit
    def _ws_turn_pass(turn, WG: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turn.index((WG + 1) % NUM_WG), count=1)

    @gluon.jit
    def _ws_step(q, k_bufs, v_bufs, p_smem, k_ready, v_ready, empty, q_empty, turn, acc, p_op, m_i, l_i, j, kv_it,
                 slot, n_blocks, r0, sq, sk, qk_scale, full, s_layout: gl.constexpr, p_layout: gl.constexpr,
                 row_o: gl.constexpr, WG: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr,
                 CAUSAL: gl.constexpr, FP8: gl.constexpr, EXP_ASM: gl.constexpr):
        """Key block ``j >= 1`` of a tile: issue ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}``, then run the
        softmax of ``S_j`` while ``P V`` is still on the tensor cores (FA3's intra-warpgroup overlap)."""
        NB: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        it = kv_it + j
        st = it % NB
        pst = (it - 1) % NB
        mbarrier.wait(k_ready.index(st), (it // NB) & 1)
        mbarrier.wait(v_ready.index(pst), ((it - 1) // NB) & 1)
        _ws_turn_wait(turn, slot + j, WG, PINGPONG)
        # (zeros made at each use: a hoisted zero tile stays live across the loops, 64 registers at d128)
        zero_s = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
        s = warpgroup_mma(q, k_bufs.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(_ws_p_operand(p_op, p_smem, WG, j - 1, FP8), _ws_v_operand(v_bufs.index(pst), FP8),
                            acc, is_async=True)
        _ws_turn_pass(turn, WG, NUM_WG, PINGPONG)
        s = warpgroup_mma_wait(1, deps=(s,))
        # Q is released right after its last read, so the next tile's Q loads under this one's tail
        mbarrier.arrive(q_empty, count=1, pred=j == n_blocks - 1)
        if j >= full:  # the diagonal and sequence-end blocks
            s = _ws_mask(s, j, r0, sq, sk, CAUSAL, BLOCK_N)
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = _ws_exp2(s * qk_scale - gl.expand_dims(m_new, 1), EXP_ASM)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        # bf16/fp16: carried to the next block as the MMA's register operand (32 registers, not 64 of fp32)
        p_next = _ws_p_keep(p, p_op, p_smem, WG, j, p_layout, FP8)
        if FP8:
            acc = warpgroup_mma_wait(0, deps=(acc,))
        else:
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(empty.index(pst), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        return acc, p_next, m_new, l_i

    @gluon.jit
    def _ws_consumer(args, WG: gl.constexpr, FP8: gl.constexpr, DESCALE: gl.constexpr, EXP_ASM: gl.constexpr):
        """Consumer warpgroup ``WG``: query rows ``m0 + 64 * WG ..`` of each of the program's tiles against every
        key block, then the epilogue (output and lse stored straight from registers, masked to the sequence).
        ``FP8``: float8 Q/K/V (P rounded to float8 for P V), the output in ``o``'s dtype; ``DESCALE``: the
        scores times ``q_descale * k_descale`` and the output times ``v_descale`` of the tile's (batch, KV
        head)."""
        (q_smem, k_bufs, v_bufs, p_smem, q_ready, q_empty, k_ready, v_ready, empty, turn, o_ptr, lse_ptr, qd_ptr,
         kd_ptr, vd_ptr, sos, slb, slh, H, GROUP, BH_GROUP, sq, sk, NUM_M, n_tiles, qk_scale, CAUSAL, NUM_WG,
         PINGPONG, PERSISTENT) = args
        NB: gl.constexpr = k_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        D: gl.constexpr = k_bufs.type.shape[2]
        ROWS: gl.constexpr = 64
        IK: gl.constexpr = 32 if FP8 else 16  # the wgmma instruction's K: 32 bytes of each operand row
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, IK])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, IK])
        KW: gl.constexpr = 4 if FP8 else 2  # 32 bits of the A operand per register
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=KW)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        Q_BUFS: gl.constexpr = q_ready.type.shape[0]
        NUM_Q: gl.constexpr = q_smem.type.shape[0] // Q_BUFS
        kv_it = 0
        slot = 0
        tile_i = 0
        pid = gl.program_id(0)
        end = n_tiles if PERSISTENT else pid + 1
        for t in range(pid, end, gl.num_programs(0)):
            b, h, hk, m0, n_blocks = _ws_tile(t, NUM_M, H, GROUP, BH_GROUP, sq, sk, CAUSAL, 64 * NUM_WG, BLOCK_N,
                                              n_tiles)
            r0 = m0 + WG * ROWS
            qb = tile_i % Q_BUFS
            q = q_smem.index(qb * NUM_Q + WG)
            q_free = q_empty.index(qb)
            qk_t = qk_scale
            if DESCALE:
                dsc = b * (H // GROUP) + hk
                qk_t = qk_scale * gl.load(qd_ptr + dsc) * gl.load(kd_ptr + dsc)
            # key blocks that need no mask: inside sk and (causal) left of this warpgroup's first diagonal
            full = sk // BLOCK_N
            if CAUSAL:
                full = gl.minimum(full, (r0 + sk - sq + 1) // BLOCK_N)
            acc = gl.zeros([ROWS, D], gl.float32, o_layout)
            mbarrier.wait(q_ready.index(qb), (tile_i // Q_BUFS) & 1)
            st = kv_it % NB
            mbarrier.wait(k_ready.index(st), (kv_it // NB) & 1)
            _ws_turn_wait(turn, slot, WG, PINGPONG)
            zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
            s = warpgroup_mma(q, k_bufs.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            _ws_turn_pass(turn, WG, NUM_WG, PINGPONG)
            s = warpgroup_mma_wait(0, deps=(s,))
            # Q is released right after its last read, so the next tile's Q loads under this one's tail
            mbarrier.arrive(q_free, count=1, pred=n_blocks == 1)
            if full < 1:
                s = _ws_mask(s, 0, r0, sq, sk, CAUSAL, BLOCK_N)
            m_i = gl.max(s, axis=1) * qk_t
            p = _ws_exp2(s * qk_t - gl.expand_dims(m_i, 1), EXP_ASM)
            l_i = gl.sum(p, axis=1)
            p_op = _ws_p_keep(p, 0, p_smem, WG, 0, p_layout, FP8)
            for j in range(1, n_blocks):
                acc, p_op, m_i, l_i = _ws_step(q, k_bufs, v_bufs, p_smem, k_ready, v_ready, empty, q_free, turn,
                                               acc, p_op, m_i, l_i, j, kv_it, slot, n_blocks, r0, sq, sk, qk_t,
                                               full, s_layout, p_layout, row_o, WG, NUM_WG, PINGPONG, CAUSAL, FP8,
                                               EXP_ASM)
            it = kv_it + n_blocks - 1
            last = it % NB
            mbarrier.wait(v_ready.index(last), (it // NB) & 1)
            _ws_turn_wait(turn, slot + n_blocks, WG, PINGPONG)
            acc = warpgroup_mma(_ws_p_operand(p_op, p_smem, WG, n_blocks - 1, FP8),
                                _ws_v_operand(v_bufs.index(last), FP8), acc, is_async=True)
            _ws_turn_pass(turn, WG, NUM_WG, PINGPONG)
            if FP8:
                acc = warpgroup_mma_wait(0, deps=(acc,))
            else:
                acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(empty.index(last), count=1)
            kv_it += n_blocks
            slot += n_blocks + 1
            tile_i += 1

            acc = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
            if DESCALE:
                acc = acc * gl.load(vd_ptr + dsc)
            lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
            b64 = b.to(gl.int64)
            rows = gl.arange(0, ROWS, layout=row_s)
            o_rows = gl.arange(0, ROWS, layout=row_o)
            o_cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
            gl.store(lse_ptr + b64 * slb + h.to(gl.int64) * slh + r0 + rows, lse, mask=r0 + rows < sq)
            orow = r0 + o_rows
            optr = (o_ptr + gl.expand_dims((b64 * sq + orow) * sos, 1)
                    + gl.expand_dims(h.to(gl.int64) * D + o_cols, 0))
            gl.store(optr, acc.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(orow < sq, 1))

    @gluon.jit(do_not_specialize=["sqs", "sks", "svs", "sos", "slb", "slh", "B", "H", "GROUP", "BH_GROUP", "sq", "sk",
                                  "NUM_M"])
    def _attn_fwd_ws_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, qd_ptr, kd_ptr, vd_ptr, sqs, sks, svs, sos, slb,
                            slh, B, H, GROUP, BH_GROUP, sq, sk, NUM_M, qk_scale,
                            CAUSAL: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr,
                            PERSISTENT: gl.constexpr, FP8: gl.constexpr, DESCALE: gl.constexpr, Q_BUFS: gl.constexpr,
                            EXP_ASM: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                            q_layout: gl.constexpr, kv_layout: gl.constexpr, vt_layout: gl.constexpr,
                            p_layout: gl.constexpr):
        """Persistent: program ``p`` runs tiles ``p, p + grid, ..`` of ``NUM_M * B * H`` (``64 * NUM_WG``
        query rows of one (batch, head) each). Q/K/V are read through one 2-D TMA descriptor each over
        ``(batch * seqlen, heads * HEAD_D)`` (row strides ``sqs``/``sks``/``svs``; the caller guarantees
        batch stride = seqlen * row stride and head stride = HEAD_D); rows of a tile past its sequence
        belong to the next batch or read as zero, and are masked (keys) or not stored (queries). ``o``
        is contiguous ``(B, sq, H, HEAD_D)``, ``lse`` ``(B, H, sq)`` with strides ``slb``, ``slh``.
        ``FP8``: float8 Q/K, V as its transposed copy ``(B, HK, HEAD_D, sk)`` with row stride ``svs``
        (16-byte aligned), ``o`` bf16; ``DESCALE``: fp32 ``(B, HK)`` descales ``qd``/``kd``/``vd`` (else
        any pointers, unread). ``Q_BUFS``: 1 or 2 Q buffers (two let the next tile's Q load under this one).
        Launched with 4 warps (consumer 0) plus ``NUM_WG - 1`` consumers and a one-warp loader."""
        HK = H // GROUP
        q_desc = tma.make_tensor_descriptor(q_ptr, [B * sq, H * HEAD_D], [sqs, 1], [64, HEAD_D], q_layout)
        k_desc = tma.make_tensor_descriptor(k_ptr, [B * sk, HK * HEAD_D], [sks, 1], [BLOCK_N, HEAD_D], kv_layout)
        if FP8:
            v_desc = tma.make_tensor_descriptor(v_ptr, [B * HK * HEAD_D, sk], [svs, 1], [HEAD_D, BLOCK_N],
                                                vt_layout)
        else:
            v_desc = tma.make_tensor_descriptor(v_ptr, [B * sk, HK * HEAD_D], [svs, 1], [BLOCK_N, HEAD_D],
                                                kv_layout)
        n_tiles = NUM_M * B * H
        q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [Q_BUFS * NUM_WG, 64, HEAD_D], q_layout)
        k_bufs = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [STAGES, BLOCK_N, HEAD_D], kv_layout)
        if FP8:
            v_bufs = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [STAGES, HEAD_D, BLOCK_N], vt_layout)
        else:
            v_bufs = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [STAGES, BLOCK_N, HEAD_D], kv_layout)
        if FP8:  # two float8 P tiles per consumer warpgroup (block j in buffer j % 2)
            p_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [NUM_WG * 2, 64, BLOCK_N], p_layout)
        else:
            p_smem = q_smem  # a placeholder of the input dtype: bf16/fp16 P stays in registers
        q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(Q_BUFS):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=NUM_WG)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=NUM_WG)  # one arrival per consumer warpgroup
        for i in gl.static_range(NUM_WG):
            mbarrier.init(turn.index(i), count=1)
        args = (q_smem, k_bufs, v_bufs, p_smem, q_ready, q_empty, k_ready, v_ready, empty, turn, o_ptr, lse_ptr,
                qd_ptr, kd_ptr, vd_ptr, sos, slb, slh, H, GROUP, BH_GROUP, sq, sk, NUM_M, n_tiles, qk_scale, CAUSAL,
                NUM_WG, PINGPONG, PERSISTENT)
        loader_args = (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, empty, H,
                       GROUP, BH_GROUP, sq, sk, NUM_M, n_tiles, CAUSAL, NUM_WG, PERSISTENT)
        if NUM_WG == 3:
            gl.warp_specialize([
                (_ws_consumer, (args, 0, FP8, DESCALE, EXP_ASM)),
                (_ws_consumer, (args, 1, FP8, DESCALE, EXP_ASM)),
                (_ws_consumer, (args, 2, FP8, DESCALE, EXP_ASM)),
                (_ws_loader, (loader_args, FP8)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_ws_consumer, (args, 0, FP8, DESCALE, EXP_ASM)),
                (_ws_consumer, (args, 1, FP8, DESCALE, EXP_ASM)),
                (_ws_loader, (loader_args, FP8)),
            ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
