"""Host-path guard of GroupNorm: a cached call makes a fixed, small number of calls (DESIGN.md).

The kernels are faked (``culmen.testing.hostcost.fake_kernels``), so this runs on CPU exactly the code a
GPU call runs after its first call. On the GPU test machine a torch call (allocation, view, method)
costs 3-11 us and a Python call 0.2 us: the C-call budget is what keeps a call near PyTorch's cost.
Measured before the move to the shared call path (BoundLaunch plans, launches stubbed): forward 16
Python / 15 C calls, forward+backward 25 / 31.
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


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_group_norm_forward_no_grad(fake, layout):
    from culmen.ops.group_norm import group_norm

    x, w, b = _leaves((2, 64, 8, 8), 64, 64)
    if layout == "cl":
        x = x.detach().contiguous(memory_format=torch.channels_last)

    def call():
        with torch.no_grad():
            group_norm(x, 32, w, b, 1e-5, "silu")

    n = assert_host_budget(call, python=8, c=10)
    # y and one workspace (statistics + partials): no placeholders, no views.
    assert n.c_names["_VariableFunctionsClass.empty_like"] == 1
    assert n.c_names["_VariableFunctionsClass.empty"] == 1
    assert len(fake) >= 1


def test_group_norm_forward_backward(fake):
    from culmen.ops.group_norm import group_norm

    x, w, b = _leaves((2, 64, 8, 8), 64, 64)
    g = torch.randn(2, 64, 8, 8, dtype=BF16)

    def call():
        for t in (x, w, b):
            t.grad = None
        group_norm(x, 32, w, b, 1e-5, "silu").backward(g)

    n = assert_host_budget(call, python=16, c=20)
    # y + workspace, dx + dw + db + workspace: one launch per direction, no reshapes, no PyTorch reductions.
    assert n.c_names["_VariableFunctionsClass.empty_like"] == 4
    assert n.c_names["_VariableFunctionsClass.empty"] == 2
    assert len(fake) >= 2


def test_contrib_group_norm_module(fake):
    from culmen.contrib.group_norm import GroupNorm

    m = GroupNorm(32, 64, act="silu").to(BF16)
    (x,) = _leaves((2, 64, 8, 8))

    def call():
        with torch.no_grad():
            m(x)

    assert_host_budget(call, python=9, c=10)
