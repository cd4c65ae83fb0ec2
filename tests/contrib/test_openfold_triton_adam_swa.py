"""contrib.openfold_triton.FusedAdamSWA against torch.optim.Adam + OpenFold's SWA average, and the
tuning-table sync over 2 gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from culmen.contrib.openfold_triton import sync_triton_auto_tune_cache_across_gpus
from culmen.contrib.openfold_triton.fused_adam_swa import AdamMathType, FusedAdamSWA

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

SIZES = (5, 130, 4099, 1)


def _swa(avg, p, decay, n_averaged):
    return p.clone() if n_averaged == 0 else avg + (p - avg) * (1.0 - decay)


def _apex_formula(p, g, m, v, *, lr, b1, b2, eps, wd, step, adamw):
    """Apex's Adam / AdamW step (bias-corrected moments under the square root), in p's dtype."""
    if not adamw:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    upd = (m / (1 - b1 ** step)) / torch.sqrt(v / (1 - b2 ** step)) .add(eps)
    if adamw:
        upd = upd + wd * p
    return p - lr * upd, m, v


def _make(state_dtype, compute_dtypes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.empty(s, dtype=state_dtype).uniform_(-2, 2, generator=gen) for s in SIZES]
    grads = [torch.empty(s, dtype=torch.float32).uniform_(-2, 2, generator=gen).to(d)
             for s, d in zip(SIZES, compute_dtypes)]
    m = [torch.empty_like(p).uniform_(-1, 1, generator=gen) for p in params]
    v = [torch.empty_like(p).uniform_(0, 2, generator=gen) for p in params]
    swa = [p + 0.25 for p in params]
    return params, grads, m, v, swa


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_pytorch_adam_math_matches_torch_adam_and_swa(backend):
    """fp64 state, mixed fp32/fp64 compute copies, step 1900, weight decay, SWA with n_averaged = 1."""
    from culmen.ops.backend import use_backend

    lr, betas, eps, wd, step0, decay = 0.1, (0.9, 0.999), 1e-6, 1e-3, 1900, 0.9
    cdts = [torch.float32, torch.float64, torch.float32, torch.float64]
    params, grads, m, v, swa = _make(torch.float64, cdts)
    # Ground truth: torch.optim.Adam on copies, then the SWA average and the compute copies.
    gt = [torch.nn.Parameter(p.clone()) for p in params]
    adam = torch.optim.Adam(gt, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    for i, p in enumerate(gt):
        adam.state[p].update(step=torch.tensor(float(step0), dtype=torch.float64), exp_avg=m[i].clone(),
                             exp_avg_sq=v[i].clone())
        p.grad = grads[i].to(torch.float64)
    adam.step()
    gt_swa = [_swa(s, p.detach(), decay, 1) for s, p in zip(swa, gt)]

    ps = [torch.nn.Parameter(p.clone()) for p in params]
    cs = [p.clone().to(d) for p, d in zip(params, cdts)]
    ss = [s.clone() for s in swa]
    opt = FusedAdamSWA(ps, cs, ss, decay, lr=lr, betas=betas, eps=eps, weight_decay=wd,
                       adam_math_mode=AdamMathType.PyTorchAdam)
    for i, p in enumerate(ps):
        opt.state[p].update(exp_avg=m[i].clone(), exp_avg_sq=v[i].clone())
    for c, g in zip(cs, grads):
        c.grad = g.clone()
    opt.param_groups[0]["step"] = step0
    opt.swa_param_groups[0]["n_averaged"] = 1
    with use_backend(backend):
        opt.step()
    assert opt.param_groups[0]["step"] == step0 + 1 and opt.swa_param_groups[0]["n_averaged"] == 2
    for i, p in enumerate(ps):
        assert not torch.allclose(p, params[i])
        torch.testing.assert_close(p.detach(), gt[i].detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(opt.state[p]["exp_avg"], adam.state[gt[i]]["exp_avg"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], adam.state[gt[i]]["exp_avg_sq"], rtol=1e-10,
                                   atol=1e-12)
        torch.testing.assert_close(cs[i], p.detach().to(cdts[i]), rtol=0, atol=0)
        torch.testing.assert_close(ss[i], gt_swa[i], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", [AdamMathType.ApexAdam, AdamMathType.ApexAdamW])
def test_apex_math_bf16_compute_two_steps_with_clip(triton_backend, mode):
    """fp32 state, bf16 compute copies, two steps (the first copies into SWA), a tensor grad_clip_scale."""
    lr, b1, b2, eps, wd, decay, clip = 1e-2, 0.8, 0.95, 1e-8, 0.05, 0.7, 0.5
    cdts = [torch.bfloat16] * len(SIZES)
    params, grads, _, _, swa = _make(torch.float32, cdts, seed=3)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    cs = [p.to(torch.bfloat16) for p in params]
    ss = [s.clone() for s in swa]
    opt = FusedAdamSWA(ps, cs, ss, decay, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, adam_math_mode=mode)
    ref_p = [p.double() for p in params]
    ref_m = [torch.zeros_like(p) for p in ref_p]
    ref_v = [torch.zeros_like(p) for p in ref_p]
    ref_s = [s.double() for s in swa]
    for step in (1, 2):
        for c, g in zip(cs, grads):
            c.grad = g * step
        opt.step(grad_clip_scale=torch.tensor(clip) if step == 1 else clip)
        for i in range(len(SIZES)):
            g = (grads[i] * step).double() * clip
            ref_p[i], ref_m[i], ref_v[i] = _apex_formula(ref_p[i], g, ref_m[i], ref_v[i], lr=lr, b1=b1, b2=b2,
                                                         eps=eps, wd=wd, step=step,
                                                         adamw=mode == AdamMathType.ApexAdamW)
            ref_s[i] = _swa(ref_s[i], ref_p[i], decay, step - 1)
    for i, p in enumerate(ps):
        torch.testing.assert_close(p.detach().double(), ref_p[i], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"].double(), ref_v[i], rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(ss[i].double(), ref_s[i], rtol=2e-6, atol=2e-6)
        # One bf16 ulp: the interpreter and PyTorch may round a tie differently.
        torch.testing.assert_close(cs[i], p.detach().to(torch.bfloat16), rtol=2 ** -7, atol=0)
    opt.zero_grad()
    assert all(c.grad is None for c in cs)


def test_constructor_errors_and_from_optim():
    p = [torch.nn.Parameter(torch.randn(4))]
    c = [torch.randn(4, dtype=torch.bfloat16)]
    s = [torch.randn(4)]
    with pytest.raises(ValueError, match="same length"):
        FusedAdamSWA(p, c + c, s, 0.9)
    with pytest.raises(ValueError, match="shapes"):
        FusedAdamSWA(p, [torch.randn(5)], s, 0.9)
    with pytest.raises(ValueError, match="swa_params"):
        FusedAdamSWA(p, c, [torch.randn(4, dtype=torch.float64)], 0.9)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        FusedAdamSWA(p, c, s, 0.9, amsgrad=True)
    with pytest.raises(ValueError, match="adam_math_mode"):
        FusedAdamSWA(p, c, s, 0.9, adam_math_mode=2)
    with pytest.raises(ValueError, match="compute_params"):
        FusedAdamSWA(p, [], s, 0.9)
    adam = torch.optim.Adam(p, lr=0.3, betas=(0.5, 0.6), weight_decay=0.1)
    p[0].grad = torch.randn(4)
    adam.step()
    opt = FusedAdamSWA.from_optim(adam, p, c, s, 0.9)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["weight_decay"], g["step"]) == (0.3, (0.5, 0.6), 0.1, 1)
    torch.testing.assert_close(opt.state[p[0]]["exp_avg"], adam.state[p[0]]["exp_avg"])


def _sync_worker(rank, world):
    from culmen.ops.layer_norm.launch import TUNING as LN
    from culmen.ops.pair_attention.launch import TUNING as PA

    before = (PA["kv_block_m"], LN["fwd_elems"])
    if rank == 0:
        PA["kv_block_m"] = 64
        LN["fwd_elems"] = 2048
    sync_triton_auto_tune_cache_across_gpus(strict=True)
    return before, (PA["kv_block_m"], LN["fwd_elems"])


def test_sync_tuning_tables_two_ranks():
    results = run_group(_sync_worker, 2, timeout=90)
    (b0, a0), (b1, a1) = results
    assert b1 != (64, 2048)
    assert a0 == a1 == (64, 2048)


def test_sync_without_process_group_is_a_noop():
    sync_triton_auto_tune_cache_across_gpus()
