"""Where the host time of fwd+bwd through the Gluon backward goes (GPU machine, Hopper).

    python3 scripts/host_ws_bwd.py

``culmen bench flash_attn``'s host column read 220-1040 us more for fwd+bwd through the Gluon backward than
through the Triton (deterministic) one. For d128 at 2k and 8k tokens per sequence (16k tokens) this prints the
host us per call (``culmen.bench.runner.host_us``: calls queued behind a sleeping GPU) of: the Gluon backward,
the Triton backward, and the Gluon backward with its fp32 dQ accumulator taken from a cache instead of a fresh
``torch.zeros`` per call; beside each, the caching allocator's device mallocs / frees / retries during the
measurement, and the top of a cProfile of two calls.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from functools import partial

import torch

from culmen.bench.runner import host_us
from culmen.flash_attn import flash_attn_func
from culmen.ops.attention import launch_ws
from culmen.ops.common.plans import clear_plans


def _stats() -> dict:
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                     "num_sync_all_streams")}


def main() -> None:
    dev = torch.device("cuda")
    orig_call = launch_ws.WsBackward.__call__
    cache: dict = {}

    def cached_acc_call(self, stream, q, k, v, dout, lse, delta, dq, dk, dv):
        acc = cache.get(self.acc_shape)
        if acc is None:
            acc = cache[self.acc_shape] = torch.empty(self.acc_shape, dtype=torch.float32, device=q.device)
        acc.zero_()
        rows, lse_st, sizes = self.ints
        self.launch(stream, True, q, k, v, dout, dk, dv, acc, lse, delta, *rows,
                    dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
                    *lse_st, *sizes)
        dq.copy_(acc[:, :self.sq])

    for s in (2048, 8192):
        for causal in (False, True):
            B, H, d = 16384 // s, 16, 128
            q, k, v = (torch.randn(B, s, H, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            g = torch.randn(B, s, H, d, device=dev, dtype=torch.bfloat16)

            def step(q=q, k=k, v=v, g=g, causal=causal, det=False):
                q.grad = k.grad = v.grad = None
                flash_attn_func(q, k, v, causal=causal, deterministic=det).backward(g)

            step_det = partial(step, det=True)

            for name, fn, patched in (("gluon bwd", step, False), ("triton bwd (deterministic)", step_det, False),
                                      ("gluon bwd, cached acc", step, True)):
                launch_ws.WsBackward.__call__ = cached_acc_call if patched else orig_call
                clear_plans()
                fn()
                fn()
                torch.cuda.synchronize()
                before = _stats()
                hus = [host_us(fn, dev) for _ in range(3)]
                after = _stats()
                delta = {k: after[k] - before[k] for k in before}
                print(f"d{d} s{s} {'causal' if causal else 'full':<6} {name:<28} host us "
                      f"{' '.join(f'{h:7.0f}' if h else '   sync' for h in hus)}  allocator {delta}", flush=True)
                torch.cuda.synchronize()
                torch.cuda._sleep(int(2e9))
                prof = cProfile.Profile()
                prof.enable()
                fn()
                fn()
                prof.disable()
                torch.cuda.synchronize()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(8)
                print("\n".join(line for line in out.getvalue().splitlines()[6:20] if line.strip()), flush=True)
    launch_ws.WsBackward.__call__ = orig_call


if __name__ == "__main__":
    main()
