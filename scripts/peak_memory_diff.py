"""What is alive at the peak of one training step (GPU machine): the LLaMA-1B ``model_train`` case, HF patched by
Liger-Kernel against HF patched by culmen (carry ``.whl`` for Liger).

    python3 scripts/peak_memory_diff.py [impl ...]   (default: hf_liger hf_culmen)

Per implementation: two warm-up steps, then one step under ``torch.cuda.memory._record_memory_history``. The
trace's allocations and frees are replayed to find the step's peak, and the allocations made during the step and
still alive at that moment are grouped by the innermost Python frame in culmen, transformers, liger or
torch.nn/autograd code (MiB, largest first). What was allocated before the step (weights, optimizer state, the
batch) is one number, the same for every implementation.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch

from culmen.bench.hf_models import ARCHS, _batch, build_hf, reference_weights

_KEEP = ("culmen/", "transformers/", "liger_kernel/", "torch/nn/", "torch/autograd/", "torch/optim/")


def _site(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in _KEEP):
            short = name[name.find(next(k for k in _KEEP if k in name)):]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "?"


def main() -> None:
    impls = sys.argv[1:] or ["hf_liger", "hf_culmen"]
    arch = ARCHS["llama1b"]
    dev = torch.device("cuda")
    weights = reference_weights(arch, 0)
    tokens, labels = _batch(arch, dev, 0)
    for impl in impls:
        torch.cuda.empty_cache()
        model = build_hf(arch, impl, weights, dev, torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)

        def step(model=model, opt=opt):
            model(input_ids=tokens, labels=labels, use_cache=False).loss.backward()
            opt.step()
            model.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak = torch.cuda.max_memory_allocated(dev)
        trace = snap["device_traces"][dev.index or 0]
        live: dict[int, tuple[int, str]] = {}
        cur = best = 0
        best_live: dict[int, tuple[int, str]] = {}
        for ev in trace:
            act = ev["action"]
            if act == "alloc":
                live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])))
                cur += ev["size"]
                if cur > best:
                    best, best_live = cur, dict(live)
            elif act == "free_completed" and ev["addr"] in live:
                cur -= live.pop(ev["addr"])[0]
        groups: Counter = Counter()
        counts: Counter = Counter()
        for size, site in best_live.values():
            groups[site] += size
            counts[site] += 1
        print(f"== {impl}: before the step {before / 2**30:.3f} GiB, peak {peak / 2**30:.3f} GiB "
              f"(step allocations alive at the peak {best / 2**30:.3f} GiB)", flush=True)
        for site, size in groups.most_common(18):
            print(f"   {size / 2**20:9.1f} MiB x{counts[site]:<4d} {site}", flush=True)
        del model, opt, step
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
