"""Host-path guard of the norm family: a cached call makes a fixed, small number of calls (DESIGN.md).

The kernels are faked (``culmen.testing.hostcost.fake_kernels``), so this runs on CPU exactly the code a
GPU call runs after its first call. On the GPU test machine a torch call (allocation, view, method)
costs 3-11 us and a Python call 0.2 us: the C-call budget is what keeps a call near PyTorch's cost.
"""

import pytest
import torch

from culmen.testing.hostcost import assert_host_budget, fake_kernels

BF16 = torch.bfloat16


@pytest.fixture
def fake():
    with fake_kernels() as launched:
        yield launched


def _leaves(*shapes):
    return [torch.randn(s, dtype=BF16, requires_grad=True) for s in shapes]


def test_layer_norm_forward_no_grad(fake):
    from culmen.ops.layer_norm import layer_norm

    x, w, b = _leaves((4, 16, 256), 256, 256)

    def call():
        with torch.no_grad():
            layer_norm(x, w, b)

    n = assert_host_budget(call, python=8, c=11)
    allocs = n.c_names["_VariableFunctionsClass.empty"] + n.c_names["_VariableFunctionsClass.empty_like"]
    assert allocs == 1  # only y: no statistics without autograd
    assert fake, "the fake kernels were not launched"


def test_layer_norm_forward_backward(fake):
    from culmen.ops.layer_norm import layer_norm

    x, w, b = _leaves((4, 16, 256), 256, 256)
    g = torch.randn(4, 16, 256, dtype=BF16)

    def call():
        for t in (x, w, b):
            t.grad = None
        layer_norm(x, w, b).y.backward(g)

    n = assert_host_budget(call, python=18, c=24)
    # y + stats, dx + partials + dw + db: no placeholders, no reshapes, no reductions in PyTorch.
    assert n.c_names["_VariableFunctionsClass.empty"] + n.c_names["_VariableFunctionsClass.empty_like"] == 6
    assert len(fake) >= 3


def test_rms_norm_with_residual_forward_backward(fake):
    from culmen.ops.layer_norm import layer_norm

    x, r, w = _leaves((2, 8, 128), (2, 8, 128), 128)
    g = torch.randn(2, 8, 128, dtype=BF16)

    def call():
        for t in (x, r, w):
            t.grad = None
        o = layer_norm(x, w, residual=r, is_rms_norm=True, return_residual=True)
        torch.autograd.backward((o.y, o.residual_out), (g, g))

    assert_host_budget(call, python=21, c=28)


def test_apex_fused_layer_norm_module(fake):
    from culmen.normalization import FusedLayerNorm

    m = FusedLayerNorm(256).to(BF16)
    (x,) = _leaves((4, 16, 256))

    def call():
        with torch.no_grad():
            m(x)

    assert_host_budget(call, python=11, c=13)
