"""``culmen.contrib.optimizers.DistributedFusedAdam`` on gloo against ``culmen.optimizers.FusedAdam`` in one process.

Each rank trains on its own slice of the batch; every rank also runs the reference (the whole batch in
one process with FusedAdam, mean loss over the slices), and after every step the gathered params must
match. One spawned group runs many configurations and returns the failures (spawning is the slow part).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

STEPS = 7
B = 3  # samples per rank


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
    return m.to(dtype)


def _batches(world, step, dtype, same=False):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(world * B, 7, generator=g).to(dtype)
    y = torch.randn(world * B, 5, generator=g).to(dtype)
    if same:  # every rank the same data: the averaged gradient equals one rank's exactly
        x, y = x[:B].repeat(world, 1), y[:B].repeat(world, 1)
    return x, y


def _loss(m, x, y):
    return ((m(x).float() - y.float()) ** 2).mean()


def _close(a, b, tol):
    return (a.float() - b.float()).abs().max().item() <= tol


def _run_case(rank, world, cfg, fails):
    from culmen.contrib.optimizers import DistributedFusedAdam
    from culmen.optimizers import FusedAdam

    name = cfg["name"]
    dtype = cfg.get("dtype", torch.float32)
    model, ref = _model(dtype), _model(dtype)
    kw = dict(lr=1e-2, weight_decay=cfg.get("wd", 0.01), adam_w_mode=cfg.get("adam_w_mode", True))
    dfa = {"bucket_cap_mb": 100 * 4 / 2 ** 20, **cfg.get("dfa", {})}  # 2 buckets, params straddling them
    opt = DistributedFusedAdam(model.parameters(), device="cpu", **kw, **dfa)
    ref_opt = FusedAdam(ref.parameters(), master_weights=dtype != torch.float32, **kw)
    scaler = ref_scaler = None
    if cfg.get("scaler"):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    for step in range(STEPS):
        x, y = _batches(world, step, dtype, same=cfg.get("same", False))
        if cfg.get("scaler") and step == 3:
            x[-1, 0] = float("inf")  # only the last rank's slice: every rank must skip
        xs, ys = x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]
        micro = cfg.get("micro", 1)
        for k in range(micro):  # gradient accumulation: the first micro-batches under no_sync
            part = slice(k * B // micro, (k + 1) * B // micro)
            loss = _loss(model, xs[part], ys[part]) * ((k + 1) * B // micro - k * B // micro) / B
            ctx = opt.no_sync() if k < micro - 1 else torch.enable_grad()
            with ctx:
                (scaler.scale(loss) if scaler else loss).backward()
        ref_loss = sum(_loss(ref, x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]) for r in range(world)) / world
        (ref_scaler.scale(ref_loss) if ref_scaler else ref_loss).backward()
        if cfg.get("clip"):
            n1 = opt.clip_grad_norm(cfg["clip"])
            n2 = torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["clip"])
            if not _close(n1, n2, 1e-5 * max(1.0, n2.item())):
                fails.append(f"{name}: step {step} grad norm {n1.item()} != {n2.item()}")
        if scaler:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                scaler.step(opt)
            scaler.update()
            ref_scaler.step(ref_opt)
            ref_scaler.update()
            if scaler.get_scale() != ref_scaler.get_scale():
                fails.append(f"{name}: step {step} scale {scaler.get_scale()} != {ref_scaler.get_scale()}")
        else:
            opt.step()
            ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        opt.param_sync()
        for (pn, p), q in zip(model.named_parameters(), ref.parameters()):
            if not _close(p, q, cfg.get("tol", 2e-5)):
                fails.append(f"{name}: step {step} {pn} max err {(p.float() - q.float()).abs().max().item():.3g}")
                return
    if cfg.get("check_state"):
        total = sum(p.numel() for p in model.parameters())
        local = sum(t.numel() for b in opt.buckets for k, t in b.state.items() if k == "exp_avg")
        padded = sum(b.size for b in opt.buckets)
        if local * opt.distributed_size != padded or padded > total + len(opt.buckets) * 16 * opt.distributed_size:
            fails.append(f"{name}: local state {local} elements for {total} params on {world} ranks")


def _worker_2(rank, world):
    fails: list[str] = []
    cases = [
        dict(name="fp32 overlap", clip=0.05, check_state=True),
        dict(name="fp32 no overlap, L2, contiguous buffers", adam_w_mode=False,
             dfa=dict(overlap_grad_sync=False, contiguous_grad_buffer=True, contiguous_param_buffer=True)),
        dict(name="overlap_param_sync + no_sync accumulation", micro=3, dfa=dict(overlap_param_sync=True)),
        dict(name="grad scaler", scaler=True),
        dict(name="bf16 params fp32 state", dtype=torch.bfloat16, same=True, tol=0.0,
             dfa=dict(param_sync_dtype=torch.bfloat16)),
        dict(name="bf16 param remainders", dtype=torch.bfloat16, same=True, tol=2 ** -7,
             dfa=dict(param_sync_dtype=torch.bfloat16, store_param_remainders=True)),
        dict(name="bf16 remainders, overlapped syncs into contiguous buffers", dtype=torch.bfloat16, same=True,
             tol=2 ** -7, dfa=dict(param_sync_dtype=torch.bfloat16, grad_sync_dtype=torch.bfloat16,
                                   store_param_remainders=True, overlap_param_sync=True,
                                   contiguous_grad_buffer=True, contiguous_param_buffer=True)),
        dict(name="bf16 grad sync, fp16 scaled states", tol=3e-3,
             dfa=dict(grad_sync_dtype=torch.bfloat16, with_scaled_states=True)),
    ]
    for cfg in cases:
        _run_case(rank, world, cfg, fails)
    return fails


def _checkpoint_worker(rank, world, path):
    from culmen.contrib.optimizers import DistributedFusedAdam

    fails = []
    for fmt, extra in ((2, dict()), (1, dict()), (2, dict(store_param_remainders=True,
                                                          param_sync_dtype=torch.bfloat16))):
        dtype = torch.bfloat16 if extra else torch.float32

        def make(dtype=dtype, extra=extra):
            m = _model(dtype)
            return m, DistributedFusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1, device="cpu",
                                           bucket_cap_mb=80 * 4 / 2 ** 20, **extra)

        def train(m, opt, steps, dtype=dtype):
            for s in steps:
                x, y = _batches(world, s, dtype)
                _loss(m, x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]).backward()
                opt.step()
                opt.zero_grad()
            opt.param_sync()

        m, opt = make()
        train(m, opt, range(3))
        sd = opt.state_dict(state_dict_format=fmt, gather_on_root=False)
        torch.save({"model": m.state_dict(), "opt": sd}, f"{path}.{fmt}.{rank}")
        root_only = opt.state_dict(state_dict_format=2)  # default: gathered on rank 0 only
        if (root_only is None) != (rank != 0):
            fails.append(f"format {fmt}: gather_on_root gave {type(root_only).__name__} on rank {rank}")
        train(m, opt, range(3, STEPS))
        dist.barrier()
        ck = torch.load(f"{path}.{fmt}.{rank}", weights_only=False)
        m2, opt2 = make()
        m2.load_state_dict(ck["model"])
        opt2.load_state_dict(ck["opt"])
        train(m2, opt2, range(3, STEPS))
        for (n, p), q in zip(m.named_parameters(), m2.parameters()):
            if not torch.equal(p, q):
                fails.append(f"format {fmt} {extra}: {n} differs after resume by {(p - q).abs().max().item()}")
    return fails


def _worker_4(rank, world):
    fails: list[str] = []
    _run_case(rank, world, dict(name="4 ranks", clip=0.05, check_state=True), fails)
    # 2 shards x 2 replicas: shards over {0,1} / {2,3}, replicated across {0,2} / {1,3}
    groups_d = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups_r = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    _run_case(rank, world, dict(name="2x2 redundant", dfa=dict(distributed_process_group=groups_d[rank // 2],
                                                               redundant_process_group=groups_r[rank % 2])), fails)
    return fails


def test_distributed_fused_adam_matches_fused_adam_2_ranks():
    for fails in run_group(_worker_2, 2, timeout=240):
        assert not fails, "\n".join(fails)


def test_distributed_fused_adam_checkpoint_resume(tmp_path):
    for fails in run_group(_checkpoint_worker, 2, str(tmp_path / "ck"), timeout=120):
        assert not fails, "\n".join(fails)


def test_distributed_fused_adam_4_ranks():
    for fails in run_group(_worker_4, 4, timeout=240):
        assert not fails, "\n".join(fails)


def test_bad_arguments():
    run_group(_bad_args_worker, 1)


def _bad_args_worker(rank, world):
    import pytest

    from culmen.contrib.optimizers import DistributedFusedAdam

    m = _model()
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DistributedFusedAdam(m.parameters(), device="cpu", bucket_cap_mb=0)
    with pytest.raises(ValueError, match="store_param_remainders"):
        DistributedFusedAdam(m.parameters(), device="cpu", store_param_remainders=True)
    with pytest.raises(TypeError, match="grad_sync_dtype"):
        DistributedFusedAdam(m.parameters(), device="cpu", grad_sync_dtype="fp16")
    with pytest.raises(ValueError, match="lr"):
        DistributedFusedAdam(m.parameters(), device="cpu", lr=-1.0)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        DistributedFusedAdam(m.parameters(), device="cpu", amsgrad=True)
