"""A/B of train_step variants in one process, timed in alternating rounds (GPU machine).

    python3 scripts/ab_train_step.py [size] [--rounds N] [--steps N] [--variants a,b,...]

The compiled ``train_step`` rows move by +-2 ms between runs of separate processes (host-bound steps on a shared
host), more than the differences measured. Here every variant is built once, then timed ``steps`` steps per round,
round after round, so drift hits all of them alike. Variants (``--variants``, default all):

* ``torch`` / ``torch-compile``: PyTorch's model (fused AdamW);
* ``culmen`` / ``culmen-compile``: culmen's model as shipped;
* ``culmen-compile-ws``: compiled with the Gluon attention kernels reached through the opaque custom ops
  (``WS_TUNING["compile"]``);
* ``culmen-trifwd`` / ``culmen-compile-ws-trifwd``: as above with the Triton forward for every causal d64 call
  (``WS_TUNING["tiles"]`` without ``(64, True)``);
* ``culmen-compile-packedrot``: compiled, Q and K rotated as one slice of the packed projection
  (``models.COMPILE_ROTARY = "packed"``; shipped: ``"split"``, rotated after unbinding).

Prints per variant the median wall ms/step over rounds, the host (enqueue) ms/step, and Dynamo's compile count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from culmen.bench import models
from culmen.bench.models import build_model, build_optimizer, compile_model, make_batch, model_config
from culmen.ops.attention import launch_ws
from culmen.ops.common.plans import clear_plans

VARIANTS = ("torch", "torch-compile", "culmen", "culmen-trifwd", "culmen-compile", "culmen-compile-ws",
            "culmen-compile-ws-trifwd", "culmen-compile-packedrot")


def _flags(name: str) -> None:
    models.COMPILE_ROTARY = "packed" if "packedrot" in name else "split"
    launch_ws.WS_TUNING["compile"] = "-ws" in name
    tiles = launch_ws.WS_TUNING["tiles"]
    if "trifwd" in name:
        tiles.pop((64, True), None)
    else:
        tiles[(64, True)] = _D64_CAUSAL
    clear_plans()


_D64_CAUSAL = launch_ws.WS_TUNING["tiles"][(64, True)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("size", nargs="?", default="d768")
    ap.add_argument("--style", default="llama")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    cfg = model_config(args.style, args.size)
    dev = torch.device("cuda")
    tokens, labels = make_batch(cfg, dev)
    steps = {}
    for name in args.variants.split(","):
        impl = "torch" if name.startswith("torch") else "culmen"
        model = build_model(cfg, impl, dev, torch.bfloat16)
        opt = build_optimizer(model, impl)
        fn = compile_model(model, "model") if "compile" in name else model

        def step(fn=fn, model=model, opt=opt):
            fn(tokens, labels).backward()
            opt.step()
            model.zero_grad(set_to_none=True)

        _flags(name)
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        print(f"built {name}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        steps[name] = step
    from torch._dynamo.utils import counters

    frames_before = counters["stats"]["unique_graphs"]
    wall: dict = {n: [] for n in steps}
    host: dict = {n: [] for n in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            _flags(name)
            step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host[name].append((t1 - t0) / args.steps * 1e3)
            wall[name].append((t2 - t0) / args.steps * 1e3)
    print(f"{args.style} {args.size}: {args.rounds} rounds x {args.steps} steps; graphs compiled during the rounds: "
          f"{counters['stats']['unique_graphs'] - frames_before}")
    base = statistics.median(wall[next(iter(wall))])
    for name in steps:
        w = statistics.median(wall[name])
        print(f"{name:<26} wall {w:7.2f} ms/step (min {min(wall[name]):6.2f} max {max(wall[name]):6.2f})  "
              f"host {statistics.median(host[name]):7.2f}  speedup vs {next(iter(wall))} {base / w:5.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
