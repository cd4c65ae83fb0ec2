"""``culmen bench train_step``: decoder LMs trained with culmen's blocks against PyTorch's.

For each (model style, size, mode) the same decoder is built twice from one config
(``culmen.bench.models``): once on PyTorch's blocks (``nn.RMSNorm`` / ``nn.LayerNorm``, rotary in
PyTorch, SDPA, ``silu * mul`` / GELU, ``F.cross_entropy`` on fp32 logits, ``AdamW(fused=True)``) and once
on culmen's public APIs (fused add + norm, ``apply_rotary_emb_qkv_``, ``flash_attn_func``, ``swiglu`` /
``fused_mlp_func``, fused linear cross-entropy, ``FusedAdam``). Both start from the same weights and
train on the same token batch (one fixed batch, so the loss falls) with the same AdamW
hyper-parameters, in one process, one model at a time (so that each peak-memory figure is its own).
Params are in the benchmark dtype (bf16 on CUDA, fp32 on CPU) and the optimizers update them in place.
Mode ``eager`` runs the model as is; ``compile`` wraps its forward + loss in ``torch.compile`` (default
mode; ``compile_scope`` ``model``: one graph for the whole forward; ``block``: each block and the loss
head separately, which keeps compile time flat in depth); the optimizer step stays eager in both.

A step is ``loss = model(tokens, labels); loss.backward(); opt.step(); model.zero_grad(set_to_none=True)``.
Per model the run is: one first step (its wall time, ``first_step_s``, holds ``torch.compile`` and
Triton JIT compiles), ``warmup - 1`` more steps, the peak-memory counter reset, ``host_steps`` steps for
host time, then ``steps`` timed steps. What is reported:

* ``ms``: wall-clock ms per step = the wall time of ``steps`` back-to-back steps, synchronized once at
  the end, divided by ``steps``: what a training loop sees. ``speedup`` = torch ms / culmen ms.
* ``tokens_per_s`` = batch * seq / (ms / 1000).
* ``peak_gib``: ``torch.cuda.max_memory_allocated`` over the host and timed steps, minus what was
  allocated before the model was built (the token batch): weights, gradients, optimizer state and
  activations. ``opt_state_gib`` shows the optimizer's share (FusedAdam keeps fp32 moments for 16-bit
  params; ``AdamW`` keeps them in the param dtype). ``None`` on CPU.
* ``first_loss`` / ``loss``: the loss of the first step and of the last timed step (after
  ``warmup + host_steps + steps`` updates), for both models; ``loss_diff`` = culmen - torch.
* ``host_ms``: host (CPU) time per step, measured by enqueueing: each of the three phases (forward +
  loss, ``backward()``, optimizer step + ``zero_grad``) starts on a drained GPU and is timed with
  ``perf_counter`` from its first call until its last kernel is enqueued (``backward()`` returns when
  the autograd engine has enqueued everything); a ``synchronize`` separates the phases and is not
  counted. The host only ever waits for the GPU when the code itself syncs (that counts: it costs
  users the same) or when it runs more than a CUDA stream's launch queue (~1000 pending launches)
  ahead of a busy GPU. Against the latter, eager mode also drains the GPU at every block boundary
  (a forward pre-hook per block and a hook on each block's input gradient) and subtracts the time
  spent in those hooks, so at most one block's launches are ever pending; compiled graphs (far fewer
  launches, and a syncing hook would break them) are measured by phase only. ``host_phases_ms`` gives
  the three medians over ``host_steps`` steps. ``host_ms`` close to ``ms`` means the step is
  host-bound. On CPU everything is host time.

Run alone: ``python -m culmen.bench.train_step [--sizes d512,d768] [--modes eager] ... [--json PATH]``;
through the CLI: ``culmen bench train_step [same options]``. ``--quick`` (and CPU by default) runs a
tiny model (d64, 2 layers, seq 32, batch 2, vocab 256; fp32 on CPU) in seconds; on CPU culmen's ops take
their PyTorch reference paths, so this checks the wiring, not speed.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch

from culmen.bench.models import (
    IMPLS,
    SIZES,
    STYLES,
    ModelConfig,
    build_model,
    build_optimizer,
    compile_model,
    make_batch,
    model_config,
    with_overrides,
)
from culmen.bench.registry import BenchConfig, SuiteResult, register_suite
from culmen.bench.runner import short_error

MODES = ("eager", "compile")
COMPILE_SCOPES = ("model", "block")
FULL_SIZES = ("d512", "d768", "d2048", "1b")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class TrainOptionsError(ValueError):
    """An invalid ``train_step`` option (the CLI reports it and exits with status 2)."""


@dataclass
class TrainOptions:
    """What ``train_step`` runs; ``from_config`` fills the defaults for the device and ``--quick``."""

    models: tuple[str, ...] = STYLES
    sizes: tuple[str, ...] = FULL_SIZES
    modes: tuple[str, ...] = MODES
    steps: int = 10
    warmup: int = 3
    host_steps: int = 3
    compile_scope: str = "model"
    dtype: str = "bf16"
    lr: float = 1e-3
    seed: int = 0
    time_limit: float | None = None
    """Seconds; cases not started by then are reported as skipped (the JSON keeps what ran)."""
    impls: tuple[str, ...] = IMPLS
    batch: int | None = None
    seq: int | None = None

    @classmethod
    def from_config(cls, cfg: BenchConfig) -> TrainOptions:
        opts = dict(cfg.options)
        cuda = cfg.device.type == "cuda"
        small = cfg.quick or not cuda
        base = cls(sizes=("tiny",) if small else FULL_SIZES, modes=MODES if cuda else ("eager",),
                   steps=3 if small else 10, warmup=2 if small else 3, host_steps=2 if small else 3,
                   dtype="bf16" if cuda else "fp32")
        kw: dict[str, Any] = {}
        for key in ("models", "sizes", "modes", "impls"):
            v = opts.get(key)
            if v:
                kw[key] = tuple(v.split(",")) if isinstance(v, str) else tuple(v)
        for key in ("steps", "warmup", "host_steps", "compile_scope", "dtype", "lr", "seed", "time_limit", "batch",
                    "seq"):
            if opts.get(key) is not None:
                kw[key] = opts[key]
        out = base.__class__(**{**asdict(base), **kw})
        out.validate()
        return out

    def validate(self) -> None:
        for name, values, allowed in (("models", self.models, STYLES), ("sizes", self.sizes, SIZES),
                                      ("modes", self.modes, MODES), ("impls", self.impls, IMPLS)):
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise TrainOptionsError(f"train_step {name} must be among {allowed}, got {list(values)}")
        if self.compile_scope not in COMPILE_SCOPES:
            raise TrainOptionsError(f"compile_scope must be one of {COMPILE_SCOPES}, got {self.compile_scope!r}")
        if self.dtype not in _DTYPES:
            raise TrainOptionsError(f"dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}")
        if self.steps < 1 or self.warmup < 1 or self.host_steps < 0:
            raise TrainOptionsError("train_step steps and warmup must be >= 1, host_steps >= 0")


@dataclass
class ModelRun:
    """One model's measurements in one case."""

    impl: str
    ms: float | None = None
    tokens_per_s: float | None = None
    peak_gib: float | None = None
    opt_state_gib: float | None = None
    first_loss: float | None = None
    loss: float | None = None
    host_ms: float | None = None
    host_phases_ms: dict[str, float] = field(default_factory=dict)
    first_step_s: float | None = None
    warmup_s: float | None = None
    params: int | None = None
    error: str | None = None
    base_bytes: int = 0
    """Memory allocated before the model was built (not a result: ``peak_gib`` is counted above it)."""


# ------------------------------------------------------------------------------------------ timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class _BlockDrain:
    """While installed, drains the GPU before every block's forward and after every block's backward
    (a hook on the block's input gradient) and adds up the seconds spent in these hooks, so that the
    host-time steps never let a long phase fill the stream's launch queue (eager mode only: a hook
    that syncs would break a compiled graph)."""

    def __init__(self, layers: Iterable[torch.nn.Module], device: torch.device) -> None:
        self.device = device
        self.spent = 0.0
        self.handles = [layer.register_forward_pre_hook(self._before_block) for layer in layers]

    def _drain(self) -> None:
        t = time.perf_counter()
        torch.cuda.synchronize(self.device)
        self.spent += time.perf_counter() - t

    def _before_block(self, module: torch.nn.Module, args: tuple) -> None:
        t = time.perf_counter()
        torch.cuda.synchronize(self.device)
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(self._after_block_backward)
        self.spent += time.perf_counter() - t

    def _after_block_backward(self, grad: torch.Tensor) -> None:
        self._drain()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def run_model(cfg: ModelConfig, impl: str, mode: str, opts: TrainOptions, device: torch.device,
              tokens: torch.Tensor, labels: torch.Tensor) -> ModelRun:
    """Build, (compile,) train and measure one model; see the module docstring for each number. A failure
    (kernel error, OOM, compile error) is reported in ``error``, with what was measured before it."""
    res = ModelRun(impl)
    _release(device)
    if mode == "compile":
        torch._dynamo.reset()
    try:
        _train(res, cfg, impl, mode, opts, device, tokens, labels)
    except Exception as exc:
        res.error = short_error(exc, 200)
        if os.environ.get("CULMEN_BENCH_TRACEBACK"):
            traceback.print_exc()
    finally:
        if mode == "compile":
            torch._dynamo.reset()
        _release(device)
    return res


def _train(res: ModelRun, cfg: ModelConfig, impl: str, mode: str, opts: TrainOptions, device: torch.device,
           tokens: torch.Tensor, labels: torch.Tensor) -> None:
    res.base_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    model = build_model(cfg, impl, device, _DTYPES[opts.dtype], opts.seed)
    res.params = sum(p.numel() for p in model.parameters())
    opt = build_optimizer(model, impl, lr=opts.lr)
    fn = compile_model(model, opts.compile_scope) if mode == "compile" else model

    measure_training(res, lambda: fn(tokens, labels), opt, model, model.layers, device, opts, cfg.tokens,
                     drain_blocks=mode == "eager")


def measure_training(res: ModelRun, forward: Callable[[], torch.Tensor], opt: torch.optim.Optimizer,
                     model: torch.nn.Module, layers: Iterable[torch.nn.Module], device: torch.device,
                     opts: TrainOptions, tokens: int, drain_blocks: bool = True) -> None:
    """Train ``model`` with ``forward`` (returns the scalar loss) and ``opt`` and fill ``res``'s first-step,
    host, wall, loss and memory figures as the module docstring defines them. ``layers`` are the blocks
    the host-time steps drain the GPU at (``drain_blocks=False``, e.g. for compiled graphs: phases only)."""
    cuda = device.type == "cuda"
    base = res.base_bytes

    def update():
        opt.step()
        model.zero_grad(set_to_none=True)

    def step():
        out = forward()
        out.backward()
        update()
        return out

    _sync(device)
    t0 = time.perf_counter()
    loss = step()
    res.first_loss = float(loss.detach())  # syncs
    res.first_step_s = time.perf_counter() - t0
    for _ in range(opts.warmup - 1):
        loss = step()
    _sync(device)
    res.warmup_s = time.perf_counter() - t0
    if cuda:
        res.opt_state_gib = _tensor_bytes(opt.state_dict()["state"]) / 2**30
        torch.cuda.reset_peak_memory_stats(device)

    # Host time: each phase starts on a drained GPU and ends when its last kernel is enqueued; in eager
    # mode the GPU is also drained at every block boundary (time spent draining not counted).
    drain = _BlockDrain(layers, device) if cuda and drain_blocks and opts.host_steps else None
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    try:
        for _ in range(opts.host_steps):
            _sync(device)
            spent = drain.spent if drain else 0.0
            t0 = time.perf_counter()
            loss = forward()
            t1 = time.perf_counter()
            fwd_drain = (drain.spent - spent) if drain else 0.0
            _sync(device)
            spent = drain.spent if drain else 0.0
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            bwd_drain = (drain.spent - spent) if drain else 0.0
            _sync(device)
            t4 = time.perf_counter()
            update()
            t5 = time.perf_counter()
            _sync(device)
            for k, v in (("forward", t1 - t0 - fwd_drain), ("backward", t3 - t2 - bwd_drain), ("optimizer", t5 - t4)):
                phases[k].append(v * 1e3)
    finally:
        if drain is not None:
            drain.remove()
    if opts.host_steps:
        res.host_phases_ms = {k: statistics.median(v) for k, v in phases.items()}
        res.host_ms = sum(res.host_phases_ms.values())

    # Wall time: back-to-back steps, one sync at the end.
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(opts.steps):
        loss = step()
    _sync(device)
    res.ms = (time.perf_counter() - t0) / opts.steps * 1e3
    res.loss = float(loss.detach())
    res.tokens_per_s = tokens / (res.ms / 1e3)
    if cuda:
        res.peak_gib = (torch.cuda.max_memory_allocated(device) - base) / 2**30


# ------------------------------------------------------------------------------------------- table


_COLS = (f"{'model':<6} {'size':<6} {'params':>7} {'mode':<8} {'torch ms':>9} {'culmen ms':>9} {'speedup':>7} "
         f"{'torch tok/s':>11} {'culmen tok/s':>12} {'torch GiB':>9} {'culmen GiB':>10} {'torch loss':>10} "
         f"{'culmen loss':>11} {'diff':>8} {'torch host':>10} {'culmen host':>11} {'1st step s':>11}")


def _f(v: float | None, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        width = spec.split(".")[0].lstrip("+-")
        return "-".rjust(int(width)) if width.isdigit() else "-"
    return format(v, spec)


def _k(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v < 1e3 else f"{v / 1e3:.1f}k" if v < 1e6 else f"{v / 1e6:.2f}M"


def _params(n: int | None) -> str:
    return "-" if not n else (f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}k")


def format_row(row: dict[str, Any]) -> str:
    t, c = row["torch"], row["culmen"]
    first = f"{_f(t.get('first_step_s'), '.1f')}/{_f(c.get('first_step_s'), '.1f')}"
    line = (f"{row['model']:<6} {row['size']:<6} {_params(row.get('params')):>7} {row['mode']:<8} "
            f"{_f(t.get('ms'), '9.2f')} {_f(c.get('ms'), '9.2f')} "
            f"{_f(row.get('speedup'), '6.2f') + 'x' if row.get('speedup') else '-':>7} "
            f"{_k(t.get('tokens_per_s')):>11} {_k(c.get('tokens_per_s')):>12} {_f(t.get('peak_gib'), '9.2f')} "
            f"{_f(c.get('peak_gib'), '10.2f')} {_f(t.get('loss'), '10.4f')} {_f(c.get('loss'), '11.4f')} "
            f"{_f(row.get('loss_diff'), '+8.4f')} {_f(t.get('host_ms'), '10.2f')} {_f(c.get('host_ms'), '11.2f')} "
            f"{first:>11}")
    for impl in ("torch", "culmen"):
        if row[impl].get("error"):
            line += f"\n{'':<30}{impl} failed: {row[impl]['error']}"
    if row.get("skipped"):
        line = f"{row['model']:<6} {row['size']:<6} {'':>7} {row['mode']:<8} skipped: {row['skipped']}"
    return line


def _records(row: dict[str, Any]) -> list[Any]:
    from culmen.bench.runner import Record

    case = f"{row['model']} {row['size']} {row['mode']}"
    recs = []
    t, c = row["torch"], row["culmen"]
    for impl, r in (("culmen", c), ("torch", t)):
        rec = Record("train_step", "end_to_end", case, impl, ms=r.get("ms"), error=r.get("error") or row.get("skipped"),
                     host_us=None if r.get("host_ms") is None else r["host_ms"] * 1e3)
        if rec.ms and t.get("ms") and impl == "culmen":
            rec.speedup, rec.best_peer = t["ms"] / rec.ms, "torch"
        elif rec.ms and c.get("ms") and impl == "torch":
            rec.speedup = rec.ms / c["ms"]
        if rec.host_us and t.get("host_ms"):
            rec.host_ratio = rec.host_us / (t["host_ms"] * 1e3)
        if r.get("loss") is not None and t.get("loss") is not None:
            rec.diffs = {"loss": abs(r["loss"] - t["loss"])}
            rec.max_abs_diff = rec.diffs["loss"]
        recs.append(rec)
    return recs


# --------------------------------------------------------------------------------------------- run


def run_cases(opts: TrainOptions, device: torch.device, out: TextIO) -> Iterator[dict[str, Any]]:
    """Run every (size, model, mode) of ``opts``; yield one row dict per case (printed as it finishes)."""
    start = time.perf_counter()
    print(f"steps={opts.steps} (timed) after warmup={opts.warmup} + host_steps={opts.host_steps}; dtype {opts.dtype}; "
          f"compile scope {opts.compile_scope}; AdamW lr {opts.lr} on both; one fixed batch per case", file=out)
    print("ms: wall ms/step (N steps, one sync); GiB: peak allocated above the batch; loss after all steps "
          "(diff = culmen - torch); host: host ms/step (enqueue time); 1st step s: torch/culmen, compiles included",
          file=out)
    print(_COLS, file=out)
    out.flush()
    for size in opts.sizes:
        for style in opts.models:
            for mode in opts.modes:
                cfg = with_overrides(model_config(style, size), batch=opts.batch, seq=opts.seq)
                row: dict[str, Any] = {"model": style, "size": size, "mode": mode, "d": cfg.d, "layers": cfg.layers,
                                       "heads": cfg.heads, "ffn": cfg.ffn, "vocab": cfg.vocab, "seq": cfg.seq,
                                       "batch": cfg.batch, "dtype": opts.dtype, "steps": opts.steps,
                                       "warmup": opts.warmup, "host_steps": opts.host_steps,
                                       "compile_scope": opts.compile_scope if mode == "compile" else None}
                elapsed = time.perf_counter() - start
                if opts.time_limit is not None and elapsed > opts.time_limit:
                    row["skipped"] = f"time limit {opts.time_limit:.0f} s reached ({elapsed:.0f} s)"
                    row["torch"] = row["culmen"] = {}
                else:
                    tokens, labels = make_batch(cfg, device, opts.seed)
                    runs = {impl: asdict(run_model(cfg, impl, mode, opts, device, tokens, labels))
                            for impl in opts.impls}
                    del tokens, labels
                    for impl in IMPLS:
                        row[impl] = runs.get(impl, {"impl": impl, "error": "not run"})
                    t, c = row["torch"], row["culmen"]
                    row["params"] = t.get("params") or c.get("params")
                    row["speedup"] = t["ms"] / c["ms"] if t.get("ms") and c.get("ms") else None
                    row["loss_diff"] = (c["loss"] - t["loss"] if t.get("loss") is not None
                                        and c.get("loss") is not None else None)
                    row["host_ratio"] = (c["host_ms"] / t["host_ms"] if t.get("host_ms") and c.get("host_ms")
                                         else None)
                print(format_row(row), file=out)
                out.flush()
                yield row


@register_suite("train_step", "end_to_end")
def bench_train_step(cfg: BenchConfig, out: TextIO) -> Iterator[SuiteResult]:
    """LLaMA/GPT-2 decoders trained on culmen's blocks vs PyTorch's: ms/step, tokens/s, peak memory, loss, host time."""
    opts = TrainOptions.from_config(cfg)
    for row in run_cases(opts, cfg.device, out):
        yield SuiteResult(_records(row), row)


# --------------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``train_step``'s options (also accepted by ``culmen bench``)."""
    g = p.add_argument_group("train_step options")
    g.add_argument("--models", metavar="LIST", help=f"comma-separated styles from {','.join(STYLES)} (default: both)")
    g.add_argument("--sizes", metavar="LIST",
                   help=f"comma-separated sizes from {','.join(SIZES)} (default: {','.join(FULL_SIZES)} on CUDA, "
                        "tiny with --quick or on CPU)")
    g.add_argument("--modes", metavar="LIST", help="comma-separated from eager,compile (default: both on CUDA, eager "
                                                   "on CPU)")
    g.add_argument("--steps", type=int, help="timed steps per model (default 10; 3 when tiny)")
    g.add_argument("--warmup", type=int, help="warm-up steps, compiles included (default 3; 2 when tiny)")
    g.add_argument("--host-steps", type=int, help="steps measured for host time (default 3; 2 when tiny)")
    g.add_argument("--compile-scope", choices=COMPILE_SCOPES,
                   help="compile: the whole forward + loss (model, default) or each block + the loss head (block)")
    g.add_argument("--dtype", choices=tuple(_DTYPES), help="param/activation dtype (default bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--batch", type=int, help="override the batch size of every size")
    g.add_argument("--seq", type=int, help="override the sequence length of every size")
    g.add_argument("--time-limit", type=float, metavar="S", help="skip cases that would start after S seconds")


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``BenchConfig.options`` dict from parsed ``add_arguments`` options (unset ones left out)."""
    keys = ("models", "sizes", "modes", "steps", "warmup", "host_steps", "compile_scope", "dtype", "batch", "seq",
            "time_limit")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def main(argv: list[str] | None = None) -> int:
    """``python -m culmen.bench.train_step``: this benchmark alone (same output as ``culmen bench train_step``)."""
    from culmen.bench.runner import run_benchmarks

    p = argparse.ArgumentParser(prog="python -m culmen.bench.train_step", description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--quick", action="store_true", help="tiny model (seconds on CPU)")
    p.add_argument("--json", metavar="PATH", help="write records, rows and metadata as JSON")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        run_benchmarks(["train_step"], device=args.device, quick=args.quick, json_path=args.json,
                       options=options_from_args(args))
    except TrainOptionsError as exc:
        print(f"train_step: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
