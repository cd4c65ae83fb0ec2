"""Runs registered benchmarks: roofline, sanity check, timing, table, JSON and plot.

Three numbers per provider (culmen and each peer), all in the same process on the same inputs:

* ``ms`` (the ratio basis): the plain eager call timed by ``triton.testing.do_bench`` (median, after
  warm-up, L2 flushed between runs), host launch cost included: what a script sees. Every speedup,
  GB/s and TFLOP/s is computed from it. On CPU a plain median wall-clock timer stands in.
* ``graph_ms``: median of CUDA-graph replays of the call (``do_bench_cudagraph``), the device time
  alone, printed beside ``ms`` and never used for a ratio; ``n/a`` when the call can't be captured.
* ``host_us``: host microseconds per call, measured while the GPU cannot run any of it: a
  ``torch.cuda._sleep`` kernel is queued first, long enough to outlast the enqueueing, then ``K``
  back-to-back calls are enqueued and timed with ``perf_counter`` (no sync inside), then the device is
  drained. An event recorded behind the sleep must still be pending when the last call returns, which
  proves the host never waited for the GPU (else the sleep is lengthened and the sample retaken; a
  call that syncs with the device reports ``None``). ``K`` is small (2..16 calls, so that ``K`` x the
  launches of one call stays far below the ~1000 pending launches a CUDA stream queue holds, past
  which a launch would block). Medians of several samples. On CPU every call is host work, so
  ``host_us`` is the wall time per call.

Before the cases, a large device-to-device copy measures the memory roofline that GB/s is set
against. Each provider runs once first as a sanity check against the reference provider (torch
eager): the max abs difference is printed, not asserted, so a broken kernel shows in the log
without stopping the run. Suites (``train_step``) time themselves and add their own records.
The JSON report is rewritten after every case, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from culmen.bench.registry import CULMEN, BenchConfig, Benchmark, Case, load_benchmarks, select_benchmarks

# do_bench settings (milliseconds of warm-up and of measurement).
WARMUP_MS = 25
REP_MS = 100
# time_ms's timers: "wall": do_bench, host launch cost included (what a script sees, the ratio basis);
# "graph": replays of a CUDA graph of the call (do_bench_cudagraph), device time only. The runner
# records both; tuning scripts pick one.
TIMERS = ("wall", "graph")
# Host timer: at most HOST_CALLS calls per sample (fewer for slow calls), HOST_SAMPLES samples.
HOST_CALLS = 16
HOST_SAMPLES = 5


@dataclass
class Record:
    """One (benchmark, case, provider) measurement; ``error`` is set when the provider failed."""

    benchmark: str
    family: str
    case: str
    provider: str
    ms: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    pct_roofline: float | None = None
    speedup: float | None = None
    """culmen row: best peer time / culmen time; peer row: this peer's time / culmen time (>1: culmen wins)."""
    best_peer: str | None = None
    max_abs_diff: float | None = None
    diffs: dict[str, float] = field(default_factory=dict)
    bytes: int | None = None
    flops: int | None = None
    error: str | None = None
    graph_ms: float | None = None
    """Median CUDA-graph replay time (device time only); ``None`` when not measured or not capturable."""
    graph_error: str | None = None
    host_us: float | None = None
    """Host microseconds per call (for ``train_step``: per training step); see the module docstring."""
    host_error: str | None = None
    """Why ``host_us`` is missing (the call waits for the GPU: a host sync inside)."""
    host_ratio: float | None = None
    """This provider's ``host_us`` / the case reference's (torch eager): > 1 means more host time."""


@dataclass
class BenchReport:
    """Everything one ``culmen bench`` run measured; ``extra`` holds suites' detail rows by name."""

    metadata: dict[str, Any]
    records: list[Record]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict: ``{"metadata": ..., "records": [...], <suite name>: [...]}``."""
        return {"metadata": self.metadata, "records": [asdict(r) for r in self.records], **self.extra}


# ----------------------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall_median_ms(fn: Callable[[], Any], device: torch.device, budget_s: float, min_reps: int = 3,
                    max_reps: int = 200) -> float:
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_ms(fn: Callable[[], Any], device: torch.device, quick: bool = False, timer: str = "wall") -> float:
    """Median time of ``fn()`` in ms: ``do_bench`` (``timer="wall"``, host cost included) or CUDA-graph
    replays (``timer="graph"``, device time only) on CUDA, a wall-clock median elsewhere."""
    if timer not in TIMERS:
        raise ValueError(f"timer must be one of {TIMERS}, got {timer!r}")
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            with torch.cuda.device(device):
                if timer == "graph":
                    from triton.testing import do_bench_cudagraph

                    return float(do_bench_cudagraph(fn, rep=REP_MS, return_mode="median"))
                return float(do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))
    fn()  # warm-up: first-call allocations and lazy initialisation
    _sync(device)
    return _wall_median_ms(fn, device, budget_s=0.02 if quick else 0.5)


_SLEEP_CYCLES_PER_MS: dict[int, float] = {}


def _sleep_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles ``torch.cuda._sleep`` spins per millisecond on ``device`` (measured once)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SLEEP_CYCLES_PER_MS:
        cycles = 20_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles // 10)  # wake the clocks up
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS[idx] = cycles / max(start.elapsed_time(end), 1e-3)
    return _SLEEP_CYCLES_PER_MS[idx]


def host_us(fn: Callable[[], Any], device: torch.device, wall_ms: float | None = None,
            calls: int = HOST_CALLS, samples: int = HOST_SAMPLES) -> float | None:
    """Host microseconds per call of ``fn`` (warm: call it once before), measured without the GPU.

    CUDA: each sample queues a ``torch.cuda._sleep`` kernel that outlasts the enqueueing (sized from
    ``wall_ms``, an upper bound of the host time per call, e.g. the do_bench time), records an event
    behind it, enqueues ``k`` calls between two ``perf_counter`` reads and checks that the event is still
    pending: the GPU was asleep the whole time, so the host never waited for our work. A sample whose
    sleep ran out is retaken with a 4x longer sleep; after three tries ``fn`` is taken to wait for the
    device (it syncs) and ``None`` is returned. ``k = clamp(20 ms / wall_ms, 2, calls)`` keeps slow
    calls cheap and the queue short (``k`` x launches per call << the ~1000-launch stream queue).
    CPU: the median wall time per call (all of it is host work).
    """
    if device.type != "cuda":
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        if wall_ms is None:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1e3
        wall_ms = max(wall_ms, 0.02)
        k = max(2, min(calls, int(20.0 / wall_ms)))
        rate = _sleep_cycles_per_ms(device)
        sleep_ms = 1.5 * k * wall_ms + 1.0
        out: list[float] = []
        for _ in range(samples):
            for _attempt in range(3):
                torch.cuda._sleep(int(rate * sleep_ms))
                asleep = torch.cuda.Event()
                asleep.record()
                t0 = time.perf_counter()
                for _ in range(k):
                    fn()
                dt = time.perf_counter() - t0
                pending = not asleep.query()
                torch.cuda.synchronize()
                if pending:
                    out.append(dt / k * 1e6)
                    break
                sleep_ms = max(4 * sleep_ms, 2e3 * dt)
            else:
                return None
        return statistics.median(out)


def graph_ms(fn: Callable[[], Any], device: torch.device) -> tuple[float | None, str | None]:
    """``(median CUDA-graph replay ms, None)``, or ``(None, reason)`` when ``fn`` can't be captured."""
    if device.type != "cuda":
        return None, None
    try:
        from triton.testing import do_bench_cudagraph  # noqa: F401
    except ImportError:
        return None, None
    try:
        return time_ms(fn, device, timer="graph"), None
    except Exception as exc:  # uncapturable calls (host syncs, CPU tensors ...): the column says n/a
        torch.cuda.synchronize(device)
        return None, short_error(exc)


def _copy_ms(nbytes: int, device: torch.device, quick: bool) -> float:
    # Own scope so the buffers are freed before any benchmark allocates. Always the wall timer: one
    # large copy has no host cost to hide, and CUDA-graph replay of it measured 2.44 instead of
    # 3.0 TB/s on an H100, which would inflate every "% of roofline".
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src), device, quick, timer="wall")


def measure_roofline(device: torch.device, quick: bool = False) -> dict[str, Any]:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), the practical roofline."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    if quick:
        nbytes = (256 << 20) if device.type == "cuda" else (8 << 20)
    ms = _copy_ms(nbytes, device, quick)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"gbps": 2 * nbytes / (ms * 1e6), "copy_bytes": nbytes, "copy_ms": ms, "method": "dst.copy_(src)"}


# ---------------------------------------------------------------------------------- correctness


def _flatten(out: Any) -> dict[str, torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return {"out": out}
    if isinstance(out, dict):
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    if isinstance(out, (tuple, list)):
        return {f"out{i}": v for i, v in enumerate(out) if isinstance(v, torch.Tensor)}
    return {}


def default_check(out: Any, ref: Any) -> dict[str, float]:
    """Max abs difference per output tensor present in both ``out`` and ``ref`` (NaN shows as nan)."""
    a, r = _flatten(out), _flatten(ref)
    diffs: dict[str, float] = {}
    for key, t in a.items():
        if key in r and r[key].shape == t.shape:
            diffs[key] = float((t.detach().float() - r[key].detach().float()).abs().max()) if t.numel() else 0.0
    return diffs


# ------------------------------------------------------------------------------------- metadata


def _git_commit() -> tuple[str | None, bool | None]:
    # A copy of the tree without .git (e.g. shipped to a GPU machine) can be told its commit.
    if os.environ.get("CULMEN_GIT_COMMIT"):
        return os.environ["CULMEN_GIT_COMMIT"], None
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():  # an installed culmen: don't report an unrelated enclosing repo
        return None, None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return commit or None, dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def device_name(device: torch.device) -> str:
    """The GPU's name, or ``cpu: <processor>`` for CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()}"


def _metadata(device: torch.device, quick: bool, roofline: dict[str, Any], graph: bool = True) -> dict[str, Any]:
    from culmen.ops.backend import backend_mode, choose_backend

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit, dirty = _git_commit()
    try:
        backend = choose_backend(device)
    except Exception as exc:  # reported, the run goes on with whatever the ops decide per call
        backend = f"error: {exc}"
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "gpu": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "culmen_backend_mode": backend_mode(),
        "culmen_backend": backend,
        "quick": quick,
        "timer": ("ms: triton.testing.do_bench median of the eager call (host launch cost included; every "
                  "ratio uses it)" if device.type == "cuda" else "ms: wall-clock median"),
        "graph_timer": ("graph_ms: triton.testing.do_bench_cudagraph median (CUDA-graph replay, device time, "
                        "not a ratio basis)" if device.type == "cuda" and graph else None),
        "host_timer": ("host_us: perf_counter around K back-to-back calls enqueued behind a torch.cuda._sleep "
                       "kernel that outlasts them (GPU idle for our work, no sync inside), median per call"
                       if device.type == "cuda" else "host_us: wall time per call (CPU: all work is host work)"),
        "roofline": roofline,
    }


# ----------------------------------------------------------------------------------------- table


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    """``v`` formatted by ``spec`` + ``suffix``; a missing value is ``-`` padded to the same width."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        width = spec.split(".")[0].lstrip("+-<>^ ")
        return "-".rjust(int(width) + len(suffix)) if width.isdigit() else "-"
    return f"{v:{spec}}{suffix}"


_HEADER = f"{'case':<30} {'provider':<9} {'wall(ms)':>10} {'graph(ms)':>10} {'host(us)':>9} {'GB/s':>9} " \
          f"{'TFLOP/s':>8} {'%roof':>7} {'speedup':>16}  max|diff| vs ref"
_LEGEND = ("wall: do_bench of the eager call (ratio basis); graph: CUDA-graph replay (device time, "
           "n/a: not capturable); host: host us per call (sync: the call waits for the GPU)")


def _row(rec: Record, first: bool, reference: str) -> str:
    case = rec.case if first else ""
    if rec.error is not None:
        return f"{case:<30} {rec.provider:<9} {'failed':>10}  {rec.error}"
    if rec.speedup is None:
        speed = "-"
    elif rec.provider == CULMEN:
        speed = f"{rec.speedup:.2f}x vs {rec.best_peer}"
    else:
        speed = f"{rec.speedup:.2f}x"
    if rec.diffs:
        worst = max(rec.diffs, key=lambda k: (math.isnan(rec.diffs[k]), rec.diffs[k]))
        diff = f"{worst}={rec.diffs[worst]:.3g}" + (" (NaN!)" if math.isnan(rec.diffs[worst]) else "")
    else:
        diff = "(reference)" if rec.provider == reference else "-"
    graph = "n/a" if rec.graph_error is not None else _fmt(rec.graph_ms, ".4f")
    host = "sync" if rec.host_error is not None else _fmt(rec.host_us, ".1f")
    return (f"{case:<30} {rec.provider:<9} {_fmt(rec.ms, '10.4f')} {graph:>10} {host:>9} "
            f"{_fmt(rec.gbps, '9.1f')} {_fmt(rec.tflops, '8.1f')} {_fmt(rec.pct_roofline, '6.1f', '%')} "
            f"{speed:>16}  {diff}")


# ------------------------------------------------------------------------------------------- run


def short_error(exc: BaseException, width: int = 160) -> str:
    """``"Type: first line of the message"`` (cut to ``width`` characters): a failure in one table cell."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:width] if msg else ''}"


def _run_case(bench: Benchmark, case: Case, device: torch.device, quick: bool, roof_gbps: float,
              out: TextIO, seen_notes: set[str], graph: bool = True) -> list[Record]:
    records: dict[str, Record] = {}
    outputs_ref: Any = None
    order = sorted(case.providers, key=lambda p: (p != case.reference, p != CULMEN, p))
    # Sanity pass: run each provider once (this also compiles / warms it up) and compare outputs.
    for name in order:
        rec = Record(bench.name, bench.family, case.label, name, bytes=case.bytes, flops=case.flops)
        records[name] = rec
        try:
            result = case.providers[name]()
            _sync(device)
        except Exception as exc:  # e.g. torch.compile or a kernel failing: reported, others go on
            rec.error = short_error(exc)
            if os.environ.get("CULMEN_BENCH_TRACEBACK"):
                traceback.print_exc(file=out)
            continue
        if name == case.reference:
            outputs_ref = result
            if case.check is not None:  # self-consistency checks apply to the reference too
                rec.diffs = case.check(result, result)
        elif outputs_ref is not None or case.check is not None:
            check = case.check or default_check
            rec.diffs = check(result, outputs_ref)
        if rec.diffs:
            rec.max_abs_diff = max(rec.diffs.values())
        del result
    del outputs_ref
    for name in order:
        rec = records[name]
        if rec.error is not None:
            continue
        fn = case.providers[name]
        try:
            rec.ms = time_ms(fn, device, quick, timer="wall")
            if graph:
                rec.graph_ms, rec.graph_error = graph_ms(fn, device)
            rec.host_us = host_us(fn, device, wall_ms=rec.ms) if device.type == "cuda" else rec.ms * 1e3
            if rec.host_us is None:
                rec.host_error = "the call waits for the GPU (a host sync inside)"
        except Exception as exc:
            rec.error = short_error(exc)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        if case.bytes:
            rec.gbps = case.bytes / (rec.ms * 1e6)
            rec.pct_roofline = 100.0 * rec.gbps / roof_gbps if roof_gbps else None
        if case.flops:
            rec.tflops = case.flops / (rec.ms * 1e9)
    ours = records.get(CULMEN)
    peers = {n: r for n, r in records.items() if n != CULMEN and r.ms is not None}
    if ours is not None and ours.ms is not None:
        for r in peers.values():
            r.speedup = r.ms / ours.ms
        rivals = [r for n, r in peers.items() if n not in case.informational]
        if rivals:
            best = min(rivals, key=lambda r: r.ms)
            ours.speedup = best.ms / ours.ms
            ours.best_peer = best.provider
    ref = records.get(case.reference)
    if ref is not None and ref.host_us:
        for r in records.values():
            if r.host_us is not None:
                r.host_ratio = r.host_us / ref.host_us
    recs = [records[n] for n in sorted(records, key=lambda p: (p != CULMEN, p))]
    for i, rec in enumerate(recs):
        print(_row(rec, i == 0, case.reference), file=out)
    for note in case.notes:
        if note not in seen_notes:  # a peer skipped for the whole benchmark is said once
            seen_notes.add(note)
            print(f"{'':<30} note: {note}", file=out)
    out.flush()
    return recs


def summarize(records: list[Record]) -> list[str]:
    """Summary lines: per benchmark, culmen's geometric-mean speedup vs the best peer, wins, failures."""
    lines = ["== summary (speedup = best peer wall time / culmen wall time, >1 means culmen wins; host = culmen "
             "host time per call / the reference peer's (torch eager), <1 means culmen costs the host less) =="]
    benches: dict[str, list[Record]] = {}
    for r in records:
        benches.setdefault(r.benchmark, []).append(r)
    for name, recs in benches.items():
        ours = [r for r in recs if r.provider == CULMEN]
        sp = [r.speedup for r in ours if r.speedup]
        failed = [r for r in recs if r.error is not None]
        geo = math.exp(sum(math.log(s) for s in sp) / len(sp)) if sp else None
        wins = sum(s > 1.0 for s in sp)
        worst = min(ours, key=lambda r: r.speedup or float("inf"), default=None)
        line = f"{name:<18} cases={len(ours):<3} culmen geomean={_fmt(geo, '.2f', 'x')} wins={wins}/{len(sp)}"
        if worst is not None and worst.speedup is not None:
            line += f" worst={worst.speedup:.2f}x ({worst.case} vs {worst.best_peer})"
        hr = [r for r in ours if r.host_ratio]
        if hr:
            hgeo = math.exp(sum(math.log(r.host_ratio) for r in hr) / len(hr))
            hmax = max(hr, key=lambda r: r.host_ratio)
            line += f" host culmen/ref geomean={hgeo:.2f}x max={hmax.host_ratio:.2f}x ({hmax.case})"
        if failed:
            line += f" failed={len(failed)} [" + ", ".join(sorted({f'{r.provider}' for r in failed})) + "]"
        lines.append(line)
        for r in ours:
            if r.error is None and r.diffs and any(math.isnan(v) for v in r.diffs.values()):
                lines.append(f"  NaN in culmen output: {r.case}")
    return lines


def write_plot(report: BenchReport, path: str | os.PathLike, out: TextIO | None = None) -> list[Path]:
    """Draw ``report``: one PNG per benchmark family beside ``path`` and an overview at ``path``
    (see ``culmen.bench.plot.write_plot``). Returns the paths written (empty when nothing was drawn)."""
    from culmen.bench.plot import write_plot as _write_plot

    return _write_plot(report, path, out)


def default_device() -> torch.device:
    """CUDA device 0 when available, else CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def bench_device(spec: str | torch.device | None) -> torch.device:
    """The device a benchmark run uses for ``spec`` (``culmen bench --device SPEC``); ``None``: CUDA device 0
    when there is one, else CPU.

    Raises ``ValueError`` with a one-line reason for a malformed name, a device type the harness does not
    time (only ``cpu`` and ``cuda``, which is also ROCm), a GPU this machine lacks, or an index past the
    GPUs it has.
    """
    if spec is None:
        return default_device()
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {str(spec)!r} is not a device name (use cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {str(spec)!r}: the benchmarks time cpu and cuda (ROCm too) devices only")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else (
                f"ROCm {torch.version.hip}" if torch.version.hip else "CPU only")
            raise ValueError(f"--device {str(spec)!r}: no CUDA/ROCm GPU is available here (torch {torch.__version__}, "
                             f"built for {build}); use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {str(spec)!r}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _write_json(report: BenchReport, json_path: str | os.PathLike) -> None:
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(report.to_json(), f, indent=1)
    os.replace(tmp, path)


def run_benchmarks(
    names: list[str] | None = None,
    *,
    device: torch.device | str | None = None,
    quick: bool = False,
    json_path: str | os.PathLike | None = None,
    plot_path: str | os.PathLike | None = None,
    out: TextIO | None = None,
    graph: bool = True,
    options: dict[str, Any] | None = None,
) -> BenchReport:
    """Run the benchmarks named in ``names`` (names or families; when empty, all but the opt-in suites)
    and report.

    Prints the roofline, one table block per case and a summary to ``out``; writes JSON to
    ``json_path`` (rewritten after every case) and figures at ``plot_path`` when given (one PNG per
    family beside it, the overview at it: ``culmen.bench.plot``). ``graph=False``
    skips the CUDA-graph column; ``options`` reach the benchmarks as ``BenchConfig.options``
    (``train_step``'s sizes, modes, steps ...). Raises ``KeyError`` for unknown names and ``ValueError``
    for a device this machine lacks (``bench_device``).
    """
    out = out or sys.stdout
    failed = load_benchmarks()
    for mod, err in failed.items():
        print(f"warning: benchmark module {mod} failed to import: {err}", file=out)
    benches = select_benchmarks(names)
    dev = bench_device(device)
    roofline = measure_roofline(dev, quick)
    meta = _metadata(dev, quick, roofline, graph)
    meta["options"] = dict(options or {})
    print(f"culmen bench on {meta['gpu']} | torch {meta['torch']} | triton {meta['triton']} | "
          f"backend {meta['culmen_backend']} (CULMEN_BACKEND={meta['culmen_backend_mode']}) | "
          f"commit {str(meta['git_commit'])[:12]}{' (dirty)' if meta['git_dirty'] else ''}", file=out)
    print(f"roofline: {roofline['gbps']:.1f} GB/s ({roofline['method']}, {roofline['copy_bytes'] >> 20} MiB, "
          f"read+write counted)", file=out)
    report = BenchReport(meta, [])
    records = report.records
    cfg = BenchConfig(device=dev, quick=quick, options=dict(options or {}))
    for bench in benches:
        print(f"\n== {bench.name} ({bench.family}) {bench.description}", file=out)
        if bench.suite is not None:
            details = report.extra.setdefault(bench.name, [])
            for res in bench.suite(cfg, out):
                records.extend(res.records)
                details.append(res.detail)
                if json_path:
                    _write_json(report, json_path)
        else:
            print(_LEGEND, file=out)
            print(_HEADER, file=out)
            seen_notes: set[str] = set()
            for case in bench.cases(cfg):
                records.extend(_run_case(bench, case, dev, quick, roofline["gbps"], out, seen_notes, graph))
                del case
                if json_path:
                    _write_json(report, json_path)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print("", file=out)
    for line in summarize(records):
        print(line, file=out)
    if json_path:
        _write_json(report, json_path)
        print(f"json written to {json_path}", file=out)
    if plot_path:
        write_plot(report, plot_path, out)
    return report
