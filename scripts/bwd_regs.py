"""Registers, spills and shared memory of the attention backward kernels compiled for sm_90, without a GPU.

    python scripts/bwd_regs.py [--d 64] [--causal] [--gqa 4] [dkdv=BM,BN,W,S] [dq=BM,BN,W,S] [NAME=value ...]

Runs one bf16 ``flash_attn_func`` forward + backward on CPU tensors with Triton's launches intercepted (nothing
executes), takes the ``_attn_bwd_dkdv_kernel`` and ``_attn_bwd_dq_kernel`` launches the plan made, overrides
their tiles (and any other constexpr, or ``maxnreg=N``), compiles each with ``triton.compile`` for ``cuda:90`` and
reads the cubin's resource usage with the bundled ``cuobjdump``: registers and stack (spills) decide how many
programs share a multiprocessor (ncu on the device: the d64 dK/dV kernel at 255 registers with a 1.6 KB stack,
2 programs per SM). Run it with Triton 3.6 on the path (``pip install --target DIR triton==3.6.0``,
``PYTHONPATH=DIR``) to see what the device compiles.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("CULMEN_BACKEND", "triton")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from sm90_compile import compile_sm90  # noqa: E402


def _capture(d: int, causal: bool, gqa: int) -> dict:
    import culmen.ops.attention.launch as attn_launch
    from culmen.flash_attn import flash_attn_func
    from culmen.ops.common import launch

    captured = {}

    def grab(self, stream, aligned, args):
        captured[self.fn.__name__] = (self, args)

    launch.Launch._launch_slow = grab
    attn_launch.use_kernels = lambda *a, **k: True
    h = 8
    q = torch.randn(2, 512, h, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 512, h // gqa, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = flash_attn_func(q, k, v, causal=causal)
    out.backward(torch.randn_like(out))
    return captured


def _compile(la, args, over: dict):
    meta = dict(la.meta, UPCAST=False)  # the CPU plan upcasts bf16 dots for the interpreter; the GPU does not
    warps, stages = la.num_warps, la.num_stages
    tile = over.pop("tile", None)
    maxnreg = over.pop("maxnreg", None)
    if tile:
        bm, bn, warps, stages = tile
        meta.update(BLOCK_M=bm, BLOCK_N=bn)
    meta.update(over)
    compiled = compile_sm90(la.fn, args, meta, dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True,
                                                    **({"maxnreg": maxnreg} if maxnreg else {})))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True, text=True)
    info = res.stdout + res.stderr
    if os.environ.get("BWD_REGS_RAW"):
        print(info)
    regs = re.search(r"REG:(\d+)", info)
    stack = re.search(r"STACK:(\d+)", info)
    local = re.search(r"LOCAL:(\d+)", info)
    return (int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1,
            int(local.group(1)) if local else -1, compiled.metadata.shared,
            (meta.get("BLOCK_M"), meta.get("BLOCK_N"), warps, stages))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("over", nargs="*")
    a = ap.parse_args()
    from culmen.ops.attention import launch

    captured = _capture(a.d, a.causal, a.gqa)
    tiles, extra = {}, {}
    for item in a.over:
        name, val = item.split("=", 1)
        if name in ("dkdv", "dq"):
            tiles[name] = tuple(int(x) for x in val.split(","))
        else:
            extra[name] = bool(int(val)) if val in ("0", "1") else int(val)
    for short, kname in (("dkdv", "_attn_bwd_dkdv_kernel"), ("dq", "_attn_bwd_dq_kernel")):
        la, args = captured[kname]
        over = dict(extra)
        bd = max(16, 1 << (a.d - 1).bit_length())
        over["tile"] = tiles.get(short) or next(t[1:] for t in launch.TUNING[short] if t[0] >= bd)
        regs, stack, local, smem, tile = _compile(la, args, over)
        print(f"triton {triton.__version__} {short:5} d{a.d} tile {tile}: {regs} registers, stack {stack} B, "
              f"local {local} B, shared {smem} B")


if __name__ == "__main__":
    main()
