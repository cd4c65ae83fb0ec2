"""``culmen.contrib.group_norm`` (Apex's ``apex.contrib.group_norm``) and the contrib extension modules.

The numerics of the op are checked in ``tests/ops/test_group_norm.py``; here: the module's arguments,
parameters and repr, Apex's functional names, the ``group_norm_cuda`` / ``group_norm_v2_cuda``
extension APIs, and the import aliases of all three contrib ops (focal loss, index_mul_2d, group norm).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from culmen.contrib.group_norm import GroupNorm, group_norm_cuda, group_norm_v2_cuda
from culmen.contrib.group_norm import group_norm as gn_mod
from culmen.ops.group_norm import group_norm_ref
from culmen.testing import randn

ROOT = Path(__file__).resolve().parents[2]


def test_module_parameters_and_repr():
    m = GroupNorm(4, 12, eps=1e-6, act="SiLU", dtype=torch.float64)
    assert m.weight.dtype == torch.float64 and torch.equal(m.weight, torch.ones(12, dtype=torch.float64))
    assert torch.equal(m.bias, torch.zeros(12, dtype=torch.float64))
    assert m.act == "silu" and repr(m) == "GroupNorm(4, 12, eps=1e-06, affine=True, act=silu)"
    plain = GroupNorm(3, 6, affine=False)
    assert plain.weight is None and plain.bias is None and plain.act is None
    assert repr(plain) == "GroupNorm(3, 6, eps=1e-05, affine=False)"
    with pytest.raises(ValueError, match="num_channels must be divisible by num_groups, got num_channels=10"):
        GroupNorm(4, 10)
    with pytest.raises(ValueError, match="act must be None, '', 'silu' or 'swish', got 'relu'"):
        GroupNorm(2, 4, act="relu")
    with pytest.raises(ValueError, match=r"expected input of shape \(N, 6, \*\), got \(2, 5, 3\)"):
        plain(randn((2, 5, 3)))


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_module_forward_backward(layout):
    m = GroupNorm(4, 8, act="swish")
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x = randn((2, 8, 5, 3), requires_grad=True)
    if layout == "cl":
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    y = m(x)
    assert y.is_contiguous(memory_format=torch.channels_last) == (layout == "cl")
    ref = group_norm_ref(x.detach().double(), 4, m.weight.detach().double(), m.bias.detach().double(), 1e-5, True)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert x.grad is not None and m.weight.grad is not None and m.bias.grad is not None


def test_apex_function_names():
    x = randn((2, 8, 4, 4)).contiguous(memory_format=torch.channels_last)
    w, b = randn(8), randn(8)
    expected = group_norm_ref(x, 2, w, b, 1e-5, True)
    for fn in (gn_mod.cuda_group_norm_nhwc_one_pass, gn_mod.cuda_group_norm_nhwc_two_pass,
               gn_mod.cuda_group_norm_v2_nhwc, gn_mod.cuda_group_norm_nhwc):
        torch.testing.assert_close(fn(x, 2, w, b, 1e-5, "silu"), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gn_mod.torch_group_norm(x, 2, w, b, 1e-5, "swish"), expected, rtol=1e-5, atol=1e-5)
    y, sums = gn_mod.group_norm_nhwc_fprop(x, 2, w, b, 1e-5, "silu", passes=2)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert sums.shape == (2 * 2 * 2,) and sums.dtype == torch.float32


def test_extension_modules_match_autograd():
    x = randn((3, 6, 5, 2), requires_grad=True)
    w, b = randn(6, requires_grad=True), randn(6, requires_grad=True)
    dy = randn((3, 6, 5, 2))
    y = gn_mod.GroupNorm(3, 6, act="silu")
    with torch.no_grad():
        y.weight.copy_(w)
        y.bias.copy_(b)
    out = y(x)
    expected = torch.autograd.grad(out, (x, y.weight, y.bias), dy)
    y1, sums = group_norm_cuda.forward(x.detach(), 3, w.detach(), b.detach(), 1e-5, group_norm_cuda.TwoPass, True)
    torch.testing.assert_close(y1, out.detach())
    got = group_norm_cuda.backward(dy, sums, x.detach(), 3, w.detach(), b.detach(), 1e-5, 1, True)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    mean_var = torch.empty(2 * 3 * 3)
    y2 = group_norm_v2_cuda.gn(x.detach(), w.detach(), b.detach(), 1e-5, True, 3, mean_var_out=mean_var)
    torch.testing.assert_close(y2, out.detach())
    torch.testing.assert_close(mean_var, sums)
    got = group_norm_v2_cuda.gn_bwd(dy, x.detach(), w.detach(), b.detach(), mean_var, 1e-5, True, 3)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="sums must have 2 \\* N \\* G = 18 elements, got 4"):
        group_norm_cuda.backward(dy, torch.zeros(4), x.detach(), 3, w.detach(), b.detach(), 1e-5, 1, True)


def test_import_aliases_of_the_contrib_ops():
    """Unmodified Apex-style imports of the three contrib ops resolve to culmen through ``culmen.compat``."""
    code = textwrap.dedent("""
        import culmen.compat as compat
        compat.install()
        import torch
        import focal_loss_cuda, fused_index_mul_2d, group_norm_cuda, group_norm_v2_cuda
        from apex.contrib.focal_loss import focal_loss
        from apex.contrib.index_mul_2d import index_mul_2d
        from apex.contrib.group_norm import GroupNorm
        assert focal_loss.__name__ == "culmen.contrib.focal_loss.focal_loss", focal_loss
        assert callable(focal_loss.FocalLoss.apply) and callable(index_mul_2d)
        assert group_norm_cuda.__name__ == "culmen.contrib.group_norm.group_norm_cuda"
        assert callable(fused_index_mul_2d.half_backward_backward) and callable(group_norm_v2_cuda.gn_bwd)
        assert callable(focal_loss_cuda.forward)
        x = torch.randn(2, 4, 3, 3)
        assert GroupNorm(2, 4, act="silu")(x).shape == x.shape
        print("OK")
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr


def test_apex_kernel_tables_and_selection(monkeypatch):
    """Apex's class attributes, ``get_cc_and_sm_count`` and its v1 (one/two pass) / v2 / fallback choice."""
    assert GroupNorm.GN_V2_SUPPORTED_LOWER_BOUND_SM_COUNT == {(10, 0): 148}
    assert GroupNorm.SUPPORTED_GROUPS == {16, 32} and 640 in GroupNorm.SUPPORTED_CHANNELS
    assert 600 not in GroupNorm.SUPPORTED_CHANNELS and len(GroupNorm.SUPPORTED_DTYPES) == 9
    assert (32 * 32, 640) in GroupNorm.GN_V2_SUPPORTED_CHANNELS and (16, True) in GroupNorm.GN_V2_SUPPORTED_GROUPS_SWISH
    assert (torch.float32, torch.float32) not in GroupNorm.GN_V2_SUPPORTED_DTYPES
    if not torch.cuda.is_available():
        assert gn_mod.get_cc_and_sm_count(None) == ((0, 0), 0)
    assert gn_mod.get_cc_and_sm_count(0) is gn_mod.get_cc_and_sm_count(0)  # cached

    gn = GroupNorm(16, 640, act="swish", dtype=torch.float16)
    assert gn.sm == (0 if not torch.cuda.is_available() else gn.sm)
    cl = torch.empty(8, 640, 32, 32, dtype=torch.float16).to(memory_format=torch.channels_last)
    assert gn._check_legality(cl) and not gn._check_v2_legality(cl)  # no Blackwell GPU with >= 148 SMs here
    assert not gn._check_legality(torch.empty(8, 640, 32, 32, dtype=torch.float16))  # NCHW
    assert not gn._check_legality(cl.double())
    assert not GroupNorm(20, 640, dtype=torch.float16)._check_legality(cl)  # groups
    assert not GroupNorm(16, 640, affine=False)._check_legality(cl)
    assert not GroupNorm(10, 600, dtype=torch.float16)._check_legality(
        torch.empty(2, 600, 4, 4, dtype=torch.float16).to(memory_format=torch.channels_last))
    # Apex's two-pass rule: H*W above 1024 (sm >= 80) or 256, or H*W >= 512 for the largest channel counts
    gn.sm = 90
    assert gn._select_algo(cl) == "one_pass"
    big = torch.empty(1, 640, 33, 32, dtype=torch.float16).to(memory_format=torch.channels_last)
    assert gn._select_algo(big) == "two_pass"
    gn.sm = 75
    assert gn._select_algo(torch.empty(1, 640, 16, 17, dtype=torch.float16)
                           .to(memory_format=torch.channels_last)) == "two_pass"
    wide = GroupNorm(32, 4096, dtype=torch.float16)
    wide.sm = 90
    assert wide._select_algo(torch.empty(1, 4096, 16, 32, dtype=torch.float16)
                             .to(memory_format=torch.channels_last)) == "two_pass"
    assert gn._select_algo(cl.contiguous()) == "torch"
    # a Blackwell part with enough SMs picks v2 for the listed (H*W, C), groups/SiLU and dtype pairs
    monkeypatch.setattr(gn_mod, "get_cc_and_sm_count", lambda index: ((10, 0), 148))
    assert gn._check_v2_legality(cl) and gn._select_algo(cl) == "v2"
    assert not gn._check_v2_legality(torch.empty(8, 640, 32, 24, dtype=torch.float16)
                                      .to(memory_format=torch.channels_last))
    assert not GroupNorm(32, 640, act="swish", dtype=torch.float16)._check_v2_legality(cl)  # 32 groups: no SiLU
    monkeypatch.setattr(gn_mod, "get_cc_and_sm_count", lambda index: ((10, 0), 132))
    assert not gn._check_v2_legality(cl)
    # the choice is Apex's: culmen's kernel computes every case, the same numbers
    x = randn((2, 640, 4, 4)).to(memory_format=torch.channels_last)
    torch.testing.assert_close(GroupNorm(16, 640, act="swish")(x),
                               group_norm_ref(x, 16, torch.ones(640), torch.zeros(640), 1e-5, "swish"),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_get_cc_and_sm_count_gpu():
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert gn_mod.get_cc_and_sm_count(torch.cuda.current_device()) == ((props.major, props.minor),
                                                                       props.multi_processor_count)
    gn = GroupNorm(32, 640, device="cuda")
    major, minor = torch.cuda.get_device_capability()
    assert gn.sm == major * 10 + minor
