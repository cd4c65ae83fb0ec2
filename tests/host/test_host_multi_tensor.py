"""Host-path guard of the multi-tensor family: a cached optimizer step or amp_C call makes a fixed, small
number of calls whatever the number of tensors (DESIGN.md).

The kernels are faked (``culmen.testing.hostcost.fake_kernels``), so this runs on CPU exactly the code a
GPU call runs after its first call. Per-tensor work is C-level only (``map`` over ``data_ptr`` / ``dtype``):
the Python-call budget does not grow with the tensor count, and no PyTorch op runs besides the launches.
"""

import pytest
import torch

from culmen.testing.hostcost import assert_host_budget, count_calls, fake_kernels

SIZES = (1000, 4096, 50, 77777, 12, 300) * 4  # the 24 params of the H100 host-cost probe


@pytest.fixture
def fake():
    with fake_kernels() as launched:
        yield launched


def _params(sizes=SIZES, dtype=torch.float32):
    ps = [torch.randn(n, dtype=dtype, requires_grad=True) for n in sizes]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def _torch_ops(n) -> int:
    """PyTorch functions called from culmen's frames (allocations, tensor ops)."""
    return sum(v for k, v in n.c_names.items() if k.startswith(("_VariableFunctionsClass", "Tensor.")))


def test_fused_adam_step(fake):
    from culmen.optimizers import FusedAdam

    opt = FusedAdam(_params(), lr=1e-3, weight_decay=0.01)
    n = assert_host_budget(opt.step, python=14, c=20)
    assert _torch_ops(n) == 1, n  # the alignment check's data_ptr only: no allocation, no torch op
    fake.clear()
    opt.step()
    assert len(fake) == 1  # one launch for 24 tensors


def test_fused_adam_step_new_gradients_every_step(fake):
    """``zero_grad(set_to_none=True)``: new gradient tensors each step (at alternating addresses)."""
    from culmen.optimizers import FusedAdam

    ps = _params()
    opt = FusedAdam(ps, lr=1e-3)
    sets = [[torch.randn_like(p) for p in ps] for _ in range(2)]
    it = [0]

    def step():
        it[0] ^= 1
        for p, g in zip(ps, sets[it[0]]):
            p.grad = g
        opt.step()

    n = assert_host_budget(step, python=14, c=22)
    assert _torch_ops(n) == 1, n
    many = _params(SIZES * 8)
    opt = FusedAdam(many, lr=1e-3)
    opt.step()
    assert count_calls(opt.step).python == n.python  # independent of the tensor count


def test_fused_adam_grad_scaler_and_capturable(fake):
    """GradScaler's attribute contract (scale and found_inf as device tensors) and capturable mode: the step
    counter is advanced by the kernel, the scale divided out in it: still no PyTorch op per step."""
    from culmen.optimizers import FusedAdam

    for capturable in (False, True):
        ps = _params()
        opt = FusedAdam(ps, lr=1e-3, capturable=capturable, master_weights=True)
        opt.grad_scale = torch.full((1,), 1024.0)
        opt.found_inf = torch.zeros(1)
        n = assert_host_budget(opt.step, python=14, c=24)
        assert _torch_ops(n) <= 4, n  # data_ptr of the flag/lr/step/scale for the alignment check


def test_fused_adam_mixed_dtypes_master_weights(fake):
    from culmen.optimizers import FusedAdam

    ps = _params()
    for p in ps[::2]:
        p.data = p.data.to(torch.bfloat16)
        p.grad = torch.randn_like(p)
    opt = FusedAdam(ps, lr=1e-3, master_weights=True)
    n = assert_host_budget(opt.step, python=18, c=26)
    assert _torch_ops(n) <= 2, n
    fake.clear()
    opt.step()
    assert len(fake) == 2  # fp32 params, bf16 params with masters


def test_fused_sgd_step(fake):
    from culmen.optimizers import FusedSGD

    opt = FusedSGD(_params(), lr=0.1, momentum=0.9)
    opt.step()  # the momentum buffers' first step
    n = assert_host_budget(opt.step, python=16, c=24)
    assert _torch_ops(n) <= 1, n


def test_amp_c_applier_cached(fake):
    from culmen.multi_tensor_apply import amp_C, multi_tensor_applier

    ps = _params()
    grads = [p.grad for p in ps]
    outs = [torch.empty_like(g) for g in grads]
    flag = torch.zeros(1, dtype=torch.int32)
    n = assert_host_budget(lambda: multi_tensor_applier(amp_C.multi_tensor_scale, flag, [grads, outs], 0.5),
                           python=16, c=20)
    assert _torch_ops(n) <= 1, n
    n = assert_host_budget(lambda: multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [grads], True),
                           python=18, c=24)
    # one buffer (norm, per-tensor norms, partial sums) and the two views returned
    assert n.c_names["_VariableFunctionsClass.empty"] == 1, n
    n = assert_host_budget(lambda: multi_tensor_applier(amp_C.multi_tensor_adam, flag, [grads, ps, outs, outs],
                                                        1e-3, 0.9, 0.999, 1e-8, 3, 1, 1, 0.0), python=16, c=24)
    assert _torch_ops(n) <= 1, n
