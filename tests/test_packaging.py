"""What a user meets first: the license, the package metadata, and ``make demo`` / ``make test``, which reuse
an installed torch and install the CPU build only when none is there.

Offline checks: pyproject.toml's fields, the Makefile's commands (``make -n``) and ``scripts/reuse_torch.py``
on throwaway venvs made without pip.
"""

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPER = ROOT / "scripts" / "reuse_torch.py"


def _pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_file_and_metadata_agree():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "culmen developers" in text
    project = _pyproject()["project"]
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]


def test_package_ships_py_typed_and_its_version():
    import culmen

    assert (ROOT / "culmen" / "py.typed").is_file()
    meta = _pyproject()
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["culmen"]
    assert meta["project"]["version"] == culmen.__version__
    assert meta["project"]["scripts"]["culmen"] == "culmen.cli:main"


def _make_n(tmp_path, target, python="python3"):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    # Under ``make test`` (CI) the parent make's MAKEFLAGS / MAKELEVEL would make this one print
    # "Entering directory" lines: run it as a top-level make.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", target, f"PYTHON={python}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_make_creates_the_venv_then_reuses_torch_before_installing_anything(tmp_path):
    lines = _make_n(tmp_path, "test", python="/opt/py/bin/python3")
    assert lines[0] == "/opt/py/bin/python3 -m venv .venv"
    assert lines[1] == "/opt/py/bin/python3 scripts/reuse_torch.py .venv/bin/python || { rm -rf .venv; exit 1; }"
    text = "\n".join(lines)
    # torch / triton / numpy: each installed only when the venv cannot import it.
    for module, spec in (("torch", '"torch==2.13.0"'), ("triton", '"triton==3.9.0"'), ("numpy", "numpy")):
        check = (f'if .venv/bin/python -c "import {module}" >/dev/null 2>&1; '
                 f'then echo "{module}: using the installed one"')
        assert check in text
        install = text.index(f"-m pip install {spec}")
        assert text.index(check) < install
    # culmen itself never resolves torch again.
    assert ".venv/bin/python -m pip install --no-deps -e ." in lines
    assert text.index("reuse_torch.py") < text.index("pip install")
    assert lines[-1].startswith(".venv/bin/python -m pytest -q -n 2 tests")


def test_make_demo_needs_only_the_base_install(tmp_path):
    lines = _make_n(tmp_path, "demo")
    assert lines[-1] == ".venv/bin/python -m culmen demo"
    assert not any("pytest" in ln for ln in lines)


def _bare_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=False).create(path)
    return path / "bin" / "python"


def _run(python, *args):
    return subprocess.run([str(python), *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")})


@pytest.mark.skipif(sys.platform == "win32", reason="venv layout of POSIX systems")
def test_reuse_torch_makes_a_fresh_venv_import_this_torch(tmp_path):
    import torch

    target = _bare_venv(tmp_path / "v")
    assert _run(target, "-c", "import torch").returncode != 0  # a bare venv has no torch
    proc = _run(sys.executable, HELPER, target)
    assert proc.returncode == 0, proc.stderr
    assert f"uses torch {torch.__version__}" in proc.stdout
    probe = _run(target, "-c", "import torch, sys; print(torch.__version__); print(sys.prefix)")
    assert probe.returncode == 0, probe.stderr
    version, prefix = probe.stdout.split()
    assert version == torch.__version__ and Path(prefix) == tmp_path / "v"
    # The outer directories come after the venv's own site-packages: what the venv installs wins.
    order = _run(target, "-c", "import sys, sysconfig; p = sysconfig.get_paths()['purelib']; "
                               "import torch, os; t = os.path.dirname(os.path.dirname(torch.__file__)); "
                               "print(sys.path.index(p) < sys.path.index(t))")
    assert order.stdout.strip() == "True", order.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="venv layout of POSIX systems")
def test_reuse_torch_without_torch_leaves_the_venv_alone(tmp_path):
    outer = _bare_venv(tmp_path / "outer")
    target = _bare_venv(tmp_path / "inner")
    proc = _run(outer, HELPER, target)
    assert proc.returncode == 0, proc.stderr
    assert "has no torch; the venv installs the CPU build" in proc.stdout
    site = _run(target, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    assert not any(p.name.endswith("reuse-torch.pth") for p in Path(site).iterdir())


def test_reuse_torch_pth_lines_quote_any_path():
    sys.path.insert(0, str(HELPER.parent))
    try:
        import reuse_torch
    finally:
        sys.path.pop(0)
    text = reuse_torch.pth_text(["/a b/site-packages", "/c'd/x"])
    assert text.splitlines() == ["import site; site.addsitedir('/a b/site-packages')",
                                 "import site; site.addsitedir(\"/c'd/x\")"]
