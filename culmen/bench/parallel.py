"""Data-parallel benchmark: culmen DDP + SyncBatchNorm against PyTorch's, under torchrun.

    torchrun --standalone --nproc_per_node 2 scripts/bench_parallel.py --out DIR [--quick]

Every rank runs the same work; times are the slowest rank's. Measured, per model (a GPT-2-small-like
bf16 transformer, and a ResNet-50-like conv net in channels_last under bf16 autocast whose
BatchNorms are synchronized):

* ``step_s``: one training step (zero_grad, forward, backward, SGD step) with culmen's
  ``DistributedDataParallel`` (``message_size`` elements per bucket, culmen ``SyncBatchNorm``) and
  with ``torch.nn.parallel.DistributedDataParallel`` (``bucket_cap_mb`` = the same bucket in bytes,
  ``torch.nn.SyncBatchNorm``); ``speedup_vs_torch`` = torch step / culmen step.
* ``single_step_s``: the same step of the plain model (``BatchNorm2d``) on one GPU, no communication;
  ``scaling_efficiency`` = single step / DDP step (weak scaling: the per-GPU batch is fixed, so 1.0
  means two GPUs do twice the work per second).
* overlap: ``fwd_bwd_s`` (forward + backward, gradients reduced), ``fwd_bwd_nocomm_s`` (reduction
  switched off: ``disable_allreduce()`` / ``no_sync()``) and ``comm_s`` (the same buckets all-reduced
  alone); ``overlap`` = 1 - (fwd_bwd - fwd_bwd_nocomm) / comm: the share of the communication hidden
  behind backward.

And ``syncbn``: forward + backward of culmen ``SyncBatchNorm`` against ``torch.nn.SyncBatchNorm`` on
ResNet-like activations, NCHW and channels_last, bf16 input with fp32 parameters, and fp32.

Writes ``DIR/parallel_bench.json`` (rank 0) and prints a summary. ``--quick`` uses tiny shapes (for
CPU/gloo runs; PyTorch's SyncBatchNorm needs a GPU, so on CPU its rows are skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2-small-like decoder (tied embedding/unembedding)."""

    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-50-like: bottleneck stages ``layers`` of widths 64, 128, 256, 512 (x ``width_mult``)."""

    def __init__(self, layers=(3, 4, 6, 3), width_mult: float = 1.0, classes: int = 1000):
        super().__init__()
        w0 = int(64 * width_mult)
        self.stem = nn.Sequential(nn.Conv2d(3, w0, 7, 2, 3, bias=False), nn.BatchNorm2d(w0), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], w0
        for i, n in enumerate(layers):
            width = int(64 * width_mult) * 2 ** i
            for j in range(n):
                blocks.append(_Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * 4
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x, targets):
        x = self.blocks(self.stem(x))
        return F.cross_entropy(self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)).float(), targets)


# ---------------------------------------------------------------------------------------------
# Timing helpers
# ---------------------------------------------------------------------------------------------


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _max_over_ranks(x: float, dev: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn, steps: int, warmup: int, dev: torch.device, repeats: int = 3) -> float:
    """Seconds per call of ``fn``: the median over ``repeats`` windows of ``steps`` calls (after ``warmup``)
    of the slowest rank's mean."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        _sync(dev)
        times.append(_max_over_ranks((time.perf_counter() - t0) / steps, dev))
    return sorted(times)[len(times) // 2]


def _bucket_bytes_mb(model: nn.Module, message_size: int) -> float:
    """torch DDP's ``bucket_cap_mb`` equal to ``message_size`` elements of the model's (main) dtype."""
    elem = next(model.parameters()).element_size()
    return message_size * elem / 2**20


# ---------------------------------------------------------------------------------------------
# Model benchmark
# ---------------------------------------------------------------------------------------------


def _culmen_runs(make_model, fmt, sync_bn, step_fn, fwd_bwd_fn, dev, args) -> dict[str, Any]:
    from culmen.parallel import DistributedDataParallel, convert_syncbn_model

    res: dict[str, Any] = {}
    torch.manual_seed(0)
    m = make_model().to(dev, memory_format=fmt)
    if sync_bn:
        m = convert_syncbn_model(m)
    ddp = DistributedDataParallel(m, message_size=args.message_size)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4, momentum=0.9)
    res["culmen_step_s"] = _timed(step_fn(ddp, opt), args.steps, args.warmup, dev)
    res["culmen_buckets"] = ddp.last_backward_stats.get("buckets")
    res["culmen_buckets_launched_during_backward"] = ddp.last_backward_stats.get("launched_during_backward")
    res["culmen_fwd_bwd_s"] = _timed(fwd_bwd_fn(ddp), args.steps, 2, dev)

    @contextlib.contextmanager
    def nosync():
        ddp.disable_allreduce()
        try:
            yield
        finally:
            ddp.enable_allreduce()

    res["culmen_fwd_bwd_nocomm_s"] = _timed(fwd_bwd_fn(ddp, nosync), args.steps, 2, dev)
    bufs = [b.buffer for b in ddp._buckets]

    def comm():
        for b in bufs:
            dist.all_reduce(b)

    res["culmen_comm_s"] = _timed(comm, args.steps, 2, dev)
    return res


def _model_bench(name: str, make_model, make_batch, amp_dtype, sync_bn: bool, dev, args) -> dict[str, Any]:
    world = dist.get_world_size()
    res: dict[str, Any] = {"world_size": world, "message_size": args.message_size}
    inputs = make_batch()
    autocast = (torch.autocast(dev.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext())

    def step_fn(model, opt):
        def step():
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = model(*inputs)
            loss.backward()
            opt.step()
        return step

    def fwd_bwd_fn(model, ctx=contextlib.nullcontext):
        def run():
            with ctx():
                with autocast:
                    loss = model(*inputs)
                loss.backward()
        return run

    fmt = torch.channels_last if name == "resnet" else torch.contiguous_format

    # 1. One GPU, no DDP (every rank runs it on its own device at the same time).
    torch.manual_seed(0)
    base = make_model().to(dev, memory_format=fmt)
    opt = torch.optim.SGD(base.parameters(), lr=1e-4, momentum=0.9)
    res["single_step_s"] = _timed(step_fn(base, opt), args.steps, args.warmup, dev)
    res["params"] = sum(p.numel() for p in base.parameters())
    del base, opt

    # 2. culmen DDP (+ culmen SyncBatchNorm).
    res.update(_culmen_runs(make_model, fmt, sync_bn, step_fn, fwd_bwd_fn, dev, args))

    # 3. torch DDP (+ torch SyncBatchNorm) with the same bucket size.
    torch.manual_seed(0)
    m = make_model().to(dev, memory_format=fmt)
    if sync_bn:
        if dev.type == "cuda":
            m = nn.SyncBatchNorm.convert_sync_batchnorm(m)
        else:
            res["torch_note"] = "torch.nn.SyncBatchNorm needs a GPU: the torch run uses unsynchronized BatchNorm"
    cap = _bucket_bytes_mb(m, args.message_size)
    res["torch_bucket_cap_mb"] = cap
    tddp = nn.parallel.DistributedDataParallel(m, device_ids=[dev.index] if dev.type == "cuda" else None,
                                               bucket_cap_mb=cap)
    opt = torch.optim.SGD(tddp.parameters(), lr=1e-4, momentum=0.9)
    res["torch_step_s"] = _timed(step_fn(tddp, opt), args.steps, args.warmup, dev)
    res["torch_fwd_bwd_s"] = _timed(fwd_bwd_fn(tddp), args.steps, 2, dev)
    res["torch_fwd_bwd_nocomm_s"] = _timed(fwd_bwd_fn(tddp, tddp.no_sync), args.steps, 2, dev)
    del tddp, m, opt

    for who in ("culmen", "torch"):
        if f"{who}_step_s" in res:
            res[f"{who}_scaling_efficiency"] = res["single_step_s"] / res[f"{who}_step_s"]
        if f"{who}_fwd_bwd_s" in res:
            exposed = res[f"{who}_fwd_bwd_s"] - res[f"{who}_fwd_bwd_nocomm_s"]
            res[f"{who}_exposed_comm_s"] = exposed
            res[f"{who}_overlap"] = min(1.0, max(0.0, 1.0 - exposed / res["culmen_comm_s"]))
    if "torch_step_s" in res:
        res["speedup_vs_torch"] = res["torch_step_s"] / res["culmen_step_s"]
    res["samples_per_s_culmen"] = world * inputs[0].shape[0] / res["culmen_step_s"]
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------
# SyncBatchNorm benchmark
# ---------------------------------------------------------------------------------------------


def _syncbn_bench(dev, args) -> list[dict[str, Any]]:
    from culmen.parallel import SyncBatchNorm

    stages = [(64, 112), (256, 56), (512, 28), (1024, 14), (2048, 7)]  # ResNet-50's BatchNorm inputs
    if args.quick:
        cases = [((4, 8, 9, 9), dt) for dt in (torch.bfloat16, torch.float32)] + [((4, 16, 5, 5), torch.bfloat16)]
    else:
        cases = [((64, c, hw, hw), dt) for c, hw in stages for dt in (torch.bfloat16, torch.float32)]
        cases += [((256, c, hw, hw), torch.bfloat16) for c, hw in stages]
    rows = []
    for shape, dtype in cases:
        for layout in ("nchw", "channels_last"):
            C = shape[1]
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            g = torch.Generator(device=dev).manual_seed(dist.get_rank())
            x = torch.randn(shape, device=dev, generator=g).to(dtype).contiguous(memory_format=fmt)
            x.requires_grad_()
            dy = torch.randn(shape, device=dev, generator=g).to(dtype).contiguous(memory_format=fmt)
            row: dict[str, Any] = {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
                                   "layout": layout}
            mods = {"culmen": SyncBatchNorm(C).to(dev)}
            if dev.type == "cuda":
                mods["torch"] = nn.SyncBatchNorm(C).to(dev)
            else:
                row["torch_note"] = "torch.nn.SyncBatchNorm needs a GPU"
            outs = {}
            for who, mod in mods.items():
                def run(mod=mod, x=x, dy=dy):
                    x.grad = None
                    mod(x).backward(dy)
                try:
                    row[f"{who}_ms"] = 1e3 * _timed(run, args.bn_steps, 3, dev)
                    x.grad = None
                    y = mod(x)
                    y.backward(dy)
                    outs[who] = (y.detach().float(), x.grad.detach().float())
                except Exception as e:  # recorded, never hidden
                    row[f"{who}_error"] = f"{type(e).__name__}: {e}"
            if "culmen_ms" in row and "torch_ms" in row:
                row["speedup"] = row["torch_ms"] / row["culmen_ms"]
            if len(outs) == 2:
                row["max_abs_diff_y"] = float((outs["culmen"][0] - outs["torch"][0]).abs().max())
                row["max_abs_diff_dx"] = float((outs["culmen"][1] - outs["torch"][1]).abs().max())
            # Bytes moved: fwd reads x twice (stats, normalize) and writes y; bwd reads dy, x twice, writes dx.
            nbytes = x.numel() * x.element_size() * 7
            if "culmen_ms" in row:
                row["culmen_gbps"] = nbytes / (row["culmen_ms"] * 1e-3) / 1e9
            rows.append(row)
            del x, dy, mods, outs
    return rows


# ---------------------------------------------------------------------------------------------
# Profile (where the time of one SyncBatchNorm goes)
# ---------------------------------------------------------------------------------------------


def _profile(dev, args) -> dict[str, Any]:
    """Per-call cost of the collectives SyncBatchNorm uses and a profiler table of culmen's / torch's."""
    from culmen.parallel import SyncBatchNorm

    res: dict[str, Any] = {}
    world = dist.get_world_size()
    pg = dist.group.WORLD
    small = torch.randn(514, device=dev)
    out = torch.empty(world * 514, device=dev)

    def per_call_us(fn, n=200):
        return 1e6 * _timed(fn, n, 10, dev, repeats=1)

    def host_us(fn, n=200):
        """Host time of enqueueing ``fn`` n times (NCCL calls return before the GPU ran them)."""
        for _ in range(10):
            fn()
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        _sync(dev)
        return 1e6 * dt / n

    res["all_gather_into_tensor_us"] = per_call_us(lambda: dist.all_gather_into_tensor(out, small))
    res["all_reduce_us"] = per_call_us(lambda: dist.all_reduce(small))
    res["host_all_gather_into_tensor_us"] = host_us(lambda: dist.all_gather_into_tensor(out, small))
    res["host_pg_allgather_base_us"] = host_us(lambda: pg._allgather_base(out, small).wait())
    res["host_all_reduce_us"] = host_us(lambda: dist.all_reduce(small))
    res["host_pg_allreduce_us"] = host_us(lambda: pg.allreduce([small]).wait())
    res["host_empty_us"] = host_us(lambda: torch.empty(514, device=dev))
    shape = (64, 256, 56, 56) if not args.quick else (4, 8, 5, 5)
    x = torch.randn(shape, device=dev).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    dy = torch.randn_like(x)
    mods = {"culmen": SyncBatchNorm(shape[1]).to(dev), "bn": nn.BatchNorm2d(shape[1]).to(dev)}
    mods_probe = mods["culmen"]
    mods_probe(x).backward(dy)  # compile the kernels first
    _sync(dev)
    res["env"] = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "NCCL", "TORCH_DIST"))}
    if dev.type == "cuda":
        big = torch.randn(8192, 8192, device=dev)

        def behind_busy_gpu_us(fn):
            """Host time of ``fn`` while the GPU still has ~10 ms of work queued (blocking calls wait it out)."""
            _sync(dev)
            dist.barrier()
            for _ in range(8):
                big @ big
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            _sync(dev)
            return 1e6 * dt

        res["busy_matmul_x8_us"] = behind_busy_gpu_us(lambda: [big @ big for _ in range(8)])
        res["busy_all_gather_sync_us"] = behind_busy_gpu_us(lambda: dist.all_gather_into_tensor(out, small))
        res["busy_all_gather_async_us"] = behind_busy_gpu_us(
            lambda: dist.all_gather_into_tensor(out, small, async_op=True))
        res["busy_all_gather_async_wait_us"] = behind_busy_gpu_us(
            lambda: dist.all_gather_into_tensor(out, small, async_op=True).wait())
        res["busy_all_reduce_sync_us"] = behind_busy_gpu_us(lambda: dist.all_reduce(small))
        res["busy_pg_allreduce_wait_us"] = behind_busy_gpu_us(lambda: pg.allreduce([small]).wait())
        res["busy_culmen_fwd_us"] = behind_busy_gpu_us(lambda: mods_probe(x))
        del big
    res["host_add_us"] = host_us(lambda: small.add(1.0))
    if dev.type == "cuda":
        mods["torch"] = nn.SyncBatchNorm(shape[1]).to(dev)
    for who, mod in mods.items():
        res[f"{who}_fwd_us"] = per_call_us(lambda mod=mod: mod(x), 50)
        res[f"{who}_fwd_bwd_us"] = per_call_us(lambda mod=mod: mod(x).backward(dy), 50)
        # Host time alone: enqueue 50 calls without waiting (the GPU runs behind).
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(50):
            mod(x).backward(dy)
        res[f"{who}_host_fwd_bwd_us"] = 1e6 * (time.perf_counter() - t0) / 50
        _sync(dev)
    import cProfile
    import io
    import pstats

    from culmen.ops.batch_norm import launch as bn_launch

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        mods["culmen"](x).backward(dy)
    pr.disable()
    _sync(dev)
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    # Every bound launch of every cached SyncBN plan: did it take the direct path (and if not, why)?
    res["launchers"] = {f"{getattr(la.fn, '__name__', la.fn)}#{i}": dict(direct=la._run is not None, error=la.error)
                        for i, plan in enumerate(bn_launch.PLANS.values())
                        for la in vars(plan).values() if type(la).__name__ == "Launch"}
    tables = [buf.getvalue()]
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda"
                                                      else [])
    for who in ("culmen", "torch"):
        if who not in mods:
            continue
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(10):
                mods[who](x).backward(dy)
            _sync(dev)
        tables.append(f"===== profile: {who} SyncBatchNorm fwd+bwd x10, {shape} bf16 channels_last =====")
        tables.append(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
        if dev.type == "cuda":
            tables.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile.txt"), "w") as f:
            f.write("\n".join(tables))
    return res


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def _env(dev) -> dict[str, Any]:
    import triton

    info = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "device": str(dev)}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    from culmen.bench.runner import _git_commit

    info["commit"], info["dirty"] = _git_commit()
    return info


def _summary(out: dict[str, Any]) -> str:
    lines = [f"culmen.parallel benchmark: {out['env'].get('gpu', out['env']['device'])} x{out['env']['world_size']} "
             f"({out['env']['backend']}), torch {out['env']['torch']}, triton {out['env']['triton']}"]
    for name, r in out["models"].items():
        if "error" in r:
            lines.append(f"  {name}: ERROR {r['error']}")
            continue
        t_ms = r.get("torch_step_s", math.nan) * 1e3
        lines.append(
            f"  {name:7s} step culmen {r['culmen_step_s'] * 1e3:8.2f} ms | torch {t_ms:8.2f} ms"
            f" | speedup {r.get('speedup_vs_torch', math.nan):5.3f}"
            f" | scaling culmen {r['culmen_scaling_efficiency']:.3f}"
            f" torch {r.get('torch_scaling_efficiency', math.nan):.3f} | overlap culmen {r['culmen_overlap']:.2f}"
            f" torch {r.get('torch_overlap', math.nan):.2f} (comm {r['culmen_comm_s'] * 1e3:.2f} ms,"
            f" {r['culmen_buckets']} buckets)")
    for r in out["syncbn"]:
        lines.append(f"  syncbn {'x'.join(map(str, r['shape'])):18s} {r['dtype']:8s} {r['layout']:13s} "
                     f"culmen {r.get('culmen_ms', math.nan):7.3f} ms | torch {r.get('torch_ms', math.nan):7.3f} ms | "
                     f"speedup {r.get('speedup', math.nan):5.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the benchmark on every rank, write JSON on rank 0; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for parallel_bench.json")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU / gloo check)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--bn-steps", type=int, default=None)
    ap.add_argument("--message-size", type=int, default=10_000_000, help="culmen DDP message_size (elements)")
    ap.add_argument("--only", default="gpt2,resnet,syncbn", help="comma-separated parts: gpt2,resnet,syncbn,profile")
    ap.add_argument("--resnet-batch", type=int, default=256, help="ResNet images per GPU (224x224)")
    args = ap.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else 20)
    args.warmup = args.warmup or (2 if args.quick else 5)
    args.bn_steps = args.bn_steps or (3 if args.quick else 30)
    if args.quick and args.message_size == 10_000_000:
        args.message_size = 2000

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=dev if cuda else None)
    parts = set(args.only.split(","))
    out: dict[str, Any] = {"env": _env(dev), "models": {}, "syncbn": [], "args": vars(args)}
    rank = dist.get_rank()
    try:
        if "gpt2" in parts:
            if args.quick:
                cfg = dict(vocab=512, seq=32, d=64, layers=2, heads=4)
                batch = 2
            else:
                cfg = dict(vocab=50304, seq=1024, d=768, layers=12, heads=12)
                batch = 8

            def make_gpt():
                return GPT(**cfg).to(torch.bfloat16)

            def gpt_batch():
                g = torch.Generator(device=dev).manual_seed(rank)
                idx = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), device=dev, generator=g)
                return idx, torch.roll(idx, -1, 1)
            out["models"]["gpt2"] = _model_bench("gpt2", make_gpt, gpt_batch, None, False, dev, args)
            out["models"]["gpt2"].update(config=cfg, batch_per_gpu=batch, dtype="bfloat16 params")
        if "resnet" in parts:
            if args.quick:
                rcfg, batch, res_px = dict(layers=(1, 1), width_mult=0.25, classes=10), 4, 32
            else:
                rcfg, batch, res_px = dict(layers=(3, 4, 6, 3), width_mult=1.0, classes=1000), args.resnet_batch, 224

            def make_resnet():
                return ResNet(**rcfg)

            def resnet_batch():
                g = torch.Generator(device=dev).manual_seed(rank)
                x = torch.randn(batch, 3, res_px, res_px, device=dev, generator=g).contiguous(
                    memory_format=torch.channels_last)
                return x, torch.randint(0, rcfg["classes"], (batch,), device=dev, generator=g)
            amp = torch.bfloat16
            out["models"]["resnet"] = _model_bench("resnet", make_resnet, resnet_batch, amp, True, dev, args)
            out["models"]["resnet"].update(config={k: list(v) if isinstance(v, tuple) else v for k, v in rcfg.items()},
                                           batch_per_gpu=batch, image=res_px, dtype="fp32 params, bf16 autocast, "
                                           "channels_last")
        if "syncbn" in parts:
            out["syncbn"] = _syncbn_bench(dev, args)
        if "profile" in parts:
            out["profile"] = _profile(dev, args)
            if rank == 0:
                print(json.dumps(out["profile"], indent=1))
    finally:
        sp = [r["speedup"] for r in out["syncbn"] if "speedup" in r]
        if sp:
            out["syncbn_summary"] = {"min_speedup": min(sp), "geomean_speedup": math.exp(sum(map(math.log, sp))
                                                                                       / len(sp)), "cases": len(sp)}
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, "parallel_bench.json")
            with open(path, "w") as f:
                json.dump(out, f, indent=2)
            print(_summary(out) if out["models"] or out["syncbn"] else "no results")
            print(f"wrote {path}")
        dist.destroy_process_group()
    return 0
