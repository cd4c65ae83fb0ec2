"""``AttnPlan.backward(grads=)``: the backward writes dQ, dK, dV into caller-given tensors with the inputs'
strides (views of one packed gradient when q, k, v are views of one packed projection, as in
``SelfMultiheadAttn``), bit-identical to the gradients it allocates itself; a layout that differs from the
inputs' is refused with a ValueError naming ``grads``."""

from __future__ import annotations

import pytest
import torch

from culmen.ops.attention.launch import AttnPlan


def _views(buf, D):
    return buf[..., 0, :], buf[..., 1, :], buf[..., 2, :]


@pytest.mark.parametrize("causal", [False, True])
def test_grads_into_packed_views_match_allocated(triton_backend, causal):
    torch.manual_seed(0)
    B, S, H, D = 2, 37, 3, 16
    qkv = torch.randn(B, S, H, 3, D)
    q, k, v = _views(qkv, D)
    plan = AttnPlan("dense", q, k, v, None, causal=causal)
    out, lse, _ = plan.forward(q, k, v, None, None)
    dout = torch.randn_like(out)
    want = plan.backward(dout, q, k, v, out, lse, None, None)
    g = torch.full_like(qkv, float("nan"))
    got = plan.backward(dout, q, k, v, out, lse, None, None, grads=_views(g, D))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not g.isnan().any()  # every element written
    assert got[0].data_ptr() == g.data_ptr()


def test_grads_with_other_strides_are_refused(triton_backend):
    B, S, H, D = 1, 16, 2, 16
    qkv = torch.randn(B, S, H, 3, D)
    q, k, v = _views(qkv, D)
    plan = AttnPlan("dense", q, k, v, None)
    out, lse, _ = plan.forward(q, k, v, None, None)
    contiguous = tuple(torch.empty(B, S, H, D) for _ in range(3))
    with pytest.raises(ValueError, match="grads"):
        plan.backward(torch.randn_like(out), q, k, v, out, lse, None, None, grads=contiguous)
