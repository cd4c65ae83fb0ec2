"""culmen bench train_step: the twin models, the CLI run on CPU, the options, and the runner's host timer."""

import json
import math
import time

import pytest
import torch

from culmen.bench import models
from culmen.bench.models import IMPLS, STYLES, build_model, build_optimizer, make_batch, model_config
from culmen.cli import main


@pytest.mark.parametrize("style", STYLES)
def test_twin_models_start_equal_and_agree(style):
    """Both implementations have the same parameters, the same initial values and (fp32, CPU: culmen's
    reference paths) the same loss and gradients."""
    cfg = model_config(style, "tiny")
    dev = torch.device("cpu")
    models = {impl: build_model(cfg, impl, dev, torch.float32, seed=3) for impl in IMPLS}
    sd = {impl: dict(m.named_parameters()) for impl, m in models.items()}
    assert sd["torch"].keys() == sd["culmen"].keys()
    for name, p in sd["torch"].items():
        assert torch.equal(p, sd["culmen"][name]), name
    n = sum(p.numel() for p in sd["torch"].values())
    assert n == cfg.n_params()
    assert len({float(p.detach().std()) for p in sd["torch"].values() if p.dim() == 2}) > 1  # not one tensor
    tokens, labels = make_batch(cfg, dev, seed=1)
    assert tokens.shape == labels.shape == (cfg.batch, cfg.seq) and torch.equal(tokens[:, 1:], labels[:, :-1])
    losses = {}
    for impl, m in models.items():
        loss = m(tokens, labels)
        loss.backward()
        losses[impl] = loss
    assert abs(losses["torch"].item() - math.log(cfg.vocab)) < 0.5  # small init: near-uniform predictions
    torch.testing.assert_close(losses["culmen"], losses["torch"], rtol=1e-5, atol=1e-5)
    for name, p in sd["torch"].items():
        torch.testing.assert_close(sd["culmen"][name].grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    # Different seeds give different weights.
    other = build_model(cfg, "torch", dev, torch.float32, seed=4)
    assert not torch.equal(other.layers[0].qkv.weight, models["torch"].layers[0].qkv.weight)


@pytest.mark.parametrize("style,rotary", [("llama", "packed"), ("llama", "split"), ("gpt2", "packed")])
def test_culmen_model_compiled_equals_eager(style, rotary, compile_fusion, monkeypatch):
    """The culmen model under torch.compile (its LLaMA block rotates Q and K out of place there, as the packed
    q|k slice or after unbinding, ``models.COMPILE_ROTARY``, and the norms, rotary and activations trace as
    PyTorch with the fusion switch on) gives the eager loss and gradients."""
    monkeypatch.setattr(models, "COMPILE_ROTARY", rotary)
    torch._dynamo.reset()
    cfg = model_config(style, "tiny")
    dev = torch.device("cpu")
    model = build_model(cfg, "culmen", dev, torch.float32, seed=3)
    tokens, labels = make_batch(cfg, dev, seed=1)
    eager = model(tokens, labels)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    comp = torch.compile(model, fullgraph=True, backend="aot_eager")(tokens, labels)
    comp.backward()
    torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_optimizers_take_the_same_step():
    """Two AdamW steps (lr 1e-2) move both models alike: Adam's update is about lr * sign(grad), so the
    tolerance is a small fraction of lr (near-zero gradients may differ in sign by rounding)."""
    cfg = model_config("llama", "tiny")
    dev = torch.device("cpu")
    tokens, labels = make_batch(cfg, dev)
    params, init = {}, dict(build_model(cfg, "torch", dev, torch.float32).named_parameters())
    for impl in IMPLS:
        m = build_model(cfg, impl, dev, torch.float32)
        opt = build_optimizer(m, impl, lr=1e-2)
        for _ in range(2):
            m(tokens, labels).backward()
            opt.step()
            m.zero_grad(set_to_none=True)
        params[impl] = dict(m.named_parameters())
    for name, p in params["torch"].items():
        assert (p - init[name]).abs().max() > 1e-2, name  # the step moved it by about 2 * lr
        torch.testing.assert_close(params["culmen"][name], p, rtol=0, atol=5e-4, msg=name)
        assert (params["culmen"][name] - p).abs().mean() < 2e-5, name


def test_train_step_quick_cpu_through_the_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CULMEN_BACKEND", raising=False)
    path = tmp_path / "ts.json"
    t0 = time.perf_counter()
    assert main(["bench", "train_step", "--quick", "--device", "cpu", "--json", str(path)]) == 0
    assert time.perf_counter() - t0 < 60
    out = capsys.readouterr().out
    assert "torch ms" in out and "culmen ms" in out and "== summary" in out
    data = json.loads(path.read_text())
    rows = data["train_step"]
    assert {(r["model"], r["size"], r["mode"]) for r in rows} == {("llama", "tiny", "eager"), ("gpt2", "tiny", "eager")}
    for row in rows:
        for impl in IMPLS:
            r = row[impl]
            assert r["error"] is None, r
            assert r["ms"] > 0 and r["tokens_per_s"] > 0 and r["host_ms"] > 0 and r["first_step_s"] > 0
            assert set(r["host_phases_ms"]) == {"forward", "backward", "optimizer"}
            assert r["peak_gib"] is None and r["opt_state_gib"] is None  # CPU: no allocator statistics
            assert r["params"] == row["params"] > 0
            assert r["loss"] < r["first_loss"]  # 2 + 2 + 3 AdamW steps on one fixed batch
        assert abs(row["loss_diff"]) < 1e-3 and row["loss_diff"] == row["culmen"]["loss"] - row["torch"]["loss"]
        assert row["speedup"] == pytest.approx(row["torch"]["ms"] / row["culmen"]["ms"])
        assert row["host_ratio"] == pytest.approx(row["culmen"]["host_ms"] / row["torch"]["host_ms"])
    recs = [r for r in data["records"] if r["benchmark"] == "train_step"]
    assert {r["provider"] for r in recs} == {"culmen", "torch"} and len(recs) == 4
    for r in recs:
        assert r["error"] is None and r["ms"] > 0 and r["host_us"] > 0
        if r["provider"] == "culmen":
            assert r["best_peer"] == "torch" and r["speedup"] > 0 and r["diffs"]["loss"] < 1e-3
    assert data["metadata"]["options"] == {}


def test_train_step_options(tmp_path, capsys):
    path = tmp_path / "ts.json"
    assert main(["bench", "train_step", "--device", "cpu", "--models", "gpt2", "--steps", "1", "--warmup", "1",
                 "--host-steps", "0", "--batch", "1", "--seq", "8", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    (row,) = data["train_step"]
    assert (row["model"], row["batch"], row["seq"], row["steps"]) == ("gpt2", 1, 8, 1)
    assert row["torch"]["host_ms"] is None and row["torch"]["ms"] > 0
    assert data["metadata"]["options"]["models"] == "gpt2"
    # A time limit already passed skips every case, which the report says.
    assert main(["bench", "train_step", "--device", "cpu", "--time-limit", "0", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["train_step"]
    assert rows and all("time limit" in r["skipped"] for r in rows)
    capsys.readouterr()
    assert main(["bench", "train_step", "--device", "cpu", "--sizes", "d4096"]) == 2
    assert "sizes must be among" in capsys.readouterr().err


def test_model_train_impls_and_cases_options(tmp_path, capsys):
    """``--model-impls`` / ``--model-cases`` choose what ``model_train`` runs; a bad name is a usage error."""
    pytest.importorskip("transformers")
    path = tmp_path / "mt.json"
    assert main(["bench", "model_train", "--quick", "--device", "cpu", "--model-cases", "tiny-llama",
                 "--model-impls", "hf_sdpa,fa_gpt", "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["model_train"]
    assert row["case"] == "tiny-llama" and set(row["runs"]) == {"hf_sdpa", "fa_gpt"}
    assert all(r["error"] is None and r["ms"] > 0 for r in row["runs"].values())
    capsys.readouterr()
    assert main(["bench", "model_train", "--quick", "--device", "cpu", "--model-impls", "hf_flash"]) == 2
    assert "model_impls must be among" in capsys.readouterr().err


def test_train_step_is_opt_in(capsys):
    from culmen.bench import load_benchmarks, select_benchmarks

    load_benchmarks()
    assert "train_step" not in {b.name for b in select_benchmarks(None)}
    assert [b.name for b in select_benchmarks(["train_step"])] == ["train_step"]
    assert main(["bench", "--list"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("train_step"))
    assert "end_to_end" in line and "run by name only" in line


def test_standalone_entry_point(tmp_path):
    from culmen.bench.train_step import main as ts_main

    path = tmp_path / "ts.json"
    assert ts_main(["--device", "cpu", "--models", "llama", "--steps", "1", "--warmup", "1", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["train_step"][0]["culmen"]["ms"] > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_block_drain_fires_around_every_block(impl, monkeypatch):
    """The eager host-time steps drain the GPU before each block's forward and after its backward, and
    count the time spent there (here a fake synchronize that sleeps 2 ms)."""
    from culmen.bench.train_step import _BlockDrain

    calls = []

    def fake_sync(*a):
        calls.append(1)
        time.sleep(2e-3)

    monkeypatch.setattr(torch.cuda, "synchronize", fake_sync)
    cfg = model_config("llama", "tiny")
    m = build_model(cfg, impl, torch.device("cpu"), torch.float32)
    tokens, labels = make_batch(cfg, torch.device("cpu"))
    drain = _BlockDrain(m.layers, torch.device("cpu"))
    m(tokens, labels).backward()
    assert len(calls) == 2 * cfg.layers
    assert 2 * cfg.layers * 2e-3 <= drain.spent < 2 * cfg.layers * 2e-3 + 0.5
    drain.remove()
    m(tokens, labels).backward()
    assert len(calls) == 2 * cfg.layers


# ------------------------------------------------------------------------------------- host timer


class _FakeGPU:
    """Simulated device for the host timer: ``_sleep`` keeps it busy until a deadline on the host clock;
    an event recorded behind it completes at that deadline."""

    def __init__(self, monkeypatch, cycles_per_ms=1e6):
        from culmen.bench import runner

        self.until = 0.0
        self.sleeps = []
        monkeypatch.setitem(runner._SLEEP_CYCLES_PER_MS, 0, cycles_per_ms)
        gpu = self

        class Event:
            def record(self):
                self.at = gpu.until

            def query(self):
                return time.perf_counter() >= self.at

        def sleep(cycles):
            ms = cycles / cycles_per_ms
            gpu.sleeps.append(ms)
            gpu.until = max(gpu.until, time.perf_counter()) + ms / 1e3

        monkeypatch.setattr(torch.cuda, "_sleep", sleep)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: self.drain())
        monkeypatch.setattr(torch.cuda, "device", lambda d: _Null())

    def drain(self):
        while time.perf_counter() < self.until:
            time.sleep(1e-4)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_host_timer_retries_until_the_gpu_outlasts_the_host(monkeypatch):
    from culmen.bench.runner import host_us

    gpu = _FakeGPU(monkeypatch)

    def call():  # 2 ms of host work
        t = time.perf_counter()
        while time.perf_counter() - t < 2e-3:
            pass

    # wall_ms far below the truth: the first sleep is too short, so the timer must lengthen it.
    us = host_us(call, torch.device("cuda", 0), wall_ms=0.05, calls=4, samples=3)
    assert us is not None and 1900 < us < 20000  # 2 ms of work per call (loose: shared CI cores)
    assert max(gpu.sleeps) > 4 * min(gpu.sleeps)


def test_host_timer_gives_up_on_a_call_that_syncs(monkeypatch):
    from culmen.bench.runner import host_us

    gpu = _FakeGPU(monkeypatch)
    assert host_us(gpu.drain, torch.device("cuda", 0), wall_ms=0.05, calls=2, samples=2) is None


@pytest.mark.gpu
def test_host_timer_on_gpu_is_not_device_time():
    from culmen.bench.runner import host_us, time_ms

    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(8192, 8192, device=dev)
    wall = time_ms(lambda: x.mul(2.0), dev)
    host = host_us(lambda: x.mul(2.0), dev, wall_ms=wall)
    assert wall > 0.1 and host is not None and host < 0.5 * wall * 1e3
    assert host_us(lambda: x.sum().item(), dev) is None


@pytest.mark.gpu
def test_train_step_quick_gpu(tmp_path):
    path = tmp_path / "ts.json"
    assert main(["bench", "train_step", "--quick", "--modes", "eager", "--json", str(path)]) == 0
    for row in json.loads(path.read_text())["train_step"]:
        for impl in IMPLS:
            assert row[impl]["error"] is None and row[impl]["peak_gib"] > 0 and row[impl]["host_ms"] > 0
        assert abs(row["loss_diff"]) < 0.05
