"""FusedAdam against torch.optim.Adam / AdamW in lockstep (reference path and Triton interpreter)."""

from __future__ import annotations

import warnings

import pytest
import torch

from culmen.optimizers import FusedAdam

SMALL = ((1,), (63,), (5, 123), (2049,))


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_torch(backend, lockstep, adam_w_mode):
    a = lockstep.params()
    b = lockstep.copies(a)
    ours = FusedAdam(a, lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, adam_w_mode=adam_w_mode)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = cls(b, lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    lockstep.run(ours, ref, a, b, steps=7)
    lockstep.assert_close(a, b, what="param")
    lockstep.assert_close([ours.state[p]["exp_avg"] for p in a], [ref.state[p]["exp_avg"] for p in b], what="m")
    lockstep.assert_close([ours.state[p]["exp_avg_sq"] for p in a], [ref.state[p]["exp_avg_sq"] for p in b],
                          what="v")
    assert ours.param_groups[0]["step"] == 7
    assert all(ours.state[p]["exp_avg"].dtype == torch.float32 for p in a)


def test_groups_frozen_and_capturable(backend, lockstep):
    """Two groups with different hyperparameters, a param that never gets a gradient, device lr/step."""
    a = lockstep.params()
    b = lockstep.copies(a)
    for capturable in (False, True):
        a = lockstep.params()
        b = lockstep.copies(a)
        ours = FusedAdam([{"params": a[:2]}, {"params": a[2:], "lr": 1e-2, "weight_decay": 0.0, "betas": (0.5, 0.9)}],
                         lr=5e-2, weight_decay=0.05, capturable=capturable)
        ref = torch.optim.AdamW([{"params": b[:2]}, {"params": b[2:], "lr": 1e-2, "weight_decay": 0.0,
                                                     "betas": (0.5, 0.9)}], lr=5e-2, weight_decay=0.05)
        frozen_before = a[3].detach().clone()
        lockstep.run(ours, ref, a, b, steps=7, frozen=(3,))
        lockstep.assert_close(a, b, what="param")
        assert torch.equal(a[3].detach(), frozen_before) and len(ours.state[a[3]]) == 0
        if capturable:
            assert isinstance(ours.param_groups[0]["lr"], torch.Tensor)
            assert int(ours.param_groups[1]["step"]) == 7


def test_mixed_dtypes_master_weights(backend, lockstep):
    """fp32 / bf16 / fp16 params in one optimizer, fp32 masters for the 16-bit ones vs AdamW on fp32 copies."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16, torch.float32]
    a = lockstep.params(dtypes=dtypes)
    b = lockstep.copies(a, torch.float32)
    ours = FusedAdam(a, lr=1e-2, weight_decay=0.1, master_weights=True)
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    lockstep.run(ours, ref, a, b, steps=7)
    masters = [ours.state[p].get("master_param", p) for p in a]
    lockstep.assert_close(masters, b, what="master")
    for p, q in zip(a, masters):
        assert q.dtype == torch.float32
        assert_rounded(p, q, backend)


def assert_rounded(p, q, backend, slack=0):
    """``p`` is the fp32 master ``q`` rounded to ``p``'s dtype. Triton's CPU interpreter truncates
    fp32 -> bf16 (the GPU rounds to nearest), so there the bf16 result may be one ulp toward zero."""
    if slack or (backend == "triton" and p.dtype == torch.bfloat16):
        # one ulp of p's dtype, plus fp32 noise of q for a result that sits next to a rounding boundary
        ulp = q.abs() * (2.0 ** -7 if p.dtype == torch.bfloat16 else 2.0 ** -10) + 1e-6
        assert bool(((p.detach().float() - q).abs() <= ulp).all())
    else:
        assert torch.equal(p.detach(), q.to(p.dtype))


def test_16bit_without_masters(backend, lockstep):
    """bf16 / fp16 params without masters: every step is the fp32 AdamW update rounded to the param dtype
    (moments fp32). The reference restarts from culmen's params each step (rounding makes runs diverge)."""
    a = lockstep.params(dtypes=[torch.bfloat16, torch.float16, torch.bfloat16, torch.float16, torch.bfloat16])
    b = lockstep.copies(a, torch.float32)
    ours = FusedAdam(a, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    for _ in range(7):
        with torch.no_grad():
            for p, q in zip(a, b):
                q.copy_(p)
        gs = lockstep.grads(a)
        lockstep.set_grads(a, gs)
        lockstep.set_grads(b, gs)
        ours.step()
        ref.step()
        for p, q in zip(a, b):
            assert_rounded(p, q.detach(), backend, slack=1)
    lockstep.assert_close([ours.state[p]["exp_avg_sq"] for p in a], [ref.state[p]["exp_avg_sq"] for p in b],
                          what="v")


def _scaled_step(opt, params, grads, scaler, inject_inf=False):
    """One GradScaler iteration: loss = sum(p * g) so that dloss/dp = g (times the scale)."""
    for p in params:
        p.grad = None
    loss = sum((p.float() * g.float()).sum() for p, g in zip(params, grads))
    scaler.scale(loss).backward()
    if inject_inf:
        params[1].grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()


def test_grad_scaler_skips_and_unscales(backend, lockstep):
    a = lockstep.params()
    b = lockstep.copies(a)
    ours = FusedAdam(a, lr=1e-2, weight_decay=0.01)
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.01)
    assert ours._step_supports_amp_scaling
    s_ours = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    s_ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the attribute contract, not the deprecated kwarg
        for it in range(5):
            gs = lockstep.grads(a)
            inf = it == 2
            if inf:
                before = [p.detach().clone() for p in a]
                m_before = [ours.state[p]["exp_avg"].clone() for p in a]
                step_before = ours.param_groups[0]["step"].clone()
            _scaled_step(ours, a, gs, s_ours, inject_inf=inf)
            _scaled_step(ref, b, gs, s_ref, inject_inf=inf)
            if inf:
                assert all(torch.equal(x.detach(), y) for x, y in zip(a, before))
                assert all(torch.equal(ours.state[p]["exp_avg"], m) for p, m in zip(a, m_before))
                assert torch.equal(ours.param_groups[0]["step"], step_before)
    assert s_ours.get_scale() == s_ref.get_scale()
    lockstep.assert_close(a, b, what="param")
    assert int(ours.param_groups[0]["step"]) == 4


def test_grad_scaler_legacy_kwarg_and_unscaled(backend, lockstep):
    """``step(grad_scaler=...)`` (the older contract, inf skip included) and ``scaler.unscale_`` + clipping."""
    a = lockstep.params()
    b = lockstep.copies(a)
    ours = FusedAdam(a, lr=1e-2)
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.0)
    s_ours = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    s_ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    for it in range(4):
        gs = lockstep.grads(a)
        for opt, ps, sc in ((ours, a, s_ours), (ref, b, s_ref)):
            for p in ps:
                p.grad = None
            sc.scale(sum((p * g).sum() for p, g in zip(ps, gs))).backward()
            if it == 2:
                ps[0].grad.view(-1)[0] = float("nan")
            if it == 1:
                sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(ps, 1.0)
            if opt is ours and it != 1:
                opt.step(grad_scaler=sc)
            else:
                sc.step(opt)
            sc.update()
    assert s_ours.get_scale() == s_ref.get_scale()
    lockstep.assert_close(a, b, what="param")
    assert int(ours.param_groups[0]["step"]) == 3


def test_state_dict_resume_bitwise(backend, lockstep):
    """3 steps, save, load into a fresh optimizer (fresh params), 4 more == 7 uninterrupted steps, bitwise."""
    init = lockstep.params(SMALL, dtypes=[torch.float32, torch.bfloat16, torch.float16, torch.bfloat16])
    grads = [lockstep.grads(init) for _ in range(7)]
    for capturable in (False, True):
        full = lockstep.copies(init)
        o_full = FusedAdam(full, lr=1e-2, weight_decay=0.1, master_weights=True, capturable=capturable)
        first = lockstep.copies(init)
        o_first = FusedAdam(first, lr=1e-2, weight_decay=0.1, master_weights=True, capturable=capturable)
        for s in range(7):
            lockstep.set_grads(full, grads[s])
            o_full.step()
        for s in range(3):
            lockstep.set_grads(first, grads[s])
            o_first.step()
        saved = lockstep.roundtrip(o_first.state_dict())
        resumed = lockstep.copies(first)
        o_res = FusedAdam(resumed, lr=0.5, weight_decay=0.0, master_weights=True, capturable=capturable)
        o_res.load_state_dict(saved)
        assert o_res.state[resumed[1]]["master_param"].dtype == torch.float32
        assert o_res.state[resumed[1]]["exp_avg"].dtype == torch.float32
        for s in range(3, 7):
            lockstep.set_grads(resumed, grads[s])
            o_res.step()
        for x, y in zip(resumed, full):
            assert torch.equal(x.detach(), y.detach())
        for x, y in zip(resumed, full):
            for k in o_full.state[y]:
                assert torch.equal(o_res.state[x][k], o_full.state[y][k]), k


def test_zero_grad_and_closure(lockstep):
    a = lockstep.params()
    opt = FusedAdam(a)
    lockstep.set_grads(a, lockstep.grads(a))
    opt.zero_grad()
    assert all(p.grad is None for p in a)
    opt = FusedAdam(a, set_grad_none=False)
    lockstep.set_grads(a, lockstep.grads(a))
    opt.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in a)

    def closure():
        opt.zero_grad()
        loss = sum((p * p).sum() for p in a)
        loss.backward()
        return loss

    assert torch.is_tensor(opt.step(closure))


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(lr=-1.0), ValueError, "Invalid learning rate"),
    (dict(eps=-1e-8), ValueError, "Invalid epsilon value"),
    (dict(betas=(1.0, 0.999)), ValueError, "Invalid beta parameter at index 0"),
    (dict(betas=(0.9, -0.1)), ValueError, "Invalid beta parameter at index 1"),
    (dict(weight_decay=-0.1), ValueError, "Invalid weight_decay value"),
    (dict(amsgrad=True), RuntimeError, "AMSGrad"),
])
def test_bad_arguments(lockstep, kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        FusedAdam(lockstep.params(), **kwargs)


def test_bad_step_inputs(lockstep):
    p = torch.randn(4, 4, requires_grad=True)
    opt = FusedAdam([p])
    p.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    p.grad = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="grads"):
        opt.step(grads=[p.grad])
    with pytest.raises(TypeError, match="unexpected"):
        opt.step(foo=1)
    q = torch.randn(3, dtype=torch.float64, requires_grad=True)
    q.grad = torch.randn(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float64"):
        FusedAdam([q]).step()
