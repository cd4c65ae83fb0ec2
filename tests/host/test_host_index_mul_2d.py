"""Host-path guard of ``index_mul_2d``: a cached call makes a fixed, small number of calls (DESIGN.md).

The kernels are faked (``culmen.testing.hostcost.fake_kernels``): this runs on CPU exactly the code a GPU
call runs after its first call. Index values are not checked there (only where that costs no device
sync, or with ``set_check_values(True)``).
"""

import pytest
import torch

from culmen.testing.hostcost import assert_host_budget, fake_kernels


@pytest.fixture
def fake():
    with fake_kernels() as launched:
        yield launched


def _inputs():
    in1 = torch.randn(50, 64, dtype=torch.bfloat16, requires_grad=True)
    in2 = torch.randn(300, 64, dtype=torch.bfloat16, requires_grad=True)
    return in1, in2, torch.randint(0, 50, (300,))


def test_index_mul_2d_forward_no_grad(fake):
    from culmen.ops.index_mul_2d import index_mul_2d

    in1, in2, idx = _inputs()

    def call():
        with torch.no_grad():
            index_mul_2d(in1, in2, idx)

    n = assert_host_budget(call, python=8, c=11)
    assert n.c_names["_VariableFunctionsClass.empty_like"] == 1 and "Tensor.contiguous" not in n.c_names
    assert "aminmax" not in str(n)


def test_index_mul_2d_forward_backward(fake):
    """The backward: the sorted segmented sum (clamp + int32 key, stable sort, run starts) and one kernel
    writing both gradients."""
    from culmen.ops.index_mul_2d import index_mul_2d

    in1, in2, idx = _inputs()
    g = torch.randn(300, 64, dtype=torch.bfloat16)

    def call():
        in1.grad = in2.grad = None
        index_mul_2d(in1, in2, idx).backward(g)

    n = assert_host_budget(call, python=16, c=28)
    assert n.c_names["_VariableFunctionsClass.sort"] == 1
    fake.clear()
    call()
    assert len(fake) == 2
