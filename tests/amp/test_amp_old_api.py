"""The deprecated amp.init() / AmpHandle / OptimWrapper API still works (with a FutureWarning)."""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from amp_testutils import clean_amp, fresh, make_data  # noqa: F401 - clean_amp is an autouse fixture

from culmen import amp
from culmen.amp.handle import AmpHandle, NoOpHandle
from culmen.amp.opt import OptimWrapper

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # amp.init casts on CUDA when there is a GPU


@pytest.fixture(autouse=True)
def _rewarn():
    importlib.import_module("culmen.amp._amp_state")._warned.discard("amp.init")
    yield


def test_init_warns_once_and_casts():
    with pytest.warns(amp.DeprecatedFeatureWarning, match="amp.init"):
        handle = amp.init(loss_scale=128.0)
    assert isinstance(handle, AmpHandle) and handle.is_active() and handle.has_cache
    x, w = torch.randn(2, 3, device=DEV), torch.randn(3, 3, device=DEV)
    assert F.linear(x, w).dtype == torch.float16
    with handle._disable_casts():
        assert not handle.is_active()
        assert F.linear(x, w).dtype == torch.float32
    assert handle.is_active()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.init()  # the second call does not warn again
    amp._amp_state.handle._deactivate()


def test_handle_scale_loss_skips_on_overflow():
    x, y = make_data()
    model, opt = fresh(opt_cls=torch.optim.SGD, lr=0.1, bn=False)
    ref_model = copy.deepcopy(model)
    with pytest.warns(FutureWarning):
        handle = amp.init(loss_scale="dynamic")
    scaler = handle._default_scaler
    scaler._loss_scale = 256.0
    before = [p.detach().clone() for p in model.parameters()]
    with handle.scale_loss(F.mse_loss(model(x).float(), y) * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()  # skipped once
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.loss_scale() == 128.0
    opt.zero_grad()
    with handle.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    with amp.disable_casts():
        F.mse_loss(ref_model(x), y).backward()
    for p, r in zip(model.parameters(), ref_model.parameters()):  # unscaled, up to fp16 rounding
        torch.testing.assert_close(p.grad, r.grad, rtol=2e-2, atol=2e-3 * r.grad.abs().max().item())
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    handle._deactivate()
    assert not torch.is_autocast_enabled(DEV)


def test_wrap_optimizer_multiple_losses():
    x, y = make_data()
    model, opt = fresh(opt_cls=torch.optim.SGD, lr=0.1, bn=False)
    with pytest.warns(FutureWarning):
        handle = amp.init()
    wrapped = handle.wrap_optimizer(opt, num_loss=2)
    assert isinstance(wrapped, OptimWrapper) and wrapped.param_groups is opt.param_groups
    for s in wrapped._loss_scaler:
        s._loss_scale = 64.0
    with pytest.raises(RuntimeError, match="wrap_optimizer"):
        with handle.scale_loss(torch.tensor(1.0), opt):
            pass
    before = [p.detach().clone() for p in model.parameters()]
    wrapped.zero_grad()
    out = model(x).float()
    with wrapped.scale_loss(F.mse_loss(out, y)) as s:
        s.backward(retain_graph=True)
    with wrapped.scale_loss(out.pow(2).mean() * float("inf")) as s:
        s.backward()
    wrapped.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert [s.loss_scale() for s in wrapped._loss_scaler] == [64.0, 32.0]
    wrapped.zero_grad()
    out = model(x).float()
    with wrapped.scale_loss(F.mse_loss(out, y)) as s:
        s.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    with wrapped.scale_loss(out.pow(2).mean()) as s:
        s.backward()
    # the second loss's grads were unscaled on their own, then the first loss's added back
    assert all(torch.isfinite(p.grad).all() and not torch.equal(p.grad, f) for p, f in zip(model.parameters(), first))
    wrapped.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(NotImplementedError, match="closure"):
        wrapped.step(closure=lambda: 0)
    handle._deactivate()


def test_disabled_init_is_noop():
    with pytest.warns(FutureWarning):
        handle = amp.init(enabled=False)
    assert isinstance(handle, NoOpHandle) and not handle.is_active()
    assert F.linear(torch.randn(2, 3), torch.randn(3, 3)).dtype == torch.float32
    loss = torch.tensor(2.0)
    with handle.scale_loss(loss, None) as s:
        assert s is loss
    model, opt = fresh(bn=False)
    wrapped = handle.wrap_optimizer(opt)
    with wrapped.scale_loss(loss) as s:
        assert s is loss


def test_init_patch_type_bfloat16_and_bad_value():
    with pytest.warns(amp.DeprecatedFeatureWarning):
        handle = amp.init(patch_type=torch.bfloat16)
    x, w = torch.randn(2, 3, device=DEV), torch.randn(3, 3, device=DEV)
    assert F.linear(x, w).dtype == torch.bfloat16
    handle._deactivate()
    assert F.linear(x, w).dtype == torch.float32
    with pytest.raises(ValueError, match="patch_type"):
        amp.init(patch_type=torch.float32)


def test_initialize_o1_handle_deactivates_casts():
    # Apex's tests switch O1 off with _amp_state.handle._deactivate() after amp.initialize.
    model, opt = fresh(opt_cls=torch.optim.SGD, lr=0.1, bn=False)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x, w = torch.randn(2, 3, device=DEV), torch.randn(3, 3, device=DEV)
    assert F.linear(x, w).dtype == torch.float16
    assert isinstance(amp._amp_state.handle, AmpHandle)
    amp._amp_state.handle._deactivate()
    assert F.linear(x, w).dtype == torch.float32


@pytest.mark.parametrize("lp", [torch.float16, torch.bfloat16])
def test_inplace_fp32_functions_refuse_16_bit_tensors(lp):
    # Apex's O1 raises for Tensor.exp_ & co on a 16-bit tensor (the fp32 result cannot be kept in place).
    with pytest.warns(amp.DeprecatedFeatureWarning):
        handle = amp.init(patch_type=lp)
    x = torch.randn(5, device=DEV)
    x.exp_()
    assert x.dtype == torch.float32
    for fn in (lambda t: t.exp_(), lambda t: t.log_(), lambda t: t.pow_(2), lambda t: t.cumsum_(0)):
        with pytest.raises(NotImplementedError, match="in-place"):
            fn(torch.rand(5, device=DEV, dtype=lp))
    assert torch.rand(5, device=DEV, dtype=lp).exp().dtype == torch.float32  # out of place: fp32
    handle._deactivate()
    torch.rand(5, device=DEV, dtype=lp).exp_()  # O1 off: allowed again
