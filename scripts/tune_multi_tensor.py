#!/usr/bin/env python3
"""Sweep the multi-tensor kernels' TUNING (chunk, block, warps) on the GPU against torch's fused ops.

    python scripts/tune_multi_tensor.py [--set a|b|all] [--quick]

Prints, per config, device time and bandwidth (bytes the op must move / time) next to torch's
``AdamW(fused=True)`` / ``SGD(fused=True)`` steps and a copy roofline, all in one process on the
same tensors. Results go to bench/notes/multi_tensor.md by hand.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from culmen.ops.multi_tensor import adam, elementwise, sgd


def param_set(name: str) -> list[int]:
    if name == "a":
        return [1 << 20] * 100
    # GPT-2-medium-like: wte, wpe, 24 blocks of (ln, qkv, proj, ln, fc, fc2), final ln.
    d, v, ctx = 1024, 50257, 1024
    sizes = [v * d, ctx * d]
    for _ in range(24):
        sizes += [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return sizes + [d, d]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def roofline(device) -> float:
    n = 1 << 28
    a = torch.empty(n, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    return 2 * a.numel() * 4 / ms / 1e6  # GB/s


def run_set(s: str, configs, bw: float, dev) -> None:
    sizes = param_set(s)
    nparam = sum(sizes)
    print(f"\n== set {s}: {len(sizes)} tensors, {nparam / 1e6:.1f}M params")
    ps = [torch.randn(n, device=dev) for n in sizes]
    gs = [torch.randn(n, device=dev) for n in sizes]
    ms = [torch.randn(n, device=dev) for n in sizes]
    vs = [torch.rand(n, device=dev) for n in sizes]
    flag = torch.zeros(1, dtype=torch.int32, device=dev)

    # Peers.
    tp = [p.clone().requires_grad_() for p in ps]
    for p, g in zip(tp, gs):
        p.grad = g.clone()
    opt = torch.optim.AdamW(tp, lr=1e-4, weight_decay=0.01, fused=True)
    t_torch = bench(opt.step)
    sopt = torch.optim.SGD(tp, lr=1e-4, momentum=0.9, fused=True)
    sopt.step()
    t_sgd = bench(sopt.step)
    adam_bytes, sgd_bytes = 28 * nparam, 20 * nparam
    print(f"torch AdamW fused   {t_torch:.3f} ms  {adam_bytes / t_torch / 1e6 / bw:.1%} of copy bw")
    print(f"torch SGD fused     {t_sgd:.3f} ms  {sgd_bytes / t_sgd / 1e6 / bw:.1%} of copy bw")
    lists = [gs, ps, ms, vs]
    for chunk, block, warps in configs:
        adam.TUNING.update(chunk=chunk, block=block, num_warps=warps)
        sgd.TUNING.update(chunk=chunk, block=block, num_warps=warps)
        elementwise.TUNING.update(chunk=chunk, block=block, num_warps=warps)

        def run_adam():
            adam.adam_update(lists, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, step=10, mode=1,
                             bias_correction=True, weight_decay=0.01, noop_flag=flag)

        t = bench(run_adam)
        t_s = bench(lambda: sgd.multi_tensor_sgd(1, flag, [gs, ps, ms], 0.0, 0.9, 0.0, 1e-4, False, False,
                                                 False, 1.0))
        t_sc = bench(lambda: elementwise.multi_tensor_scale(1, flag, [gs, ms], 0.5))
        print(f"chunk {chunk:6d} block {block:5d} warps {warps}:  adam {t:.3f} ms "
              f"({adam_bytes / t / 1e6 / bw:.1%}, {t_torch / t:.2f}x torch)  sgd {t_s:.3f} ms "
              f"({sgd_bytes / t_s / 1e6 / bw:.1%}, {t_sgd / t_s:.2f}x)  scale {t_sc:.3f} ms "
              f"({8 * nparam / t_sc / 1e6 / bw:.1%})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="all")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = roofline(dev)
    print(f"copy roofline {bw:.0f} GB/s  ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__})")
    sets = ["a", "b"] if args.set == "all" else [args.set]
    configs = [(8192, 1024, 4), (8192, 2048, 8), (16384, 1024, 4), (16384, 2048, 4), (4096, 1024, 4),
               (32768, 2048, 8), (16384, 4096, 8), (65536, 2048, 8)]
    if args.quick:
        configs = configs[:3]
    for s in sets:
        run_set(s, configs, bw, dev)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
