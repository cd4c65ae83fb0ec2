"""Which tiles the attention kernels run and how many key splits a KV-cache call takes.

``TUNING`` holds the block configs per kernel kind and head dim (swept on H100/H200 GPUs, see
``bench/notes/attention.md``) and the kernels' switches; ``use_kernels`` says whether a call runs the Triton kernels
or the PyTorch reference; ``kvcache_splits`` / ``choose_num_splits`` pick split-KV decoding's split count. The plans
of ``launch.py`` read them when they are built (changing ``TUNING`` drops the cached plans).
"""

from __future__ import annotations

import os

import torch

from culmen.ops.attention import checks
from culmen.ops.backend import choose_backend
from culmen.ops.common.launch import PlanTuning, cdiv, next_pow2
from culmen.ops.common.plans import clear_plans

MAX_KERNEL_HEADDIM = 512
SPLIT_MAX_SEQLEN_Q = 16
"""The automatic split-KV choice engages only for KV-cache calls with at most this many query rows (decoding)."""
MAX_SPLITS = 128
# num_splits=0 picks a split count on GPUs (choose_num_splits) when this is True (measured with
# `culmen bench kvcache_decode`: batch-1 decoding over 32k keys 5.6x faster than one split on an H200).
AUTO_SPLIT = True

# ``CULMEN_FLASH_TRITON=0`` sends GPU calls to the reference (an escape hatch for bisecting numerics).
# Read once, at import; plans read this flag when they are built (change it with ``set_kernels_on_gpu``).
_KERNELS_ON_GPU = os.environ.get("CULMEN_FLASH_TRITON", "1") != "0"

TUNING = PlanTuning({
    # (max padded head dim, BLOCK_M, BLOCK_N, num_warps, num_stages), first row that fits wins.
    # Forward and dQ hold a BLOCK_M query block and loop over keys; dK/dV hold a BLOCK_N key block and
    # loop over queries. Measured on an H100 (bench/notes/attention.md).
    "fwd": [(64, 128, 64, 4, 3), (128, 128, 128, 8, 3), (256, 128, 64, 8, 2), (512, 64, 32, 8, 1)],
    "dkdv": [(64, 64, 64, 4, 3), (128, 64, 128, 8, 3), (256, 64, 32, 4, 2), (512, 32, 32, 8, 1)],
    "dq": [(64, 128, 64, 8, 3), (128, 128, 64, 8, 3), (256, 128, 32, 8, 2), (512, 32, 32, 8, 1)],
    "dkdv_atomic": [(64, 64, 128, 8, 3), (128, 64, 128, 8, 3), (256, 32, 64, 4, 2), (512, 32, 32, 8, 1)],
    # The dK/dV kernel of "tma_dq" (its dQ tile is staged in shared memory for the bulk reduce); swept on the
    # H200 (bench/notes/attention.md v6): 64x128x8x3 best or within 3% at d128.
    "dkdv_tma": [(64, 64, 128, 8, 3), (128, 64, 128, 8, 3), (256, 32, 64, 4, 2), (512, 32, 32, 8, 1)],
    "pre_block_m": 64,
    # Register cap (ptxas ``maxnreg``) per (backward kernel kind, max padded head dim of its tile row); absent:
    # none. The dK/dV and dQ kernels use every register ptxas allows (255 at d64's 64x64x4 tile), which leaves
    # 2 programs of 4 warps per SM; a cap trades a few spills for a third program (ncu: 12.5% occupancy).
    # H200, d64 s2k GQA 32/8 (bench/notes/attention.md v8): dQ 128x64x8x3 capped at 128 registers (2 programs of 8
    # warps per SM) 1.406 ms causal / 2.258 full for the whole backward, against 1.455 / 2.360 for 128x32x4x3.
    # At d128 every cap tried spilled badly (2-6x slower).
    "bwd_maxnreg": {("dq", 64): 128},
    # KV-cache calls with at most SPLIT_MAX_SEQLEN_Q query rows (decoding; with pack-GQA the rows are the query
    # heads of one KV head): a 16-row query tile, the loop streaming wide key blocks. Same columns as "fwd".
    "decode": [(64, 16, 128, 4, 3), (128, 16, 128, 4, 3), (256, 16, 64, 4, 2), (512, 16, 32, 4, 1)],
    # The programs of split-KV decoding over a dense cache (paged caches keep "decode"): a 64-key block at d128.
    # H100, batch 1, 16 splits, three runs each (s11 sweep logs): 4k keys 0.0202 ms vs 0.0223 for 128-key
    # blocks, 32k 0.0658 vs 0.0672, 128k 0.1926 vs 0.1957; unsplit calls (batch 64) and the paged split (batch 8,
    # 4 splits: 0.119 vs 0.111) were slower with it.
    "decode_split": [(64, 16, 128, 4, 3), (128, 16, 64, 4, 3), (256, 16, 64, 4, 2), (512, 16, 32, 4, 1)],
    # Decoding over a paged cache read one page-table load per key block ("paged_block"; split or not); other paged
    # caches keep "decode".
    "decode_paged": [(64, 16, 128, 4, 3), (128, 16, 128, 4, 3), (256, 16, 64, 4, 2), (512, 16, 32, 4, 1)],
    # Split-KV's merge by combine._combine_rows_kernel (one program per query row, a chunk of splits loaded at
    # once) instead of _combine_kernel (row blocks, one split after another).
    "combine_rows": True,
    # Split-KV decoding (at most SPLIT_MAX_SEQLEN_Q query rows) merged inside the split kernel: the last program
    # of a row block to finish merges the splits' partials (kernels._merge_splits), counted in a small int32
    # workspace cached per plan and stream (AttnPlan._forward_split), instead of a second launch (combine above).
    "fused_merge": True,
    # Paged caches whose page size is a multiple of the key block (and whose keys start at 0: no cache_leftpad):
    # one page-table load per key block instead of one per row (kernels._load_paged).
    "paged_block": True,
    # Forward K/V loads through per-program TMA tensor descriptors (Hopper+, 16-byte aligned inputs).
    # Off: +2% at d128 and nothing at d64 on the H100 (Triton 3.6), and ptxas crashed on the
    # num_stages=2 variants; Triton's warp specialization on top of it gained nothing either.
    "tma": False,
    # dQ summed with fp32 atomics in the dK/dV kernel (5 matmuls per tile instead of 7, no dQ kernel)
    # when deterministic=False. Off: on the H100 it was no faster than the dQ kernel (-4% .. +3% at
    # d64/d128, 19% slower with GQA, whose dK/dV programs add into GROUP query heads) and needs an
    # fp32 dQ buffer (+50% peak memory), so every backward is the reproducible one.
    "atomic_dq": False,
    # Like "atomic_dq" (and implying it), but each dQ tile is added by one TMA bulk reduce-add
    # (cp.reduce.async.bulk.tensor through a per-head device-side descriptor) instead of one fp32 atomic per
    # element, as FA3 does. Falls back to the element atomics where descriptors cannot be used (pre-Hopper,
    # head dim not a multiple of 4 (fp32 rows must be 16-byte aligned), padded head dim > 256, torch.compile,
    # an interpreter without descriptor reduce). Never taken when deterministic. Off: within +-5% of the
    # deterministic backward on the H200 (bench/notes/attention.md v6).
    "tma_dq": False,
    # FP8 forwards (fp8 q/k/v): their own tile configs (one byte a value; at d128 128x128x8x3 was best of
    # seven on the H200), and V read through a transposed copy made per call ((.., d, seq) contiguous;
    # kernels._load_rows_t), the layout Hopper's FP8 MMA takes for the P @ V operand: 267 -> 405 TFLOP/s at
    # d128 s8k with pointer loads (bench/notes/attention.md v6); 658 with "fp8_tma" and "fp8_overlap" (v7).
    "fwd_fp8": [(64, 128, 64, 4, 3), (128, 128, 128, 8, 3), (256, 128, 64, 8, 2), (512, 64, 32, 8, 1)],
    "fp8_v_t": True,
    # FP8 forwards with the transposed V: K and V through TMA descriptors (as "tma", but for FP8 alone).
    # Triton 3.6 never pipelines the pointer load of the transposed FP8 V (its TTGIR loads V synchronously
    # in every iteration; Triton 3.9 does pipeline it), and a TMA load is always pipelined.
    "fp8_tma": True,
    # FP8 forwards through TMA: the rotated key loop ("fwd_overlap") on. H200, d128 s8k: 591 -> 658 TFLOP/s,
    # causal 514 -> 544 (with pointer loads it was slower: 405 -> 351).
    "fp8_overlap": True,
    # FP8 forwards on a GPU: the softmax numerators by ex2.approx.f16x2 (kernels._exp2). Off: slower on the
    # H200 (370 vs 405 TFLOP/s at d128 s8k, 318 vs 373 causal).
    "fp8_exp16": False,
    # Forward: the unmasked key loop rotated so the next block's q @ k.T is issued before this block's softmax
    # (kernels "OVERLAP"; not with qv). Off: the compiler does not overlap them; bf16 128x128x3 tiles run out
    # of shared memory, 128x64 reach 0.92-0.94x of the default, FP8 0.87x.
    "fwd_overlap": False,
    # Block size under the CPU interpreter (tests): small, so odd seqlens span several blocks.
    "interp_block": 16,
}, clear_plans)


def set_kernels_on_gpu(flag: bool) -> None:
    """Run GPU calls on the Triton kernels (``True``, the default) or on the PyTorch reference (for
    bisecting numerics; starts from ``CULMEN_FLASH_TRITON``). Drops the cached plans."""
    global _KERNELS_ON_GPU
    _KERNELS_ON_GPU = bool(flag)
    clear_plans()


def supported(dtype: torch.dtype, head_dim: int, return_probs: bool = False) -> bool:
    """Whether the kernels handle this call (else the reference runs it)."""
    # fp32 tiles take twice the shared memory: they use the configs of twice the head dim (so <= 256).
    max_d = MAX_KERNEL_HEADDIM // (2 if dtype == torch.float32 else 1)
    return (not return_probs and (dtype in (torch.float16, torch.bfloat16, torch.float32) or dtype in checks.FP8)
            and head_dim <= max_d)


def use_kernels(device: torch.device, dtype: torch.dtype, head_dim: int, return_probs: bool = False) -> bool:
    """Whether a call on ``device`` runs the Triton kernels: the backend says ``"triton"`` (CUDA, or CPU
    under ``CULMEN_BACKEND=triton``), GPUs are not sent to the reference, and ``supported``."""
    if choose_backend(device) != "triton":
        return False
    if device.type != "cpu" and not _KERNELS_ON_GPU:
        return False
    return supported(dtype, head_dim, return_probs)


def _tile_row(kind: str, block_d: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """The first ``TUNING[kind]`` row ``(max padded head dim, BLOCK_M, BLOCK_N, warps, stages)`` that fits."""
    width = block_d * (2 if dtype == torch.float32 else 1)  # bytes per row / 2
    for row in TUNING[kind]:
        if width <= row[0]:
            return row
    raise ValueError(f"head dim {block_d} too large for the attention kernels")


def _blocks(kind: str, block_d: int, on_gpu: bool, dtype: torch.dtype) -> tuple[int, int, int, int]:
    if not on_gpu:
        b = TUNING["interp_block"]
        return b, b, 4, 1
    return _tile_row(kind, block_d, dtype)[1:]


def _bwd_options(kind: str, block_d: int, on_gpu: bool, dtype: torch.dtype) -> dict | None:
    """Compile options of a backward kernel: ``maxnreg`` from ``TUNING["bwd_maxnreg"]`` (GPU only)."""
    if not on_gpu:
        return None
    n = TUNING["bwd_maxnreg"].get((kind, _tile_row(kind, block_d, dtype)[0]))
    return {"maxnreg": n} if n else None


def merge_chunk(rows: int, block_m: int, warps: int, block_dv: int) -> int:
    """The splits the fused split-KV merge (``kernels._merge_splits``) loads at once, programs of ``rows`` query rows
    (at most ``block_m``) and ``warps`` warps, V head dim padded to ``block_dv``: about 64 fp32 values a thread."""
    m = next_pow2(min(rows, block_m))
    return max(1, min(next_pow2(MAX_SPLITS), 64 * 32 * warps // (m * block_dv)))


def choose_num_splits(batch: int, nheads_kv: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                      num_sms: int, paged: bool = False, merge_cap: int = 0) -> int:
    """The automatic split-KV factor of a KV-cache call (``num_splits=0``): 1 unless the call decodes
    (``seqlen_q <= SPLIT_MAX_SEQLEN_Q``) and its ``batch * nheads_kv * ceil(seqlen_q / block_m)`` work units fill
    at most half of the ``num_sms`` SMs; then as many splits as fit one wave. A ``paged`` cache: as many as fit
    two waves, at any batch, and at most ``merge_cap`` when that is given (a paged cache read a key block at a
    time and merged in the split kernel: one chunk of the merge). At most one split per two key blocks of the cache
    (``seqlen_k``, its capacity: a host number, so the choice is fixed per plan, no sync) and ``MAX_SPLITS``."""
    if seqlen_q > SPLIT_MAX_SEQLEN_Q or seqlen_q <= 0 or seqlen_k <= 0:
        return 1
    units = batch * nheads_kv * cdiv(seqlen_q, block_m)
    if units == 0:
        return 1
    cap = min(cdiv(seqlen_k, 2 * block_n), MAX_SPLITS)
    if paged:
        # Paged caches: two waves, whatever the batch. Each program reads its rows through the page table and
        # streams about half as fast as a dense one (H100, batch 8 L8192, one split: 0.208 ms paged, 0.103 dense),
        # so more programs in flight pay (batch 8 page 256: 2 splits 0.127 ms, 3 0.115, 4 0.111, 8 0.116; batch
        # 1 L32k: 16 0.0744, 33 0.0716; batch 4 L16k: 4 0.128, 8 0.114; batch 16 L4k: 1 0.126, 2 0.114).
        # Read a block at a time (page 256) with the fused merge, batch 1 L32k ran 16 splits in 0.0554 ms and 33 (a
        # merge of three chunks) in 0.0598; batch 8 L8k: 2 0.0920, 4 0.0827, 8 0.0861 (H200, s12 sweep log).
        return max(1, min(2 * num_sms // units, cap, merge_cap or cap))
    if 2 * units > num_sms:
        return 1
    # Dense caches: as many splits as one wave holds. A partial second wave cost more than it gained (H200, d128
    # GQA 32/8: batch 4 ran 4 splits in 0.088 ms, 5 in 0.112), and full extra waves gained nothing either (H100,
    # batch 1, 16-row 128-key tiles: 16 splits 0.0656 ms at 32k keys, 32 splits 0.0695, 64 0.0738, 8 0.0660;
    # 128k keys 0.1915 / 0.1948 / 0.1994; 64-key tiles, up to three programs per SM, the same; s11 sweep log).
    return max(1, min(num_sms // units, cap))


def paged_block_tile(page: int, k_range: int, width: int, on_gpu: bool, dtype: torch.dtype) -> bool:
    """Whether decoding over a paged cache of ``page`` rows a page reads it one page-table load per key block
    (``TUNING["paged_block"]``, keys from 0: ``k_range == 1``, the page a multiple of the ``"decode_paged"`` tile's
    key block): it then runs that tile."""
    return bool(page and k_range == 1 and TUNING["paged_block"]
                and page % _blocks("decode_paged", width, on_gpu, dtype)[1] == 0)


def kvcache_splits(num_splits: int, device: torch.device, dtype: torch.dtype, batch: int, nheads_kv: int,
                   seqlen_q: int, seqlen_k: int, head_dim: int, head_dim_v: int, paged: bool = False, page: int = 0,
                   k_range: int = 1) -> int:
    """The number of key splits a KV-cache call runs with: ``num_splits > 1`` as given (at most one per key block
    and ``MAX_SPLITS``), ``1`` as given, ``0`` (or negative) ``choose_num_splits`` on GPUs when ``AUTO_SPLIT`` is on
    (1 on CPU, where there are no SMs to fill). Always 1 when the Triton kernels do not run the call. ``page``: the
    paged cache's page size, ``k_range`` the attention plan's (2 with ``cache_leftpad``)."""
    if num_splits == 1 or not use_kernels(device, dtype, max(head_dim, head_dim_v)):
        return 1
    width = max(16, next_pow2(head_dim), next_pow2(head_dim_v))
    on_gpu = device.type == "cuda"
    decode = seqlen_q <= SPLIT_MAX_SEQLEN_Q
    block = decode and paged_block_tile(page, k_range, width, on_gpu, dtype)
    bm, bn, warps, _ = _blocks("decode_paged" if block else "decode" if decode else "fwd", width, on_gpu, dtype)
    if num_splits > 1:
        return max(1, min(num_splits, cdiv(seqlen_k, bn), MAX_SPLITS))
    if not on_gpu or not AUTO_SPLIT:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    cap = merge_chunk(seqlen_q, bm, warps, max(16, next_pow2(head_dim_v))) if block and TUNING["fused_merge"] else 0
    return choose_num_splits(batch, nheads_kv, seqlen_q, seqlen_k, bm, bn, sms, paged, cap)
