"""amp.initialize rejects bad loss-scaler arguments with an error naming the argument and the value,
before it touches the model or the optimizer; the accepted forms keep Apex's meaning."""

from __future__ import annotations

import pytest
import torch
from amp_testutils import clean_amp  # noqa: F401 - autouse fixture: amp state reset around each test

from culmen import amp
from culmen.amp._amp_state import _amp_state


def _model_opt():
    m = torch.nn.Linear(4, 3)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


@pytest.mark.parametrize(("value", "exc", "text"), [
    ("bad", ValueError, "'bad'"),
    ("", ValueError, "''"),
    (0, ValueError, "positive"),
    (-128.0, ValueError, "-128.0"),
    (float("nan"), ValueError, "nan"),
    (float("inf"), ValueError, "inf"),
    ([1.0], TypeError, "list"),
    (True, TypeError, "True"),
])
def test_bad_loss_scale(value, exc, text):
    m, opt = _model_opt()
    w = m.weight.detach().clone()
    for level in ("O0", "O1", "O2"):
        with pytest.raises(exc, match="loss_scale") as info:
            amp.initialize(m, opt, opt_level=level, loss_scale=value, verbosity=0)
        assert text in str(info.value)
    assert torch.equal(m.weight, w) and m.weight.dtype == torch.float32  # untouched


@pytest.mark.parametrize(("value", "kept"), [("dynamic", "dynamic"), ("128", 128.0), (64, 64.0), (0.5, 0.5),
                                             (torch.tensor(8.0), 8.0)])
def test_good_loss_scale(value, kept):
    m, opt = _model_opt()
    amp.initialize(m, opt, opt_level="O0", loss_scale=value, verbosity=0)
    assert _amp_state.opt_properties.loss_scale == kept
    scaler = _amp_state.loss_scalers[0]
    assert scaler.dynamic == (kept == "dynamic")
    if kept != "dynamic":
        assert scaler.loss_scale() == kept


@pytest.mark.parametrize(("kwargs", "exc", "name"), [
    (dict(num_losses=0), ValueError, "num_losses"),
    (dict(num_losses=1.5), TypeError, "num_losses"),
    (dict(num_losses="2"), TypeError, "num_losses"),
    (dict(min_loss_scale=-1.0), ValueError, "min_loss_scale"),
    (dict(min_loss_scale=float("nan")), ValueError, "min_loss_scale"),
    (dict(min_loss_scale="1"), TypeError, "min_loss_scale"),
    (dict(max_loss_scale=-1.0), ValueError, "max_loss_scale"),
    (dict(max_loss_scale=None), TypeError, "max_loss_scale"),
    (dict(min_loss_scale=2.0**20, max_loss_scale=2.0**10), ValueError, "min_loss_scale"),
    (dict(hysteresis=0), ValueError, "hysteresis"),
])
def test_bad_scaler_arguments(kwargs, exc, name):
    m, opt = _model_opt()
    with pytest.raises(exc, match=name):
        amp.initialize(m, opt, opt_level="O1", verbosity=0, **kwargs)


def test_min_loss_scale_zero_means_no_floor():
    m, opt = _model_opt()
    amp.initialize(m, opt, opt_level="O1", min_loss_scale=0, verbosity=0)
    assert _amp_state.min_loss_scale == 0
