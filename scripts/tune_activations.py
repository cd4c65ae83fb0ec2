"""Where the activation / MLP benchmarks spend their time, and sweeps of the activation launch rules.

Usage (GPU machine)::

    python3 scripts/tune_activations.py profile [--providers culmen,torch,liger] [--only SUBSTR,...] [--trace]
    python3 scripts/tune_activations.py dbias [--budget SECONDS]
    python3 scripts/tune_activations.py prefetch [--json PATH]
    python3 scripts/tune_activations.py host
    python3 scripts/tune_activations.py bench NAME ... --log PATH [--json PATH] [--tuning overrides.json]
    python3 scripts/tune_activations.py sweep [--timer graph|wall] [NAME ...]

``profile``: for every case of the activation and MLP benchmarks, per provider: ``wall``
(``do_bench``, host cost included: what ``culmen bench`` reports), ``graph`` (CUDA-graph replay:
device time only) and ``host`` (wall time per call at the quick shape, where the device work is
negligible). A case is host-bound when wall is well above graph and close to host. ``--trace`` lists
culmen's kernels of one call (torch.profiler) for the fwd+bwd cases.

``dbias``: device time of the fused activation-backward + bias-gradient pass (``act_bwd`` with
``want_dbias``) over a grid of its tile / split settings, next to the same pass without the bias
gradient (the bandwidth it should reach).

``prefetch``: the bias-grad passes with ``TUNING["dbias_prefetch"]`` off and on, the host cost of a
do-nothing ``autograd.Function`` next to torch's own ReLU, and the better setting as JSON.

``host``: host cost per fwd+bwd call at tiny shapes: torch, a do-nothing ``autograd.Function``, culmen.

``sweep``: one-at-a-time changes of ``culmen.ops.activations.launch.TUNING`` over the registered
benchmark cases (culmen's provider only; ``culmen bench`` has the peers).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from culmen.bench.tuning import host_us, sweep_tuning  # noqa: E402
from culmen.ops.activations import act_bwd, launch  # noqa: E402
from culmen.ops.activations.op import act_plan  # noqa: E402

GRID = {
    "block_elems": [1024, 2048, 8192, 16384],
    "warps": [2, 8, 16],
    "max_block_n": [256, 512, 2048],
    "dbias_block_m": [8, 16, 64],
    "dbias_block_n": [64, 256, 512],
    "dbias_warps": [2, 8],
    "dbias_programs_per_sm": [2, 4, 16],
}

BENCHES = ["bias_gelu", "bias_gelu_erf", "relu", "sqrelu", "swiglu", "geglu", "fused_mlp", "fused_mlp_relu",
           "fused_dense_gelu_dense", "apex_mlp"]

DBIAS_GRID = {
    "dbias_block_m": [8, 16, 32, 64],
    "dbias_block_n": [64, 128, 256],
    "dbias_warps": [4, 8],
    "dbias_programs_per_sm": [4, 8, 16],
}
DBIAS_SHAPES = [(8192, 16384, "gelu_tanh"), (16384, 4096, "gelu_tanh"), (8192, 4096, "gelu_tanh"),
                (16384, 4096, "gelu")]


def trace(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]
    kern = "; ".join(f"{k[:50]} x{c} {t:.1f}us" for k, c, t in sorted(rows, key=lambda r: -r[2])[:10])
    api = {e.key: e.count for e in prof.key_averages() if e.key.startswith(("cuda", "cu"))}
    return kern + "\n   runtime calls: " + ", ".join(f"{k} x{c}" for k, c in sorted(api.items()))


def profile_main(argv: list[str]) -> None:
    from triton.testing import do_bench, do_bench_cudagraph

    from culmen.bench.registry import BenchConfig, load_benchmarks, select_benchmarks

    ap = argparse.ArgumentParser(prog="tune_activations.py profile")
    ap.add_argument("--providers", default="culmen,torch,liger")
    ap.add_argument("--only", default="", help="comma-separated substrings of '<bench> <case>' to keep")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("names", nargs="*", default=BENCHES)
    args = ap.parse_args(argv)
    want = args.providers.split(",")
    load_benchmarks()
    dev = torch.device("cuda")
    for bench in select_benchmarks(args.names):
        quick = {c.label.split(" ", 1)[1]: c for c in bench.cases(BenchConfig(device=dev, quick=True))}
        for case in bench.cases(BenchConfig(device=dev)):
            label = f"{bench.name} {case.label}"
            if args.only and not any(o in label for o in args.only.split(",")):
                continue
            tag = case.label.split(" ", 1)[1]
            parts = []
            for name in want:
                fn = case.providers.get(name)
                if fn is None:
                    continue
                try:
                    w = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    g = do_bench_cudagraph(fn, rep=60, return_mode="median")
                except Exception as exc:  # a provider that cannot be captured still gets its wall time
                    parts.append(f"{name}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                    continue
                q = quick.get(tag)
                h = host_us(q.providers[name]) if q is not None and name in q.providers else float("nan")
                rate = (f"{case.bytes / (g * 1e6):.0f} GB/s dev" if case.bytes else
                        f"{case.flops / (g * 1e9):.0f} TFLOP/s dev" if case.flops else "")
                parts.append(f"{name}: wall {w:.4f} graph {g:.4f} ms ({rate}) host {h:.0f} us")
            print(f"{label}: " + " | ".join(parts), flush=True)
            if args.trace and "fwd+bwd" in case.label:
                print("   kernels:", trace(case.providers["culmen"]), flush=True)
            del case
            torch.cuda.empty_cache()


def dbias_main(argv: list[str]) -> None:
    from triton.testing import do_bench_cudagraph

    ap = argparse.ArgumentParser(prog="tune_activations.py dbias")
    ap.add_argument("--budget", type=float, default=45.0, help="seconds per shape")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    base = dict(launch.TUNING)
    keys = list(DBIAS_GRID)
    for M, N, act in DBIAS_SHAPES:
        g = torch.randn(M, N, device=dev).to(torch.bfloat16)
        x = (torch.randn(M, N, device=dev) * 2).to(torch.bfloat16)
        b = torch.randn(N, device=dev).to(torch.bfloat16)
        gb = 3 * M * N * 2 + 2 * N * 2

        def run(want_db=True, g=g, x=x, b=b, act=act):
            return act_bwd(g, x, b, act, dbias_dtype=torch.bfloat16 if want_db else None)

        launch.TUNING.update(base)
        ref = do_bench_cudagraph(lambda run=run: run(False), rep=40, return_mode="median")
        default = do_bench_cudagraph(run, rep=40, return_mode="median")
        res = []
        t0 = time.perf_counter()
        for vals in itertools.product(*(DBIAS_GRID[k] for k in keys)):
            if time.perf_counter() - t0 > args.budget:
                break
            launch.TUNING.update(base)
            launch.TUNING.update(dict(zip(keys, vals)))
            try:
                res.append((do_bench_cudagraph(run, rep=20, return_mode="median"), vals))
            except Exception as exc:
                print(f"  {dict(zip(keys, vals))} failed: {type(exc).__name__}", flush=True)
        launch.TUNING.update(base)
        res.sort()
        print(f"dbias {act} {M}x{N}: no-dbias pass {ref:.4f} ms ({gb / (ref * 1e6):.0f} GB/s); default "
              f"{default:.4f} ms ({gb / (default * 1e6):.0f} GB/s); {len(res)} settings; best " +
              ", ".join(f"{'/'.join(map(str, v))}:{t:.4f}" for t, v in res[:6]) +
              f" (order {'/'.join(keys)})", flush=True)
        del g, x, b
        torch.cuda.empty_cache()


def prefetch_main(argv: list[str]) -> None:
    """Device time of the bias-grad passes with ``dbias_prefetch`` off / on (GELU and ReLU's bit-mask
    pass), the better setting as JSON (``--json``), then ``host``."""
    import json
    import math

    from triton.testing import do_bench_cudagraph

    ap = argparse.ArgumentParser(prog="tune_activations.py prefetch")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    base = dict(launch.TUNING)
    ratios = []
    for M, N, act in DBIAS_SHAPES + [(8192, 16384, "relu"), (16384, 4096, "relu")]:
        g = torch.randn(M, N, device=dev).to(torch.bfloat16)
        x = (torch.randn(M, N, device=dev) * 2).to(torch.bfloat16)
        b = torch.randn(N, device=dev).to(torch.bfloat16)
        if act == "relu":
            _, mask = act_plan(x, b, act).forward_mask(x, b)

            def run(g=g, x=x, b=b, mask=mask):
                # The plan is looked up per run: a TUNING change drops the cached plans.
                return act_plan(x, b, "relu").backward_mask(g, mask, True)
            gb = 2 * M * N * 2 + M * N // 8
        else:
            def run(g=g, x=x, b=b, act=act):
                return act_bwd(g, x, b, act, dbias_dtype=torch.bfloat16)
            gb = 3 * M * N * 2
        times = {}
        for pf in (False, True):
            launch.TUNING.update(base)
            launch.TUNING["dbias_prefetch"] = pf
            times[pf] = do_bench_cudagraph(run, rep=50, return_mode="median")
        ratios.append(times[False] / times[True])
        print(f"prefetch {act} {M}x{N}: off {times[False]:.4f} ms ({gb / (times[False] * 1e6):.0f} GB/s), on "
              f"{times[True]:.4f} ms ({gb / (times[True] * 1e6):.0f} GB/s)", flush=True)
        del g, x, b, run
        torch.cuda.empty_cache()
    launch.TUNING.update(base)
    geo_mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    best = {"dbias_prefetch": geo_mean > 1.01}
    print(f"prefetch on/off speedup geomean {geo_mean:.3f} -> {best}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best, f)

    host_main([])


CANDIDATES: list[dict] = [{"warps": 8}, {"block_elems": 8192, "warps": 8}, {"block_elems": 2048}]


def choose_main(argv: list[str]) -> None:
    """Device time (CUDA-graph replay) of culmen's provider of every case of the elementwise benchmarks
    under the default ``TUNING`` and under each of ``CANDIDATES``; the candidate with the best geomean
    (if better than the default by > 1%) is merged into the JSON file ``--json`` (read first if present)."""
    import json
    import math

    from triton.testing import do_bench_cudagraph

    from culmen.bench.registry import BenchConfig, load_benchmarks, select_benchmarks

    ap = argparse.ArgumentParser(prog="tune_activations.py choose")
    ap.add_argument("--json", default=None)
    ap.add_argument("names", nargs="*", default=["relu", "bias_gelu", "sqrelu", "swiglu"])
    args = ap.parse_args(argv)
    load_benchmarks()
    dev = torch.device("cuda")
    base = dict(launch.TUNING)
    options = [{}] + CANDIDATES
    logs = [0.0] * len(options)
    count = 0
    for bench in select_benchmarks(args.names):
        for case in bench.cases(BenchConfig(device=dev)):
            fn = case.providers["culmen"]
            times = []
            for opt in options:
                launch.TUNING.update(base)
                launch.TUNING.update(opt)
                times.append(do_bench_cudagraph(fn, rep=40, return_mode="median"))
            count += 1
            for i, t in enumerate(times):
                logs[i] += math.log(times[0] / t)
            print(f"{bench.name} {case.label}: " + ", ".join(f"{opt or 'default'} {t:.4f}" for opt, t in
                                                              zip(options, times)), flush=True)
            del case, fn
            torch.cuda.empty_cache()
    launch.TUNING.update(base)
    gains = [math.exp(v / max(count, 1)) for v in logs]
    best = max(range(len(options)), key=lambda i: gains[i])
    print("speedup geomean vs default: " + ", ".join(f"{opt or 'default'} {g:.3f}" for opt, g in
                                                                  zip(options, gains)), flush=True)
    chosen = options[best] if gains[best] > 1.01 else {}
    print(f"chosen: {chosen or 'default'}", flush=True)
    if args.json:
        cur = {}
        if os.path.exists(args.json):
            with open(args.json) as f:
                cur = json.load(f)
        cur.update(chosen)
        with open(args.json, "w") as f:
            json.dump(cur, f)


def host_main(argv: list[str]) -> None:
    """Host cost per fwd+bwd call at a tiny shape (min of 5 rounds): torch's ReLU, a do-nothing
    ``autograd.Function`` (the floor of every Python-level op), culmen's activations, and a
    1024-4096-1024 MLP step (torch eager vs culmen's FusedMLP) at 64 tokens."""
    import torch.nn.functional as F

    from culmen.flash_attn.ops.fused_dense import fused_mlp_func
    from culmen.ops.activations import bias_act

    dev = torch.device("cuda")

    class _Nop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return torch.empty_like(t)

        @staticmethod
        def backward(ctx, g):
            return torch.empty_like(g)

    t = torch.randn(64, 256, device=dev, requires_grad=True)
    dy = torch.randn(64, 256, device=dev)
    w1 = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    b1 = torch.randn(4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(1024, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    b2 = torch.randn(1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    xm = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dym = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16)

    def step(f):
        def run():
            t.grad = None
            f(t).backward(dy)
        return run

    def mlp(f):
        def run():
            for p in (xm, w1, b1, w2, b2):
                p.grad = None
            f().backward(dym)
        return run

    cases = {"torch relu": step(F.relu), "no-op autograd.Function": step(_Nop.apply),
             "culmen relu": step(lambda v: bias_act(v, None, "relu")),
             "culmen gelu_tanh": step(lambda v: bias_act(v, None, "gelu_tanh")),
             "torch MLP": mlp(lambda: F.linear(F.gelu(F.linear(xm, w1, b1), approximate="tanh"), w2, b2)),
             "culmen FusedMLP": mlp(lambda: fused_mlp_func(xm, w1, w2, b1, b2, activation="gelu_approx"))}
    best_us = {k: min(host_us(f, 200) for _ in range(5)) for k, f in cases.items()}
    print("host fwd+bwd per call (min of 5): " + ", ".join(f"{k} {v:.0f} us" for k, v in best_us.items()), flush=True)


def bench_main(argv: list[str]) -> None:
    """``culmen bench NAMES`` (same runner, same output) with ``launch.TUNING`` overrides from a JSON file
    (e.g. the one ``prefetch --json`` wrote), so a setting measured earlier in the same session is used."""
    import json

    from culmen.bench.runner import run_benchmarks

    ap = argparse.ArgumentParser(prog="tune_activations.py bench")
    ap.add_argument("names", nargs="+")
    ap.add_argument("--tuning", default=None, help="JSON file of TUNING overrides (ignored when missing)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--log", required=True)
    args = ap.parse_args(argv)
    if args.tuning and os.path.exists(args.tuning):
        with open(args.tuning) as f:
            launch.TUNING.update(json.load(f))
    with open(args.log, "w") as out:
        print(f"activation TUNING: {dict(launch.TUNING)}", file=out)
        run_benchmarks(args.names, json_path=args.json, out=out)


def main() -> None:
    argv = sys.argv[1:]
    cmd = argv[0] if argv and argv[0] in ("profile", "dbias", "prefetch", "choose", "host", "bench",
                                          "sweep") else "sweep"
    rest = argv[1:] if argv and argv[0] == cmd else argv
    if cmd == "profile":
        profile_main(rest)
    elif cmd == "dbias":
        dbias_main(rest)
    elif cmd == "prefetch":
        prefetch_main(rest)
    elif cmd == "bench":
        bench_main(rest)
    elif cmd == "host":
        host_main(rest)
    elif cmd == "choose":
        choose_main(rest)
    else:
        ap = argparse.ArgumentParser(prog="tune_activations.py sweep")
        ap.add_argument("names", nargs="*", default=["bias_gelu", "relu", "swiglu"])
        ap.add_argument("--timer", choices=("wall", "graph"), default="graph")
        a = ap.parse_args(rest)
        sweep_tuning(launch.TUNING, GRID, a.names, a.timer)


if __name__ == "__main__":
    main()
