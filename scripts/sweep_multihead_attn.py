"""Sweep: SelfMultiheadAttn's fast path as one autograd node (``block``, the default) against the chain it
replaced (``chain``: F.linear -> attention node -> F.linear, same kernels) and nn.MultiheadAttention, and,
key-padded, the block with its key index / row packing done by torch ops (``blk-ops``: sort, searchsorted,
index_select, index_copy_) instead of the three ``_pack`` kernels (the default), at
BERT-large shapes (seq 512, E 1024, 16 heads, fp16), eager forward, forward + backward and key-padded
forward + backward. Prints wall ms (triton do_bench of the eager call), host us per call (calls enqueued
behind a GPU sleep: culmen.bench.runner.host_us) and the speedup over torch. Decides nothing: the default
stays ``block`` unless the table says otherwise. Run: ``python3 scripts/sweep_multihead_attn.py`` (< 60 s).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from culmen.bench.runner import host_us  # noqa: E402
from culmen.contrib.multihead_attn import SelfMultiheadAttn, _block, _core  # noqa: E402

SHAPES = [(512, 16), (512, 32)]
E, H = 1024, 16


def make(s: int, b: int, dev: torch.device):
    gen = torch.Generator(device=dev).manual_seed(0)
    fast = SelfMultiheadAttn(E, H, bias=True).to(dev, torch.float16)
    peer = torch.nn.MultiheadAttention(E, H, bias=True).to(dev, torch.float16)
    d = E // H
    with torch.no_grad():
        fast.in_proj_weight.copy_(peer.in_proj_weight.view(3, H, d, E).transpose(0, 1).reshape(3 * E, E))
        fast.in_proj_bias.copy_(peer.in_proj_bias.view(3, H, d).transpose(0, 1).reshape(3 * E))
        fast.out_proj_weight.copy_(peer.out_proj.weight)
        fast.out_proj_bias.copy_(peer.out_proj.bias)
    x = torch.randn(s, b, E, device=dev, dtype=torch.float16, generator=gen).requires_grad_(True)
    dy = torch.randn(s, b, E, device=dev, dtype=torch.float16, generator=gen)
    lens = torch.randint(s // 2, s + 1, (b,), device=dev, generator=gen)
    pad = torch.arange(s, device=dev)[None, :] >= lens[:, None]
    return fast, peer, x, dy, pad


def runner(module, call, x, dy, mode):
    params = list(module.parameters())
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                return call(x, None)
        return fwd
    mask_on = mode.startswith("pad")

    def fwd_bwd():
        y = call(x, mask_on)
        return torch.autograd.grad(y, [x, *params], dy)
    return fwd_bwd


def sweep_shape(s: int, b: int, dev: torch.device) -> None:
    fast, peer, x, dy, pad = make(s, b, dev)

    def culmen_call(t, masked):
        return fast(t, t, t, key_padding_mask=pad if masked else None)[0]

    def torch_call(t, masked):
        return peer(t, t, t, key_padding_mask=pad if masked else None, need_weights=False)[0]

    for mode in ("fwd", "fwd+bwd", "pad fwd+bwd"):
        rows = []
        variants = [("torch", peer, torch_call, True, True), ("block", fast, culmen_call, True, True),
                    ("chain", fast, culmen_call, False, True)]
        if mode.startswith("pad"):
            variants.append(("blk-ops", fast, culmen_call, True, False))
        for name, module, call, block, pack in variants:
            _core.USE_BLOCK = block
            _block.PACK_KERNELS = pack
            _block.BLOCKS.clear()
            fn = runner(module, call, x, dy, mode)
            fn()
            torch.cuda.synchronize()
            wall = do_bench(fn, warmup=25, rep=100, return_mode="median")
            host = host_us(fn, dev, wall)
            rows.append((name, wall, host))
        _core.USE_BLOCK = True
        _block.PACK_KERNELS = True
        _block.BLOCKS.clear()
        ref = rows[0][1]
        for name, wall, host in rows:
            host_s = "sync" if host is None else f"{host:.1f}"
            print(f"{f's{s} B{b} {mode}':<22} {name:<7} {wall:8.4f} {host_s:>8} {ref / wall:8.2f}x")


def main() -> None:
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    print(f"{'case':<22} {'variant':<7} {'wall ms':>8} {'host us':>8} {'vs torch':>9}")
    for s, b in SHAPES:
        sweep_shape(s, b, dev)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
