"""``culmen demo``: train a byte-level GPT (``culmen.flash_attn.models.gpt``) on the Python standard library.

The text is the standard library's own source files, which every Python installation carries: the
``*.py`` files in the directory of the ``os`` module, read as bytes in sorted order (one file in ten is
held out for the evaluation loss). The model is flash_attn's ``GPTLMHeadModel`` with a 256-byte vocabulary,
rotary embeddings, RMSNorm, a SwiGLU ``GatedMlp``, the FlashAttention path and fused dropout + residual
add + RMSNorm between the blocks; the loss is culmen's fused linear + cross-entropy on the final hidden
states (the logits are never materialised) and the optimizer culmen's ``FusedAdam``. At the end it prints
the evaluation loss and a sampled continuation of ``"def "``. The exit status is non-zero when the
training loss did not fall.

On CPU the defaults (2 layers, 0.46M parameters, 400 steps of 16 x 64 bytes) finish in about half a minute
on two cores through culmen's reference paths; on CUDA the model is GPT-2-small-sized (12 layers, d_model
768), in bf16, and trains for 600 steps of 16 x 512 bytes on culmen's Triton kernels, and the sample is
decoded with CUDA graphs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TextIO

import torch
from torch import Tensor

PROMPT = b"def "


@dataclass
class DemoConfig:
    """Model, data and training sizes of the demo."""

    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4
    seq: int = 64
    batch: int = 16
    steps: int = 400
    lr: float = 1e-2
    warmup: int = 20
    weight_decay: float = 0.01
    dropout: float = 0.0
    eval_batches: int = 4
    sample_len: int = 120
    top_k: int = 10
    temperature: float = 0.8
    log_every: int = 50
    dtype: torch.dtype = torch.float32

    @classmethod
    def for_device(cls, device: torch.device) -> DemoConfig:
        """Small and fp32 on CPU; on CUDA a GPT-2-small-sized model in bf16, where the kernels dominate."""
        if device.type == "cuda":
            return cls(d_model=768, n_layer=12, n_head=12, seq=512, batch=16, steps=600, lr=1e-3, warmup=60,
                       eval_batches=8, sample_len=240, dtype=torch.bfloat16)
        return cls()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        for name in ("d_model", "n_layer", "n_head", "seq", "batch", "eval_batches", "sample_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.steps < 2:
            raise ValueError(f"steps must be >= 2, got {self.steps!r}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 8:
            raise ValueError(f"d_model / n_head must be a multiple of 8, got d_model={self.d_model}, "
                             f"n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


# ---------------------------------------------------------------------------------------------- data


@dataclass
class Corpus:
    """Training and held-out bytes as uint8 CPU tensors, and where they came from."""

    train: Tensor
    held_out: Tensor
    source: str
    n_files: int


def load_corpus(root: Path | None = None, every: int = 10) -> Corpus:
    """The ``*.py`` files of ``root`` (default: the standard library, the directory of ``os.__file__``),
    sorted by name and read as bytes; files ``every - 1, 2 * every - 1, ...`` form the held-out part.

    Falls back to culmen's own sources when ``root`` holds no Python files (a stripped installation)."""
    root = Path(os.__file__).parent if root is None else Path(root)
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if len(files) < 2:
        root = Path(__file__).parent
        files = sorted(p for p in root.rglob("*.py") if p.is_file())
    train, held = [], []
    for i, path in enumerate(files):
        (held if i % every == every - 1 else train).append(path.read_bytes())
    if not held:
        held.append(train.pop())

    def to_tensor(chunks: list[bytes]) -> Tensor:
        # Files are separated by a blank line so a window spanning two files still reads as source.
        return torch.frombuffer(bytearray(b"\n\n".join(chunks)), dtype=torch.uint8)

    return Corpus(to_tensor(train), to_tensor(held), str(root), len(files))


def sample_batch(data: Tensor, batch: int, seq: int, generator: torch.Generator) -> Tensor:
    """``batch`` random windows of ``seq + 1`` bytes of ``data`` (uint8, 1-D) as an int64 ``(batch, seq + 1)``
    CPU tensor: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
    if data.numel() < seq + 2:
        raise ValueError(f"seq={seq} is longer than the {data.numel()} bytes of text")
    starts = torch.randint(0, data.numel() - seq - 1, (batch, 1), generator=generator)
    return data[starts + torch.arange(seq + 1)].long()


# --------------------------------------------------------------------------------------------- model


class PlainGPT2Config(SimpleNamespace):
    """The ``transformers.GPT2Config`` fields ``GPTLMHeadModel`` reads, for machines without ``transformers``
    (``make demo`` installs only torch, triton and numpy; culmen's GPT model checks the config's class only
    when ``transformers`` is importable). The Hugging Face aliases (``hidden_size`` ...) are set too."""

    def __init__(self, *, n_embd: int, n_layer: int, n_head: int, n_positions: int = 1024, **fields) -> None:
        defaults = dict(vocab_size=50257, n_inner=None, activation_function="gelu_new", resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1, layer_norm_epsilon=1e-5, initializer_range=0.02,
                        scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, tie_word_embeddings=True)
        defaults.update(fields)
        super().__init__(n_embd=n_embd, hidden_size=n_embd, n_layer=n_layer, num_hidden_layers=n_layer,
                         n_head=n_head, num_attention_heads=n_head, n_positions=n_positions,
                         max_position_embeddings=n_positions, **defaults)


def gpt2_config(**fields):
    """``transformers.GPT2Config(**fields)`` (flash_attn's model config), or ``PlainGPT2Config`` without
    ``transformers``. ``fields`` use GPT-2's names (``n_embd``, ``n_layer``, ``n_head``, ``n_positions``)."""
    try:
        from transformers import GPT2Config
    except ImportError:
        return PlainGPT2Config(**fields)
    return GPT2Config(**fields)


def build_model(cfg: DemoConfig, device: torch.device):
    """A byte-level ``GPTLMHeadModel`` (vocab 256, tied embeddings) in ``cfg.dtype`` on ``device``."""
    from culmen.flash_attn.models.gpt import GPTLMHeadModel

    config = gpt2_config(
        vocab_size=256, n_embd=cfg.d_model, n_layer=cfg.n_layer, n_head=cfg.n_head,
        n_positions=0,  # no learned positions: rotary only
        # SwiGLU with ~8/3 d hidden units (GatedMlp rounds up to a multiple of 128 by default).
        n_inner=(8 * cfg.d_model) // 3, activation_function="swiglu",
        rms_norm=True, rotary_emb_fraction=1.0, use_flash_attn=True, fused_dropout_add_ln=True,
        residual_in_fp32=True, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=0.0,
        qkv_proj_bias=False, out_proj_bias=False, mlp_fc1_bias=False, mlp_fc2_bias=False,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=True,
    )
    return GPTLMHeadModel(config, device=device, dtype=cfg.dtype)


def lm_loss(model, tokens: Tensor) -> Tensor:
    """Mean next-byte cross-entropy (fp32, 0-dim) of ``tokens`` int64 ``(batch, seq + 1)``, from the final
    hidden states and the head weight by the fused linear + cross-entropy (no logits tensor)."""
    from culmen.ops.cross_entropy import fused_linear_cross_entropy

    hidden = model.transformer(tokens[:, :-1])
    return fused_linear_cross_entropy(hidden, model.lm_head.weight, tokens[:, 1:])


@torch.no_grad()
def evaluate(model, data: Tensor, cfg: DemoConfig, device: torch.device, seed: int) -> float:
    """Mean loss over ``cfg.eval_batches`` fixed windows of the held-out bytes."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed + 1)
    losses = [float(lm_loss(model, sample_batch(data, cfg.batch, cfg.seq, gen).to(device)))
              for _ in range(cfg.eval_batches)]
    model.train(was_training)
    return sum(losses) / len(losses)


def generate_sample(model, cfg: DemoConfig, device: torch.device, seed: int, prompt: bytes = PROMPT) -> str:
    """``prompt`` continued by ``cfg.sample_len`` bytes sampled (top-k, temperature) with ``seed``, decoded
    as UTF-8 with invalid bytes replaced. CUDA decodes through CUDA graphs (``cg=True``)."""
    model.eval()
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out = model.generate(ids, max_length=len(prompt) + cfg.sample_len, top_k=cfg.top_k,
                             temperature=cfg.temperature, cg=device.type == "cuda")
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------ progress


class Progress:
    """A one-line text progress bar redrawn in place on a terminal; on anything else (a pipe, a log file,
    a test's buffer) a plain line every ``every`` steps and at the last one."""

    def __init__(self, total: int, stream: TextIO, every: int, width: int = 24) -> None:
        self.total, self.stream, self.every, self.width = total, stream, every, width
        isatty = getattr(stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self._start = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Report step ``step`` (1-based) of ``total``."""
        elapsed = time.perf_counter() - self._start
        if self.tty:
            done = int(self.width * step / self.total)
            eta = elapsed / step * (self.total - step)
            bar = "#" * done + "-" * (self.width - done)
            self.stream.write(f"\r[{bar}] {step}/{self.total}  loss {loss:.3f}  {tokens_per_s:,.0f} tok/s  "
                              f"eta {eta:4.0f}s ")
            if step == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif step == 1 or step % self.every == 0 or step == self.total:
            self.stream.write(f"step {step:4d}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s  "
                              f"{elapsed:.1f}s\n")
            self.stream.flush()


# -------------------------------------------------------------------------------------------- driver


@dataclass
class DemoResult:
    """What a demo run measured."""

    device: str
    losses: list[float] = field(default_factory=list)
    eval_loss: float = math.nan
    tokens_per_s: float = 0.0
    sample: str = ""
    seconds: float = 0.0

    @property
    def initial_loss(self) -> float:
        """Loss of the first step."""
        return self.losses[0]

    @property
    def final_loss(self) -> float:
        """Mean loss of the last tenth of the steps (at least one): less noisy than the last step."""
        tail = self.losses[-max(1, len(self.losses) // 10):]
        return sum(tail) / len(tail)

    @property
    def loss_fell(self) -> bool:
        """Whether training lowered the loss (the exit status of ``culmen demo``)."""
        return math.isfinite(self.final_loss) and self.final_loss < self.initial_loss


def _lr_at(step: int, cfg: DemoConfig) -> float:
    """Linear warm-up to ``cfg.lr``, then cosine decay to a tenth of it at the last step."""
    if step <= cfg.warmup:
        return cfg.lr * step / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * frac)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_demo(cfg: DemoConfig | None = None, device: torch.device | str | None = None, *, seed: int = 0,
             out: TextIO | None = None, progress: TextIO | None = None, corpus: Corpus | None = None) -> DemoResult:
    """Train the byte-level GPT for ``cfg.steps`` steps on ``device`` (CUDA when available), then evaluate
    and sample. Reports go to ``out`` (stdout); the progress bar to ``progress`` (stderr) on a terminal,
    else periodic lines to ``out``."""
    from culmen.optimizers import FusedAdam

    out = out or sys.stdout
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = cfg or DemoConfig.for_device(dev)
    cfg.validate()
    progress = progress or sys.stderr
    if not (getattr(progress, "isatty", None) and progress.isatty()):
        progress = out
    corpus = corpus or load_corpus()
    t_begin = time.perf_counter()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = build_model(cfg, dev).train()
    opt = FusedAdam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    name = f"{dev} ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else str(dev)
    result = DemoResult(device=name)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"culmen demo: byte-level GPT (culmen.flash_attn.models.gpt) on {name}, {nparams / 1e6:.2f}M params, "
          f"{cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.batch}x{cfg.seq} bytes/step, "
          f"{str(cfg.dtype).removeprefix('torch.')}", file=out)
    print(f"text: {corpus.n_files} Python files of {corpus.source} ({corpus.train.numel() / 1e6:.1f} MB to train "
          f"on, {corpus.held_out.numel() / 1e6:.1f} MB held out)", file=out, flush=True)
    bar = Progress(cfg.steps, progress, cfg.log_every)
    tokens = 0
    t_warm = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        batch = sample_batch(corpus.train, cfg.batch, cfg.seq, gen).to(dev, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        result.losses.append(float(loss.detach()))  # a sync: the per-step loss is what the demo shows
        if step == 1:
            t_warm = time.perf_counter()  # the first step compiles kernels on GPUs: not in tokens/s
        else:
            tokens += batch.shape[0] * (batch.shape[1] - 1)
        elapsed = time.perf_counter() - t_warm
        rate = tokens / elapsed if tokens and elapsed > 0 else 0.0
        bar.update(step, result.losses[-1], rate)
    _sync(dev)
    result.tokens_per_s = tokens / max(time.perf_counter() - t_warm, 1e-9)
    result.eval_loss = evaluate(model, corpus.held_out, cfg, dev, seed)
    result.sample = generate_sample(model, cfg, dev, seed)
    result.seconds = time.perf_counter() - t_begin
    print(f"train loss {result.initial_loss:.3f} -> {result.final_loss:.3f}, held-out loss {result.eval_loss:.3f} "
          f"({result.eval_loss / math.log(2):.2f} bits/byte), {result.tokens_per_s:,.0f} tokens/s, "
          f"{result.seconds:.1f}s", file=out)
    print(f"sample (top-{cfg.top_k}, temperature {cfg.temperature}, seed {seed}):", file=out)
    print("    " + result.sample.replace("\n", "\n    "), file=out, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    """``culmen demo [--steps N] [--device cpu|cuda] [--seq N] [--batch N]``; 1 when the loss did not fall."""
    parser = argparse.ArgumentParser(prog="culmen demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``culmen demo`` (shared with the ``culmen`` CLI)."""
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 400 on CPU, 600 on CUDA)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--seq", type=int, default=None, help="bytes per sequence (default: 64 on CPU, 512 on CUDA)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, batches and sample (default: 0)")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the demo for parsed ``args``; the exit status (0 when the loss fell, 1 when not, 2 for bad options)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print("culmen demo: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = DemoConfig.for_device(dev)
    for name in ("steps", "seq", "batch"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(cfg, name, value)
    if args.steps is not None:
        cfg.warmup = min(cfg.warmup, max(1, args.steps // 10))
        cfg.log_every = max(1, min(cfg.log_every, args.steps // 4 or 1))
    try:
        cfg.validate()
    except ValueError as exc:
        print(f"culmen demo: {exc}", file=sys.stderr)
        return 2
    result = run_demo(cfg, dev, seed=getattr(args, "seed", 0))
    if result.loss_fell:
        print(f"loss fell: {result.initial_loss:.3f} -> {result.final_loss:.3f} over {len(result.losses)} steps",
              flush=True)
        return 0
    print(f"LOSS DID NOT FALL: {result.initial_loss:.3f} -> {result.final_loss:.3f} over {len(result.losses)} steps",
          flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
