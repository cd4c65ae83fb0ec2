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


# ------------------------------------------------------------------ `import apex` as Apex's __init__ gave it


def test_apex_exposes_its_subpackages_lazily():
    out = _run("""
        import sys, warnings
        import culmen.compat as compat
        compat.install()
        import apex, culmen
        # Nothing heavy on `import apex`: the subpackages (and Triton) load on first access.
        heavy = [m for m in sys.modules if m.startswith(("culmen.amp", "culmen.normalization", "culmen.optimizers",
                                                         "culmen.parallel", "culmen.ops", "triton"))]
        assert not heavy, heavy
        names = ["amp", "optimizers", "normalization", "parallel", "fp16_utils", "transformer", "mlp",
                 "fused_dense", "contrib", "multi_tensor_apply"]
        for name in names:
            mod = getattr(apex, name)
            assert mod is sys.modules["culmen." + name] and mod.__name__ == "culmen." + name, name
            assert name in dir(apex), name
        # Attribute and `import apex.X` forms meet the same objects.
        import apex.amp, apex.optimizers.fused_adam
        assert apex.amp.initialize is culmen.amp.initialize
        assert apex.optimizers.FusedAdam is apex.optimizers.fused_adam.FusedAdam
        assert apex.normalization.FusedLayerNorm is culmen.normalization.FusedLayerNorm
        assert apex.transformer.functional.fused_apply_rotary_pos_emb is not None
        for missing in ("RNN_not_there", "_private"):
            try:
                getattr(apex, missing)
            except AttributeError as e:
                assert missing in str(e)
            else:
                raise SystemExit(missing + " resolved")
        # Apex's module-level helpers.
        assert apex.DeprecatedFeatureWarning is culmen.amp.DeprecatedFeatureWarning
        assert issubclass(apex.DeprecatedFeatureWarning, FutureWarning)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            apex.deprecated_warning("old API")
            ok = apex.check_cudnn_version_and_warn("some_option", 10**9)
        assert [type(x.message) for x in w][0] is apex.DeprecatedFeatureWarning, w
        assert ok is False and "some_option" in str(w[1].message), w
        print("OK")
    """)
    assert out.strip() == "OK"


def test_apex_star_import_and_plain_import_culmen_stay_light():
    out = _run("""
        import sys
        import culmen
        assert "torch" not in sys.modules, "import culmen imported torch"
        ns = {}
        exec("from culmen import *", ns)
        for name in ("amp", "optimizers", "normalization", "parallel", "fp16_utils", "transformer"):
            assert ns[name] is sys.modules["culmen." + name], name
        print("OK")
    """)
    assert out.strip() == "OK"


def test_flash_attn_top_level_names():
    out = _run("""
        import culmen.compat as compat
        compat.install()
        import flash_attn
        import flash_attn.flash_attn_interface as fai
        assert flash_attn.__version__ == "2.8.3"
        for name in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
                     "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
                     "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"):
            assert getattr(flash_attn, name) is getattr(fai, name), name
            assert name in flash_attn.__all__
        from flash_attn import flash_attn_func
        assert flash_attn_func is fai.flash_attn_func
        print("OK")
    """)
    assert out.strip() == "OK"


# ----------------------------------------------------------------------------------------- launchers

_RANK_SCRIPT = """
import sys
import apex
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"RANK {dist.get_rank()}/{dist.get_world_size()} apex={apex.__name__}:{getattr(apex, 'REAL', '-')} "
      f"argv={sys.argv[1:]}", flush=True)
dist.destroy_process_group()
"""


def _launch(args, tmp_path, extra_path=()):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180, env=env,
                          cwd=tmp_path)


def test_apex_multiproc_through_the_alias(tmp_path):
    """`python -m culmen.compat --force -m apex.parallel.multiproc` (runpy through the alias loader) starts
    workers (gloo, 2 ranks) that import apex as culmen, with Apex's rank arguments; the real apex
    installed here stays shadowed in the workers because `--force` reaches them too."""
    fake = tmp_path / "site" / "apex"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    script = tmp_path / "train.py"
    script.write_text(_RANK_SCRIPT)
    proc = _launch(["-m", "culmen.compat", "--force", "-m", "apex.parallel.multiproc", "--nproc", "2",
                    "--no-log-files", str(script), "x"], tmp_path, extra_path=[tmp_path / "site"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"RANK {rank}/2 apex=culmen:- argv=['x', '--world-size', '2', '--rank', '{rank}']" in proc.stdout


def test_runpy_through_the_alias():
    out = _run("""
        import runpy, culmen.compat as compat
        compat.install()
        g = runpy.run_module("apex.parallel.multiproc", run_name="not_main")
        assert callable(g["launch_command"]) and g["__file__"].endswith("multiproc.py"), g["__file__"]
        import importlib.util
        spec = importlib.util.find_spec("apex.parallel.multiproc")
        assert spec.loader.get_source(spec.name) == open(g["__file__"]).read()
        assert not spec.loader.is_package(spec.name)
        pkg = importlib.util.find_spec("apex.parallel")
        assert pkg.loader.is_package(pkg.name) and pkg.submodule_search_locations is not None
        print("OK")
    """)
    assert out.strip() == "OK"


def test_missing_targets_give_a_message_not_a_traceback(tmp_path):
    proc = _launch(["-m", "culmen.compat", "missing.py", "a"], tmp_path)
    assert proc.returncode == 2 and "can't open file" in proc.stderr and "missing.py" in proc.stderr
    assert "Traceback" not in proc.stderr
    for module in ("no_such_pkg.tool", "no_such_module"):
        proc = _launch(["-m", "culmen.compat", "-m", module], tmp_path)
        assert proc.returncode == 1 and "No module named" in proc.stderr and "Traceback" not in proc.stderr, \
            proc.stderr
    proc = _launch(["-m", "culmen.compat", "--bogus"], tmp_path)
    assert proc.returncode == 2 and "unknown option" in proc.stderr and "Traceback" not in proc.stderr
    proc = _launch(["-m", "culmen.parallel.multiproc", "--nproc", "2", "missing.py"], tmp_path)
    assert proc.returncode == 2 and "can't open file" in proc.stderr and "Traceback" not in proc.stderr
    # An error inside the script itself keeps its traceback.
    (tmp_path / "bad.py").write_text("import no_such_dependency\n")
    proc = _launch(["-m", "culmen.compat", "bad.py"], tmp_path)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "no_such_dependency" in proc.stderr


def test_flash_attn_extension_module_is_aliased():
    """``import flash_attn_2_cuda`` (flash_attn's compiled extension) is culmen's Python module with the
    extension's entry points."""
    import importlib

    from culmen import compat

    was = compat.installed()
    compat.install()
    try:
        ext = importlib.import_module("flash_attn_2_cuda")
        import culmen.flash_attn.flash_attn_2_cuda as ours

        assert ext is ours
        for name in ("fwd", "bwd", "varlen_fwd", "varlen_bwd", "fwd_kvcache"):
            assert callable(getattr(ext, name))
    finally:
        if not was:
            compat.uninstall()
