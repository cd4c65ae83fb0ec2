"""Checkpoint / resume of every fused optimizer: 2 steps, state_dict through torch.save/load, a fresh
optimizer on fresh params loads it, 2 more steps == 4 uninterrupted steps, bit for bit (FusedAdam's own
test does 3 + 4 steps with master weights and capturable mode)."""

from __future__ import annotations

import pytest
import torch

from culmen.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedLARS,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

SHAPES = ((1,), (5, 123), (2049,))
DTYPES = [torch.float32, torch.bfloat16, torch.float32]

MAKERS = {
    "adam": lambda ps: FusedAdam([{"params": ps[:1]}, {"params": ps[1:], "lr": 3e-3}], lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adagrad": lambda ps: FusedAdagrad(ps, lr=0.05, weight_decay=0.01),
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2, max_grad_norm=5.0),
    "mp_lamb": lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, reduced_precision_dtype=torch.bfloat16),
    "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01),
    "lars": lambda ps: FusedLARS(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
}


@pytest.mark.parametrize("name", list(MAKERS))
def test_resume_bitwise(backend, lockstep, name):
    make = MAKERS[name]
    init = lockstep.params(SHAPES, dtypes=DTYPES)
    grads = [lockstep.grads(init) for _ in range(4)]
    full, part = lockstep.copies(init), lockstep.copies(init)
    o_full, o_part = make(full), make(part)
    for s in range(4):
        lockstep.set_grads(full, grads[s])
        o_full.step()
    for s in range(2):
        lockstep.set_grads(part, grads[s])
        o_part.step()
    saved = lockstep.roundtrip(o_part.state_dict())
    resumed = lockstep.copies(part)
    o_res = make(resumed)
    o_res.load_state_dict(saved)
    for s in range(2, 4):
        lockstep.set_grads(resumed, grads[s])
        o_res.step()
    for x, y in zip(resumed, full):
        assert torch.equal(x.detach(), y.detach()), name
    for x, y in zip(resumed, full):
        sx, sy = o_res.state[x], o_full.state[y]
        assert sorted(sx) == sorted(sy)
        for k in sy:
            assert sx[k].dtype == sy[k].dtype, (name, k)
            assert torch.equal(sx[k], sy[k]), (name, k)
    for gx, gy in zip(o_res.param_groups, o_full.param_groups):
        if "step" in gy:
            assert torch.equal(torch.as_tensor(gx["step"]), torch.as_tensor(gy["step"]))


def test_state_dict_keys_follow_torch(lockstep):
    """FusedSGD's state is torch.optim.SGD's (momentum_buffer), so checkpoints move between them."""
    a = lockstep.params(SHAPES)
    b = lockstep.copies(a)
    ours = FusedSGD(a, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(b, lr=0.1, momentum=0.9)
    lockstep.run(ours, ref, a, b, steps=2)
    ref2 = torch.optim.SGD(lockstep.copies(a), lr=0.1, momentum=0.9)
    ref2.load_state_dict(lockstep.roundtrip(ours.state_dict()))
    ours2 = FusedSGD(lockstep.copies(a), lr=0.1, momentum=0.9)
    ours2.load_state_dict(lockstep.roundtrip(ref.state_dict()))
    assert all("momentum_buffer" in s for s in ref2.state.values())
    assert all("momentum_buffer" in s for s in ours2.state.values())


def test_adam_loads_torch_adamw_checkpoint(lockstep):
    """torch.optim.AdamW's per-param steps become FusedAdam's group step: training continues identically."""
    a = lockstep.params(SHAPES)
    b = lockstep.copies(a)
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        lockstep.set_grads(b, lockstep.grads(b))
        ref.step()
    ours = FusedAdam(lockstep.copies(b), lr=1e-2, weight_decay=0.1)
    ours.load_state_dict(lockstep.roundtrip(ref.state_dict()))
    assert ours.param_groups[0]["step"] == 3
    a = ours.param_groups[0]["params"]
    lockstep.run(ours, ref, a, b, steps=2)
    lockstep.assert_close(a, b, what="param")
