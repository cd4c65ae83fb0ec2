"""Mixed-precision training step: ``culmen.amp`` O1 / O2 against ``torch.autocast`` + ``GradScaler``.

One training step (zero_grad, forward, cross-entropy loss, backward, optimizer step) of a
GPT-2-small-like model (12 layers, d=768, 12 heads, vocabulary 50257, tied embeddings, causal SDPA,
GELU-tanh MLP; batch 8 x 1024 tokens), in fp16 and in bf16. Every provider has its own copy of the
model, built from the same initial weights, and runs on the same token batch:

* ``torch``: ``torch.autocast`` around forward + loss, ``torch.amp.GradScaler`` (fp16 only; bf16
  needs no scaling), ``torch.optim.AdamW(fused=True)``.
* ``culmen`` in the O1 cases: ``amp.initialize(opt_level="O1")`` (fp16) / ``"O4"`` (bf16) with the
  same ``AdamW(fused=True)``, loss scaled by ``amp.scale_loss``.
* ``culmen`` in the O2 cases: ``opt_level="O2"`` (fp16, dynamic loss scale) / ``"O5"`` (bf16) with
  culmen's ``FusedAdam`` updating the fp32 master weights (``torch.optim.AdamW(fused=True)`` when
  ``culmen.optimizers`` is missing, said in a note); ``culmen-O1`` (the O1 step) is a peer there, so
  the ratio shows O2 against both torch and O1.

Peak memory is measured on each provider's first (sanity) step and printed as a note: the memory
its model, gradients and optimizer state hold between steps, and the extra a step allocates.
The loss of that first step is the compared output (same weights and batch for every provider).
amp is process-global state; each provider swaps its own amp set-up in when it runs
(``capture_state`` / ``restore_state``), which costs nothing while the same provider runs repeatedly.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark

_DT_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2-like language model (tied input / output embeddings)."""

    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


FULL = dict(vocab=50257, seq=1024, d=768, heads=12, layers=12, batch=8)
QUICK = dict(vocab=128, seq=32, d=64, heads=4, layers=2, batch=2)


def _train_flops(n_params: int, tokens: int, layers: int, seq: int, d: int) -> int:
    """6 N T for the weights plus the attention matmuls (12 L T^2 d per sequence, causal halves it)."""
    return 6 * n_params * tokens + 6 * layers * tokens * seq * d


class _Swap:
    """Which amp state is live; a provider restores its own when another one ran last."""

    def __init__(self) -> None:
        from culmen.amp._amp_state import capture_state

        self.empty = capture_state()
        self.current: Any = self.empty

    def use(self, snap: Any) -> None:
        if self.current is not snap:
            from culmen.amp._amp_state import restore_state

            restore_state(snap)
            self.current = snap


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _with_memory(device: torch.device, notes: list[str], label: str, name: str,
                 build: Callable[[], Callable[[], Any]]) -> Callable[[], Any]:
    """Build a provider; its first call records the memory it keeps between steps (weights, grads,
    optimizer state: what its construction and first step left allocated) and the extra a step peaks at."""
    start = _allocated(device)
    fn = build()
    built = _allocated(device) - start
    done = [False]

    def run() -> Any:
        if done[0] or device.type != "cuda":
            return fn()
        done[0] = True
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        resident = built + torch.cuda.memory_allocated(device) - before
        notes.append(f"{label} {name}: state {resident / 2**30:.2f} GiB, step peak +{peak / 2**30:.2f} GiB")
        return out

    return run


def _fused_adam(params, lr: float, notes: list[str]):
    try:
        from culmen.optimizers import FusedAdam

        return FusedAdam(params, lr=lr, adam_w_mode=True, weight_decay=0.0)
    except Exception as exc:  # culmen.optimizers not there yet: the O2 cases still run
        notes.append(f"culmen O2: culmen.optimizers.FusedAdam unavailable ({type(exc).__name__}); "
                     "torch AdamW(fused=True) used")
        return torch.optim.AdamW(params, lr=lr, fused=True)


@register_benchmark("amp_gpt2", "amp")
def amp_gpt2_bench(cfg: BenchConfig) -> Iterator[Case]:
    """GPT-2-small training step: culmen amp O1 / O2 vs torch.autocast + GradScaler (fp16, bf16)."""
    from culmen import amp
    from culmen.amp._amp_state import capture_state

    dev = cfg.device
    shape = QUICK if cfg.quick else FULL
    lr = 1e-4
    swap = _Swap()
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g, device="cpu").to(dev)
    tgt = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g, device="cpu").to(dev)
    torch.manual_seed(0)
    ref_model = GPT(shape["vocab"], shape["seq"], shape["d"], shape["heads"], shape["layers"])
    init_state = {k: v.clone() for k, v in ref_model.state_dict().items()}
    n_params = sum(p.numel() for p in ref_model.parameters())
    del ref_model
    tokens = shape["batch"] * shape["seq"]
    flops = _train_flops(n_params, tokens, shape["layers"], shape["seq"], shape["d"])
    fused = dev.type == "cuda"

    def new_model() -> nn.Module:
        m = GPT(shape["vocab"], shape["seq"], shape["d"], shape["heads"], shape["layers"])
        m.load_state_dict(init_state)
        return m.to(dev)

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    def torch_provider(dtype: torch.dtype) -> Callable[[], Any]:
        model = new_model()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
        scaler = torch.amp.GradScaler(dev.type, enabled=dtype == torch.float16)

        def step() -> dict:
            swap.use(swap.empty)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=dtype):
                loss = loss_of(model(idx))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return {"loss": loss.detach().float()}

        return step

    def amp_provider(level: str, dtype: torch.dtype, notes: list[str]) -> Callable[[], Any]:
        swap.use(swap.empty)
        model = new_model()
        if level in ("O2", "O5"):
            opt = _fused_adam(model.parameters(), lr, notes)
            kw: dict[str, Any] = {"loss_scale": "dynamic"} if dtype == torch.float16 else {}
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
            kw = {}
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
        snap = capture_state()
        swap.current = snap

        def step() -> dict:
            swap.use(snap)
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model(idx))
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            return {"loss": loss.detach().float()}

        return step

    try:
        for dtype in (torch.float16, torch.bfloat16):
            name = _DT_NAME[dtype]
            o1, o2 = ("O1", "O2") if dtype == torch.float16 else ("O4", "O5")
            size = "gpt2-124M" if not cfg.quick else "gpt2-tiny"
            for mode in ("O1", "O2"):
                label = f"{size} b{shape['batch']}x{shape['seq']} {name} {mode}"
                notes: list[str] = []
                providers: dict[str, Callable[[], Any]] = {}
                specs: list[tuple[str, Callable[[], Callable[[], Any]]]] = [
                    ("torch", lambda dtype=dtype: torch_provider(dtype)),
                ]
                if mode == "O1":
                    specs.append((CULMEN, lambda o1=o1, dtype=dtype, notes=notes: amp_provider(o1, dtype, notes)))
                else:
                    specs.append(("culmen-O1", lambda o1=o1, dtype=dtype, notes=notes: amp_provider(o1, dtype, notes)))
                    specs.append((CULMEN, lambda o2=o2, dtype=dtype, notes=notes: amp_provider(o2, dtype, notes)))
                for pname, build in specs:
                    providers[pname] = _with_memory(dev, notes, label, pname, build)
                notes.append(f"opt levels: culmen {o2 if mode == 'O2' else o1}"
                             + (f", culmen-O1 = {o1}" if mode == "O2" else "")
                             + (", torch GradScaler on" if dtype == torch.float16 else ", no loss scaling (bf16)"))
                yield Case(label, providers, flops=flops, notes=notes)
                del providers, specs
                swap.use(swap.empty)
                gc.collect()  # amp-patched optimizers hold reference cycles (bound methods)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        swap.use(swap.empty)
        amp.deinitialize()

