"""ONNX export of models holding culmen's norm modules (Apex's, contrib's and flash_attn's).

While either exporter runs, ``culmen.ops.layer_norm.layer_norm`` computes with plain PyTorch ops
(``culmen/ops/layer_norm/export.py``). Checked two ways:

* without the ``onnx`` package: the graph each exporter sees (a TorchScript trace with the exporter's
  flag set, a ``torch.export`` program with the other exporter's flag set) holds no culmen op and no
  opaque autograd function, and computes what the eager module computes;
* with ``onnx`` (and ``onnxscript`` for ``dynamo=True``): ``torch.onnx.export`` itself, and the exported
  model run by ONNX's reference evaluator against the eager output.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch

from culmen.contrib.layer_norm import FastLayerNorm
from culmen.flash_attn.ops.layer_norm import DropoutAddLayerNorm
from culmen.flash_attn.ops.rms_norm import RMSNorm as LegacyRMSNorm
from culmen.flash_attn.ops.triton.layer_norm import RMSNorm as TritonRMSNorm
from culmen.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm


class _Block(torch.nn.Module):
    """A linear layer, then one norm module ``norm``; ``residual`` feeds the norm a second input."""

    def __init__(self, norm: torch.nn.Module, residual: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 12)
        self.norm = norm
        self.residual = residual

    def forward(self, x):
        h = self.lin(x)
        if self.residual:
            out = self.norm(h, x.new_ones(()) * h.flip(-1))
            return out[0] if isinstance(out, tuple) else out
        return self.norm(h)


def _randomize(m: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1.0)
    return m.eval()


MODELS = {
    "FusedLayerNorm": lambda: _Block(FusedLayerNorm(12)),
    "FusedRMSNorm": lambda: _Block(FusedRMSNorm(12, eps=1e-3)),
    "FusedLayerNorm-2d-shape": lambda: torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Unflatten(-1, (3, 4)),
                                                           FusedLayerNorm((3, 4))),
    "FusedLayerNorm-no-affine": lambda: _Block(FusedLayerNorm(12, elementwise_affine=False)),
    "MixedFusedLayerNorm": lambda: _Block(MixedFusedLayerNorm(12)),
    "MixedFusedRMSNorm": lambda: _Block(MixedFusedRMSNorm(12)),
    "FastLayerNorm": lambda: _Block(FastLayerNorm(12)),
    "flash_attn-RMSNorm": lambda: _Block(TritonRMSNorm(12, zero_centered_weight=True)),
    "flash_attn-legacy-RMSNorm": lambda: _Block(LegacyRMSNorm(12)),
    "flash_attn-DropoutAddLayerNorm": lambda: _Block(DropoutAddLayerNorm(12, prenorm=True), residual=True),
}


def _no_culmen_ops(graph_text: str) -> None:
    """No culmen op (``culmen::x`` in TorchScript, ``culmen.x.default`` in an FX graph), no autograd
    function (``prim::PythonOp``)."""
    assert not re.search(r"culmen::|culmen\.\w+\.default|PythonOp", graph_text), graph_text


@contextlib.contextmanager
def _flag(obj, name):
    old = getattr(obj, name)
    setattr(obj, name, True)
    try:
        yield
    finally:
        setattr(obj, name, old)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_traced_graphs_are_plain(name):
    """What each exporter sees, without needing the onnx package."""
    from torch.onnx._internal.exporter import _flags

    from culmen.ops.layer_norm.export import ONNX_TS

    m = _randomize(MODELS[name]())
    x = torch.randn(3, 5, 8)
    want = m(x)
    # TorchScript exporter: it traces the eager path with its flag set.
    with _flag(ONNX_TS, "in_onnx_export"), torch.no_grad():
        traced = torch.jit.trace(m, (x,), check_trace=False)
    _no_culmen_ops(str(traced.inlined_graph))
    torch.testing.assert_close(traced(x), want, rtol=1e-5, atol=1e-5)
    # torch.export based exporter: layer_norm runs under torch.compiler.is_compiling() with its flag set.
    with _flag(_flags, "_is_onnx_exporting"):
        ep = torch.export.export(m, (x,))
    _no_culmen_ops(str(ep.graph))
    torch.testing.assert_close(ep.module()(x), want, rtol=1e-5, atol=1e-5)


def test_export_path_matches_the_op():
    """The plain-op path against the op itself, feature by feature (residual, x1 with a second weight,
    rowscale, zero-centered weight, RMS, fp32 residual, out_dtype, prenorm): same outputs."""
    from culmen.ops.layer_norm import layer_norm
    from culmen.ops.layer_norm.export import layer_norm_export

    x, res, x1 = (torch.randn(4, 6, 16, dtype=torch.bfloat16) for _ in range(3))
    w, b, w1, b1 = (torch.randn(16) for _ in range(4))
    rowscale = torch.rand(4, 6)
    cases = [
        dict(),
        dict(residual=res, return_residual=True),
        dict(x1=x1, weight1=w1, bias1=b1, rowscale=rowscale, residual_in_fp32=True, return_residual=True),
        dict(is_rms_norm=True, zero_centered_weight=True, out_dtype=torch.float32),
        dict(is_rms_norm=True, residual=res.float(), return_residual=True),
    ]
    for kw in cases:
        op = layer_norm(x, w, b, eps=1e-5, **kw)
        args = {k: kw.get(k) for k in ("residual", "x1", "weight1", "bias1", "rowscale", "out_dtype")}
        got = layer_norm_export(x, w, b, args["residual"], args["x1"], args["weight1"], args["bias1"], 1e-5, 0.0,
                                args["rowscale"], kw.get("is_rms_norm", False), kw.get("zero_centered_weight", False),
                                kw.get("residual_in_fp32", False), args["out_dtype"], kw.get("return_residual", False),
                                False)
        for field, a in zip(("y", "y1", "residual_out"), got):
            e = getattr(op, field)
            assert (a is None) == (e is None), (kw, field)
            if a is not None:
                assert a.dtype == e.dtype and a.shape == e.shape, (kw, field)
                torch.testing.assert_close(a.float(), e.float(), rtol=1e-2, atol=1e-2)


def _onnx_run(onnx_bytes: bytes, x: torch.Tensor) -> torch.Tensor:
    import onnx
    from onnx.reference import ReferenceEvaluator

    model = onnx.load_from_string(onnx_bytes)
    sess = ReferenceEvaluator(model)
    (out,) = sess.run(None, {model.graph.input[0].name: x.numpy()})
    return torch.from_numpy(out)


@pytest.mark.parametrize("dynamo", [False, True])
@pytest.mark.parametrize("name", ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm", "FastLayerNorm",
                                  "flash_attn-RMSNorm", "flash_attn-DropoutAddLayerNorm"])
def test_torch_onnx_export(name, dynamo, tmp_path):
    pytest.importorskip("onnx", reason="torch.onnx.export needs the onnx package (pip install onnx)")
    if dynamo:
        pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
    m = _randomize(MODELS[name]())
    x = torch.randn(3, 5, 8)
    want = m(x).detach()
    if dynamo:
        prog = torch.onnx.export(m, (x,), dynamo=True, verbose=False)
        path = tmp_path / "m.onnx"
        prog.save(str(path))
        data = path.read_bytes()
    else:
        f = io.BytesIO()
        torch.onnx.export(m, (x,), f, dynamo=False)
        data = f.getvalue()
    got = _onnx_run(data, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
