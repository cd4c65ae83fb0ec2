"""Sweep the decoding tile configs (``launch.TUNING["decode"]``) on a GPU and print one table.

    python3 scripts/tune_decode.py [--configs "16,128,4,3 16,64,4,4 16,256,8,2"] [--splits auto 1]

For each config (BLOCK_M, BLOCK_N, warps, stages, applied to the d128 row) and split mode it times
``flash_attn_with_kvcache`` one-token decoding (bf16, 32 query heads over 8 KV heads, d 128, the shapes of
``culmen bench kvcache_decode``) with ``triton.testing.do_bench`` (eager wall, host cost included) and
``do_bench_cudagraph`` (device time), prints ms and the KV bytes streamed per second, and SDPA's numbers on
the same caches. Decides nothing: copy the winner into ``TUNING["decode"]`` by hand.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from culmen.bench.decode import HEAD_DIM, HEADS, KV_HEADS, SHAPES  # noqa: E402
from culmen.flash_attn import flash_attn_with_kvcache  # noqa: E402
from culmen.ops.attention import launch  # noqa: E402
from culmen.ops.common.plans import clear_plans  # noqa: E402

DEFAULT = "16,128,4,3 16,64,4,4 16,128,8,3 16,256,8,2 16,64,2,4 32,128,4,3"


def _time(fn) -> tuple[float, float]:
    from triton.testing import do_bench, do_bench_cudagraph

    wall = do_bench(fn, warmup=25, rep=100, return_mode="median")
    graph = do_bench_cudagraph(fn, rep=100, return_mode="median")
    return wall, graph


def _case(B: int, L: int, page: int, configs: list[str], split_modes: list[str], base: list) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 1, HEADS, HEAD_DIM, device=dev, dtype=dt, generator=g)
    k = torch.randn(B, L, KV_HEADS, HEAD_DIM, device=dev, dtype=dt, generator=g)
    v = torch.randn_like(k)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    kc, vc, table = k, v, None
    if page:
        n = L // page
        perm = torch.randperm(B * n, device=dev)
        table = perm.view(B, n).to(torch.int32)
        kc = torch.empty(B * n, page, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
        kc[perm] = k.reshape(B * n, page, KV_HEADS, HEAD_DIM)
        vc = torch.empty_like(kc)
        vc[perm] = v.reshape(B * n, page, KV_HEADS, HEAD_DIM)
    nbytes = 2 * B * L * KV_HEADS * HEAD_DIM * 2
    label = f"B{B} L{L}" + (f" page{page}" if page else "")
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    w, gr = _time(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
    print(f"{label:28s} {'sdpa':26s} {w:9.4f} {gr:9.4f} {nbytes / gr / 1e6:13.0f}", flush=True)
    ref = None
    for cfg in configs:
        bm, bn, warps, stages = (int(x) for x in cfg.split(","))
        row = (bm, bn, warps, stages)
        launch.TUNING["decode"] = [(r[0], *row) if r[0] <= 128 else r for r in base]
        clear_plans()
        for sp in split_modes:
            splits = 0 if sp == "auto" else int(sp)

            def fn(s=splits):
                return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, num_splits=s)
            try:
                out = fn()
                ref = out if ref is None else ref
                err = (out.float() - ref.float()).abs().max().item()
                w, gr = _time(fn)
                print(f"{label:28s} {cfg + ' s=' + sp:26s} {w:9.4f} {gr:9.4f} {nbytes / gr / 1e6:13.0f}"
                      f"  diff {err:.1e}", flush=True)
            except Exception as exc:  # a config that does not compile (shared memory) is reported, not fatal
                print(f"{label:28s} {cfg + ' s=' + sp:26s} failed: {type(exc).__name__}: {str(exc)[:80]}")
    launch.TUNING["decode"] = base
    clear_plans()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT)
    ap.add_argument("--splits", nargs="+", default=["auto", "1"])
    args = ap.parse_args()
    base = list(launch.TUNING["decode"])
    print(f"{'case':28s} {'variant':26s} {'wall ms':>9s} {'graph ms':>9s} {'GB/s (graph)':>13s}")
    for B, L, page in SHAPES:
        _case(B, L, page, args.configs.split(), args.splits, base)


if __name__ == "__main__":
    main()
