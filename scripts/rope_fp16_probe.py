"""Which arithmetic culmen's Apex RoPE kernel does for fp16 on the GPU: its output against the formula
with products and sums rounded to fp16 (Apex), with fp32 math rounded once, and with an FMA-fused sum;
and whether Triton's fp32 -> fp16 cast rounds as PyTorch's. ``python scripts/rope_fp16_probe.py``."""

import torch
import triton
import triton.language as tl

from culmen.transformer.functional import fused_apply_rotary_pos_emb, fused_apply_rotary_pos_emb_cached


@triton.jit
def _round_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(X + offs, mask=m)
    tl.store(Y + offs, x.to(tl.float16).to(tl.float32), mask=m)


def rot_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    _round_kernel[(x.numel() // 1024,)](x, y, x.numel(), BLOCK=1024)
    print("triton fp32->fp16 cast vs torch .half():", f"mismatch {(y != x.half().float()).float().mean().item():.4%}")
    for dt in (torch.float16, torch.bfloat16):
        t = torch.rand(512, 2, 16, 128, device="cuda").to(dt)
        freqs = torch.rand(512, 1, 1, 64, device="cuda")
        c, s = freqs.cos().to(dt), freqs.sin().to(dt)
        head = t[..., :64]
        apex = torch.cat((head * c + rot_half(head) * s, t[..., 64:]), -1)
        f32 = torch.cat(((head.float() * c.float() + rot_half(head).float() * s.float()).to(dt), t[..., 64:]), -1)
        for fname, y in (("freqs", fused_apply_rotary_pos_emb(t, freqs)),
                         ("cached 16-bit tables", fused_apply_rotary_pos_emb_cached(t, c, s)),
                         ("cached fp32 tables", fused_apply_rotary_pos_emb_cached(t, freqs.cos(), freqs.sin()))):
            for name, ref in (("apex", apex), ("fp32 math", f32)):
                d = (y.float() - ref.float()).abs()
                frac = (y != ref).float().mean().item()
                print(dt, fname, "vs", name, f"mismatch {frac:.4%} max {d.max().item():.3g}",
                      flush=True)


if __name__ == "__main__":
    main()
