"""``culmen.transformer.amp.GradScaler``: the found-inf flag is reduced over the model-parallel group
(2 gloo ranks), so tensor-parallel ranks skip steps and back off together while data-parallel replicas
(separate model-parallel groups) decide alone; the optimizer's own unscale hook; errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from culmen.transformer import parallel_state as ps
from culmen.transformer.amp import GradScaler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

LR = 0.25


class _SelfUnscalingSGD(torch.optim.SGD):
    """Unscales its own gradients (Apex's hook for optimizers holding sharded gradients)."""

    _custom_amp_unscale_grads = True

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.calls = 0

    def unscale_grads(self, inv_scale, found_inf, allow_fp16):
        self.calls += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.mul_(inv_scale)
                found_inf += (~torch.isfinite(p.grad)).any().float()
        return {found_inf.device: found_inf}  # what torch's GradScaler records per device


def _amp_worker(rank, world, cases):
    return [_amp_case(rank, tp, custom) for tp, custom in cases]


def _amp_case(rank, tp, custom):
    from culmen.transformer import parallel_state as ps
    from culmen.transformer.amp import GradScaler

    ps.initialize_model_parallel(tp, 1)
    w0 = torch.linspace(-1, 1, 5)
    w = torch.nn.Parameter(w0.clone())
    opt = _SelfUnscalingSGD([w], LR) if custom else torch.optim.SGD([w], lr=LR)
    scaler = GradScaler(init_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2, device="cpu")
    record = []
    for it in range(3):
        x = torch.arange(1.0, 6.0) * (rank + 1)
        if it == 0 and rank == 1:
            x[2] = float("inf")  # only rank 1 overflows
        opt.zero_grad()
        scaler.scale((w * x).sum()).backward()
        scaler.step(opt)
        scaler.update()
        record.append((scaler.get_scale(), w.detach().clone(), None if it or rank else w.grad.clone()))
    ps.destroy_model_parallel()
    return record, getattr(opt, "calls", None)


def test_found_inf_reduced_over_model_parallel_group():
    # tp=2: both ranks form one model replica; tp=1: two data-parallel replicas, each its own MP group.
    cases = [(tp, custom) for tp in (2, 1) for custom in (False, True)]
    out = run_group(_amp_worker, 2, cases)
    for i, (tp, custom) in enumerate(cases):
        for rank in range(2):
            record, calls = out[rank][i]
            x = torch.arange(1.0, 6.0) * (rank + 1)
            skipped_first = tp == 2 or rank == 1
            scales = [r[0] for r in record]
            if skipped_first:
                # back off to 4, then two clean steps grow it back to 8
                assert scales == [4.0, 4.0, 8.0], (tp, rank, scales)
                steps = [0, 1, 2]
            else:
                assert scales == [8.0, 16.0, 16.0], (tp, rank, scales)
                steps = [1, 2, 3]
            w0 = torch.linspace(-1, 1, 5)
            for it, (_, w, _grad) in enumerate(record):
                torch.testing.assert_close(w, w0 - LR * steps[it] * x, rtol=0, atol=1e-6)
            if rank == 0 and tp == 1:
                torch.testing.assert_close(record[0][2], x)  # unscaled gradient
            if custom:
                assert calls == 3


def test_needs_model_parallel_groups():
    ps.destroy_model_parallel()
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = GradScaler(device="cpu")
    scaler.scale(w.sum()).backward()
    with pytest.raises(ps.ModelParallelNotInitializedError, match="model parallel group"):
        scaler.step(opt)
    assert torch.equal(w.detach(), torch.ones(3))  # nothing stepped


def test_disabled_and_manual_scale():
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.5)
    off = GradScaler(enabled=False, device="cpu")
    loss = w.sum()
    assert off.scale(loss) is loss
    loss.backward()
    off.step(opt)  # no reduction when disabled
    off.update()
    torch.testing.assert_close(w.detach(), torch.full((3,), 0.5))
    on = GradScaler(init_scale=4.0, device="cpu")
    on.scale(w.sum())
    on.update(2.0)
    assert on.get_scale() == 2.0
    assert (on.get_growth_factor(), on.get_backoff_factor(), on.get_growth_interval()) == (2.0, 0.5, 2000)
