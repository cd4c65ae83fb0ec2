"""Which calls of an eager ``train_step`` synchronize the host with the GPU (run on the lent machine).

    python3 scripts/find_syncs.py [style] [size]

Builds the ``train_step`` benchmark's culmen and PyTorch models, runs warm-up steps, then one step under
``torch.cuda.set_sync_debug_mode("warn")`` and prints each distinct synchronizing call with the innermost
frames of its stack (a sync inside a block makes the host wait for the GPU: host-bound steps pay it).
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from culmen.bench.models import build_model, build_optimizer, make_batch, model_config

    style = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    size = sys.argv[2] if len(sys.argv) > 2 else "d512"
    cfg = model_config(style, size)
    dev = torch.device("cuda")
    tokens, labels = make_batch(cfg, dev)
    for impl in ("torch", "culmen"):
        model = build_model(cfg, impl, dev, torch.bfloat16)
        opt = build_optimizer(model, impl)
        for _ in range(3):
            model(tokens, labels).backward()
            opt.step()
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seen: Counter = Counter()
        stacks: dict = {}

        def show(message, category, filename, lineno, file=None, line=None, seen=seen, stacks=stacks):
            stack = "".join(traceback.format_stack(limit=9)[:-2])
            seen[str(message)[:80]] += 1
            stacks.setdefault(str(message)[:80], stack)

        old = warnings.showwarning
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                model(tokens, labels).backward()
                opt.step()
                model.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
        torch.cuda.synchronize()
        print(f"== {impl} {style} {size}: {sum(seen.values())} synchronizing calls", flush=True)
        for msg, n in seen.most_common():
            print(f"  x{n} {msg}\n{stacks[msg]}", flush=True)
        del model, opt


if __name__ == "__main__":
    main()
