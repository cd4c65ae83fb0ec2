"""Name-by-name check of ``apex.RNN`` and the ``apex.contrib`` long tail through the ``apex`` alias: every upstream
name (tests/contrib/apex_contrib_names.py) imports from the same module path, has the same kind, and takes a
compatible signature (same positional names in order, same defaults, only optional extras)."""

from __future__ import annotations

import importlib
import inspect
import sys

import pytest
import torch

from tests.contrib.apex_contrib_names import UPSTREAM

_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@pytest.fixture(scope="module")
def apex_alias():
    import culmen.compat as compat

    had_apex = any(k == "apex" or k.startswith("apex.") for k in sys.modules)
    compat.install()
    yield
    if not had_apex:
        compat.uninstall()


def _parse(expected: list) -> tuple[list, list, bool, bool]:
    """Split an upstream parameter list into positional, keyword-only, has-*args, has-**kwargs."""
    positional, kwonly, var_pos, var_kw, in_kw = [], [], False, False, False
    for p in expected:
        if p == "*":
            in_kw = True
        elif isinstance(p, str) and p.startswith("**"):
            var_kw = True
        elif isinstance(p, str) and p.startswith("*"):
            var_pos, in_kw = True, True
        else:
            (kwonly if in_kw else positional).append(p if isinstance(p, tuple) else (p, _EMPTY))
    return positional, kwonly, var_pos, var_kw


def _same_default(expected, actual) -> bool:
    if isinstance(expected, str) and expected.startswith("<"):
        return actual is not _EMPTY  # an upstream object: only "has a default" is comparable
    if actual is _EMPTY:
        return False
    try:
        return bool(expected == actual) and type(expected) is not bool or expected is actual
    except Exception:  # noqa: BLE001 (tensors and other odd defaults compare as different)
        return False


def _check(params: list[inspect.Parameter], expected: list, where: str) -> list[str]:
    """Differences between culmen's ``params`` and the upstream list (empty when compatible)."""
    problems = []
    positional, kwonly, var_pos, var_kw = _parse(expected)
    actual_pos = [p for p in params if p.kind in _POSITIONAL]
    by_name = {p.name: p for p in params}
    has_var_pos = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    for i, (name, default) in enumerate(positional):
        if i >= len(actual_pos) or actual_pos[i].name != name:
            got = [p.name for p in actual_pos]
            problems.append(f"{where}: positional #{i} should be {name!r}; culmen's positional params are {got}")
            break
        if default is not _EMPTY and not _same_default(default, actual_pos[i].default):
            problems.append(f"{where}: {name} default {default!r} != {actual_pos[i].default!r}")
    for name, default in kwonly:
        p = by_name.get(name)
        if p is None or p.kind not in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            problems.append(f"{where}: keyword parameter {name!r} missing")
        elif default is not _EMPTY and not _same_default(default, p.default):
            problems.append(f"{where}: {name} default {default!r} != {p.default!r}")
    if var_pos and not has_var_pos:
        problems.append(f"{where}: *args missing")
    if var_kw and not has_var_kw:
        problems.append(f"{where}: **kwargs missing")
    known = {n for n, _ in positional} | {n for n, _ in kwonly}
    extra_pos = actual_pos[len(positional):]
    for p in extra_pos + [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in known]:
        if p.name not in known and p.default is _EMPTY:
            problems.append(f"{where}: extra parameter {p.name!r} is required (must be optional)")
    if not positional and not kwonly and has_var_pos and has_var_kw and expected:
        problems.append(f"{where}: culmen takes only (*args, **kwargs)")
    return problems


def _sig(fn, drop_first: bool) -> list[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())
    return params[1:] if drop_first else params


def _autograd_params(obj) -> list[inspect.Parameter]:
    apply = inspect.getattr_static(obj, "apply", None)
    own_apply = apply is not None and apply is not inspect.getattr_static(torch.autograd.Function, "apply", None)
    if own_apply:
        return _sig(obj.apply, drop_first=False)
    return _sig(obj.forward, drop_first=True)


def _kind_problem(obj, kind: str) -> str | None:
    if kind == "value":
        return None
    if kind == "function":
        return None if callable(obj) and not isinstance(obj, type) else f"expected a function, got {obj!r}"
    if not isinstance(obj, type):
        return f"expected a class, got {obj!r}"
    if kind == "module" and not issubclass(obj, torch.nn.Module):
        return f"expected an nn.Module subclass, got {obj!r}"
    if kind == "autograd" and not (issubclass(obj, torch.autograd.Function) or callable(getattr(obj, "apply", None))):
        return f"expected an autograd.Function (or a class with apply), got {obj!r}"
    return None


def _entry_problems(module, name: str, kind: str, signature) -> list[str]:
    where = f"{module.__name__}.{name}"
    if not hasattr(module, name):
        return [f"{where}: missing"]
    obj = getattr(module, name)
    kp = _kind_problem(obj, kind)
    if kp:
        return [f"{where}: {kp}"]
    if signature is None:
        return []
    if kind == "function":
        return _check(_sig(obj, drop_first=False), signature, where)
    if kind == "autograd":
        return _check(_autograd_params(obj), signature, where + ".apply")
    if kind == "module":
        init, fwd = signature
        return _check(_sig(obj, False), init, where + ".__init__") + _check(_sig(obj.forward, True), fwd,
                                                                            where + ".forward")
    if kind == "class":
        return _check(_sig(obj, False), signature, where + ".__init__")
    return []


@pytest.mark.parametrize("module_path", sorted(UPSTREAM))
def test_upstream_names(apex_alias, module_path):
    assert module_path.startswith("apex"), module_path
    module = importlib.import_module(module_path)
    culmen_path = "culmen" + module_path[len("apex"):]
    assert module is importlib.import_module(culmen_path), f"{module_path} is not {culmen_path} through the alias"
    problems = []
    for name, kind, signature in UPSTREAM[module_path]:
        problems += _entry_problems(module, name, kind, signature)
    assert not problems, "\n".join(problems)


def test_checker_catches_mismatches():
    """The signature comparison is strict where it must be (so a passing run means something)."""
    def ok(a, b=1, *, c=2):
        pass

    def renamed(a, bb=1):
        pass

    def new_default(a, b=3):
        pass

    def extra_required(a, b=1, d=None, e=0, *, f):
        pass

    def wrapped(*args, **kwargs):
        pass

    assert _check(_sig(ok, False), ["a", ("b", 1)], "ok") == []
    assert _check(_sig(ok, False), ["a", ("b", 1), "*", ("c", 2)], "ok") == []
    assert _check(_sig(renamed, False), ["a", ("b", 1)], "x")
    assert _check(_sig(new_default, False), ["a", ("b", 1)], "x")
    assert _check(_sig(extra_required, False), ["a", ("b", 1)], "x")
    assert _check(_sig(wrapped, False), ["a"], "x")
    assert _check(_sig(ok, False), ["a", ("b", True)], "x")  # True is not 1
    assert _kind_problem(ok, "module") and _kind_problem(torch.nn.Linear, "function")
    assert _kind_problem(torch.nn.Linear, "module") is None
