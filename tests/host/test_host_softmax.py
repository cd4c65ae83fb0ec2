"""Host-path guard of the softmax family: a cached call makes a fixed, small number of calls (DESIGN.md).

The kernels are faked (``culmen.testing.hostcost.fake_kernels``), so this runs on CPU exactly the code a
GPU call runs after its first call. PyTorch's equivalent of a masked softmax is 2-4 torch ops (scale,
masked_fill, softmax, casts) forward and as many autograd nodes; culmen's is one allocation and one
launch per direction, the mask read in place (no expand, view or cast of it).
"""

import pytest
import torch

from culmen.testing.hostcost import assert_host_budget, fake_kernels

BF16 = torch.bfloat16
SHAPE = (2, 4, 64, 64)
EMPTY_LIKE = "_VariableFunctionsClass.empty_like"


@pytest.fixture
def fake():
    with fake_kernels() as launched:
        yield launched


@pytest.fixture
def scores():
    x = torch.randn(SHAPE, dtype=BF16, requires_grad=True)
    mask = torch.rand(SHAPE[0], 1, *SHAPE[2:]) < 0.2  # bool, broadcast over heads
    g = torch.randn(SHAPE, dtype=BF16)
    return x, mask, g


def test_op_forward_no_grad(fake, scores):
    from culmen.ops.softmax import scaled_masked_softmax

    x, mask, _ = scores

    def call():
        with torch.no_grad():
            scaled_masked_softmax(x, mask, 0.5)

    n = assert_host_budget(call, python=4, c=7)
    assert n.c_names[EMPTY_LIKE] == 1 and n.c == n.c_names[EMPTY_LIKE] + 6  # no mask expand / view / cast
    assert fake, "the fake kernels were not launched"


def test_op_forward_backward(fake, scores):
    from culmen.ops.softmax import scaled_masked_softmax

    x, mask, g = scores

    def call():
        x.grad = None
        scaled_masked_softmax(x, mask, 0.5).backward(g)

    before = len(fake)
    n = assert_host_budget(call, python=10, c=12)
    assert n.c_names[EMPTY_LIKE] == 2  # y and dx
    assert (len(fake) - before) % 2 == 0


def test_apex_masked_softmax_forward_backward(fake, scores):
    from culmen.transformer.functional.fused_softmax import scaled_masked_softmax

    x, mask, g = scores

    def call():
        x.grad = None
        scaled_masked_softmax(x, mask, 0.5).backward(g)

    n = assert_host_budget(call, python=12, c=14)
    assert n.c_names[EMPTY_LIKE] == 2


def test_apex_causal_softmax_forward_backward(fake, scores):
    from culmen.transformer.functional.fused_softmax import scaled_upper_triang_masked_softmax

    x, _, g = scores

    def call():
        x.grad = None
        scaled_upper_triang_masked_softmax(x, None, 0.5).backward(g)

    n = assert_host_budget(call, python=12, c=14)
    assert n.c_names[EMPTY_LIKE] == 2  # no reshape to 3-D and back


def test_apex_module_no_grad(fake, scores):
    from culmen.transformer import AttnMaskType
    from culmen.transformer.functional import FusedScaleMaskSoftmax

    x, mask, _ = scores
    m = FusedScaleMaskSoftmax(False, True, AttnMaskType.padding, True, lambda t, k: t.masked_fill(k, -1e4), True, 0.5)

    def call():
        with torch.no_grad():
            m(x, mask)

    assert_host_budget(call, python=9, c=12)


def test_extension_halves(fake, scores):
    """Megatron's ``scaled_masked_softmax_cuda.forward`` / ``backward`` and the causal 3-D extension."""
    import importlib

    ext = importlib.import_module("culmen.transformer.functional._ext.scaled_masked_softmax_cuda")
    causal = importlib.import_module("culmen.transformer.functional._ext.scaled_upper_triang_masked_softmax_cuda")
    x, mask, g = scores
    x = x.detach()
    y = ext.forward(x, mask, 0.5)
    # The extensions' own checks (TORCH_CHECKs of the dims) run once per signature, with the plan.
    n = assert_host_budget(lambda: ext.backward(g, ext.forward(x, mask, 0.5), 0.5), python=12, c=12)
    assert n.c_names[EMPTY_LIKE] == 2
    x3, g3 = x.view(-1, *SHAPE[2:]), g.view(-1, *SHAPE[2:])
    n = assert_host_budget(lambda: causal.backward(g3, causal.forward(x3, 0.5), 0.5), python=12, c=10)
    assert n.c_names[EMPTY_LIKE] == 2 and y.shape == x.shape
