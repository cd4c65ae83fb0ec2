"""apex.contrib.torchsched: the "torchsched" torch.compile backend equals eager on CPU; the stream plan of real
AOTAutograd graphs is checked by an independent simulator (every cross-stream dependency covered by an event,
mutations as barriers, record_stream for every cross-stream use, all side streams joined); the scheduled code
runs on CPU with a recording runtime; switches and bad input. GPU-marked: results equal eager and the kernels
really run on several streams (profiler trace)."""

from __future__ import annotations

import copy
import json
import operator
import textwrap
from collections import defaultdict

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from fresh_python import run_python
from torch._functorch.aot_autograd import make_boxed_func

import culmen.contrib.torchsched as ts
from culmen.contrib.torchsched import config, get_backend, set_default_backend
from culmen.contrib.torchsched.backend import convolution_backward_decomp_dwb
from culmen.contrib.torchsched.scheduler import _is_barrier, _tensors, build_scheduled_module, plan_streams
from culmen.testing.tolerance import assert_close_tolerance


class Branches(nn.Module):
    """Three independent branches of unequal length from one input, then combined."""

    def __init__(self, d=12, h=20):
        super().__init__()
        self.a1, self.a2, self.a3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, d)
        self.b1 = nn.Linear(d, d)
        self.c1, self.c2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        a = self.a3(torch.relu(self.a2(torch.relu(self.a1(x)))))
        b = torch.sigmoid(self.b1(x))
        c = self.c2(torch.tanh(self.c1(x)))
        return a * b + c, b.sum()


class ConvBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Conv2d(3, 5, 3, padding=1)
        self.q = nn.Conv2d(3, 5, 1)

    def forward(self, x):
        return torch.relu(self.p(x)) + self.q(x) * 0.5


def _eager_and_grads(model, x):
    y = model(x)
    y = y if isinstance(y, tuple) else (y,)
    grads = torch.autograd.grad(sum(t.sum() * (i + 1) for i, t in enumerate(y)), [x, *model.parameters()])
    return y, grads


@pytest.mark.parametrize("make", [Branches, ConvBranches], ids=["linear-branches", "conv-branches"])
def test_compile_equals_eager_cpu(make):
    torch._dynamo.reset()
    model = make()
    x = torch.randn(3, 12) if make is Branches else torch.randn(2, 3, 7, 9)
    x.requires_grad_(True)
    want, want_g = _eager_and_grads(model, x)
    compiled = torch.compile(model, backend="torchsched", fullgraph=True)
    got, got_g = _eager_and_grads(compiled, x)
    for a, b in zip(got + got_g, want + want_g):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the plan, checked by an independent simulator


def check_program(graph: fx.Graph, plan) -> list[str]:
    """Replay ``plan.program`` with vector clocks; return what is wrong."""
    errs = []
    stream_of = plan.stream_of
    vc: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    count: dict[int, int] = defaultdict(int)
    pos: dict[fx.Node, tuple[int, int]] = {}
    events: dict[int, dict[int, int]] = {}
    recorded: set[tuple[fx.Node, int]] = set()
    cur = 0
    last_barrier = None
    launched: list[fx.Node] = []
    for ins in plan.program:
        kind = ins[0]
        if kind == "switch":
            cur = ins[1]
        elif kind == "record":
            events[ins[1]] = dict(vc[cur])
        elif kind == "wait":
            s, slot = ins[1], ins[2]
            if slot not in events:
                errs.append(f"wait on never-recorded event {slot}")
                continue
            for k, v in events[slot].items():
                vc[s][k] = max(vc[s][k], v)
        elif kind == "record_stream":
            recorded.add((ins[1], ins[2]))
        elif kind == "join":
            for s in ins[1]:
                for k, v in vc[s].items():
                    vc[0][k] = max(vc[0][k], v)
            cur = 0
        else:
            n = ins[1]
            if n.op == "output":
                if cur != 0:
                    errs.append("graph returns on a side stream")
                for p in n.all_input_nodes:
                    if p in pos and vc[0][pos[p][0]] < pos[p][1]:
                        errs.append(f"output {p} not visible to stream 0")
                for s in list(count):
                    if s and vc[0][s] < count[s]:
                        errs.append(f"side stream {s} not joined")
                continue
            if n.op != "call_function":
                continue
            if stream_of[n] != cur:
                errs.append(f"{n} issued on stream {cur}, planned {stream_of[n]}")
            for p in n.all_input_nodes:
                if p in pos:
                    t, i = pos[p]
                    if t != cur and vc[cur][t] < i:
                        errs.append(f"{n} on stream {cur} may run before its input {p} on stream {t}")
            if _is_barrier(n):
                for q in launched:
                    t, i = pos[q]
                    if vc[cur][t] < i:
                        errs.append(f"mutation {n} may run before {q}")
            elif cur != 0 and last_barrier is not None and vc[cur][0] < pos[last_barrier][1]:
                errs.append(f"{n} on stream {cur} may run before mutation {last_barrier}")
            count[cur] += 1
            vc[cur][cur] = count[cur]
            pos[n] = (cur, count[cur])
            launched.append(n)
            if _is_barrier(n):
                last_barrier = n
    # Every tensor used on a stream other than the one that allocated its memory (a view's memory is its
    # base's, a getitem's its producer's, graph inputs need none) is record_stream'ed, on some alias, for it.
    def root(n):
        if n.op != "call_function":
            return None
        name = getattr(n.target, "__name__", "").split(".")[0]
        if n.target is operator.getitem:
            return n
        if getattr(n.target, "is_view", False) or name in ("_unsafe_view", "alias", "detach", "lift_fresh"):
            base = next((p for p in n.all_input_nodes if _tensors(p.meta.get("val"))), None)
            return root(base) if base is not None else None
        return n

    def alloc_stream(r):
        return stream_of.get(r.args[0], 0) if r.target is operator.getitem else stream_of[r]

    covered = {(root(n), s) for n, s in recorded}
    for n in graph.nodes:
        if n.op != "call_function" or not _tensors(n.meta.get("val")) or root(n) is None:
            continue
        r = root(n)
        for u in n.users:
            s = 0 if u.op == "output" else stream_of[u]
            if s != alloc_stream(r) and (r, s) not in covered:
                errs.append(f"{n} (memory of {r}) used on stream {s} without record_stream")
    return errs


class Recorder:
    """A CPU stand-in for CudaStreamRuntime: records the calls the scheduled code makes."""

    def __init__(self):
        self.calls = []

    def switch(self, s):
        self.calls.append(("switch", s))

    def wait(self, s, slot):
        self.calls.append(("wait", s, slot))

    def record(self, slot, s):
        self.calls.append(("record", slot, s))

    def record_stream(self, t, s):
        assert isinstance(t, torch.Tensor)
        self.calls.append(("record_stream", s))

    def join(self, streams):
        self.calls.append(("join", streams))


def _capture_and_schedule(model, x, num_streams, reuse=True):
    """Compile with AOTAutograd on CPU, planning and running every graph through the scheduled code."""
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def compiler(gm, example_inputs):
        plan = plan_streams(gm.graph, num_streams, reuse)
        rec = Recorder()
        sgm = build_scheduled_module(gm, plan, rec)
        seen.append((gm, plan, rec))
        return make_boxed_func(sgm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    return compiled, seen


def test_plan_of_forward_and_backward_graphs():
    model = Branches()
    x = torch.randn(5, 12, requires_grad=True)
    want, want_g = _eager_and_grads(model, x)
    compiled, seen = _capture_and_schedule(model, x, num_streams=4)
    got, got_g = _eager_and_grads(compiled, x)
    for a, b in zip(got + got_g, want + want_g):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert len(seen) == 2  # forward and backward
    for gm, plan, rec in seen:
        errs = check_program(gm.graph, plan)
        assert not errs, errs[:10]
        assert len(plan.side_streams) >= 2, plan.side_streams  # three branches: two off the critical path
        assert all(plan.stream_of[n] == 0 for n in plan.critical_path)
        # The scheduled code issued exactly the plan's runtime calls (events recorded on the issuing stream).
        want_calls, cur = [], 0
        for ins in plan.program:
            if ins[0] in ("switch", "join"):
                cur = ins[1] if ins[0] == "switch" else 0
            if ins[0] == "record":
                want_calls.append(("record", ins[1], cur))
            elif ins[0] == "record_stream":
                want_calls.append(("record_stream", ins[2]))
            elif ins[0] != "node":
                want_calls.append(ins)
        assert rec.calls == want_calls
        # mm-heavy branches went to side streams
        mm_streams = {plan.stream_of[n] for n in gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target)}
        assert len(mm_streams) >= 3, mm_streams


def test_plan_without_event_reuse_and_single_stream():
    model = Branches()
    x = torch.randn(4, 12, requires_grad=True)
    compiled, seen = _capture_and_schedule(model, x, num_streams=3, reuse=False)
    _eager_and_grads(compiled, x)
    for gm, plan, _ in seen:
        assert not check_program(gm.graph, plan)
        reused = plan_streams(gm.graph, 3, reuse_events=True)
        assert reused.num_events <= plan.num_events
        assert not check_program(gm.graph, reused)
        one = plan_streams(gm.graph, 1)
        assert one.side_streams == [] and one.num_events == 0
        assert all(i[0] == "node" for i in one.program)


def test_mutation_is_a_barrier():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, y, w):
        a = torch.mm(x, w)
        b = torch.mm(y, w).relu()
        c = torch.mm(x, w.t()).sigmoid()
        x.add_(1.0)  # mutates an input the branches read
        d = torch.mm(x, w)
        return a + b + c + d

    args = [torch.randn(6, 6) for _ in range(3)]
    gm = make_fx(f, tracing_mode="fake")(*args)
    plan = plan_streams(gm.graph, 4)
    barriers = [n for n in gm.graph.nodes if n.op == "call_function" and _is_barrier(n)]
    assert barriers and all(plan.stream_of[n] == 0 for n in barriers)
    assert len(plan.side_streams) >= 1
    assert not check_program(gm.graph, plan)
    # The simulator catches a program with a wait removed.
    broken = plan_streams(gm.graph, 4)
    i = next(k for k, ins in enumerate(broken.program) if ins[0] == "wait")
    del broken.program[i]
    assert check_program(gm.graph, broken)
    unrecorded = plan_streams(gm.graph, 4)
    unrecorded.program = [ins for ins in unrecorded.program if ins[0] != "record_stream"]
    assert any("record_stream" in e for e in check_program(gm.graph, unrecorded))
    # And the scheduled module still computes f.
    want = f(*[a.clone() for a in args])
    sgm = build_scheduled_module(gm, plan, Recorder())
    torch.testing.assert_close(sgm(*[a.clone() for a in args]), want, rtol=0, atol=0)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(24), nn.Linear(24, 24)
        self.ln_plain = nn.LayerNorm(24, elementwise_affine=False)

    def forward(self, x):
        return self.fc(self.ln(x)).relu() + self.ln_plain(x)


def test_pre_grad_layer_norm_pass():
    from culmen.contrib.torchsched.passes import pre_grad_custom_pass
    from culmen.contrib.torchsched.passes.pre_grad_passes import culmen_layer_norm

    targets = []

    def backend(gm, example_inputs):
        pre_grad_custom_pass(gm.graph)
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    model = Normed()
    x = torch.randn(3, 5, 24, requires_grad=True)
    torch.compile(model, backend=backend, fullgraph=True)(x)
    assert targets.count(culmen_layer_norm) == 1  # the affine LayerNorm; the plain one has no weight
    assert targets.count(torch.nn.functional.layer_norm) == 1
    # Through the backend: forward and every gradient match eager.
    torch._dynamo.reset()
    want, want_g = _eager_and_grads(model, x)
    with config.patch(enable_pre_grad_pass=True):
        compiled = torch.compile(model, backend="torchsched", fullgraph=True)
        got, got_g = _eager_and_grads(compiled, x)
    for a, b in zip(got + got_g, want + want_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with config.patch(pre_grad_pass_options=["no_such_pass"]), pytest.raises(ValueError, match="no_such_pass"):
        pre_grad_custom_pass(fx.Graph())


# ------------------------------------------------------------------ switches, names and bad input


def test_config_switches():
    assert config._parse_ids("1,2,3-5, 9") == {1, 2, 3, 4, 5, 9}
    assert config._parse_ids(None) == set()
    assert config._dump_spec("+inductor,/tmp/x") == (["torchsched", "inductor"], "/tmp/x")
    assert config._dump_spec(None) == (["torchsched"], None)
    with config.patch(num_streams=3):
        assert config.num_streams == 3
        with config.patch("num_streams", 2), config.patch({"debug": True}):
            assert config.num_streams == 2 and config.debug is True
        assert config.num_streams == 3 and config.debug is False

    @config.patch(reuse_cuda_event=False)
    def decorated():
        return config.reuse_cuda_event

    assert decorated() is False
    with pytest.raises(ValueError, match="num_stream"):
        config.patch(num_stream=2)
    assert config.get_config_copy()["num_streams"] == 8
    assert config.num_streams == 8 and config.reuse_cuda_event is True and config.enable_pre_grad_pass is False


def test_get_backend_and_bad_input():
    from torch._dynamo import lookup_backend

    assert get_backend("torch") is lookup_backend("inductor")
    b = get_backend("torchsched", "wbd")
    assert b == get_backend("torchsched", "wbd") and b != get_backend("torchsched", "dwb")
    with pytest.raises(ValueError, match="backend='tvm2'"):
        get_backend("tvm2")
    with pytest.raises(ValueError, match="scheme='bdw'"):
        get_backend("torchsched", "bdw")
    with pytest.raises(ValueError, match="num_streams"):
        plan_streams(fx.Graph(), 0)
    with pytest.raises(ValueError, match="no_such_option"):
        ts.torchsched(None, [], config_patches={"no_such_option": 1})


def test_set_default_backend_wraps_and_restores_torch_compile():
    original = torch.compile
    try:
        with pytest.raises(ValueError, match="not_a_backend"):
            set_default_backend("not_a_backend")
        set_default_backend("torchsched")
        assert torch.compile is ts.torchsched_compile and ts._DEFAULT_BACKEND == "torchsched"
        torch._dynamo.reset()
        model = Branches()
        x = torch.randn(2, 12)
        out = torch.compile(model)(x)
        torch.testing.assert_close(out[0], model(x)[0], rtol=0, atol=1e-6)
        set_default_backend("inductor")
        assert torch.compile is original
    finally:
        torch.compile = original
        ts._DEFAULT_BACKEND = "inductor"


def test_conv_backward_split_keeps_cpu_fused():
    g, x, w = torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3), torch.randn(2, 2, 1, 1)
    args = (g, x, w, [2], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True])
    assert convolution_backward_decomp_dwb(*args) is NotImplemented


def test_alias_import():
    code = textwrap.dedent("""
        import culmen.compat as compat
        compat.install()
        import apex.contrib.torchsched as ts
        from apex.contrib.torchsched import get_backend, set_default_backend
        import apex.contrib.torchsched.config as config
        import apex.contrib.torchsched.backend as backend
        import culmen.contrib.torchsched as c
        from torch._dynamo import list_backends
        assert ts is c and get_backend is c.get_backend and config.num_streams >= 1
        assert "torchsched" in list_backends(exclude_tags=())
        print("OK")
    """)
    assert run_python(code) == "OK"


# ------------------------------------------------------------------ GPU


def _kernel_streams(fn) -> set[int]:
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return {e["args"]["stream"] for e in trace.get("traceEvents", [])
            if e.get("cat") == "kernel" and "stream" in e.get("args", {})}


def _check_fp64(model, x, got, want):
    """The float64 model is the reference; the compiled graph may add gradients in another order than eager
    autograd (or pick other cuDNN / TF32 algorithms), so it gets the tolerance rule against eager's error."""
    ref_model = copy.deepcopy(model).double()
    ref, ref_g = _eager_and_grads(ref_model, x.detach().double().requires_grad_(True))
    names = ["y"] * (len(got) - len(ref_g)) + ["dx"] + [f"d{n}" for n, _ in model.named_parameters()]
    for a, b, r, name in zip(got, want, ref + ref_g, names):
        assert_close_tolerance(a, r, b, name=name)


class WideBranches(nn.Module):
    def __init__(self, d=1024, n=4):
        super().__init__()
        self.branches = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d)) for _ in range(n))

    def forward(self, x):
        return sum(b(x) for b in self.branches)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_multi_stream_equals_eager(dtype):
    torch._dynamo.reset()
    model = WideBranches().cuda().to(dtype)
    x = torch.randn(512, 1024, device="cuda", dtype=dtype, requires_grad=True)
    want, want_g = _eager_and_grads(model, x)
    compiled = torch.compile(model, backend="torchsched", fullgraph=True)
    got, got_g = _eager_and_grads(compiled, x)
    _check_fp64(model, x, got + got_g, want + want_g)

    def step():
        _eager_and_grads(compiled, x)

    streams = _kernel_streams(step)
    assert len(streams) >= 2, f"kernels ran on streams {streams}"
    assert len(_kernel_streams(lambda: _eager_and_grads(model, x))) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["dwb", "wbd"])
def test_gpu_conv_backward_split(scheme):
    torch._dynamo.reset()
    model = ConvBranches().cuda()
    x = torch.randn(4, 3, 33, 31, device="cuda", requires_grad=True)
    want, want_g = _eager_and_grads(model, x)
    compiled = torch.compile(model, backend=get_backend("torchsched", scheme), fullgraph=True)
    got, got_g = _eager_and_grads(compiled, x)
    _check_fp64(model, x, got + got_g, want + want_g)
    with config.patch(num_streams=1):
        torch._dynamo.reset()
        one = torch.compile(model, backend="torchsched", fullgraph=True)
        assert len(_kernel_streams(lambda: _eager_and_grads(one, x))) == 1


@pytest.mark.gpu
def test_gpu_pre_grad_layer_norm_pass():
    torch._dynamo.reset()
    model = Normed().cuda()
    x = torch.randn(4, 77, 24, device="cuda", requires_grad=True)
    want, want_g = _eager_and_grads(model, x)
    with config.patch(enable_pre_grad_pass=True):
        compiled = torch.compile(model, backend="torchsched", fullgraph=True)
        got, got_g = _eager_and_grads(compiled, x)
    _check_fp64(model, x, got + got_g, want + want_g)
