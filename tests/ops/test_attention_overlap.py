"""``TUNING["fwd_overlap"]``: the forward's unmasked key loop rotated (block ``n + 1``'s ``q @ k.T`` issued
before block ``n``'s softmax and ``P @ V``). The same operations in the same order, so the outputs and lse
equal the plain loop's bit for bit, in every mode that reaches the unmasked run (full, causal, windows,
softcap, ALiBi, dropout, GQA, varlen, KV cache with split-KV, FP8), and match float64 attention."""

from __future__ import annotations

import pytest
import torch

from culmen.ops.attention import launch
from culmen.testing.attention import plain as attention64


def _run(fn, monkeypatch, flag):
    monkeypatch.setitem(launch.TUNING, "fwd_overlap", flag)
    torch.manual_seed(0)
    return fn()


CASES = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(23, 5)),
    "softcap_alibi": dict(softcap=3.0, alibi=True),
    "dropout": dict(dropout_p=0.2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_overlap_equals_plain_loop(triton_backend, monkeypatch, name):
    from culmen.flash_attn import flash_attn_func

    kw = dict(CASES[name])
    g = torch.Generator().manual_seed(1)
    B, sq, sk, h, hk, d = 2, 37, 83, 4, 2, 24  # the interpreter's 16-wide blocks: several unmasked ones
    q = torch.randn(B, sq, h, d, generator=g, dtype=torch.float16)
    k = torch.randn(B, sk, hk, d, generator=g, dtype=torch.float16)
    v = torch.randn(B, sk, hk, d, generator=g, dtype=torch.float16)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(B, h, generator=g) * 0.3

    def fn():
        return flash_attn_func(q, k, v, return_attn_probs=False, **kw)

    plain = _run(fn, monkeypatch, False)
    rotated = _run(fn, monkeypatch, True)
    assert torch.equal(plain, rotated)
    if "dropout_p" not in kw:
        want = attention64(q, k, v, torch.float64, causal=kw.get("causal", False),
                           window=kw.get("window_size", (-1, -1)),
                           softcap=kw.get("softcap", 0.0), alibi=kw.get("alibi_slopes"))
        assert (rotated.double() - want).abs().max().item() < 5e-3


def test_overlap_varlen_kvcache_and_fp8(triton_backend, monkeypatch):
    import culmen.flash_attn_3 as fa3
    from culmen.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    g = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 45, 52, 121], dtype=torch.int32)
    q = torch.randn(121, 4, 32, generator=g, dtype=torch.float16)
    k = torch.randn(121, 1, 32, generator=g, dtype=torch.float16)
    v = torch.randn(121, 1, 32, generator=g, dtype=torch.float16)
    kc = torch.randn(3, 90, 2, 32, generator=g, dtype=torch.float16)
    vc = torch.randn(3, 90, 2, 32, generator=g, dtype=torch.float16)
    qd = torch.randn(3, 1, 4, 32, generator=g, dtype=torch.float16)
    lens = torch.tensor([90, 17, 64], dtype=torch.int32)
    q8, k8, v8 = (torch.randn(2, n, 2, 32, generator=g).to(torch.float8_e4m3fn) for n in (29, 70, 70))

    def fn():
        return (flash_attn_varlen_func(q, k, v, cu, cu, 69, 69, causal=True),
                flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, num_splits=3),
                fa3.flash_attn_func(q8, k8, v8, causal=True))

    for a, b in zip(_run(fn, monkeypatch, False), _run(fn, monkeypatch, True)):
        assert torch.equal(a, b)
