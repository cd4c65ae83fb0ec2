# ruff: noqa: B023  (closures over loop variables run inside their own iteration)
"""culmen.RNN: eager step loop vs CUDA-graph replay of each layer's loops, beside cuDNN (GPU sweep)

    python3 scripts/sweep_rnn.py [--quick] [--kinds lstm,gru]

Issue 18's shape: a 2-layer LSTM (and GRU), hidden 1024, input 1024, seq 512, batch 64, bf16, fwd and
fwd+bwd. Variants, timed on the same inputs and weights in one process:

* ``eager``: ``culmen.RNN.set_cuda_graphs(False)``: per layer and direction one recurrent GEMM and one
  Triton cell launch per step (host-bound: about 2 x 512 launches per layer).
* ``graph``: the default: each layer's forward / backward loop replayed as one CUDA graph (captured
  during the warm-up calls; the one-time capture cost is printed apart).
* ``torch``: ``torch.nn.LSTM`` / ``GRU`` (cuDNN).

Columns: eager wall ms (``triton.testing.do_bench`` of the plain call, host cost included: the number that
counts), host us per call (``culmen.bench.runner.host_us``; ``sync`` where the call waits for the GPU, i.e.
the host is the bottleneck), the ratio to torch (>1: faster than cuDNN), the max difference of the output
against torch, and the graph statistics (captures / replays). The script changes nothing; the default is
``graph``. Runs in well under a minute on an H100/H200.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import culmen.RNN as RNN  # noqa: E402
from culmen.bench.runner import host_us  # noqa: E402
from culmen.ops.rnn import graphs  # noqa: E402


def _models(kind, In, H, layers, dtype, dev):
    ours = (RNN.LSTM if kind == "lstm" else RNN.GRU)(In, H, layers).to(dev, dtype)
    peer = (nn.LSTM if kind == "lstm" else nn.GRU)(In, H, layers).to(dev, dtype)
    with torch.no_grad():
        for k, cell in enumerate(ours.rnns):
            for a, b in (("w_ih", "weight_ih"), ("w_hh", "weight_hh"), ("b_ih", "bias_ih"), ("b_hh", "bias_hh")):
                getattr(peer, f"{b}_l{k}").copy_(getattr(cell, a))
    peer.flatten_parameters()
    return ours, peer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T 128 instead of 512, shorter timing")
    ap.add_argument("--kinds", default="lstm,gru", help="cells (comma-separated)")
    opts = ap.parse_args()
    import triton
    from triton.testing import do_bench

    dev = torch.device("cuda")
    dt = torch.bfloat16
    T, B, In, H, L = (128 if opts.quick else 512), 64, 1024, 1024, 2
    rep = 40 if opts.quick else 100
    print(f"device {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"L{L} T{T} B{B} I{In} H{H} bf16")
    print(f"{'case':<14} {'variant':<7} {'wall ms':>9} {'host us':>9} {'vs torch':>9} {'max|d| vs torch':>16}  notes")
    for kind in opts.kinds.split(","):
        torch.manual_seed(0)
        ours, peer = _models(kind, In, H, L, dt, dev)
        x = torch.randn(T, B, In, device=dev, dtype=dt)
        dy = torch.randn(T, B, H, device=dev, dtype=dt)
        for mode in ("fwd", "fwd+bwd"):
            grad = mode == "fwd+bwd"
            xs = x.detach().clone().requires_grad_(grad)
            params = [*ours.parameters(), *peer.parameters(), xs]

            def run_ours():
                ours.reset_hidden(B)
                if not grad:
                    with torch.no_grad():
                        return ours(xs)[0]
                for p in params:
                    p.grad = None
                y = ours(xs)[0]
                y.backward(dy)
                return y.detach()

            def run_peer():
                if not grad:
                    with torch.no_grad():
                        return peer(xs)[0]
                for p in params:
                    p.grad = None
                y = peer(xs)[0]
                y.backward(dy)
                return y.detach()

            ref = run_peer().float()
            ms_t = do_bench(run_peer, warmup=25, rep=rep)
            us_t = host_us(run_peer, dev, ms_t)
            rows = []
            for variant in ("eager", "graph"):
                graphs.clear_cuda_graphs()
                graphs.STATS.clear()
                graphs._ENABLED = variant == "graph"  # (set_cuda_graphs would also clear: same effect here)
                note = ""
                if variant == "graph":
                    t0 = time.perf_counter()
                    run_ours()  # first call of the signature: eager (compiles, no buffers)
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    run_ours()  # captures
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    note = f"first call {1e3 * (t1 - t0):.0f} ms, capturing call {1e3 * (t2 - t1):.0f} ms; "
                diff = (run_ours().float() - ref).abs().max().item()
                ms = do_bench(run_ours, warmup=25, rep=rep)
                us = host_us(run_ours, dev, ms)
                st = graphs.STATS
                note += (f"captures {st['capture_fwd']}/{st['capture_bwd']} replays {st['replay_fwd']}/"
                         f"{st['replay_bwd']} eager {st['eager_fwd']}/{st['eager_bwd']} (fwd/bwd)")
                errs = [lg.error for lg in graphs.GRAPHS.values() if lg.error]
                if errs:
                    note += f"; capture failed: {errs[0]}"
                rows.append((variant, ms, us, diff, note))
            graphs._ENABLED = True
            label = f"{kind} {mode}"
            for variant, ms, us, diff, note in rows:
                hs = "sync" if us is None else f"{us:.0f}"
                print(f"{label:<14} {variant:<7} {ms:>9.3f} {hs:>9} {ms_t / ms:>8.2f}x {diff:>16.3g}  {note}")
            hs = "sync" if us_t is None else f"{us_t:.0f}"
            print(f"{label:<14} {'torch':<7} {ms_t:>9.3f} {hs:>9} {1.0:>8.2f}x {0.0:>16.3g}  cuDNN")
        graphs.clear_cuda_graphs()
        ours = peer = None  # free the models' memory before the next kind
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
