"""Sweep block configs of the attention kernels on a GPU (run on the lent machine).

    python3 scripts/tune_attention.py --kind fwd --d 128 --seqlen 8192 [--configs "128,64,4,3 128,128,8,3"]
    python3 scripts/tune_attention.py --kind dkdv_tma --d 64,128 --seqlen 2048,8192 --gqa 1,4

For each config of ``--kind`` (fwd / dkdv_atomic, the element-atomic dQ backward / dkdv_tma, the TMA
reduce-add dQ backward / dkdv + dq, the deterministic backward; the other kinds keep ``launch.TUNING``)
it times an ``AttnPlan``'s forward or backward (do_bench median) at batch*seqlen = 16k tokens, hidden
2048, bf16, causal and not, checks the result against SDPA's flash backend (dq/dk/dv for the backward
kinds; GQA against SDPA on repeated K/V heads, dK/dV summed back), and prints TFLOP/s. ``--d``,
``--seqlen`` and ``--gqa`` (query heads per KV head) take comma lists: every combination is timed.
``dkdv_atomic`` / ``dkdv_tma`` also time, per case, the deterministic backward and the element-atomic one
at ``launch.TUNING``'s configs ("det" / "atomic" rows), so the variant is compared in the same process.
Kernels are compiled first in a pool of processes (Triton's on-disk cache), then timed in this process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULTS = {
    # 256-row tiles on 16 warps: FA3-like two-warpgroup query tiles.
    "fwd": "128,128,8,3 128,64,8,3 128,128,8,2 128,128,4,3 256,64,8,3 256,128,8,2 64,128,4,3 128,64,4,3 "
           "256,128,16,3 256,64,16,2",
    "dkdv": "64,128,8,2 64,128,8,3 32,128,4,3 32,128,8,3 64,64,4,3 32,64,4,4 64,128,4,2 128,128,8,2",
    "dq": "128,64,8,2 128,64,8,3 128,32,4,3 64,64,4,3 128,128,8,2 64,128,4,2 128,64,4,3",
    "dkdv_atomic": "64,128,8,3 64,128,8,2 32,128,8,3 64,64,4,3 32,64,4,3 128,128,8,2 64,128,4,3 128,64,8,2",
    # the dQ tile (BLOCK_M x d fp32) is staged in shared memory for the bulk reduce: fewer stages fit
    "dkdv_tma": "64,128,8,3 64,128,8,2 32,128,4,3 64,64,4,3",
}
_MAXNREG0 = None  # launch.TUNING["bwd_maxnreg"] as shipped: the caps every row keeps but the swept kernel's
BASELINES = {"dkdv_atomic": ("det",), "dkdv_tma": ("det", "atomic")}


def _inputs(d, s, gqa=1, dtype=torch.bfloat16, seed=0):
    h = 2048 // d
    B = max(1, 16384 // s)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(B, s, h, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(B, s, h // gqa, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    return q, k, v, do


def _set(kind, label, cfg, d):
    """``launch.TUNING`` for one timed row: ``label`` "cfg" (``cfg`` of ``kind``), "det" or "atomic"."""
    from culmen.ops.attention import launch

    launch.TUNING["tma"] = os.environ.get("CULMEN_ATTN_TMA", "0") == "1"
    launch.TUNING["atomic_dq"] = label == "atomic" or (label == "cfg" and kind == "dkdv_atomic")
    launch.TUNING["tma_dq"] = label == "cfg" and kind == "dkdv_tma"
    global _MAXNREG0
    if _MAXNREG0 is None:
        _MAXNREG0 = dict(launch.TUNING["bwd_maxnreg"])
    caps = dict(_MAXNREG0)
    if label == "cfg":
        bd = max(16, 1 << (d - 1).bit_length())
        launch.TUNING[kind] = [(bd, *cfg[:4])]
        caps.pop((kind, bd), None)
        if len(cfg) > 4 and cfg[4]:  # a fifth number: the ptxas register cap of a backward kernel
            caps[(kind, bd)] = cfg[4]
    launch.TUNING["bwd_maxnreg"] = caps


def _run(kind, label, d, causal, q, k, v, do):
    from culmen.ops.attention.launch import AttnPlan

    # kinds dkdv / dq and the "det" rows: the deterministic dQ-kernel path.
    plan = AttnPlan("dense", q, k, v, None, softmax_scale=d ** -0.5, causal=causal,
                    deterministic=kind in ("dkdv", "dq") or label == "det")
    out, lse, _ = plan.forward(q, k, v, None, None)
    if kind == "fwd":
        return (lambda: plan.forward(q, k, v, None, None)), (out,), plan
    res = plan.backward(do, q, k, v, out, lse, None, None)
    return (lambda: plan.backward(do, q, k, v, out, lse, None, None)), res, plan


def _warm(args):
    kind, label, cfg, d, s, gqa = args
    try:
        _set(kind, label, cfg, d)
        for causal in (False, True):
            q, k, v, do = _inputs(d, min(s, 1024), gqa)
            fn, _, _ = _run(kind, label, d, causal, q, k, v, do)
            fn()
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # reported by the timing pass
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def _sdpa(q, k, v, do, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(qt, kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1),
                                           is_causal=causal)
        grads = torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2))
    return o.transpose(1, 2), *(t.transpose(1, 2) for t in grads)


def _cudnn_fwd(q, k, v, causal):
    """SDPA's cuDNN forward on the same inputs (``(B, h, s, d)`` views, GQA by ``enable_gqa``)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
    return run


def _ints(text):
    return [int(x) for x in str(text).split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=list(DEFAULTS), required=True)
    ap.add_argument("--d", default="128", help="head dims, comma-separated")
    ap.add_argument("--seqlen", default="8192", help="sequence lengths, comma-separated")
    ap.add_argument("--gqa", default="1", help="query heads per KV head, comma-separated")
    ap.add_argument("--configs", default=None,
                    help="space-separated BLOCK_M,BLOCK_N,warps,stages[,maxnreg (backward kinds)]")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    a = ap.parse_args()
    from triton.testing import do_bench

    cfgs = [tuple(int(x) for x in c.split(",")) for c in (a.configs or DEFAULTS[a.kind]).split()]
    rows_spec = [(b, None) for b in BASELINES.get(a.kind, ())] + [("cfg", c) for c in cfgs]
    cases = list(itertools.product(_ints(a.d), _ints(a.seqlen), _ints(a.gqa)))
    # compile once per (row, head dim, GQA factor): every seqlen shares the kernels (the head counts do not)
    warm = sorted({(a.kind, lab, c, d, 1024, g) for lab, c in rows_spec for d, _, g in cases}, key=str)
    with mp.get_context("spawn").Pool(min(a.workers, len(warm))) as pool:
        errs = dict(zip(warm, pool.map(_warm, warm)))
    rows = []
    tma = os.environ.get("CULMEN_ATTN_TMA", "0")
    for d, s, gqa in cases:
        for causal in (False, True):
            q, k, v, do = _inputs(d, s, gqa)
            ref = _sdpa(q, k, v, do, causal)
            B, _, h, _ = q.shape
            flops = 4 * B * h * s * s * d * (0.5 if causal else 1.0) * (1.0 if a.kind == "fwd" else 2.5)
            if a.kind == "fwd":  # the peer to beat, same inputs, same process
                row = dict(kind=a.kind, d=d, seqlen=s, gqa=gqa, causal=causal, row="cudnn", cfg=None)
                try:
                    ms = do_bench(_cudnn_fwd(q, k, v, causal), warmup=25, rep=a.rep, return_mode="median")
                    row.update(ms=ms, tflops=flops / ms / 1e9)
                    print(f"tma={tma} fwd   d{d} s{s} gqa{gqa} {'causal' if causal else 'full  '} {'cudnn':18} "
                          f"{ms:8.3f} ms {row['tflops']:6.1f} TFLOP/s", flush=True)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
            for label, cfg in rows_spec:
                row = dict(kind=a.kind, d=d, seqlen=s, gqa=gqa, causal=causal, row=label, cfg=cfg)
                err = errs[(a.kind, label, cfg, d, 1024, gqa)]
                if err:
                    row["error"] = err
                else:
                    try:
                        _set(a.kind, label, cfg, d)
                        fn, res, plan = _run(a.kind, label, d, causal, q, k, v, do)
                        row["tma_dq"] = bool(getattr(plan, "tma_dq", False))
                        theirs = ref[:1] if a.kind == "fwd" else ref[1:]
                        row["maxdiff"] = max((x.float() - y.float()).abs().max().item() for x, y in zip(res, theirs))
                        ms = do_bench(fn, warmup=25, rep=a.rep, return_mode="median")
                        row["ms"] = ms
                        row["tflops"] = flops / ms / 1e9
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
                name = str(cfg) if label == "cfg" else label
                print(f"tma={tma} {a.kind:5} d{d} s{s} gqa{gqa} {'causal' if causal else 'full  '} {name:18} "
                      + (f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s diff {row['maxdiff']:.4f}"
                         + (" (tma_dq)" if row["tma_dq"] else "") if "ms" in row else row.get("error", "?")),
                      flush=True)
            del q, k, v, do, ref
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
