"""Gradients after an unscaling update: Apex's capturable Adam kernels store the unscaled gradient back
(``g = g * inv_scale``) when they step and leave it alone on a skipped step; the optimizers' variant
(``unscale_skipped``) unscales on a skipped step too. LAMB overwrites the gradients with its updates, and
with ``unscale_skipped`` leaves them unscaled on a skipped step. References and Triton kernels
(interpreter), and the custom op traced by ``torch.compile`` declares the gradients mutated."""

from __future__ import annotations

import pytest
import torch

from culmen.multi_tensor_apply import amp_C
from culmen.ops.multi_tensor import adam, lamb

SIZES = (3, 8192 + 5, 100)


def _lists(k, positive=(), dtypes=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtypes = dtypes or [torch.float32] * k
    out = []
    for i in range(k):
        lst = [torch.randn(n, generator=gen).to(dtypes[i]) for n in SIZES]
        out.append([x.abs() + 0.1 for x in lst] if i in positive else lst)
    return out


def _c(x, dtype=torch.float32):
    return torch.tensor([x], dtype=dtype)


@pytest.fixture(params=["reference_backend", "triton_backend"])
def any_backend(request):
    request.getfixturevalue(request.param)


@pytest.mark.parametrize("master", [False, True])
def test_capturable_adam_writes_unscaled_grads_back(any_backend, master):
    ls = _lists(4, positive=(3,), dtypes=[torch.float16, torch.float32, torch.float32, torch.float32])
    if master:
        ls = [ls[0], [x.half() for x in ls[1]], ls[2], ls[3], ls[1]]
    g0 = [g.clone() for g in ls[0]]
    fn = amp_C.multi_tensor_adam_capturable_master if master else amp_C.multi_tensor_adam_capturable
    fn(2048, torch.zeros(1, dtype=torch.int32), ls, _c(1e-2), 0.9, 0.99, 1e-8, _c(1, torch.int32), 1, 1, 0.0,
       _c(0.25))
    for g, before in zip(ls[0], g0):
        assert torch.equal(g, (before.float() * 0.25).half())
    # a skipped step (noop set) touches nothing, the gradients included (as Apex's kernels)
    snap = [[t.clone() for t in lst] for lst in ls]
    fn(2048, torch.ones(1, dtype=torch.int32), ls, _c(1e-2), 0.9, 0.99, 1e-8, _c(2, torch.int32), 1, 1, 0.0,
       _c(0.25))
    for lst, old in zip(ls, snap):
        assert all(torch.equal(a, b) for a, b in zip(lst, old))


def test_adam_update_unscale_skipped(any_backend):
    """``unscale_skipped``: a skipped step still unscales the gradients (and changes nothing else). (The
    optimizers' fast path, which divides by GradScaler's scale in the kernel, is covered by
    tests/optimizers/test_grad_scaler_contract.py.)"""
    ls = _lists(4, positive=(3,))
    g0 = [g.clone() for g in ls[0]]
    rest = [[t.clone() for t in lst] for lst in ls[1:]]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, step=1, mode=1, bias_correction=True, weight_decay=0.0,
              inv_scale=_c(0.25), unscale_skipped=True)
    adam.adam_update(ls, noop_flag=torch.ones(1), **kw)  # GradScaler's float found_inf
    for g, before in zip(ls[0], g0):
        assert torch.equal(g, before * 0.25)
    for lst, old in zip(ls[1:], rest):
        assert all(torch.equal(a, b) for a, b in zip(lst, old))
    adam.adam_update(ls, noop_flag=torch.zeros(1), **kw)  # a taken step unscales once more, and updates
    for g, before in zip(ls[0], g0):
        assert torch.equal(g, before * 0.0625)
    assert not torch.equal(ls[1][1], rest[0][1])


def test_lamb_unscale_skipped(any_backend):
    ls = _lists(4, positive=(3,))
    g0 = [g.clone() for g in ls[0]]
    rest = [[t.clone() for t in lst] for lst in ls[1:]]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, step=1, bias_correction=True, weight_decay=0.01,
              grad_averaging=True, mode=1, global_grad_norm=_c(3.0), max_grad_norm=1.0, use_nvlamb=False,
              inv_scale=_c(0.5), unscale_skipped=True)
    lamb.lamb_update(ls, noop_flag=torch.ones(1, dtype=torch.int32), **kw)
    for g, before in zip(ls[0], g0):
        assert torch.equal(g, before * 0.5)
    for lst, old in zip(ls[1:], rest):
        assert all(torch.equal(a, b) for a, b in zip(lst, old))
    # without unscale_skipped (amp_C's lamb): a skipped step leaves the gradients as they are
    kw["unscale_skipped"] = False
    snap = [g.clone() for g in ls[0]]
    lamb.lamb_update(ls, noop_flag=torch.ones(1, dtype=torch.int32), **kw)
    assert all(torch.equal(a, b) for a, b in zip(ls[0], snap))


def test_compiled_adam_mutates_grads(reference_backend):
    """Under torch.compile the capturable op is a custom-op node that declares the gradients mutated: the
    compiled function leaves them as eager does."""
    torch._dynamo.reset()

    def step(g, p, m, v, lr, st, inv, flag):
        amp_C.multi_tensor_adam_capturable(2048, flag, [g, p, m, v], lr, 0.9, 0.99, 1e-8, st, 1, 1, 0.0, inv)

    base = _lists(4, positive=(3,))
    runs = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        ls = [[t.clone() for t in lst] for lst in base]
        fn(*ls, _c(1e-2), _c(1, torch.int32), _c(0.5), torch.zeros(1, dtype=torch.int32))
        runs.append(ls)
    for a, b in zip(*runs):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert torch.equal(runs[1][0][0], base[0][0] * 0.5)
