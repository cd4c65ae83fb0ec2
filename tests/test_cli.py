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
    assert write_plot(report, tmp_path / "x.png") is False
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from culmen.bench.runner import BenchReport, Record, write_plot

    recs = [Record("b", "f", "c1", p, ms=1.0, gbps=g) for p, g in (("culmen", 2.0), ("torch", 1.0))]
    path = tmp_path / "x.png"
    assert write_plot(BenchReport({"roofline": {"gbps": 3.0}, "gpu": "cpu"}, recs), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def _env_with_repo():
    import os
    from pathlib import Path

    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env
