"""culmen bench model_parallel on CPU: the suite end to end on 2 gloo ranks (tiny GPT), the tensor-parallel
models against the unsharded one, and the option checks. The GPU numbers come from scripts/gpu-parallel-check."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from culmen.bench import parallel_models as pm
from culmen.bench.registry import BenchConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402


def test_suite_runs_every_section_on_gloo(tmp_path):
    """``culmen bench model_parallel --quick`` on CPU: every implementation of every section trains, the
    table and the JSON report hold their rows, the 1F1B bubble is a fraction and the records name culmen."""
    from culmen.bench.runner import run_benchmarks

    out = io.StringIO()
    path = tmp_path / "mp.json"
    report = run_benchmarks(["model_parallel"], device="cpu", quick=True, json_path=path, out=out, graph=False)
    text = out.getvalue()
    details = {d["section"]: d for d in report.extra["model_parallel"]}
    assert set(details) == set(pm.SECTIONS)
    for section, impls in (("tp", pm.TP_IMPLS), ("zero", pm.ZERO_IMPLS), ("pipeline", ("culmen_1f1b",))):
        rows = {r["impl"]: r for r in details[section]["rows"]}
        assert set(rows) == set(impls), (section, rows)
        for impl, r in rows.items():
            assert r.get("error") is None, (section, impl, r.get("error"), r.get("traceback"))
            assert r["ms"] > 0 and r["tokens_per_s"] > 0, (section, impl)
            assert f"{impl:<16}" in text
            if section != "pipeline":
                # a freshly initialized LM predicts ~uniformly: loss near log(vocab), and finite after training
                assert abs(r["first_loss"] - math.log(pm.SHAPES["tiny"].vocab)) < 1.0, (impl, r["first_loss"])
                assert math.isfinite(r["loss"])
    pipe = details["pipeline"]["rows"][0]
    assert pipe["theory"] == pytest.approx(1 / 9)
    assert len(pipe["stage_bubble"]) == 2 and all(0.0 <= b < 1.0 for b in pipe["stage_bubble"])
    assert details["zero"]["summary"]["dfa_vs_fsdp2"] > 0
    recs = [r for r in report.records if r.benchmark == "model_parallel"]
    assert {r.provider for r in recs} >= {"culmen", "torch_tp", "fsdp2", "culmen_tp_sp", "fused_adam_1gpu"}
    tp_culmen = next(r for r in recs if r.provider == "culmen" and r.case.startswith("tp "))
    assert tp_culmen.best_peer == "torch_tp" and tp_culmen.speedup > 0
    saved = json.loads(path.read_text())
    assert [d["section"] for d in saved["model_parallel"]] == list(pm.SECTIONS)


def _copy_shards(plain: torch.nn.Module, tp: torch.nn.Module, rank: int, world: int) -> None:
    """Load ``plain``'s weights into culmen's TP model: column layers and the embedding / head keep their
    block of rows, row layers their block of columns."""
    dense = dict(plain.named_parameters())
    with torch.no_grad():
        for name, p in tp.named_parameters():
            full = dense[name.replace(".inner", "")]
            if p.shape == full.shape:
                p.copy_(full)
            else:
                dim = 0 if p.shape[0] != full.shape[0] else 1
                n = p.shape[dim]
                p.copy_(full.narrow(dim, rank * n, n))


def _tp_equivalence_worker(rank: int, world: int) -> list[str]:
    """The benchmark's tensor-parallel GPTs (culmen TP, culmen TP + SP, PyTorch TP) compute the same loss and
    weight gradients as the unsharded GPT with the same weights (fp32, CPU)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from culmen.transformer import parallel_state as ps
    from culmen.transformer.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(world)
    model_parallel_cuda_manual_seed(0)
    shape, dev, f32 = pm.SHAPES["tiny"], torch.device("cpu"), torch.float32
    fails: list[str] = []

    def plain_model():
        torch.manual_seed(11)
        m = pm.GPT(shape, pm._Linears("plain", f32, dev))
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.02)  # non-zero biases and non-trivial norms
        return m

    tokens, labels = pm._batch(shape, 3, dev, seed=5)  # batch 3: odd
    ref = plain_model()
    ref_loss = ref(tokens, labels)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for impl in ("culmen_tp", "culmen_tp_sp", "torch_tp"):
        if impl == "torch_tp":
            model = pm._build_tp(impl, shape, f32, dev, world)
            with torch.no_grad():
                for p, q in zip(model.parameters(), plain_model().parameters()):
                    p.copy_(distribute_tensor(q, p.device_mesh, p.placements) if isinstance(p, DTensor) else q)
            with loss_parallel():
                loss = model(tokens, labels)
                loss.backward()
        else:
            model = pm._build_tp(impl, shape, f32, dev, world)
            _copy_shards(plain_model(), model, rank, world)
            loss = model(tokens, labels)
            loss.backward()
            sp = [p for p in model.parameters() if getattr(p, "sequence_parallel_enabled", False)]
            if impl == "culmen_tp_sp" and not sp:
                fails.append("culmen_tp_sp: no parameter is marked sequence_parallel_enabled")
            pm._allreduce_grads(sp, ps.get_tensor_model_parallel_group())
        if not torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6):
            fails.append(f"{impl}: loss {loss.item()} != unsharded {ref_loss.item()}")
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            want = ref_grads[name.replace(".inner", "")]
            if g.shape != want.shape:
                dim = 0 if g.shape[0] != want.shape[0] else 1
                want = want.narrow(dim, rank * g.shape[dim], g.shape[dim])
            if not torch.allclose(g, want, rtol=1e-4, atol=1e-6):
                fails.append(f"{impl}: grad of {name} off by {(g - want).abs().max().item():.3g}")
    ps.destroy_model_parallel()
    return fails


def test_tensor_parallel_models_equal_the_unsharded_model():
    for fails in run_group(_tp_equivalence_worker, 2, timeout=120):
        assert not fails, "\n".join(fails)


def test_options_and_skips():
    cfg = BenchConfig(torch.device("cpu"), quick=True, options={"parallel_sections": "tp,nope"})
    with pytest.raises(ValueError, match="nope"):
        pm._options(cfg)
    with pytest.raises(ValueError, match="parallel_shape"):
        pm._options(BenchConfig(torch.device("cpu"), options={"parallel_shape": "7b"}))
    with pytest.raises(ValueError, match="steps"):
        pm._options(BenchConfig(torch.device("cpu"), options={"steps": -1}))
    opts, sections = pm._options(BenchConfig(torch.device("cpu"), quick=True))
    assert sections == pm.SECTIONS and opts["shape"] == "tiny" and opts["world"] == 2
    # a spent time limit skips every section without spawning anything
    out = io.StringIO()
    results = list(pm.bench_model_parallel(BenchConfig(torch.device("cpu"), quick=True, options={"time_limit": -1}),
                                           out))
    assert [r.detail["section"] for r in results] == list(pm.SECTIONS)
    assert all("time limit" in r.detail["rows"][0]["error"] for r in results)
    assert pm.SHAPES["1.3b"].params == pytest.approx(1.34e9, rel=0.01)


def test_stage_layers_balances_the_head():
    """The last stage carries the LM head: it gets fewer blocks, every stage at least one, all blocks placed."""
    big = pm.SHAPES["1.3b"]
    for stages in (1, 2, 3, 4):
        counts = pm.stage_layers(big, stages)
        assert len(counts) == stages and sum(counts) == big.layers and min(counts) >= 1
    assert pm.stage_layers(big, 2) == [13, 11]
    assert pm.stage_layers(pm.SHAPES["tiny"], 2) == [1, 1]
    with pytest.raises(ValueError, match="stages"):
        pm.stage_layers(pm.SHAPES["tiny"], 3)
