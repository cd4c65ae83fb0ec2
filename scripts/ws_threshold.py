"""Gluon against Triton attention kernels at short sequences (GPU machine, Hopper).

    python3 scripts/ws_threshold.py

For each shape (the train_step models' attention calls and the short cases of ``culmen bench flash_attn``):
wall ms (do_bench) of the forward with the Gluon forward on / off, and of fwd+bwd for the four combinations of
Gluon / Triton forward and backward (the backward's ``min_sk`` lifted so that it can take the call).
"""

from __future__ import annotations

import torch
import triton

from culmen.flash_attn import flash_attn_func
from culmen.ops.attention import launch_ws
from culmen.ops.common.plans import clear_plans

# (B, S, H, d): d768 / d512 / 1b train_step calls, then the short flash_attn bench cases (16k tokens)
SHAPES = [(8, 1024, 12, 64), (8, 512, 8, 64), (4, 2048, 16, 128), (16, 1024, 32, 64), (32, 512, 32, 64),
          (8, 2048, 32, 64), (16, 1024, 16, 128), (8, 2048, 16, 128)]


def _no_ws(*args, **kwargs) -> None:
    """Stands in for ``WsForward``: the plan then keeps the Triton forward (the backward's choice unchanged)."""
    return None


def main() -> None:
    dev = torch.device("cuda")
    min_sk = dict(launch_ws.WS_BWD_TUNING["min_sk"])
    ws_forward = launch_ws.WsForward
    cols = ("fwd ws", "fwd tri", "ws/ws", "ws/tri", "tri/ws", "tri/tri")
    print(f"{'shape':<30}" + "".join(f"{c:>9}" for c in cols) + "  (ms; fwd+bwd as fwd kernel / bwd kernel)")
    for B, S, H, d in SHAPES:
        for causal in (True, False):
            q, k, v = (torch.randn(B, S, H, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            g = torch.randn(B, S, H, d, device=dev, dtype=torch.bfloat16)

            def fwd(q=q, k=k, v=v, causal=causal):
                return flash_attn_func(q, k, v, causal=causal)

            def fwd_bwd(q=q, k=k, v=v, g=g, causal=causal):
                q.grad = k.grad = v.grad = None
                flash_attn_func(q, k, v, causal=causal).backward(g)

            row = []
            for fon in (True, False):
                launch_ws.WsForward = ws_forward if fon else _no_ws
                clear_plans()
                row.append(triton.testing.do_bench(fwd, warmup=25, rep=150))
            for fon, bon in ((True, True), (True, False), (False, True), (False, False)):
                launch_ws.WsForward = ws_forward if fon else _no_ws
                launch_ws.WS_BWD_TUNING["on"] = bon
                launch_ws.WS_BWD_TUNING["min_sk"] = {}
                clear_plans()
                try:
                    row.append(triton.testing.do_bench(fwd_bwd, warmup=25, rep=150))
                except Exception as exc:  # a combination the plans cannot make
                    print(f"   {fon}/{bon} failed: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                    row.append(float("nan"))
            launch_ws.WsForward = ws_forward
            launch_ws.WS_BWD_TUNING["on"] = True
            launch_ws.WS_BWD_TUNING["min_sk"] = min_sk
            name = f"B{B} S{S} H{H} d{d} {'causal' if causal else 'full'}"
            print(f"{name:<30}" + "".join(f"{x:9.3f}" for x in row), flush=True)


if __name__ == "__main__":
    main()
