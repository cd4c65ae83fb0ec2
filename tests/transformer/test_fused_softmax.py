"""Apex's ``FusedScaleMaskSoftmax`` family (``culmen.transformer.functional``) and the Megatron softmax
extension modules.

The fused path is checked with the tolerance rule against a float64 oracle, with Apex's own unfused
fallback (``forward_torch_softmax`` in fp16) as the low-precision baseline, at shapes Apex would not
fuse (odd ``sk``, ``sq`` and ``b * np`` not divisible by 4).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from culmen.ops.softmax import scaled_masked_softmax_ref
from culmen.testing import assert_close_tolerance, randn
from culmen.transformer import AttnMaskType, AttnType, LayerType, ModelType
from culmen.transformer.functional import FusedScaleMaskSoftmax, GenericFusedScaleMaskSoftmax
from culmen.transformer.functional import fused_softmax as fs

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

EXTENSIONS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda",
              "generic_scaled_masked_softmax_cuda")


def _mask_func(scores, mask):
    return scores.masked_fill(mask, -10000.0)


def _module(kind, dtype=F16, fusion=True, scale=0.5, cls=FusedScaleMaskSoftmax):
    fp16, bf16 = dtype == F16, dtype == BF16
    if cls is GenericFusedScaleMaskSoftmax:
        return cls(fp16, bf16, fusion, _mask_func, True, scale)
    return cls(fp16, bf16, kind, fusion, _mask_func, True, scale)


@pytest.mark.parametrize("kind", [AttnMaskType.padding, AttnMaskType.causal])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_fused_matches_oracle_where_apex_would_not_fuse(kind, dtype):
    b, np_, sq, sk = 3, 1, 5, 5
    if kind == AttnMaskType.padding:
        sk = 37
    sm = _module(kind, dtype)
    assert sm.is_kernel_available(None, b, np_, sq, sk)
    x = randn((b, np_, sq, sk), dtype, scale=3.0, requires_grad=True)
    mask = torch.rand(b, 1, sq, sk) < 0.3 if kind == AttnMaskType.padding else None
    y = sm(x, mask)
    g = randn(y.shape, dtype)
    y.backward(g)
    causal = kind == AttnMaskType.causal
    hi = x.detach().to(F64).requires_grad_()
    y_hi = scaled_masked_softmax_ref(hi, mask, 0.5, causal)
    lo_in = x.detach().clone().requires_grad_()
    lo_mask = mask if mask is not None else torch.ones(sq, sk, dtype=torch.bool).triu(1)
    y_lo = sm.forward_torch_softmax(lo_in, lo_mask)  # Apex's unfused fallback, rounded to the input dtype
    assert_close_tolerance(y, y_hi, y_lo, name="y")
    (d_hi,) = torch.autograd.grad(y_hi, hi, g.to(F64))
    (d_lo,) = torch.autograd.grad(y_lo, lo_in, g)
    assert_close_tolerance(x.grad, d_hi, d_lo, name="dx")
    assert y.dtype == dtype


def test_unfused_paths_follow_apex():
    x = randn((2, 2, 4, 6), F16)
    mask = torch.rand(2, 1, 4, 6) < 0.3
    # Fusion off, or fp32 flags: Apex's torch path (mask_func, fp32 softmax, cast back).
    for sm in (_module(AttnMaskType.padding, fusion=False), _module(AttnMaskType.padding, dtype=F32)):
        assert not sm.is_kernel_available(mask, 2, 2, 4, 6)
        ref = torch.softmax(_mask_func(x.float() * 0.5, mask), -1)
        ref = ref.half() if sm.input_in_fp16 else ref
        torch.testing.assert_close(sm(x if sm.input_in_fp16 else x.float(), mask), ref, rtol=0, atol=0)
    # Causal with sq != sk cannot use the causal kernel: the user's mask goes through mask_func.
    sm = _module(AttnMaskType.causal)
    assert not sm.is_kernel_available(None, 2, 2, 4, 6)
    torch.testing.assert_close(sm(x, mask), torch.softmax(_mask_func(x.float() * 0.5, mask), -1).half())


def test_generic_module_fuses_every_shape_and_dtype():
    sm = _module(None, F32, cls=GenericFusedScaleMaskSoftmax)
    assert sm.attn_mask_type == AttnMaskType.padding
    assert sm.is_kernel_available(None, 1, 1, 1, 1) and not sm.is_kernel_available(None, 1, 1, 1, 0)
    x = randn((1, 3, 2, 21))
    mask = torch.zeros(1, 1, 2, 21, dtype=torch.bool)
    mask[..., 1, :] = True  # a fully masked row
    y = sm(x, mask)
    torch.testing.assert_close(y, scaled_masked_softmax_ref(x, mask, 0.5), rtol=1e-6, atol=1e-6)
    assert torch.equal(y[:, :, 1], torch.zeros_like(y[:, :, 1]))


def test_autograd_functions():
    x3 = randn((4, 6, 6), BF16, requires_grad=True)
    y = fs.ScaledUpperTriangMaskedSoftmax.apply(x3, 0.3)
    y.sum().backward()
    torch.testing.assert_close(y.float(), scaled_masked_softmax_ref(x3.detach().float()[None], None, 0.3, True)[0],
                               rtol=0, atol=8e-3)
    x = randn((2, 2, 3, 9), requires_grad=True)
    mask = torch.rand(2, 1, 3, 9) < 0.3
    for fn, args in ((fs.ScaledMaskedSoftmax, (mask, 2.0)), (fs.GenericScaledMaskedSoftmax, (mask, 2.0)),
                     (fs.ScaledSoftmax, (2.0,))):
        y = fn.apply(x, *args)
        m = args[0] if len(args) == 2 else None
        g = randn(y.shape)
        (dx,) = torch.autograd.grad(y, x, g)
        xr = x.detach().to(F64).requires_grad_()
        yr = scaled_masked_softmax_ref(xr, m, 2.0)
        (dr,) = torch.autograd.grad(yr, xr, g.to(F64))
        assert_close_tolerance(y, yr, None, name=f"{fn.__name__} y")
        assert_close_tolerance(dx, dr, None, name=f"{fn.__name__} dx")


def test_init_errors_and_batch_per_block():
    with pytest.raises(RuntimeError, match="both fp16 and bf16"):
        FusedScaleMaskSoftmax(True, True, AttnMaskType.padding, True, _mask_func, True, None)
    with pytest.raises(RuntimeError, match="softmax should be in fp32 when scaled"):
        FusedScaleMaskSoftmax(True, False, AttnMaskType.padding, True, _mask_func, False, 0.5)
    with pytest.raises(ValueError, match="Invalid attn_mask_type"):
        FusedScaleMaskSoftmax(True, False, None, True, _mask_func, True, None)
    with pytest.raises(ValueError, match="4-D"):
        _module(AttnMaskType.padding)(randn((2, 3, 4), F16), None)
    with pytest.raises(ValueError, match="sq must equal sk"):
        fs.scaled_upper_triang_masked_softmax(randn((1, 1, 2, 3), F16), None, 1.0)
    # Apex's rows per 128-thread block: warp of min(next_pow2(sk), 32) lanes, 2 rows per warp up to 128.
    expect = {1: 256, 16: 16, 17: 8, 64: 8, 128: 8, 129: 4, 2048: 4, 16384: 4}
    for sk, n in expect.items():
        assert FusedScaleMaskSoftmax.get_batch_per_block(4, sk, 2, 8) == n, sk
    assert (AttnMaskType.padding.value, AttnMaskType.causal.value) == (1, 2)
    assert (AttnType.self_attn.value, LayerType.decoder.value, ModelType.encoder_and_decoder.value) == (1, 2, 2)


def test_extension_modules():
    mods = {n: importlib.import_module(f"culmen.transformer.functional._ext.{n}") for n in EXTENSIONS}
    x = randn((2, 3, 4, 4), F16)
    mask = torch.rand(2, 1, 4, 4) < 0.3
    g = randn((2, 3, 4, 4), F16)
    for name in ("scaled_masked_softmax_cuda", "generic_scaled_masked_softmax_cuda"):
        y = mods[name].forward(x, mask.to(torch.uint8), 0.25)
        torch.testing.assert_close(y.float(), scaled_masked_softmax_ref(x.float(), mask, 0.25), rtol=0, atol=1e-3)
        dx = mods[name].backward(g, y, 0.25)
        ref = 0.25 * y.float() * (g.float() - (g.float() * y.float()).sum(-1, keepdim=True))
        torch.testing.assert_close(dx.float(), ref, rtol=0, atol=2e-3)
        assert mods[name].get_batch_per_block(4, 4, 2, 3) == 64
    y = mods["scaled_softmax_cuda"].forward(x, 0.25)
    torch.testing.assert_close(y.float(), torch.softmax(x.float() * 0.25, -1), rtol=0, atol=1e-3)
    y3 = mods["scaled_upper_triang_masked_softmax_cuda"].forward(x.view(6, 4, 4), 0.25)
    assert torch.equal(y3.float().triu(1), torch.zeros(6, 4, 4))
    assert mods["scaled_upper_triang_masked_softmax_cuda"].backward(g.view(6, 4, 4), y3, 0.25).shape == (6, 4, 4)
    with pytest.raises(ValueError, match="expected 3D"):
        mods["scaled_upper_triang_masked_softmax_cuda"].forward(x, 1.0)
    with pytest.raises(ValueError, match="expected 4D"):
        mods["scaled_masked_softmax_cuda"].forward(x, mask[0], 1.0)


def test_extension_names_import_through_compat():
    """``import scaled_masked_softmax_cuda`` (Megatron's way) works once culmen.compat is installed."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import culmen.compat as c; c.install()\n"
            + "".join(f"import {n}; assert callable({n}.forward) and callable({n}.backward)\n" for n in EXTENSIONS)
            + "import fused_rotary_positional_embedding as r; assert callable(r.forward_thd)\n"
            + "from apex.transformer.functional import FusedScaleMaskSoftmax, fused_apply_rotary_pos_emb\n"
            + "from apex.transformer.enums import AttnMaskType\nprint('OK')\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
