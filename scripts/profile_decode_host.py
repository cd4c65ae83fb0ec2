"""Where the host time of one-token ``flash_attn_with_kvcache`` decoding goes.

    python3 scripts/profile_decode_host.py [--page 256] [--batch 8] [--seqlen 8192]     # GPU: cProfile
    python3 scripts/profile_decode_host.py --host-only [--cases "1,4096,0,0 8,8192,256,0"]  # GPU: host us
    python3 scripts/profile_decode_host.py --fake [--cases ...]                          # CPU, fake kernels

Default (GPU): cProfile of 300 paged calls (bf16, 32 query heads over 8 KV heads, d 128, a shuffled page
table), sorted by own time, beside the mean host microseconds per call with and without the page table.
``--host-only`` (GPU): host microseconds per call of each case (``batch,cache length,page or 0,num_splits``)
measured as ``culmen bench`` does (``culmen.bench.runner.host_us``: the GPU held asleep while the calls are
enqueued). ``--fake`` (CPU): the same cases with every kernel faked (``culmen.testing.hostcost``), so the
cached path runs as on a GPU minus the launches: microseconds per call and the calls culmen makes. CPU value
checks of ``cache_seqlens`` are skipped there (a GPU call does not make them).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = "1,4096,0,0 1,4096,0,1 1,32768,0,0 8,8192,256,0 16,4096,0,0"


def _call(B: int, L: int, page: int, splits: int, dev: str):
    from culmen.flash_attn import flash_attn_with_kvcache

    h, hk, d, dt = 32, 8, 128, torch.bfloat16
    q = torch.randn(B, 1, h, d, device=dev, dtype=dt)
    table = None
    if page:
        n = L // page
        kc = torch.randn(B * n, page, hk, d, device=dev, dtype=dt)
        table = torch.randperm(B * n, device=dev).to(torch.int32).view(B, n)
    else:
        kc = torch.randn(B, L, hk, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    lens = torch.full((B,), L, device=dev, dtype=torch.int32)

    def call():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, num_splits=splits)
    return call


def _cases(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in c.split(",")) for c in text.split()]


def fake(cases: str) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from culmen.ops.attention import checks
    from culmen.testing.hostcost import count_calls, fake_kernels

    checks.check_kvcache_values = lambda *a, **k: None  # GPU calls make no value checks
    for B, L, page, splits in _cases(cases):
        with fake_kernels():
            call = _call(B, L, page, splits, "cpu")
            for _ in range(3):
                call()
            n = count_calls(call)
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(1000):
                    call()
                ts.append((time.perf_counter() - t0) * 1e3)
        print(f"B{B} L{L} page{page} splits={splits}: {statistics.median(ts):6.2f} us/call (CPU, fake kernels); "
              f"{n.python} Python / {n.c} C calls: {', '.join(f'{k} x{v}' for k, v in n.c_names.most_common())}",
              flush=True)


def host_only(cases: str) -> None:
    from culmen.bench.runner import host_us

    dev = torch.device("cuda")
    for B, L, page, splits in _cases(cases):
        call = _call(B, L, page, splits, "cuda")
        call()
        torch.cuda.synchronize()
        us = [host_us(call, dev) for _ in range(3)]
        print(f"B{B} L{L} page{page} splits={splits}: host {statistics.median(us):6.1f} us/call "
              f"(runs {', '.join(f'{u:.1f}' for u in us)})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--fake", action="store_true", help="CPU: fake kernels, count calls")
    ap.add_argument("--host-only", action="store_true", help="GPU: host us per call of --cases")
    ap.add_argument("--cases", default=CASES, help="'batch,cache length,page or 0,num_splits ...'")
    a = ap.parse_args()
    if a.fake:
        return fake(a.cases)
    if a.host_only:
        return host_only(a.cases)
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
