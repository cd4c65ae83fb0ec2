"""``culmen.set_compile_fusion``: under ``torch.compile`` the fusable ops (norms without dropout, dense rotary,
``bias_act`` / ``gated_act``) trace as plain PyTorch, so no culmen custom op is left in the graph for Inductor
to work around; with the switch off they are ``triton_op`` nodes. Both forms equal the eager call (the
reference path on CPU) in values and gradients, for every form of the rotary the formula serves."""

from __future__ import annotations

import pytest
import torch

import culmen
from culmen.ops.activations import gated_act
from culmen.ops.layer_norm import layer_norm
from culmen.ops.rotary import rotary
from culmen.testing import randn

F64 = torch.float64


def _tables(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(rows, width, dtype=F64) * 6.3
    return ang.cos().float(), ang.sin().float()


def _culmen_nodes(fn, *args) -> list[str]:
    """The culmen custom-op calls in the graph Dynamo hands its backend (after AOT tracing: ops only)."""
    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "culmen" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return seen


def _block(x, res, w, qkv, cos, sin, g, u):
    o = layer_norm(x, w, residual=res, is_rms_norm=True, return_residual=True)
    y, r = o.y, o.residual_out
    q = rotary(qkv[:, :, :2], cos, sin, inplace=True)  # Q and K of a packed qkv, in place
    return y, r, q, gated_act(g, u, "silu")


def _block_inputs():
    B, S, H, D, N = 2, 6, 2, 8, 24
    cos, sin = _tables(S, D // 2)
    return (randn((B, S, N), requires_grad=True), randn((B, S, N), requires_grad=True), randn(N, requires_grad=True),
            randn((B, S, 3, H, D)) * 1.0, cos, sin, randn((5, 12), requires_grad=True),
            randn((5, 12), requires_grad=True))


def test_fusion_leaves_no_culmen_op(compile_fusion):
    args = _block_inputs()
    nodes = _culmen_nodes(_block, *args)
    if compile_fusion:
        assert nodes == []
    else:
        assert any("layer_norm" in n for n in nodes) and any("rotary" in n for n in nodes)
        assert any("glu" in n for n in nodes)


def test_dropout_keeps_the_kernel_op():
    """Dropout masks come from culmen's Philox streams: that norm stays culmen's op even with fusion on."""
    x, w = randn((4, 16), requires_grad=True), randn(16, requires_grad=True)
    assert any("layer_norm" in n for n in _culmen_nodes(lambda a, b: layer_norm(a, b, dropout_p=0.1).y, x, w))


def test_block_matches_eager(compile_fusion):
    args = _block_inputs()
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def run(f):
        qkv = args[3].clone().requires_grad_()
        outs = f(*args[:3], qkv * 1.0, *args[4:])
        cots = [torch.randn_like(o, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(outs)]
        loss = sum((o * c).sum() for o, c in zip(outs, cots))
        return (*outs, *torch.autograd.grad(loss, leaves + [qkv]))

    eager = run(_block)
    torch._dynamo.reset()
    comp = run(torch.compile(_block, fullgraph=True, backend="aot_eager"))
    for i, (e, c) in enumerate(zip(eager, comp)):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5, msg=f"output {i}")


@pytest.mark.parametrize("form", ["offsets", "seq_first", "interleaved_partial", "conjugate_full_table", "5d_offset",
                                  "fp16"])
def test_rotary_formula_forms(form):
    """Every form the traced formula serves, against the eager call (values and the gradient of x)."""
    B, S, H, D = 3, 5, 2, 12
    kw: dict = {}
    shape = (B, S, H, D)
    cos, sin = _tables(S + 3, 4)
    dtype = torch.float32
    if form == "offsets":  # the last sequence runs past the tables: those positions pass through
        kw["seqlen_offsets"] = torch.tensor([0, 3, 6])
    elif form == "seq_first":
        shape, kw["seq_first"] = (S, B, H, D), True
    elif form == "interleaved_partial":
        kw["interleaved"], kw["seqlen_offsets"] = True, 2
    elif form == "conjugate_full_table":
        cos, sin = _tables(S, 10)
        kw["conjugate"], kw["full_table"] = True, True
    elif form == "5d_offset":
        shape = (B, S, 2, H, D)
        kw["seqlen_offsets"] = 1
    else:
        dtype = torch.float16
    x = randn(shape, dtype, requires_grad=True)
    g = randn(shape, dtype)

    def fn(t):
        return rotary(t, cos, sin, **kw)

    def run(f):
        y = f(x)
        return y, torch.autograd.grad((y.float() * g.float()).sum(), x)[0]

    eager = run(fn)
    torch._dynamo.reset()
    comp = run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    tol = 1e-3 if dtype == torch.float16 else 1e-5
    for e, c, name in zip(eager, comp, ("y", "dx")):
        assert c.dtype == e.dtype
        torch.testing.assert_close(c, e, rtol=tol, atol=tol, msg=name)


def test_rotary_formula_checks_offsets():
    cos, sin = _tables(4, 4)
    x = randn((1, 3, 2, 8))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="must lie within the 4 rows"):
        torch.compile(lambda t: rotary(t, cos, sin, seqlen_offsets=2), fullgraph=True, backend="aot_eager")(x)


def test_switch_validates():
    with pytest.raises(TypeError, match="set_compile_fusion expects a bool"):
        culmen.set_compile_fusion(1)


def test_rotary_formula_checks_shapes():
    """Bad inputs raise the eager call's error types under the traced formula too."""
    cos, sin = _tables(8, 4)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="x must be"):
        torch.compile(lambda t: rotary(t, cos, sin), fullgraph=True, backend="aot_eager")(randn((3, 2, 8)))
    with pytest.raises(Exception, match="rotary_dim"):
        torch.compile(lambda t: rotary(t, cos, sin), fullgraph=True, backend="aot_eager")(randn((1, 3, 2, 6)))
