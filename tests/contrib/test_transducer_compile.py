"""``torch.compile(fullgraph=True)`` of ``culmen.contrib.transducer``'s ``TransducerJoint`` and ``TransducerLoss``:
they trace as the custom ops ``culmen::transducer_joint_fwd`` / ``culmen::rnnt_loss_fwd`` (no graph break), and
the compiled outputs and input gradients equal the eager calls' (reference and Triton-interpreter backends),
dense and packed; dropout's mask is replayed by the compiled backward."""

from __future__ import annotations

import pytest
import torch
from compile_checks import compile_keeping_graphs as _compile  # tests/contrib helper

from culmen.contrib.transducer import TransducerJoint, TransducerLoss
from culmen.ops.backend import use_backend
from culmen.ops.transducer import rnnt_loss_ref
from culmen.testing import randn
from culmen.testing.tolerance import assert_close_tolerance

F_LEN = torch.tensor([5, 3, 4])
G_LEN = torch.tensor([4, 1, 3])




def _run(fn, inputs, seed=3):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*xs)
    # drawn in float64 so that every dtype's run gets the same output gradient
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(y.device, y.dtype)
    return y, torch.autograd.grad(y, xs, dy)


def _same(a, b):
    torch.testing.assert_close(a[0], b[0])
    for ga, gb in zip(a[1], b[1]):
        torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("pack", [False, True])
def test_joint_compiled(backend, pack):
    f, g = randn((3, 5, 6)), randn((3, 4, 6))
    boff = torch.cumsum(F_LEN * G_LEN, 0)
    rows = int(boff[-1]) + 2  # two spare rows: zero in the packed output
    joint = TransducerJoint(pack_output=pack, relu=True)

    def fn(f, g):
        return joint(f, g, F_LEN, G_LEN, boff, rows) * 2.0

    graphs: list = []
    with use_backend(backend):
        eager = _run(fn, [f, g])
        compiled = _run(_compile(fn, graphs), [f, g])
    assert any("transducer_joint_fwd" in code for code in graphs), graphs
    assert compiled[0].shape == ((rows, 6) if pack else (3, 5, 4, 6))
    _same(compiled, eager)


def test_joint_compiled_dropout_mask_replayed():
    """The compiled backward replays the forward's dropout draw: the gradients are the mask-gated sums."""
    f, g = randn((2, 4, 8), requires_grad=True), randn((2, 3, 8), requires_grad=True)
    f_len, g_len = torch.tensor([4, 2]), torch.tensor([3, 2])
    joint = TransducerJoint(relu=True, dropout=True, dropout_prob=0.3, probe_mask=True)
    graphs: list = []
    h = _compile(lambda f, g: joint(f, g, f_len, g_len), graphs)(f, g)
    assert any("transducer_joint_fwd" in code for code in graphs)
    mask = joint.mask_probe[-1].bool()
    assert 0 < int(mask.sum()) < mask.numel()
    s = f.detach().unsqueeze(2) + g.detach().unsqueeze(1)
    valid = ((torch.arange(4).view(1, 4, 1) < f_len.view(2, 1, 1)) &
             (torch.arange(3).view(1, 1, 3) < g_len.view(2, 1, 1))).unsqueeze(-1)
    want = torch.where(valid, torch.where(mask, s / 0.7, 0.0), -1.0)
    torch.testing.assert_close(h, want)
    dh = randn(h.shape)
    df, dg = torch.autograd.grad(h, (f, g), dh)
    gate = torch.where(mask & valid, dh / 0.7, 0.0)
    torch.testing.assert_close(df, gate.sum(2))
    torch.testing.assert_close(dg, gate.sum(1))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_loss_compiled_dense(backend):
    B, T, U, K = 3, 5, 4, 7
    x = randn((B, T, U, K))
    y_len = G_LEN - 1 + torch.tensor([0, 1, 0])
    label = torch.randint(0, K - 1, (B, U - 1), generator=torch.Generator().manual_seed(1))
    loss = TransducerLoss()

    def fn(x, debug):
        return loss(x, label, F_LEN, y_len, K - 1, debug_list=debug)

    graphs: list = []
    with use_backend(backend):
        eager_dbg: list = []
        eager = _run(lambda x: fn(x, eager_dbg), [x])
        comp_dbg: list = []
        compiled_fn = _compile(fn, graphs)
        compiled = _run(lambda x: compiled_fn(x, comp_dbg), [x])
    assert any("rnnt_loss_fwd" in code for code in graphs), graphs
    _same(compiled, eager)
    # debug_list gets alpha and beta under compile too; alpha[b, 0, 0] = 0, beta[b, 0, 0] = -loss
    assert len(comp_dbg) == 2 and comp_dbg[0].shape == (B, T, U)
    torch.testing.assert_close(comp_dbg[1][:, 0, 0].to(x.dtype), -compiled[0].detach())
    # and the textbook definition in float64
    x64 = x.double().requires_grad_()
    ref = rnnt_loss_ref(x64, label, F_LEN, y_len, K - 1)
    assert_close_tolerance(compiled[0], ref.detach(), None, atol=1e-4)
    dy = torch.randn(B, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (dref,) = torch.autograd.grad(ref, x64, dy)
    assert_close_tolerance(compiled[1][0], dref, None, atol=1e-5)


def test_loss_compiled_packed():
    B, T, U, K = 3, 5, 4, 6
    y_len = torch.tensor([3, 0, 2])
    boff = torch.cumsum(F_LEN * (y_len + 1), 0)
    x = randn((int(boff[-1]), K))
    label = torch.randint(0, K, (B, U - 1), generator=torch.Generator().manual_seed(2))
    loss = TransducerLoss(packed_input=True)

    def fn(x):
        return loss(x, label, F_LEN, y_len, 0, boff, T)

    graphs: list = []
    eager = _run(fn, [x])
    compiled = _run(_compile(fn, graphs), [x])
    assert any("rnnt_loss_fwd" in code for code in graphs)
    _same(compiled, eager)


def test_opcheck():
    """The ops' schemas, fake implementations (shapes, strides, dtypes of the real outputs) and autograd
    registration hold (``torch.library.opcheck``)."""
    ops = torch.ops.culmen
    checks = ("test_schema", "test_faketensor", "test_autograd_registration")
    f, g = randn((3, 5, 6), requires_grad=True), randn((3, 4, 6), requires_grad=True)
    boff = torch.cumsum(F_LEN * G_LEN, 0)
    rng = torch.tensor([123, 456])
    torch.library.opcheck(ops.transducer_joint_fwd.default, (f, g, F_LEN, G_LEN, boff, rng, 30, True, True, 0.2, True),
                          test_utils=checks)
    torch.library.opcheck(ops.transducer_joint_fwd.default, (f, g, F_LEN, G_LEN, None, None, 0, False, False, None,
                                                             False), test_utils=checks)
    torch.library.opcheck(ops.transducer_joint_bwd.default, (randn((30, 6)), f.detach(), g.detach(), F_LEN, G_LEN,
                                                             boff, rng, 30, True, True, 0.2), test_utils=checks)
    x = randn((3, 5, 4, 7), requires_grad=True)
    label, y_len = torch.tensor([[1, 2, 3], [0, 0, 0], [4, 5, 6]]), torch.tensor([3, 0, 2])
    torch.library.opcheck(ops.rnnt_loss_fwd.default, (x, label, F_LEN, y_len, None, 6, 0, False), test_utils=checks)
    stats = ops.rnnt_loss_fwd(x.detach(), label, F_LEN, y_len, None, 6, 0, False)[1:]
    torch.library.opcheck(ops.rnnt_loss_bwd.default, (randn((3,)), x.detach(), label, F_LEN, y_len, None, *stats, 6, 0,
                                                      False), test_utils=checks)


def test_compiled_dynamic_shapes():
    """A second batch of other sizes recompiles with symbolic sizes (packed row count, ``max_f_len`` included):
    a packed joint with ReLU feeding a packed loss still equals eager."""
    joint = TransducerJoint(pack_output=True, relu=True)
    loss = TransducerLoss(packed_input=True)

    def fn(f, g, f_len, y_len, boff, rows, label, w, T):
        h = joint(f, g, f_len, y_len + 1, boff, rows)
        return loss(h @ w, label, f_len, y_len, 0, boff, T)

    graphs: list = []
    compiled = _compile(fn, graphs)
    for seed, (B, T, U, H, K) in ((0, (2, 5, 3, 4, 5)), (1, (3, 4, 4, 4, 5))):
        gen = torch.Generator().manual_seed(seed)
        f_len = torch.randint(1, T + 1, (B,), generator=gen)
        y_len = torch.randint(0, U, (B,), generator=gen)
        boff = torch.cumsum(f_len * (y_len + 1), 0)
        label = torch.randint(1, K, (B, U - 1), generator=gen)
        args = (f_len, y_len, boff, int(boff[-1]), label, randn((H, K)), T)
        inputs = [randn((B, T, H)), randn((B, U, H))]
        eager = _run(lambda f, g, a=args: fn(f, g, *a), inputs, seed)
        comp = _run(lambda f, g, a=args: compiled(f, g, *a), inputs, seed)
        assert comp[0].shape == (B,)
        _same(comp, eager)
    assert len(graphs) == 2 and "transducer_joint_fwd" in graphs[1] and "rnnt_loss_fwd" in graphs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_compiled_gpu(dtype):
    """On a GPU the ops' bodies launch the Triton kernels through ``wrap_triton`` and Inductor (the default
    backend) compiles the graph: a packed joint with ReLU feeding a packed loss, at a size where several
    programs share each dimension, equals the eager kernels; a second batch of other lengths runs through
    the dynamic-shape recompile."""
    dev = "cuda"

    def case(B, T, U, H, K, seed):
        gen = torch.Generator().manual_seed(seed)
        f_len = torch.randint(T // 2, T + 1, (B,), generator=gen).to(dev)
        y_len = torch.randint(0, U, (B,), generator=gen).to(dev)
        boff = torch.cumsum(f_len * (y_len + 1), 0)
        label = torch.randint(0, K - 1, (B, U - 1), generator=gen).to(dev)
        f, g = randn((B, T, H), dtype, dev), randn((B, U, H), dtype, dev)
        w = randn((H, K), dtype, dev, scale=H ** -0.5)
        return f, g, f_len, y_len, boff, label, w, T

    joint = TransducerJoint(pack_output=True, relu=True)
    loss = TransducerLoss(packed_input=True)

    def fn(f, g, f_len, y_len, boff, rows, label, w, T):
        h = joint(f, g, f_len, y_len + 1, boff, rows)
        return loss(h @ w, label, f_len, y_len, K - 1, boff, T)

    K = 33
    compiled = torch.compile(fn, fullgraph=True)
    torch._dynamo.reset()
    for seed, dims in ((0, (4, 37, 9, 64)), (1, (3, 29, 12, 64))):
        f, g, f_len, y_len, boff, label, w, T = case(*dims, K, seed)
        rows = int(boff[-1])
        args = (f_len, y_len, boff, rows, label, w, T)
        eager = _run(lambda f, g, a=args: fn(f, g, *a), [f, g])
        comp = _run(lambda f, g, a=args: compiled(f, g, *a), [f, g])
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(comp[0], eager[0], **tol)
        for a, b in zip(comp[1], eager[1]):
            torch.testing.assert_close(a, b, **tol)
