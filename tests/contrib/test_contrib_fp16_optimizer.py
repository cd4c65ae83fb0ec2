"""``apex.contrib.optimizers.FP16_Optimizer``: flat fp32 masters around the old contrib ``FusedAdam``, loss
scaling, overflow skips, state round trips (CPU)."""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch

from culmen.contrib.optimizers import FP16_Optimizer, FusedAdam

warnings.filterwarnings("ignore", message=".*deprecated.*")


def _model(seed=0, dtype=torch.float16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)


def _loss(model, seed):
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(4, 6, generator=g).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


def _reference(params0, grads_per_step, lr, betas, eps, wd, max_norm=0.0):
    """The contrib FusedAdam update on float64 masters, from the unscaled gradients of each step."""
    ps = [p.double().clone() for p in params0]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t, grads in enumerate(grads_per_step, 1):
        gs = [g.double() for g in grads]
        if max_norm > 0:
            norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
            clip = (norm + 1e-6) / max_norm
            if clip > 1:
                gs = [g / clip for g in gs]
        bc1, bc2 = 1 - betas[0] ** t, 1 - betas[1] ** t
        for p, g, m, v in zip(ps, gs, ms, vs):
            m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
            v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            p.sub_(lr * math.sqrt(bc2) / bc1 * (m / (v.sqrt() + eps) + wd * p))
    return ps


@pytest.mark.parametrize("max_norm", [0.0, 0.05])
def test_steps_follow_the_contrib_adam_update_on_flat_masters(max_norm):
    model = _model()
    params0 = [p.detach().float().clone() for p in model.parameters()]
    opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=max_norm),
                         static_loss_scale=128.0)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"][0].dtype == torch.float32
    # the model's parameters are views of one flat half-precision buffer
    flat = opt.fp16_groups_flat[0]
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in model.parameters())
    grads_seen = []
    for step in range(3):
        opt.zero_grad()
        opt.backward(_loss(model, step))
        grads_seen.append([p.grad.float() / 128.0 for p in model.parameters()])
        assert opt.step() is None
    want = _reference(params0, grads_seen, 1e-2, (0.9, 0.999), 1e-8, 0.01, max_norm)
    masters = torch._utils._unflatten_dense_tensors(opt.fp32_groups_flat[0], want)
    for got, w, p in zip(masters, want, model.parameters()):
        torch.testing.assert_close(got.double(), w, rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), got.to(p.dtype))  # written back, cast, into the model


def test_overflow_skips_the_step_and_the_dynamic_scale_adapts(capsys):
    model = _model(1)
    opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 1024.0, "scale_window": 2})
    assert opt.loss_scale == 1024.0
    opt.backward(_loss(model, 0))
    next(model.parameters()).grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert "overflow" in capsys.readouterr().out
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    assert opt.loss_scale == 512.0 and not opt.optimizer.state
    for step in range(2):  # two clean steps: the window is 2, so the scale doubles once
        opt.zero_grad(set_grads_to_None=False)
        opt.backward(_loss(model, step + 1))
        opt.step()
    assert opt.loss_scale == 1024.0 and opt.cur_iter == 3
    assert not all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))


def test_state_dict_round_trip_continues_identically():
    def run(opt, model, steps):
        for s in steps:
            opt.zero_grad()
            opt.backward(_loss(model, s))
            opt.step()

    m1 = _model(2)
    o1 = FP16_Optimizer(FusedAdam(m1.parameters(), lr=5e-3), dynamic_loss_scale=True)
    run(o1, m1, range(2))
    buf = io.BytesIO()
    torch.save(o1.state_dict(), buf)  # through serialization, as a checkpoint (state_dict holds live tensors)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    assert {"cur_scale", "cur_iter", "optimizer_state_dict", "fp32_groups_flat", "scale_window"} <= set(sd)
    m2 = _model(3)  # other initial values: the loaded masters overwrite them
    o2 = FP16_Optimizer(FusedAdam(m2.parameters(), lr=5e-3), dynamic_loss_scale=True)
    o2.load_state_dict(sd)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(m1.parameters(), m2.parameters()))
    run(o1, m1, range(2, 4))
    run(o2, m2, range(2, 4))
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(m1.parameters(), m2.parameters()))
    assert o1.loss_scale == o2.loss_scale and o1.cur_iter == o2.cur_iter


def test_bf16_groups_and_closure():
    model = _model(4, torch.bfloat16)
    opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-2), verbose=False)

    def closure():
        opt.zero_grad()
        loss = _loss(model, 0)
        opt.backward(loss)
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))


def test_bad_arguments_are_named():
    model = _model()
    with pytest.raises(TypeError, match="wraps an optimizer"):
        FP16_Optimizer(list(model.parameters()))
    with pytest.raises(ValueError, match="dynamic_loss_args"):
        FP16_Optimizer(FusedAdam(_model().parameters()), dynamic_loss_scale=True, dynamic_loss_args={"delay": 2})
    with pytest.raises(ValueError, match="dynamic_loss_scale=True"):
        FP16_Optimizer(FusedAdam(_model().parameters()), dynamic_loss_args={"init_scale": 2.0})
    mixed = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float16)), torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(TypeError, match="one floating dtype"):
        FP16_Optimizer(FusedAdam(mixed))
    opt = FP16_Optimizer(FusedAdam(_model().parameters()))
    with pytest.raises(RuntimeError, match="no gradient"):
        opt.step()


def test_importable_through_the_apex_alias():
    import culmen.compat

    culmen.compat.install()
    from apex.contrib.optimizers import FP16_Optimizer as A
    from apex.contrib.optimizers.fp16_optimizer import FP16_Optimizer as B

    assert A is B is FP16_Optimizer
