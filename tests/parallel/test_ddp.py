"""``culmen.parallel.DistributedDataParallel`` and ``Reducer`` on gloo, in spawned process groups.

Each rank trains on its own slice of a batch (distinct per-rank inputs, so a wrong or racing
reduction shows); each rank also computes, in float64, the gradient of the whole batch in one
process, and the DDP gradients must match it. The option cases are chosen pairwise over
``delay_allreduce``, ``message_size``, trigger params, ``allreduce_always_fp32``, predivide factors,
``gradient_average``, streams, ``retain_allreduce_buffers``, ``zero_grad(set_to_none)`` and
fp32/fp16/bf16/mixed-dtype models. Spawning is slow, so one group runs many checks and returns the
failures.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_harness import run_group

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
TOL = {F32: 2e-5, F16: 1e-2, BF16: 4e-2, F64: 1e-10}
B = 4  # samples per rank


class Net(nn.Module):
    """Three linears; ``mixed`` puts the middle one in ``dtype`` and the others in fp32."""

    def __init__(self, dtype=F32, mixed=False):
        super().__init__()
        self.l1 = nn.Linear(6, 10)
        self.l2 = nn.Linear(10, 12)
        self.l3 = nn.Linear(12, 3)
        if mixed:
            self.l2.to(dtype)
        else:
            self.to(dtype)

    def forward(self, x):
        h = torch.tanh(self.l1(x.to(self.l1.weight.dtype)))
        h = torch.tanh(self.l2(h.to(self.l2.weight.dtype)))
        return self.l3(h.to(self.l3.weight.dtype)).float()


def _loss(out):
    return out.square().sum(1).mean()


def _batch(world, it):
    g = torch.Generator().manual_seed(1000 + it)
    return torch.randn(world * B, 6, generator=g)


def _device(c, rank):
    return torch.device("cuda", rank) if c.get("device") == "cuda" else torch.device("cpu")


def _reference_grads(model, world, it):
    """float64 gradients of the mean loss over the whole batch, from a copy of ``model``'s parameters."""
    ref = Net(F64)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters()):
            p.copy_(q.double().cpu())
    _loss(ref(_batch(world, it).double())).backward()
    return [p.grad for p in ref.parameters()]


def _ddp_cases_worker(rank, world, cases):
    from culmen.parallel import DistributedDataParallel as DDP

    failures, info = [], []
    for c in cases:
        name = c["name"]
        dev = _device(c, rank)
        torch.manual_seed(rank)  # rank-specific init: DDP must broadcast rank 0's
        model = Net(c.get("dtype", F32), c.get("mixed", False)).to(dev)
        torch.manual_seed(0)
        rank0 = Net(c.get("dtype", F32), c.get("mixed", False)).to(dev)
        kw = dict(c.get("kw", {}))
        if "triggers" in c:
            kw["allreduce_trigger_params"] = [dict(model.named_parameters())[n] for n in c["triggers"]]
        ddp = DDP(model, **kw)
        for p, q in zip(model.parameters(), rank0.parameters()):
            if not torch.equal(p, q):
                failures.append(f"{name}: parameters not broadcast from rank 0")
                break
        avg = kw.get("gradient_average", True)
        f = kw.get("gradient_predivide_factor", 1.0)
        scaler = torch.amp.GradScaler(dev.type, init_scale=256.0) if c.get("scaler") else None
        overlapped = []
        for it in range(3):
            model.zero_grad(set_to_none=(it != 2))
            x = _batch(world, it)[rank * B:(rank + 1) * B].to(dev)
            if c.get("autocast"):
                with torch.autocast(dev.type, dtype=BF16):
                    loss = _loss(ddp(x))
            else:
                loss = _loss(ddp(x))
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                inv = 1.0 / scaler.get_scale()
                for p in model.parameters():
                    p.grad.mul_(inv)
            overlapped.append(ddp.last_backward_stats["launched_during_backward"])
            ref = _reference_grads(model, world, it)
            for (pname, p), r in zip(model.named_parameters(), ref):
                expect = r if avg else r * (world / f)
                # Errors follow the model's lowest precision (fp32 layers of a mixed model see bf16 inputs).
                tol = TOL[BF16 if c.get("autocast") else c.get("dtype", F32)] * max(1.0, expect.abs().max().item())
                err = (p.grad.double().cpu() - expect).abs().max().item()
                if not err <= tol:
                    failures.append(f"{name} it{it} {pname}: max err {err:.3g} > {tol:.3g}")
                if p.grad.dtype != p.dtype:
                    failures.append(f"{name}: {pname}.grad dtype {p.grad.dtype}")
        if kw.get("retain_allreduce_buffers"):
            bufs = ddp.allreduce_buffers
            if len(bufs) != len(ddp.bucket_structure):
                failures.append(f"{name}: {len(bufs)} retained buffers for {len(ddp.bucket_structure)} buckets")
            ptrs = {b.data_ptr() for b in bufs}
            for p in model.parameters():
                base = p.grad._base if p.grad._base is not None else p.grad
                if base.data_ptr() not in ptrs:
                    failures.append(f"{name}: a grad is not a view of a retained allreduce buffer")
                    break
        info.append({"name": name, "buckets": ddp.bucket_structure, "overlapped": overlapped})
    return failures, info


# Pairwise over the options; "expect" says how the first-rank buckets must look.
CASES_2 = [
    dict(name="fp32-msg50", kw=dict(message_size=50)),
    dict(name="bf16-delay-pre2", dtype=BF16, kw=dict(message_size=0, delay_allreduce=True,
                                                     gradient_predivide_factor=2.0)),
    dict(name="fp16-fp32reduce-sum", dtype=F16, kw=dict(allreduce_always_fp32=True, gradient_average=False)),
    dict(name="mixed-bf16-triggers-pre3", dtype=BF16, mixed=True, triggers=["l2.weight", "l1.bias"],
         kw=dict(gradient_predivide_factor=3.0)),
    dict(name="fp32-msg0-streams2-retain-sum-pre2", kw=dict(message_size=0, num_allreduce_streams=2,
                                                            retain_allreduce_buffers=True, gradient_average=False,
                                                            gradient_predivide_factor=2.0)),
    dict(name="mixed-fp16-delay-fp32reduce-retain", dtype=F16, mixed=True,
         kw=dict(delay_allreduce=True, allreduce_always_fp32=True, retain_allreduce_buffers=True)),
    dict(name="bf16-msg50-streams2-fp32reduce-pre0.5", dtype=BF16,
         kw=dict(message_size=50, num_allreduce_streams=2, allreduce_always_fp32=True,
                 gradient_predivide_factor=0.5)),
    dict(name="fp16-msg0-triggers-retain", dtype=F16, triggers=["l3.weight"],
         kw=dict(message_size=0, retain_allreduce_buffers=True)),
    dict(name="fp32-autocast-scaler-msg100", autocast=True, scaler=True, kw=dict(message_size=100)),
]

CASES_3 = [
    dict(name="fp32-msg0-pre3", kw=dict(message_size=0, gradient_predivide_factor=3.0)),
    dict(name="bf16-fp32reduce-delay-sum", dtype=BF16, kw=dict(allreduce_always_fp32=True, delay_allreduce=True,
                                                               gradient_average=False)),
    dict(name="mixed-fp16-msg50-streams3", dtype=F16, mixed=True, kw=dict(message_size=50,
                                                                          num_allreduce_streams=3)),
    dict(name="fp32-triggers-pre1.5", triggers=["l2.bias"], kw=dict(gradient_predivide_factor=1.5)),
]


def _check_group(results, cases):
    failures = [f"rank {r}: {f}" for r, (fs, _) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
    infos = [info for _, info in results]
    for k, c in enumerate(cases):
        structs = {str(infos[r][k]["buckets"]) for r in range(len(results))}
        assert len(structs) == 1, f"{c['name']}: bucket structures differ across ranks: {structs}"
        buckets = infos[0][k]["buckets"]
        overlapped = infos[0][k]["overlapped"]
        kw = c.get("kw", {})
        # The first backward records the order and reduces at its end; later ones overlap.
        assert overlapped[0] == 0, c["name"]
        if kw.get("delay_allreduce"):
            dtypes = {c.get("dtype", F32)} | ({F32} if c.get("mixed") else set())
            assert len(buckets) == len(dtypes) and overlapped == [0, 0, 0], c["name"]
        elif "triggers" in c:  # triggers replace message_size
            assert any(b[-1] in c["triggers"] for b in buckets), (c["name"], buckets)
            assert min(overlapped[1:]) >= 1, (c["name"], overlapped)
        elif kw.get("message_size") == 0:
            assert len(buckets) == 6 and min(overlapped[1:]) >= 5, (c["name"], buckets, overlapped)
        if not kw.get("delay_allreduce") and not c.get("mixed") and (kw.get("message_size") in (0, 50)
                                                                      or "triggers" in c):
            # Backward produces the last layer's gradients first.
            assert buckets[0][0].startswith("l3"), (c["name"], buckets)


def test_ddp_option_cases_2_ranks():
    cases = CASES_2
    _check_group(run_group(_ddp_cases_worker, 2, cases), cases)


def test_ddp_option_cases_3_ranks():
    cases = CASES_3
    _check_group(run_group(_ddp_cases_worker, 3, cases), cases)


# ---------------------------------------------------------------------------------------------
# Race test (Apex's idea): exact expected values, many buckets in flight, distinct per-rank grads
# ---------------------------------------------------------------------------------------------

SIZES = (7, 130, 3, 64, 1, 33, 260, 5)
DTYPES = (F32, BF16, F16, F32, BF16, F32, F16, BF16)


def _race_worker(rank, world, iters, device="cpu"):
    from culmen.parallel import DistributedDataParallel as DDP

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")

    class Params(nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = nn.ParameterList(nn.Parameter(torch.zeros(n, dtype=d)) for n, d in zip(SIZES, DTYPES))

        def forward(self, k):
            # grad of p_i = (rank + 1) * k * pattern_i; a chain of products spreads the backward in time.
            total = 0.0
            for i, p in enumerate(self.ps):
                pat = (torch.arange(p.numel(), device=p.device) % 5 + 1 + i).to(p.dtype)
                total = total + (p * (pat * (rank + 1) * k)).sum().float()
                if p.is_cuda:  # some GPU work between the parameters: buckets finish while backward runs
                    total = total + (torch.ones(256, 256, device=p.device) @ torch.ones(256, 256, device=p.device)
                                     ).sum() * 0
            return total

    failures = []
    for kw in (dict(message_size=40), dict(message_size=0, num_allreduce_streams=2), dict(message_size=200,
                                                                                          allreduce_always_fp32=True)):
        m = Params().to(dev)
        ddp = DDP(m, **kw)
        for it in range(iters):
            m.zero_grad(set_to_none=(it % 2 == 0))
            k = it % 4 + 1
            ddp(k).backward()
            for i, p in enumerate(m.ps):
                pat = (torch.arange(p.numel(), device=dev) % 5 + 1 + i).double()
                expect = (pat * k * sum(r + 1 for r in range(world)) / world).to(p.dtype)
                if not torch.equal(p.grad, expect):
                    bad = (p.grad != expect).nonzero()[:3].flatten().tolist()
                    failures.append(f"{kw} it{it} param{i} ({p.dtype}): wrong at {bad}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_race_exact(world):
    results = run_group(_race_worker, world, 6)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])


# ---------------------------------------------------------------------------------------------
# Unused parameters, accumulation, requires_grad changes, Reducer, argument checks
# ---------------------------------------------------------------------------------------------


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)  # never used in forward

    def forward(self, x, use_b=True):
        h = self.a(x)
        return self.b(h) if use_b else h


def _misc_worker(rank, world):
    from culmen.parallel import DistributedDataParallel as DDP
    from culmen.parallel import Reducer, flat_dist_call

    out = {}
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))

    # 1. A parameter never used: left out of the buckets, grad stays None, no error.
    torch.manual_seed(0)
    m = Branchy()
    ddp = DDP(m, message_size=0)
    for _ in range(2):
        ddp(x).sum().backward()
    out["never_grad_none"] = m.never.weight.grad is None
    out["never_not_bucketed"] = all("never" not in n for b in ddp.bucket_structure for n in b)

    # 2. A bucketed parameter unused in a later backward (on every rank): every rank raises, clearly;
    #    the next full backward works again.
    m.zero_grad()
    try:
        ddp(x, use_b=False).sum().backward()
        out["unused_error"] = None
    except RuntimeError as e:
        out["unused_error"] = str(e)
    m.zero_grad()
    ddp(x).sum().backward()
    out["after_error_ok"] = m.b.weight.grad is not None

    # 3. Rank-dependent use: only rank 1 skips b. Rank 1 raises; rank 0 completes with zeros in rank 1's
    #    place; the groups stay in step for the next iteration.
    m.zero_grad()
    try:
        ddp(x, use_b=(rank != 1)).sum().backward()
        out["rank_dep_error"] = None
    except RuntimeError as e:
        out["rank_dep_error"] = str(e)
    m.zero_grad()
    ddp(x).sum().backward()
    out["rank_dep_then_ok"] = True

    # 4. find_unused_parameters=True: rank-dependent use is reduced with zeros standing in.
    torch.manual_seed(0)
    m2 = Branchy()
    ddp2 = DDP(m2, message_size=0, find_unused_parameters=True)
    grads = []
    for it in range(3):
        m2.zero_grad()
        ddp2(x, use_b=(rank != 1 or it == 0)).sum().backward()
        grads.append(m2.b.weight.grad.clone())
    local = torch.zeros_like(m2.b.weight) if rank == 1 else torch.autograd.grad(m2.b(m2.a(x)).sum(), m2.b.weight)[0]
    total = local.clone()
    dist.all_reduce(total)
    out["find_unused_ok"] = torch.allclose(grads[-1], total / world, atol=1e-6)
    out["find_unused_buckets_all"] = sum(len(b) for b in ddp2.bucket_structure) == 6

    # 5. Gradient accumulation with disable_allreduce / enable_allreduce.
    torch.manual_seed(0)
    m3 = nn.Linear(4, 2)
    ddp3 = DDP(m3, message_size=1)
    x1 = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + rank))
    x2 = torch.randn(3, 4, generator=torch.Generator().manual_seed(20 + rank))
    ddp3.disable_allreduce()
    ddp3(x1).square().sum().backward()
    local_after_1 = m3.weight.grad.clone()
    ddp3.enable_allreduce()
    ddp3(x2).square().sum().backward()
    torch.manual_seed(0)
    ref = nn.Linear(4, 2)
    g = [torch.autograd.grad((ref(xx).square().sum()), ref.weight)[0] for xx in (x1, x2)]
    own = g[0] + g[1]
    tot = own.clone()
    dist.all_reduce(tot)
    out["accum_local_step_unreduced"] = torch.allclose(local_after_1, g[0], atol=1e-6)
    out["accum_ok"] = torch.allclose(m3.weight.grad, tot / world, atol=1e-5)

    # 6. requires_grad changes rebuild the buckets; the frozen weight's grad is left alone.
    m3.weight.requires_grad_(False)
    m3.zero_grad(set_to_none=True)
    ddp3(x1).sum().backward()
    out["frozen_refresh"] = (m3.weight.grad is None and m3.bias.grad is not None
                             and ddp3.bucket_structure == [["bias"]])

    # 7. Reducer: with a module (broadcast at construction), and with a list of tensors.
    torch.manual_seed(rank)
    m4 = nn.Linear(3, 3)
    red = Reducer(m4)
    w0 = m4.weight.detach().clone()
    dist.all_reduce(w0)
    out["reducer_broadcast"] = torch.allclose(w0 / world, m4.weight)
    m4(torch.full((2, 3), float(rank + 1))).sum().backward()
    red.reduce()
    mean_x = sum(r + 1 for r in range(world)) / world
    out["reducer_module"] = torch.allclose(m4.weight.grad, torch.full((3, 3), 2.0 * mean_x))
    ts = [torch.full((5,), float(rank)), torch.full((2,), float(rank), dtype=F64), torch.full((3,), 1.0 + rank)]
    Reducer([ts[0], [ts[1], (ts[2],)]]).reduce()
    mr = sum(range(world)) / world
    out["reducer_list"] = (torch.allclose(ts[0], torch.full((5,), mr)) and ts[1].dtype == F64
                           and torch.allclose(ts[2], torch.full((3,), 1.0 + mr)))
    t = [torch.full((4,), float(rank))]
    flat_dist_call(t, dist.broadcast, (0,))
    out["flat_dist_call_broadcast"] = bool((t[0] == 0).all())

    # 8. Argument checks (Apex's errors) and the deprecated split factor.
    errs = {}
    for key, kw in {
        "shared_param": dict(shared_param=True),
        "streams_delay": dict(num_allreduce_streams=2, delay_allreduce=True),
        "triggers_delay": dict(allreduce_trigger_params=[m4.weight], delay_allreduce=True),
        "communicators": dict(num_allreduce_streams=2, allreduce_communicators=([None], [None])),
        "foreign_trigger": dict(allreduce_trigger_params=[nn.Parameter(torch.ones(1))]),
        "predivide": dict(gradient_predivide_factor=0.0),
    }.items():
        try:
            DDP(nn.Linear(3, 3), **kw)
            errs[key] = None
        except ValueError as e:
            errs[key] = str(e)
    out["arg_errors"] = errs
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        m5 = nn.Linear(3, 1)
        ddp5 = DDP(m5, gradient_average_split_factor=4.0, gradient_average=False)
    out["split_factor_warning"] = any(issubclass(w.category, FutureWarning) for w in rec)
    ddp5(torch.ones(1, 3)).sum().backward()
    out["split_factor_is_predivide"] = torch.allclose(m5.weight.grad, torch.full((1, 3), world / 4.0))
    try:
        import pickle

        pickle.dumps(ddp5)
        out["pickle_error"] = False
    except TypeError:
        out["pickle_error"] = True
    return out


def test_ddp_misc():
    results = run_group(_misc_worker, 2)
    for rank, out in enumerate(results):
        assert out["never_grad_none"] and out["never_not_bucketed"], out
        assert out["unused_error"] is not None and "b.weight" in out["unused_error"] \
            and "find_unused_parameters=True" in out["unused_error"], out["unused_error"]
        assert out["after_error_ok"] and out["rank_dep_then_ok"]
        if rank == 1:
            assert out["rank_dep_error"] is not None and "b.bias" in out["rank_dep_error"]
        else:
            assert out["rank_dep_error"] is None
        assert out["find_unused_ok"] and out["find_unused_buckets_all"]
        assert out["accum_local_step_unreduced"] and out["accum_ok"]
        assert out["frozen_refresh"]
        assert out["reducer_broadcast"] and out["reducer_module"] and out["reducer_list"]
        assert out["flat_dist_call_broadcast"]
        for key, msg in out["arg_errors"].items():
            assert msg, f"{key} did not raise"
        assert "no longer supported" in out["arg_errors"]["shared_param"]
        assert out["split_factor_warning"] and out["split_factor_is_predivide"]
        assert out["pickle_error"]


def test_needs_process_group():
    from culmen.parallel import DistributedDataParallel as DDP

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DDP(nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------
# With culmen.amp and culmen's fused optimizers
# ---------------------------------------------------------------------------------------------


def _amp_worker(rank, world):
    from culmen import amp
    from culmen.optimizers import FusedAdam, FusedSGD
    from culmen.parallel import DistributedDataParallel as DDP

    out = {}
    for level, opt_cls in (("O1", FusedAdam), ("O2", FusedSGD), ("O5", FusedAdam)):
        torch.manual_seed(rank)  # different per rank: DDP's broadcast must align them
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = opt_cls(m.parameters(), lr=1e-2)
        m, opt = amp.initialize(m, opt, opt_level=level, verbosity=0)
        ddp = DDP(m, message_size=20)
        g = torch.Generator().manual_seed(5 + rank)
        for _ in range(4):
            opt.zero_grad()
            loss = ddp(torch.randn(6, 8, generator=g)).float().square().mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        flat = torch.cat([p.detach().float().flatten() for p in m.parameters()])
        every = torch.empty(world * flat.numel())
        dist.all_gather_into_tensor(every, flat)
        every = every.view(world, -1)
        out[level] = {"in_sync": bool((every == every[0]).all()), "finite": bool(torch.isfinite(flat).all()),
                      "moved": bool((flat != 0).any()), "dtype": str(next(m.parameters()).dtype)}
    return out


def test_ddp_with_culmen_amp_and_fused_optimizers():
    """amp O1/O2/O5 (master weights, loss scaling) with FusedAdam/FusedSGD stepping on DDP's bucket-view
    gradients: every rank ends with the same finite parameters."""
    for out in run_group(_amp_worker, 2):
        for level, r in out.items():
            assert r["in_sync"] and r["finite"] and r["moved"], (level, r)
        assert out["O2"]["dtype"] == "torch.float16" and out["O5"]["dtype"] == "torch.bfloat16"


def test_package_exports():
    import culmen.parallel as par
    from culmen.parallel.LARC import LARC

    assert par.LARC is LARC and par.ReduceOp is dist.ReduceOp
    for name in ("DistributedDataParallel", "Reducer", "SyncBatchNorm", "convert_syncbn_model",
                 "create_syncbn_process_group", "flat_dist_call"):
        assert hasattr(par, name)
