"""Sweep the FP8 forward's tile configs and its transposed-V copy on a GPU (run on the lent machine).

    python3 scripts/sweep_fp8.py [--seqlen 2048,8192]

At d 128, hidden 2048, batch * seqlen = 16k tokens, causal and not: culmen's bf16 forward and the FP8 forward
(float8_e4m3fn q/k/v, per-(batch, kv head) descales) under each row of ``ROWS`` (``launch.TUNING`` entries:
the transposed V copy ``fp8_v_t``, fp16 softmax numerators ``fp8_exp16``, the rotated loop ``fwd_overlap``,
tile configs). Prints wall ms (do_bench median of the eager call), TFLOP/s, the ratio to bf16 and the max
difference from the bf16 output. Kernels compile first in a pool of processes (Triton's disk cache).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (label, fp8 inputs, TUNING entries): tile rows are (BLOCK_M, BLOCK_N, warps, stages) for head dim 128
ROWS = [
    ("bf16", False, {}),
    ("bf16 tma overlap 128,128,8,2", False, {"tma": True, "fwd_overlap": True, "fwd": (128, 128, 8, 2)}),
    ("bf16 tma overlap 128,64,8,3", False, {"tma": True, "fwd_overlap": True, "fwd": (128, 64, 8, 3)}),
    ("bf16 overlap 128,128,8,2", False, {"fwd_overlap": True, "fwd": (128, 128, 8, 2)}),
    ("bf16 tma 256,128,16,2", False, {"tma": True, "fwd": (256, 128, 16, 2)}),
    ("fp8 tma overlap", True, {}),
    ("fp8 tma overlap 256,128,16,3", True, {"fwd_fp8": (256, 128, 16, 3)}),
    ("fp8 tma overlap 256,128,8,3", True, {"fwd_fp8": (256, 128, 8, 3)}),
    ("fp8 tma overlap 256,64,8,3", True, {"fwd_fp8": (256, 64, 8, 3)}),
    ("fp8 tma 256,128,16,3", True, {"fp8_overlap": False, "fwd_fp8": (256, 128, 16, 3)}),
    ("fp8 tma overlap 128,128,8,3 (again)", True, {"fwd_fp8": (128, 128, 8, 3)}),
]
DEFAULTS = {"fp8_v_t": True, "fp8_tma": True, "fp8_overlap": True, "tma": False, "fp8_exp16": False,
            "fwd_overlap": False}


def _set(settings):
    from culmen.ops.attention import launch

    base = _set.base = getattr(_set, "base", None) or {k: launch.TUNING[k] for k in ("fwd", "fwd_fp8")}
    launch.TUNING.update(dict(DEFAULTS, **base))
    for key, val in settings.items():
        launch.TUNING[key] = [(128, *val)] + base[key][2:] if key in base else val


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


def _warm(row):
    _, fp8, settings = row
    try:
        _set(settings)
        for causal in (False, True):
            args, kw = _inputs(1024, fp8)
            _call(args, kw, causal)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", default="2048,8192")
    ap.add_argument("--workers", type=int, default=12)
    a = ap.parse_args()
    from triton.testing import do_bench

    with mp.get_context("spawn").Pool(min(a.workers, len(ROWS))) as pool:
        errs = pool.map(_warm, ROWS)
    for s in (int(x) for x in a.seqlen.split(",")):
        for causal in (False, True):
            inputs = {False: _inputs(s, False), True: _inputs(s, True)}
            B = inputs[False][0][0].shape[0]
            flops = 4 * B * 16 * s * s * 128 * (0.5 if causal else 1.0)
            ref = base = None
            for (label, fp8, settings), err in zip(ROWS, errs):
                if err:
                    print(f"s{s} {'causal' if causal else 'full  '} {label:30} {err}", flush=True)
                    continue
                _set(settings)
                args, kw = inputs[fp8]
                out = _call(args, kw, causal)
                ref = out if ref is None else ref
                ms = do_bench(lambda a_=args, k_=kw, c_=causal: _call(a_, k_, c_), warmup=25, rep=200,
                              return_mode="median")
                base = base or ms
                diff = (out.float() - ref.float()).abs().max().item()
                print(f"s{s} {'causal' if causal else 'full  '} {label:30} {ms:8.3f} ms {flops / ms / 1e9:6.1f} "
                      f"TFLOP/s {base / ms:5.2f}x bf16  diff {diff:.4f}", flush=True)


if __name__ == "__main__":
    main()
