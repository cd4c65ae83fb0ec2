"""contrib.sparsity.semi_structured: pruned Linear layers on semi-structured sparse tensors (SM80+),
the dense fallback elsewhere, lazy re-compression after weight updates, and gradients vs float64."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from culmen.contrib.sparsity import ASP, create_mask
from culmen.contrib.sparsity import semi_structured as ss
from culmen.testing import assert_close_tolerance


@pytest.fixture(autouse=True)
def _fresh_asp():
    ASP.reset()
    yield
    ASP.reset()


def _pruned_linear(n_in, n_out, dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out).to(device, dtype)
    with torch.no_grad():
        lin.weight.mul_(create_mask(lin.weight, "m4n2_1d"))
    return lin


def test_support_check_names_the_reason():
    ok, reason = ss.semi_structured_supported("cpu", torch.float16)
    assert not ok and "device cpu" in reason
    ok, reason = ss.semi_structured_supported("cpu", torch.float32)
    assert not ok and "dtype" in reason


def test_cpu_layers_stay_dense_and_can_be_disabled():
    lin = _pruned_linear(32, 24)
    x = torch.randn(3, 5, 32)
    assert ss.enable_semi_structured(lin) is False
    assert ss.semi_structured_status(lin).startswith("dense: ") and not ss.is_semi_structured(lin)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
    ss.disable_semi_structured(lin)
    assert ss.semi_structured_status(lin) == "not enabled" and "forward" not in lin.__dict__
    with pytest.raises(TypeError, match="module"):
        ss.enable_semi_structured(nn.Conv1d(4, 4, 1))


@pytest.mark.parametrize("bias", [True, False])
def test_semi_structured_linear_values_and_grads_vs_float64(bias):
    lin = _pruned_linear(64, 40)
    w = lin.weight.detach().clone().requires_grad_()
    b = lin.bias.detach().clone().requires_grad_() if bias else None
    x = torch.randn(5, 64, 7).transpose(1, 2).requires_grad_()  # (5, 7, 64), non-contiguous
    dy = torch.randn(5, 7, 40)
    y = ss.semi_structured_linear(x, w, b, w.detach())  # a dense stand-in for the compressed weight
    y.backward(dy)
    leaves = [x, w] + ([b] if bias else [])
    hi = [t.detach().double().requires_grad_() for t in leaves]
    y_hi = F.linear(hi[0], hi[1], hi[2] if bias else None)
    y_hi.backward(dy.double())
    lo = [t.detach().clone().requires_grad_() for t in leaves]
    y_lo = F.linear(lo[0], lo[1], lo[2] if bias else None)
    y_lo.backward(dy)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    for name, a, h, low in zip(["dx", "dweight", "dbias"], leaves, hi, lo):
        assert_close_tolerance(a.grad, h.grad, low.grad, name=name)


def test_compressed_weight_is_refreshed_only_when_the_weight_changes(monkeypatch):
    calls = []

    def fake_compress(t):
        calls.append(t.data_ptr())
        return t.clone()  # stands for the compressed tensor: same math

    monkeypatch.setattr(ss, "semi_structured_supported", lambda device, dtype: (True, ""))
    monkeypatch.setattr(torch.sparse, "to_sparse_semi_structured", fake_compress)
    lin = _pruned_linear(32, 16)
    assert ss.enable_semi_structured(lin, backend="torch") and ss.is_semi_structured(lin)
    assert ss.semi_structured_status(lin) == "active (torch)"
    assert len(calls) == 1
    x = torch.randn(4, 32)
    lin(x)
    lin(x)
    assert len(calls) == 1  # unchanged weight: no re-compression
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    lin(x).sum().backward()
    opt.step()
    with torch.no_grad():
        lin.weight.mul_(create_mask(lin.weight, "m4n2_1d"))
    y = lin(x)
    assert len(calls) == 2
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
    # the dense weight is what optimizers and the state_dict see
    assert set(lin.state_dict()) == {"weight", "bias"}
    # a non-2:4 weight is refused at enable time
    with torch.no_grad():
        lin.weight.fill_(1.0)
    assert not ss.enable_semi_structured(lin) and "not 2:4" in ss.semi_structured_status(lin)


def test_asp_option_falls_back_cleanly_on_cpu(capsys):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ASP.init_model_for_pruning(model, verbosity=2, whitelist=[nn.Linear], allow_permutation=False,
                               allow_recompute_mask=True, semi_structured=True)
    ASP.init_optimizer_for_pruning(opt)
    ASP.compute_sparse_masks()
    assert "semi-structured sparse forward dense: device cpu" in capsys.readouterr().out
    model(torch.randn(3, 32, dtype=torch.float16)).float().sum().backward()
    opt.step()
    ASP.restore_pruned_weights()
    assert ss.semi_structured_status(model[0]) == "not enabled"


# -- GPU (SM80+) -----------------------------------------------------------------------------------

def _capability():
    return torch.cuda.get_device_capability()[0]


def _gpu_check(lin, x, dy):
    y = lin(x)
    y.backward(dy)
    hi = [t.detach().double().requires_grad_() for t in (x, lin.weight, lin.bias)]
    y_hi = F.linear(*hi)
    y_hi.backward(dy.double())
    lo = [t.detach().clone().requires_grad_() for t in (x, lin.weight, lin.bias)]
    y_lo = F.linear(*lo)
    y_lo.backward(dy)
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    for name, a, h, low in zip(["dx", "dweight", "dbias"], (x, lin.weight, lin.bias), hi, lo):
        assert_close_tolerance(a.grad, h.grad, low.grad, name=name)
        a.grad = None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["auto", "cusparselt-graph", "cusparselt", "cutlass", "torch"])
def test_gpu_each_backend_forward_and_grads_vs_float64(backend, dtype):
    """Every backend this GPU / PyTorch has, at BERT-MLP sizes, an odd token count (padded for the
    kernels) and a multiple of 8, twice each (the graph backend's capture, then its replay), and
    after an optimizer step (re-compression)."""
    lin = _pruned_linear(768, 3072, dtype=dtype, device="cuda")
    active = ss.enable_semi_structured(lin, backend=backend)
    status = ss.semi_structured_status(lin)
    if _capability() < 8:
        assert not active and "compute capability" in status
        return
    assert active, status
    got = lin._culmen_semi_structured.backend
    if backend == "cutlass" and _capability() != 8:
        # PyTorch's CUTLASS kernels are SM8x-only: refused at enable, the next backend took over
        assert got != "cutlass" and "cutlass" in lin._culmen_semi_structured.reason, status
    elif backend != "auto":
        assert got == backend, status
    else:
        assert got == ss.backend_order("auto")[0], status
    torch.manual_seed(1)
    for lead in ((3, 171), (512,), (3, 171)):
        x = torch.randn(*lead, 768, device="cuda", dtype=dtype, requires_grad=True)
        _gpu_check(lin, x, torch.randn(*lead, 3072, device="cuda", dtype=dtype))
    with torch.no_grad():
        lin.weight.mul_(-0.5)  # an in-place update (what an optimizer step does): re-compressed
    x = torch.randn(3, 171, 768, device="cuda", dtype=dtype, requires_grad=True)
    _gpu_check(lin, x, torch.randn(3, 171, 3072, device="cuda", dtype=dtype))
    assert lin._culmen_semi_structured.backend == got  # no run-time failure made it fall back


@pytest.mark.gpu
def test_gpu_graph_backend_inside_an_outer_cuda_graph():
    lin = _pruned_linear(768, 3072, dtype=torch.float16, device="cuda")
    assert ss.enable_semi_structured(lin, backend="cusparselt-graph") is (_capability() >= 8)
    x = torch.randn(256, 768, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        lin(x)  # eager: its own graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = lin(x)  # captured: the op directly (no nested capture)
        x.normal_()
        graph.replay()
        ref = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    assert_close_tolerance(y, ref, F.linear(x, lin.weight, lin.bias), name="y")


@pytest.mark.gpu
def test_gpu_asp_training_with_semi_structured_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(768, 3072), nn.GELU(), nn.Linear(3072, 768)).cuda().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ASP.init_model_for_pruning(model, verbosity=0, whitelist=[nn.Linear], allow_permutation=False,
                               semi_structured=True)
    ASP.init_optimizer_for_pruning(opt)
    ASP.compute_sparse_masks()
    assert ss.is_semi_structured(model[0]) is (_capability() >= 8)
    x = torch.randn(512, 768, device="cuda", dtype=torch.float16)
    for _ in range(3):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
        ref = F.linear(F.gelu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias)
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref, rtol=2e-2, atol=2e-2)  # tracks the updated weights
        for *_, p, mask, _ in ASP.sparse_parameters():
            assert bool((p[~mask] == 0).all())


def test_benchmark_cases_run_and_agree_with_dense_on_cpu():
    from culmen.bench import sparsity
    from culmen.bench.registry import BenchConfig
    from culmen.bench.runner import default_check

    cases = list(sparsity.sparsity_linear_bench(BenchConfig(device=torch.device("cpu"), quick=True)))
    assert [c.label.split()[-1] for c in cases] == ["fwd", "fwd+bwd", "fwd", "fwd+bwd"]
    for case in cases:
        outs = {name: provider() for name, provider in case.providers.items()}
        diffs = default_check(outs["culmen"], outs["torch"])
        assert diffs and max(diffs.values()) == 0.0  # dense fallback on CPU: identical math
        assert any("device cpu" in note for note in case.notes)
