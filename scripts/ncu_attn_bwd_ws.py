"""One backward of culmen's Gluon attention kernel and one of SDPA-cuDNN on the same values, for ``ncu``.

    ncu --clock-control none -k regex:"attn_bwd_ws|bprop" -s 4 -c 2 python3 scripts/ncu_attn_bwd_ws.py [--d 128]
        [--seqlen 2048] [--causal]

16k tokens (batch = 16384 // seqlen), hidden 2048 (heads = 2048 // d), bf16; each backward runs twice before
the profiled one so compilation and autotuning stay out of the capture.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from culmen.flash_attn import flash_attn_func

    B, H = 16384 // a.seqlen, 2048 // a.d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, a.seqlen, H, a.d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attn_func(q, k, v, causal=a.causal)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ot = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2), retain_graph=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
