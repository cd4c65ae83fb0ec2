"""Apex's FastRMSNorm, the ``fast_layer_norm`` extension entry points and ``apex.testing.common_utils``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from culmen.contrib.layer_norm import FastRMSNorm
from culmen.contrib.layer_norm import fast_layer_norm as fln
from culmen.contrib.layer_norm.layer_norm import FastRMSNormFN
from culmen.ops.layer_norm.reference import layer_norm_ref, rms_norm_ref
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn

BACKENDS = ["reference", "triton"]


def _leaf(t, dtype=None):
    return t.detach().to(dtype or t.dtype).requires_grad_(True)


def test_module_attributes():
    m = FastRMSNorm(33, eps=1e-3, memory_efficient=True)
    assert m.epsilon == 1e-3 and m.memory_efficient
    assert [n for n, _ in m.named_parameters()] == ["weight"] and torch.equal(m.weight, torch.ones(33))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, shape, noncontig, mem_eff", [
    (torch.float32, (3, 63), False, False),
    (torch.float16, (2, 5, 40), True, True),
])
def test_forward_backward_matches_float64(request, backend, dtype, shape, noncontig, mem_eff):
    request.getfixturevalue(f"{backend}_backend")
    n = shape[-1]
    m = FastRMSNorm(n, memory_efficient=mem_eff, dtype=dtype)
    w = (torch.rand(n) + 0.5).to(dtype)
    with torch.no_grad():
        m.weight.copy_(w)
    x, g = randn(shape, dtype), randn(shape)
    xin = make_noncontiguous(x).requires_grad_(True) if noncontig else _leaf(x)
    y = m(xin)
    assert y.dtype == dtype and y.shape == shape
    y.backward(g.to(dtype))

    def ref(dt):
        xx, ww = _leaf(x, dt), _leaf(w, dt)
        out = rms_norm_ref(xx, ww, None, eps=1e-5)
        out.backward(g.to(out.dtype))
        return out, xx.grad, ww.grad

    for name, got, h, low in zip(("y", "dx", "dweight"), (y, xin.grad, m.weight.grad), ref(torch.float64),
                                 ref(dtype)):
        assert_close_tolerance(got, h, low, name=name)
    torch.testing.assert_close(FastRMSNormFN.apply(x, m.weight.detach(), 1e-5), y.detach())


def test_autocast_and_bad_input():
    m = FastRMSNorm(40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(randn((2, 40))).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="hidden_size 40"):
        m(randn((2, 41)))


@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16])
def test_extension_layer_norm_entry_points(wdtype):
    x = randn((2, 3, 48), dtype=torch.float16)
    gamma, beta = (torch.rand(48) + 0.5).to(wdtype), (randn(48) * 0.1).to(wdtype)
    dz = randn((2, 3, 48)).to(wdtype)
    z, mu, rsigma = fln.ln_fwd(x, gamma, beta, 1e-5)
    assert z.dtype == wdtype and mu.shape == rsigma.shape == (6,) and mu.dtype == torch.float32
    dx, dgamma, dbeta = fln.ln_bwd(dz, x, mu, rsigma, gamma)
    xx, gg, bb = _leaf(x, torch.float64), _leaf(gamma, torch.float64), _leaf(beta, torch.float64)
    want = layer_norm_ref(xx, gg, bb, eps=1e-5)
    want.backward(dz.double())
    for name, got, h in (("z", z, want), ("dx", dx, xx.grad), ("dgamma", dgamma, gg.grad), ("dbeta", dbeta, bb.grad)):
        assert_close_tolerance(got, h, None, name=name)
    assert dx.dtype == x.dtype and dgamma.dtype == wdtype


def test_extension_rms_norm_entry_points():
    x, gamma, dz = randn((5, 40)), torch.rand(40) + 0.5, randn((5, 40))
    z, rsigma = fln.rmsnorm_fwd(x, gamma, 1e-5)
    dx, dgamma, dgamma_part = fln.rmsnorm_bwd(dz, x, rsigma, gamma)
    xx, gg = _leaf(x, torch.float64), _leaf(gamma, torch.float64)
    want = rms_norm_ref(xx, gg, None, eps=1e-5)
    want.backward(dz.double())
    for name, got, h in (("z", z, want), ("dx", dx, xx.grad), ("dgamma", dgamma, gg.grad)):
        assert_close_tolerance(got, h, None, name=name)
    torch.testing.assert_close(dgamma_part.sum(0), dgamma)
    with pytest.raises(ValueError, match="gamma's size 40"):
        fln.rmsnorm_fwd(randn((5, 41)), gamma, 1e-5)


def test_common_utils_skips_follow_the_environment():
    code = (
        "import unittest, culmen.compat as c; c.install()\n"
        "from apex.testing.common_utils import skipIfRocm, skipFlakyTest, TEST_WITH_ROCM\n"
        "import fast_layer_norm, apex.contrib.layer_norm.layer_norm as m; assert m.FastRMSNorm\n"
        "class T(unittest.TestCase):\n"
        "    @skipIfRocm\n    def test_a(self): pass\n"
        "    @skipFlakyTest\n    def test_b(self): pass\n"
        "r = unittest.TextTestRunner(verbosity=0).run(unittest.defaultTestLoader.loadTestsFromTestCase(T))\n"
        "print(len(r.skipped))\n"
    )
    env = {**os.environ, "APEX_TEST_WITH_ROCM": "1", "APEX_SKIP_FLAKY_TEST": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "1"
    env["APEX_TEST_WITH_ROCM"], env["APEX_SKIP_FLAKY_TEST"] = "0", "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "1"


def test_extension_rms_norm_rounds_like_apex_in_16_bit():
    # Apex's kernel rounds x * rsigma to the weight dtype, then scales by gamma in that dtype.
    x, gamma = randn((7, 48)), (torch.rand(48) + 0.5).to(torch.bfloat16)
    z, rsigma = fln.rmsnorm_fwd(x, gamma, 1e-5)
    want = (x * torch.rsqrt(x.square().mean(1, keepdim=True) + 1e-5)).to(torch.bfloat16) * gamma
    assert z.dtype == torch.bfloat16 and torch.equal(z, want)
