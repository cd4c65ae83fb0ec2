"""Sweep the ways of running a 2:4-sparse Linear forward (768 -> 3072, bias) on this GPU and print one table.

Usage (GPU machine): ``python3 scripts/sweep_sparsity.py [--tokens 4096 16384] [--dtypes fp16 bf16]``.

Rows, all on the same input and the same 2:4-pruned weight, ``torch.no_grad``:

- ``dense``: ``F.linear`` on the pruned dense weight (cuBLAS), the number to beat;
- ``torch-default``: ``F.linear(x, to_sparse_semi_structured(w), b)`` (PyTorch's subclass, cuSPARSELt
  unless forced to CUTLASS);
- ``cslt alg0``: ``torch._cslt_sparse_mm(W_c, x.t(), bias, transpose_result=True)`` called directly;
- ``cslt graph replay``: that op captured in a CUDA graph and replayed alone (no input copy, no
  output clone): the floor of the graph approach;
- ``culmen <backend>``: the layer after ``enable_semi_structured(lin, backend)`` (``auto`` is the
  default; the status column says which backend ran).

Columns: wall ms (``do_bench`` of the eager call, the number that counts), host us per call (the
call enqueued behind a sleeping GPU: pure host cost), max |y - ref| against an fp32 ``F.linear`` of the
same pruned weight (dense's own error gives the scale). The script decides nothing: it prints.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from culmen.bench.runner import host_us, short_error, time_ms  # noqa: E402
from culmen.contrib.sparsity import create_mask  # noqa: E402
from culmen.contrib.sparsity import semi_structured as ss  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
D_IN, D_OUT = 768, 3072


def _variants(lin: nn.Linear, x: torch.Tensor):
    """(name, build) pairs; ``build()`` returns ``(fn, note)`` or raises (the row says n/a)."""
    w, b = lin.weight.detach(), lin.bias.detach()

    def dense():
        return (lambda: F.linear(x, w, b)), ""

    def torch_default():
        ws = torch.sparse.to_sparse_semi_structured(w)
        return (lambda: F.linear(x, ws, b)), type(ws).__name__

    def cslt():
        c = torch._cslt_compress(w)
        return (lambda: torch._cslt_sparse_mm(c, x.t(), bias=b, transpose_result=True)), "alg_id=0"

    def cslt_graph():
        c = torch._cslt_compress(w)
        torch._cslt_sparse_mm(c, x.t(), bias=b, transpose_result=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch._cslt_sparse_mm(c, x.t(), bias=b, transpose_result=True)

        def run():
            graph.replay()
            return out
        return run, "replay only (no copies)"

    def culmen(backend: str):
        def build():
            layer = copy.deepcopy(lin)
            ss.enable_semi_structured(layer, backend)
            return (lambda: layer(x)), ss.semi_structured_status(layer)[:90]
        return build

    # No CUTLASS variants (SM80 code: an illegal instruction on SM90) and no cuSPARSELt search (it breaks
    # cuSPARSELt for the process on torch 2.11 / cuSPARSELt 0.8.0, see scripts/probe_cusparselt.py).
    return [("dense", dense), ("torch-default", torch_default), ("cslt alg0", cslt),
            ("cslt graph replay", cslt_graph), ("culmen auto", culmen("auto")),
            ("culmen cusparselt-graph", culmen("cusparselt-graph")), ("culmen cusparselt", culmen("cusparselt")),
            ("culmen torch", culmen("torch"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*SparseSemiStructuredTensor.*")
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)} (sm{''.join(map(str, torch.cuda.get_device_capability(dev)))}), "
          f"torch {torch.__version__}, cuSPARSELt {getattr(torch.backends.cusparselt, 'version', lambda: '?')()}; "
          f"culmen auto order: {', '.join(ss.backend_order('auto', dev))}")
    print(f"{'case':<22}{'variant':<30}{'wall ms':>9}{'host us':>9}{'x dense':>9}{'max err':>10}  note")
    for dt_name in args.dtypes:
        dtype = DTYPES[dt_name]
        for tokens in args.tokens:
            torch.manual_seed(0)
            lin = nn.Linear(D_IN, D_OUT).to(dev, dtype)
            with torch.no_grad():
                lin.weight.mul_(create_mask(lin.weight, "m4n2_1d"))
            x = torch.randn(tokens, D_IN, device=dev, dtype=dtype)
            ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
            case = f"{tokens}x{D_IN}->{D_OUT} {dt_name}"
            dense_ms = None
            for name, build in _variants(lin, x):
                try:
                    with torch.no_grad():
                        fn, note = build()
                        y = fn()
                        err = float((y.float() - ref).abs().max())
                        wall = time_ms(fn, dev, timer="wall")
                        host = host_us(fn, dev, wall_ms=wall)
                except Exception as exc:  # a variant this GPU / build lacks: its row says why
                    torch.cuda.synchronize()
                    print(f"{case:<22}{name:<30}{'n/a':>9}{'':>9}{'':>9}{'':>10}  {short_error(exc, 100)}",
                          flush=True)
                    continue
                dense_ms = wall if name == "dense" else dense_ms
                ratio = f"{dense_ms / wall:.2f}x" if dense_ms else "-"
                host_s = f"{host:.1f}" if host is not None else "sync"
                print(f"{case:<22}{name:<30}{wall:>9.4f}{host_s:>9}{ratio:>9}{err:>10.3g}  {note}", flush=True)
                del fn
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
