# ruff: noqa: B023  (closures over loop variables run inside their own iteration)
"""Where should ``ConvBiasReLU`` switch from PyTorch's formulation to the fused autograd function? (GPU sweep)

    python3 scripts/sweep_conv_epilogue.py [--batches 32,128] [--quick]

``culmen.contrib.conv_bias_relu`` routes a call by its output size (``ROUTING``, see that module's notes):
with autograd, outputs of at least ``ROUTING["fused_grad_min_numel"]`` elements (default 2^25) run the fused
autograd function (cuDNN convolution + Triton epilogue forward, one Triton pass for the ReLU gate and the bias
sums backward), smaller ones ``relu_(conv2d(x, w, b))`` with PyTorch's own autograd nodes (the lighter host
path); without autograd, outputs of at least ``ROUTING["fused_fwd_min_numel"]`` (default 0) run the Triton
epilogue. This script times both sides on the same inputs (``culmen bench conv_bias_relu``'s ResNet-50 shapes,
fp16 channels-last, at each batch size) and prints one table: eager wall ms (``triton.testing.do_bench``,
host cost included), host us per call (``culmen.bench.runner.host_us``: enqueued behind a sleeping GPU), the
output size, and which route won. It changes nothing: a good threshold is a size between the largest
output where ``torch`` wins fwd+bwd and the smallest where ``fused`` wins; set it in ``ROUTING``'s default.
Runs in well under a minute on an H100/H200.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from culmen.bench.conv_epilogue import CONV_CASES  # noqa: E402
from culmen.bench.runner import host_us  # noqa: E402
from culmen.contrib.conv_bias_relu import ConvBiasReLU  # noqa: E402
from culmen.contrib.conv_bias_relu.conv_bias_relu import ROUTING  # noqa: E402

CL = torch.channels_last
NEVER = 1 << 62


def _routes(mode: str) -> dict[str, dict[str, int]]:
    key = "fused_grad_min_numel" if mode == "fwd+bwd" else "fused_fwd_min_numel"
    return {"torch": {key: NEVER}, "fused": {key: 0}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="32,128", help="batch sizes (comma-separated)")
    ap.add_argument("--quick", action="store_true", help="first two shapes only, shorter timing")
    opts = ap.parse_args()
    from triton.testing import do_bench

    dev = torch.device("cuda")
    dt = torch.float16
    rep = 20 if opts.quick else 60
    saved = dict(ROUTING)
    print(f"device {torch.cuda.get_device_name(dev)}, torch {torch.__version__}; defaults {saved}")
    print(f"{'case':<34} {'mode':<8} {'out elems':>10} {'torch ms':>9} {'fused ms':>9} {'torch us':>9} "
          f"{'fused us':>9}  faster")
    cases = CONV_CASES[:2] if opts.quick else CONV_CASES
    try:
        for n in (int(b) for b in opts.batches.split(",")):
            for _, C, H, W, K, k, st, pad in cases:
                Ho, Wo = (H + 2 * pad - k) // st + 1, (W + 2 * pad - k) // st + 1
                x = torch.randn(n, C, H, W, device=dev, dtype=dt).contiguous(memory_format=CL)
                w = (torch.randn(K, C, k, k, device=dev, dtype=dt) * (2.0 / (C * k * k)) ** 0.5)
                w = w.contiguous(memory_format=CL)
                b = torch.randn(1, K, 1, 1, device=dev, dtype=dt) * 0.1
                dy = torch.randn(n, K, Ho, Wo, device=dev, dtype=dt).contiguous(memory_format=CL)
                for mode in ("fwd", "fwd+bwd"):
                    grad = mode == "fwd+bwd"
                    for t in (x, w, b):
                        t.requires_grad_(grad)

                    def call():
                        if not grad:
                            with torch.no_grad():
                                return ConvBiasReLU(x, w, b, pad, st)
                        x.grad = w.grad = b.grad = None
                        y = ConvBiasReLU(x, w, b, pad, st)
                        y.backward(dy)
                        return y

                    res = {}
                    for route, setting in _routes(mode).items():
                        ROUTING.update(setting)
                        call()
                        torch.cuda.synchronize()
                        ms = do_bench(call, warmup=10, rep=rep)
                        res[route] = (ms, host_us(call, dev, ms))
                        ROUTING.update(saved)
                    (tm, th), (fm, fh) = res["torch"], res["fused"]
                    label = f"{n}x{C}x{H}x{W} k{k}s{st} ->{K}"
                    th_s = "sync" if th is None else f"{th:.1f}"
                    fh_s = "sync" if fh is None else f"{fh:.1f}"
                    print(f"{label:<34} {mode:<8} {n * K * Ho * Wo:>10} {tm:>9.4f} {fm:>9.4f} {th_s:>9} {fh_s:>9}  "
                          f"{'fused' if fm < tm else 'torch'} {max(tm, fm) / min(tm, fm):.2f}x")
    finally:
        ROUTING.update(saved)


if __name__ == "__main__":
    main()
