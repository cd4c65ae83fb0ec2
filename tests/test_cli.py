"""The culmen command: info, bench (harness on CPU with --quick), demo wiring."""

import json
import sys

import pytest
import torch

from culmen.cli import main


def test_info_prints_versions_and_ops(capsys, monkeypatch):
    monkeypatch.delenv("CULMEN_BACKEND", raising=False)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch    {torch.__version__}" in out
    assert "numpy" in out and "triton" in out and "python" in out
    assert "CULMEN_BACKEND=auto" in out
    for line in (ln for ln in out.splitlines() if "layer_norm_fwd" in ln or "layer_norm_bwd" in ln):
        assert "reference" in line  # CPU tensors take the reference path in auto mode
    assert "layer_norm_fwd" in out and "layer_norm_bwd" in out
    if not torch.cuda.is_available():
        assert "cpu (no CUDA/ROCm device)" in out


def test_info_reports_backend_errors_without_crashing(capsys, monkeypatch):
    from culmen.ops.backend import set_backend

    set_backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert main(["info"]) == 0
    assert "error: CULMEN_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1" in capsys.readouterr().out


def test_info_invalid_mode_exit_code(capsys, monkeypatch):
    from culmen.ops import backend

    # As if the process had started with a bad variable (it is read once, at import).
    monkeypatch.setattr(backend, "_MODE", None)
    monkeypatch.setenv("CULMEN_BACKEND", "bogus")
    assert main(["info"]) == 2
    assert "CULMEN_BACKEND invalid" in capsys.readouterr().out


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    names = [ln.split()[0] for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert {"layer_norm", "rms_norm", "dropout_add_norm"} <= set(names)


def test_bench_unknown_name(capsys):
    assert main(["bench", "--quick", "no_such_bench"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_bench_quick_layer_norm_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CULMEN_BACKEND", raising=False)
    path = tmp_path / "out" / "bench.json"
    assert main(["bench", "--quick", "layer_norm", "--device", "cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "roofline:" in out and "== summary" in out and "json written" in out
    assert "wall(ms)" in out and "graph(ms)" in out and "host(us)" in out and "host culmen/ref geomean=" in out
    data = json.loads(path.read_text())
    meta = data["metadata"]
    assert meta["torch"] == torch.__version__ and meta["roofline"]["gbps"] > 0
    assert {"date", "gpu", "triton", "git_commit", "culmen_backend"} <= set(meta)
    recs = data["records"]
    assert {r["benchmark"] for r in recs} == {"layer_norm"}
    assert {r["provider"] for r in recs} >= {"culmen", "torch"}
    modes = {r["case"].split()[-1] for r in recs}
    assert modes == {"fwd", "fwd+bwd"}
    for r in recs:
        assert r["error"] is None, r
        assert r["ms"] > 0 and r["gbps"] > 0 and r["bytes"] > 0
        # CPU: no CUDA graphs; every call is host work, so host time is the wall time.
        assert r["graph_ms"] is None and r["graph_error"] is None
        assert r["host_us"] == pytest.approx(r["ms"] * 1e3)
    ours = [r for r in recs if r["provider"] == "culmen"]
    for r in ours:
        torch_rec = next(t for t in recs if t["provider"] == "torch" and t["case"] == r["case"])
        assert r["host_ratio"] == pytest.approx(r["host_us"] / torch_rec["host_us"])
        assert r["best_peer"] == "torch" and r["speedup"] > 0
        # The reference path must agree with torch eager: this is the sanity check doing its job.
        assert r["max_abs_diff"] is not None and r["max_abs_diff"] < 0.5
        if "fwd+bwd" in r["case"]:
            assert {"y", "dx", "dw", "db"} <= set(r["diffs"])


def test_bench_has_no_timer_option(capsys):
    """Ratios always use the eager wall time; the CUDA-graph column can only be switched off."""
    with pytest.raises(SystemExit):
        main(["bench", "--timer", "graph", "layer_norm"])
    assert "unrecognized arguments: --timer" in capsys.readouterr().err


def test_bench_bytes_count_each_tensor_once(tmp_path):
    from culmen.bench.norms import _norm_bytes

    M, N = 16384, 4096
    assert _norm_bytes(M, N, 2, "fwd", rms=False) == 2 * M * N * 2 + 2 * N * 2
    assert _norm_bytes(M, N, 4, "fwd", rms=True) == 2 * M * N * 4 + N * 4
    fwd = _norm_bytes(M, N, 2, "fwd", rms=False)
    assert _norm_bytes(M, N, 2, "fwd+bwd", rms=False) == fwd + 3 * M * N * 2 + 3 * N * 2


def test_bench_reports_a_broken_provider(capsys):
    """A provider that raises, or returns wrong values, shows in the table and records; the run goes on."""
    from culmen.bench.registry import BenchConfig, Benchmark, Case
    from culmen.bench.runner import _run_case

    x = torch.randn(8, 16)

    def broken():
        raise RuntimeError("kernel exploded")

    case = Case("8x16 fp32 fwd", {"culmen": lambda: x * 2 + 1, "torch": lambda: x * 2, "other": broken}, bytes=1024)
    bench = Benchmark("toy", "test", lambda cfg: iter([case]))
    recs = {r.provider: r for r in _run_case(bench, case, torch.device("cpu"), True, 10.0, sys.stdout, set())}
    out = capsys.readouterr().out
    assert recs["other"].error == "RuntimeError: kernel exploded" and "kernel exploded" in out
    assert recs["culmen"].max_abs_diff == pytest.approx(1.0)
    assert recs["culmen"].best_peer == "torch"
    assert recs["culmen"].speedup == pytest.approx(recs["torch"].ms / recs["culmen"].ms)
    assert BenchConfig(torch.device("cpu")).quick is False


def test_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    from culmen.bench.runner import BenchReport, Record, write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    report = BenchReport({"roofline": {"gbps": 1.0}}, [Record("b", "f", "c", "culmen", ms=1.0, gbps=1.0)])
    assert write_plot(report, tmp_path / "x.png") == []
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _toy_records():
    from culmen.bench.runner import Record

    return [
        Record("ln", "normalization", "a fwd", "culmen", ms=1.0, best_peer="torch"),
        Record("ln", "normalization", "a fwd", "torch", ms=2.0),
        Record("ln", "normalization", "a fwd", "compile", error="RuntimeError: inductor"),
        Record("ln", "normalization", "b fwd", "culmen", error="RuntimeError: kernel exploded"),
        Record("ln", "normalization", "b fwd", "torch", ms=1.0),
        Record("ln", "normalization", "b fwd", "compile", ms=0.5),
        Record("relu", "activations", "c", "culmen", ms=4.0, best_peer="torch"),
        Record("relu", "activations", "c", "torch", ms=1.0),
        Record("relu", "activations", "c", "liger", ms=2.0),
    ]


def test_case_ratios_are_relative_to_the_best_peer():
    from culmen.bench.plot import case_ratios

    fam = case_ratios(_toy_records())
    assert list(fam) == ["normalization", "activations"]
    a, b = fam["normalization"]
    assert a.best_peer == "torch" and a.ratios == {"culmen": 2.0, "torch": 1.0} and a.culmen == 2.0
    assert set(a.failed) == {"compile"}
    # culmen failed: the fastest other provider is the best peer; culmen has no ratio, only its error.
    assert b.best_peer == "compile" and b.culmen is None and b.ratios == {"torch": 0.5, "compile": 1.0}
    assert b.failed["culmen"] == "RuntimeError: kernel exploded"
    (c,) = fam["activations"]
    assert c.ratios == {"culmen": 0.25, "torch": 1.0, "liger": 0.5}


def test_plot_writes_one_png_per_family_and_an_overview(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from culmen.bench.plot import ROW_IN, family_path
    from culmen.bench.runner import BenchReport, write_plot

    path = tmp_path / "figs" / "run.png"
    written = write_plot(BenchReport({"gpu": "cpu", "roofline": {"gbps": 3.0}}, _toy_records()), path)
    expected = [tmp_path / "figs" / "run-normalization.png", tmp_path / "figs" / "run-activations.png", path]
    assert written == expected
    assert family_path(path, "normalization") == expected[0]
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted(p.name for p in expected)
    sizes = {p.name: _png_size(p) for p in expected}
    # One row per case (+ a header per benchmark): a family of 3 lines is a small figure, not a tall strip.
    w, h = sizes["run-normalization.png"]
    assert w == 1200 and h < 100 * (2.5 + ROW_IN * 3) + 1
    assert sizes["run-activations.png"][1] < h
    out = capsys.readouterr().out
    assert all(f"plot written to {p}" in out for p in expected)


def test_plot_height_grows_per_case_not_per_benchmark_panel(tmp_path):
    """33 benchmarks of 4 cases in 3 families: three figures of readable height (no 15,000-pixel strip)."""
    pytest.importorskip("matplotlib")
    from culmen.bench.runner import BenchReport, Record, write_plot

    recs = []
    for i in range(33):
        for c in range(4):
            for prov, ms in (("culmen", 1.0 + 0.1 * c), ("torch", 1.2), ("compile", 0.9 + 0.05 * i)):
                recs.append(Record(f"bench{i}", f"family{i % 3}", f"case {c}", prov, ms=ms,
                                   best_peer="compile" if prov == "culmen" else None))
    written = write_plot(BenchReport({"gpu": "cpu"}, recs), tmp_path / "b.png")
    assert [p.name for p in written] == ["b-family0.png", "b-family1.png", "b-family2.png", "b.png"]
    for p in written:
        w, h = _png_size(p)
        assert 900 <= w <= 1200 and 300 < h < 2000, (p.name, w, h)


def test_plot_from_saved_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from culmen.bench.runner import BenchReport, _write_json

    src = tmp_path / "run.json"
    _write_json(BenchReport({"gpu": "cpu"}, _toy_records()), src)
    assert main(["bench", "--from-json", str(src), "--plot", str(tmp_path / "p.png")]) == 0
    assert sorted(p.name for p in tmp_path.glob("p*.png")) == ["p-activations.png", "p-normalization.png", "p.png"]
    assert main(["bench", "--from-json", str(src)]) == 2
    assert "give --plot PATH too" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"metadata": {}}')
    assert main(["bench", "--from-json", str(bad), "--plot", str(tmp_path / "q.png")]) == 2
    assert "not a culmen bench JSON report" in capsys.readouterr().err


def test_bench_quick_cpu_run_plots_each_family(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.delenv("CULMEN_BACKEND", raising=False)
    path = tmp_path / "bench.png"
    assert main(["bench", "--quick", "layer_norm", "relu", "--device", "cpu", "--plot", str(path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-activations.png", "bench-normalization.png",
                                                          "bench.png"]


@pytest.mark.parametrize("spec, message", [
    ("cuda", "no CUDA/ROCm GPU is available here"),
    ("cuda:0", "no CUDA/ROCm GPU is available here"),
    ("bogus", "is not a device name"),
    ("meta", "the benchmarks time cpu and cuda"),
])
def test_bench_bad_device_is_one_plain_line(spec, message, capsys):
    if spec.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("a CUDA device exists here")
    assert main(["bench", "--quick", "layer_norm", "--device", spec]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("culmen bench: --device") and message in err
    assert "Traceback" not in err


def test_bench_device_without_gpu_exits_nonzero_without_traceback():
    """The whole command, as a user runs it: one line on stderr, exit status 2."""
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("a CUDA device exists here")
    proc = subprocess.run([sys.executable, "-m", "culmen", "bench", "--quick", "layer_norm", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120, env=_env_with_repo())
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no CUDA/ROCm GPU" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_version(capsys):
    import culmen

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"culmen {culmen.__version__}"


def test_version_matches_the_package_metadata():
    from importlib.metadata import PackageNotFoundError, version

    import culmen

    try:
        assert version("culmen") == culmen.__version__
    except PackageNotFoundError:
        pytest.skip("culmen is not installed (run from a source tree)")


def test_demo_subcommand_rejects_missing_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device exists here")
    assert main(["demo", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_python_dash_m_culmen_runs():
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "culmen", "--help"], capture_output=True, text=True, timeout=120,
                          env=_env_with_repo())
    assert proc.returncode == 0 and "info" in proc.stdout and "bench" in proc.stdout and "demo" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "culmen", "--version"], capture_output=True, text=True, timeout=120,
                          env=_env_with_repo())
    assert proc.returncode == 0 and proc.stdout.startswith("culmen ")


def _env_with_repo():
    import os
    from pathlib import Path

    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env
