"""Device time of culmen's attention backward kernels against SDPA's cuDNN backward, kernel by kernel
(run on the lent machine; under ``ncu`` for hardware counters).

    python3 scripts/profile_attn_bwd.py [--d 64] [--seqlen 2048] [--heads 32] [--kv-heads 8] [--batch 4]
        [--full] [--once] [--tuning KEY=VALUE ...] [--dkdv BM,BN,W,S] [--dq BM,BN,W,S]

Default case: LLaMA-3.2-1B training attention (b4 x s2048, 32 query heads over 8 KV heads, d64, causal, bf16).
Prints wall ms of the backward alone (do_bench median): culmen's ``AttnPlan.backward`` and SDPA-cuDNN's backward
through autograd on the same values (K/V repeated to the query heads for cuDNN), and each CUDA kernel's device
time per call (torch.profiler). ``--once`` runs each backward once after warm-up and exits (for ``ncu``).
``--dkdv`` / ``--dq`` override the deterministic backward's tiles (``launch.TUNING``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(text: str, d: int):
    bd = max(16, 1 << (d - 1).bit_length())
    return [(bd, *(int(x) for x in text.split(",")))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--full", action="store_true", help="not causal")
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--tuning", nargs="*", default=[])
    ap.add_argument("--dkdv", default=None)
    ap.add_argument("--dq", default=None)
    a = ap.parse_args()
    import triton.testing

    from culmen.ops.attention import launch
    from culmen.ops.attention.launch import AttnPlan

    for kv in a.tuning:
        key, val = kv.split("=")
        launch.TUNING[key] = bool(int(val)) if val in ("0", "1") else int(val)
    if a.dkdv:
        launch.TUNING["dkdv"] = _cfg(a.dkdv, a.d)
    if a.dq:
        launch.TUNING["dq"] = _cfg(a.dq, a.d)
    causal = not a.full
    B, S, H, HK, D = a.batch, a.seqlen, a.heads, a.kv_heads, a.d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(B, S, HK, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    plan = AttnPlan("dense", q, k, v, None, softmax_scale=D ** -0.5, causal=causal, deterministic=True)
    out, lse, _ = plan.forward(q, k, v, None, None)

    def ours():
        return plan.backward(do, q, k, v, out, lse, None, None)

    # cuDNN on BHSD leaf tensors, K/V repeated to the query heads; its backward through autograd
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt = q.transpose(1, 2).detach().requires_grad_()
    kt, vt = (t.transpose(1, 2).repeat_interleave(H // HK, 1).detach().requires_grad_() for t in (k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o_c = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=D ** -0.5)
    dot_ = do.transpose(1, 2)

    def cudnn():
        return torch.autograd.grad(o_c, (qt, kt, vt), dot_, retain_graph=True)

    flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0) * 2.5
    for name, fn in (("culmen", ours), ("cudnn", cudnn)):
        fn()
        torch.cuda.synchronize()
        if a.once:
            continue
        ms = triton.testing.do_bench(fn, warmup=25, rep=200)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        rows = sorted(((e.device_time_total / 5 / 1000, e.count // 5, e.key) for e in prof.key_averages()
                       if e.device_time_total > 0), reverse=True)
        print(f"== {name} d{D} s{S} h{H}/{HK} b{B} {'causal' if causal else 'full'}: backward {ms:.3f} ms "
              f"({flops / ms / 1e9:.0f} TFLOP/s), kernels {sum(r[0] for r in rows):.3f} ms")
        for t, n, key in rows[:6]:
            print(f"  {t:8.3f} ms  x{n:<2d} {key[:100]}")
    if a.once:
        torch.cuda.synchronize()
        print("tiles", launch.TUNING.get("dkdv"), launch.TUNING.get("dq"))


if __name__ == "__main__":
    main()
