"""``culmen.flash_attn.utils.benchmark`` on CPU: what each helper times, its return values and output."""

from __future__ import annotations

import json

import pytest
import torch
import torch.utils.benchmark as tbench

from culmen.flash_attn.utils import benchmark as fb


class Counting:
    """``fn`` for the helpers: counts forward calls, output (x * w).sum(-1) with a tuple option."""

    def __init__(self, as_tuple: bool = False) -> None:
        self.calls = 0
        self.as_tuple = as_tuple

    def __call__(self, x, w, scale=1.0):
        self.calls += 1
        y = (x * w).sum(-1) * scale
        return (y, "extra") if self.as_tuple else y


def _inputs():
    x = torch.randn(7, 33, requires_grad=True)
    w = torch.randn(33, requires_grad=True)
    return x, w


def test_benchmark_forward_times_the_call(capsys):
    fn = Counting()
    x, w = _inputs()
    t, m = fb.benchmark_forward(fn, x, w, repeats=5, desc="fwd", scale=2.0)
    assert isinstance(t, tbench.Timer) and isinstance(m, tbench.Measurement)
    # Timer.timeit warms up with a couple of calls of its own before the timed ones.
    assert 5 <= fn.calls <= 5 + 3 and len(m.times) >= 1 and m.mean > 0
    out = capsys.readouterr().out
    assert "fwd - Forward pass" in out
    fb.benchmark_forward(fn, x, w, repeats=3, verbose=False)
    assert capsys.readouterr().out == ""


def test_benchmark_backward_accumulates_nothing_and_checks_grad():
    fn = Counting(as_tuple=True)
    x, w = _inputs()
    grad = torch.randn(7)
    _, m = fb.benchmark_backward(fn, x, w, grad=grad, repeats=4, verbose=False)
    assert fn.calls == 1, "the backward benchmark runs the forward once"
    # .grad is reset before every timed backward, so it holds exactly one backward's gradient.
    torch.testing.assert_close(x.grad, grad[:, None] * w.detach(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, (grad[:, None] * x.detach()).sum(0), rtol=1e-6, atol=1e-6)
    assert m.mean > 0
    with pytest.raises(RuntimeError, match="Grad shape"):
        fb.benchmark_backward(fn, x, w, grad=torch.randn(3), repeats=1, verbose=False)


def test_benchmark_combined_fwd_bwd_and_all(capsys):
    fn = Counting()
    x, w = _inputs()
    _, m = fb.benchmark_combined(fn, x, w, repeats=3, desc="c")
    assert 1 + 3 <= fn.calls <= 1 + 3 + 3 and m.mean > 0
    assert "c - Forward + Backward pass" in capsys.readouterr().out
    pair = fb.benchmark_fwd_bwd(fn, x, w, repeats=2, verbose=False)
    assert len(pair) == 2 and all(isinstance(p[1], tbench.Measurement) for p in pair)
    triple = fb.benchmark_all(fn, x, w, repeats=2, verbose=False)
    assert len(triple) == 3 and all(isinstance(p[0], tbench.Timer) for p in triple)
    with pytest.raises(ValueError, match="repeats"):
        fb.benchmark_forward(fn, x, w, repeats=0)


def test_amp_on_cpu_autocasts_the_call():
    seen = []

    def fn(a, b):
        y = a @ b
        seen.append(y.dtype)
        return y

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    fb.benchmark_forward(fn, a, b, repeats=1, verbose=False, amp=True, amp_dtype=torch.bfloat16)
    assert set(seen) == {torch.bfloat16}
    seen.clear()
    fb.benchmark_forward(fn, a, b, repeats=1, verbose=False)
    assert set(seen) == {torch.float32}


def test_pytorch_profiler_cpu_table_and_trace(tmp_path, capsys):
    fn = Counting()
    x, w = _inputs()
    trace = tmp_path / "trace.json"
    fb.pytorch_profiler(fn, x, w, backward=True, cpu=True, trace_filename=str(trace))
    assert fn.calls == 1 + 30 + 1  # the gradient's shape, 30 warm-ups, the profiled call
    assert "Self CPU time total" in capsys.readouterr().out
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"aten::mul", "aten::sum"} <= names
    assert x.grad is not None


def test_benchmark_memory_cpu_sees_a_large_allocation(capsys):
    def allocate(n):
        t = torch.ones(n)  # written, so the pages are resident
        return float(t[-1])

    mem = fb.benchmark_memory(allocate, 30_000_000, desc="alloc")  # 120 MB of float32
    assert 0.09 < mem < 1.0, mem
    assert "alloc max memory" in capsys.readouterr().out
    small = fb.benchmark_memory(lambda: None, verbose=False)
    assert small < 0.05
