"""Where the host time of fwd+bwd through the Gluon backward goes (GPU machine, Hopper).

    python3 scripts/host_ws_bwd.py

``culmen bench flash_attn``'s host column read 220-1040 us more for fwd+bwd through the Gluon backward than
through the Triton (deterministic) one. For d128 at 2k and 8k tokens per sequence (16k tokens) this prints the
host us per call (``culmen.bench.runner.host_us``: calls queued behind a sleeping GPU) of: the Gluon backward,
the Triton backward, and the Gluon backward with its fp32 dQ accumulator taken from a cache instead of a fresh
``torch.zeros`` per call; beside each, the caching allocator's device mallocs / frees / retries during the
measurement, and the top of a cProfile of two calls (the main thread only: the backward runs in autograd's
device thread). ``--launches``: instead, the host us spent inside each ``Launch`` call (Triton's launcher
included, both threads) per fwd+bwd, with whether the launch is bound to the direct path. ``--phases``: the host
us of the forward call, the ``backward()`` call, ``AttnPlan.backward`` and the Gluon backward's own steps.
``--torch-profile``: torch.profiler's CPU ops of both backwards.
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


def _inputs(s: int, causal: bool, det: bool):
    """``(q, k, v, dout)`` of d128 attention at ``s`` tokens a sequence (16k tokens, 16 heads), fresh plans and three
    warm-up fwd+bwd calls (``det``: deterministic, the Triton backward) done."""
    B, H, d = 16384 // s, 16, 128
    dev = torch.device("cuda")
    q, k, v = (torch.randn(B, s, H, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, s, H, d, device=dev, dtype=torch.bfloat16)
    clear_plans()
    for _ in range(3):
        flash_attn_func(q, k, v, causal=causal, deterministic=det).backward(g)
    torch.cuda.synchronize()
    return q, k, v, g


def launches() -> None:
    """Host us inside each kernel's ``Launch.__call__`` per fwd+bwd call (GPU asleep), Gluon vs Triton paths."""
    import statistics
    import sys
    import time
    from collections import defaultdict

    from culmen.ops.common import launch as common_launch

    orig = common_launch.Launch.__call__
    spent: dict = defaultdict(list)
    seen: dict = {}

    def timed(self, stream, aligned, *args):
        t0 = time.perf_counter()
        orig(self, stream, aligned, *args)
        name = getattr(self.fn, "__name__", None) or getattr(getattr(self.fn, "fn", None), "__name__", str(self.fn))
        spent[name].append(time.perf_counter() - t0)
        seen[name] = (self._run is not None, self.error)

    common_launch.Launch.__call__ = timed
    d = 128
    for s, causal, det in ((2048, False, False), (2048, False, True), (8192, True, False)):
        q, k, v, g = _inputs(s, causal, det)
        spent.clear()
        torch.cuda._sleep(int(3e9))
        t0 = time.perf_counter()
        n = 10
        for _ in range(n):
            q.grad = k.grad = v.grad = None
            flash_attn_func(q, k, v, causal=causal, deterministic=det).backward(g)
        total = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        print(f"d{d} s{s} {'causal' if causal else 'full'} {'triton bwd' if det else 'gluon bwd'}: "
              f"{total:.0f} us per fwd+bwd (GPU asleep)", flush=True)
        for name, ts in spent.items():
            print(f"    {name:<36} x{len(ts) // n}  median {statistics.median(ts) * 1e6:7.1f} us  max "
                  f"{max(ts) * 1e6:7.1f}  bound {seen[name][0]} {seen[name][1] or ''}", flush=True)
    common_launch.Launch.__call__ = orig
    sys.stdout.flush()


def phases() -> None:
    """Host us per fwd+bwd call (GPU asleep) split into: the whole ``AttnPlan.backward``, and inside the Gluon
    backward (``WsBackward.__call__``) the accumulator's ``torch.zeros``, the launch, the ``dq.copy_``; against the
    same call through the Triton backward."""
    import statistics
    import time
    from collections import defaultdict

    from culmen.ops.attention import launch as attn_launch

    spent: dict = defaultdict(list)
    orig_bwd = attn_launch.AttnPlan.backward

    def timed_bwd(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = orig_bwd(self, *args, **kwargs)
        spent["AttnPlan.backward"].append(time.perf_counter() - t0)
        return out

    def timed_ws(self, stream, q, k, v, dout, lse, delta, dq, dk, dv):
        t0 = time.perf_counter()
        acc = torch.zeros(self.acc_shape, dtype=torch.float32, device=q.device)
        t1 = time.perf_counter()
        rows, lse_st, sizes = self.ints
        self.launch(stream, True, q, k, v, dout, dk, dv, acc, lse, delta, *rows,
                    dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
                    *lse_st, *sizes)
        t2 = time.perf_counter()
        dq.copy_(acc[:, :self.sq])
        t3 = time.perf_counter()
        spent["  ws zeros"].append(t1 - t0)
        spent["  ws launch"].append(t2 - t1)
        spent["  ws dq copy"].append(t3 - t2)

    from culmen.ops.attention import op as attn_op

    orig_node = attn_op._AttnFn.backward

    def timed_node(ctx, *args):
        t0 = time.perf_counter()
        out = orig_node(ctx, *args)
        spent["_AttnFn.backward"].append(time.perf_counter() - t0)
        return out

    orig_ws = launch_ws.WsBackward.__call__
    attn_launch.AttnPlan.backward = timed_bwd
    launch_ws.WsBackward.__call__ = timed_ws
    attn_op._AttnFn.backward = staticmethod(timed_node)
    d = 128
    try:
        # the Triton backward both before and after the Gluon one at s2k: an order effect would show
        for s, causal, det in ((2048, False, True), (2048, False, False), (2048, False, True), (8192, True, False),
                               (8192, True, True)):
            q, k, v, g = _inputs(s, causal, det)
            spent.clear()
            torch.cuda._sleep(int(3e9))
            n = 10
            t0 = time.perf_counter()
            for _ in range(n):
                q.grad = k.grad = v.grad = None
                t1 = time.perf_counter()
                y = flash_attn_func(q, k, v, causal=causal, deterministic=det)
                spent["forward call"].append(time.perf_counter() - t1)
                t1 = time.perf_counter()
                y.backward(g)
                spent["backward() call"].append(time.perf_counter() - t1)
            total = (time.perf_counter() - t0) / n * 1e6
            torch.cuda.synchronize()
            print(f"d{d} s{s} {'causal' if causal else 'full'} {'triton' if det else 'gluon'} bwd: {total:.0f} us "
                  f"per fwd+bwd (GPU asleep)", flush=True)
            for name, ts in spent.items():
                print(f"    {name:<22} median {statistics.median(ts) * 1e6:7.1f} us  max {max(ts) * 1e6:7.1f}",
                      flush=True)
    finally:
        attn_launch.AttnPlan.backward = orig_bwd
        launch_ws.WsBackward.__call__ = orig_ws
        attn_op._AttnFn.backward = staticmethod(orig_node)


def torch_profile() -> None:
    """torch.profiler's CPU ops (both threads: the backward runs in autograd's device thread) of ten fwd+bwd
    calls queued behind a sleeping GPU, d128 s2k full, the Gluon backward against the Triton (deterministic)
    one: which op holds the host time ``--phases`` finds outside ``AttnPlan.backward``."""
    from torch.profiler import ProfilerActivity, profile

    for det in (False, True):
        q, k, v, g = _inputs(2048, False, det)
        torch.cuda._sleep(int(3e9))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                q.grad = k.grad = v.grad = None
                flash_attn_func(q, k, v, causal=False, deterministic=det).backward(g)
        torch.cuda.synchronize()
        print(f"== d128 s2048 full, {'triton' if det else 'gluon'} backward: 10 fwd+bwd, self CPU time", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60),
              flush=True)


def main() -> None:
    import sys

    if "--launches" in sys.argv:
        launches()
        return
    if "--phases" in sys.argv:
        phases()
        return
    if "--torch-profile" in sys.argv:
        torch_profile()
        return
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
