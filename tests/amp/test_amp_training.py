"""End-to-end: O0-O5 against fp32, several models / optimizers / losses, gradient accumulation,
O2 master weights (clipping, state dict, add_param_group), culmen's fused optimizers."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from amp_testutils import MLP, clean_amp, fresh, make_data  # noqa: F401 - clean_amp is an autouse fixture

from culmen import amp
from culmen.amp._amp_state import _amp_state

STEPS = 150


@functools.cache
def _fp32_losses(steps: int) -> tuple[float, ...]:
    return tuple(_train(None, steps))


def _train(level: str | None, steps: int = STEPS, **kw) -> list[float]:
    x, y = make_data(n=128)
    model, opt = fresh(lr=5e-3)
    if level is not None:
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        if level is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# Tolerance: the final loss of a mixed-precision run is within 15% (+0.002) of the fp32 run's, and
# both got below a fifth of the initial loss. bf16 keeps 8 mantissa bits, so its forward error on
# this problem is about 1e-2 relative; the 15% leaves room for that to compound over 150 steps.
@pytest.mark.parametrize("level, kw", [("O0", {}), ("O1", {}), ("O4", {}), ("O2", {}), ("O5", {}),
                                       ("O2", {"cast_model_type": torch.bfloat16}),
                                       ("O1", {"patch_torch_functions_type": torch.bfloat16})])
def test_converges_like_fp32(level, kw):
    ref = list(_fp32_losses(STEPS))
    amp_losses = _train(level, **kw)
    assert ref[-1] < ref[0] / 5
    assert amp_losses[-1] < amp_losses[0] / 5
    assert abs(amp_losses[-1] - ref[-1]) <= 0.15 * ref[-1] + 2e-3, (level, kw, amp_losses[-1], ref[-1])
    if level == "O0":
        assert amp_losses == ref  # O0 is fp32 throughout


def test_o3_pure_half_trains_with_sgd():
    x, y = make_data(n=128)
    model, opt = fresh(opt_cls=torch.optim.SGD, lr=0.05)
    model, opt = amp.initialize(model, opt, opt_level="O3", verbosity=0)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    first = None
    for _ in range(60):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < first / 2


def test_o2_master_weights():
    x, y = make_data()
    model, opt = fresh()
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    masters = list(amp.master_params(opt))
    assert all(m.dtype == torch.float32 and m.requires_grad for m in masters)
    assert model.fc1.weight.dtype == torch.float16 and model.bn.weight.dtype == torch.float32
    out = model(x.double())  # the patched forward casts floating inputs; outputs come back fp32
    assert out.dtype == torch.float32
    for _ in range(3):
        opt.zero_grad()
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in amp.master_params(opt))
        total = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm=0.05)
        assert torch.isfinite(total)
        clipped = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in amp.master_params(opt)]))
        assert clipped <= 0.05 * (1 + 1e-5)
        opt.step()
        assert all(m.grad is None for m in amp.master_params(opt) if m.dtype == torch.float32
                   and m is not model.bn.weight and m is not model.bn.bias)
    # The model holds the masters rounded to fp16; its state dict holds the exact fp32 masters.
    assert torch.equal(model.fc1.weight, opt.param_groups[0]["params"][0].half())
    sd = model.state_dict()
    assert all(v.dtype != torch.float16 for v in sd.values())
    assert torch.equal(sd["fc1.weight"], opt.param_groups[0]["params"][0])
    assert sd["bn.running_mean"].dtype == torch.float32


def test_o2_add_param_group_and_zero_grad_set_to_none():
    x, y = make_data()
    model, opt = fresh(opt_cls=torch.optim.SGD, lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    extra = torch.nn.Parameter(torch.randn(5).half())
    opt.add_param_group({"params": extra, "lr": 0.5})
    new_master = opt.param_groups[-1]["params"][0]
    assert new_master.dtype == torch.float32 and new_master is not extra
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y) + (extra.float() ** 2).sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    m0 = new_master.detach().clone()
    expected = m0 - 0.5 * 2 * m0.half().float()  # the grad comes from the fp16 model copy
    opt.step()
    torch.testing.assert_close(new_master.detach(), expected)
    assert torch.equal(extra.detach(), new_master.detach().half())
    assert new_master.grad is None  # master grads are dropped after the step (as Apex)
    assert model.fc1.weight.grad is not None
    opt.zero_grad(set_to_none=True)
    assert model.bn.weight.grad is None and model.fc1.weight.grad is None and extra.grad is None
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.zero_grad()  # Apex's default: zero in place
    assert torch.count_nonzero(model.fc1.weight.grad) == 0 and torch.count_nonzero(model.bn.weight.grad) == 0


def test_several_models_optimizers_losses():
    """A GAN-like set-up: two models, two optimizers, three losses with their own scalers."""
    x, y = make_data()
    gen, opt_g = fresh(seed=1)
    disc, opt_d = fresh(seed=2, d_in=5, d_out=1)
    [gen, disc], [opt_g, opt_d] = amp.initialize([gen, disc], [opt_g, opt_d], opt_level="O2", num_losses=3,
                                                 verbosity=0)
    scalers = _amp_state.loss_scalers
    for s in scalers:
        s._loss_scale = 256.0

    def step(poison_loss: int | None):
        opt_g.zero_grad()
        opt_d.zero_grad()
        fake = gen(x)
        losses = [disc(fake.detach()).mean(), F.mse_loss(fake, y), disc(fake).pow(2).mean()]
        if poison_loss is not None:
            losses[poison_loss] = losses[poison_loss] * float("inf")
        with amp.scale_loss(losses[0], opt_d, loss_id=0) as s:
            s.backward()
        with amp.scale_loss(losses[1], opt_g, loss_id=1) as s:
            s.backward(retain_graph=True)
        with amp.scale_loss(losses[2], [opt_g, opt_d], loss_id=2) as s:
            s.backward()
        opt_d.step()
        opt_g.step()

    step(None)
    g_before = [p.detach().clone() for p in gen.parameters()]
    d_before = [p.detach().clone() for p in disc.parameters()]
    step(poison_loss=1)  # only the generator's reconstruction loss overflows
    assert [s.loss_scale() for s in scalers] == [256.0, 128.0, 256.0]
    assert all(torch.equal(a, b) for a, b in zip(g_before, gen.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(d_before, disc.parameters()))
    d_before = [p.detach().clone() for p in disc.parameters()]
    step(poison_loss=2)  # the loss shared by both optimizers: both skip
    assert [s.loss_scale() for s in scalers] == [256.0, 128.0, 128.0]
    assert all(torch.equal(a, b) for a, b in zip(d_before, disc.parameters()))
    step(None)
    assert any(not torch.equal(a, b) for a, b in zip(d_before, disc.parameters()))


def _reference_grads(model_fp32, xs, ys):
    model_fp32.zero_grad()
    for x, y in zip(xs, ys):
        F.mse_loss(model_fp32(x).float(), y).backward()
    return [p.grad.clone() for p in model_fp32.parameters()]


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("delay", [True, False])
def test_gradient_accumulation(level, delay):
    """Three micro-batches: the unscaled accumulated grads match fp32's (fp16 rounding aside), whether
    the grads stay scaled until the last micro-batch (delay_unscale) or are unscaled each time."""
    x, y = make_data(n=96)
    xs, ys = x.chunk(3), y.chunk(3)
    ref_model, _ = fresh(bn=False)
    ref = _reference_grads(ref_model, xs, ys)
    model, opt = fresh(bn=False)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    _amp_state.loss_scalers[0]._loss_scale = 1024.0
    opt.zero_grad()
    for i, (xb, yb) in enumerate(zip(xs, ys)):
        loss = F.mse_loss(model(xb).float(), yb)
        with amp.scale_loss(loss, opt, delay_unscale=delay and i < 2) as scaled:
            scaled.backward()
    got = [p.grad for p in amp.master_params(opt)]
    for g, r in zip(got, ref):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, atol=2e-3 * r.abs().max().item() + 1e-5, rtol=2e-2)


def test_accumulation_paths_agree():
    x, y = make_data(n=96)
    xs, ys = x.chunk(3), y.chunk(3)
    grads = {}
    for delay in (True, False):
        amp.deinitialize()
        model, opt = fresh(bn=False)
        model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=1024.0, verbosity=0)
        opt.zero_grad()
        for i, (xb, yb) in enumerate(zip(xs, ys)):
            with amp.scale_loss(F.mse_loss(model(xb), yb), opt, delay_unscale=delay and i < 2) as scaled:
                scaled.backward()
        grads[delay] = [p.grad.clone() for p in amp.master_params(opt)]
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, atol=1e-3 * b.abs().max().item(), rtol=1e-2)


def test_static_scale_accumulates_fp32_params_under_o2():
    """Static scale 1 with master weights: batch-norm (fp32) grads still accumulate over backwards."""
    x, y = make_data(n=64)
    model, opt = fresh()
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=1.0, verbosity=0)
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as s:
        s.backward()
    one = model.bn.weight.grad.clone()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as s:
        s.backward()
    torch.testing.assert_close(model.bn.weight.grad, 2 * one, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_culmen_fused_optimizers(name, level):
    optimizers = pytest.importorskip("culmen.optimizers")
    cls = getattr(optimizers, name)
    ref_losses = _fp32_losses(40)
    x, y = make_data(n=128)
    torch.manual_seed(0)
    model = MLP()
    lr = 5e-3 if name == "FusedAdam" else 0.05
    opt = cls(model.parameters(), lr=lr)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    for _ in range(40):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    assert loss.item() < ref_losses[0] / 3
