"""Sweep the GroupNorm launch rules on a GPU (run on the lent machine).

    python3 scripts/tune_group_norm.py [--mode fwd+bwd] [--configs "tile,warps,max_block_d_cl,l2_mb ..."]

For each config it sets ``culmen.ops.group_norm.launch.TUNING`` (tile elements, warps, widest
channels-last channel block, L2 budget of the fused schedule in MiB; 0 = one program per group), times
``group_norm`` (+ SiLU) on the Stable-Diffusion shapes of ``culmen bench group_norm`` in NCHW and
channels-last with ``do_bench`` (median), checks the output against ``F.group_norm`` + ``F.silu``, and
prints GB/s (fewest bytes: fwd reads x and writes y; bwd reads dy and x and writes dx) and the
percentage of the measured copy bandwidth. The fastest config per case is marked.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [(8, 512, 64, 64), (8, 1280, 32, 32), (16, 320, 128, 128), (1, 640, 64, 64)]
DEFAULT_CONFIGS = "4096,8,64,32 4096,8,64,0 8192,8,64,32 8192,16,64,32 2048,4,64,32 4096,16,64,32 4096,8,32,32"


def copy_gbps() -> float:
    from triton.testing import do_bench

    src = torch.empty(1 << 28, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() * 4 / ms / 1e6


def main() -> None:
    from triton.testing import do_bench

    from culmen.ops.group_norm import group_norm, launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="fwd+bwd", choices=["fwd", "fwd+bwd"])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    roof = copy_gbps()
    print(f"copy bandwidth {roof:.0f} GB/s; mode {args.mode}; {args.dtype}; silu")
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split()]
    for shape in SHAPES:
        for layout in ("nchw", "nhwc"):
            x = torch.randn(shape, device="cuda", dtype=dtype)
            if layout == "nhwc":
                x = x.contiguous(memory_format=torch.channels_last)
            C = shape[1]
            w = torch.randn(C, device="cuda", dtype=dtype)
            b = torch.randn(C, device="cuda", dtype=dtype)
            grad = args.mode == "fwd+bwd"
            x.requires_grad_(grad)
            w.requires_grad_(grad)
            b.requires_grad_(grad)
            dy = torch.randn_like(x) if grad else None
            ref = F.silu(F.group_norm(x.float(), 32, w.float(), b.float(), 1e-5)).to(dtype)
            nbytes = x.numel() * x.element_size() * (5 if grad else 2)

            def run(x=x, w=w, b=b, dy=dy, grad=grad):
                if not grad:
                    with torch.no_grad():
                        return group_norm(x, 32, w, b, 1e-5, "silu")
                y = group_norm(x, 32, w, b, 1e-5, "silu")
                torch.autograd.grad(y, (x, w, b), dy)
                return y

            results = []
            for tile, warps, bdc, l2 in configs:
                launch.TUNING.update(tile=tile, num_warps=warps, max_block_d_cl=bdc, fused_l2_budget=l2 << 20)
                try:
                    err = (run().float() - ref.float()).abs().max().item()
                    ms = do_bench(run, warmup=25, rep=100, return_mode="median")
                    results.append((ms, (tile, warps, bdc, l2), err))
                except Exception as exc:  # report and go on with the next config
                    print(f"  {shape} {layout} {(tile, warps, bdc, l2)} failed: {type(exc).__name__}: {exc}")
            best = min(r[0] for r in results) if results else None
            for ms, cfg, err in results:
                gbps = nbytes / ms / 1e6
                mark = " <- best" if ms == best else ""
                print(f"{'x'.join(map(str, shape)):>16} {layout} tile,warps,bdc,l2MiB={cfg}: {ms:8.3f} ms "
                      f"{gbps:7.0f} GB/s {100 * gbps / roof:5.1f}% of copy  max|y-ref|={err:.3g}{mark}")


if __name__ == "__main__":
    main()
