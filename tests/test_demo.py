"""culmen demo: a short CPU run trains and the loss falls."""

import io

import torch

from culmen.demo import DemoConfig, TinyLM, make_batch, run_demo


def test_demo_loss_decreases_on_cpu(monkeypatch):
    monkeypatch.delenv("CULMEN_BACKEND", raising=False)
    cfg = DemoConfig(steps=12, log_every=4)
    buf = io.StringIO()
    result = run_demo(cfg, "cpu", out=buf)
    assert len(result.losses) == 12
    assert result.final_loss < 0.7 * result.initial_loss, result.losses
    assert result.backend == "reference" and result.tokens_per_s > 0
    out = buf.getvalue()
    assert "norm backend reference" in out and "step   12" in out


def test_synthetic_task_follows_the_rule():
    cfg = DemoConfig(vocab=17, batch=3, seq=9)
    inputs, targets = make_batch(cfg, torch.device("cpu"), torch.Generator().manual_seed(1))
    assert inputs.shape == targets.shape == (3, 9)
    assert torch.equal(targets, (inputs * 3 + 1) % 17)


def test_model_uses_culmen_layer_norm(monkeypatch):
    """The blocks call culmen's fused layer_norm with a residual and dropout, and a final RMSNorm."""
    import culmen.demo as demo

    calls = []
    real = demo.layer_norm

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(demo, "layer_norm", spy)
    cfg = DemoConfig(n_blocks=2, batch=2, seq=4)
    model = TinyLM(cfg)
    logits = model(torch.randint(0, cfg.vocab, (2, 4)))
    assert logits.shape == (2, 4, cfg.vocab)
    assert len(calls) == 3
    assert calls[0]["residual"] is None and calls[1]["residual"] is not None
    assert all(c["dropout_p"] == cfg.dropout_p for c in calls)
    assert calls[1]["return_residual"] and calls[2]["is_rms_norm"]


def test_cli_demo_exit_status(capsys):
    from culmen.cli import main

    assert main(["demo", "--steps", "6", "--device", "cpu"]) == 0
    assert "loss fell" in capsys.readouterr().out
