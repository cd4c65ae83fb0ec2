"""Sweep the launch settings of the cross-entropy kernels and the fused linear CE chunk budget.

Usage (GPU machine): ``python3 scripts/tune_cross_entropy.py [--n 8192] [--v 128256] [--skip-flce]
[--skip-kernels]``.
Times the forward kernel, the backward kernel (bf16 logits, ``do_bench`` medians, through the cached
plans) under each setting of ``culmen.ops.cross_entropy.launch.TUNING`` below, reports GB/s against bytes
actually moved (forward: one read; backward: one read + one write), then times fused linear +
cross-entropy fwd+bwd and its peak extra memory: at T=8192, H=4096, V=128256 bf16 for several
``chunk_bytes`` budgets, and at the LM-head shapes of ``culmen bench train_step`` (and that one) for each
``recompute_dw`` setting (``True``: grad_weight by recomputed vocab slices, ``False``: accumulated per
chunk, ``"auto"``: the default's cost model picking one of them).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from culmen.ops.cross_entropy import fused_linear_cross_entropy, launch  # noqa: E402
from culmen.ops.cross_entropy.fused_linear import TUNING as FLCE_TUNING  # noqa: E402
from culmen.ops.cross_entropy.op import get_plan  # noqa: E402

FWD_GRID = {"fwd_block_v": [2048, 4096, 8192, 16384], "elems_per_thread": [4, 8, 16], "max_warps": [16, 32]}
BWD_GRID = {"bwd_block_v": [1024, 2048, 4096, 8192], "bwd_elems": [2048, 4096, 8192], "elems_per_thread": [4, 8, 16]}
CHUNK_BYTES = [64 << 20, 128 << 20, 192 << 20, 256 << 20]
RECOMPUTE = [True, False, "auto"]
# The LM heads of ``culmen bench train_step`` (tokens, hidden, vocab): d512 llama / gpt2, d768, d2048.
TRAIN_STEP_HEADS = [(4096, 512, 32000), (4096, 512, 50304), (8192, 768, 50304), (8192, 2048, 32000),
                    (8192, 2048, 50304)]


def _sweep(grid: dict, run, nbytes: int) -> None:
    from triton.testing import do_bench

    saved = dict(launch.TUNING)
    rows = []
    for values in itertools.product(*grid.values()):
        launch.TUNING.update(dict(zip(grid, values)))  # drops the cached plans: run() builds new ones
        try:
            ms = do_bench(run, warmup=25, rep=100, return_mode="median")
            rows.append((ms, dict(zip(grid, values))))
        except Exception as exc:  # a setting the compiler rejects (registers, shared memory)
            print(f"  {dict(zip(grid, values))}: failed ({type(exc).__name__}: {str(exc)[:80]})")
        finally:
            launch.TUNING.clear()
            launch.TUNING.update(saved)
    for ms, cfg in sorted(rows, key=lambda r: r[0])[:8]:
        print(f"  {ms:8.4f} ms  {nbytes / ms / 1e6:8.1f} GB/s  {cfg}")


def _kernels(n: int, v: int, dev: torch.device) -> None:
    x = torch.randn(n, v, device=dev).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device=dev)
    dloss = torch.full((n,), 1.0 / n, device=dev)

    def plan():
        # The cached plan: every TUNING change of the sweep drops it, the first timed call builds the next.
        return get_plan(x, y)

    def fwd():
        return plan().forward(x, y, None)

    lse = fwd()[2]

    def bwd():
        return plan().backward(dloss, x, lse, y, None)

    print(f"forward, {n} x {v} bf16 (one read of the logits)")
    _sweep(FWD_GRID, fwd, x.numel() * 2)
    print(f"backward, {n} x {v} bf16 (one read + one write)")
    _sweep(BWD_GRID, bwd, x.numel() * 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--skip-flce", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true", help="only the fused linear CE part")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if not args.skip_kernels:
        _kernels(args.n, args.v, dev)
        torch.cuda.empty_cache()
    if args.skip_flce:
        return
    from triton.testing import do_bench

    def flce(t: int, h: int, vv: int, settings: dict) -> None:
        hid = (torch.randn(t, h, device=dev)).to(torch.bfloat16).requires_grad_()
        w = (torch.randn(vv, h, device=dev) * h ** -0.5).to(torch.bfloat16).requires_grad_()
        yy = torch.randint(0, vv, (t,), device=dev)
        torch.mm(hid[:64].detach(), w[:64].detach().t())  # cuBLAS workspace allocated before measuring

        def step():
            return torch.autograd.grad(fused_linear_cross_entropy(hid, w, yy), (hid, w))

        print(f"fused linear CE, T={t} H={h} V={vv} bf16 fwd+bwd")
        saved = dict(FLCE_TUNING)
        for key, values in settings.items():
            for value in values:
                FLCE_TUNING[key] = value
                step()
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - before
                ms = do_bench(step, warmup=5, rep=50, return_mode="median")
                print(f"  {key}={value!r:12}  {ms:8.3f} ms  peak extra {peak / 1e9:.3f} GB")
            FLCE_TUNING.update(saved)

    flce(8192, 4096, 128256, {"chunk_bytes": CHUNK_BYTES, "recompute_dw": RECOMPUTE})
    for t, h, vv in TRAIN_STEP_HEADS:
        torch.cuda.empty_cache()
        flce(t, h, vv, {"recompute_dw": RECOMPUTE})


if __name__ == "__main__":
    main()
