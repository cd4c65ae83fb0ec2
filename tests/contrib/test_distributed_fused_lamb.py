"""``culmen.contrib.optimizers.DistributedFusedLAMB`` on gloo against ``culmen.optimizers.FusedLAMB`` in one process.

Per-rank slices of one batch; the reference runs the whole batch (mean of the slices' losses) with
FusedLAMB. The trust ratio needs per-param norms summed over shards, so the tiny buckets make params
straddle buckets and ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402
from test_distributed_fused_adam import STEPS, B, _batches, _close, _loss, _model  # noqa: E402


def _case(rank, world, cfg, fails):
    from culmen.contrib.optimizers import DistributedFusedLAMB
    from culmen.optimizers import FusedLAMB

    model, ref = _model(), _model()
    kw = dict(lr=1e-2, eps=1e-6, weight_decay=cfg.get("wd", 0.01), adam_w_mode=cfg.get("adam_w_mode", True),
              grad_averaging=cfg.get("grad_averaging", True), use_nvlamb=cfg.get("use_nvlamb", False))
    opt = DistributedFusedLAMB(model.parameters(), max_grad_norm=cfg.get("max_grad_norm", 0.0), device="cpu",
                               dwu_num_blocks=3, **kw, **cfg.get("dfl", {}))
    mg = cfg.get("max_grad_norm", 0.0)
    ref_opt = FusedLAMB(ref.parameters(), max_grad_norm=mg if mg > 0 else None, **kw)
    for step in range(STEPS):
        x, y = _batches(world, step, torch.float32)
        scale = cfg.get("global_scale", 1.0)
        if scale != 1.0:
            opt.set_global_scale(scale)
        (_loss(model, x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]) * scale).backward()
        (sum(_loss(ref, x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]) for r in range(world)) / world).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            if not _close(p, q, 2e-5):
                fails.append(f"{cfg['name']}: step {step} {n} max err {(p - q).abs().max().item():.3g}")
                return opt
    if opt.has_overflow:
        fails.append(f"{cfg['name']}: overflow reported on finite gradients")
    return opt


def _worker(rank, world, path):
    fails: list[str] = []
    cases = [
        dict(name="clip + decoupled wd", max_grad_norm=0.05),
        dict(name="L2 mode, nvlamb, no wd", adam_w_mode=False, wd=0.0, use_nvlamb=True),
        dict(name="no wd no nvlamb, no grad averaging, no overlap, global scale", wd=0.0, grad_averaging=False,
             global_scale=64.0, dfl=dict(overlap_reductions=False)),
    ]
    for cfg in cases:
        _case(rank, world, cfg, fails)
    if world == 4:
        _case(rank, world, dict(name="dwu_group_size=2", max_grad_norm=0.05, dfl=dict(dwu_group_size=2)), fails)
        return fails
    # checkpoint (gathered format) resumed bit-identically
    from culmen.contrib.optimizers import DistributedFusedLAMB

    def make():
        m = _model()
        return m, DistributedFusedLAMB(m.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=0.05, device="cpu",
                                       dwu_num_blocks=3)

    def train(m, opt, steps):
        for s in steps:
            x, y = _batches(world, s, torch.float32)
            _loss(m, x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]).backward()
            opt.step()
            opt.zero_grad()

    m, opt = make()
    train(m, opt, range(3))
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(gather_on_root=False)}, f"{path}.{rank}")
    train(m, opt, range(3, STEPS))
    dist.barrier()
    ck = torch.load(f"{path}.{rank}", weights_only=False)
    m2, opt2 = make()
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    train(m2, opt2, range(3, STEPS))
    for (n, p), q in zip(m.named_parameters(), m2.parameters()):
        if not torch.equal(p, q):
            fails.append(f"resume: {n} differs by {(p - q).abs().max().item()}")
    return fails


def test_distributed_fused_lamb_matches_fused_lamb_2_ranks(tmp_path):
    for fails in run_group(_worker, 2, str(tmp_path / "ck"), timeout=180):
        assert not fails, "\n".join(fails)


def test_distributed_fused_lamb_4_ranks(tmp_path):
    for fails in run_group(_worker, 4, str(tmp_path / "ck"), timeout=240):
        assert not fails, "\n".join(fails)
