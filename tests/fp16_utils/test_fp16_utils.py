"""culmen.fp16_utils: network conversion helpers, manual master params, the standalone loss scalers,
and FP16_Optimizer end to end (training, overflow skipping, clipping, checkpoint, closure)."""

from __future__ import annotations

import importlib
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from culmen import amp
from culmen.fp16_utils import (
    BN_convert_float,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)

_state_mod = importlib.import_module("culmen.amp._amp_state")


@pytest.fixture(autouse=True)
def _quiet():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: avoid oversubscribing CI's 2 cores
    verbosity = amp._amp_state.verbosity
    amp._amp_state.verbosity = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield
    amp._amp_state.verbosity = verbosity
    torch.set_num_threads(threads)


def _net(bn: bool = True) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16)] + ([nn.BatchNorm1d(16)] if bn else []) + [nn.ReLU(), nn.Linear(16, 3)]
    return nn.Sequential(*layers)


def _data(n: int = 64):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    return x, torch.tanh(x[:, :3] * 2)


# ---------------------------------------------------------------------------------- conversion


def test_network_to_half_keeps_bn_fp32():
    net = network_to_half(_net())
    assert isinstance(net, nn.Sequential) and isinstance(net[0], tofp16)
    inner = net[1]
    assert inner[0].weight.dtype == torch.float16 and inner[1].weight.dtype == torch.float32
    assert inner[1].running_mean.dtype == torch.float32
    out = net(torch.randn(4, 8))
    assert out.dtype == torch.float16


def test_convert_network_keeps_identity_and_bn():
    net = _net()
    w = net[0].weight
    net[0].weight.grad = torch.ones_like(w)
    out = convert_network(net, torch.bfloat16)
    assert out is net and net[0].weight is w and w.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert net[1].weight.dtype == torch.float32 and net[1].num_batches_tracked.dtype == torch.int64
    no_affine = nn.BatchNorm1d(4, affine=False)
    convert_network(no_affine, torch.half)
    assert no_affine.running_var.dtype == torch.float16  # only affine batch norms are kept in fp32
    lin = nn.Linear(2, 2)
    convert_module(lin, torch.float16)
    assert lin.weight.dtype == lin.bias.dtype == torch.float16
    bn = BN_convert_float(nn.Sequential(nn.BatchNorm1d(3)).half())
    assert bn[0].weight.dtype == torch.float32


def test_fp16_model_warns_and_casts():
    _state_mod._warned.discard("FP16Model")
    with pytest.warns(FutureWarning, match="FP16Model"):
        m = FP16Model(_net())
    assert m.network[0].weight.dtype == torch.float16 and m.network[1].weight.dtype == torch.float32
    assert m(torch.randn(4, 8)).dtype == torch.float16


def test_prep_param_lists_and_copies():
    net = _net(bn=False).half()
    model_params, master_params = prep_param_lists(net)
    assert len(model_params) == len(master_params) == 4
    assert all(m.dtype == torch.float32 and m.requires_grad and m.grad is None for m in master_params)
    assert all(torch.equal(m, p.float()) for m, p in zip(master_params, model_params))
    x, y = _data()
    F.mse_loss(net(x.half()).float(), y).backward()
    net[0].bias.grad = None
    model_grads_to_master_grads(model_params, master_params)
    assert master_params[1].grad is None
    assert torch.equal(master_params[0].grad, model_params[0].grad.float())
    with torch.no_grad():
        for m in master_params:
            m.add_(0.5)
    master_params_to_model_params(model_params, master_params)
    assert all(torch.equal(p, m.half()) for p, m in zip(model_params, master_params))


def test_prep_param_lists_flat():
    net = _net(bn=False).half()
    model_params, [flat] = prep_param_lists(net, flat_master=True)
    assert flat.dtype == torch.float32 and flat.numel() == sum(p.numel() for p in model_params)
    assert flat.grad is not None and flat.grad.shape == flat.shape
    x, y = _data()
    F.mse_loss(net(x.half()).float(), y).backward()
    model_grads_to_master_grads(model_params, [flat], flat_master=True)
    assert torch.equal(flat.grad[: model_params[0].numel()], model_params[0].grad.float().reshape(-1))
    with torch.no_grad():
        flat.mul_(2)
    master_params_to_model_params(model_params, [flat], flat_master=True)
    assert torch.equal(model_params[-1], (flat[-model_params[-1].numel():]).half().reshape(model_params[-1].shape))
    mixed = _net()
    mixed[0].half()
    with pytest.raises(TypeError, match="single dtype"):
        prep_param_lists(mixed, flat_master=True)


def test_small_helpers():
    assert to_python_float(torch.tensor(2.5)) == 2.5
    assert to_python_float([1.5]) == 1.5
    assert clip_grad_norm is torch.nn.utils.clip_grad_norm_
    assert tofp16()(torch.ones(2)).dtype == torch.float16


# --------------------------------------------------------------------------- standalone scalers


def test_static_loss_scaler():
    s = LossScaler(8.0)
    p = nn.Parameter(torch.tensor([2.0]))
    p.grad = torch.tensor([float("inf")])
    assert s.loss_scale == 8.0 and s.has_overflow([p]) is False
    s.update_scale(True)
    assert s.loss_scale == 8.0
    s.backward((p * 3).sum())
    assert p.grad.item() == float("inf")  # accumulated onto the inf (static never checks)
    assert s.scale_gradient(None, (torch.ones(1),), None)[0].item() == 8.0


def test_dynamic_loss_scaler_rules():
    s = DynamicLossScaler(init_scale=2.0**4, scale_factor=2.0, scale_window=3)
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("nan"), 2.0])
    assert s.has_overflow([p]) is True
    h = nn.Parameter(torch.ones(3).half())
    h.grad = torch.tensor([60000.0, 60000.0, 60000.0]).half()
    assert s.has_overflow([h]) is False  # finite values whose sum exceeds fp16's range are fine
    s.update_scale(True)
    assert s.loss_scale == 8.0 and s.last_overflow_iter == 0
    for _ in range(2):
        s.update_scale(False)
    assert s.loss_scale == 8.0
    s.update_scale(False)
    assert s.loss_scale == 16.0
    tiny = DynamicLossScaler(init_scale=1.0)
    tiny.update_scale(True)
    assert tiny.loss_scale == 1  # never below 1
    q = nn.Parameter(torch.tensor([1.0]))
    s.backward((q * 2).sum())
    assert q.grad.item() == 2 * s.loss_scale


# ------------------------------------------------------------------------------ FP16_Optimizer


def _fp16_setup(dtype=torch.float16, dynamic=True, opt_cls=torch.optim.Adam, lr=1e-2, bn=True, **kw):
    net = convert_network(_net(bn), dtype)
    opt = FP16_Optimizer(opt_cls(net.parameters(), lr=lr), dynamic_loss_scale=dynamic, verbose=False, **kw)
    return net, opt


def _fp16_step(net, opt, x, y, poison=None):
    opt.zero_grad()
    loss = F.mse_loss(net(x.to(net[0].weight.dtype)).float(), y)
    if poison is not None:
        loss = loss * poison
    opt.backward(loss)
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_optimizer_trains(dtype):
    x, y = _data(128)
    net, opt = _fp16_setup(dtype, dynamic_loss_args={"init_scale": 2.0**10})
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    losses = [_fp16_step(net, opt, x, y).item() for _ in range(80)]
    assert losses[-1] < losses[0] / 4
    masters = opt.fp32_from_fp16_groups[0]
    assert torch.equal(net[0].weight, masters[0].to(dtype))


def test_fp16_optimizer_skips_overflow_and_backs_off():
    x, y = _data()
    net, opt = _fp16_setup(dynamic_loss_args={"init_scale": 256.0, "scale_window": 3})
    _fp16_step(net, opt, x, y)
    before = [p.detach().clone() for p in net.parameters()]
    masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state.items()}
    _fp16_step(net, opt, x, y, poison=float("inf"))
    assert opt.overflow and opt.loss_scale == 128.0
    assert opt.clip_master_grads(1.0) == -1
    assert opt.inspect_master_grad_data() is None
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, (p for g in opt.param_groups for p in g["params"])))
    for k, v in opt.state.items():
        for n, t in v.items():
            assert torch.equal(t, state[k][n])
    for _ in range(3):
        _fp16_step(net, opt, x, y)
    assert not opt.overflow and opt.loss_scale == 256.0
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_fp16_optimizer_static_scale_and_grad_values():
    x, y = _data()
    net, opt = _fp16_setup(dynamic=False, static_loss_scale=64.0, opt_cls=torch.optim.SGD, lr=0.1, bn=False)
    ref = _net(bn=False)
    opt.zero_grad()
    opt.backward(F.mse_loss(net(x.half()).float(), y))
    F.mse_loss(ref(x), y).backward()
    grads = opt.inspect_master_grad_data()
    assert len(grads) == 1 and len(grads[0]) == 4
    for g, r in zip(grads[0], ref.parameters()):
        torch.testing.assert_close(g, r.grad, rtol=2e-2, atol=2e-3 * r.grad.abs().max().item())
    norm = opt.clip_master_grads(1e-3)
    assert norm > 1e-3
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in opt.inspect_master_grad_data()[0]]))
    assert total <= 1e-3 * (1 + 1e-4)
    assert opt.loss_scale == 64.0
    opt.loss_scale = 32.0
    assert opt.loss_scaler.loss_scale() == 32.0


def test_fp16_optimizer_accumulate_then_update():
    x, y = _data()
    net, opt = _fp16_setup(opt_cls=torch.optim.SGD, lr=0.1, dynamic_loss_args={"init_scale": 128.0})
    opt.zero_grad()
    for xb, yb in zip(x.chunk(2), y.chunk(2)):
        opt.backward(F.mse_loss(net(xb.half()).float(), yb), update_master_grads=False)
    opt.update_master_grads()
    assert not opt.overflow
    acc = [g.clone() for g in opt.inspect_master_grad_data()[0]]
    opt.zero_grad()
    opt.backward(F.mse_loss(net(x[:32].half()).float(), y[:32]))
    one = opt.inspect_master_grad_data()[0][0]
    assert not torch.allclose(acc[0], one)


def test_fp16_optimizer_state_dict_round_trip():
    x, y = _data()
    net, opt = _fp16_setup(dynamic_loss_args={"init_scale": 256.0})
    for _ in range(3):
        _fp16_step(net, opt, x, y)
    _fp16_step(net, opt, x, y, poison=float("inf"))
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buf)
    cont = [_fp16_step(net, opt, x, y) for _ in range(4)]

    net2, opt2 = _fp16_setup(dynamic_loss_args={"init_scale": 2.0**15})
    ck = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    net2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    assert opt2.loss_scale == 128.0 and opt2.overflow
    resumed = [_fp16_step(net2, opt2, x, y) for _ in range(4)]
    assert torch.equal(torch.stack(cont), torch.stack(resumed))


def test_fp16_optimizer_properties_and_zero_grad():
    net, opt = _fp16_setup(opt_cls=torch.optim.SGD, lr=0.1)
    opt.param_groups[0]["lr"] = 0.01
    assert opt.optimizer.param_groups[0]["lr"] == 0.01
    assert opt.state is opt.optimizer.state
    x, y = _data()
    opt.backward(F.mse_loss(net(x.half()).float(), y))
    opt.zero_grad()
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in net.parameters())
    opt.zero_grad(set_grads_to_None=True)
    assert all(p.grad is None for p in net.parameters())
    assert all(p.grad is None for g in opt.param_groups for p in g["params"])
    with pytest.raises(RuntimeError, match="state_dict"):
        import pickle

        pickle.dumps(opt)


def test_fp16_optimizer_closure():
    x, y = _data()
    net, opt = _fp16_setup(opt_cls=torch.optim.SGD, lr=0.1, dynamic_loss_args={"init_scale": 128.0})
    calls = []

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(net(x.half()).float(), y)
        if not calls:
            loss = loss * float("inf")  # first evaluation overflows: re-run at the reduced scale
        calls.append(1)
        opt.backward(loss)
        return loss

    before = net[0].weight.detach().clone()
    loss = opt.step(closure)
    assert len(calls) == 2 and torch.isfinite(loss) and opt.loss_scale == 64.0
    assert not torch.equal(before, net[0].weight)
    assert opt.first_closure_call_this_step


def test_fp16_optimizer_bad_input_and_warning():
    _state_mod._warned.discard("FP16_Optimizer")
    net = _net().double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with pytest.raises(FutureWarning, match="FP16_Optimizer"):
            FP16_Optimizer(torch.optim.SGD(net.parameters(), lr=0.1), verbose=False)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        FP16_Optimizer(torch.optim.SGD(net.parameters(), lr=0.1), verbose=False)
    with pytest.raises(TypeError, match="wraps an optimizer"):
        FP16_Optimizer(net, verbose=False)
