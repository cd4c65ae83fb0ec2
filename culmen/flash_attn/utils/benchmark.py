"""flash_attn's ``flash_attn.utils.benchmark``: timing helpers built on ``torch.utils.benchmark``.

Same names, arguments, defaults and return values as flash_attn 2.8 (each ``benchmark_*`` returns
``(Timer, Measurement)``, ``benchmark_fwd_bwd`` two such pairs, ``benchmark_all`` three). Unlike
flash_attn's, they also run on CPU: autocast uses the device of the tensor inputs (CUDA when there are
none and CUDA is available), ``pytorch_profiler`` records CPU activity where there is no GPU, and
``benchmark_memory`` on CPU reports the rise of the process's peak resident memory (Linux).

These are culmen's flash_attn-compatible helpers for users' scripts; culmen's own benchmarks are
``culmen bench`` (``culmen.bench``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.benchmark as benchmark

__all__ = [
    "benchmark_all",
    "benchmark_backward",
    "benchmark_combined",
    "benchmark_forward",
    "benchmark_fwd_bwd",
    "benchmark_memory",
    "pytorch_profiler",
]

# flash_attn divides bytes by 2**20 * 1000 and calls the result GB; kept so numbers compare.
_GB = float(2**20 * 1000)


def _device_type(inputs: tuple, kwinputs: dict) -> str:
    """Device type of the first tensor argument; CUDA if there is none and CUDA exists, else CPU."""
    for x in (*inputs, *kwinputs.values()):
        if isinstance(x, torch.Tensor):
            return x.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _autocast(device_type: str, amp: bool, amp_dtype: torch.dtype):
    return torch.autocast(device_type=device_type, dtype=amp_dtype, enabled=amp)


def _first(y: Any) -> torch.Tensor:
    """The output to differentiate: the first element when ``fn`` returns a tuple."""
    return y[0] if isinstance(y, tuple) else y


def _grad_for(y: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    if grad is None:
        return torch.randn_like(y)
    if grad.shape != y.shape:
        raise RuntimeError(f"Grad shape does not match output shape: grad {tuple(grad.shape)}, "
                           f"output {tuple(y.shape)}")
    return grad


def _clear_grads(inputs: tuple) -> None:
    # Gradients are set to None so the timed backward does not include accumulation into old ones.
    for x in inputs:
        if isinstance(x, torch.Tensor):
            x.grad = None


def _timer(stmt: str, env: dict) -> benchmark.Timer:
    return benchmark.Timer(stmt=stmt, globals=env, num_threads=torch.get_num_threads())


def _check_repeats(repeats: int) -> None:
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")


def benchmark_forward(fn: Callable, *inputs, repeats: int = 10, desc: str = "", verbose: bool = True,
                      amp: bool = False, amp_dtype: torch.dtype = torch.float16, **kwinputs):
    """Time ``fn(*inputs, **kwinputs)`` (under autocast to ``amp_dtype`` when ``amp``).

    Returns ``(torch.utils.benchmark.Timer, Measurement)`` of ``repeats`` runs; prints the
    measurement when ``verbose``.
    """
    _check_repeats(repeats)
    if verbose:
        print(desc, "- Forward pass")
    device_type = _device_type(inputs, kwinputs)

    def amp_wrapper(*inputs, **kwinputs):
        with _autocast(device_type, amp, amp_dtype):
            fn(*inputs, **kwinputs)

    t = _timer("fn_amp(*inputs, **kwinputs)", {"fn_amp": amp_wrapper, "inputs": inputs, "kwinputs": kwinputs})
    m = t.timeit(repeats)
    if verbose:
        print(m)
    return t, m


def benchmark_backward(fn: Callable, *inputs, grad: torch.Tensor | None = None, repeats: int = 10,
                       desc: str = "", verbose: bool = True, amp: bool = False,
                       amp_dtype: torch.dtype = torch.float16, **kwinputs):
    """Time the backward of ``fn``'s output (its first element if a tuple) with ``grad`` (default:
    standard normal of the output's shape), the graph kept between runs. The tensor inputs' ``.grad``
    is reset to ``None`` before each run. Returns ``(Timer, Measurement)``.
    """
    _check_repeats(repeats)
    if verbose:
        print(desc, "- Backward pass")
    with _autocast(_device_type(inputs, kwinputs), amp, amp_dtype):
        y = _first(fn(*inputs, **kwinputs))
    grad = _grad_for(y, grad)

    def f(*inputs, y, grad):
        _clear_grads(inputs)
        y.backward(grad, retain_graph=True)

    t = _timer("f(*inputs, y=y, grad=grad)", {"f": f, "inputs": inputs, "y": y, "grad": grad})
    m = t.timeit(repeats)
    if verbose:
        print(m)
    return t, m


def benchmark_combined(fn: Callable, *inputs, grad: torch.Tensor | None = None, repeats: int = 10,
                       desc: str = "", verbose: bool = True, amp: bool = False,
                       amp_dtype: torch.dtype = torch.float16, **kwinputs):
    """Time forward + backward of ``fn`` together (see :func:`benchmark_backward` for ``grad``).
    Returns ``(Timer, Measurement)``."""
    _check_repeats(repeats)
    if verbose:
        print(desc, "- Forward + Backward pass")
    device_type = _device_type(inputs, kwinputs)
    with _autocast(device_type, amp, amp_dtype):
        y = _first(fn(*inputs, **kwinputs))
    grad = _grad_for(y, grad)
    del y

    def f(grad, *inputs, **kwinputs):
        _clear_grads(inputs)
        with _autocast(device_type, amp, amp_dtype):
            y = _first(fn(*inputs, **kwinputs))
        y.backward(grad, retain_graph=True)

    t = _timer("f(grad, *inputs, **kwinputs)",
               {"f": f, "fn": fn, "inputs": inputs, "grad": grad, "kwinputs": kwinputs})
    m = t.timeit(repeats)
    if verbose:
        print(m)
    return t, m


def benchmark_fwd_bwd(fn: Callable, *inputs, grad: torch.Tensor | None = None, repeats: int = 10,
                      desc: str = "", verbose: bool = True, amp: bool = False,
                      amp_dtype: torch.dtype = torch.float16, **kwinputs):
    """``(benchmark_forward(...), benchmark_backward(...))``."""
    return (
        benchmark_forward(fn, *inputs, repeats=repeats, desc=desc, verbose=verbose, amp=amp,
                          amp_dtype=amp_dtype, **kwinputs),
        benchmark_backward(fn, *inputs, grad=grad, repeats=repeats, desc=desc, verbose=verbose, amp=amp,
                           amp_dtype=amp_dtype, **kwinputs),
    )


def benchmark_all(fn: Callable, *inputs, grad: torch.Tensor | None = None, repeats: int = 10,
                  desc: str = "", verbose: bool = True, amp: bool = False,
                  amp_dtype: torch.dtype = torch.float16, **kwinputs):
    """``(benchmark_forward(...), benchmark_backward(...), benchmark_combined(...))``."""
    return (
        benchmark_forward(fn, *inputs, repeats=repeats, desc=desc, verbose=verbose, amp=amp,
                          amp_dtype=amp_dtype, **kwinputs),
        benchmark_backward(fn, *inputs, grad=grad, repeats=repeats, desc=desc, verbose=verbose, amp=amp,
                           amp_dtype=amp_dtype, **kwinputs),
        benchmark_combined(fn, *inputs, grad=grad, repeats=repeats, desc=desc, verbose=verbose, amp=amp,
                           amp_dtype=amp_dtype, **kwinputs),
    )


def pytorch_profiler(fn: Callable, *inputs, trace_filename: str | None = None, backward: bool = False,
                     amp: bool = False, amp_dtype: torch.dtype = torch.float16, cpu: bool = False,
                     verbose: bool = True, **kwinputs):
    """Profile one call of ``fn`` (and its backward when ``backward``) after 30 warm-up calls.

    Records CUDA activity (plus CPU with ``cpu=True``; CPU only on a machine without CUDA). Prints the
    top-50 table when ``verbose``; writes a Chrome trace to ``trace_filename`` when given. Returns
    ``None`` as flash_attn does.
    """
    device_type = _device_type(inputs, kwinputs)
    if backward:
        with _autocast(device_type, amp, amp_dtype):
            g = torch.randn_like(_first(fn(*inputs, **kwinputs)))

    def once():
        if backward:
            _clear_grads(inputs)
        with _autocast(device_type, amp, amp_dtype):
            out = _first(fn(*inputs, **kwinputs))
        if backward:  # outside autocast, as a training step does
            out.backward(g, retain_graph=True)

    for _ in range(30):
        once()
    activities = []
    if cpu or not torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CPU)
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        once()
    if verbose:
        print(prof.key_averages().table(row_limit=50))
    if trace_filename is not None:
        prof.export_chrome_trace(trace_filename)


def _peak_rss_kib() -> tuple[int, int] | None:
    """(current, peak) resident set size of this process in KiB, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            status = f.read()
    except OSError:
        return None
    rss = re.search(r"VmRSS:\s+(\d+)", status)
    hwm = re.search(r"VmHWM:\s+(\d+)", status)
    return (int(rss.group(1)), int(hwm.group(1))) if rss and hwm else None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def benchmark_memory(fn: Callable, *inputs, desc: str = "", verbose: bool = True, **kwinputs) -> float:
    """Peak memory of one call of ``fn``, in flash_attn's unit (bytes / (2**20 * 1000), printed "GB").

    CUDA (a CUDA tensor among the inputs, or none and CUDA available): ``max_memory_allocated`` after
    resetting the peak, so memory already held counts. CPU: how far the process's peak resident set
    rose above its size before the call (Linux ``/proc``; 0.0 where that is unavailable).
    """
    if _device_type(inputs, kwinputs) == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        fn(*inputs, **kwinputs)
        torch.cuda.synchronize()
        mem = torch.cuda.max_memory_allocated() / _GB
        torch.cuda.empty_cache()
    else:
        before = _peak_rss_kib() if _reset_peak_rss() else None
        fn(*inputs, **kwinputs)
        after = _peak_rss_kib() if before is not None else None
        mem = max(after[1] - before[0], 0) * 1024 / _GB if after is not None else 0.0
    if verbose:
        print(f"{desc} max memory: {mem}GB")
    return mem
