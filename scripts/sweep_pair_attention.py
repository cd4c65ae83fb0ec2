"""Sweep the backward (and forward) settings of culmen.ops.pair_attention on OpenFold's triangle attention.

Usage (GPU machine, ~60 s): ``python3 scripts/sweep_pair_attention.py [--no-compile] [--budget S] [--n 256,384]``.
CPU smoke run of the script itself (Triton interpreter, tiny shape): ``--smoke``.

Case: q, k, v ``[B=1, I=N, H=4, N, d=32]`` bf16 (transposed views of ``[B, I, N, H, d]``, as OpenFold makes
them), pair bias ``[1, 1, 4, N, N]`` (its gradient summed over I), key mask ``[1, I, 1, 1, N]``. Each row:
``fwd+bwd`` (forward and backward into q, k, v and the bias: the number ``culmen bench
openfold_triangle_attention`` compares), ``bwd`` (backward alone, from a retained graph), host us per
fwd+bwd call, and the worst gradient error against an fp32 eager reference (a broken setting shows there).

Rows: the peers (SDPA with the bias and mask summed into a float ``attn_mask`` that requires grad,
``torch.compile`` of OpenFold's eager formula, the eager formula itself), then culmen's default settings
and one-at-a-time changes of ``culmen.ops.pair_attention.launch.TUNING`` from the default. The script
decides nothing; it prints the table. Before this backward (one recomputing dQ kernel and a bias-gradient
kernel recomputing two matmuls per tile) the H200 bench had: N256 culmen 1.226 ms vs SDPA 0.964 ms, N384
culmen 2.84 ms vs compile 2.49 ms.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from culmen.bench.openfold import INF, _eager, _sdpa  # noqa: E402
from culmen.contrib.openfold_triton import AttnTri  # noqa: E402
from culmen.ops.backend import use_backend  # noqa: E402
from culmen.ops.pair_attention.launch import TUNING  # noqa: E402

# (label, TUNING changes from the default). One factor at a time: each Triton config compiles once (~1-2 s).
VARIANTS: list[tuple[str, dict]] = [
    ("default", {}),
    ("kv 64x64 s2", {"kv_block_n": 64, "kv_block_m": 64, "kv_stages": 2}),
    ("kv 64x32", {"kv_block_n": 64}),
    ("kv 128x64 w8 s2", {"kv_block_m": 64, "kv_warps": 8, "kv_stages": 2}),
    ("kv 128x32 s2", {"kv_stages": 2}),
    ("kv 128x16 s4", {"kv_block_m": 16, "kv_stages": 4}),
    ("dq 64x64", {"dq_block_m": 64}),
    ("dq 128x128 w8", {"dq_block_n": 128, "dq_warps": 8}),
    ("red u4", {"red_unroll": 4}),
    ("red 16x64 w2", {"red_block_m": 16, "red_warps": 2}),
    ("red 64x64 u4", {"red_block_m": 64, "red_unroll": 4}),
    ("red torch.sum", {"dbias_reduce": "torch"}),
    ("fwd 128x128 w8", {"fwd_block_n": 128, "fwd_warps": 8}),
    ("fwd 64x64", {"fwd_block_m": 64}),
    ("fwd 128x32 s4", {"fwd_block_n": 32, "fwd_stages": 4}),
]


def _inputs(n: int, dev: torch.device, i_rows: int | None = None, h: int = 4, d: int = 32):
    gen = torch.Generator(device=dev).manual_seed(0)
    i_rows = n if i_rows is None else i_rows
    q, k, v = ((torch.randn(1, i_rows, n, h, d, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
               .transpose(-2, -3).requires_grad_() for _ in range(3))
    bias = torch.randn(1, 1, h, n, n, device=dev, generator=gen).to(torch.bfloat16).requires_grad_()
    mask = (torch.rand(1, i_rows, 1, 1, n, device=dev, generator=gen) > 0.1).to(torch.bfloat16)
    mask[..., 0] = 1
    dy = torch.randn(q.shape, device=dev, dtype=torch.bfloat16, generator=gen)
    return q, k, v, bias, mask, dy


class _Timer:
    """``do_bench`` on CUDA (ms), a plain loop on CPU (smoke runs)."""

    def __init__(self, dev: torch.device, warmup: int, rep: int) -> None:
        self.cuda = dev.type == "cuda"
        self.warmup, self.rep = warmup, rep

    def ms(self, fn) -> float:
        if self.cuda:
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=self.warmup, rep=self.rep))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def host_us(self, fn, calls: int = 10) -> float:
        if not self.cuda:
            return float("nan")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / calls * 1e6


def _measure(fn, leaves, dy, timer: _Timer, ref):
    """(fwd+bwd ms, bwd ms, host us, worst relative gradient error vs ``ref``) of ``fn() -> out``."""

    def fwd_bwd():
        return torch.autograd.grad(fn(), leaves, dy)

    grads = fwd_bwd()  # compiles; also the checked gradients
    err = max(float((g.float() - r).abs().max()) / max(float(r.abs().max()), 1e-6) for g, r in zip(grads, ref))
    out = fn()
    bwd = timer.ms(lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True))
    both = timer.ms(fwd_bwd)
    return both, bwd, timer.host_us(fwd_bwd), err


class _Shape:
    """Inputs, fp32 reference gradients and the best peer time of one residue count ``n``."""

    def __init__(self, n: int, dev: torch.device, smoke: bool) -> None:
        self.q, self.k, self.v, self.bias, self.mask, self.dy = _inputs(n, dev, i_rows=3 if smoke else None)
        self.leaves = (self.q, self.k, self.v, self.bias)
        args = [t.detach().float().requires_grad_() for t in self.leaves]
        self.ref = torch.autograd.grad(_eager(*args[:3], self.mask.float(), args[3]), args, self.dy.float())
        self.tag = f"N{n} I{self.q.shape[1]} H4 d32"
        self.best = float("inf")

    def run(self, f, timer: _Timer):
        return _measure(lambda: f(self.q, self.k, self.v, self.mask, self.bias), self.leaves, self.dy, timer,
                        self.ref)


def _culmen(q, k, v, mask, bias):
    return AttnTri(q, k, v, mask, bias, INF, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="256,384", help="residue counts N (I = N rows)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peer")
    ap.add_argument("--budget", type=float, default=55.0, help="seconds; variants past it are listed as skipped")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, N=20, I=3 (checks the script only)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    smoke = args.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    timer = _Timer(dev, warmup=5, rep=40)
    defaults = dict(TUNING)
    sizes = [20] if smoke else [int(s) for s in args.n.split(",")]
    print(f"device: {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu (smoke)'}, torch "
          f"{torch.__version__}; default TUNING: {defaults}")
    rows: list[tuple] = []
    skipped: list[str] = []

    def over(what: str) -> bool:
        if time.perf_counter() - t_start > args.budget:
            skipped.append(what)
            return True
        return False

    shapes = [_Shape(n, dev, smoke) for n in sizes]
    # Peers first (the compile peer costs ~10 s per shape), then each culmen setting on every shape in turn
    # (one Triton compile per setting), so a cut by --budget drops whole settings from the end of VARIANTS.
    for sh in shapes:
        peers = {"sdpa": _sdpa, "eager": _eager}
        if not args.no_compile and not smoke:
            torch._dynamo.reset()
            peers["compile"] = torch.compile(_eager, dynamic=False)
        for name, f in peers.items():
            if not over(f"{sh.tag} {name}"):
                res = sh.run(f, timer)
                sh.best = min(sh.best, res[0])
                rows.append((sh.tag, name, *res))
    with use_backend("triton"):
        for label, change in VARIANTS:
            TUNING.update(defaults)
            TUNING.update(change)
            for sh in shapes:
                if over(f"{sh.tag} {label}"):
                    continue
                try:
                    res = sh.run(_culmen, timer)
                except Exception as exc:  # a setting that fails to compile or run is a row, not the sweep's end
                    rows.append((sh.tag, f"culmen {label}", f"failed: {type(exc).__name__}: {str(exc)[:80]}"))
                    continue
                rows.append((sh.tag, f"culmen {label}", *res, sh.best / res[0]))
    TUNING.update(defaults)
    rows.sort(key=lambda r: sizes.index(int(r[0].split()[0][1:])))
    print(f"{'case':<16} {'provider':<24} {'fwd+bwd ms':>10} {'bwd ms':>8} {'host us':>8} {'grad err':>9} "
          f"{'vs best peer':>12}")
    for r in rows:
        if len(r) == 3:
            print(f"{r[0]:<16} {r[1]:<24} {r[2]}")
            continue
        ratio = f"{r[6]:.2f}x" if len(r) > 6 else ""
        print(f"{r[0]:<16} {r[1]:<24} {r[2]:>10.4f} {r[3]:>8.4f} {r[4]:>8.1f} {r[5]:>9.2e} {ratio:>12}")
    if skipped:
        print(f"skipped (past --budget {args.budget:.0f} s): " + ", ".join(skipped))
    print(f"total {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
