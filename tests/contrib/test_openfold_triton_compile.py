"""``culmen.contrib.openfold_triton``'s attention under ``torch.compile(fullgraph=True)``: the pair-attention
custom ops (``culmen::pair_attention_fwd`` / ``_bwd``) and their fake implementations trace without a graph
break, and the compiled call equals the eager one in the output and the gradients of q, k, v and the bias
(OpenFold's triangle layout, a broadcast pair bias and a key mask), on the kernels and on the reference."""

from __future__ import annotations

import pytest
import torch

from culmen.contrib.openfold_triton import AttnTri
from culmen.ops.pair_attention import pair_attention, pair_attention_ref
from culmen.testing import assert_close_tolerance, randn


def _inputs(dtype=torch.float32, B=1, rows=3, H=2, N=11, D=16, device="cpu"):
    q, k, v = (randn((B, rows, H, N, D), dtype, device).requires_grad_(True) for _ in range(3))
    bias = randn((B, 1, H, N, N), dtype, device).requires_grad_(True)
    mask = torch.rand((B, rows, 1, 1, N), device=device) > 0.3
    mask[..., 0] = True  # no fully masked row
    return q, k, v, bias, mask


def _run(fn, q, k, v, bias, mask, do):
    out = fn(q, k, v, bias, mask)
    return (out, *torch.autograd.grad(out, (q, k, v, bias), do))


def _fwd_bwd_ops(fn, *args):
    """The ``culmen::pair_attention_*`` ops in the aot graphs of ``fn`` (forward and backward)."""
    seen = []

    def backend(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def collect(g, _):
            seen.extend(str(n.target) for n in g.graph.nodes if "pair_attention" in str(n.target))
            return make_boxed_func(g)

        return aot_autograd(fw_compiler=collect, bw_compiler=collect)(gm, example_inputs)

    out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    out.sum().backward()
    return seen


@pytest.mark.parametrize("fn_name", ["AttnTri", "pair_attention"])
def test_compiled_equals_eager_kernels(triton_backend, fn_name):
    torch._dynamo.reset()
    fn = {"AttnTri": lambda q, k, v, b, m: AttnTri(q, k, v, m, b, 1e9, True),
          "pair_attention": lambda q, k, v, b, m: pair_attention(q, k, v, b, m, 1e9)}[fn_name]
    args = _inputs()
    do = randn(args[0].shape, args[0].dtype)
    eager = _run(fn, *args, do)
    compiled = _run(torch.compile(fn, fullgraph=True, backend="aot_eager"), *args, do)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), compiled, eager):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, msg=name)
    # And both against the float64 reference (the compiled graph does run the kernels' math).
    ref = _run(lambda *a: pair_attention_ref(*a), *[t.detach().double().requires_grad_(t.requires_grad)
                                                      if t.dtype != torch.bool else t for t in args], do.double())
    for name, a, r in zip(("out", "dq", "dk", "dv", "dbias"), compiled, ref):
        assert_close_tolerance(a, r, r.to(a.dtype), name=name)


def test_custom_ops_in_graph(triton_backend):
    """The kernels reach the compiled graph as the two custom ops (no traced reference)."""
    torch._dynamo.reset()
    q, k, v, bias, mask = _inputs(N=7, D=8)
    ops = _fwd_bwd_ops(lambda q, k, v, b: pair_attention(q, k, v, b, mask), q, k, v, bias)
    assert any("pair_attention_fwd" in o for o in ops), ops
    assert any("pair_attention_bwd" in o for o in ops), ops


def test_compiled_reference_path(reference_backend):
    """Calls the kernels do not take trace the reference formula; no bias, float mask, 4-d layout."""
    torch._dynamo.reset()
    q, k, v = (randn((2, 3, 9, 8), torch.float32).requires_grad_(True) for _ in range(3))
    mask = (torch.rand((2, 1, 1, 9)) > 0.3).float()
    mask[..., 0] = 1.0

    def fn(q, k, v):
        return AttnTri(q, k, v, mask, None, 1e9, True)

    do = randn(q.shape, q.dtype)
    res = [(o, *torch.autograd.grad(o, (q, k, v), do)) for o in (fn(q, k, v),
                                                                  torch.compile(fn, fullgraph=True,
                                                                                backend="aot_eager")(q, k, v))]
    for a, b in zip(res[1], res[0]):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_inductor_gpu(dtype):
    torch._dynamo.reset()
    q, k, v, bias, mask = _inputs(dtype, B=1, rows=64, H=4, N=128, D=32, device="cuda")

    def fn(q, k, v, b, m):
        return AttnTri(q, k, v, m, b, 1e9, True)

    do = randn(q.shape, dtype, "cuda")
    eager = _run(fn, q, k, v, bias, mask, do)
    compiled = _run(torch.compile(fn, fullgraph=True), q, k, v, bias, mask, do)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), compiled, eager):
        torch.testing.assert_close(a, b, msg=name)
