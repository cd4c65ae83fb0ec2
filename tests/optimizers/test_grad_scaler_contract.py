"""Every fused optimizer under ``torch.amp.GradScaler``: after ``scaler.step(opt)`` the gradients are unscaled
(what ``scaler.unscale_`` leaves, skipped steps included), and params, state and step counts are those of
torch's optimizer (or of the same optimizer fed the unscaled gradients by hand, where torch has none).

Scales are powers of two, so unscaling is exact and the comparisons can be tight. Runs through the ops'
references and through the Triton kernels (the interpreter on CPU).
"""

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

SHAPES = ((1,), (63,), (5, 123), (2049,))
INF_STEP = 2  # the iteration whose gradients hold an inf: the step is skipped
STEPS = 5


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _backward(params, grads, scaler):
    """loss = sum(p * g), so that p.grad = g * scale (exact: the scale is a power of two)."""
    for p in params:
        p.grad = None
    loss = sum((p.float() * g.float()).sum() for p, g in zip(params, grads))
    scaler.scale(loss).backward()


def _poison(params):
    params[1].grad.view(-1)[0] = float("inf")


def _run_scaled(opt, params, scaler, steps=STEPS, unscale_first=()):
    """Iterations through ``scaler`` (``INF_STEP`` poisoned); the gradients after each ``scaler.step``."""
    seen = []
    for it in range(steps):
        _backward(params, _grads(params, it), scaler)
        if it == INF_STEP:
            _poison(params)
        if it in unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        seen.append([p.grad.detach().clone() for p in params])
    return seen


def _run_by_hand(opt, params, scales, steps=STEPS):
    """What GradScaler promises: the optimizer sees unscaled gradients and does not step on an overflow."""
    seen = []
    for it in range(steps):
        for p, g in zip(params, _grads(params, it)):
            p.grad = (g.float() * scales[it]).to(p.dtype)
        if it == INF_STEP:
            _poison(params)
        for p in params:
            p.grad = (p.grad.float() * (1.0 / scales[it])).to(p.dtype)
        if it != INF_STEP:
            opt.step()
        seen.append([p.grad.detach().clone() for p in params])
    return seen


def _scales(init=2.0 ** 8):
    """The scale GradScaler(init_scale=init, growth_interval=2) uses at each iteration (overflow at INF_STEP)."""
    out, s, good = [], init, 0
    for it in range(STEPS):
        out.append(s)
        if it == INF_STEP:
            s, good = s * 0.5, 0
        else:
            good += 1
            if good == 2:
                s, good = s * 2.0, 0
    return out


def _params(dtypes=None):
    dtypes = dtypes or [torch.float32] * len(SHAPES)
    gen = torch.Generator().manual_seed(123)
    return [torch.randn(s, generator=gen).to(dt).requires_grad_() for s, dt in zip(SHAPES, dtypes)]


def _copies(params):
    return [p.detach().clone().requires_grad_() for p in params]


def _close(xs, ys, rtol=1e-5, atol=1e-6, what=""):
    for i, (x, y) in enumerate(zip(xs, ys)):
        torch.testing.assert_close(x.detach().double(), y.detach().double(), rtol=rtol, atol=atol,
                                   msg=lambda m, i=i: f"{what}[{i}]: {m}")


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)


def _check_grads_unscaled(seen, params):
    """The gradients after each step are the iteration's unscaled ones (the skipped step's too)."""
    for it, gs in enumerate(seen):
        expect = _grads(params, it)
        for i, (g, e) in enumerate(zip(gs, expect)):
            if it == INF_STEP and i == 1:
                assert torch.isinf(g.view(-1)[0])
                g, e = g.view(-1)[1:], e.view(-1)[1:]
            torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m, it=it, i=i: f"grad[{i}] at {it}: {m}")


# ---------------------------------------------------------------------------------- torch counterparts

TORCH_CASES = {
    "adamw": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)),
    "adam_l2": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01, adam_w_mode=False),
                lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01)),
    "adam_capturable": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01, capturable=True),
                        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)),
    "adam_capturable_masters": (lambda ps: FusedAdam(ps, lr=1e-2, capturable=True, master_weights=True),
                                lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0)),
    "sgd_nesterov": (lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd_dampening": (lambda ps: FusedSGD(ps, lr=0.05, momentum=0.8, dampening=0.3),
                      lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3)),
    "sgd_plain": (lambda ps: FusedSGD(ps, lr=0.05), lambda ps: torch.optim.SGD(ps, lr=0.05)),
    "adagrad": (lambda ps: FusedAdagrad(ps, lr=0.05, weight_decay=0.01),
                lambda ps: torch.optim.Adagrad(ps, lr=0.05, weight_decay=0.01)),
}


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_matches_torch_under_grad_scaler(backend, case):
    make_ours, make_ref = TORCH_CASES[case]
    a = _params()
    b = _copies(a)
    ours, ref = make_ours(a), make_ref(b)
    s_ours, s_ref = _scaler(), _scaler()
    seen_ours = _run_scaled(ours, a, s_ours)
    seen_ref = _run_scaled(ref, b, s_ref)
    assert s_ours.get_scale() == s_ref.get_scale()
    _check_grads_unscaled(seen_ours, a)
    for it, (x, y) in enumerate(zip(seen_ours, seen_ref)):
        _close(x, y, rtol=0, atol=0, what=f"grad at {it}")
    _close(a, b, what="param")
    for p, q in zip(a, b):
        for k, v in ref.state[q].items():
            if k == "step":
                continue
            key = {"sum": "sum"}.get(k, k)
            _close([ours.state[p][key]], [v], what=k)
    if isinstance(ours, FusedAdam):
        assert int(ours.param_groups[0]["step"]) == STEPS - 1  # the overflow step did not count


def test_unscale_first_then_step(backend):
    """``scaler.unscale_(opt)`` (e.g. to clip) before ``scaler.step``: the gradients are unscaled once only."""
    for make_ours, make_ref in (TORCH_CASES["adamw"], TORCH_CASES["sgd_nesterov"]):
        a = _params()
        b = _copies(a)
        ours, ref = make_ours(a), make_ref(b)
        seen = _run_scaled(ours, a, _scaler(), unscale_first=(1, INF_STEP))
        seen_ref = _run_scaled(ref, b, _scaler(), unscale_first=(1, INF_STEP))
        _check_grads_unscaled(seen, a)
        for x, y in zip(seen, seen_ref):
            _close(x, y, rtol=0, atol=0, what="grad")
        _close(a, b, what="param")


def test_adam_masters_16bit_under_grad_scaler(backend):
    """16-bit params with fp32 masters (capturable or not): the same as the optimizer fed unscaled grads."""
    dts = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]
    for capturable in (False, True):
        a = _params(dts)
        b = _copies(a)
        ours = FusedAdam(a, lr=1e-2, weight_decay=0.01, master_weights=True, capturable=capturable)
        ref = FusedAdam(b, lr=1e-2, weight_decay=0.01, master_weights=True, capturable=capturable)
        seen = _run_scaled(ours, a, _scaler())
        seen_ref = _run_by_hand(ref, b, _scales())
        _check_grads_unscaled(seen, a)
        for x, y in zip(seen, seen_ref):
            _close(x, y, rtol=0, atol=0, what="grad")
        # Under a GradScaler the step counter lives on the device and the bias corrections are formed in
        # fp32 there (in double on the host otherwise): a few fp32 ulps, and a 16-bit rounding flip at most.
        _close([ours.state[p]["master_param"] for p in a[1:]], [ref.state[p]["master_param"] for p in b[1:]],
               rtol=1e-5, atol=1e-6, what="master")
        _close(a, b, rtol=2 ** -7, atol=1e-6, what="param")
        assert int(ours.param_groups[0]["step"]) == int(ref.param_groups[0]["step"]) == STEPS - 1


# ------------------------------------------------------- optimizers torch lacks: the same one, by hand

HAND_CASES = {
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01),
    "lamb_l2_clip": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=False, max_grad_norm=0.5),
    "mp_lamb": lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, weight_decay=0.01,
                                                  reduced_precision_dtype=torch.bfloat16),
    "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01),
    "lars": lambda ps: FusedLARS(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
}


@pytest.mark.parametrize("case", list(HAND_CASES))
def test_matches_unscaled_by_hand(backend, case):
    """LAMB overwrites the gradients with its updates (as Apex does), so after a taken step ``.grad`` holds the
    update of the unscaled gradients; after the skipped one, the unscaled gradients."""
    make = HAND_CASES[case]
    dts = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16] if case == "mp_lamb" else None
    a = _params(dts)
    b = _copies(a)
    ours, ref = make(a), make(b)
    seen = _run_scaled(ours, a, _scaler())
    seen_ref = _run_by_hand(ref, b, _scales())
    # (the device step's fp32 bias corrections: 1 - beta2 ** step is formed in fp32, within ~1e-4 relative)
    for it, (x, y) in enumerate(zip(seen, seen_ref)):
        _close(x, y, rtol=1e-4, atol=1e-6, what=f"grad at {it}")
    skipped = seen[INF_STEP]
    expect = _grads(a, INF_STEP)
    for i, (g, e) in enumerate(zip(skipped, expect)):
        if i == 1:
            g, e = g.view(-1)[1:], e.view(-1)[1:]
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    _close(a, b, rtol=1e-4, atol=1e-6, what="param")
    for p, q in zip(a, b):
        for k, v in ref.state[q].items():
            if isinstance(v, torch.Tensor):
                _close([ours.state[p][k]], [v], rtol=1e-4, atol=1e-6, what=k)
    for g_ours, g_ref in zip(ours.param_groups, ref.param_groups):
        if "step" in g_ref:
            assert int(g_ours["step"]) == int(g_ref["step"]) == STEPS - 1
