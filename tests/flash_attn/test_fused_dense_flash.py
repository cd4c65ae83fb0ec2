"""``culmen.flash_attn.ops.fused_dense``: ``FusedMLP`` / ``fused_mlp_func`` / ``FusedDense`` against float64
oracles (tolerance rule), what each ``checkpoint_lvl`` saves, argument errors, and the tensor-parallel
``ColumnParallelLinear`` / ``RowParallelLinear`` / ``ParallelFusedMLP`` on 2 gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from culmen.flash_attn.ops.fused_dense import (
    FusedDense,
    FusedDenseFunc,
    FusedMLP,
    FusedMLPFunc,
    fused_dense_func,
    fused_mlp_func,
)
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
ACTS = {"gelu_approx": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu, "sqrelu": lambda t: F.relu(t) ** 2}


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    request.getfixturevalue(f"{request.param}_backend")
    return request.param


@pytest.mark.parametrize("act,lvl,dtype,bias", [
    ("gelu_approx", 0, BF16, True),
    ("gelu_approx", 1, F32, True),
    ("gelu_approx", 2, F16, False),
    ("relu", 0, BF16, True),
    ("relu", 2, F32, True),
    ("sqrelu", 1, BF16, True),
])
def test_fused_mlp_tolerance(backend, act, lvl, dtype, bias):
    m = FusedMLP(13, 37, 11, bias1=bias, bias2=bias, activation=act, checkpoint_lvl=lvl, dtype=dtype)
    x = make_noncontiguous(randn((2, 5, 13), dtype, scale=2.0)).requires_grad_()
    y = m(x)
    assert y.shape == (2, 5, 11) and y.dtype == dtype
    g = randn(y.shape, dtype)
    params = list(m.parameters())
    got = (y, *torch.autograd.grad(y, [x, *params], g))
    refs = {}
    for hi in (True, False):
        cp = [t.detach().to(F64 if hi else dtype).requires_grad_() for t in (x, *params)]
        w1, *rest = cp[1:]
        b1, w2, b2 = (rest[0], rest[1], rest[2]) if bias else (None, rest[0], None)
        yr = F.linear(ACTS[act](F.linear(cp[0], w1, b1)), w2, b2)
        refs[hi] = (yr, *torch.autograd.grad(yr, cp, g.to(yr.dtype)))
    for i, (a, rh, rl) in enumerate(zip(got, refs[True], refs[False])):
        assert torch.isfinite(a).all()
        assert_close_tolerance(a, rh, rl, name=f"output {i} [{act} lvl={lvl} {dtype}]")


def _saved_hidden(m, x):
    """Number of ``(tokens, hidden)`` tensors the forward saves for the backward."""
    hidden = m.fc1.weight.shape[0]
    count = 0

    def pack(t):
        nonlocal count
        count += t.dim() == 2 and t.shape == (x.shape[0], hidden)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x)
    return count


def test_checkpoint_levels_save_what_they_say():
    x = randn((6, 8), requires_grad=True)
    expect = {"gelu_approx": (2, 1, 0), "sqrelu": (2, 1, 0), "relu": (1, 1, 0)}
    for act, counts in expect.items():
        got = tuple(_saved_hidden(FusedMLP(8, 24, 8, activation=act, checkpoint_lvl=lvl), x) for lvl in (0, 1, 2))
        assert got == counts, (act, got)
    # Eval mode passes save_pre_act=False: level 2 whatever the module's level.
    assert _saved_hidden(FusedMLP(8, 24, 8, checkpoint_lvl=0).eval(), x) == 0


def test_fused_mlp_api(backend):
    m = FusedMLP(8)
    assert m.fc1.weight.shape == (32, 8) and m.fc2.weight.shape == (8, 32)  # hidden 4x, out = in
    assert FusedMLP(8, activation="sqrelu").heuristic == -1
    x = randn((3, 8), requires_grad=True)
    mr = FusedMLP(8, 16, return_residual=True)
    out, res = mr(x)
    assert res is x and out.shape == (3, 8)
    ref = F.linear(F.gelu(F.linear(x, mr.fc1.weight, mr.fc1.bias), approximate="tanh"), mr.fc2.weight, mr.fc2.bias)
    torch.testing.assert_close(out, ref)
    (out.sum() + res.square().sum()).backward()
    dref = torch.autograd.grad(ref.sum(), x)[0] + 2 * x.detach()
    torch.testing.assert_close(x.grad, dref)
    # The functional and FusedMLPFunc (biases interleaved with weights) agree.
    w1, b1, w2, b2 = mr.fc1.weight, mr.fc1.bias, mr.fc2.weight, mr.fc2.bias
    y1 = fused_mlp_func(x, w1, w2, b1, b2, activation="relu", checkpoint_lvl=1)
    y2 = FusedMLPFunc.apply(x, w1, b1, w2, b2, "relu", True, False, 1, 0)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    # FusedDense: nn.Linear parameters, return_residual, FusedDenseFunc.apply.
    d = FusedDense(8, 5, return_residual=True)
    o, r = d(x)
    assert r is x
    torch.testing.assert_close(o, F.linear(x, d.weight, d.bias))
    torch.testing.assert_close(FusedDenseFunc.apply(x, d.weight, None), x @ d.weight.t())
    torch.testing.assert_close(fused_dense_func(x, d.weight, d.bias), o)
    with torch.autocast("cpu", dtype=BF16):
        assert FusedMLP(8, 16)(x).dtype == BF16


def test_bad_arguments():
    with pytest.raises(ValueError, match="activation must be one of .*'gelu'"):
        FusedMLP(8, 16, activation="gelu")
    with pytest.raises(ValueError, match="checkpoint_lvl must be 0, 1 or 2, got 3"):
        FusedMLP(8, 16, checkpoint_lvl=3)
    with pytest.raises(ValueError, match="heuristic must be"):
        fused_mlp_func(torch.randn(2, 8), torch.randn(16, 8), torch.randn(8, 16), heuristic=7)
    with pytest.raises(ValueError, match=r"weight2 must have shape \(out_features, 16\)"):
        fused_mlp_func(torch.randn(2, 8), torch.randn(16, 8), torch.randn(8, 15))
    with pytest.raises(TypeError, match="x is torch.float64 but weight1's parameters are torch.float32"):
        FusedMLP(8, 16)(torch.randn(2, 8, dtype=F64))


def test_torch_compile_fullgraph():
    m = FusedMLP(8, 24, 6, checkpoint_lvl=1)
    x = randn((5, 8), requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    params = list(m.parameters())
    y = compiled(x)
    got = torch.autograd.grad(y.square().sum(), [x, *params])
    y_ref = m(x)
    ref = torch.autograd.grad(y_ref.square().sum(), [x, *params])
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- tensor parallel


def _tp_worker(rank, world):
    import torch.distributed as dist

    from culmen.flash_attn.ops.fused_dense import ParallelFusedMLP

    pg = dist.group.WORLD
    errs = {}
    torch.manual_seed(0)  # the same full weights, input and cotangent on every rank
    d_in, hid, t = 12, 16, 6
    w1, b1 = torch.randn(hid, d_in, dtype=F64), torch.randn(hid, dtype=F64)
    w2, b2 = torch.randn(d_in, hid, dtype=F64), torch.randn(d_in, dtype=F64)
    xf, gf = torch.randn(t, d_in, dtype=F64), torch.randn(t, d_in, dtype=F64)
    leaves = [p.clone().requires_grad_() for p in (xf, w1, b1, w2, b2)]
    ref = F.linear(F.gelu(F.linear(leaves[0], leaves[1], leaves[2]), approximate="tanh"), leaves[3], leaves[4])
    dref = dict(zip(("x", "w1", "b1", "w2", "b2"), torch.autograd.grad(ref, leaves, gf)))
    h, r = hid // world, t // world
    for sp in (True, False):
        m = ParallelFusedMLP(d_in, hid, process_group=pg, sequence_parallel=sp, dtype=F64)
        with torch.no_grad():
            m.fc1.weight.copy_(w1[rank * h:(rank + 1) * h])
            m.fc1.bias.copy_(b1[rank * h:(rank + 1) * h])
            m.fc2.weight.copy_(w2[:, rank * h:(rank + 1) * h])
            if rank == 0:
                m.fc2.bias.copy_(b2)
        rows = slice(rank * r, (rank + 1) * r) if sp else slice(None)
        x = xf[rows].clone().requires_grad_()
        out = m(x)
        out.backward(gf[rows])
        k = f"sp={sp}"
        errs[f"{k} out"] = (out - ref.detach()[rows]).abs().max().item()
        errs[f"{k} dx"] = (x.grad - dref["x"][rows]).abs().max().item()
        errs[f"{k} dw1"] = (m.fc1.weight.grad - dref["w1"][rank * h:(rank + 1) * h]).abs().max().item()
        errs[f"{k} db1"] = (m.fc1.bias.grad - dref["b1"][rank * h:(rank + 1) * h]).abs().max().item()
        errs[f"{k} dw2"] = (m.fc2.weight.grad - dref["w2"][:, rank * h:(rank + 1) * h]).abs().max().item()
        if rank == 0:
            errs[f"{k} db2"] = (m.fc2.bias.grad - dref["b2"]).abs().max().item()
        else:
            errs[f"{k} no bias2"] = float(m.fc2.bias is not None)
    return errs


def test_tensor_parallel_two_gloo_ranks():
    results = run_group(_tp_worker, 2)
    for rank, errs in enumerate(results):
        assert len(errs) == 12, errs
        bad = {k: v for k, v in errs.items() if v > 1e-10}
        assert not bad, f"rank {rank}: {bad}"
