"""Host-path guard of the activation family and the dense compositions built on it: a cached call makes
a fixed, small number of calls (DESIGN.md).

The kernels are faked (``culmen.testing.hostcost.fake_kernels``), so this runs on CPU exactly the code a
GPU call runs after its first call (the GEMMs of the dense compositions run for real, on CPU). On the
GPU test machine a torch call (allocation, view, method) costs 3-11 us and a Python call 0.2 us: the
C-call budget is what keeps a call near PyTorch's cost.
"""

import pytest
import torch

from culmen.testing.hostcost import assert_host_budget, fake_kernels

BF16 = torch.bfloat16
EMPTY, EMPTY_LIKE = "_VariableFunctionsClass.empty", "_VariableFunctionsClass.empty_like"


@pytest.fixture
def fake():
    with fake_kernels() as launched:
        yield launched


def _leaves(*shapes):
    return [torch.randn(s, dtype=BF16, requires_grad=True) for s in shapes]


def _allocs(n) -> int:
    return n.c_names[EMPTY] + n.c_names[EMPTY_LIKE]


def test_swiglu_forward_no_grad(fake):
    from culmen.flash_attn.ops.activations import swiglu

    a, u = _leaves((64, 1024), (64, 1024))

    def call():
        with torch.no_grad():
            swiglu(a, u)

    n = assert_host_budget(call, python=6, c=8)
    assert _allocs(n) == 1 and fake


def test_swiglu_forward_backward(fake):
    from culmen.flash_attn.ops.activations import swiglu

    a, u = _leaves((64, 1024), (64, 1024))
    g = torch.randn(64, 1024, dtype=BF16)

    def call():
        a.grad = u.grad = None
        swiglu(a, u).backward(g)

    # +1 Python / +2 C calls: whether the saved inputs are free to take the gradients (here leaves the caller
    # holds: one reference count says no); test_swiglu_on_projections shows what it saves.
    n = assert_host_budget(call, python=13, c=18)
    assert _allocs(n) == 3  # y, dx, du
    fake.clear()
    call()
    assert len(fake) == 2  # one forward and one backward launch


def test_swiglu_on_the_halves_of_one_tensor(fake):
    """``swiglu(*h.chunk(2, -1))``: the kernels read the halves in place (no copy) and the backward writes
    ``h``'s gradient as one buffer: autograd runs no chunk backward (no concatenation)."""
    from culmen.flash_attn.ops.activations import swiglu

    (w,) = _leaves((64, 2048))
    g = torch.randn(64, 1024, dtype=BF16)
    h = w * 1  # the linear's output (built once: the count is swiglu's, not the product's)

    def call():
        w.grad = None
        swiglu(*h.chunk(2, -1)).backward(g, retain_graph=True)

    n = assert_host_budget(call, python=13, c=20)  # +1 / +1: the graph is kept (retain_graph): no reuse
    assert _allocs(n) == 2  # y and the one (64, 2048) gradient buffer
    assert "Tensor.contiguous" not in n.c_names and "Tensor.reshape" not in n.c_names
    y = swiglu(*h.chunk(2, -1))
    assert [f for f, _ in y.grad_fn.next_functions if f is not None] == [h.grad_fn]


def test_swiglu_on_projections(fake):
    """An MLP's gate and up projections are saved by the activation alone: the backward writes dx / du into
    them (two allocations fewer than the leaves of test_swiglu_forward_backward)."""
    from culmen.flash_attn.ops.activations import swiglu

    (w,) = _leaves((64, 1024))
    g = torch.randn(64, 1024, dtype=BF16)

    def call():
        w.grad = None
        swiglu(w * 1, w * 2).backward(g)

    # The checks are 8 cheap C calls (reference and use counts, no allocation), plus two detaches and a version
    # bump, where the fresh backward pays two allocations.
    n = assert_host_budget(call, python=12, c=25)
    assert _allocs(n) == 1  # y only


def test_bias_gelu_forward_backward(fake):
    from culmen.ops.activations import bias_act

    x, b = _leaves((4, 16, 256), 256)
    g = torch.randn(4, 16, 256, dtype=BF16)

    def call():
        x.grad = b.grad = None
        bias_act(x, b, "gelu_tanh").backward(g)

    n = assert_host_budget(call, python=15, c=19)
    assert _allocs(n) == 4  # y, dx, the bias-grad partials, dbias


def test_relu_bit_mask_forward_backward(fake):
    from culmen.ops.activations import bias_act

    (x,) = _leaves((64, 1024))
    g = torch.randn(64, 1024, dtype=BF16)

    def call():
        x.grad = None
        bias_act(x, None, "relu").backward(g)

    n = assert_host_budget(call, python=13, c=13)
    assert _allocs(n) == 3  # y, the bit mask, dx


def test_apex_mlp_forward_backward(fake):
    """Apex's ``MLP`` (its test asserts it is faster than ``nn.Sequential``): the checks run once per
    signature; per layer a GEMM forward, and one fused activation-gradient launch and two GEMMs backward."""
    from culmen.mlp import MLP

    m = MLP([64, 128, 32]).to(BF16)
    (x,) = _leaves((16, 64))
    g = torch.randn(16, 32, dtype=BF16)
    params = list(m.parameters())

    def call():
        x.grad = None
        for p in params:
            p.grad = None
        m(x).backward(g)

    n = assert_host_budget(call, python=22, c=35)
    assert "Tensor.contiguous" not in n.c_names and "Tensor.to" not in n.c_names


def test_flash_attn_fused_mlp_forward_backward(fake):
    from culmen.flash_attn.ops.fused_dense import FusedMLP

    m = FusedMLP(64, 128, dtype=BF16)
    (x,) = _leaves((16, 64))
    g = torch.randn(16, 64, dtype=BF16)
    params = list(m.parameters())

    def call():
        x.grad = None
        for p in params:
            p.grad = None
        m(x).backward(g)

    n = assert_host_budget(call, python=24, c=28)
    assert "Tensor.contiguous" not in n.c_names and "Tensor.to" not in n.c_names


def test_apex_fused_dense_forward_backward(fake):
    from culmen.fused_dense import FusedDense, FusedDenseGeluDense

    d = FusedDense(64, 96).to(BF16)
    (x,) = _leaves((16, 64))
    g = torch.randn(16, 96, dtype=BF16)

    def call():
        x.grad = d.weight.grad = d.bias.grad = None
        d(x).backward(g)

    assert_host_budget(call, python=13, c=13)
    m = FusedDenseGeluDense(64, 128, 64).to(BF16)
    g2 = torch.randn(16, 64, dtype=BF16)

    def call2():
        x.grad = None
        for p in m.parameters():
            p.grad = None
        m(x).backward(g2)

    n = assert_host_budget(call2, python=23, c=27)
    assert "Tensor.contiguous" not in n.c_names
