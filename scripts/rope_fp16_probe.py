"""Which arithmetic culmen's Apex RoPE kernel does for fp16 on the GPU: its output against the formula
with products and sums rounded to fp16 (Apex), with fp32 math rounded once, and with an FMA-fused sum.
``python scripts/rope_fp16_probe.py`` (GPU machine)."""

import torch

from culmen.transformer.functional import fused_apply_rotary_pos_emb


def rot_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def main() -> None:
    torch.manual_seed(0)
    for dt in (torch.float16, torch.bfloat16):
        t = torch.rand(512, 2, 16, 128, device="cuda").to(dt)
        freqs = torch.rand(512, 1, 1, 64, device="cuda")
        y = fused_apply_rotary_pos_emb(t, freqs)
        c, s = freqs.cos().to(dt), freqs.sin().to(dt)
        head = t[..., :64]
        apex = torch.cat((head * c + rot_half(head) * s, t[..., 64:]), -1)
        f32 = torch.cat(((head.float() * c.float() + rot_half(head).float() * s.float()).to(dt), t[..., 64:]), -1)
        p = (head.float() * c.float()).to(dt).float()
        fma = torch.cat(((p + rot_half(head).float() * s.float()).to(dt), t[..., 64:]), -1)
        for name, ref in (("apex (rounded products)", apex), ("fp32 math, one rounding", f32),
                          ("first product rounded, fused second", fma)):
            print(dt, name, f"mismatch {(y != ref).float().mean().item():.4%}", flush=True)


if __name__ == "__main__":
    main()
