"""culmen.compat: the opt-in apex / flash_attn import alias. Each test runs in a fresh interpreter so
this process's sys.modules and sys.meta_path stay clean."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code_or_args, *, extra_path=(), cwd=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), str(ROOT), env.get("PYTHONPATH", "")])
    args = [sys.executable, "-c", textwrap.dedent(code_or_args)] if isinstance(code_or_args, str) else \
        [sys.executable, *code_or_args]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_alias_is_the_same_module_object():
    out = _run("""
        import sys, importlib.util
        import culmen.compat as compat
        try:
            import apex
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("apex importable before install")
        table = compat.install()
        assert table["apex"] == "culmen" and table["flash_attn"] == "culmen.flash_attn", table
        import apex, apex.ops.backend, culmen, culmen.ops.backend
        assert apex is culmen
        assert sys.modules["apex.ops.backend"] is culmen.ops.backend
        from apex.ops.layer_norm import layer_norm
        import culmen.ops.layer_norm as ln
        assert layer_norm is ln.layer_norm
        # culmen's modules keep their own identity (spec, name) after being aliased.
        assert culmen.ops.backend.__name__ == "culmen.ops.backend"
        assert culmen.ops.backend.__spec__.name == "culmen.ops.backend"
        # What culmen lacks fails the ordinary way.
        try:
            import apex.no_such_module
        except ModuleNotFoundError as e:
            assert "apex.no_such_module" in str(e)
        else:
            raise SystemExit("apex.no_such_module imported")
        assert importlib.util.find_spec("apex.no_such_module") is None
        compat.uninstall()
        assert not any(k == "apex" or k.startswith("apex.") for k in sys.modules)
        assert culmen.ops.backend is sys.modules["culmen.ops.backend"]
        try:
            import apex
        except ModuleNotFoundError:
            print("OK")
    """)
    assert out.strip().endswith("OK")


def test_flash_attn_prefix_maps_to_culmen_flash_attn():
    out = _run("""
        import sys, culmen.compat as compat
        compat.install()
        import flash_attn, culmen.flash_attn
        assert flash_attn is culmen.flash_attn
        from flash_attn.ops.triton.layer_norm import layer_norm_fn
        import culmen.flash_attn.ops.triton.layer_norm as ln
        assert layer_norm_fn is ln.layer_norm_fn
        assert sys.modules["flash_attn.ops.triton.layer_norm"] is ln
        print("OK")
    """)
    assert out.strip() == "OK"


def test_apex_normalization_is_culmen_normalization():
    out = _run("""
        import culmen.compat as compat
        compat.install()
        from apex.normalization import FusedLayerNorm
        import culmen.normalization
        assert FusedLayerNorm is culmen.normalization.FusedLayerNorm
        print("OK")
    """)
    assert out.strip() == "OK"


def test_extension_module_table(tmp_path):
    out = _run("""
        import culmen.compat as compat
        compat.EXTENSION_MODULES["fake_ext_C"] = "culmen.ops.backend"
        compat.install()
        import fake_ext_C, culmen.ops.backend
        assert fake_ext_C is culmen.ops.backend
        print("OK")
    """)
    assert out.strip() == "OK"


def test_real_apex_is_not_shadowed(tmp_path):
    fake = tmp_path / "site" / "apex"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    code = """
        import warnings, culmen.compat as compat
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            table = compat.install()
        assert "apex" not in table and "flash_attn" in table, table
        assert any("real 'apex' is installed" in str(x.message) for x in w)
        import apex
        assert getattr(apex, "REAL", False), apex
        compat.uninstall()
        import sys
        del sys.modules["apex"]
        table = compat.install(force=True)
        assert table["apex"] == "culmen"
        import apex, culmen
        assert apex is culmen
        print("OK")
    """
    assert _run(code, extra_path=[tmp_path / "site"]).strip() == "OK"


def test_run_script_with_argv(tmp_path):
    script = tmp_path / "train.py"
    (tmp_path / "helper_mod.py").write_text("VALUE = 42\n")
    script.write_text(textwrap.dedent("""
        import sys
        import apex.ops.backend, culmen.ops.backend
        import helper_mod  # from the script's folder, as `python train.py` would find it
        assert apex.ops.backend is culmen.ops.backend
        print("ARGV", sys.argv, __name__, helper_mod.VALUE)
    """))
    out = _run(["-m", "culmen.compat", str(script), "a", "--b", "c"], cwd=ROOT)
    assert f"ARGV {[str(script), 'a', '--b', 'c']} __main__ 42" in out


def test_run_module_with_argv(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tool.py").write_text("import sys, apex\nprint('MOD', sys.argv[1:], __name__, apex.__name__)\n")
    out = _run(["-m", "culmen.compat", "-m", "mypkg.tool", "x", "-y"], extra_path=[tmp_path])
    assert "MOD ['x', '-y'] __main__ culmen" in out


def test_usage_without_target():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "culmen.compat"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2 and "usage" in proc.stderr
