"""``DistributedFusedAdam`` / ``DistributedFusedLAMB`` over NCCL on 2 GPUs against the one-GPU optimizers.

bf16 params, fp32 optimizer state (master params and moments), communication overlapped with backward
(``overlap_grad_sync`` / ``overlap_reductions``) and, for Adam, the parameter all-gather with the next
forward (``overlap_param_sync``). Each rank trains on its slice of the batch; every rank also runs the
reference on its own GPU: the same bf16 model, the gradient of each rank's slice computed separately and
averaged the way the sharded optimizer averages (sum in the gradient-sync dtype, then times 1/world in
fp32), then ``FusedAdam`` / ``FusedLAMB`` on one GPU with fp32 state. Equal inputs to the update give
equal updates, so after each of 7 steps every bf16 param must match the reference within one bf16 ulp
(masters can round differently where the norms of sharded tensors are summed in another order).

Adam's update is nearly invariant to the scale of the gradient, so a wrongly averaged gradient could
slip through a parameter check; the cases use ``eps`` comparable to the gradients, and the global
gradient norm the sharded optimizer computes is checked against the reference's every step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

STEPS = 7
B = 5  # samples per rank
D_IN, D_H, D_OUT = 37, 129, 11  # odd sizes: params straddle buckets and shards at odd offsets
BF16 = torch.bfloat16

needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                  reason="needs 2 GPUs (one NCCL rank per GPU); "
                                         f"this machine has {torch.cuda.device_count()}")


def _device(rank: int) -> torch.device:
    # CPU only when the worker is driven by hand over gloo (a check of the test itself); the test runs on GPUs.
    return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(1234)  # the same initial weights on every rank and for the reference
    m = nn.Sequential(nn.Linear(D_IN, D_H), nn.Tanh(), nn.Linear(D_H, D_OUT))
    return m.to(device=device, dtype=BF16)


def _batch(world: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(world * B, D_IN, generator=g)
    y = torch.randn(world * B, D_OUT, generator=g)
    return x.to(device, BF16), y.to(device, BF16)


def _loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((m(x).float() - y.float()) ** 2).mean()


def _averaged_grads(ref: nn.Module, x: torch.Tensor, y: torch.Tensor, world: int,
                    sync_dtype: torch.dtype) -> list[torch.Tensor]:
    """fp32 gradients as the sharded optimizer sees them: each rank's slice separately (bf16), summed in
    ``sync_dtype`` (NCCL adds in fp32 and rounds once to the buffer's dtype), times 1/world in fp32."""
    params = list(ref.parameters())
    per_rank = [torch.autograd.grad(_loss(ref, x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]), params)
                for r in range(world)]
    out = []
    for i in range(len(params)):
        total = per_rank[0][i].float()
        for r in range(1, world):
            total = total + per_rank[r][i].float()
        out.append(total.to(sync_dtype).float() * (1.0 / world))
    return out


def _compare(name: str, step: int, model: nn.Module, ref: nn.Module, fails: list[str]) -> bool:
    """Every bf16 param within one bf16 ulp of the reference (|p - q| <= |q| * 2^-7 bounds one ulp), plus
    2^-20 absolute for params that pass near zero (fp32 master noise; params are ~0.1, updates ~1e-2)."""
    for (pn, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.dtype != BF16:
            fails.append(f"{name}: {pn} became {p.dtype}")
            return False
        err = (p.float() - q.float()).abs()
        bad = err > q.float().abs() * 2.0 ** -7 + 2.0 ** -20
        if bool(bad.any()):
            fails.append(f"{name}: step {step} {pn}: {int(bad.sum())} of {p.numel()} elements off by more than "
                         f"one bf16 ulp (max err {err.max().item():.3g})")
            return False
    return True


def _check_norm(name: str, step: int, got: torch.Tensor, grads: list[torch.Tensor], fails: list[str]) -> None:
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if not torch.allclose(got.float().reshape(()), want, rtol=1e-5, atol=0.0):
        fails.append(f"{name}: step {step} global grad norm {got.item():.8g} != reference {want.item():.8g}")


def _adam_case(rank: int, world: int, cfg: dict, fails: list[str]) -> None:
    from culmen.contrib.optimizers import DistributedFusedAdam
    from culmen.optimizers import FusedAdam

    name, dev = cfg["name"], _device(rank)
    sync = cfg.get("grad_sync_dtype", torch.float32)
    model, ref = _model(dev), _model(dev)
    # eps comparable to the gradients: the update then depends on their scale (see the module docstring)
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.05, adam_w_mode=True)
    bucket_mb = 1000 * torch.empty((), dtype=sync).element_size() / 2 ** 20  # ~1000 elements: 7 buckets
    opt = DistributedFusedAdam(model.parameters(), device=dev, dtype=torch.float32, grad_sync_dtype=sync,
                               param_sync_dtype=BF16, overlap_grad_sync=True, overlap_param_sync=True,
                               bucket_cap_mb=bucket_mb, **hyper, **cfg.get("dfa", {}))
    if cfg["reference"] == "master_weights":  # FusedAdam keeps the fp32 masters of the bf16 params itself
        ref_opt = FusedAdam(ref.parameters(), master_weights=True, **hyper)
        masters = None
    else:  # FusedAdam over fp32 copies, rounded into the bf16 model after each step
        masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
        ref_opt = FusedAdam(masters, **hyper)
    for step in range(STEPS):
        x, y = _batch(world, step, dev)
        _loss(model, x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]).backward()
        grads = _averaged_grads(ref, x, y, world, sync)
        _check_norm(name, step, opt.grad_norm(), grads, fails)
        opt.step()
        opt.zero_grad()
        if masters is None:
            for p, g in zip(ref.parameters(), grads):
                p.grad = g.to(BF16)  # exact: the sync rounding already happened in _averaged_grads
            ref_opt.step()
            ref_opt.zero_grad()
        else:
            for mst, g in zip(masters, grads):
                mst.grad = g
            ref_opt.step()
            with torch.no_grad():
                for p, mst in zip(ref.parameters(), masters):
                    p.copy_(mst)
        opt.param_sync()  # overlap_param_sync: the gathers finish at the next forward otherwise
        if not _compare(name, step, model, ref, fails):
            return
    moved = max((p.float() - q.float()).abs().max().item()
                for p, q in zip(model.parameters(), _model(dev).parameters()))
    if moved < 1e-2:  # the optimizer must have trained: lr 1e-2 over 7 steps moves params by ~0.07
        fails.append(f"{name}: params moved only {moved:.3g} in {STEPS} steps")


def _lamb_case(rank: int, world: int, cfg: dict, fails: list[str]) -> None:
    from culmen.contrib.optimizers import DistributedFusedLAMB
    from culmen.optimizers import FusedLAMB

    name, dev = cfg["name"], _device(rank)
    model, ref = _model(dev), _model(dev)
    clip = cfg.get("max_grad_norm", 0.0)
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=cfg.get("eps", 1e-6), weight_decay=0.05, adam_w_mode=True,
                 grad_averaging=True, use_nvlamb=cfg.get("use_nvlamb", False))
    opt = DistributedFusedLAMB(model.parameters(), max_grad_norm=clip, overlap_reductions=True, dtype=torch.float32,
                               param_sync_dtype=BF16, device=dev, bucket_cap_mb=1000 * 4 / 2 ** 20, **hyper)
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = FusedLAMB(masters, max_grad_norm=clip if clip > 0 else None, **hyper)
    clipped = 0
    for step in range(STEPS):
        x, y = _batch(world, step, dev)
        _loss(model, x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]).backward()
        grads = _averaged_grads(ref, x, y, world, torch.float32)
        opt.step()
        opt.zero_grad()
        _check_norm(name, step, opt.L2_grad_norm, grads, fails)
        clipped += int(clip > 0 and opt.L2_grad_norm.item() > clip)
        for mst, g in zip(masters, grads):
            mst.grad = g
        ref_opt.step()
        with torch.no_grad():
            for p, mst in zip(ref.parameters(), masters):
                p.copy_(mst)
        if not _compare(name, step, model, ref, fails):
            return
    if clip > 0 and clipped == 0:
        fails.append(f"{name}: max_grad_norm={clip} never clipped: the case does not test clipping")


def _worker(rank: int, world: int) -> list[str]:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    fails: list[str] = []
    cases = [
        (_adam_case, dict(name="adam: bf16 grad sync vs FusedAdam(master_weights=True)",
                          grad_sync_dtype=BF16, reference="master_weights")),
        (_adam_case, dict(name="adam: fp32 grad sync, contiguous buffers", reference="fp32_masters",
                          dfa=dict(contiguous_grad_buffer=True, contiguous_param_buffer=True))),
        (_adam_case, dict(name="adam: fp32 grad sync, bf16 param remainders", reference="fp32_masters",
                          dfa=dict(store_param_remainders=True))),
        (_lamb_case, dict(name="lamb: global-norm clipping", max_grad_norm=0.05)),
        (_lamb_case, dict(name="lamb: no clipping, eps 1e-3, nvlamb", eps=1e-3, use_nvlamb=True)),
    ]
    for fn, cfg in cases:
        try:
            fn(rank, world, cfg, fails)
        except Exception as e:  # one broken case must not hide the others' results
            fails.append(f"{cfg['name']}: {type(e).__name__}: {e}")
    return fails


@pytest.mark.gpu
@needs_2_gpus
def test_distributed_fused_adam_lamb_over_nccl_match_one_gpu():
    results = run_group(_worker, 2, backend="nccl", timeout=300, pg_timeout=120)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
