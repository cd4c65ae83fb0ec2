"""Compile a captured culmen ``Launch`` for sm_90 without a GPU (shared by ``dump_ttgir.py`` and ``bwd_regs.py``).

``compile_sm90(fn, args, meta, options)`` builds the Triton signature from the launch's arguments (tensors as
16-byte aligned pointers of their dtype, ints as ``i32`` with divisibility 16 where they are multiples of 16,
floats as ``fp32``; every name in ``meta`` and every ``None`` a constexpr) and returns ``triton.compile``'s result
for ``cuda:90``, which needs only Triton's bundled ptxas.
"""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_PTR = {torch.float8_e4m3fn: "*fp8e4nv", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
        torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8"}


def compile_sm90(fn, args, meta: dict, options: dict):
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        a = meta[name] if name in meta else args[i]
        if name in meta or a is None:
            sig[name] = "constexpr"
            consts[(i,)] = a
        elif isinstance(a, torch.Tensor):
            sig[name] = _PTR[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i32"
            if a and a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
