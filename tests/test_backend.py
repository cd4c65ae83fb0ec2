"""Dispatch rules of culmen.ops.backend (DESIGN.md, Dispatch)."""

import pytest
import torch

from culmen.ops import backend


@pytest.mark.parametrize("value, expected", [(None, "auto"), ("", "auto"), ("auto", "auto"), ("triton", "triton"),
                                             ("reference", "reference"), (" Triton ", "triton")])
def test_backend_mode_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("CULMEN_BACKEND", raising=False)
    else:
        monkeypatch.setenv("CULMEN_BACKEND", value)
    assert backend.backend_mode() == expected


def test_invalid_mode_raises_and_names_choices(monkeypatch):
    monkeypatch.setenv("CULMEN_BACKEND", "cuda")
    with pytest.raises(ValueError, match="CULMEN_BACKEND must be one of"):
        backend.backend_mode()
    with pytest.raises(ValueError):
        backend.choose_backend("cpu")


def test_cpu_defaults_to_reference(monkeypatch):
    monkeypatch.delenv("CULMEN_BACKEND", raising=False)
    assert backend.choose_backend("cpu") == "reference"
    assert backend.choose_backend(torch.device("cpu")) == "reference"


def test_reference_forced_everywhere(monkeypatch):
    monkeypatch.setenv("CULMEN_BACKEND", "reference")
    assert backend.choose_backend("cpu") == "reference"
    # A CUDA device type needs no GPU for the decision itself.
    assert backend.choose_backend("cuda") == "reference"


def test_cuda_tensors_use_triton(monkeypatch):
    monkeypatch.delenv("CULMEN_BACKEND", raising=False)
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    assert backend.choose_backend("cuda:0") == "triton"


def test_cuda_without_triton_is_an_error(monkeypatch):
    monkeypatch.delenv("CULMEN_BACKEND", raising=False)
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs triton"):
        backend.choose_backend("cuda")


def test_triton_on_cpu_with_interpreter(monkeypatch):
    monkeypatch.setenv("CULMEN_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.interpreter_enabled()
    assert backend.choose_backend("cpu") == "triton"


@pytest.mark.parametrize("interp", ["0", "", "false"])
def test_triton_forced_on_cpu_without_interpreter_raises(monkeypatch, interp):
    monkeypatch.setenv("CULMEN_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    assert not backend.interpreter_enabled()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.choose_backend("cpu")


def test_triton_forced_on_other_device_type_raises(monkeypatch):
    monkeypatch.setenv("CULMEN_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="cannot run on device type"):
        backend.choose_backend("meta")


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


def test_set_deterministic_turns_off_atomic_dq(triton_backend, monkeypatch):
    import culmen
    from culmen.ops.attention import flash_attn, launch

    monkeypatch.setitem(launch.TUNING, "atomic_dq", True)
    seen = []
    real = launch._dq
    monkeypatch.setattr(launch, "_dq", lambda *a, **k: (seen.append(1), real(*a, **k)))
    q, k, v = (torch.randn(1, 20, 2, 16, requires_grad=True) for _ in range(3))
    flash_attn(q, k, v, causal=True)[0].sum().backward()
    assert not seen  # atomic dQ: no dQ kernel
    culmen.set_deterministic(True)
    try:
        flash_attn(q, k, v, causal=True)[0].sum().backward()
    finally:
        culmen.set_deterministic(False)
    assert seen == [1]
