"""Where the host time of one eager ``train_step`` goes (GPU machine): the culmen and PyTorch LLaMA models at
``d512`` (host-bound there), a few steps each under ``cProfile`` (culmen's Python, by own time) and under
``torch.profiler`` (aten ops and autograd nodes, by CPU time).

``python scripts/train_step_profile.py [style] [size] [kernels] [compile]``; the host profile ends with the culmen
``Launch`` objects that never bound the direct launcher. ``kernels``: instead of the host profiles,
the device time per step of each CUDA kernel (largest first) and their sum, to tell a host-bound step from a
device-bound one. ``compile``: the models wrapped in ``torch.compile`` (``compile_model(model, "model")``);
``culmen-only``: skip the PyTorch model.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from culmen.bench.models import build_model, build_optimizer, compile_model, make_batch, model_config


def _unbound_launches() -> None:
    """Every culmen ``Launch`` that has not bound the direct launcher (each call pays Triton's dispatch)."""
    import gc

    from culmen.ops.common.launch import Launch

    seen = [o for o in gc.get_objects() if isinstance(o, Launch)]
    slow = [o for o in seen if o._run is None]
    print(f"launches: {len(seen)}, unbound: {len(slow)}")
    for o in slow[:20]:
        print(f"   unbound {o.fn.__name__ if hasattr(o.fn, '__name__') else o.fn}: {o.error}")


def main() -> None:
    style = sys.argv[1] if len(sys.argv) > 1 else "llama"
    size = sys.argv[2] if len(sys.argv) > 2 else "d512"
    cfg = model_config(style, size)
    dev = torch.device("cuda")
    tokens, labels = make_batch(cfg, dev)
    for impl in ("culmen",) if "culmen-only" in sys.argv[3:] else ("torch", "culmen"):
        model = build_model(cfg, impl, dev, torch.bfloat16)
        opt = build_optimizer(model, impl)
        if "compile" in sys.argv[3:]:
            model = compile_model(model, "model")

        def step(model=model, opt=opt):
            model(tokens, labels).backward()
            opt.step()
            model.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        host = (time.perf_counter() - t0) / 5 * 1e3
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 5 * 1e3
        print(f"== {impl} {style} {size}: host {host:.2f} ms/step (enqueue), wall {wall:.2f} ms/step", flush=True)
        if "compile" in sys.argv[3:]:
            from torch._dynamo.utils import counters

            print(f"   graph breaks {dict(counters['graph_break'])}, stats {dict(counters['stats'])}", flush=True)
            counters.clear()
        if "kernels" in sys.argv[3:]:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            rows = sorted(((e.device_time_total / 3e3, e.count // 3, e.key) for e in prof.key_averages()
                           if e.device_time_total > 0), reverse=True)
            print(f"   kernels {sum(r[0] for r in rows):.2f} ms/step", flush=True)
            for t, n, key in rows[:28]:
                print(f"   {t:7.3f} ms x{n:<4d} {key[:100]}", flush=True)
            del model, opt, step
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
        torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60), flush=True)
        if impl == "culmen":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(3):
                step()
            pr.disable()
            torch.cuda.synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(30)
            _unbound_launches()
        del model, opt, step


if __name__ == "__main__":
    main()
