"""culmen demo: the byte-level GPT trains on the standard library's sources, evaluates, samples, and the
command's exit status follows the loss."""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import culmen.demo as demo
from culmen.demo import DemoConfig, DemoResult, Progress, build_model, lm_loss, load_corpus, run_demo, sample_batch


def tiny(**kw) -> DemoConfig:
    base = dict(d_model=64, n_layer=1, n_head=2, seq=32, batch=8, steps=30, lr=1e-2, warmup=3, eval_batches=2,
                sample_len=24, log_every=10)
    base.update(kw)
    return DemoConfig(**base)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_corpus_is_the_standard_library_in_sorted_order(corpus):
    root = Path(os.__file__).parent
    files = sorted(root.glob("*.py"))
    assert corpus.source == str(root) and corpus.n_files == len(files) > 20
    held = b"\n\n".join(p.read_bytes() for i, p in enumerate(files) if i % 10 == 9)
    assert corpus.held_out.dtype == torch.uint8 and bytes(corpus.held_out.tolist()[:5000]) == held[:5000]
    assert corpus.held_out.numel() == len(held)
    # Every file once, plus a two-byte separator between neighbours in each part.
    assert corpus.train.numel() + corpus.held_out.numel() == sum(p.stat().st_size for p in files) + 2 * (len(files) - 2)
    again = load_corpus()
    assert torch.equal(again.train, corpus.train) and torch.equal(again.held_out, corpus.held_out)


def test_corpus_split_and_fallback(tmp_path):
    for i in range(12):
        (tmp_path / f"m{i:02d}.py").write_bytes(bytes([65 + i]) * 3)
    c = load_corpus(tmp_path, every=5)
    assert bytes(c.held_out.tolist()) == b"EEE\n\nJJJ"  # files 4 and 9
    assert bytes(c.train.tolist()).split(b"\n\n") == [bytes([65 + i]) * 3 for i in range(12) if i not in (4, 9)]
    empty = tmp_path / "empty"
    empty.mkdir()
    c = load_corpus(empty)
    assert c.source == str(Path(demo.__file__).parent) and b"culmen" in bytes(c.train[:200000].tolist())


def test_sample_batch_windows_are_seeded_slices():
    data = torch.arange(200, dtype=torch.uint8)
    b = sample_batch(data, 5, 17, torch.Generator().manual_seed(3))
    assert b.shape == (5, 18) and b.dtype == torch.int64
    assert torch.equal(b[:, 1:] - b[:, :-1], torch.ones(5, 17, dtype=torch.int64))  # contiguous windows
    assert int(b.max()) < 200
    assert torch.equal(b, sample_batch(data, 5, 17, torch.Generator().manual_seed(3)))
    assert not torch.equal(b, sample_batch(data, 5, 17, torch.Generator().manual_seed(4)))
    with pytest.raises(ValueError, match="seq=199"):
        sample_batch(data, 1, 199, torch.Generator())


def test_model_is_a_byte_level_flash_attn_gpt():
    from culmen.flash_attn.models.gpt import GPTLMHeadModel
    from culmen.flash_attn.modules.mlp import GatedMlp
    from culmen.flash_attn.ops.triton.layer_norm import RMSNorm

    cfg = tiny(n_layer=2)
    model = build_model(cfg, torch.device("cpu"))
    assert isinstance(model, GPTLMHeadModel)
    assert model.lm_head.weight is model.transformer.embeddings.word_embeddings.weight
    assert model.lm_head.weight.shape == (256, cfg.d_model)
    assert model.transformer.fused_dropout_add_ln and isinstance(model.transformer.ln_f, RMSNorm)
    for layer in model.transformer.layers:
        assert layer.fused_dropout_add_ln and isinstance(layer.norm1, RMSNorm)
        assert isinstance(layer.mlp, GatedMlp) and layer.mlp.activation is F.silu
        assert layer.mixer.use_flash_attn and layer.mixer.rotary_emb_dim == cfg.d_model // cfg.n_head


def test_fused_loss_equals_cross_entropy_of_the_logits():
    cfg = tiny(n_layer=2)
    model = build_model(cfg, torch.device("cpu"))
    tokens = torch.randint(0, 256, (3, 21))
    loss = lm_loss(model, tokens)
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    ref = F.cross_entropy(logits.double().reshape(-1, 256), tokens[:, 1:].reshape(-1))
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(float(loss.detach()) - float(ref)) < 1e-5 * float(ref)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_demo_trains_evaluates_and_samples(corpus):
    cfg = tiny()
    buf = io.StringIO()
    result = run_demo(cfg, "cpu", out=buf, corpus=corpus)
    assert len(result.losses) == 30 and all(math.isfinite(x) for x in result.losses)
    assert result.initial_loss > 4.5  # about ln(256) = 5.55 at the start
    assert result.final_loss < result.initial_loss - 1.2, result.losses
    assert result.loss_fell and result.eval_loss < result.initial_loss - 1.0
    assert result.tokens_per_s > 0
    assert result.sample.startswith("def ") and len(result.sample) > 4
    out = buf.getvalue()
    assert "culmen.flash_attn.models.gpt" in out and "step   30/30" in out and "step   10/30" in out
    assert "held-out loss" in out and "tokens/s" in out
    assert "    " + result.sample.splitlines()[0] in out


def test_sample_is_reproducible_from_its_seed():
    cfg = tiny(sample_len=20, top_k=0, temperature=1.0)  # untrained model: every byte is plausible
    model = build_model(cfg, torch.device("cpu"))
    a = demo.generate_sample(model, cfg, torch.device("cpu"), seed=5)
    b = demo.generate_sample(model, cfg, torch.device("cpu"), seed=5)
    c = demo.generate_sample(model, cfg, torch.device("cpu"), seed=6)
    assert a == b != c and a.startswith("def ")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_and_lines_elsewhere():
    tty = _Tty()
    bar = Progress(4, tty, every=2, width=8)
    for step in range(1, 5):
        bar.update(step, 3.0 - step / 10, 1234.0)
    text = tty.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
    assert "[##------] 1/4" in text and "[########] 4/4" in text and "1,234 tok/s" in text
    plain = io.StringIO()
    bar = Progress(5, plain, every=2)
    for step in range(1, 6):
        bar.update(step, 2.5, 10.0)
    lines = plain.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines] == ["1/5", "2/5", "4/5", "5/5"] and "\r" not in plain.getvalue()


def test_learning_rate_warms_up_then_decays():
    cfg = tiny(steps=100, warmup=10, lr=1.0)
    lrs = [demo._lr_at(s, cfg) for s in range(1, 101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="steps"):
        tiny(steps=1).validate()
    with pytest.raises(ValueError, match="n_head"):
        tiny(d_model=60, n_head=4).validate()


def test_cli_demo_exit_status(capsys):
    from culmen.cli import main

    assert main(["demo", "--steps", "25", "--device", "cpu", "--seq", "32", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "loss fell" in out and "sample (top-10" in out and "8x32 bytes/step" in out
    assert main(["demo", "--steps", "1", "--device", "cpu"]) == 2
    assert "steps must be >= 2" in capsys.readouterr().err


def test_cli_demo_fails_when_the_loss_does_not_fall(monkeypatch, capsys):
    from culmen.cli import main

    monkeypatch.setattr(demo, "run_demo", lambda cfg, dev, seed=0: DemoResult("cpu", losses=[3.0, 3.1, 3.2]))
    assert main(["demo", "--steps", "3", "--device", "cpu"]) == 1
    assert "LOSS DID NOT FALL" in capsys.readouterr().out
    monkeypatch.setattr(demo, "run_demo", lambda cfg, dev, seed=0: DemoResult("cpu", losses=[3.0, math.nan]))
    assert main(["demo", "--steps", "3", "--device", "cpu"]) == 1


def test_demo_model_without_transformers(monkeypatch):
    """``make demo`` installs no ``transformers``: the plain config builds the very same model."""
    import sys

    import culmen.flash_attn.models.gpt as gpt

    cfg = tiny(n_layer=2)
    torch.manual_seed(7)
    with_hf = build_model(cfg, torch.device("cpu"))
    assert type(with_hf.config).__name__ == "GPT2Config"
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    monkeypatch.setattr(gpt, "GPT2Config", None)  # as gpt.py sets it where transformers is missing
    torch.manual_seed(7)
    plain = build_model(cfg, torch.device("cpu"))
    assert isinstance(plain.config, demo.PlainGPT2Config)
    a, b = with_hf.state_dict(), plain.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tokens = torch.randint(0, 256, (2, 17))
    assert torch.equal(lm_loss(with_hf, tokens), lm_loss(plain, tokens))


@pytest.mark.gpu
def test_demo_on_cuda_bf16_with_graph_decoding(corpus):
    """The CUDA configuration (bf16 parameters, Triton kernels, CUDA-graph sampling), shortened."""
    cfg = DemoConfig.for_device(torch.device("cuda"))
    assert cfg.dtype == torch.bfloat16
    cfg.n_layer, cfg.steps, cfg.warmup, cfg.eval_batches, cfg.sample_len = 2, 40, 4, 2, 32
    buf = io.StringIO()
    result = run_demo(cfg, "cuda", out=buf, corpus=corpus)
    assert result.loss_fell and result.final_loss < result.initial_loss - 0.7, result.losses
    assert math.isfinite(result.eval_loss) and result.eval_loss < result.initial_loss
    assert result.sample.startswith("def ") and result.tokens_per_s > 0
    assert "bfloat16" in buf.getvalue()
