"""Checkpointing: model + optimizer + amp state saved mid-run and resumed in fresh objects gives a
loss curve bit-identical to the uninterrupted run (with an overflow and a scale change inside)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from amp_testutils import MLP, clean_amp, fresh, make_data  # noqa: F401 - clean_amp is an autouse fixture

from culmen import amp
from culmen.amp._amp_state import _amp_state

STEPS, SAVE_AT, POISON_AT = 14, 7, 3
CONFIGS = [
    ("O1", {}),
    ("O4", {"loss_scale": "dynamic"}),  # bf16 levels default to a static scale, which never skips
    ("O2", {}),
    ("O5", {"loss_scale": "dynamic"}),
    ("O2", {"num_losses": 2}),
    ("O1", {"fused": True}),  # optimizers that skip on the device: the scale update is deferred
    ("O2", {"fused": True}),
]


def _setup(level: str, kw: dict, seed: int):
    kw = dict(kw)
    if kw.pop("fused", False):
        model, opt = fresh(seed=seed, lr=1e-2, opt_cls=lambda p, lr: torch.optim.Adam(p, lr=lr, fused=True))
    else:
        model, opt = fresh(seed=seed, lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
    for s in _amp_state.loss_scalers:
        if s.dynamic:
            s._loss_scale, s._scale_seq_len = 512.0, 4  # a back-off and a regrowth within the run
    return model, opt


def _step(model, opt, x, y, i: int, num_losses: int) -> torch.Tensor:
    opt.zero_grad()
    out = model(x[i % 4::4])
    loss = F.mse_loss(out.float(), y[i % 4::4])
    if i == POISON_AT:
        loss = loss * float("inf")
    parts = [loss] if num_losses == 1 else [0.5 * loss, 0.5 * loss.detach() + out.float().pow(2).mean()]
    for k, part in enumerate(parts):
        with amp.scale_loss(part, opt, loss_id=k) as scaled:
            scaled.backward(retain_graph=k + 1 < len(parts))
    opt.step()
    return loss.detach()


def _save(model, opt) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("level, kw", CONFIGS)
@pytest.mark.parametrize("optimizer_first", [False, True])
def test_resume_is_bit_identical(level, kw, optimizer_first):
    x, y = make_data(n=64)
    n_losses = kw.get("num_losses", 1)
    model, opt = _setup(level, kw, seed=0)
    full = [_step(model, opt, x, y, i, n_losses) for i in range(STEPS)]
    scales = [s.loss_scale() for s in _amp_state.loss_scalers]

    amp.deinitialize()
    model, opt = _setup(level, kw, seed=0)
    first = [_step(model, opt, x, y, i, n_losses) for i in range(SAVE_AT)]
    blob = _save(model, opt)
    amp.deinitialize()

    # A fresh process's view: new objects with other initial weights, then the Apex recipe
    # (initialize, then load model / optimizer / amp state).
    model, opt = _setup(level, kw, seed=123)
    ckpt = torch.load(io.BytesIO(blob), weights_only=False)
    if optimizer_first:
        opt.load_state_dict(ckpt["optimizer"])
        model.load_state_dict(ckpt["model"])
    else:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    rest = [_step(model, opt, x, y, i, n_losses) for i in range(SAVE_AT, STEPS)]

    assert torch.equal(torch.stack(first + rest), torch.stack(full))
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == scales
    assert scales[0] != 512.0  # the run did change the scale
    assert torch.isinf(full[POISON_AT])


def test_o2_checkpoint_loads_into_fp32_model():
    x, y = make_data(n=64)
    model, opt = _setup("O2", {}, seed=0)
    for i in range(4):
        _step(model, opt, x, y, i, 1)
    sd = model.state_dict()
    assert all(v.dtype in (torch.float32, torch.int64) for v in sd.values())
    plain = MLP()
    plain.load_state_dict(sd)
    masters = list(amp.master_params(opt))
    assert torch.equal(plain.fc1.weight, masters[0])
