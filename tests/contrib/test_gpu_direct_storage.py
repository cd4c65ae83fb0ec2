"""apex.contrib.gpu_direct_storage.GDSFile: save/load round trips (host fallback on CPU; cuFile on GPUs where
the filesystem supports it), Apex's mode rules, and bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from culmen.contrib.gpu_direct_storage import GDSFile

SHAPES_DTYPES = [((63,), torch.float32), ((5, 123), torch.bfloat16), ((3, 7, 11), torch.float16),
                 ((1000,), torch.int64), ((17,), torch.bool), ((), torch.float64), ((0, 4), torch.float32)]


def _rand(shape, dtype, device="cpu"):
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-2**40, 2**40, shape, dtype=dtype, device=device)
    return torch.randn(shape, device=device).to(dtype)


@pytest.mark.parametrize("gds", [True, False], ids=["r-w", "rn-wn"])
def test_roundtrip_cpu(tmp_path, gds):
    for i, (shape, dtype) in enumerate(SHAPES_DTYPES):
        path = tmp_path / f"t{i}.bin"
        src = _rand(shape, dtype)
        with GDSFile(str(path), "w" if gds else "wn") as f:
            assert f.is_open and not f.uses_gds  # CPU tensors never go through cuFile
            (f.save_data if gds else f.save_data_no_gds)(src)
        assert not f.is_open
        assert path.stat().st_size == src.nbytes
        dst = torch.full(shape, 7, dtype=dtype) if dtype != torch.bool else torch.zeros(shape, dtype=dtype)
        with GDSFile(path, "r" if gds else "rn") as f:  # os.PathLike works too
            (f.load_data if gds else f.load_data_no_gds)(dst)
        assert torch.equal(dst, src), (shape, dtype)


def test_overwrite_truncates_and_reopen(tmp_path):
    path = str(tmp_path / "x.bin")
    f = GDSFile(path, "w")
    f.save_data(torch.arange(100, dtype=torch.int32))
    f.close()
    f.close()  # idempotent
    f.open(path, "w")  # reopening with the same name and mode is allowed
    f.save_data(torch.arange(10, dtype=torch.int32))
    f.close()
    assert os.path.getsize(path) == 40
    with pytest.raises(ValueError, match="cannot reopen"):
        f.open(path, "r")
    out = torch.empty(10, dtype=torch.int32)
    with GDSFile(path, "r") as g:
        g.load_data(out)
        with pytest.raises(ValueError, match="already open"):
            g.open(path, "r")
    assert torch.equal(out, torch.arange(10, dtype=torch.int32))


def test_mode_rules_and_bad_input(tmp_path):
    path = str(tmp_path / "y.bin")
    t = torch.randn(8)
    with pytest.raises(ValueError, match="mode"):
        GDSFile(path, "a")
    with pytest.raises(TypeError, match="filename"):
        GDSFile(3, "w")
    with GDSFile(path, "w") as f:
        with pytest.raises(ValueError, match="mode 'r'"):
            f.load_data(t)
        with pytest.raises(ValueError, match="mode 'wn'"):
            f.save_data_no_gds(t)
        with pytest.raises(ValueError, match="contiguous"):
            f.save_data(torch.randn(4, 6).t())
        with pytest.raises(TypeError, match="tensor"):
            f.save_data([1.0, 2.0])
        f.save_data(t)
    with pytest.raises(ValueError, match="closed"):
        f.save_data(t)
    with GDSFile(path, "rn") as f:
        with pytest.raises(ValueError, match="mode 'r'"):
            f.load_data(t)
        big = torch.empty(9)
        with pytest.raises(ValueError, match="holds 32 bytes"):
            f.load_data_no_gds(big)
    with pytest.raises(FileNotFoundError):
        GDSFile(str(tmp_path / "missing.bin"), "r")


def test_noncontiguous_source_slices_roundtrip(tmp_path):
    # A contiguous slice of a bigger tensor (storage offset != 0) saves only its own bytes.
    base = torch.randn(50)
    part = base[7:30]
    path = str(tmp_path / "p.bin")
    with GDSFile(path, "w") as f:
        f.save_data(part)
    out = torch.zeros(60)[5:28]
    with GDSFile(path, "r") as f:
        f.load_data(out)
    assert torch.equal(out, part)


def test_alias_import_and_extension_name():
    code = textwrap.dedent("""
        import culmen.compat as compat
        compat.install()
        from apex.contrib.gpu_direct_storage import GDSFile
        import culmen.contrib.gpu_direct_storage as c
        import culmen.contrib.gpu_direct_storage._apex_gpu_direct_storage as ext
        assert GDSFile is c.GDSFile is ext._GDSFile
        print("OK")
    """)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert out.stdout.strip() == "OK", out.stderr


@pytest.mark.gpu
def test_roundtrip_gpu(tmp_path):
    # tmp_path may be on a filesystem without O_DIRECT (tmpfs): then uses_gds is False and the host path runs.
    # Both must give the bytes back; the path taken is printed for the record.
    for i, (shape, dtype) in enumerate(SHAPES_DTYPES + [((4096, 1000), torch.bfloat16)]):
        src = _rand(shape, dtype, "cuda")
        for w, r, save, load in (("w", "r", "save_data", "load_data"),
                                 ("wn", "rn", "save_data_no_gds", "load_data_no_gds")):
            path = str(tmp_path / f"g{i}{w}.bin")
            with GDSFile(path, w) as f:
                getattr(f, save)(src)
                if w == "w":
                    used = f.uses_gds
            dst = torch.zeros(shape, dtype=dtype, device="cuda")
            with GDSFile(path, r) as f:
                getattr(f, load)(dst)
            torch.cuda.synchronize()
            assert torch.equal(dst, src), (shape, dtype, w)
            assert os.path.getsize(path) == src.nbytes
        print(f"shape {shape}: cuFile used: {used}")
    # A CUDA view with a storage offset round-trips too (cuFile writes whole storages: culmen compacts it).
    base = torch.randn(1000, device="cuda")
    path = str(tmp_path / "view.bin")
    with GDSFile(path, "w") as f:
        f.save_data(base[100:400])
    out = torch.zeros(2000, device="cuda")[50:350]
    with GDSFile(path, "r") as f:
        f.load_data(out)
    assert torch.equal(out, base[100:400])
