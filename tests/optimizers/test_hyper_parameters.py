"""Every fused optimizer checks its hyper-parameters at construction (and in each param group): a bad value
raises ValueError / TypeError naming the argument and the value, never a bare Python error from deep
inside (``FusedAdam(params, betas=0.9)`` used to fail with "object of type 'float' has no len()")."""

from __future__ import annotations

import math

import pytest
import torch

from culmen.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedLARS,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

NAN = math.nan
# (class, required kwargs): every optimizer, with what it needs to be built
OPTIMIZERS = {
    "FusedAdam": (FusedAdam, {}),
    "FusedLAMB": (FusedLAMB, {}),
    "FusedMixedPrecisionLamb": (FusedMixedPrecisionLamb, {}),
    "FusedNovoGrad": (FusedNovoGrad, {}),
    "FusedAdagrad": (FusedAdagrad, {}),
    "FusedSGD": (FusedSGD, {"lr": 0.1}),
    "FusedLARS": (FusedLARS, {"lr": 0.1}),
}
# hyper-parameter -> the optimizers that take it
TAKES = {
    "lr": list(OPTIMIZERS),
    "eps": ["FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad", "FusedAdagrad", "FusedLARS"],
    "weight_decay": list(OPTIMIZERS),
    "betas": ["FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad"],
    "momentum": ["FusedSGD", "FusedLARS"],
    "dampening": ["FusedSGD", "FusedLARS"],
    "trust_coefficient": ["FusedLARS"],
    "max_grad_norm": ["FusedLAMB", "FusedMixedPrecisionLamb"],
    "step": ["FusedMixedPrecisionLamb"],
    "bias_correction": ["FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad"],
    "grad_averaging": ["FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad"],
    "nesterov": ["FusedSGD", "FusedLARS"],
}
# (argument, bad value, exception, text the message must hold besides the argument's name)
BAD = [
    ("lr", -1e-3, ValueError, "-0.001"),
    ("lr", "fast", TypeError, "'fast'"),
    ("lr", True, TypeError, "True"),
    ("lr", NAN, ValueError, "nan"),
    ("lr", torch.ones(2), ValueError, "(2,)"),
    ("eps", -1e-8, ValueError, "-1e-08"),
    ("eps", None, TypeError, "None"),
    ("weight_decay", -0.1, ValueError, "-0.1"),
    ("weight_decay", [0.1], TypeError, "[0.1]"),
    ("betas", 0.9, TypeError, "0.9"),
    ("betas", (0.9,), ValueError, "(0.9,)"),
    ("betas", (0.9, 0.99, 0.999), ValueError, "3 values"),
    ("betas", (0.9, 1.0), ValueError, "betas[1]=1.0"),
    ("betas", (-0.1, 0.9), ValueError, "betas[0]=-0.1"),
    ("betas", ("a", 0.9), TypeError, "'a'"),
    ("betas", "ab", TypeError, "'ab'"),
    ("momentum", -0.5, ValueError, "-0.5"),
    ("momentum", "high", TypeError, "'high'"),
    ("dampening", "x", TypeError, "'x'"),
    ("dampening", NAN, ValueError, "NaN"),
    ("trust_coefficient", -1.0, ValueError, "-1.0"),
    ("max_grad_norm", "1.0", TypeError, "'1.0'"),
    ("step", -1, ValueError, "-1"),
    ("step", 1.5, ValueError, "1.5"),
    ("bias_correction", "yes", TypeError, "'yes'"),
    ("grad_averaging", 0.5, TypeError, "0.5"),
    ("nesterov", "no", TypeError, "'no'"),
]
CASES = [(opt, arg, bad, exc, text) for arg, bad, exc, text in BAD for opt in TAKES[arg]]


def _params():
    return [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]


@pytest.mark.parametrize("opt, arg, bad, exc, text", CASES,
                         ids=[f"{o}-{a}-{b!r}"[:60] for o, a, b, _, _ in CASES])
def test_constructor_argument(opt, arg, bad, exc, text):
    cls, base = OPTIMIZERS[opt]
    with pytest.raises(exc) as info:
        cls(_params(), **{**base, arg: bad})
    msg = str(info.value)
    assert arg.split("[")[0] in msg and text in msg and opt in msg, msg


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_param_group_values(opt):
    """A param group's own values are checked too, and the error says which group."""
    cls, base = OPTIMIZERS[opt]
    p1, p2 = _params()
    with pytest.raises(ValueError, match=r"param group 1.*lr=-1"):
        cls([{"params": [p1]}, {"params": [p2], "lr": -1}], **base)
    with pytest.raises(ValueError, match=r"weight_decay=-2"):
        cls([{"params": [p1], "weight_decay": -2}], **base)
    good = cls([{"params": [p1]}, {"params": [p2], "lr": 0.5, "weight_decay": 0.25}], **base)
    assert float(good.param_groups[1]["lr"]) == 0.5
    with pytest.raises(ValueError, match="param group 2"):
        good.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "weight_decay": -1.0})


def test_good_values_are_accepted():
    """Integers, numpy scalars, tensor lr / betas, lists for betas, zero and edge values are fine."""
    np = pytest.importorskip("numpy")
    FusedAdam(_params(), lr=torch.tensor(1e-3), betas=[0, np.float64(0.5)], eps=0, weight_decay=np.float32(0.1))
    FusedAdam(_params(), betas=(torch.tensor(0.9), torch.tensor(0.999)), bias_correction=1)
    FusedSGD(_params(), lr=1, momentum=0, dampening=-0.5, nesterov=False)
    FusedLAMB(_params(), max_grad_norm=None)
    FusedLAMB(_params(), max_grad_norm=-1.0)  # <= 0 disables clipping (documented)
    FusedMixedPrecisionLamb(_params(), step=torch.tensor([3], dtype=torch.int32), lr=torch.tensor([1e-3]))
    FusedLARS(_params(), lr=0.1, trust_coefficient=0, eps=0)
