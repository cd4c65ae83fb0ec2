"""Sweep the FP8 forward's tile configs and its transposed-V copy on a GPU (run on the lent machine).

    python3 scripts/sweep_fp8.py [--seqlen 2048,8192] [--configs "128,128,8,3 128,256,8,2"]

At d 128, hidden 2048, batch * seqlen = 16k tokens, causal and not: culmen's bf16 forward (``launch.TUNING``
"fwd"), then the FP8 forward (float8_e4m3fn q/k/v, per-(batch, kv head) descales) at each config of
``TUNING["fwd_fp8"]`` with V read through the transposed copy (``fp8_v_t``), and the first config with V read
as given. Prints wall ms (do_bench median of the eager call), TFLOP/s, the ratio to bf16 and the max
difference from the bf16 output. Kernels compile first in a pool of processes (Triton's disk cache).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = "128,128,8,3 128,128,8,4 128,256,8,2 128,64,8,4 128,128,4,3 256,128,8,2 64,128,4,4"


def _set(cfg, v_t):
    from culmen.ops.attention import launch

    launch.TUNING["fp8_v_t"] = v_t
    if cfg is not None:
        launch.TUNING["fwd_fp8"] = [(128, *cfg)]


def _inputs(s, fp8, seed=0):
    d, h = 128, 16
    B = max(1, 16384 // s)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    if not fp8:
        return (q, k, v), {}
    from culmen.flash_attn_3 import quantize_fp8

    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)


def _call(args, kw, causal):
    import culmen.flash_attn_3 as fa3

    return fa3.flash_attn_func(*args, causal=causal, **kw)


def _warm(job):
    cfg, v_t = job
    try:
        _set(cfg, v_t)
        for causal in (False, True):
            args, kw = _inputs(1024, cfg is not None or v_t is not None)
            _call(args, kw, causal)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", default="2048,8192")
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--workers", type=int, default=12)
    a = ap.parse_args()
    from triton.testing import do_bench

    cfgs = [tuple(int(x) for x in c.split(",")) for c in a.configs.split()]
    rows = [("bf16", None, None)] + [(f"fp8 {c} v_t", c, True) for c in cfgs] + [(f"fp8 {cfgs[0]} v", cfgs[0], False)]
    jobs = [(c, vt) for _, c, vt in rows]
    with mp.get_context("spawn").Pool(min(a.workers, len(jobs))) as pool:
        errs = dict(zip(map(str, jobs), pool.map(_warm, jobs)))
    for s in (int(x) for x in a.seqlen.split(",")):
        for causal in (False, True):
            bf_args, _ = _inputs(s, False)
            f8_args, f8_kw = _inputs(s, True)
            B = bf_args[0].shape[0]
            flops = 4 * B * 16 * s * s * 128 * (0.5 if causal else 1.0)
            ref = None
            base = None
            for label, cfg, v_t in rows:
                err = errs[str((cfg, v_t))]
                if err:
                    print(f"s{s} {'causal' if causal else 'full  '} {label:28} {err}", flush=True)
                    continue
                _set(cfg, v_t if v_t is not None else True)
                args, kw = (bf_args, {}) if cfg is None else (f8_args, f8_kw)
                out = _call(args, kw, causal)
                if ref is None:
                    ref = out
                ms = do_bench(lambda a_=args, k_=kw, c_=causal: _call(a_, k_, c_), warmup=25, rep=200,
                              return_mode="median")
                base = base or ms
                diff = (out.float() - ref.float()).abs().max().item()
                print(f"s{s} {'causal' if causal else 'full  '} {label:28} {ms:8.3f} ms {flops / ms / 1e9:6.1f} "
                      f"TFLOP/s {base / ms:5.2f}x bf16  diff {diff:.4f}", flush=True)


if __name__ == "__main__":
    main()
