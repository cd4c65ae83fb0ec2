"""Compile the warp-specialized Gluon attention forward for sm_90 without a GPU; print registers and spills.

    python scripts/ws_regs.py                      # every shipped (head dim, causal) config
    python scripts/ws_regs.py 128 1 128,3,2,1      # d, causal, BLOCK_N,STAGES,warpgroups,pingpong

One line per config: ``d=.. causal=.. tile=.. shared=<bytes> regs=<maxnreg> stack=<bytes>``. The stack is the
register spill of the hottest partition (ptxas counts the whole kernel): the tuned tiles keep it near 0, and a
consumer warpgroup that spills runs 2x slower (bench/notes/attention.md v10). Needs Triton's bundled ptxas and
cuobjdump only; run with the device's Triton on the path (``PYTHONPATH=DIR``) to see what it compiles.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # Gluon kernels compile only outside the interpreter
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from culmen.ops.attention import kernels_ws, launch_ws  # noqa: E402


def compile_config(d: int, causal: bool, tile: tuple):
    """``triton.compile`` result of the kernel for ``cuda:90`` at one config (bf16)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    la = launch_ws.ws_launch(torch.bfloat16, d, causal, tile, 1, torch.device("cpu"), True)
    fn = kernels_ws._attn_fwd_ws_kernel
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in la.meta:
            sig[name], consts[(i,)] = "constexpr", la.meta[name]
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name == "lse_ptr" else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": la.options["maxnreg"]})


def usage(k) -> tuple[int, int]:
    """``(registers, stack bytes)`` of a compiled kernel's cubin, read by the bundled cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


def main() -> None:
    if not kernels_ws.AVAILABLE:
        print("no Gluon in this Triton")
        sys.exit(2)
    if len(sys.argv) == 4:
        configs = [(int(sys.argv[1]), sys.argv[2] == "1", tuple(int(x) for x in sys.argv[3].split(",")))]
        configs = [(d, c, (t[0], t[1], t[2], bool(t[3]))) for d, c, t in configs]
    else:
        configs = [(d, c, t) for (d, c), t in sorted(launch_ws.WS_TUNING["tiles"].items())]
    for d, causal, tile in configs:
        k = compile_config(d, causal, tile)
        regs, stack = usage(k)
        ptx = k.asm["ptx"]
        feats = ",".join(n for n, s in (("setmaxnreg", "setmaxnreg"), ("wgmma", "wgmma.mma_async"),
                                         ("tma", "cp.async.bulk.tensor")) if s in ptx)
        print(f"d={d} causal={int(causal)} tile={','.join(str(int(x)) for x in tile)} shared={k.metadata.shared} "
              f"regs={regs} stack={stack} ptx={feats}", flush=True)


if __name__ == "__main__":
    main()
