"""``multihead_attn``: Apex's ``SelfMultiheadAttn`` (``impl="fast"``, culmen's FlashAttention) against
``torch.nn.MultiheadAttention`` at BERT-large shapes (seq 512, batch 16 / 32, embed 1024, 16 heads, fp16),
eager forward and forward + backward, with and without a key-padding mask.

Both modules hold the same weights (PyTorch's packed in-projection is ``(q; k; v)`` over all heads, Apex's
interleaves ``(q, k, v)`` per head: the bench converts) and run on the same sequence-first input; the
peer is called with ``need_weights=False`` (its SDPA path). ``culmen-default`` (the plain-PyTorch
``impl="default"``) is informational. The check compares the output and the input gradient. FLOPs: the
four projections (``8 * S * B * E^2`` forward, 3x for forward + backward) plus attention (``4 * B * S^2 *
E`` forward, 3.5x for forward + backward, flash_attn's count).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark

FULL = [(512, 16), (512, 32)]  # (seq, batch) at embed 1024, 16 heads
QUICK = [(24, 2)]


def _flops(s: int, b: int, e: int, mode: str) -> int:
    lin, att = 8 * s * b * e * e, 4 * b * s * s * e
    return lin + att if mode == "fwd" else 3 * lin + int(3.5 * att)


def _provider(module: torch.nn.Module, call: Callable[[Tensor], Tensor], x: Tensor, dy: Tensor,
              mode: str) -> Callable[[], Any]:
    params = [p for p in module.parameters() if p.requires_grad]
    if mode == "fwd":
        def run_fwd():
            with torch.no_grad():
                return call(x)
        return run_fwd

    def run_fwd_bwd():
        y = call(x)
        grads = torch.autograd.grad(y, [x, *params], dy)
        return y.detach(), grads[0]
    return run_fwd_bwd


def _check(out: Any, ref: Any) -> dict[str, float]:
    out = out if isinstance(out, tuple) else (out,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    return {n: (a.float() - b.float()).abs().max().item() for n, a, b in zip(("out", "dx"), out, ref)}


def _case(s: int, b: int, e: int, h: int, dtype: torch.dtype, mask: bool, mode: str,
          device: torch.device) -> Case:
    from culmen.contrib.multihead_attn import SelfMultiheadAttn

    gen = torch.Generator(device=device).manual_seed(0)
    fast = SelfMultiheadAttn(e, h, bias=True, impl="fast").to(device=device, dtype=dtype)
    default = SelfMultiheadAttn(e, h, bias=True, impl="default").to(device=device, dtype=dtype)
    peer = torch.nn.MultiheadAttention(e, h, bias=True).to(device=device, dtype=dtype)
    d = e // h
    with torch.no_grad():
        # PyTorch's rows: (part, head, d); Apex's: (head, part, d).
        peer.in_proj_bias.normal_(0.0, 0.02, generator=gen)
        peer.out_proj.bias.normal_(0.0, 0.02, generator=gen)
        w = peer.in_proj_weight.view(3, h, d, e).transpose(0, 1).reshape(3 * e, e)
        bias = peer.in_proj_bias.view(3, h, d).transpose(0, 1).reshape(3 * e)
        for m in (fast, default):
            m.in_proj_weight.copy_(w)
            m.in_proj_bias.copy_(bias)
            m.out_proj_weight.copy_(peer.out_proj.weight)
            m.out_proj_bias.copy_(peer.out_proj.bias)
    grad = mode != "fwd"
    x = torch.randn(s, b, e, device=device, dtype=dtype, generator=gen).requires_grad_(grad)
    dy = torch.randn(s, b, e, device=device, dtype=dtype, generator=gen)
    pad = None
    if mask:  # right padding, lengths spread over [s/2, s]
        lens = torch.randint(s // 2, s + 1, (b,), device=device, generator=gen)
        pad = torch.arange(s, device=device)[None, :] >= lens[:, None]
    providers = {
        CULMEN: _provider(fast, lambda t: fast(t, t, t, key_padding_mask=pad)[0], x, dy, mode),
        "culmen-default": _provider(default, lambda t: default(t, t, t, key_padding_mask=pad)[0], x, dy, mode),
        "torch": _provider(peer, lambda t: peer(t, t, t, key_padding_mask=pad, need_weights=False)[0], x, dy,
                           mode),
    }
    notes = ["torch = nn.MultiheadAttention(need_weights=False); same weights, same input"]
    if mask:
        notes.append("key_padding_mask: right padding, lengths uniform in [s/2, s]")
    label = f"s{s} B{b} E{e} h{h} {str(dtype).split('.')[-1]}{' pad' if mask else ''} {mode}"
    return Case(label=label, providers=providers, flops=_flops(s, b, e, mode), reference="torch", check=_check,
                notes=notes, informational=("culmen-default",))


@register_benchmark("multihead_attn", "attention")
def bench_multihead_attn(cfg: BenchConfig) -> Iterator[Case]:
    """SelfMultiheadAttn (fast) vs nn.MultiheadAttention, BERT-large shapes, fp16, fwd and fwd+bwd."""
    dev = cfg.device
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    e, h = (32, 4) if cfg.quick else (1024, 16)
    for s, b in (QUICK if cfg.quick else FULL):
        for mask, mode in ((False, "fwd"), (False, "fwd+bwd"), (True, "fwd+bwd")):
            yield _case(s, b, e, h, dtype, mask, mode, dev)
