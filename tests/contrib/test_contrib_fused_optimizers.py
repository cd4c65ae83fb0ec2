"""Apex's old-API ``contrib.optimizers`` FusedAdam / FusedLAMB / FusedSGD against float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from culmen.contrib.optimizers import FusedAdam, FusedLAMB, FusedSGD


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in ((7, 5), (13,), (3, 3, 2))]


def _old_adam_ref(ps, grads_seq, scales, norms, lr, b1, b2, eps, wd, max_norm, inside):
    ps = [p.double().clone() for p in ps]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    out = []
    for t, (gs, scale, gn) in enumerate(zip(grads_seq, scales, norms), 1):
        comb = scale
        if max_norm > 0:
            clip = (gn / scale + 1e-6) / max_norm
            if clip > 1:
                comb = clip * scale
        step_size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        for p, m, v, g in zip(ps, ms, vs, gs):
            g = g.double() / comb
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            den = torch.sqrt(v + eps) if inside else v.sqrt() + eps
            p.sub_(step_size * (m / den + wd * p))
        out.append([p.clone() for p in ps])
    return out


@pytest.mark.parametrize("inside", [False, True])
def test_old_fused_adam(inside):
    ps = [p.requires_grad_() for p in _params()]
    ref_init = [p.detach().clone() for p in ps]
    outs = [torch.full_like(p, float("nan"), dtype=torch.float16) for p in ps]
    opt = FusedAdam(ps, lr=1e-2, eps=1e-6, weight_decay=0.1, max_grad_norm=2.0, eps_inside_sqrt=inside)
    g = torch.Generator().manual_seed(1)
    grads_seq, scales, norms = [], [], []
    for _ in range(7):
        scale = 8.0
        gs = [torch.randn(p.shape, generator=g) * scale for p in ps]
        keep = [x.clone() for x in gs]
        norm = math.sqrt(sum(float(x.square().sum()) for x in gs))
        opt.step(grads=gs, output_params=outs, scale=scale, grad_norms=[norm])
        assert all(torch.equal(a, b) for a, b in zip(gs, keep)), "the caller's gradients were modified"
        grads_seq.append(gs)
        scales.append(scale)
        norms.append(norm)
    ref = _old_adam_ref(ref_init, grads_seq, scales, norms, 1e-2, 0.9, 0.999, 1e-6, 0.1, 2.0, inside)[-1]
    for p, r, o in zip(ps, ref, outs):
        assert (p.double() - r).abs().max() < 1e-5
        assert torch.equal(o, p.detach().half())


def test_old_fused_adam_rejects_bad_arguments():
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(_params(), amsgrad=True)
    with pytest.raises(ValueError, match="lr"):
        FusedAdam(_params(), lr=-1)
    opt = FusedAdam(_params())
    with pytest.raises(ValueError, match="grads"):
        opt.step(grads=[torch.ones(1)])


def test_old_fused_lamb_is_fused_lamb():
    from culmen.optimizers import FusedLAMB as NewLAMB

    a, b = [p.requires_grad_() for p in _params()], [p.requires_grad_() for p in _params()]
    o1 = FusedLAMB(a, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    o2 = NewLAMB(b, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        for x, y in zip(a, b):
            x.grad = torch.randn(x.shape, generator=g)
            y.grad = x.grad.clone()
        o1.step()
        o2.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(TypeError):
        FusedLAMB(a, use_nvlamb=True)


def test_old_fused_sgd():
    ps = [p.requires_grad_() for p in _params()]
    ref = [p.detach().double().clone().requires_grad_() for p in ps]
    opt = FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    outs = [torch.full_like(p, float("nan"), dtype=torch.bfloat16) for p in ps]
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        gs = [torch.randn(p.shape, generator=g) for p in ps]
        opt.step(grads=[x * 4.0 for x in gs], output_params=outs, scale=4.0)
        for r, x in zip(ref, gs):
            r.grad = x.double()
        ref_opt.step()
        assert all(p.grad is None for p in ps)
    for p, r, o in zip(ps, ref, outs):
        assert (p.double() - r).abs().max() < 1e-5
        assert torch.equal(o, p.detach().bfloat16())
