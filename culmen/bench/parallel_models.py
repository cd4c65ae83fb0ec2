"""``culmen bench model_parallel``: a GPT trained across 2 GPUs with culmen's model parallelism vs PyTorch's.

Every section runs in its own group of ``world`` (2) spawned ranks (``torch.multiprocessing``, one rank per
GPU, NCCL; gloo ranks on CPU for ``--quick`` smoke runs), on one decoder-only GPT (pre-norm ``nn.LayerNorm``
blocks, fused QKV laid out head by head, causal SDPA, tanh-GELU MLP, untied embedding / LM head; ``1.3b``:
d 2048, 24 layers, 16 heads, vocab 32768, seq 2048: 1.34B params) in bf16 (fp32 on CPU). Only the
parallelism changes between the rows of a section; the blocks' other ops are the same code.

* ``tp`` (tensor parallelism over all ranks, batch 8 x 2048 on every rank):
  ``torch_tp``: ``torch.distributed.tensor.parallel`` (``ColwiseParallel`` QKV / fc1 / LM head,
  ``RowwiseParallel`` projections and the embedding, ``loss_parallel`` cross-entropy);
  ``culmen_tp``: culmen's ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding`` /
  ``vocab_parallel_cross_entropy``; ``culmen_tp_sp``: the same with sequence parallelism (norms, residuals
  and the embedding output split along the sequence; the norms' gradients all-reduced over TP each step).
  All use ``torch.optim.AdamW(fused=True)`` (bf16 state). Reported: ``ms`` per step (slowest rank),
  ``tokens_per_s`` (batch tokens / step time: the TP ranks share one batch), ``peak_gib`` (this rank's
  allocation peak above what was allocated before the model), ``act_gib``: memory held by the autograd
  graph at the end of one forward (allocated after forward - before it, no gradients alive), and
  ``fwd_bwd_peak_gib`` (peak of that forward + backward above the same base).
* ``pipeline`` (1F1B, ``world`` stages of ``layers / world`` blocks, 8 microbatches of 2 x 2048):
  culmen's ``forward_backward_pipelining_without_interleaving``. Each stage stamps CUDA events (host
  ``perf_counter`` on CPU) where its forward of a microbatch starts and ends and where its backward starts
  and ends (autograd identity functions at the stage's input and output); ``bubble`` = 1 - busy / total
  per stage, total = the schedule's wall time from a synchronized start, averaged over iterations and
  stages. ``theory`` = (p - 1) / (m + p - 1); ``bubble_ratio`` = bubble / theory.
* ``zero`` (data parallelism, batch 4 x 2048 per GPU): ``fused_adam_1gpu``: rank 0 alone, ``FusedAdam
  (master_weights=True)`` (fp32 masters and moments); ``dfa``: ``DistributedFusedAdam`` on every rank
  (fp32 state sharded, bf16 gradient reduce-scatter and parameter all-gather, ``store_param_remainders``,
  ``overlap_grad_sync`` and ``overlap_param_sync``); ``dfa_hp``: the same on a process group whose NCCL
  streams have high priority; ``fsdp2``: ``fully_shard`` per block and at the root
  with ``reshard_after_forward=False`` (ZeRO-2-like), fp32 sharded params with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``, ``AdamW(fused=True)``. Reported: ``ms``,
  ``opt_gib`` (allocated after the first step and ``zero_grad`` - allocated before the optimizer existed:
  what the optimizer keeps between steps), ``steady_gib`` (everything allocated between steps),
  ``peak_gib``; ``dfa_vs_fsdp2`` = dfa ms / fsdp2 ms, ``opt_mem_ratio`` = dfa opt / fused_adam opt,
  ``scaling`` = fused_adam_1gpu ms / dfa ms (weak scaling: the per-GPU batch is fixed, 1.0 is perfect).

A step is forward + loss, backward, optimizer step, ``zero_grad`` (``set_to_none``); the timing is
``train_step``'s: one first step (its wall time includes compiles), warm-up steps, then ``steps`` steps
back to back with one synchronization at the end.

Run: ``culmen bench model_parallel [--steps N --warmup N --time-limit S --json PATH]`` or
``python -m culmen.bench.parallel_models [--sections tp,pipeline,zero] [--quick]``. The environment
variable ``CULMEN_MODEL_PARALLEL_SECTIONS`` selects sections for the CLI. ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are set in the ranks unless already set.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn as nn

from culmen.bench.parallel_gpt import GPT, SHAPES, GPTShape, _Linears
from culmen.bench.registry import BenchConfig, SuiteResult, register_suite
from culmen.bench.runner import short_error
from culmen.bench.train_step import _release

SECTIONS = ("tp", "pipeline", "zero")
TP_IMPLS = ("torch_tp", "culmen_tp", "culmen_tp_sp")
ZERO_IMPLS = ("fused_adam_1gpu", "dfa", "dfa_hp", "fsdp2")
_SECTION_TIMEOUT_S = 420.0


# ------------------------------------------------------------------------------------------ timing


class _Clock:
    """Timestamps: CUDA events on the current stream (GPU), ``perf_counter`` (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stamps: list[tuple[str, Any]] = []

    def stamp(self, key: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.stamps.append((key, ev))
        else:
            self.stamps.append((key, time.perf_counter()))

    def ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _gib(n: int | None) -> float | None:
    return None if n is None else n / 2 ** 30


def time_training(step: Callable[[], torch.Tensor], device: torch.device, steps: int, warmup: int,
                  base: int) -> dict[str, Any]:
    """``train_step``'s timing of ``step()`` (one training step returning the loss): first step (compiles
    included), ``warmup - 1`` more, then ``steps`` back to back with one sync. ``peak_gib`` is above
    ``base`` bytes; memory figures are None on CPU."""
    cuda = device.type == "cuda"
    _sync(device)
    t0 = time.perf_counter()
    loss = step()
    first_loss = float(loss.detach())
    first_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    _sync(device)
    ms = (time.perf_counter() - t0) / steps * 1e3
    return {"ms": ms, "first_step_s": first_s, "first_loss": first_loss, "loss": float(loss.detach()),
            "peak_gib": _gib(torch.cuda.max_memory_allocated(device) - base) if cuda else None}


def _profile(step: Callable[[], Any], device: torch.device, name: str, steps: int = 3) -> None:
    """With ``CULMEN_BENCH_PROFILE=<dir>``: profile ``steps`` more steps into ``<dir>/<name>.txt`` (ops
    by device time, then by host time) for finding where a step's time goes; otherwise nothing."""
    out_dir = os.environ.get("CULMEN_BENCH_PROFILE")
    if not out_dir or device.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    wall = (time.perf_counter() - t0) / steps * 1e3
    table = prof.key_averages()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
        print(f"{name}: {steps} steps, {wall:.1f} ms/step under the profiler", file=f)
        print(table.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70), file=f)
        print(table.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70), file=f)


def _slowest(ms: float | None, device: torch.device, group: Any = None) -> float | None:
    """The largest ``ms`` over the ranks of ``group`` (a collective: every rank calls it)."""
    t = torch.tensor([ms if ms is not None else -1.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return None if t.item() < 0 else t.item()


def _batch(shape: GPTShape, rows: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab, (rows, shape.seq), generator=g)
    labels = torch.randint(0, shape.vocab, (rows, shape.seq), generator=g)
    return tokens.to(device), labels.to(device)


class _AdamW:
    """``torch.optim.AdamW`` (fused on CUDA); if the fused kernel refuses the params (DTensor support varies
    by torch version) the first step falls back to ``foreach`` and says so in ``note``."""

    def __init__(self, params: list[torch.Tensor], device: torch.device, lr: float = 1e-4) -> None:
        self.params, self.lr, self.fused, self.note = params, lr, device.type == "cuda", None
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=self.fused or None)

    def step(self) -> None:
        try:
            self.opt.step()
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            if not self.fused:
                raise
            self.fused, self.note = False, f"fused AdamW failed ({short_error(exc, 300)}); foreach used"
            self.opt = torch.optim.AdamW(self.params, lr=self.lr, weight_decay=0.0, foreach=True)
            self.opt.step()


class _Optimizers:
    """One :class:`_AdamW` per kind of param: PyTorch TP leaves the norms as plain tensors beside the
    DTensor weights, and torch's multi-tensor AdamW refuses a mix of the two in one call."""

    def __init__(self, params: list[torch.Tensor], device: torch.device) -> None:
        kinds: dict[bool, list[torch.Tensor]] = {}
        for p in params:
            kinds.setdefault(hasattr(p, "device_mesh"), []).append(p)
        self.opts = [_AdamW(ps, device) for ps in kinds.values()]

    @property
    def note(self) -> str | None:
        return "; ".join(o.note for o in self.opts if o.note) or None

    def step(self) -> None:
        for o in self.opts:
            o.step()


# ------------------------------------------------------------------------------------------ sections


def _allreduce_grads(params: list[torch.Tensor], group: Any) -> None:
    """Sum the gradients of ``params`` over ``group`` in one flat all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def _build_tp(impl: str, shape: GPTShape, dtype: torch.dtype, device: torch.device, world: int) -> nn.Module:
    if impl == "torch_tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = GPT(shape, _Linears("plain", dtype, device))
        plan: dict[str, Any] = {"embed": RowwiseParallel(input_layouts=Replicate()),
                                "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(shape.layers):
            plan.update({f"blocks.{i}.qkv": ColwiseParallel(), f"blocks.{i}.proj": RowwiseParallel(),
                         f"blocks.{i}.fc1": ColwiseParallel(), f"blocks.{i}.fc2": RowwiseParallel()})
        return parallelize_module(model, init_device_mesh(device.type, (world,)), plan)
    return GPT(shape, _Linears("culmen", dtype, device, sp=impl == "culmen_tp_sp"))


def _tp_impl(impl: str, shape: GPTShape, dtype: torch.dtype, device: torch.device, world: int,
             opts: dict[str, Any]) -> dict[str, Any]:
    from culmen.transformer import parallel_state as ps

    row: dict[str, Any] = {"impl": impl}
    base = _allocated(device)
    tokens, labels = _batch(shape, shape.tp_batch, device, opts["seed"])
    with contextlib.ExitStack() as stack:
        if impl == "torch_tp":
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())  # both forward and backward of the loss need it
        torch.manual_seed(opts["seed"])  # every implementation starts from the same draws
        model = _build_tp(impl, shape, dtype, device, world)
        sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel_enabled", False)]
        tp_group = ps.get_tensor_model_parallel_group()
        opt = _Optimizers(list(model.parameters()), device)

        def step() -> torch.Tensor:
            loss = model(tokens, labels)
            loss.backward()
            if sp_params:
                _allreduce_grads(sp_params, tp_group)
            opt.step()
            model.zero_grad(set_to_none=True)
            return loss

        row.update(time_training(step, device, opts["steps"], opts["warmup"], base))
        # activation memory: what one forward leaves for backward, with no gradients alive
        _sync(device)
        before = _allocated(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        loss = model(tokens, labels)
        _sync(device)
        after = _allocated(device)
        loss.backward()
        _sync(device)
        if device.type == "cuda":
            row["act_gib"] = _gib(after - before)
            row["fwd_bwd_peak_gib"] = _gib(torch.cuda.max_memory_allocated(device) - before)
        model.zero_grad(set_to_none=True)
        row["note"] = opt.note
    row["ms"] = _slowest(row.get("ms"), device)
    row["tokens_per_s"] = shape.tp_batch * shape.seq / (row["ms"] / 1e3) if row.get("ms") else None
    return row


def run_tp(rank: int, world: int, shape: GPTShape, dtype: torch.dtype, device: torch.device,
           opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Section ``tp`` on this rank; the rows (meaningful on rank 0)."""
    from culmen.transformer import parallel_state as ps
    from culmen.transformer.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(world)
    model_parallel_cuda_manual_seed(opts["seed"])
    rows = []
    for impl in opts.get("tp_impls", TP_IMPLS):
        try:
            row = _tp_impl(impl, shape, dtype, device, world, opts)
        except Exception as exc:  # one failing implementation must not hide the others
            row = {"impl": impl, "error": short_error(exc, 300), "traceback": traceback.format_exc()[-2000:]}
        _release(device)
        dist.barrier()
        rows.append(row)
    ps.destroy_model_parallel()
    return rows


def _bubble(clock: _Clock) -> tuple[float, float]:
    """(bubble fraction, total ms) of one schedule run from ``clock``'s stamps (start, f0/f1, b0/b1, end)."""
    stamps = clock.stamps
    start, end = stamps[0][1], stamps[-1][1]
    busy, open_at = 0.0, {}
    for key, t in stamps[1:-1]:
        if key in ("f0", "b0"):
            open_at[key[0]] = t
        else:
            busy += clock.ms(open_at.pop(key[0]), t)
    total = clock.ms(start, end)
    return 1.0 - busy / total, total


def stage_layers(shape: GPTShape, stages: int) -> list[int]:
    """Blocks per pipeline stage balancing the work: the last stage also runs the LM head and the loss,
    costed in blocks by their matmul FLOPs per token (``2 d V`` against a block's ``24 d^2 + 4 s d``)
    plus a tenth for the fp32 softmax; the cut minimises the slowest stage (1F1B's bubble assumes equal
    stages)."""
    if stages < 1 or shape.layers < stages:
        raise ValueError(f"stages must be in [1, layers={shape.layers}], got {stages}")
    block = 24 * shape.d ** 2 + 4 * shape.seq * shape.d
    head = 2 * shape.d * shape.vocab / block + 0.1
    best: tuple[tuple[float, float], list[int]] | None = None
    for last in range(1, shape.layers - stages + 2):
        rest, n = shape.layers - last, stages - 1
        counts = [rest // n + (i < rest % n) for i in range(n)] + [last] if n else [last]
        if (n and min(counts[:-1]) < 1) or (not n and last != shape.layers):
            continue
        costs = counts[:-1] + [last + head]
        key = (max(costs), max(costs) - min(costs))  # the slowest stage, then the spread
        if best is None or key < best[0]:
            best = (key, counts)
    assert best is not None
    return best[1]


def run_pipeline(rank: int, world: int, shape: GPTShape, dtype: torch.dtype, device: torch.device,
                 opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Section ``pipeline``: 1F1B over ``world`` stages; per-stage idle fraction from timestamps."""
    from culmen.transformer import parallel_state as ps
    from culmen.transformer.pipeline_parallel import get_forward_backward_func
    from culmen.transformer.pipeline_parallel import utils as pp_utils

    m, mb = shape.microbatches, shape.micro
    row: dict[str, Any] = {"impl": "culmen_1f1b", "stages": world, "microbatches": m, "micro_batch": mb,
                           "theory": (world - 1) / (m + world - 1)}
    try:
        ps.initialize_model_parallel(1, world)
        pp_utils._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
        pp_utils.setup_microbatch_calculator(rank, None, m * mb, mb, 1)
        counts = stage_layers(shape, world)
        row["stage_layers"] = counts
        first = sum(counts[:rank])
        model = GPT(shape, _Linears("plain", dtype, device), range(first, first + counts[rank]),
                    pre=rank == 0, post=rank == world - 1)
        schedule = get_forward_backward_func(None, world)
        batch = list(_batch(shape, m * mb, device, opts["seed"]))

        def fwd_step(mbatch, mdl):
            out = mdl(mbatch[0], mbatch[1])
            return out, lambda o: (o, {"loss": o.detach()})

        bubbles, totals = [], []
        for it in range(opts["warmup"] + opts["steps"]):
            clock = _Clock(device)
            model.clock = clock
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            clock.stamp("start")
            schedule(fwd_step, batch, model, forward_only=False, tensor_shape=(shape.seq, mb, shape.d), dtype=dtype)
            clock.stamp("end")
            _sync(device)
            if it == 0:
                row["first_step_s"] = time.perf_counter() - t0
            if it >= opts["warmup"]:
                b, total = _bubble(clock)
                bubbles.append(b)
                totals.append(total)
            model.zero_grad(set_to_none=True)
        mine = {"bubble": sum(bubbles) / len(bubbles), "ms": sum(totals) / len(totals)}
    except Exception as exc:
        mine = {"error": short_error(exc, 300), "traceback": traceback.format_exc()[-2000:]}
    per_stage: list[Any] = [None] * world
    dist.all_gather_object(per_stage, mine)
    errors = [s["error"] for s in per_stage if "error" in s]
    if errors:
        row["error"] = errors[0]
        row["traceback"] = next(s["traceback"] for s in per_stage if "error" in s)
    else:
        row["stage_bubble"] = [s["bubble"] for s in per_stage]
        row["bubble"] = sum(row["stage_bubble"]) / world
        row["ms"] = max(s["ms"] for s in per_stage)
        row["bubble_ratio"] = row["bubble"] / row["theory"]
        row["tokens_per_s"] = m * mb * shape.seq / (row["ms"] / 1e3)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return [row]


def _zero_impl(impl: str, rank: int, world: int, shape: GPTShape, dtype: torch.dtype, device: torch.device,
               opts: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"impl": impl, "gpus": 1 if impl == "fused_adam_1gpu" else world}
    if impl == "fused_adam_1gpu" and rank != 0:
        return row
    cuda = device.type == "cuda"
    base = _allocated(device)
    tokens, labels = _batch(shape, shape.zero_batch, device, opts["seed"] + rank)
    torch.manual_seed(opts["seed"])  # the same initial weights on every rank and for every implementation
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = GPT(shape, _Linears("plain", torch.float32, device))
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype != torch.float32 else None
        kw = {"reshard_after_forward": False, **({"mp_policy": mp} if mp is not None else {})}
        for blk in model.blocks:
            fully_shard(blk, **kw)
        fully_shard(model, **kw)
    else:
        # built in fp32 and cast, as FSDP2's is: a bf16 init draws different numbers from the same seed
        model = GPT(shape, _Linears("plain", torch.float32, device)).to(dtype)
    _sync(device)
    before_opt = _allocated(device)
    note = None
    if impl == "fused_adam_1gpu":
        from culmen.optimizers import FusedAdam

        opt: Any = FusedAdam(model.parameters(), lr=1e-4, master_weights=dtype != torch.float32)
    elif impl in ("dfa", "dfa_hp"):
        from culmen.contrib.optimizers import DistributedFusedAdam

        half = dtype != torch.float32
        opt = DistributedFusedAdam(model.parameters(), lr=1e-4, device=device, dtype=torch.float32,
                                   grad_sync_dtype=dtype, param_sync_dtype=dtype, store_param_remainders=half,
                                   overlap_grad_sync=True, overlap_param_sync=True, contiguous_param_buffer=True,
                                   process_group=_high_priority_group(world) if impl == "dfa_hp" else None)
    else:
        opt = _AdamW(list(model.parameters()), device)

    def step() -> torch.Tensor:
        loss = model(tokens, labels)
        loss.backward()
        opt.step()
        if impl.startswith("dfa"):
            opt.zero_grad()
        else:
            model.zero_grad(set_to_none=True)
        return loss

    step()
    _sync(device)
    row["opt_gib"] = _gib(_allocated(device) - before_opt) if cuda else None
    row["steady_gib"] = _gib(_allocated(device) - base) if cuda else None
    row.update(time_training(step, device, opts["steps"], opts["warmup"], base))
    _profile(step, device, f"zero-{impl}-rank{rank}")
    row["note"] = getattr(opt, "note", note)
    row["tokens_per_s"] = row["gpus"] * shape.zero_batch * shape.seq / (row["ms"] / 1e3)
    return row


def _high_priority_group(world: int) -> Any:
    """A process group over every rank whose NCCL streams have high priority (so the collectives' blocks
    are scheduled ahead of the compute kernels they overlap); the default group elsewhere."""
    if dist.get_backend() != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return dist.new_group(list(range(world)), backend="nccl", pg_options=options)


def run_zero(rank: int, world: int, shape: GPTShape, dtype: torch.dtype, device: torch.device,
             opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Section ``zero``: FusedAdam on one GPU, DistributedFusedAdam and FSDP2 on ``world``."""
    rows = []
    for impl in opts.get("zero_impls", ZERO_IMPLS):
        try:
            row = _zero_impl(impl, rank, world, shape, dtype, device, opts)
        except Exception as exc:
            row = {"impl": impl, "error": short_error(exc, 300), "traceback": traceback.format_exc()[-2000:]}
        _release(device)
        if impl != "fused_adam_1gpu":
            row["ms"] = _slowest(row.get("ms"), device)
        dist.barrier()
        rows.append(row)
    return rows


_RUNNERS = {"tp": run_tp, "pipeline": run_pipeline, "zero": run_zero}


# ------------------------------------------------------------------------------------------ spawning


def _watch_parent(ppid: int) -> None:
    # a rank whose launcher died (killed by a timeout) must not keep holding its GPU
    while True:
        time.sleep(2.0)
        if os.getppid() != ppid:
            os._exit(3)


def _rank_main(rank: int, world: int, port: int, section: str, opts: dict[str, Any], out_path: str,
               ppid: int) -> None:
    threading.Thread(target=_watch_parent, args=(ppid,), daemon=True).start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    cuda = opts["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    kw = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=opts["pg_timeout"]), **kw)
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        rows = _RUNNERS[section](rank, world, SHAPES[opts["shape"]], dtype, device, opts)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_section(section: str, world: int, opts: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Run ``section`` on ``world`` spawned ranks; rank 0's rows, or one row with the error."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        ctx = mp.start_processes(_rank_main, args=(world, _free_port(), section, opts, out, os.getpid()),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"section {section} did not finish in {timeout:.0f} s")
        except Exception as exc:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            return [{"impl": section, "error": short_error(exc, 300), "traceback": str(exc)[-3000:]}]
        with open(out) as f:
            return json.load(f)


# ------------------------------------------------------------------------------------------ report


def _fmt(v: Any, spec: str, width: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-".rjust(width)
    return format(v, spec).rjust(width)


def _summarize(section: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Section-level ratios (the issue's goals) from its rows."""
    by = {r["impl"]: r for r in rows}

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = by.get(a, {}).get(key), by.get(b, {}).get(key)
        return x / y if x and y else None

    if section == "tp":
        return {"speedup_vs_torch_tp": ratio("torch_tp", "culmen_tp", "ms"),
                "sp_speedup_vs_torch_tp": ratio("torch_tp", "culmen_tp_sp", "ms"),
                "sp_act_saving": (1 - r) if (r := ratio("culmen_tp_sp", "culmen_tp", "act_gib")) else None}
    if section == "zero":
        return {"dfa_vs_fsdp2": ratio("dfa", "fsdp2", "ms"), "dfa_hp_vs_fsdp2": ratio("dfa_hp", "fsdp2", "ms"),
                "opt_mem_ratio": ratio("dfa", "fused_adam_1gpu", "opt_gib"),
                "scaling": ratio("fused_adam_1gpu", "dfa", "ms")}
    r = rows[0]
    return {"bubble": r.get("bubble"), "theory": r.get("theory"), "bubble_ratio": r.get("bubble_ratio")}


def _print_rows(section: str, rows: list[dict[str, Any]], summary: dict[str, Any], out: TextIO) -> None:
    print(f"-- {section}", file=out)
    print(f"{'impl':<16} {'ms':>9} {'tok/s':>10} {'peak GiB':>9} {'act GiB':>8} {'opt GiB':>8} {'steady':>7} "
          f"{'bubble':>7} {'loss':>8} {'1st s':>6}", file=out)
    for r in rows:
        print(f"{r['impl']:<16} {_fmt(r.get('ms'), '.2f', 9)} {_fmt(r.get('tokens_per_s'), '.0f', 10)} "
              f"{_fmt(r.get('peak_gib'), '.2f', 9)} {_fmt(r.get('act_gib'), '.2f', 8)} "
              f"{_fmt(r.get('opt_gib'), '.2f', 8)} {_fmt(r.get('steady_gib'), '.2f', 7)} "
              f"{_fmt(r.get('bubble'), '.3f', 7)} {_fmt(r.get('loss'), '.3f', 8)} "
              f"{_fmt(r.get('first_step_s'), '.1f', 6)}", file=out)
        for key in ("note", "error"):
            if r.get(key):
                print(f"{'':<17}{key}: {r[key]}", file=out)
        if r.get("stage_bubble"):
            print(f"{'':<17}per-stage bubble {[round(b, 4) for b in r['stage_bubble']]}, theory "
                  f"(p-1)/(m+p-1) = {r['theory']:.4f}", file=out)
    print("   " + "  ".join(f"{k}={_fmt(v, '.3f', 0).strip()}" for k, v in summary.items()), file=out)
    out.flush()


def _records(section: str, label: str, rows: list[dict[str, Any]], summary: dict[str, Any]) -> list[Any]:
    from culmen.bench.runner import Record

    recs = []
    ours = {"tp": "culmen_tp", "pipeline": "culmen_1f1b", "zero": "dfa"}[section]
    peer = {"tp": "torch_tp", "zero": "fsdp2"}.get(section)
    by = {r["impl"]: r for r in rows}
    for r in rows:
        provider = "culmen" if r["impl"] == ours else r["impl"]
        rec = Record("model_parallel", "end_to_end", f"{section} {label}", provider, ms=r.get("ms"),
                     error=r.get("error"))
        if provider == "culmen" and peer and r.get("ms") and by.get(peer, {}).get("ms"):
            rec.speedup, rec.best_peer = by[peer]["ms"] / r["ms"], peer
        elif peer and r["impl"] == peer and r.get("ms") and by.get(ours, {}).get("ms"):
            rec.speedup = r["ms"] / by[ours]["ms"]
        recs.append(rec)
    return recs


def _options(cfg: BenchConfig) -> tuple[dict[str, Any], tuple[str, ...]]:
    o = cfg.options
    cuda = cfg.device.type == "cuda"
    small = cfg.quick or not cuda
    opts = {"device": cfg.device.type, "shape": o.get("parallel_shape") or ("tiny" if small else "1.3b"),
            "steps": int(o.get("steps") or (2 if small else 10)), "warmup": int(o.get("warmup") or (2 if small else 3)),
            "seed": int(o.get("seed") or 0), "pg_timeout": float(o.get("pg_timeout") or (60 if small else 180)),
            "world": int(o.get("world") or 2)}
    if opts["shape"] not in SHAPES:
        raise ValueError(f"parallel_shape must be one of {tuple(SHAPES)}, got {opts['shape']!r}")
    if opts["steps"] < 1 or opts["warmup"] < 1:
        raise ValueError(f"steps and warmup must be >= 1, got {opts['steps']} and {opts['warmup']}")
    names = o.get("parallel_sections") or os.environ.get("CULMEN_MODEL_PARALLEL_SECTIONS") or ",".join(SECTIONS)
    sections = tuple(s for s in (names.split(",") if isinstance(names, str) else names) if s)
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        raise ValueError(f"model_parallel sections must be among {SECTIONS}, got {list(sections)}")
    return opts, sections


@register_suite("model_parallel", "end_to_end")
def bench_model_parallel(cfg: BenchConfig, out: TextIO) -> Iterator[SuiteResult]:
    """GPT-1.3B on 2 GPUs: culmen TP/SP vs torch TP, 1F1B bubble, DistributedFusedAdam vs FSDP2 and FusedAdam."""
    opts, sections = _options(cfg)
    world, shape = opts["world"], SHAPES[opts["shape"]]
    label = f"gpt{shape.name} x{world} {'bf16' if opts['device'] == 'cuda' else 'fp32'}"
    print(f"GPT {shape.name} ({shape.params / 1e9:.2f}B params: d {shape.d}, {shape.layers} layers, "
          f"{shape.heads} heads, vocab {shape.vocab}, seq {shape.seq}) on {world} ranks "
          f"({'NCCL' if opts['device'] == 'cuda' else 'gloo'}); "
          f"steps={opts['steps']} after warmup={opts['warmup']}", file=out)
    start = time.perf_counter()
    limit = cfg.options.get("time_limit")
    have = torch.cuda.device_count() if opts["device"] == "cuda" else world
    if opts["device"] == "cuda":
        torch.cuda.empty_cache()  # the ranks need the memory this process cached
    for section in sections:
        detail: dict[str, Any] = {"section": section, "shape": asdict(shape), "world": world, **opts}
        if have < world:
            rows = [{"impl": section, "error": f"skipped: needs {world} GPUs, found {have}"}]
        elif limit is not None and time.perf_counter() - start > float(limit):
            rows = [{"impl": section, "error": f"skipped: time limit {float(limit):.0f} s reached"}]
        else:
            rows = spawn_section(section, world, opts, float(cfg.options.get("section_timeout") or _SECTION_TIMEOUT_S))
        summary = _summarize(section, rows)
        _print_rows(section, rows, summary, out)
        detail.update(rows=rows, summary=summary)
        yield SuiteResult(_records(section, label, rows, summary), detail)


def main(argv: list[str] | None = None) -> int:
    """``python -m culmen.bench.parallel_models``: this suite alone (same output as ``culmen bench model_parallel``)."""
    from culmen.bench.runner import run_benchmarks

    p = argparse.ArgumentParser(prog="python -m culmen.bench.parallel_models", description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda (NCCL, one rank per GPU) or cpu (gloo); default cuda if any")
    p.add_argument("--quick", action="store_true", help="tiny GPT (seconds on CPU)")
    p.add_argument("--sections", default=None, help=f"comma-separated from {','.join(SECTIONS)} (default: all)")
    p.add_argument("--steps", type=int, help="timed steps / schedule runs (default 10; 2 when tiny)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default 3; 2 when tiny)")
    p.add_argument("--shape", choices=tuple(SHAPES), help="model shape (default 1.3b on CUDA, tiny otherwise)")
    p.add_argument("--time-limit", type=float, metavar="S", help="skip sections that would start after S seconds")
    p.add_argument("--json", metavar="PATH", help="write records and rows as JSON")
    args = p.parse_args(argv)
    options = {k: v for k, v in (("parallel_sections", args.sections), ("steps", args.steps), ("warmup", args.warmup),
                                 ("parallel_shape", args.shape), ("time_limit", args.time_limit)) if v is not None}
    try:
        run_benchmarks(["model_parallel"], device=args.device, quick=args.quick, json_path=args.json, options=options)
    except ValueError as exc:
        print(f"model_parallel: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
