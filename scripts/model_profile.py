"""Where a model benchmark's GPU time goes: ``torch.profiler`` over training steps (or decode steps) of
``culmen.bench.hf_models`` implementations, the top kernels by CUDA time per implementation.

    python scripts/model_profile.py [--case llama1b] [--impls fa_gpt,hf_liger] [--decode] [--top 25]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from culmen.bench import hf_models as H


def _train_step(arch, impl, weights, dev, dtype):
    if impl == "fa_gpt":
        model = H.build_fa_gpt(arch, weights, dev, dtype)
    else:
        model = H.build_hf(arch, impl, weights, dev, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens, labels = H._batch(arch, dev, 0)
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)

    def step():
        loss = (H._fa_loss(model, tokens, shifted) if impl == "fa_gpt"
                else model(input_ids=tokens, labels=labels, use_cache=False).loss)
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)
    return step


def _decode_steps(arch, weights, dev, dtype):
    model = H.build_fa_gpt(arch, weights, dev, dtype).eval()
    ids = torch.randint(1, arch.vocab, (1, 128), device=dev)

    def step():
        with torch.inference_mode():
            model.generate(ids, max_length=128 + 16, cg=False, top_k=1)
    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="llama1b")
    p.add_argument("--impls", default="fa_gpt,hf_liger,hf_culmen")
    p.add_argument("--decode", action="store_true", help="profile 16 decode steps (fa_gpt, no graphs) instead")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    arch = H.ARCHS[a.case]
    weights = H.reference_weights(arch, 0)
    for impl in a.impls.split(","):
        if a.decode:
            step = _decode_steps(arch, weights, dev, dtype)
        else:
            step = _train_step(arch, impl, weights, dev, dtype)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        print(f"===== {a.case} {impl}{' decode' if a.decode else ''} (2 steps)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.top, max_name_column_width=70))
        del step
        torch.cuda.empty_cache()
        if a.decode:
            break


if __name__ == "__main__":
    main()
