"""FA3's autograd classes (``flash_attn_interface.FlashAttnFunc`` / ``FlashAttnVarlenFunc`` /
``FlashAttnQKVPackedFunc``) with FA3's ``apply`` arguments: the same output, lse and gradients as the
functions (which the other FA3 tests check against float64), through the import alias too."""

from __future__ import annotations

import pytest
import torch

import culmen.flash_attn_3 as fa3


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


def _same_output_and_grads(out, want, inputs):
    """``out`` equals ``want`` and, seeded with one random gradient, so do their gradients of ``inputs``."""
    torch.testing.assert_close(out, want)
    g = torch.randn_like(out)
    for a, b in zip(_grads(out, inputs, g), _grads(want, inputs, g)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_class(causal):
    torch.manual_seed(0)
    q = torch.randn(2, 9, 4, 16, requires_grad=True)
    k = torch.randn(2, 13, 2, 16, requires_grad=True)
    v = torch.randn(2, 13, 2, 8, requires_grad=True)
    out, lse = fa3.FlashAttnFunc.apply(q, k, v, None, causal, None, None, None, None, (-1, -1), 0, 0.0, 1, None,
                                       False, 0, True)
    want, wlse = fa3.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[:2]
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, wlse)
    assert not lse.requires_grad
    g = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, k, v), g), _grads(want, (q, k, v), g)):
        torch.testing.assert_close(a, b)
    # plain call: the output only
    assert isinstance(fa3.FlashAttnFunc.apply(q, k, v, 0.3, causal), torch.Tensor)


def test_flash_attn_func_class_with_qv_and_a_frozen_input():
    torch.manual_seed(1)
    q = torch.randn(1, 6, 2, 8, requires_grad=True)
    k = torch.randn(1, 10, 2, 8)  # no gradient wanted
    v = torch.randn(1, 10, 2, 12, requires_grad=True)
    qv = torch.randn(1, 6, 2, 12, requires_grad=True)
    out = fa3.FlashAttnFunc.apply(q, k, v, None, True, qv)
    want = fa3.flash_attn_func(q, k, v, causal=True, qv=qv)
    _same_output_and_grads(out, want, (q, v, qv))


def test_varlen_class_takes_seqused_before_max_lengths():
    torch.manual_seed(2)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    q = torch.randn(9, 2, 16, requires_grad=True)
    k = torch.randn(13, 1, 16, requires_grad=True)
    v = torch.randn(13, 1, 16, requires_grad=True)
    used_k = torch.tensor([5, 7], dtype=torch.int32)
    out = fa3.FlashAttnVarlenFunc.apply(q, k, v, cu_q, cu_k, None, used_k, 5, 7, None, True)
    want = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, seqused_k=used_k, causal=True)
    _same_output_and_grads(out, want, (q, k, v))


def test_qkvpacked_class_and_helpers():
    import importlib

    from culmen.compat import ALIASES

    torch.manual_seed(3)
    qkv = torch.randn(2, 7, 3, 2, 16, requires_grad=True)
    out = fa3.FlashAttnQKVPackedFunc.apply(qkv, None, True)
    want = fa3.flash_attn_qkvpacked_func(qkv, causal=True)
    torch.testing.assert_close(out, want)
    g = torch.randn_like(out)
    torch.testing.assert_close(_grads(out, (qkv,), g)[0], _grads(want, (qkv,), g)[0])
    # flash_attn_interface (FA3's module name) is this package through the alias
    mod = importlib.import_module(ALIASES["flash_attn_interface"])
    assert mod.FlashAttnFunc is fa3.FlashAttnFunc and mod.round_multiple(13, 8) == 16
    x = torch.randn(4, 6)[:, ::2]
    assert mod.maybe_contiguous(x).is_contiguous() and mod.maybe_contiguous(None) is None
