"""amp.initialize: opt-level defaults, Apex's override rules, return shapes and bad input."""

from __future__ import annotations

import inspect

import pytest
import torch
from amp_testutils import MLP, clean_amp, fresh  # noqa: F401 - clean_amp is an autouse fixture
from torch import nn

from culmen import amp
from culmen.amp._amp_state import _amp_state
from culmen.amp.frontend import Properties, opt_levels
from culmen.fp16_utils import FP16_Optimizer

EXPECTED_DEFAULTS = {
    "O0": (torch.float32, False, None, False, 1.0),
    "O1": (None, True, None, None, "dynamic"),
    "O2": (torch.float16, False, True, True, "dynamic"),
    "O3": (torch.float16, False, False, False, 1.0),
    "O4": (None, True, None, None, 1.0),
    "O5": (torch.bfloat16, False, True, True, 1.0),
}


def test_signature_matches_apex():
    params = list(inspect.signature(amp.initialize).parameters.items())
    apex = [("models", inspect.Parameter.empty), ("optimizers", None), ("enabled", True), ("opt_level", "O1"),
            ("cast_model_type", None), ("patch_torch_functions", None), ("keep_batchnorm_fp32", None),
            ("master_weights", None), ("loss_scale", None), ("cast_model_outputs", None), ("num_losses", 1),
            ("verbosity", 1), ("min_loss_scale", None), ("max_loss_scale", 2.0**24)]
    assert [(n, p.default) for n, p in params[: len(apex)]] == apex
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for _, p in params[len(apex):])


@pytest.mark.parametrize("level", sorted(EXPECTED_DEFAULTS))
def test_opt_level_defaults(level):
    props = opt_levels[level](Properties())
    cast, patch, keep_bn, master, scale = EXPECTED_DEFAULTS[level]
    assert props.enabled is True and props.opt_level == level
    assert props.cast_model_type == cast
    assert props.patch_torch_functions is patch
    assert props.keep_batchnorm_fp32 == keep_bn
    assert props.master_weights == master
    assert props.loss_scale == scale
    if patch:
        assert props.patch_torch_functions_type == (torch.bfloat16 if level == "O4" else torch.float16)


@pytest.mark.parametrize("kwargs, match", [
    ({"opt_level": "O1", "cast_model_type": torch.float16}, "O1 inserts casts"),
    ({"opt_level": "O1", "cast_model_type": torch.bfloat16}, "O1 inserts casts"),
    ({"opt_level": "O1", "keep_batchnorm_fp32": True}, "keep_batchnorm_fp32 should be None"),
    ({"opt_level": "O1", "master_weights": True}, "master_weights with O1"),
    ({"opt_level": "O2", "patch_torch_functions": True}, "patch_torch_functions=True should only"),
    ({"opt_level": "O2", "patch_torch_functions_type": torch.bfloat16}, "patch_torch_functions_type should only"),
    ({"opt_level": "O1", "patch_torch_functions_type": torch.float32}, "must be torch.float16 or"),
])
def test_contradictory_overrides_raise(kwargs, match):
    model, opt = fresh()
    with pytest.raises(RuntimeError, match=match):
        amp.initialize(model, opt, verbosity=0, **kwargs)


def test_hard_override_only_prints(capsys):
    _amp_state.hard_override = True
    model, opt = fresh()
    amp.initialize(model, opt, opt_level="O1", master_weights=True, verbosity=0)
    assert "Warning:  It doesn't make sense" in capsys.readouterr().out
    assert _amp_state.opt_properties.master_weights is True


def test_o1_allowed_overrides_do_not_raise():
    model, opt = fresh()
    amp.initialize(model, opt, opt_level="O1", cast_model_type=torch.float32, loss_scale=128, verbosity=0)
    assert _amp_state.opt_properties.loss_scale == 128.0
    assert _amp_state.loss_scalers[0].dynamic is False


@pytest.mark.parametrize("value, expected", [("True", True), ("False", False), (True, True), (False, False)])
def test_keep_batchnorm_fp32_strings(value, expected):
    model, opt = fresh()
    model, opt = amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32=value, verbosity=0)
    assert _amp_state.opt_properties.keep_batchnorm_fp32 is expected
    assert model.bn.weight.dtype == (torch.float32 if expected else torch.float16)
    assert model.fc1.weight.dtype == torch.float16


def test_keep_batchnorm_fp32_bad_string():
    model, opt = fresh()
    with pytest.raises(AssertionError, match="keep_batchnorm_fp32 must be a boolean"):
        amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32="yes", verbosity=0)


@pytest.mark.parametrize("value, expected", [("dynamic", "dynamic"), ("128.0", 128.0), (512, 512.0), ("1", 1.0)])
def test_loss_scale_forms(value, expected):
    model, opt = fresh()
    amp.initialize(model, opt, opt_level="O2", loss_scale=value, verbosity=0)
    assert _amp_state.opt_properties.loss_scale == expected
    scaler = _amp_state.loss_scalers[0]
    assert scaler.dynamic is (expected == "dynamic")
    assert scaler.loss_scale() == (2.0**16 if expected == "dynamic" else expected)


def test_loss_scale_bad_string():
    model, opt = fresh()
    with pytest.raises(ValueError):
        amp.initialize(model, opt, opt_level="O2", loss_scale="dynamc", verbosity=0)


@pytest.mark.parametrize("level", ["O6", "o1", "01", "", None])
def test_unknown_opt_level(level):
    model, opt = fresh()
    with pytest.raises(RuntimeError, match="Unexpected optimization level.*letter O"):
        amp.initialize(model, opt, opt_level=level, verbosity=0)


def test_return_shapes():
    m, o = fresh()
    assert amp.initialize(m, verbosity=0) is m
    m, o = fresh()
    m2, o2 = amp.initialize(m, o, verbosity=0)
    assert m2 is m and o2 is o
    m, o = fresh()
    ms, os_ = amp.initialize([m], [o], verbosity=0)
    assert isinstance(ms, list) and isinstance(os_, list) and ms[0] is m and os_[0] is o
    m, o = fresh()
    ms, o2 = amp.initialize([m], o, verbosity=0)
    assert isinstance(ms, list) and o2 is o
    m, o = fresh()
    m2, os_ = amp.initialize(m, [o], verbosity=0)
    assert m2 is m and isinstance(os_, list)
    m, o = fresh()
    ms = amp.initialize([m], verbosity=0)
    assert ms == [m]


def test_disabled_returns_unchanged_and_scale_loss_passes_through():
    m, o = fresh()
    m2, o2 = amp.initialize(m, o, enabled=False, opt_level="O2", verbosity=0)
    assert m2 is m and o2 is o and m.fc1.weight.dtype == torch.float32
    loss = m(torch.randn(4, 12)).sum()
    with amp.scale_loss(loss, o) as scaled:
        assert scaled is loss
    assert amp.initialize(m, enabled=False, verbosity=0) is m


def test_bad_types():
    m, o = fresh()
    with pytest.raises(TypeError, match="models must be"):
        amp.initialize("model", o, verbosity=0)
    with pytest.raises(TypeError, match="optimizers must be"):
        amp.initialize(m, "adam", verbosity=0)
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        amp.initialize([m, 3], o, verbosity=0)
    with pytest.raises(ValueError, match="num_losses"):
        amp.initialize(m, o, num_losses=0, verbosity=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_initialize_twice_same_objects(level):
    m, o = fresh()
    m, o = amp.initialize(m, o, opt_level=level, verbosity=0)
    with pytest.raises(RuntimeError, match="already passed through amp.initialize"):
        amp.initialize(m, opt_level=level, verbosity=0)
    m2, _ = fresh()
    with pytest.raises(RuntimeError, match="optimizer should only be passed through amp.initialize once"):
        amp.initialize(m2, o, opt_level=level, verbosity=0)


def test_initialize_again_with_new_objects_replaces_state():
    m, o = fresh()
    amp.initialize(m, o, opt_level="O1", verbosity=0)
    assert torch.is_autocast_enabled("cpu")
    m2, o2 = fresh()
    amp.initialize(m2, o2, opt_level="O2", verbosity=0)
    assert not torch.is_autocast_enabled("cpu")  # the O1 casting of the first call is gone
    assert _amp_state.opt_properties.opt_level == "O2"


def test_parallel_wrapped_model_rejected():
    m, o = fresh()
    with pytest.raises(RuntimeError, match="DataParallel.*AFTER"):
        amp.initialize(nn.DataParallel(m), o, verbosity=0)


def test_half_model_rejected_unless_allowed():
    m, o = fresh()
    m.half()
    with pytest.raises(RuntimeError, match="you do not need to call .half"):
        amp.initialize(m, o, opt_level="O2", verbosity=0)
    amp.deinitialize()
    _amp_state.allow_incoming_model_not_fp32 = True
    m, o = fresh()
    m.half()
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    assert m.fc1.weight.dtype == torch.float16


def test_fp16_optimizer_rejected():
    m = MLP().half()
    with pytest.warns(FutureWarning):
        fo = FP16_Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), verbose=False)
    with pytest.raises(RuntimeError, match="FP16_Optimizer"):
        amp.initialize(MLP(), fo, verbosity=0)


def test_scale_loss_errors():
    m, o = fresh()
    loss = m(torch.randn(4, 12)).sum()
    with pytest.raises(RuntimeError, match="before amp.initialize"):
        with amp.scale_loss(loss, o):
            pass
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    late = torch.optim.SGD(m.parameters(), lr=0.1)  # built after initialize: unknown to amp
    loss = m(torch.randn(4, 12)).sum()
    with pytest.raises(RuntimeError, match="was not passed through amp.initialize"):
        with amp.scale_loss(loss, late):
            pass
    with pytest.raises(RuntimeError, match="num_losses=1"):
        with amp.scale_loss(loss, o, loss_id=1):
            pass
    with pytest.raises(TypeError, match="optimizers must be"):
        with amp.scale_loss(loss, "opt"):
            pass


def test_bad_hysteresis():
    m, o = fresh()
    with pytest.raises(ValueError, match="hysteresis"):
        amp.initialize(m, o, hysteresis=0, verbosity=0)


def test_verbosity_prints_options(capsys):
    m, o = fresh()
    amp.initialize(m, o, opt_level="O2", verbosity=1)
    out = capsys.readouterr().out
    assert "Selected optimization level O2" in out and "master_weights" in out
    amp.deinitialize()
    m, o = fresh()
    amp.initialize(m, o, opt_level="O2", verbosity=0)
    assert capsys.readouterr().out == ""


def test_properties_attribute_errors():
    props = Properties()
    with pytest.raises(AttributeError):
        _ = props.not_an_option
    with pytest.raises(ValueError, match="unexpected option"):
        props._update_options_dict({"bogus": 1})
    props._update_options_dict({"opt_level": "O2", "master_weights": True})
    assert props.opt_level == "O2" and props.master_weights is True


def test_apex_import_alias_reaches_amp_and_fp16_utils():
    """Unmodified Apex scripts: ``from apex import amp`` / ``apex.fp16_utils`` through culmen.compat."""
    import importlib

    from culmen import compat

    compat.install(force=True)
    try:
        apex_amp = importlib.import_module("apex.amp")
        fp16 = importlib.import_module("apex.fp16_utils")
        assert apex_amp is amp and fp16.FP16_Optimizer is FP16_Optimizer
        from apex.amp import _amp_state as state  # noqa: I001 - the alias has to be installed first

        assert state is _amp_state
    finally:
        compat.uninstall()
