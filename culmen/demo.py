"""``culmen demo``: train a tiny pre-norm MLP language model with culmen's fused norm kernels.

Each block is ``layer_norm(dropout(hidden) + residual)`` in one fused call (``return_residual=True``
hands the new residual stream back), then Linear → GELU → Linear; a final RMSNorm and a head
follow. The synthetic task, next token = (3 * token + 1) mod vocab, is learnable, so the loss must
fall; the demo exits non-zero when it does not.

On CPU the defaults finish in well under a minute on two cores through the reference path
(``CULMEN_BACKEND=triton TRITON_INTERPRET=1`` runs the Triton kernels in the interpreter instead,
about 100x slower: pass a few ``--steps``); on CUDA the model is larger and runs under bf16 autocast.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from culmen.ops.backend import choose_backend
from culmen.ops.layer_norm import layer_norm


@dataclass
class DemoConfig:
    """Model and training sizes."""

    vocab: int = 64
    d_model: int = 64
    d_hidden: int = 256
    n_blocks: int = 4
    batch: int = 32
    seq: int = 32
    steps: int = 60
    lr: float = 3e-3
    dropout_p: float = 0.1
    log_every: int = 10

    @classmethod
    def for_device(cls, device: torch.device) -> DemoConfig:
        """Small on CPU; on CUDA a model big enough that the kernels, not launches, dominate."""
        if device.type == "cuda":
            return cls(vocab=1024, d_model=1024, d_hidden=4096, batch=32, seq=256, steps=200, lr=1e-3,
                       log_every=20)
        return cls()


class Block(nn.Module):
    """Fused dropout + residual add + LayerNorm, then a GELU MLP."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(d_model))
        self.norm_bias = nn.Parameter(torch.zeros(d_model))
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_model)

    def forward(self, hidden: Tensor, residual: Tensor | None, dropout_p: float) -> tuple[Tensor, Tensor]:
        """Return ``(mlp_out, residual)``: the new residual stream is the pre-norm sum."""
        out = layer_norm(hidden, self.norm_weight, self.norm_bias, residual=residual, dropout_p=dropout_p,
                         return_residual=True, residual_in_fp32=True)
        return self.fc2(F.gelu(self.fc1(out.y))), out.residual_out


class TinyLM(nn.Module):
    """Token embedding → ``n_blocks`` × ``Block`` → RMSNorm (fused with the last residual add) → head."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.d_hidden) for _ in range(cfg.n_blocks))
        self.final_norm_weight = nn.Parameter(torch.ones(cfg.d_model))
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(batch, seq, vocab)`` for ``tokens`` ``(batch, seq)``."""
        p = self.cfg.dropout_p if self.training else 0.0
        hidden, residual = self.embed(tokens), None
        for block in self.blocks:
            hidden, residual = block(hidden, residual, p)
        y = layer_norm(hidden, self.final_norm_weight, None, residual=residual, dropout_p=p, is_rms_norm=True).y
        return self.head(y)


def make_batch(cfg: DemoConfig, device: torch.device, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Sequences following token[t+1] = (3 * token[t] + 1) % vocab; returns (inputs, targets)."""
    start = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=generator, device="cpu")
    seq = [start]
    for _ in range(cfg.seq):
        seq.append((seq[-1] * 3 + 1) % cfg.vocab)
    tokens = torch.cat(seq, dim=1).to(device)
    return tokens[:, :-1], tokens[:, 1:]


@dataclass
class DemoResult:
    """What a demo run measured."""

    device: str
    backend: str
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0

    @property
    def initial_loss(self) -> float:
        """Loss of the first step."""
        return self.losses[0]

    @property
    def final_loss(self) -> float:
        """Loss of the last step."""
        return self.losses[-1]


def run_demo(cfg: DemoConfig | None = None, device: torch.device | str | None = None, *, seed: int = 0,
             out=None) -> DemoResult:
    """Train ``TinyLM`` for ``cfg.steps`` steps on ``device`` (CUDA if available), printing progress."""
    out = out or sys.stdout
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = cfg or DemoConfig.for_device(dev)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = TinyLM(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext())
    result = DemoResult(device=str(dev) if dev.type != "cuda" else f"{dev} ({torch.cuda.get_device_name(dev)})",
                        backend=choose_backend(dev))
    nparams = sum(p.numel() for p in model.parameters())
    print(f"culmen demo: device {result.device}, norm backend {result.backend}, {nparams / 1e6:.2f}M params, "
          f"{cfg.n_blocks} blocks, d_model {cfg.d_model}, {cfg.batch}x{cfg.seq} tokens/step, "
          f"{'bf16 autocast' if dev.type == 'cuda' else 'fp32'}", file=out)
    tokens_done, t_start = 0, time.perf_counter()
    for step in range(1, cfg.steps + 1):
        inputs, targets = make_batch(cfg, dev, gen)
        with autocast:
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        result.losses.append(float(loss.detach()))
        tokens_done += inputs.numel()
        if step == 1 or step % cfg.log_every == 0 or step == cfg.steps:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            elapsed = time.perf_counter() - t_start
            result.tokens_per_s = tokens_done / elapsed if elapsed > 0 else 0.0
            print(f"step {step:4d}  loss {result.losses[-1]:.4f}  {result.tokens_per_s:,.0f} tokens/s", file=out)
    return result


def main(argv: list[str] | None = None) -> int:
    """``culmen demo [--steps N] [--device cpu|cuda]``; returns 1 when the loss did not fall."""
    parser = argparse.ArgumentParser(prog="culmen demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``culmen demo`` (shared with the ``culmen`` CLI)."""
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 60 on CPU, 200 on CUDA)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available, else cpu")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the demo for parsed ``args``; the exit status (0 when the loss fell)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print("culmen demo: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = DemoConfig.for_device(dev)
    if args.steps is not None:
        if args.steps < 2:
            print("culmen demo: --steps must be at least 2", file=sys.stderr)
            return 2
        cfg.steps = args.steps
        cfg.log_every = max(1, min(cfg.log_every, args.steps // 4 or 1))
    result = run_demo(cfg, dev)
    ok = result.final_loss < result.initial_loss
    verdict = "loss fell" if ok else "LOSS DID NOT FALL"
    print(f"{verdict}: {result.initial_loss:.4f} -> {result.final_loss:.4f} over {len(result.losses)} steps, "
          f"{result.tokens_per_s:,.0f} tokens/s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
