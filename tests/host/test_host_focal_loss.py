"""Host-path guard of the focal loss: a cached call makes a fixed, small number of calls (DESIGN.md).

The kernels are faked (``culmen.testing.hostcost.fake_kernels``): this runs on CPU exactly the code a GPU
call runs after its first call. Labels are not value-checked there (only where that costs no device
sync, or with ``set_check_values(True)``).
"""

import pytest
import torch

from culmen.testing.hostcost import assert_host_budget, fake_kernels

EMPTY, EMPTY_LIKE = "_VariableFunctionsClass.empty", "_VariableFunctionsClass.empty_like"


@pytest.fixture
def fake():
    with fake_kernels() as launched:
        yield launched


def _inputs():
    x = torch.randn(2, 1000, 16, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(-2, 14, (2, 1000))
    return x, labels, torch.tensor([37.0])


def test_focal_loss_forward_no_grad(fake):
    from culmen.ops.focal_loss import focal_loss

    x, labels, nps = _inputs()

    def call():
        with torch.no_grad():
            focal_loss(x, labels, nps, 14, 0.25, 2.0)

    n = assert_host_budget(call, python=7, c=10)
    assert n.c_names[EMPTY] == 2 and "Tensor.reshape" not in n.c_names  # loss + partials; no views
    assert "aminmax" not in str(n) and "Tensor.to" not in n.c_names


def test_focal_loss_forward_backward(fake):
    from culmen.ops.focal_loss import focal_loss

    x, labels, nps = _inputs()

    def call():
        x.grad = None
        focal_loss(x, labels, nps, 14, 0.25, 2.0, 0.1).backward()

    n = assert_host_budget(call, python=13, c=17)
    assert n.c_names[EMPTY] + n.c_names[EMPTY_LIKE] == 3  # loss, partials, dx
    fake.clear()
    call()
    assert len(fake) == 3  # forward, finish, backward


def test_focal_loss_number_normalizer_and_int8_labels(fake):
    """Unusual arguments cost only their own conversions: a number as normalizer (one fill), labels of
    another integer dtype (one cast)."""
    from culmen.ops.focal_loss import focal_loss

    x, labels, _ = _inputs()
    lab8 = labels.to(torch.int8)

    def call():
        with torch.no_grad():
            focal_loss(x, lab8, 37.0, 14, 0.25, 2.0)

    n = assert_host_budget(call, python=7, c=13)
    assert n.c_names["_VariableFunctionsClass.full"] == 1 and n.c_names["Tensor.to"] == 1
