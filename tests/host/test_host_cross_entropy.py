"""Host-path guard of the cross-entropy family: a cached call makes a fixed, small number of calls (DESIGN.md).

The kernels are faked (``culmen.testing.hostcost.fake_kernels``), so this runs on CPU exactly the code a
GPU call runs after its first call, except the label value check, which runs for CPU labels only (one
``Tensor.any`` in the counts; on a GPU it runs only under ``set_check_values(True)``). On the GPU test
machine a torch call (allocation, view, method) costs 3-11 us and a Python call 0.2 us: the C-call budget
is what keeps a call near PyTorch's cost (``F.cross_entropy`` fwd+bwd: 182 us at 64 x 1000 bf16).

Before the plans (FastLauncher, checks and PyTorch reductions per call), the same calls counted: forward
without grad 23 Python / 23 C calls, per-row loss + ``.mean()`` fwd+bwd 38 / 37, flash_attn's module
mean 41 / 45 (plus its ``!=``, ``/`` operators, which the counter does not see), Apex's loss 41 / 43,
the fused linear loss with one chunk 39 / 58.
"""

import pytest
import torch

from culmen.testing.hostcost import assert_host_budget, fake_kernels

BF16 = torch.bfloat16
N, V = 64, 1000


@pytest.fixture
def fake():
    with fake_kernels() as launched:
        yield launched


def _logits(dtype=BF16):
    return torch.randn(N, V, dtype=dtype, requires_grad=True), torch.randint(0, V, (N,))


def test_forward_no_grad(fake):
    from culmen.ops.cross_entropy import cross_entropy

    x, y = _logits()

    def call():
        with torch.no_grad():
            cross_entropy(x, y)

    n = assert_host_budget(call, python=8, c=12)
    assert n.c_names["_VariableFunctionsClass.empty"] == 3  # loss, z-loss, LSE: nothing else
    assert n.py_names["Launch.__call__"] == 1


def test_rows_then_mean_forward_backward(fake):
    """The host probe's pattern: per-row losses, ``.mean()`` in PyTorch, backward."""
    from culmen.ops.cross_entropy import cross_entropy

    x, y = _logits()

    def call():
        x.grad = None
        cross_entropy(x, y).loss.mean().backward()

    n = assert_host_budget(call, python=14, c=17)
    assert n.c_names["_VariableFunctionsClass.empty"] == 3 and n.c_names["_VariableFunctionsClass.empty_like"] == 1
    assert n.py_names["Launch.__call__"] == 2


def test_mean_forward_backward(fake):
    """``reduction="mean"`` inside the op: one more launch, no PyTorch reduction, no scale ops."""
    from culmen.ops.cross_entropy import cross_entropy

    x, y = _logits()

    def call():
        x.grad = None
        cross_entropy(x, y, reduction="mean").loss.backward()

    n = assert_host_budget(call, python=15, c=17)
    # LSE, per-row scratch, loss, z-loss; the gradient.
    assert n.c_names["_VariableFunctionsClass.empty"] == 4 and n.c_names["_VariableFunctionsClass.empty_like"] == 1
    assert n.py_names["Launch.__call__"] == 3
    assert not any(k.startswith("Tensor.sum") or k.startswith("Tensor.expand") for k in n.c_names)


def test_flash_attn_module_mean(fake):
    from culmen.flash_attn.losses.cross_entropy import CrossEntropyLoss

    x, y = _logits()
    mod = CrossEntropyLoss(label_smoothing=0.1)

    def call():
        x.grad = None
        mod(x, y).backward()

    n = assert_host_budget(call, python=16, c=20)
    assert "Tensor.reshape" not in n.c_names and "Tensor.sum" not in n.c_names


def test_flash_attn_functional(fake):
    from culmen.flash_attn.ops.triton.cross_entropy import cross_entropy_loss

    x, y = _logits()

    def call():
        x.grad = None
        cross_entropy_loss(x, y, label_smoothing=0.1)[0].sum().backward()

    assert_host_budget(call, python=15, c=17)


def test_apex_xentropy_half_losses(fake):
    """Apex's fp16 losses come out of the kernel in fp16: no cast op, no extra autograd node."""
    from culmen.contrib.xentropy import SoftmaxCrossEntropyLoss

    x, y = _logits(torch.float16)

    def call():
        x.grad = None
        SoftmaxCrossEntropyLoss.apply(x, y, 0.1, 0, False).sum().backward()

    n = assert_host_budget(call, python=16, c=20)
    assert "Tensor.to" not in n.c_names and "Tensor.float" not in n.c_names


def _flce_call(n_tokens: int, monkeypatch):
    from culmen.ops.cross_entropy import fused_linear_cross_entropy
    from culmen.ops.cross_entropy.fused_linear import TUNING

    # The accumulating schedule: every chunk costs the same (two matmuls, one addmm_, one launch).
    monkeypatch.setitem(TUNING, "vocab_major", False)
    monkeypatch.setitem(TUNING, "recompute_dw", False)
    h = torch.randn(n_tokens, 32, dtype=BF16, requires_grad=True)
    w = torch.randn(V, 32, dtype=BF16, requires_grad=True)
    y = torch.randint(0, V, (n_tokens,))

    def call():
        h.grad = w.grad = None
        fused_linear_cross_entropy(h, w, y, chunk_size=8).backward()

    return call


def test_fused_linear_per_chunk_cost(fake, monkeypatch):
    """Per call: a fixed set of allocations; per extra chunk at most 2 Python and 3 C calls (the matmuls;
    the kernel is one direct launch: row offsets are kernel arguments, not views)."""
    one = assert_host_budget(_flce_call(8, monkeypatch), python=22, c=28)
    many = assert_host_budget(_flce_call(64, monkeypatch), python=22 + 7 * 2, c=28 + 7 * 3)
    assert one.c_names["_VariableFunctionsClass.empty"] == many.c_names["_VariableFunctionsClass.empty"] == 7
    assert (many.python - one.python) <= 7 * 2 and (many.c - one.c) <= 7 * 3
