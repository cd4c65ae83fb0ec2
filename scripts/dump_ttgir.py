"""Compile culmen's attention forward for sm_90 on a machine without a GPU and report how its loads pipeline.

    python scripts/dump_ttgir.py [causal] [tuning:fp8_tma=0 ...] [BM=128 BN=128 W=8 S=3 EXP16=0 ...] [--out FILE]

Runs one FP8 ``flash_attn_3.flash_attn_func`` call with Triton's launches intercepted (nothing executes), takes
the ``_attn_fwd_kernel`` launch the plan made (its arguments and constexprs), overrides the GPU-only settings
(tile sizes, warps, stages, any other ``NAME=value`` constexpr) and compiles it with ``triton.compile`` for
``cuda:90``, which needs only Triton's bundled ptxas. ``tuning:KEY=VALUE`` sets ``launch.TUNING[KEY]`` before
the call (e.g. ``tuning:fp8_tma=0``: the pointer loads). Prints the shared memory, the counts of pipelined loads
(``async_copy_global_to_local``, TMA ``async_tma_copy``) and of plain tensor loads left in the TTGIR; ``--out``
writes the TTGIR. This is how the FP8 transposed-V load was found unpipelined under Triton 3.6 (the device's
version) while 3.9 pipelines it (bench/notes/attention.md v7): run it under each Triton to compare.
"""

from __future__ import annotations

import os
import re
import sys

os.environ.setdefault("CULMEN_BACKEND", "triton")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from sm90_compile import compile_sm90  # noqa: E402


def _capture(causal: bool, tuning: dict):
    """The plan's forward ``Launch`` and its arguments, from one intercepted FP8 call on CPU tensors."""
    import culmen.flash_attn_3 as fa3
    import culmen.ops.attention.launch as attn_launch
    from culmen.ops.common import launch

    captured = []
    launch.Launch._launch_slow = lambda self, stream, aligned, args: captured.append((self, args))
    attn_launch.use_kernels = lambda *a, **k: True  # plan the kernels although no GPU is here
    attn_launch.TUNING.update(tuning)
    q, k, v = (torch.randn(1, 512, 2, 128).to(torch.float8_e4m3fn) for _ in range(3))
    fa3.flash_attn_func(q, k, v, causal=causal)
    return next((la, args) for la, args in captured if la.fn.__name__ == "_attn_fwd_kernel")


def main() -> None:
    argv = sys.argv[1:]
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        out = argv[i + 1]
        del argv[i:i + 2]
    tuning = {a[7:].split("=")[0]: int(a.split("=")[1]) for a in argv if a.startswith("tuning:")}
    la, args = _capture("causal" in argv, tuning)
    over = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("tuning:"))
    meta = dict(la.meta, UPCAST=False, BLOCK_M=int(over.pop("BM", 128)), BLOCK_N=int(over.pop("BN", 128)))
    warps, stages = int(over.pop("W", 8)), int(over.pop("S", 3))
    for name, val in over.items():
        meta[name] = bool(int(val)) if val in ("0", "1") else int(val)
    compiled = compile_sm90(la.fn, args, meta, dict(num_warps=warps, num_stages=stages))
    ttgir = compiled.asm["ttgir"]
    if out:
        with open(out, "w") as f:
            f.write(ttgir)
    plain = len(re.findall(r"= tt\.load %\S+(?:, %\S+)*(?: \{[^}]*\})? : tensor<\d+x\d+x!tt\.ptr", ttgir))
    print(f"triton {triton.__version__}: shared {compiled.metadata.shared} B, cp.async loads "
          f"{ttgir.count('async_copy_global_to_local')}, TMA loads {ttgir.count('async_tma_copy')}, "
          f"plain 2-D tensor loads {plain} (Q's is one)")


if __name__ == "__main__":
    main()
