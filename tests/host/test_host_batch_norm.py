"""Host-path guard of (synchronized) batch norm: a cached call makes a fixed, small number of calls.

The kernels are faked (``culmen.testing.hostcost.fake_kernels``), so this runs on CPU exactly the code a
GPU call runs after its first call (one process: no collective). On the GPU test machine a torch call
(allocation, view, method) costs 3-11 us and a Python call 0.2 us. Measured before the move to the
shared call path (BoundLaunch plans, launches stubbed): forward 36 Python / 84 C calls, forward+backward
57 / 141, ``SyncBatchNorm`` forward+backward 60 / 145.
"""

import pytest
import torch

from culmen.testing.hostcost import assert_host_budget, fake_kernels

BF16 = torch.bfloat16


@pytest.fixture
def fake():
    with fake_kernels() as launched:
        yield launched


def _leaves(*shapes, dtype=BF16):
    return [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_batch_norm_forward_no_grad(fake, layout):
    from culmen.ops.batch_norm import sync_batch_norm

    (x,) = _leaves((4, 64, 8, 8))
    if layout == "channels_last":
        x = x.detach().contiguous(memory_format=torch.channels_last)
    w, b = _leaves(64, 64, dtype=torch.float32)
    rm, rv = torch.zeros(64), torch.ones(64)

    def call():
        with torch.no_grad():
            sync_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)

    n = assert_host_budget(call, python=9, c=14)
    # One workspace (partial statistics, final statistics) and y; statistics, combine (+ running update)
    # and normalize: three launches, no views.
    assert n.c_names["_VariableFunctionsClass.empty"] == 1
    assert n.c_names["_VariableFunctionsClass.empty_like"] == 1
    assert len(fake) == 3 * 3


def test_batch_norm_forward_backward(fake):
    from culmen.ops.batch_norm import sync_batch_norm

    (x,) = _leaves((4, 64, 8, 8))
    w, b = _leaves(64, 64, dtype=torch.float32)
    rm, rv = torch.zeros(64), torch.ones(64)
    g = torch.randn(4, 64, 8, 8, dtype=BF16)

    def call():
        for t in (x, w, b):
            t.grad = None
        sync_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5).backward(g)

    n = assert_host_budget(call, python=20, c=23)
    # Forward: workspace (with room for the backward's sums) + y; backward: dx, dweight, dbias.
    assert n.c_names["_VariableFunctionsClass.empty"] == 1
    assert n.c_names["_VariableFunctionsClass.empty_like"] == 4
    assert len(fake) == 3 * 6


def test_batch_norm_eval_no_grad(fake):
    from culmen.ops.batch_norm import sync_batch_norm

    (x,) = _leaves((4, 64, 8, 8))
    rm, rv = torch.zeros(64), torch.ones(64)

    def call():
        with torch.no_grad():
            sync_batch_norm(x, None, None, rm, rv, False, 0.1, 1e-5, fuse_relu=True)

    n = assert_host_budget(call, python=9, c=10)
    # invstd from the running variance in a kernel, not in PyTorch ops.
    assert n.c_names["_VariableFunctionsClass.empty"] == 1 and n.c_names["_VariableFunctionsClass.empty_like"] == 1


@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_batch_norm_module(fake, momentum):
    from culmen.parallel import SyncBatchNorm

    m = SyncBatchNorm(64, momentum=momentum)
    (x,) = _leaves((4, 64, 8, 8), dtype=torch.float32)
    g = torch.randn(4, 64, 8, 8)

    def call():
        x.grad = None
        m(x).backward(g)

    # num_batches_tracked.add_(1) is torch's own BatchNorm behaviour (and, with momentum=None, float() of it).
    n = assert_host_budget(call, python=22, c=25)
    assert n.c_names["_VariableFunctionsClass.empty"] == 1
    # A cumulative average (momentum=None) changes momentum every step: still one plan.
    from culmen.ops.batch_norm.launch import PLANS

    assert len(PLANS) == 1
