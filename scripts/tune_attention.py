"""Sweep block configs of the attention kernels on a GPU (run on the lent machine).

    python3 scripts/tune_attention.py --kind fwd --d 128 --seqlen 8192 [--configs "128,64,4,3 128,128,8,3"]

For each config of ``--kind`` (fwd / dkdv_atomic, the default backward / dkdv + dq, the deterministic
backward; the other kinds keep ``launch.TUNING``) it times
an ``AttnPlan``'s forward or backward (do_bench median) at batch*seqlen = 16k tokens, hidden 2048,
bf16, causal and not, checks the result against SDPA's flash backend, and prints TFLOP/s. Kernels
are compiled first in a pool of processes (Triton's on-disk cache), then timed in this process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULTS = {
    "fwd": "128,128,8,3 128,64,8,3 128,128,8,2 128,128,4,3 256,64,8,3 256,128,8,2 64,128,4,3 128,64,4,3",
    "dkdv": "64,128,8,2 64,128,8,3 32,128,4,3 32,128,8,3 64,64,4,3 32,64,4,4 64,128,4,2 128,128,8,2",
    "dq": "128,64,8,2 128,64,8,3 128,32,4,3 64,64,4,3 128,128,8,2 64,128,4,2 128,64,4,3",
    "dkdv_atomic": "64,128,8,3 64,128,8,2 32,128,8,3 64,64,4,3 32,64,4,3 128,128,8,2 64,128,4,3 128,64,8,2",
}


def _inputs(d, s, causal, dtype=torch.bfloat16, seed=0):
    h = 2048 // d
    B = max(1, 16384 // s)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(B, s, h, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    return q, k, v, do


def _set(kind, cfg, d):
    from culmen.ops.attention import launch

    launch.TUNING["tma"] = os.environ.get("CULMEN_ATTN_TMA", "0") == "1"
    bd = max(16, 1 << (d - 1).bit_length())
    launch.TUNING[kind] = [(bd, *cfg)]


def _run(kind, d, s, causal, q, k, v, do):
    from culmen.ops.attention.launch import AttnPlan

    # kinds dkdv / dq: the deterministic dQ-kernel path; dkdv_atomic needs TUNING["atomic_dq"].
    plan = AttnPlan("dense", q, k, v, None, softmax_scale=d ** -0.5, causal=causal,
                    deterministic=kind in ("dkdv", "dq"))
    out, lse, _ = plan.forward(q, k, v, None, None)
    if kind == "fwd":
        return (lambda: plan.forward(q, k, v, None, None)), (out,)
    return (lambda: plan.backward(do, q, k, v, out, lse, None, None)), plan.backward(do, q, k, v, out, lse, None, None)


def _warm(args):
    kind, cfg, d, s = args
    try:
        _set(kind, cfg, d)
        for causal in (False, True):
            q, k, v, do = _inputs(d, min(s, 1024), causal)
            fn, _ = _run(kind, d, s, causal, q, k, v, do)
            fn()
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # reported by the timing pass
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def _sdpa(q, k, v, do, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        grads = torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2))
    return o.transpose(1, 2), *(g.transpose(1, 2) for g in grads)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=list(DEFAULTS), required=True)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--configs", default=None, help="space-separated BLOCK_M,BLOCK_N,warps,stages")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workers", type=int, default=12)
    a = ap.parse_args()
    from triton.testing import do_bench

    cfgs = [tuple(int(x) for x in c.split(",")) for c in (a.configs or DEFAULTS[a.kind]).split()]
    with mp.get_context("spawn").Pool(min(a.workers, len(cfgs))) as pool:
        errors = pool.map(_warm, [(a.kind, c, a.d, a.seqlen) for c in cfgs])
    rows = []
    for causal in (False, True):
        q, k, v, do = _inputs(a.d, a.seqlen, causal)
        ref = _sdpa(q, k, v, do, causal)
        B, s, h, d = q.shape
        flops = 4 * B * h * s * s * d * (0.5 if causal else 1.0) * (1.0 if a.kind == "fwd" else 2.5)
        for cfg, err in zip(cfgs, errors):
            row = dict(kind=a.kind, d=a.d, seqlen=a.seqlen, causal=causal, cfg=cfg)
            if err:
                row["error"] = err
            else:
                try:
                    _set(a.kind, cfg, a.d)
                    fn, res = _run(a.kind, a.d, a.seqlen, causal, q, k, v, do)
                    mine = res if a.kind == "fwd" else res
                    theirs = ref[:1] if a.kind == "fwd" else ref[1:]
                    row["maxdiff"] = max((x.float() - y.float()).abs().max().item() for x, y in zip(mine, theirs))
                    ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
                    row["ms"] = ms
                    row["tflops"] = flops / ms / 1e9
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            tma = os.environ.get("CULMEN_ATTN_TMA", "0")
            print(f"tma={tma} {a.kind:5} d{a.d} s{a.seqlen} {'causal' if causal else 'full  '} {str(cfg):18} "
                  + (f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s diff {row['maxdiff']:.4f}"
                     if "ms" in row else row.get("error", "?")), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
