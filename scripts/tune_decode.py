"""Sweep the decoding tile configs (``launch.TUNING["decode"]`` / ``["decode_split"]`` / ``["decode_paged"]``), split
counts, merges and paged loads on a GPU.

    python3 scripts/tune_decode.py [--configs "16,128,4,3 16,64,4,4"] [--splits auto 1]
        [--shapes "1,32768,0 8,8192,256"] [--split-sets "1:8,16,32 8:1,2,4"] [--combine rows blocks]
        [--fused on off] [--paged-block on off] [--graph] [--profile "1,32768,0"]

For each config (BLOCK_M, BLOCK_N, warps, stages, applied to the d128 rows of all three), merge (``rows``:
``TUNING["combine_rows"]`` on, ``blocks``: off; ``--fused on``: ``TUNING["fused_merge"]``, the merge inside the split
kernel, ``off``: the second launch), paged load (``--paged-block``: ``TUNING["paged_block"]``, one page-table load
per key block, or one per row) and split count it times ``flash_attn_with_kvcache`` one-token
decoding (bf16, 32 query heads over 8 KV heads, d 128; shapes ``batch,cache length,page size or 0``, default
those of ``culmen bench kvcache_decode``) with ``triton.testing.do_bench`` (eager wall, host cost included, L2
flushed: the bench's ratio basis) and, with ``--graph``, ``do_bench_cudagraph`` (device time); prints ms, the KV
bytes streamed per second and SDPA's numbers on the same caches. ``--split-sets`` gives per-batch split lists
(``batch:s1,s2,..``), else ``--splits`` serves every shape. ``--profile`` prints the per-kernel device time of
the default call (torch.profiler) for the shapes given. Decides nothing: copy the winner by hand.
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
from culmen.ops.attention.kvcache import pack_gqa_rows  # noqa: E402
from culmen.ops.common.plans import clear_plans  # noqa: E402

DEV = torch.device("cuda")  # (a CPU smoke test of the script swaps it)
DEFAULT = "16,128,4,3 16,64,4,4 16,128,8,3 16,256,8,2 16,64,2,4 32,128,4,3"


def _time(fn, graph: bool) -> tuple[float, float]:
    from triton.testing import do_bench, do_bench_cudagraph

    wall = do_bench(fn, warmup=10, rep=40, return_mode="median")
    return wall, (do_bench_cudagraph(fn, rep=40, return_mode="median") if graph else float("nan"))


def _inputs(B: int, L: int, page: int):
    dev, dt = DEV, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, 1, HEADS, HEAD_DIM, device=dev, dtype=dt, generator=g)
    k = torch.randn(B, L, KV_HEADS, HEAD_DIM, device=dev, dtype=dt, generator=g)
    v = torch.randn(B, L, KV_HEADS, HEAD_DIM, device=dev, dtype=dt, generator=g)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    kc, vc, table = k, v, None
    if page:
        n = L // page
        perm = torch.randperm(B * n, device=dev, generator=g)
        table = perm.view(B, n).to(torch.int32)
        kc = torch.empty(B * n, page, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
        kc[perm] = k.reshape(B * n, page, KV_HEADS, HEAD_DIM)
        vc = torch.empty_like(kc)
        vc[perm] = v.reshape(B * n, page, KV_HEADS, HEAD_DIM)
    return q, k, v, kc, vc, lens, table


def _splits_used(B: int, L: int, splits: int, page: int) -> int:
    rows = pack_gqa_rows(HEADS, KV_HEADS)
    return launch.kvcache_splits(splits, DEV, torch.bfloat16, B, HEADS // rows, rows, L, HEAD_DIM, HEAD_DIM,
                                 paged=page > 0, page=page)


def _case(B, L, page, configs, combines, split_modes, base, base_split, base_paged, graph, fused_modes,
          block_modes) -> None:
    q, k, v, kc, vc, lens, table = _inputs(B, L, page)
    nbytes = 2 * B * L * KV_HEADS * HEAD_DIM * 2
    label = f"B{B} L{L}" + (f" page{page}" if page else "")
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    ref = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
    w, gr = _time(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), graph)
    print(f"{label:24s} {'sdpa':36s} {w:9.4f} {gr:9.4f} {nbytes / w / 1e6:8.0f}", flush=True)
    saved = {k: launch.TUNING[k] for k in ("combine_rows", "fused_merge", "paged_block")}
    variants = [(c, f, p) for c in combines for f in fused_modes for p in (block_modes if page else ["-"])]
    for cfg in configs:
        bm, bn, warps, stages = (int(x) for x in cfg.split(","))
        for comb, fused, pblock in variants:
            # the config serves every decode call of head dim <= 128, split over a dense cache or not, paged or not
            row = (bm, bn, warps, stages)
            launch.TUNING["decode"] = [(r[0], *row) if r[0] <= 128 else r for r in base]
            launch.TUNING["decode_split"] = [(r[0], *row) if r[0] <= 128 else r for r in base_split]
            launch.TUNING["decode_paged"] = [(r[0], *row) if r[0] <= 128 else r for r in base_paged]
            launch.TUNING["combine_rows"] = comb == "rows"
            launch.TUNING["fused_merge"] = fused == "on"
            launch.TUNING["paged_block"] = pblock != "off"
            for sp in split_modes:
                splits = 0 if sp == "auto" else int(sp)

                def fn(s=splits):
                    return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, num_splits=s)
                merge = ("fused" if fused == "on" else comb) + ("" if pblock == "-" else f" pb={pblock}")
                name = f"{cfg} {merge} s={sp}({_splits_used(B, L, splits, page)})"
                try:
                    err = (fn().float() - ref.float()).abs().max().item()
                    w, gr = _time(fn, graph)
                    print(f"{label:24s} {name:36s} {w:9.4f} {gr:9.4f} {nbytes / w / 1e6:8.0f}  err {err:.1e}",
                          flush=True)
                except Exception as exc:  # a config that does not compile (shared memory) is reported, not fatal
                    print(f"{label:24s} {name:36s} failed: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
    launch.TUNING["decode"] = base
    launch.TUNING["decode_split"] = base_split
    launch.TUNING["decode_paged"] = base_paged
    launch.TUNING.update(saved)
    clear_plans()


def _profile(B: int, L: int, page: int, combines, fused_modes) -> None:
    """Per-kernel device time of the default call (num_splits=0) under each merge."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, kc, vc, lens, table = _inputs(B, L, page)
    saved = {k: launch.TUNING[k] for k in ("combine_rows", "fused_merge")}
    for comb, fused in ((c, f) for c in combines for f in fused_modes):
        launch.TUNING["combine_rows"] = comb == "rows"
        launch.TUNING["fused_merge"] = fused == "on"
        comb = "fused" if fused == "on" else comb

        def fn():
            return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table)
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        times: dict = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                times.setdefault(e.name, []).append(e.device_time)
        for name, ts in sorted(times.items()):
            print(f"profile B{B} L{L} page{page} {comb:6s} {name[:48]:48s} {sum(ts) / len(ts):8.2f} us x{len(ts)}",
                  flush=True)
    launch.TUNING.update(saved)
    clear_plans()


def _shapes(text: str | None) -> list[tuple[int, int, int]]:
    if not text:
        return list(SHAPES)
    return [tuple(int(x) for x in s.split(",")) for s in text.split()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT)
    ap.add_argument("--splits", nargs="+", default=["auto", "1"])
    ap.add_argument("--split-sets", default="", help="per batch size: '1:8,16,32 8:1,2,4'")
    ap.add_argument("--shapes", default=None, help="'batch,cache length,page ...' (page 0: dense)")
    ap.add_argument("--combine", nargs="+", default=["rows"], choices=["rows", "blocks"])
    on = "on" if launch.TUNING["fused_merge"] else "off"
    ap.add_argument("--fused", nargs="+", default=[on], choices=["on", "off"],
                    help="TUNING['fused_merge'] (the merge inside the split kernel); off: the --combine kernels")
    pb = "on" if launch.TUNING["paged_block"] else "off"
    ap.add_argument("--paged-block", nargs="+", default=[pb], choices=["on", "off"],
                    help="TUNING['paged_block'] (paged shapes only): one page-table load per key block")
    ap.add_argument("--graph", action="store_true", help="also time CUDA-graph replays (device time)")
    ap.add_argument("--profile", default="", help="shapes whose default call is profiled per kernel")
    args = ap.parse_args()
    per_batch = {int(b): s.split(",") for b, s in (x.split(":") for x in args.split_sets.split())}
    base, base_split = list(launch.TUNING["decode"]), list(launch.TUNING["decode_split"])
    base_paged = list(launch.TUNING["decode_paged"])
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else DEV
    print(f"{name} | torch {torch.__version__} | decode rows {base} | split rows {base_split} | paged rows "
          f"{base_paged}")
    if args.profile:
        for B, L, page in _shapes(args.profile):
            _profile(B, L, page, args.combine, args.fused)
    print(f"{'case':24s} {'config merge paged-block splits(used)':36s} {'wall ms':>9s} {'graph ms':>9s} {'GB/s':>8s}")
    for B, L, page in _shapes(args.shapes):
        _case(B, L, page, args.configs.split(), args.combine, per_batch.get(B, args.splits), base, base_split,
              base_paged, args.graph, args.fused, args.paged_block)


if __name__ == "__main__":
    main()
