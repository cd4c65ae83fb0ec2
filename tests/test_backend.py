"""Dispatch rules of culmen.ops.backend (DESIGN.md, Dispatch)."""

import pytest
import torch

from culmen.ops import backend


@pytest.mark.parametrize("value, expected", [(None, "auto"), ("", "auto"), ("auto", "auto"), ("triton", "triton"),
                                             ("reference", "reference"), (" Triton ", "triton")])
def test_parse_backend_values(value, expected):
    assert backend.parse_backend(value) == expected


def test_invalid_mode_raises_and_names_choices():
    with pytest.raises(ValueError, match="CULMEN_BACKEND must be one of"):
        backend.parse_backend("cuda")
    with pytest.raises(ValueError, match="CULMEN_BACKEND must be one of"):
        backend.set_backend("cuda")


def test_environment_is_read_once_at_import(monkeypatch):
    """CULMEN_BACKEND gives the initial backend (``_initial_mode`` runs at import); later changes of the
    variable do nothing (the setter does)."""
    monkeypatch.setenv("CULMEN_BACKEND", "reference")
    assert backend._initial_mode() == "reference"
    monkeypatch.setattr(backend, "_MODE", backend._initial_mode())
    monkeypatch.setenv("CULMEN_BACKEND", "triton")
    assert backend.backend_mode() == "reference"
    monkeypatch.setenv("CULMEN_BACKEND", "bogus")
    assert backend._initial_mode() is None  # a bad variable never breaks the import itself


def test_setter_drops_cached_plans():
    from culmen.ops.common.plans import PlanCache

    cache = PlanCache("test")
    cache.put("k", object())
    backend.set_backend("reference")
    assert "k" not in cache
    with backend.use_backend("auto"):
        assert backend.backend_mode() == "auto"
    assert backend.backend_mode() == "reference"


def test_plan_cache_is_bounded():
    from culmen.ops.common.plans import PlanCache

    cache = PlanCache("bounded", maxsize=3)
    for i in range(3):
        cache.put(i, i)
    cache.put(3, 3)
    assert list(cache) == [3]


def test_cpu_defaults_to_reference():
    backend.set_backend("auto")
    assert backend.choose_backend("cpu") == "reference"
    assert backend.choose_backend(torch.device("cpu")) == "reference"


def test_reference_forced_everywhere():
    backend.set_backend("reference")
    assert backend.choose_backend("cpu") == "reference"
    # A CUDA device type needs no GPU for the decision itself.
    assert backend.choose_backend("cuda") == "reference"


def test_cuda_tensors_use_triton(monkeypatch):
    backend.set_backend("auto")
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    assert backend.choose_backend("cuda:0") == "triton"


def test_cuda_without_triton_is_an_error(monkeypatch):
    backend.set_backend("auto")
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs triton"):
        backend.choose_backend("cuda")


def test_triton_on_cpu_with_interpreter(monkeypatch):
    backend.set_backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.interpreter_enabled()
    assert backend.choose_backend("cpu") == "triton"


@pytest.mark.parametrize("interp", ["0", "", "false"])
def test_triton_forced_on_cpu_without_interpreter_raises(monkeypatch, interp):
    backend.set_backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    assert not backend.interpreter_enabled()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.choose_backend("cpu")


def test_triton_forced_on_other_device_type_raises(monkeypatch):
    backend.set_backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="cannot run on device type"):
        backend.choose_backend("meta")


def test_check_values_switch():
    prev = backend.check_values_on()
    try:
        backend.set_check_values(True)
        assert backend.check_values_on()
        with pytest.raises(TypeError, match="bool"):
            backend.set_check_values(1)
    finally:
        backend.set_check_values(prev)


def test_fixtures_set_the_mode(triton_backend):
    assert backend.backend_mode() == "triton"


def test_reference_fixture(reference_backend):
    assert backend.choose_backend("cpu") == "reference"


def test_registry_lists_layer_norm_ops():
    from culmen.ops import OP_MODULES, load_all

    assert "culmen.ops.layer_norm" in OP_MODULES
    assert load_all() == {}
    names = {op.name for op in backend.registered_ops()}
    assert {"layer_norm_fwd", "layer_norm_bwd"} <= names


def test_load_all_reports_a_broken_module(monkeypatch):
    import culmen.ops as ops

    monkeypatch.setattr(ops, "OP_MODULES", ("culmen.ops.layer_norm", "culmen.ops.does_not_exist"))
    failed = ops.load_all()
    assert list(failed) == ["culmen.ops.does_not_exist"]
    assert "ModuleNotFoundError" in failed["culmen.ops.does_not_exist"]


def test_set_deterministic_switch(monkeypatch):
    import culmen
    from culmen.ops.index_mul_2d import op as im_op

    assert not culmen.deterministic_enabled()
    assert im_op._deterministic() is False
    culmen.set_deterministic(True)
    try:
        assert culmen.deterministic_enabled() and im_op._deterministic()
    finally:
        culmen.set_deterministic(False)
    assert not culmen.deterministic_enabled()
    with pytest.raises(TypeError, match="bool"):
        culmen.set_deterministic(1)
