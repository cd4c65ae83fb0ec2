"""culmen works whatever the default device: every internal allocation names its device.

Scripts (Apex's amp tests among them) call ``torch.set_default_device("cuda")`` or
``torch.set_default_tensor_type(torch.cuda.FloatTensor)``; an allocation that does not name its device
then lands on the GPU (a pinned host buffer fails: "Only dense CPU tensors can be pinned"). On CPU the
same mistake is caught by making ``meta`` the default device: an unnamed allocation becomes a meta
tensor, which fails (or poisons a result) as soon as it meets a real one. Each case runs once normally
and once under ``torch.device("meta")`` on copies of the same inputs, and both runs must agree exactly,
through the references and through the Triton kernels (interpreter).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from culmen.contrib.clip_grad import clip_grad_norm_
from culmen.multi_tensor_apply import amp_C
from culmen.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedLARS,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

SIZES = (5, 300, 2049)
CPU = torch.device("cpu")


def _t(n, dtype=torch.float32, seed=0, positive=False):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), device=CPU)
    return (x.abs() + 0.1 if positive else x).to(dtype)


def _lists(k, dtype=torch.float32, positive=()):
    return [[_t(n, dtype, seed=10 * i + j, positive=i in positive) for j, n in enumerate(SIZES)] for i in range(k)]


def _flag():
    return torch.zeros(1, dtype=torch.int32, device=CPU)


def _on_cpu(obj):
    """Every tensor reachable in ``obj`` (lists, tuples, dicts) lives on the CPU."""
    if isinstance(obj, torch.Tensor):
        assert obj.device == CPU, obj.device
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _on_cpu(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            _on_cpu(x)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.device == b.device == CPU
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def _both_ways(make, run):
    """``run(make())`` normally and under a meta default device: the same results, all on the CPU."""
    plain = run(make())
    with torch.device("meta"):
        odd = run(make())
    _on_cpu(odd)
    _same(plain, odd)


def _c(x):
    return torch.tensor(x, device=CPU)


AMP_C = {
    "scale": (lambda: _lists(2), lambda ls: (amp_C.multi_tensor_scale(2048, f := _flag(), ls, 0.5), ls, f)),
    "axpby": (lambda: _lists(3), lambda ls: (amp_C.multi_tensor_axpby(2048, f := _flag(), ls, 0.5, 2.0, -1), ls, f)),
    "l2norm": (lambda: _lists(1), lambda ls: amp_C.multi_tensor_l2norm(2048, _flag(), ls, True)),
    "l2norm_mp": (lambda: _lists(1), lambda ls: amp_C.multi_tensor_l2norm_mp(2048, _flag(), ls, True)),
    "l2norm_scale": (lambda: _lists(2), lambda ls: (amp_C.multi_tensor_l2norm_scale(2048, _flag(), ls, 0.5, True),
                                                    ls)),
    "unscale_l2norm": (lambda: _lists(1),
                       lambda ls: amp_C.multi_tensor_unscale_l2norm(2048, _flag(), ls, _c([0.25]), True)),
    "adam": (lambda: _lists(4, positive=(3,)),
             lambda ls: (amp_C.multi_tensor_adam(2048, _flag(), ls, 1e-2, 0.9, 0.99, 1e-8, 3, 1, 1, 0.01), ls)),
    "adam_capturable": (lambda: _lists(4, positive=(3,)), lambda ls: (amp_C.multi_tensor_adam_capturable(
        2048, _flag(), ls, _c([1e-2]), 0.9, 0.99, 1e-8, _c([3]).int(), 1, 1, 0.01, _c([0.5])), ls)),
    "adam_capturable_master": (lambda: _lists(4, positive=(3,)) + [[_t(n, seed=99) for n in SIZES]],
                               lambda ls: (amp_C.multi_tensor_adam_capturable_master(
                                   2048, _flag(), [ls[0], [x.half() for x in ls[4]], *ls[2:4], ls[4]], _c([1e-2]),
                                   0.9, 0.99, 1e-8, _c([3]).int(), 1, 1, 0.01, _c([0.5])), ls)),
    "sgd": (lambda: _lists(3), lambda ls: (amp_C.multi_tensor_sgd(2048, _flag(), ls, 0.01, 0.9, 0.0, 0.1, True,
                                                                  False, False, 1.0), ls)),
    "adagrad": (lambda: _lists(3, positive=(2,)),
                lambda ls: (amp_C.multi_tensor_adagrad(2048, _flag(), ls, 0.1, 1e-10, 0, 0.01), ls)),
    "novograd": (lambda: _lists(3), lambda ls: (amp_C.multi_tensor_novograd(
        2048, _flag(), ls, _t(len(SIZES), positive=True), 0.1, 0.9, 0.99, 1e-8, 2, 1, 0.01, 1, 0, 2), ls)),
    "lamb": (lambda: _lists(4, positive=(3,)), lambda ls: (amp_C.multi_tensor_lamb(
        2048, _flag(), ls, 1e-2, 0.9, 0.99, 1e-6, 2, 1, 0.01, 1, 1, _c([3.0]), 1.0, False), ls)),
    "lamb_mp": (lambda: _lists(4, positive=(3,)), lambda ls: (amp_C.multi_tensor_lamb_mp(
        2048, _flag(), ls, _c([1e-2]), 0.9, 0.99, 1e-6, _c([2]).int(), 1, 0.01, 1, 1, _c([3.0]), _c([1.0]), False,
        _c([0.0]), _c([0.5])), ls)),
    "lamb_stages": (lambda: _lists(5, positive=(3,)), lambda ls: (
        amp_C.multi_tensor_lamb_stage1_cuda(2048, _flag(), ls, _t(len(SIZES), positive=True), 2, 0.9, 0.99, 1e-6,
                                            _c([3.0]), 1.0),
        amp_C.multi_tensor_lamb_stage2_cuda(2048, _flag(), [ls[1], ls[4]], _t(len(SIZES), positive=True),
                                            _t(len(SIZES), seed=5, positive=True), 0.1, 0.01, False), ls)),
    "lars": (lambda: _lists(3), lambda ls: (amp_C.multi_tensor_lars(
        2048, _flag(), ls, _t(len(SIZES), positive=True), _t(len(SIZES), seed=3, positive=True), 0.1, 0.001, 0.0,
        0.01, 0.9, 0.0, False, False, False, 1.0, False), ls)),
    "hysteresis": (lambda: [_c([4.0]), _c([0]).int(), _c([2]).int(), _c([1.0])],
                   lambda a: (amp_C.update_scale_hysteresis(*a, 2.0, 0.5, 2000, 2), a)),
}


@pytest.mark.parametrize("op", list(AMP_C))
def test_amp_c_ops(backend_any, op):
    make, run = AMP_C[op]
    _both_ways(make, run)


@pytest.fixture(params=["reference_backend", "triton_backend"])
def backend_any(request):
    request.getfixturevalue(request.param)


# ------------------------------------------------------------------------------- optimizers

OPTIMIZERS = {
    "adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "adam_capturable_master": lambda ps: FusedAdam(ps, lr=1e-2, capturable=True, master_weights=True),
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2),
    "mp_lamb": lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, reduced_precision_dtype=torch.bfloat16),
    "sgd": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sgd_dampening": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
    "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2),
    "novograd_inf_norm": lambda ps: FusedNovoGrad(ps, lr=1e-2, norm_type=0, init_zero=True),
    "adagrad": lambda ps: FusedAdagrad(ps, lr=0.1),
    "lars": lambda ps: FusedLARS(ps, lr=0.1, momentum=0.9),
}


def _train(make_opt):
    """Two plain steps, two GradScaler steps (the second skipped on an inf), a state-dict round trip."""
    dts = (torch.float32, torch.bfloat16, torch.float32)
    ps = [torch.nn.Parameter(_t(n, dt, seed=i)) for i, (n, dt) in enumerate(zip(SIZES, dts))]
    opt = make_opt(ps)
    for it in range(2):
        for i, p in enumerate(ps):
            p.grad = _t(p.numel(), p.dtype, seed=100 + 10 * it + i)
        opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    for it in range(2):
        opt.zero_grad()
        loss = sum((p.float() * _t(p.numel(), seed=200 + 10 * it + i)).sum() for i, p in enumerate(ps))
        scaler.scale(loss).backward()
        if it == 1:
            ps[0].grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
    clone = make_opt([torch.nn.Parameter(p.detach().clone()) for p in ps])
    clone.load_state_dict(copy.deepcopy(opt.state_dict()))
    return [p.detach() for p in ps], [p.grad for p in ps], opt.state_dict(), clone.state_dict(), scaler.get_scale()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers(backend_any, name):
    _both_ways(lambda: OPTIMIZERS[name], _train)


# ------------------------------------------------------------------- clip_grad and amp's scaler

@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_clip_grad(backend_any, norm_type):
    def make():
        dts = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
        ps = [torch.nn.Parameter(_t(n, dt, seed=i)) for i, (n, dt) in enumerate(zip(SIZES + (7,), dts))]
        for i, p in enumerate(ps):
            p.grad = _t(p.numel(), p.dtype, seed=50 + i)
        return ps

    def run(ps):
        return clip_grad_norm_(ps, 0.5, norm_type), clip_grad_norm_(ps, 0.1, norm_type, foreach=False), \
            [p.grad for p in ps]

    _both_ways(make, run)
    p = torch.nn.Parameter(_t(3))
    with torch.device("meta"):
        assert clip_grad_norm_([p], 1.0).device == CPU  # no gradient at all: on the params' device


def test_loss_scaler(backend_any):
    from culmen.amp.scaler import LossScaler

    def run(lists):
        model, stashed, master = lists
        s = LossScaler("dynamic", init_scale=2.0 ** 4, scale_window=2)
        out = []
        for it in range(4):
            s.clear_overflow_state()
            if it == 2:
                model[1][0] = float("inf")
            s.unscale(model, master, s.loss_scale())
            s.unscale_with_stashed(model, stashed, master)
            out.append(s.update_scale())
            out.append(s.loss_scale())
        s.clear_overflow_state()
        model[1][0] = 1.0
        s.unscale(model, master, s.loss_scale())
        found = s.defer_update()
        out.append(found)
        out.append(s.loss_scale())
        return out, master

    _both_ways(lambda: _lists(3), run)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["set_default_device", "set_default_tensor_type"])
def test_cuda_default_device_gpu(how):
    """With CUDA as the default device (Apex's amp tests set the default tensor type), the multi-tensor ops
    (pinned host tables), every fused optimizer, clip_grad_norm_ and LossScaler.defer_update (pinned flag)
    work on CUDA tensors and on CPU tensors alike."""
    from culmen.amp.scaler import LossScaler

    old_dtype = torch.get_default_dtype()
    if how == "set_default_device":
        torch.set_default_device("cuda")
    else:
        with warnings.catch_warnings():  # torch deprecates set_default_tensor_type; Apex's tests still call it
            warnings.simplefilter("ignore")
            torch.set_default_tensor_type(torch.cuda.FloatTensor)
    try:
        for dev in ("cuda", "cpu"):
            params = [torch.nn.Parameter(torch.randn(n, device=dev)) for n in SIZES]
            for name, make in OPTIMIZERS.items():
                opt = make(params)
                for p in params:
                    p.grad = torch.randn_like(p)
                opt.step()
                scaler = torch.amp.GradScaler(dev, init_scale=4.0)
                scaler.scale(sum((p * 2).sum() for p in params)).backward()
                scaler.step(opt)
                scaler.update()
                assert all(p.device.type == dev and torch.isfinite(p).all() for p in params), name
            norm = clip_grad_norm_(params, 0.5)
            assert norm.device.type == dev
            s = LossScaler("dynamic")
            grads = [torch.randn(n, device=dev) for n in SIZES]
            s.unscale(grads, [torch.empty_like(g) for g in grads], s.loss_scale())
            assert float(s.defer_update()) == 0.0 and s.loss_scale() == 2.0 ** 16
    finally:
        torch.set_default_device(None)
        if how != "set_default_device":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.set_default_tensor_type(torch.FloatTensor)
        torch.set_default_dtype(old_dtype)
