"""``culmen.transformer.layers``: the norms equal a float64 LayerNorm (output and every gradient), mark
their parameters with ``sequence_parallel_enabled``, and under sequence parallelism on 2 gloo ranks the
marked parameters' gradients summed over the tensor-parallel group equal the unsharded gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from culmen.testing.tolerance import assert_close_tolerance
from culmen.transformer.layers import FastLayerNorm, FusedLayerNorm, MixedFusedLayerNorm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402


def _randomize(m, gen):
    with torch.no_grad():
        m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
        m.bias.copy_(torch.randn(m.bias.shape, generator=gen))


def _check_against_float64(m, x_dtype, hidden, out_dtype):
    gen = torch.Generator().manual_seed(3)
    _randomize(m, gen)
    x = (torch.randn(3, 5, hidden, generator=gen) * 2 + 0.5).to(x_dtype)
    x_t = x.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(True)  # non-contiguous input
    g = torch.randn(3, 5, hidden, generator=gen)
    y = m(x_t)
    assert y.dtype == out_dtype and y.shape == x.shape
    y.backward(g.to(y.dtype))

    def ref(dtype, xin, w, b):
        return F.layer_norm(xin.to(dtype), (hidden,), w.to(dtype), b.to(dtype), m.eps if hasattr(m, "eps")
                            else m.epsilon)

    x64 = x.double().requires_grad_(True)
    w64 = m.weight.detach().double().requires_grad_(True)
    b64 = m.bias.detach().double().requires_grad_(True)
    y64 = ref(torch.float64, x64, w64, b64)
    y64.backward(g.double())
    lo_dtype = torch.promote_types(x_dtype, m.weight.dtype) if out_dtype != x_dtype else x_dtype
    xl = x.to(lo_dtype).requires_grad_(True)
    wl = m.weight.detach().to(lo_dtype).requires_grad_(True)
    bl = m.bias.detach().to(lo_dtype).requires_grad_(True)
    yl = ref(lo_dtype, xl, wl, bl)
    yl.backward(g.to(lo_dtype))
    assert_close_tolerance(y, y64, yl, name="out")
    assert_close_tolerance(x_t.grad, x64.grad, xl.grad, name="dx")
    assert_close_tolerance(m.weight.grad, w64.grad, wl.grad, name="dweight")
    assert_close_tolerance(m.bias.grad, b64.grad, bl.grad, name="dbias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_norm_matches_float64(dtype):
    m = FusedLayerNorm(123, eps=1e-5, sequence_parallel_enabled=True, dtype=dtype)
    _check_against_float64(m, dtype, 123, dtype)


def test_mixed_fused_layer_norm_returns_param_dtype():
    m = MixedFusedLayerNorm(63, eps=1e-4, sequence_parallel_enabled=True)
    _check_against_float64(m, torch.bfloat16, 63, torch.float32)


def test_fast_layer_norm_matches_float64():
    m = FastLayerNorm(97, sequence_parallel_enabled=False)
    _check_against_float64(m, torch.float32, 97, torch.float32)


def test_marking():
    for cls, kw in ((FusedLayerNorm, {}), (MixedFusedLayerNorm, {}), (FastLayerNorm, {})):
        for flag in (False, True):
            m = cls(16, sequence_parallel_enabled=flag, **kw)
            assert m.sequence_parallel_enabled is flag
            assert m.weight.sequence_parallel_enabled is flag and m.bias.sequence_parallel_enabled is flag
    assert FusedLayerNorm(8).weight.sequence_parallel_enabled is False
    plain = FusedLayerNorm((4, 8), elementwise_affine=False, sequence_parallel_enabled=True)
    assert plain.sequence_parallel_enabled is True and plain.weight is None
    with pytest.raises(TypeError, match="sequence_parallel_enabled must be a bool, got 'yes'"):
        FusedLayerNorm(8, sequence_parallel_enabled="yes")
    with pytest.raises(TypeError):
        FusedLayerNorm(8, 1e-5, True, True)  # keyword only, as in Apex


def _sp_worker(rank, world, seq, hidden):
    import torch.distributed as dist

    from culmen.transformer import parallel_state as ps
    from culmen.transformer.layers import FusedLayerNorm, MixedFusedLayerNorm

    ps.initialize_model_parallel(world, 1)
    out = []
    for cls in (FusedLayerNorm, MixedFusedLayerNorm):
        gen = torch.Generator().manual_seed(11)
        x = torch.randn(seq, 2, hidden, generator=gen, dtype=torch.float64)
        g = torch.randn(seq, 2, hidden, generator=gen, dtype=torch.float64)
        m = cls(hidden, sequence_parallel_enabled=True, dtype=torch.float64)
        _randomize(m, gen)
        shard = seq // world
        rows = slice(rank * shard, (rank + 1) * shard)
        xs = x[rows].clone().requires_grad_(True)
        m(xs).backward(g[rows])
        for p in m.parameters():
            if getattr(p, "sequence_parallel_enabled", False):
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        out.append((xs.grad, m.weight.grad, m.bias.grad, m.weight.detach(), m.bias.detach(), x, g))
    ps.destroy_model_parallel()
    return out


def test_sequence_parallel_grads_sum_to_full():
    seq, hidden = 6, 33
    results = run_group(_sp_worker, 2, seq, hidden)
    for case in range(2):
        _, _, _, w, b, x, g = results[0][case]
        x = x.clone().requires_grad_(True)
        w = w.clone().requires_grad_(True)
        b = b.clone().requires_grad_(True)
        F.layer_norm(x, (hidden,), w, b, 1e-5).backward(g)  # culmen keeps statistics in fp32: ~1e-7 off
        dx = torch.cat([results[r][case][0] for r in range(2)])
        torch.testing.assert_close(dx, x.grad, rtol=1e-5, atol=2e-6)
        for r in range(2):
            torch.testing.assert_close(results[r][case][1], w.grad, rtol=1e-5, atol=2e-6)
            torch.testing.assert_close(results[r][case][2], b.grad, rtol=1e-5, atol=2e-6)
