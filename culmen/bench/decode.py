"""Decoding benchmark: ``flash_attn_with_kvcache`` with one query token per sequence, the call an inference
loop makes per layer per generated token. Its work is streaming the KV cache, so the number that counts is
the bandwidth: ``GB/s`` counts the cache rows each call must read (``2 * B * L * hk * d`` elements) against
the copy roofline the runner measures.

Providers on the same values (bf16, ``h = 32`` query heads over ``hk = 8`` KV heads, ``d = 128``, full caches
of ``L`` positions, no new tokens):

- ``culmen``: the default call (``num_splits=0``: split-KV chosen automatically when
  ``culmen.ops.attention.tiles.AUTO_SPLIT`` is on, else one split);
- ``culmen-s1`` / ``culmen-auto`` / ``culmen-s<n>``: one split, the automatic choice forced on, fixed splits
  (informational: they decide the automatic rule);
- ``torch``: ``F.scaled_dot_product_attention`` on ``(B, h, 1, d)`` queries over the ``(B, hk, L, d)`` cache
  with ``enable_gqa`` (PyTorch's own choice of backend), the same bytes read.

Paged cases (pages of 256 and of 16 rows) read the cache through a shuffled page table.

Two environment variables serve GPU sessions that compare settings in one process: ``CULMEN_BENCH_DECODE_SHAPES``
(``"batch,length,page ..."``) replaces the shape grid, and ``CULMEN_BENCH_FUSED_MERGE`` (``0`` / ``1``) sets
``launch.TUNING["fused_merge"]`` (the split-KV merge inside the split kernel, or a second launch) for the run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from culmen.bench.registry import BenchConfig, Case, register_benchmark

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
# (batch, cache length, page size or 0): issue 17's grid (batch 1 / 16 / 64 over caches of 4k / 32k / 128k
# tokens; batch 64 at 128k would need 34 GB of cache plus SDPA's copy, so it stops at 32k) and one paged case.
SHAPES: list[tuple[int, int, int]] = [(1, 4096, 0), (1, 32768, 0), (1, 131072, 0), (16, 4096, 0), (16, 32768, 0),
                                      (16, 131072, 0), (64, 4096, 0), (64, 32768, 0), (8, 8192, 256), (8, 8192, 16)]
QUICK_SHAPES: list[tuple[int, int, int]] = [(1, 64, 0), (2, 64, 16)]
FIXED_SPLITS = (4, 16)


def _auto_splits(B: int, L: int, page: int, device: torch.device, dtype: torch.dtype) -> int:
    """What the automatic rule picks for this call with ``AUTO_SPLIT`` on (the flag restored after)."""
    from culmen.ops.attention import tiles
    from culmen.ops.attention.kvcache import pack_gqa_rows

    rows = pack_gqa_rows(HEADS, KV_HEADS)  # one-token decoding runs HEADS / rows packed heads of `rows` rows
    saved = tiles.AUTO_SPLIT
    tiles.AUTO_SPLIT = True
    try:
        return tiles.kvcache_splits(0, device, dtype, B, HEADS // rows, rows, L, HEAD_DIM, HEAD_DIM, paged=page > 0,
                                    page=page)
    finally:
        tiles.AUTO_SPLIT = saved


@register_benchmark("kvcache_decode", "attention")
def bench_kvcache_decode(cfg: BenchConfig) -> Iterator[Case]:
    """One-token decoding over a KV cache (bf16, 32 heads over 8 KV heads, d 128) vs SDPA: bandwidth."""
    from culmen.flash_attn import flash_attn_with_kvcache
    from culmen.ops.attention import launch

    shapes = QUICK_SHAPES if cfg.quick else SHAPES
    if os.environ.get("CULMEN_BENCH_DECODE_SHAPES"):
        shapes = [tuple(int(x) for x in s.split(",")) for s in os.environ["CULMEN_BENCH_DECODE_SHAPES"].split()]
    if os.environ.get("CULMEN_BENCH_FUSED_MERGE") in ("0", "1"):
        launch.TUNING["fused_merge"] = os.environ["CULMEN_BENCH_FUSED_MERGE"] == "1"
    dev = cfg.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    dgen = torch.Generator(device=dev).manual_seed(0)  # gigabyte caches: drawn on the device
    for B, L, page in shapes:
        def rnd(*shape):
            return torch.randn(*shape, generator=dgen, dtype=dtype, device=dev)

        q = rnd(B, 1, HEADS, HEAD_DIM)
        k, v = rnd(B, L, KV_HEADS, HEAD_DIM), rnd(B, L, KV_HEADS, HEAD_DIM)
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        table = None
        kc, vc = k, v
        if page:
            n = L // page
            perm = torch.randperm(B * n, generator=gen).to(dev)
            table = perm.view(B, n).to(torch.int32)
            kc = torch.empty(B * n, page, KV_HEADS, HEAD_DIM, dtype=dtype, device=dev)
            vc = torch.empty_like(kc)
            kc[perm] = k.reshape(B * n, page, KV_HEADS, HEAD_DIM)
            vc[perm] = v.reshape(B * n, page, KV_HEADS, HEAD_DIM)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

        def ours(splits: int, kc=kc, vc=vc, q=q, lens=lens, table=table):
            def run():
                out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, num_splits=splits)
                return out.transpose(1, 2)
            return run

        def sdpa(qt=qt, kt=kt, vt=vt):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        auto = _auto_splits(B, L, page, dev, dtype)
        providers = {"culmen": ours(0), "culmen-s1": ours(1), "culmen-auto": ours(auto)}
        for s in FIXED_SPLITS:
            providers[f"culmen-s{s}"] = ours(s)
        providers["torch"] = sdpa
        label = f"B{B} L{L} h{HEADS}/{KV_HEADS} d{HEAD_DIM}" + (f" page{page}" if page else "")
        notes = [f"culmen-auto runs {auto} split(s) (the automatic rule with AUTO_SPLIT on); fused merge "
                 f"{'on' if launch.TUNING['fused_merge'] else 'off'}"]
        if page:
            notes.append("torch reads the same rows from a dense (B, hk, L, d) copy (SDPA has no page table)")
        yield Case(label, providers, bytes=2 * B * L * KV_HEADS * HEAD_DIM * k.element_size(),
                   flops=4 * B * HEADS * L * HEAD_DIM, notes=notes,
                   informational=("culmen-s1", "culmen-auto", *(f"culmen-s{s}" for s in FIXED_SPLITS)))
        del q, k, v, kc, vc, qt, kt, vt
