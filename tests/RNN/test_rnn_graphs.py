"""The CUDA-graph path of the sequence ops (``culmen.ops.rnn.graphs``).

On CPU a stand-in graph (capture stores the loop, replay runs it on the static buffers) takes the place of
``torch.cuda.CUDAGraph``: a loop that read a per-call tensor instead of a static buffer would replay on the
captured call's data, and these tests would see it. GPU tests run the real graphs.
"""

from __future__ import annotations

import pytest
import torch
from test_rnn_ops import _ref_gru_seq, _ref_lstm_seq

import culmen.RNN
from culmen.ops.backend import use_backend
from culmen.ops.rnn import graphs, gru_sequence, lstm_sequence, set_cuda_graphs
from culmen.testing.hostcost import count_calls, fake_kernels
from culmen.testing.tolerance import assert_close_tolerance


class ReplayGraph:
    """What a CUDA graph does, eagerly: capture records the loop (and runs nothing), replay runs it."""

    def capture(self, loop, warmup):
        warmup()
        self.loop = loop

    def replay(self):
        self.loop()


class NullGraph(ReplayGraph):
    def replay(self):
        pass


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(graphs, "_GRAPH_FACTORY", ReplayGraph)
    graphs.clear_cuda_graphs()
    graphs.STATS.clear()
    yield graphs.STATS
    graphs.clear_cuda_graphs()


def _lstm_inputs(T, B, In, H, dtype=torch.float32, bias=True, dev="cpu"):
    shapes = [(T, B, In), (4 * H, In), (4 * H, H), (4 * H,), (4 * H,), (B, H), (B, H)]
    scales = [1.0, In ** -0.5, H ** -0.5, 0.2, 0.2, 0.5, 0.5]
    ts = [(torch.randn(*s, dtype=torch.float64, device=dev) * c).to(dtype).requires_grad_(True)
          for s, c in zip(shapes, scales)]
    if not bias:
        ts[3] = ts[4] = None
    return ts


def _gru_inputs(T, B, In, H, dtype=torch.float32, dev="cpu"):
    shapes = [(T, B, In), (3 * H, In), (3 * H, H), (3 * H,), (3 * H,), (B, H)]
    scales = [1.0, In ** -0.5, H ** -0.5, 0.2, 0.2, 0.5]
    return [(torch.randn(*s, dtype=torch.float64, device=dev) * c).to(dtype).requires_grad_(True)
            for s, c in zip(shapes, scales)]


def _run(kind, ins, reverse, cuda_graph, use_c=True, seed=0):
    """Outputs and the gradients of every input of one sequence call (loss weights drawn from ``seed``)."""
    if kind == "lstm":
        y, c = lstm_sequence(*ins, reverse=reverse, cuda_graph=cuda_graph)
        outs = (y, c)
    else:
        outs = (gru_sequence(*ins, reverse=reverse, cuda_graph=cuda_graph),)
    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
    ws = [torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float64).to(o.dtype) for o in outs]
    loss = (outs[0] * ws[0]).sum()
    if len(outs) > 1 and use_c:
        loss = loss + (outs[1] * ws[1]).sum()
    live = [t for t in ins if t is not None]
    return outs, torch.autograd.grad(loss, live)


def _ref_run(kind, ins, reverse, seed, dtype):
    """``_run`` on the plain-PyTorch step references (float64 inputs: the oracle; ``dtype`` inputs: the same
    computation in low precision), with the loss weights ``_run`` draws for ``dtype`` outputs."""
    outs = _ref_lstm_seq(*ins, reverse) if kind == "lstm" else (_ref_gru_seq(*ins, reverse),)
    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
    ws = [torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float64).to(dtype).to(o.dtype)
          for o in outs]
    loss = sum((o * w).sum() for o, w in zip(outs, ws))
    return outs, torch.autograd.grad(loss, [t for t in ins if t is not None])


def _equal(a, b, what):
    """Equal up to GEMM rounding: the same ops on the same values, but CPU BLAS may sum in another order
    for differently aligned buffers (differences of ~1e-8 in fp32). Stale or wrong data is far off."""
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"{what} {i}: {m}")


@pytest.mark.parametrize("kind,reverse", [("lstm", False), ("lstm", True), ("gru", False), ("gru", True)])
def test_graph_path_equals_eager_over_calls(fake_graphs, kind, reverse):
    """Call 0 eager (warm-up), call 1 captures set A, call 2 captures set B (A is held), call 3 replays A:
    every call on new inputs gives the eager results, and call 1's outputs survive call 2."""
    T, B, In, H = 5, 3, 4, 6
    make = _lstm_inputs if kind == "lstm" else _gru_inputs
    held = None
    for call in range(4):
        ins = make(T, B, In, H)
        eager_o, eager_g = _run(kind, ins, reverse, False, seed=call)
        outs, grads = _run(kind, ins, reverse, None, seed=call)
        _equal(outs, eager_o, f"call {call} output")
        _equal(grads, eager_g, f"call {call} grad")
        assert not outs[0]._is_view()
        if call == 1:
            held = (outs, [o.clone() for o in outs])
        if call == 2:
            _equal(held[0], held[1], "outputs of call 1 after call 2")  # set B took call 2
            held = None
    st = fake_graphs  # eager: the first call and the 4 calls with cuda_graph=False
    assert (st["eager_fwd"], st["capture_fwd"], st["replay_fwd"]) == (5, 2, 3), dict(st)
    assert (st["eager_bwd"], st["capture_bwd"], st["replay_bwd"]) == (5, 2, 3), dict(st)
    assert len(graphs.GRAPHS) == 1 and len(next(iter(graphs.GRAPHS.values())).sets) == 2


def test_graph_path_against_float64_and_new_inputs(fake_graphs):
    """The replayed graph computes each call's own inputs (not the captured call's): vs float64 autograd."""
    T, B, In, H = 4, 2, 3, 5
    for call in range(3):
        ins64 = _lstm_inputs(T, B, In, H, dtype=torch.float64)
        ins = [t.detach().float().requires_grad_(True) for t in ins64]
        outs, grads = _run("lstm", ins, False, None, seed=call)
        ref = _ref_run("lstm", ins64, False, call, torch.float32)
        for i, (got, r) in enumerate(zip((*outs, *grads), (*ref[0], *ref[1]))):
            assert_close_tolerance(got, r, None, name=f"call {call} tensor {i}")
    assert fake_graphs["replay_fwd"] == 2 and fake_graphs["replay_bwd"] == 2


def test_all_sets_busy_falls_back_to_fresh_tensors(fake_graphs, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_SETS", 2)
    T, B, In, H = 3, 2, 3, 4
    keep = []
    for _ in range(4):
        ins = _lstm_inputs(T, B, In, H)
        with torch.no_grad():
            y, c = lstm_sequence(*ins)
            ref = lstm_sequence(*ins, cuda_graph=False)
        keep.append((y, c, ref))
    for y, c, ref in keep:
        _equal((y, c), ref, "outputs")
    # call 0: first call; 1, 2: sets A, B; 3: both held -> eager. The graphs=False calls count too.
    assert fake_graphs["eager_fwd"] == 4 + 2 and fake_graphs["capture_fwd"] == 2
    del keep
    with torch.no_grad():
        lstm_sequence(*_lstm_inputs(T, B, In, H))
    assert fake_graphs["replay_fwd"] == 3  # a released set is used again


def test_views_of_outputs_and_saved_tensors_keep_a_set_busy(fake_graphs):
    T, B, In, H = 3, 2, 3, 4
    ins = _lstm_inputs(T, B, In, H)
    lstm_sequence(*ins)  # first call: eager
    y, _ = lstm_sequence(*ins)
    last = y[-1]
    lg = next(iter(graphs.GRAPHS.values()))
    assert not lg.sets[0].free()  # y and the autograd node's saved tensors
    del y
    assert not lg.sets[0].free()  # the view, the saved tensors
    with torch.no_grad():
        y2, c2 = lstm_sequence(*ins)
    del last, y2, c2
    assert len(lg.sets) == 2 and lg.sets[1].free() and not lg.sets[0].free()  # set 0: still saved for backward


def test_lstm_backward_without_cell_gradient_and_hidden_only_loss(fake_graphs):
    """A loss of y alone (no cell-state gradient) and a loss of c alone take their own backward graphs."""
    T, B, In, H = 4, 3, 2, 5
    for call in range(3):
        ins = _lstm_inputs(T, B, In, H, bias=call != 1)
        for use_c in (False, True):
            eager = _run("lstm", ins, False, False, use_c=use_c, seed=call)
            got = _run("lstm", ins, False, None, use_c=use_c, seed=call)
            _equal(got[0], eager[0], "outputs")
            _equal(got[1], eager[1], "grads")
        y, c = lstm_sequence(*ins)
        (dc0,) = torch.autograd.grad(c[-1].sum(), [ins[-1]])
        y, c = lstm_sequence(*ins, cuda_graph=False)
        _equal((dc0,), torch.autograd.grad(c[-1].sum(), [ins[-1]]), "dc0")
    assert fake_graphs["capture_bwd"] >= 2


def test_switch_argument_compile_and_capture_disable_graphs(fake_graphs, monkeypatch):
    T, B, In, H = 3, 2, 3, 4
    ins = _lstm_inputs(T, B, In, H)
    try:
        set_cuda_graphs(False)
        assert not culmen.RNN.cuda_graphs_enabled()
        for _ in range(3):
            lstm_sequence(*ins)
        assert len(graphs.GRAPHS) == 0
    finally:
        culmen.RNN.set_cuda_graphs(True)
    for _ in range(3):
        lstm_sequence(*ins, cuda_graph=False)
    assert len(graphs.GRAPHS) == 0
    with pytest.raises(TypeError, match="enabled"):
        set_cuda_graphs(1)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert graphs.graphs_allowed(cpu, None) and not graphs.graphs_allowed(cpu, False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not graphs.graphs_allowed(cpu, None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not graphs.graphs_allowed(cuda, None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert graphs.graphs_allowed(cuda, None)
    monkeypatch.setattr(graphs, "_GRAPH_FACTORY", None)
    assert not graphs.graphs_allowed(cpu, None)  # real graphs: CUDA only


def test_failed_capture_leaves_the_signature_eager(fake_graphs, monkeypatch):
    class Broken(ReplayGraph):
        def capture(self, loop, warmup):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_GRAPH_FACTORY", Broken)
    T, B, In, H = 3, 2, 3, 4
    for _ in range(3):
        ins = _gru_inputs(T, B, In, H)
        _equal(_run("gru", ins, False, None)[1], _run("gru", ins, False, False)[1], "grads")
    lg = next(iter(graphs.GRAPHS.values()))
    assert "RuntimeError" in lg.error and fake_graphs["capture_fwd"] == 0 and fake_graphs["set_eager_fwd"] == 1


def test_cold_kernels_run_the_loop_eagerly_on_the_set(fake_graphs):
    """Triton launches not yet bound (here: the CPU interpreter, which never binds) are never captured."""
    T, B, In, H = 3, 2, 3, 4
    inputs = [_gru_inputs(T, B, In, H) for _ in range(3)]
    with use_backend("triton"):  # (switching the backend drops the cached graphs: no switch in between)
        got = [_run("gru", ins, True, None) for ins in inputs]
    assert fake_graphs["capture_fwd"] == 0 and fake_graphs["set_eager_fwd"] == 2
    assert fake_graphs["set_eager_bwd"] == 2
    for ins, (outs, grads) in zip(inputs, got):
        ref = _run("gru", [t.detach().double().requires_grad_(True) for t in ins], True, False)
        for a, r in zip((*outs, *grads), (*ref[0], *ref[1])):
            assert_close_tolerance(a, r, None, name="gru")


def test_stateful_model_over_calls_matches_eager(fake_graphs):
    """culmen.RNN.LSTM keeps its hidden state between calls (views into the last call's buffers): three
    stateful calls with graphs equal three without."""
    torch.manual_seed(1)
    a = culmen.RNN.LSTM(3, 5, 2)
    b = culmen.RNN.LSTM(3, 5, 2)
    b.load_state_dict(a.state_dict())
    for call in range(3):
        x = torch.randn(4, 2, 3)
        ya, ha = a(x)
        try:
            set_cuda_graphs(False)
            yb, hb = b(x)
        finally:
            set_cuda_graphs(True)
        _equal((ya, *ha), (yb, *hb), f"call {call} outputs")
        ga = torch.autograd.grad(ya.sum() + ha[1].sum(), list(a.parameters()))
        gb = torch.autograd.grad(yb.sum() + hb[1].sum(), list(b.parameters()))
        _equal(ga, gb, f"call {call} grads")
        a.detach_hidden()
        b.detach_hidden()
    assert fake_graphs["replay_fwd"] >= 2


def test_host_calls_of_a_replayed_layer_do_not_grow_with_T(monkeypatch):
    """With the graph replayed, a layer's forward + backward makes the same host calls at T = 4 and
    T = 64 (the eager loop makes about two per step), under a fixed budget."""
    monkeypatch.setattr(graphs, "_GRAPH_FACTORY", NullGraph)

    def counts(T, cuda_graph):
        graphs.clear_cuda_graphs()
        ins = _lstm_inputs(T, 2, 3, 4)
        dy = torch.randn(T, 2, 4)

        def call():
            y, _ = lstm_sequence(*ins, cuda_graph=cuda_graph)
            torch.autograd.backward(y, dy)

        for _ in range(3):
            call()
        return count_calls(call)

    with fake_kernels():
        short, long = counts(4, None), counts(64, None)
        e_short, e_long = counts(4, False), counts(64, False)
    assert (short.python, short.c) == (long.python, long.c), f"T=4: {short}\nT=64: {long}"
    assert short.python <= 45 and short.c <= 60, str(short)
    # Eager: per step and direction one GEMM (a C call) and one bound launch (one Python frame).
    per_step = ((e_long.python - e_short.python) / 60, (e_long.c - e_short.c) / 60)
    assert max(per_step) <= 2.0, f"{per_step} Python / C calls per step: {e_long}"


# ------------------------------------------------------------------------------------------------ GPU


@pytest.fixture
def gpu_graphs():
    graphs.clear_cuda_graphs()
    graphs.STATS.clear()
    torch.backends.cuda.matmul.allow_tf32 = False
    yield graphs.STATS
    graphs.clear_cuda_graphs()


def _close_to_eager(got, ref, dtype, what):
    """The graph replays the eager loop's kernels on the same values: agreement to a few rounding steps
    of ``dtype`` (stale or misplaced data would be off by the values' own size)."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    for i, (a, r) in enumerate(zip(got, ref)):
        err = (a.double() - r.double()).abs().max().item()
        assert err <= tol * (1 + r.double().abs().max().item()), f"{what} {i}: max diff {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,reverse", [("lstm", False), ("lstm", True), ("gru", False)])
def test_gpu_graph_replay_matches_eager_and_float64(gpu_graphs, kind, reverse, dtype):
    """Real CUDA graphs: four calls on new inputs (capture, second set, replays) against the eager loop
    and, on the last call, against float64 autograd within the tolerance rule."""
    T, B, In, H = 64, 37, 200, 256
    make = _lstm_inputs if kind == "lstm" else _gru_inputs
    held = None
    for call in range(4):
        ins64 = make(T, B, In, H, dtype=torch.float64, dev="cuda")
        ins = [t.detach().to(dtype).requires_grad_(True) for t in ins64]
        eager = _run(kind, ins, reverse, False, seed=call)
        got = _run(kind, ins, reverse, None, seed=call)
        _close_to_eager(got[0], eager[0], dtype, f"call {call} outputs")
        _close_to_eager(got[1], eager[1], dtype, f"call {call} grads")
        if call == 1:
            held = (got[0], [o.clone() for o in got[0]])
        if call == 2:
            _equal(held[0], held[1], "call 1 outputs after call 2")
            held = None
    st = gpu_graphs
    assert st["capture_fwd"] == 2 and st["replay_fwd"] == 3 and st["capture_bwd"] == 2 and st["replay_bwd"] == 3, \
        (dict(st), [lg.error for lg in graphs.GRAPHS.values()])
    ref = _ref_run(kind, ins64, reverse, 3, dtype)
    lo = _ref_run(kind, [t.detach().to(dtype).requires_grad_(True) for t in ins64], reverse, 3, dtype)
    for i, (a, r, low) in enumerate(zip((*got[0], *got[1]), (*ref[0], *ref[1]), (*lo[0], *lo[1]))):
        assert_close_tolerance(a, r, low, name=f"{kind} {dtype} tensor {i}")


@pytest.mark.gpu
def test_gpu_training_loop_with_weight_updates(gpu_graphs):
    """A 2-layer bf16 LSTM trained for five steps (weights change in place between calls; the previous
    output is still alive during the next forward) equals the same model run with graphs off."""
    torch.manual_seed(3)
    T, B, In, H = 48, 16, 64, 128
    a = culmen.RNN.LSTM(In, H, 2).cuda().to(torch.bfloat16)
    b = culmen.RNN.LSTM(In, H, 2).cuda().to(torch.bfloat16)
    b.load_state_dict(a.state_dict())
    out_a = out_b = None
    for step in range(5):
        x = torch.randn(T, B, In, device="cuda", dtype=torch.bfloat16)
        a.reset_hidden(B)
        b.reset_hidden(B)
        out_a, hid_a = a(x)
        graphs._ENABLED = False  # (set_cuda_graphs(False) would also drop a's graphs)
        try:
            out_b, hid_b = b(x)
        finally:
            graphs._ENABLED = True
        _close_to_eager((out_a, *hid_a), (out_b, *hid_b), torch.bfloat16, f"step {step} outputs")
        (out_a.float().square().mean() + hid_a[1].float().sum()).backward()
        (out_b.float().square().mean() + hid_b[1].float().sum()).backward()
        with torch.no_grad():
            for pa, pb in zip(a.parameters(), b.parameters()):
                _close_to_eager((pa.grad,), (pb.grad,), torch.bfloat16, f"step {step} grad")
                pa -= 0.5 * pa.grad
                pb -= 0.5 * pb.grad
                pa.grad = pb.grad = None
    assert gpu_graphs["replay_fwd"] >= 6 and gpu_graphs["replay_bwd"] >= 6, dict(gpu_graphs)


@pytest.mark.gpu
def test_gpu_inside_an_outer_capture_runs_eagerly(gpu_graphs):
    """Inside the caller's own CUDA-graph capture the layer runs its eager loop (captured into the
    caller's graph), after earlier calls made a set and graphs of their own."""
    T, B, In, H = 16, 8, 32, 64
    ins = [t.detach() for t in _lstm_inputs(T, B, In, H, dev="cuda")]
    for _ in range(3):
        lstm_sequence(*ins)
    static_x = ins[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lstm_sequence(static_x, *ins[1:], cuda_graph=False)  # warm the eager path on this stream
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    before = gpu_graphs["eager_fwd"]
    with torch.cuda.graph(g):
        y, c = lstm_sequence(static_x, *ins[1:])
    assert gpu_graphs["eager_fwd"] == before + 1
    new_x = torch.randn_like(static_x)
    static_x.copy_(new_x)
    g.replay()
    ry, rc = lstm_sequence(new_x, *ins[1:], cuda_graph=False)
    _close_to_eager((y, c), (ry, rc), torch.float32, "outer capture")
