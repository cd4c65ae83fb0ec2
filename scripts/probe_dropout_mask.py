"""Attention dropout on a GPU: the PyTorch keep-mask on CUDA vs on CPU for one rng_state, and the dropped
fraction flash_attn's tests read from ``S_dmask`` (run on the GPU machine).

    python3 scripts/probe_dropout_mask.py
"""

from __future__ import annotations

import os
import sys

import torch

DEV = os.environ.get("PROBE_DEVICE", "cuda")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from culmen.flash_attn import flash_attn_qkvpacked_func
    from culmen.ops.attention.dropout import dropout_keep_mask

    B, S, H, d, p = 4, 97, 9, 32, 0.17
    for seed, off in ((0, 0), (12345, 7), (2 ** 40 + 3, 2 ** 33 + 11)):
        st = torch.tensor([seed, off], dtype=torch.int64)
        bidx = torch.arange(B, dtype=torch.int64)
        cpu = dropout_keep_mask(st, p, bidx, H, S, S)
        gpu = dropout_keep_mask(st.to(DEV), p, bidx.to(DEV), H, S, S).cpu()
        print(f"seed {seed} offset {off}: cpu keep {cpu.float().mean():.4f} gpu keep {gpu.float().mean():.4f} "
              f"equal {torch.equal(cpu, gpu)}", flush=True)
    torch.manual_seed(0)
    for dev in ("cpu", DEV):
        for causal in (False, True):
            qkv = torch.randn(B, S, 3, H, d, dtype=torch.bfloat16, device=dev, requires_grad=True)
            out, lse, sd = flash_attn_qkvpacked_func(qkv, p, causal=causal, return_attn_probs=True)
            sd = sd[:, :, :S, :S].float()
            vis = torch.ones(S, S, dtype=torch.bool, device=dev)
            if causal:
                vis = vis.tril()
            vis = vis.expand_as(sd)
            print(f"{dev} causal={causal}: S_dmask {tuple(sd.shape)} dropped {(sd[vis] < 0).float().mean():.4f} "
                  f"zero {(sd[vis] == 0).float().mean():.4f} nonzero outside {(sd[~vis] != 0).float().mean():.4f}",
                  flush=True)


if __name__ == "__main__":
    main()
