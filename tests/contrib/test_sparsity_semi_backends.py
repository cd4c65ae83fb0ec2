"""contrib.sparsity semi-structured backends on CPU with the sparse ops faked (dense math standing for
the compressed kernels): the cuSPARSELt call conventions (transposed dense operand, transposed result,
fused bias, padding of odd token counts), the CUDA-graph cache (one capture per token count, the
weight re-compressed in place, the cap, no nesting inside a capture), the alg-id search done once,
the backend order, the enable-time probe, the run-time fallback and the host cost of a cached call."""

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from culmen.contrib.sparsity import _semi_backends as sb
from culmen.contrib.sparsity import create_mask
from culmen.contrib.sparsity import semi_structured as ss
from culmen.testing import assert_close_tolerance
from culmen.testing.hostcost import assert_host_budget


class Fakes:
    """Dense stand-ins for PyTorch's sparse ops, recording how they were called."""

    def __init__(self):
        self.mm_calls, self.search_calls, self.captures, self.compress_calls = [], [], 0, 0
        self.fail_mm = False
        self.bad_alg = False

    def compress(self, w):
        self.compress_calls += 1
        return w.clone()

    def cslt_mm(self, c, dense_b, bias=None, alpha=None, out_dtype=None, transpose_result=False, alg_id=0):
        if self.fail_mm:
            raise RuntimeError("CUDA error: fake failure")
        assert not dense_b.is_contiguous() or dense_b.shape[1] == 1  # x2.t(): the transposed view
        self.mm_calls.append((dense_b.shape[1], alg_id, bias is not None))
        y = c @ dense_b  # (out, tokens)
        if self.bad_alg and alg_id:
            y = -y
        if bias is not None:
            y = y + bias[:, None]
        return y.t().contiguous() if transpose_result else y

    def search(self, c, dense_b, bias=None, alpha=None, out_dtype=None, transpose_result=False):
        assert transpose_result
        self.search_calls.append(dense_b.shape[1])
        return 3

    def capture(self, fn):
        self.captures += 1
        out = fn()
        return (lambda: out.copy_(fn())), out


@pytest.fixture
def fakes(monkeypatch):
    f = Fakes()
    monkeypatch.setattr(ss, "semi_structured_supported", lambda device, dtype: (True, ""))
    monkeypatch.setattr(torch, "_cslt_compress", f.compress, raising=False)
    monkeypatch.setattr(torch, "_cslt_sparse_mm", f.cslt_mm, raising=False)
    monkeypatch.setattr(torch, "_cslt_sparse_mm_search", f.search, raising=False)
    monkeypatch.setattr(sb, "_capture", f.capture)
    monkeypatch.setattr(sb, "_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))  # where cutlass runs
    cutlass = types.SimpleNamespace(from_dense=lambda w: types.SimpleNamespace(packed=w.clone(), meta=None))
    monkeypatch.setattr(torch.sparse, "SparseSemiStructuredTensorCUTLASS", cutlass)
    monkeypatch.setattr(torch, "_sparse_semi_structured_mm", lambda a, meta, b: a @ b, raising=False)
    monkeypatch.setattr(torch, "_sparse_semi_structured_addmm", lambda c, a, meta, b: a @ b + c[:, None],
                        raising=False)
    monkeypatch.setattr(torch.sparse, "to_sparse_semi_structured", lambda w: w.clone())
    return f


def _pruned_linear(n_in, n_out, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(create_mask(lin.weight, "m4n2_1d"))
    return lin


def _check_values_and_grads(lin, x, dy):
    y = lin(x)
    y.backward(dy)
    leaves = [x, lin.weight] + ([lin.bias] if lin.bias is not None else [])
    hi = [t.detach().double().requires_grad_() for t in leaves]
    y_hi = F.linear(hi[0], hi[1], hi[2] if len(hi) > 2 else None)
    y_hi.backward(dy.double())
    lo = [t.detach().clone().requires_grad_() for t in leaves]
    y_lo = F.linear(lo[0], lo[1], lo[2] if len(lo) > 2 else None)
    y_lo.backward(dy)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    for name, a, h, low in zip(["dx", "dweight", "dbias"], leaves, hi, lo):
        assert_close_tolerance(a.grad, h.grad, low.grad, name=name)
    for t in leaves:
        t.grad = None


def test_backend_order(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    assert ss.backend_order("auto")[0] == "cutlass"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    order = ss.backend_order("auto")
    # CUTLASS's 2:4 kernels are SM80 code (an illegal instruction on an H200): never tried outside 8.x
    assert order[0] == "cusparselt-graph" and order[-1] == "dense" and "cutlass" not in order
    assert sorted(order) == sorted(b for b in ss.BACKENDS if b != "cutlass")
    named = ss.backend_order("torch")
    assert named[0] == "torch" and named.count("torch") == 1 and len(named) == len(ss.BACKENDS) - 1
    with pytest.raises(ValueError, match="backend"):
        ss.backend_order("cublas")
    with pytest.raises(ValueError, match="max_graphs"):
        ss.enable_semi_structured(nn.Linear(8, 8), max_graphs=-1)


@pytest.mark.parametrize("bias", [True, False])
def test_graph_backend_values_grads_and_one_capture_per_token_count(fakes, bias):
    lin = _pruned_linear(32, 24, bias=bias)
    assert ss.enable_semi_structured(lin, "cusparselt-graph", search_alg=True)  # the search is opt-in
    assert ss.semi_structured_status(lin) == "active (cusparselt-graph)"
    assert fakes.captures == 0 and fakes.search_calls == [64]  # the enable-time probe runs the op directly
    x = torch.randn(3, 5, 32, requires_grad=True)  # 15 tokens: padded to 16 for the kernel
    dy = torch.randn(3, 5, 24)
    for _ in range(2):
        _check_values_and_grads(lin, x, dy)
    assert fakes.captures == 1 and fakes.search_calls == [64, 16]
    x2 = torch.randn(16, 32, requires_grad=True)  # the same padded count, unpadded: its own graph
    _check_values_and_grads(lin, x2, torch.randn(16, 24))
    assert fakes.captures == 2 and fakes.search_calls == [64, 16]  # the alg id is per kernel token count
    assert all(has_bias == bias for _, _, has_bias in fakes.mm_calls)
    assert fakes.mm_calls[-1][1] == 3  # the searched alg id (checked once against alg 0, then kept)
    with torch.no_grad():  # inference skips the autograd node, same graph
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert fakes.captures == 2


def test_graph_backend_tracks_weight_updates_in_place(fakes):
    lin = _pruned_linear(32, 16)
    ss.enable_semi_structured(lin, "cusparselt-graph")
    impl = lin._culmen_semi_structured.impl
    ptr = impl.compressed.data_ptr()
    x = torch.randn(8, 32)
    lin(x)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    for _ in range(2):
        lin(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            lin.weight.mul_(create_mask(lin.weight, "m4n2_1d"))
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert fakes.captures == 1 and impl.compressed.data_ptr() == ptr  # re-compressed into the same buffer
    n = fakes.compress_calls
    lin(x)
    lin(x)
    assert fakes.compress_calls == n  # unchanged weight: no re-compression
    lin.bias = nn.Parameter(torch.randn(16))  # a new bias tensor: the graphs baked the old pointer
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert fakes.captures == 2


def test_graph_cap_and_no_capture_inside_a_capture(fakes, monkeypatch):
    lin = _pruned_linear(32, 16)
    ss.enable_semi_structured(lin, "cusparselt-graph", max_graphs=2)
    for tokens in (8, 16, 24, 24):
        x = torch.randn(tokens, 32)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert fakes.captures == 2 and sorted(lin._culmen_semi_structured.impl.graphs) == [8, 16]
    monkeypatch.setattr(sb, "_capturing", lambda: True)
    lin2 = _pruned_linear(32, 16, seed=1)
    ss.enable_semi_structured(lin2, "cusparselt-graph")
    searches = len(fakes.search_calls)
    x = torch.randn(40, 32)
    torch.testing.assert_close(lin2(x), F.linear(x, lin2.weight, lin2.bias), rtol=1e-5, atol=1e-5)
    assert fakes.captures == 2 and len(fakes.search_calls) == searches  # direct op, no search in a capture


def test_a_searched_alg_that_disagrees_with_alg0_is_not_used(fakes):
    fakes.bad_alg = True
    lin = _pruned_linear(32, 16)
    assert ss.enable_semi_structured(lin, "cusparselt", search_alg=True)
    x = torch.randn(24, 32)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert lin._culmen_semi_structured.impl.algs == {64: 0, 24: 0}


@pytest.mark.parametrize("backend", ["cusparselt", "cutlass", "torch"])
def test_other_backends_values_and_grads(fakes, backend):
    lin = _pruned_linear(64, 40)
    assert ss.enable_semi_structured(lin, backend, search_alg=False)
    assert ss.semi_structured_status(lin) == f"active ({backend})"
    x = torch.randn(5, 64, 7).transpose(1, 2).requires_grad_()  # (5, 7, 64) non-contiguous, 35 tokens
    _check_values_and_grads(lin, x, torch.randn(5, 7, 40))
    if backend == "cusparselt":
        assert fakes.search_calls == [] and {alg for _, alg, _ in fakes.mm_calls} == {0}
        assert {n for n, _, _ in fakes.mm_calls} == {64, 40}  # probe, then 35 tokens padded to 40


def test_probe_drops_a_wrong_backend_and_runtime_failure_falls_back(fakes, monkeypatch):
    monkeypatch.setattr(torch, "_sparse_semi_structured_addmm", lambda c, a, meta, b: (a @ b).flip(0), raising=False)
    lin = _pruned_linear(32, 16)
    assert ss.enable_semi_structured(lin, "cutlass")
    state = lin._culmen_semi_structured
    assert state.backend == "cusparselt-graph" and "cutlass: probe mismatch" in state.reason
    x = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="mat1 and mat2|shape"):
        lin(torch.randn(8, 31))  # the caller's mistake: raised, the backend kept
    assert state.backend == "cusparselt-graph"
    fakes.fail_mm = True  # the op starts failing: cusparselt-graph and cusparselt drop out, torch takes over
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert ss.semi_structured_status(lin) == "active (torch)" and "cusparselt-graph failed" in state.reason
    monkeypatch.setattr(torch.sparse, "to_sparse_semi_structured", lambda w: 1 / 0)
    lin3 = _pruned_linear(32, 16)
    monkeypatch.setattr(torch, "_cslt_compress", None)  # op missing: TypeError at build
    assert not ss.enable_semi_structured(lin3, "torch") and ss.semi_structured_status(lin3).startswith("dense: ")


def test_cached_graph_call_host_budget(fakes):
    lin = _pruned_linear(32, 16)
    ss.enable_semi_structured(lin, "cusparselt-graph")
    x = torch.randn(16, 32)

    def call():
        with torch.no_grad():
            lin(x)

    # _forward, semi_structured_linear, the backend's mm; the weight/bias pointer checks, the graph
    # lookup, the input copy, the replay and the output clone. The fake replay re-runs the captured
    # lambda (1 Python + 1 C call more than CUDAGraph.replay, a single C call)
    n = assert_host_budget(call, python=4, c=10)
    assert "Tensor.clone" in n.c_names and fakes.captures == 1
    n = assert_host_budget(lambda: lin(x), python=5, c=10)  # + the autograd Function's forward
