"""Where the time of one SelfMultiheadAttn step goes, against nn.MultiheadAttention (run on the lent machine).

    python3 scripts/profile_mha.py [--batch 32] [--seqlen 512] [--mask]

Builds the ``multihead_attn`` benchmark's case (BERT-large: embed 1024, 16 heads, fp16, forward + backward)
and, for culmen's fast path and PyTorch's module, prints the wall ms per step (do_bench median of the eager
call) and the device time per step of each CUDA kernel (torch.profiler over 5 steps), largest first, so the
gap between the two can be read kernel by kernel.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--mask", action="store_true")
    a = ap.parse_args()
    import triton.testing

    from culmen.bench.multihead_attn import _case

    case = _case(a.seqlen, a.batch, 1024, 16, torch.float16, a.mask, "fwd+bwd", torch.device("cuda"))
    for name in ("culmen", "torch"):
        fn = case.providers[name]
        ms = triton.testing.do_bench(fn, warmup=50, rep=300)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        rows = [(e.device_time_total / 5 / 1000, e.count // 5, e.key) for e in prof.key_averages()
                if e.device_time_total > 0]
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(f"== {name}: wall {ms:.3f} ms/step, kernels {total:.3f} ms/step")
        for t, n, key in rows[:14]:
            print(f"  {t:8.3f} ms  x{n:<3d} {key[:110]}")


if __name__ == "__main__":
    main()
