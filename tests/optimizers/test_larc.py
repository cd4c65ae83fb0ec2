"""culmen.parallel.LARC against Apex's algorithm written out per param (clip and scale modes)."""

from __future__ import annotations

import pytest
import torch

from culmen.optimizers import FusedSGD
from culmen.parallel.LARC import LARC


def _apex_larc_step(opt, trust_coefficient, clip, eps):
    """Apex's LARC.step, one param at a time (the oracle)."""
    wds = []
    with torch.no_grad():
        for group in opt.param_groups:
            wd = group.get("weight_decay", 0)
            wds.append(wd)
            group["weight_decay"] = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                pn, gn = torch.norm(p.data.double()), torch.norm(p.grad.data.double())
                if pn != 0 and gn != 0:
                    rate = trust_coefficient * pn / (gn + pn * wd + eps)
                    if clip:
                        rate = min(rate / group["lr"], 1)
                    p.grad.data += wd * p.data
                    p.grad.data *= rate
    opt.step()
    for group, wd in zip(opt.param_groups, wds):
        group["weight_decay"] = wd


@pytest.mark.parametrize("clip", [True, False])
def test_larc_matches_apex(backend, lockstep, clip):
    shapes = ((63,), (5, 123), (2049,), (17,), (9,))
    a = lockstep.params(shapes)
    b = lockstep.copies(a)
    with torch.no_grad():  # a zero param (||p|| = 0) and, below, a zero gradient (||g|| = 0)
        a[3].zero_()
        b[3].zero_()
    tc = 0.02 if clip else 0.5
    ours = LARC(torch.optim.SGD([{"params": a[:3]}, {"params": a[3:], "lr": 0.5, "weight_decay": 0.2}], lr=0.1,
                                momentum=0.9, weight_decay=0.01), trust_coefficient=tc, clip=clip)
    inner = torch.optim.SGD([{"params": b[:3]}, {"params": b[3:], "lr": 0.5, "weight_decay": 0.2}], lr=0.1,
                            momentum=0.9, weight_decay=0.01)
    for _ in range(4):
        gs = lockstep.grads(a)
        gs[4] = torch.zeros_like(gs[4])
        lockstep.set_grads(a, gs)
        lockstep.set_grads(b, gs)
        ours.step()
        _apex_larc_step(inner, tc, clip, 1e-8)
        lockstep.assert_close([p.grad for p in a], [p.grad for p in b], what="grad")
    lockstep.assert_close(a, b, what="param")
    assert [g["weight_decay"] for g in ours.param_groups] == [0.01, 0.2]


def test_larc_wraps_fused_sgd_and_grad_scaler(backend, lockstep):
    a = lockstep.params(((63,), (2049,)))
    b = lockstep.copies(a)
    ours = LARC(FusedSGD(a, lr=0.1, momentum=0.9, weight_decay=1e-3))
    inner = torch.optim.SGD(b, lr=0.1, momentum=0.9, weight_decay=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 7)
    for it in range(3):
        gs = lockstep.grads(a)
        for p in a:
            p.grad = None
        sc.scale(sum((p * g).sum() for p, g in zip(a, gs))).backward()
        if it == 1:
            a[0].grad.view(-1)[0] = float("inf")
        sc.step(ours)  # LARC is not _step_supports_amp_scaling: GradScaler unscales, then steps or skips
        sc.update()
        if it != 1:
            lockstep.set_grads(b, gs)
            _apex_larc_step(inner, 0.02, True, 1e-8)
    lockstep.assert_close(a, b, what="param")


def test_larc_delegates(lockstep):
    a = lockstep.params(((5,), (7,)))
    inner = torch.optim.SGD(a, lr=0.1, momentum=0.9)
    larc = LARC(inner)
    assert larc.param_groups is inner.param_groups and larc.state is inner.state
    lockstep.set_grads(a, lockstep.grads(a))
    loss = larc.step(lambda: torch.tensor(1.5))
    assert float(loss) == 1.5
    sd = larc.state_dict()
    assert "momentum_buffer" in next(iter(sd["state"].values()))
    larc.load_state_dict(sd)
    larc.zero_grad()
    assert all(p.grad is None for p in a)
    extra = torch.randn(3, requires_grad=True)
    larc.add_param_group({"params": [extra]})
    assert len(inner.param_groups) == 2
    assert repr(larc) == repr(inner)
