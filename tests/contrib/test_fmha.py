"""apex.contrib.fmha: FMHAFun / FMHA on packed variable-length sequences against a float64 per-sequence
PyTorch reference (outputs and dqkv), zero_tensors on rows past the last sequence, dropout switches, bad
arguments, the alias import."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch
from fresh_python import run_python

from culmen.contrib.fmha import FMHA, FMHAFun
from culmen.testing.tolerance import assert_close_tolerance


def ref_fmha(qkv: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Each sequence attends to itself (no mask inside it), in ``qkv``'s dtype; rows past the sequences 0."""
    out = torch.zeros(qkv.shape[0], *qkv.shape[2:], dtype=qkv.dtype, device=qkv.device)
    start = 0
    for n in lens:
        q, k, v = (qkv[start:start + n, i].transpose(0, 1) for i in range(3))  # (h, n, d)
        p = torch.softmax(q @ k.transpose(-1, -2) * qkv.shape[-1] ** -0.5, -1)
        out[start:start + n] = (p @ v).transpose(0, 1)
        start += n
    return out


def _cu(lens: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def check_fmha(lens: list[int], h: int, d: int, extra_rows: int = 0, dtype=torch.float32, device="cpu") -> None:
    total = sum(lens) + extra_rows
    qkv = torch.randn(total, 3, h, d, dtype=dtype, device=device, requires_grad=True)
    cu = _cu(lens, device)
    out = FMHAFun.apply(qkv, cu, 0.0, max(lens), True, True)
    assert out.shape == (total, h, d) and out.dtype == dtype
    dy = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, qkv, dy)
    n = sum(lens)
    if extra_rows:
        assert (out[n:] == 0).all() and (g[n:] == 0).all()  # zero_tensors
    results = []
    for rdt in (torch.float64, dtype):
        x = qkv.detach().to(rdt).requires_grad_(True)
        r = ref_fmha(x, lens)
        results.append((r, torch.autograd.grad(r, x, dy.to(rdt))[0]))
    (hi, ghi), (lo, glo) = results
    assert_close_tolerance(out[:n], hi[:n], lo[:n], name="context")
    assert_close_tolerance(g[:n], ghi[:n], glo[:n], name="dqkv")


@pytest.mark.parametrize(("lens", "extra"), [([3, 1, 6], 0), ([5, 2], 3), ([7], 0)])
def test_fmha_matches_reference(lens, extra):
    check_fmha(lens, 2, 8, extra)


def test_fmha_triton_kernels(triton_backend):
    check_fmha([3, 5, 1], 2, 16, 2)


def test_fmha_module_and_dropout():
    cfg = SimpleNamespace(attention_probs_dropout_prob=0.3, num_attention_heads=2, hidden_size=16)
    m = FMHA(cfg)
    assert (m.h, m.d, m.p_dropout) == (2, 8, 0.3)
    lens = [4, 6]
    qkv = torch.randn(10, 3 * 16, requires_grad=True)
    cu = _cu(lens)
    y_eval = m(qkv, cu, 6, is_training=False)
    assert y_eval.shape == (10, 16)
    ref = ref_fmha(qkv.detach().double().view(10, 3, 2, 8), lens).view(10, 16)
    assert_close_tolerance(y_eval, ref, None, atol=1e-5)
    torch.manual_seed(3)
    y1 = m(qkv, cu, 6)
    torch.manual_seed(3)
    y2 = m(qkv, cu, 6)
    torch.testing.assert_close(y1, y2)
    assert (y1 - y_eval).abs().max() > 1e-3
    y1.sum().backward()
    assert torch.isfinite(qkv.grad).all() and qkv.grad.abs().sum() > 0


def test_bad_arguments():
    qkv = torch.randn(6, 3, 2, 8)
    cu = _cu([2, 4])
    with pytest.raises(ValueError, match="qkv"):
        FMHAFun.apply(qkv[:, :2], cu, 0.0, 4, True, False)
    with pytest.raises(TypeError, match="int32"):
        FMHAFun.apply(qkv, cu.long(), 0.0, 4, True, False)
    with pytest.raises(ValueError, match="max_s"):
        FMHAFun.apply(qkv, cu, 0.0, 0, True, False)
    with pytest.raises(ValueError, match="dropout"):
        FMHAFun.apply(qkv, cu, 1.0, 4, True, False)
    with pytest.raises(ValueError, match="cu_seqlens"):
        FMHAFun.apply(qkv, cu[:1], 0.0, 4, True, False)
    with pytest.raises(ValueError, match="divisible"):
        FMHA(SimpleNamespace(attention_probs_dropout_prob=0.1, num_attention_heads=3, hidden_size=16))
    with pytest.raises(ValueError, match="qkv"):
        FMHA(SimpleNamespace(attention_probs_dropout_prob=0.1, num_attention_heads=2, hidden_size=16))(
            torch.randn(5, 40), cu, 4)


def test_alias_import():
    code = textwrap.dedent("""
        import culmen.compat as compat
        compat.install()
        from apex.contrib.fmha import FMHAFun
        from apex.contrib.fmha.fmha import FMHA, FMHAFun as F2
        import culmen.contrib.fmha.fmha as c
        assert FMHAFun is F2 is c.FMHAFun and FMHA is c.FMHA
        print("ok")
    """)
    assert run_python(code).endswith("ok")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fmha_gpu(dtype):
    """Apex's BERT sizes (head dim 64, up to 512 tokens) on the GPU kernels."""
    check_fmha([512, 129, 300, 64, 511], 16, 64, 7, dtype=dtype, device="cuda")
