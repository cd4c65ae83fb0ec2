"""Where the host time of one paged ``flash_attn_with_kvcache`` decode call goes (run on the GPU machine).

    python3 scripts/profile_decode_host.py [--page 256] [--batch 8] [--seqlen 8192]

cProfile of 300 calls (bf16, 32 query heads over 8 KV heads, d 128, a shuffled page table), sorted by
own time, beside the mean host microseconds per call with and without the page table.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=8192)
    a = ap.parse_args()
    from culmen.flash_attn import flash_attn_with_kvcache

    B, L, P, h, hk, d = a.batch, a.seqlen, a.page, 32, 8, 128
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, 1, h, d, device=dev, dtype=dt)
    n = L // P
    kc = torch.randn(B * n, P, hk, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    table = torch.randperm(B * n, device=dev).to(torch.int32).view(B, n)
    lens = torch.full((B,), L - 1, device=dev, dtype=torch.int32)
    kd, vd = kc.view(B, L, hk, d), vc.view(B, L, hk, d)

    def paged():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table)

    def dense():
        return flash_attn_with_kvcache(q, kd, vd, cache_seqlens=lens)

    for name, fn in (("paged", paged), ("dense", dense)):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(300):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{name}: host {1e6 * (t1 - t0) / 300:.1f} us/call (launch only), "
              f"wall {1e6 * (time.perf_counter() - t0) / 300:.1f} us/call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        paged()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
