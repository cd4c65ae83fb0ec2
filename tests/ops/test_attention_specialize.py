"""How many kernels attention compiles: one per configuration, whatever the sequence lengths and batch sizes.

Every ``Launch`` the plans make is recorded with what Triton's JIT cache key is made of: the kernel,
its constexprs, warps and stages, and each runtime argument's specialization (tensor dtypes; for
integers their width and, unless listed in the kernel's ``do_not_specialize``, whether they are 1 or
divisible by 16). Pointer alignment, the one remaining part of the key, is fixed by the caller's
allocations. Nothing is launched: the recorder replaces ``Launch.__call__``. The GPU twin of this test
(``test_attention_gpu.py::test_one_compile_per_configuration``) counts Triton's own compile cache.
"""

from __future__ import annotations

import random

import pytest
import torch

from culmen.ops.attention import attention, attention_varlen, launch
from culmen.ops.backend import use_backend
from culmen.ops.common.launch import Launch

_I32 = 2**31


def _dns(fn) -> set:
    names = getattr(fn, "do_not_specialize", None)
    if names is None:  # Triton's interpreter keeps the decorator's arguments
        names = getattr(fn, "kwargs", {}).get("do_not_specialize", ())
    return set(names)


def _spec(name: str, a, dns: set):
    if isinstance(a, torch.Tensor):
        return str(a.dtype)
    if a is None or isinstance(a, bool):
        return a
    if isinstance(a, int):
        width = "i32" if -_I32 <= a < _I32 else "i64"
        return (width,) if name in dns else (width, a == 1, a % 16 == 0)
    return type(a).__name__


@pytest.fixture
def recorded(monkeypatch):
    """``{(kernel, mode): set of JIT keys}`` of every launch; the GPU block configs are planned (the CPU
    interpreter's small blocks would hide a config that depends on the sequence length)."""
    keys: dict = {}
    mode = ["?"]
    real_blocks = launch._blocks

    def record(self, stream, aligned, *args):
        fn = self.fn
        dns = _dns(fn)
        spec = tuple(_spec(n, a, dns) for n, a in zip(fn.arg_names, args))
        key = (tuple(sorted(self.meta.items())), self.num_warps, self.num_stages, spec)
        keys.setdefault((fn.__name__, mode[0]), set()).add(key)

    monkeypatch.setattr(Launch, "__call__", record)
    monkeypatch.setattr(launch, "_blocks", lambda kind, bd, on_gpu, dt: real_blocks(kind, bd, True, dt))
    with use_backend("triton"):
        yield keys, mode


def _dense_case(B, sq, sk, grad):
    q = torch.randn(B, sq, 4, 64, dtype=torch.bfloat16, requires_grad=grad)
    k = torch.randn(B, sk, 2, 64, dtype=torch.bfloat16, requires_grad=grad)
    v = torch.randn(B, sk, 2, 64, dtype=torch.bfloat16, requires_grad=grad)
    return q, k, v


@pytest.mark.parametrize("window,softcap", [((-1, -1), 0.0), ((100, 3), 5.0)])
def test_one_configuration_per_kernel_over_24_seqlens(recorded, window, softcap):
    keys, mode = recorded
    rnd = random.Random(1234)
    lengths = [rnd.randint(128, 2048) for _ in range(24)]
    for i, s in enumerate(lengths):
        B = 1 + i % 3
        sk = s if i % 2 else rnd.randint(128, 2048)
        kw = dict(causal=True, window_size=window, softcap=softcap)
        mode[0] = "dense"
        q, k, v = _dense_case(B, s, sk, True)
        out = attention(q, k, v, **kw)
        out.backward(torch.ones_like(out))
        mode[0] = "dense no-grad"
        with torch.no_grad():
            attention(q, k, v, **kw)
        mode[0] = "varlen"
        lens = [rnd.randint(1, s) for _ in range(B)]
        cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
        total = int(cu[-1])
        qv = torch.randn(total, 4, 64, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(total, 2, 64, dtype=torch.bfloat16, requires_grad=True)
        out = attention_varlen(qv, kv, kv, cu, cu, max(lens), max(lens), **kw)
        out.backward(torch.ones_like(out))
    kernels = {"_attn_fwd_kernel", "_attn_bwd_preprocess_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"}
    for m in ("dense", "varlen"):
        assert {name for name, mm in keys if mm == m} == kernels
    assert {name for name, mm in keys if mm == "dense no-grad"} == {"_attn_fwd_kernel"}
    for (name, m), ks in keys.items():
        assert len(ks) == 1, f"{name} ({m}) would compile {len(ks)} times over 24 sequence lengths"
    # The no-grad forward (no lse stored) and the training forward are the two forward variants.
    assert keys["_attn_fwd_kernel", "dense"] != keys["_attn_fwd_kernel", "dense no-grad"]


def test_block_config_depends_on_head_dim_only():
    for kind in ("fwd", "dkdv", "dq", "dkdv_atomic"):
        for bd in (16, 32, 64, 128, 256, 512):
            assert launch._blocks(kind, bd, True, torch.bfloat16) == launch._blocks(kind, bd, True, torch.float16)


def test_stride_unit():
    assert launch._stride_unit((0, 512, 64)) == 16
    assert launch._stride_unit((3 * 512 * 1000, 3 * 512, 64)) == 16
    assert launch._stride_unit((59 * 4 * 7, 59 * 4, 59)) == 1
    assert launch._stride_unit((24 * 3, 24, 8)) == 8
