"""Compile the warp-specialized Gluon attention kernels for sm_90 without a GPU; print registers and spills.

    python scripts/ws_regs.py                      # every shipped forward and backward config
    python scripts/ws_regs.py 128 1 128,3,2,1      # forward: d, causal, BLOCK_N,STAGES,warpgroups,pingpong
    python scripts/ws_regs.py fp8 128 1 128,3,2,1  # the FP8 forward (float8 Q/K/V with descales)
    python scripts/ws_regs.py bwd 128 1 64,2       # backward: d, causal, BLOCK_M,STAGES
    python scripts/ws_regs.py --bwd-stages         # the backward with 2 and 3 Q/dO stages

One line per config: ``[fp8 |bwd ]d=.. causal=.. tile=.. shared=<bytes> regs=<maxnreg> stack=<bytes> ptx=..``. The
stack is the register spill of the hottest partition (ptxas counts the whole kernel): the tuned tiles keep it
small, and a consumer warpgroup that spills in its loop runs up to 2x slower (bench/notes/attention.md v10; the
backward keeps no spill ops in its d128 loops under Triton 3.6). Needs Triton's bundled ptxas and
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

_FP32_PTRS = ("lse_ptr", "delta_ptr", "dq_ptr", "qd_ptr", "kd_ptr", "vd_ptr")
_INPUT_PTRS = ("q_ptr", "k_ptr", "v_ptr")
_FP32_SCALARS = ("qk_scale", "sm_scale")


def _compile(la, fp8: bool = False):
    """``triton.compile`` of a ``Launch``'s Gluon kernel for ``cuda:90`` (bf16 tensors, fp32 lse/delta/dQ and
    descales; ``fp8``: float8 q/k/v)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = la.fn
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in la.meta:
            sig[name], consts[(i,)] = "constexpr", la.meta[name]
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name in _FP32_PTRS else "*fp8e4nv" if fp8 and name in _INPUT_PTRS else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in _FP32_SCALARS else "i32"
    return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": la.options["maxnreg"]})


def compile_config(d: int, causal: bool, tile: tuple, fp8: bool = False):
    """The forward kernel compiled for ``cuda:90`` at one config (bf16; ``fp8``: float8 with descales)."""
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    return _compile(launch_ws.ws_launch(dtype, d, causal, tile, 1, torch.device("cpu"), True, descale=fp8), fp8)


def compile_bwd_config(d: int, causal: bool, tile: tuple):
    """The backward kernel compiled for ``cuda:90`` at one config (bf16, persistent)."""
    return _compile(launch_ws.ws_bwd_launch(torch.bfloat16, d, causal, tile, 1, torch.device("cpu"), True))


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
    args = sys.argv[1:]
    if "--q-double" in args:  # the forward with WS_TUNING["q_double"] (two Q buffers where they fit)
        args.remove("--q-double")
        launch_ws.WS_TUNING["q_double"] = True
    stages = "--bwd-stages" in args
    if stages:  # the backward with two and three Q/dO stages (three fit at d128: P stays in registers)
        args.remove("--bwd-stages")
    if stages and not args:
        configs = [("bwd", d, c, (64, stages)) for d in sorted(launch_ws.WS_BWD_TUNING["tiles"])
                   for c in (False, True) for stages in (2, 3)]
    elif len(args) == 4 and args[0] == "bwd":
        configs = [("bwd", int(args[1]), args[2] == "1", tuple(int(x) for x in args[3].split(",")))]
    elif len(args) in (3, 4):
        t = tuple(int(x) for x in args[-1].split(","))
        configs = [(args[0] if len(args) == 4 else "", int(args[-3]), args[-2] == "1", (t[0], t[1], t[2], bool(t[3])))]
    else:
        configs = [("", d, c, t) for (d, c), t in sorted(launch_ws.WS_TUNING["tiles"].items())]
        configs += [("", d, c, t) for (d, c), (_, t) in sorted(launch_ws.WS_TUNING["tiles_long"].items())]
        configs += [("fp8", d, c, t) for (d, c), t in sorted(launch_ws.WS_TUNING["tiles_fp8"].items())]
        configs += [("bwd", d, c, t) for d, t in sorted(launch_ws.WS_BWD_TUNING["tiles"].items())
                    for c in (False, True)]
    for kind, d, causal, tile in configs:
        if kind == "bwd":
            k = compile_bwd_config(d, causal, tile)
        else:
            k = compile_config(d, causal, tile, fp8=kind == "fp8")
        regs, stack = usage(k)
        ptx = k.asm["ptx"]
        feats = ",".join(n for n, s in (("setmaxnreg", "setmaxnreg"), ("wgmma", "wgmma.mma_async"),
                                         ("tma", "cp.async.bulk.tensor"),
                                         ("tma_reduce", "cp.reduce.async.bulk.tensor")) if s in ptx)
        print(f"{kind + ' ' if kind else ''}d={d} causal={int(causal)} tile={','.join(str(int(x)) for x in tile)} "
              f"shared={k.metadata.shared} regs={regs} stack={stack} ptx={feats}", flush=True)


if __name__ == "__main__":
    main()
