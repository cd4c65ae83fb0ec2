"""Decoder language models for ``culmen bench train_step``, each written twice from one config.

Two styles, each as a plain-PyTorch model and as a culmen model that uses culmen's public APIs the way
a user would write them:

``llama`` (pre-norm RMSNorm, fused qkv projection without bias, rotary (GPT-NeoX halves), causal
attention, SwiGLU MLP, final RMSNorm, untied LM head, mean cross-entropy):

* torch: ``nn.RMSNorm``; rotary as ``q * cos + rotate_half(q) * sin`` with cached ``(S, D)`` tables;
  ``F.scaled_dot_product_attention(is_causal=True)`` on ``(B, H, S, D)`` (transposes in and out);
  ``F.silu(gate) * up``; ``F.cross_entropy(logits.float(), labels)``.
* culmen: flash_attn's Triton ``RMSNorm`` module with the residual add fused into it
  (``norm(x, residual, prenorm=True)``, flash_attn's own block structure);
  ``apply_rotary_emb_qkv_`` on the packed qkv (in place, one launch for q and k);
  ``flash_attn_func(q, k, v, causal=True)`` on ``(B, S, H, D)``; ``swiglu(gate, up)``;
  ``fused_linear_cross_entropy(hidden, lm_head.weight, labels)`` (no logits tensor).

``gpt2`` (pre-norm LayerNorm with bias, learned positions, qkv/out projections with bias, GELU-tanh MLP
4x wide, final LayerNorm, LM head tied to the token embedding):

* torch: ``nn.LayerNorm``, SDPA causal, ``F.gelu(approximate="tanh")`` between two ``nn.Linear``,
  ``F.cross_entropy(F.linear(x, wte.weight).float(), labels)``.
* culmen: ``culmen.normalization.FusedLayerNorm`` modules hold the parameters and flash_attn's
  ``layer_norm_fn(x, w, b, residual=, prenorm=True)`` fuses the residual add; ``flash_attn_func``;
  flash_attn's ``fused_mlp_func`` (linear + bias + GELU-tanh + linear); fused linear cross-entropy
  against the tied ``wte.weight``.

Both implementations of a style have the same parameter names and shapes; ``init_weights`` fills them
from per-parameter seeded generators, so the two models start from identical weights. Every model's
``forward(tokens, labels)`` returns the scalar fp32 loss, and is built from three pieces so that
``torch.compile`` can take either the whole model or each block (``compile_model``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

STYLES = ("llama", "gpt2")
IMPLS = ("torch", "culmen")
# How culmen's LLaMA block rotates Q and K while torch.compile traces it: "packed" (one rotation of the q|k slice
# of the packed projection: one forward kernel, but its backward writes the packed gradient in two passes, a
# slice-backward and a select-backward) or "split" (q, k, v unbound first and q, k rotated each, as torch's model
# does: the backward stacks three gradients). H200 profile (s12), per step at d768: packed rotary forward 0.453
# ms, backward 0.599 + 0.574; torch's model 0.226 and 0.441 + 0.453. A/B in one process (s13, H200,
# scripts/ab_train_step.py, median of 5 rounds x 10 steps): split 16.28 ms/step, packed 16.43, torch 15.33.
COMPILE_ROTARY = "split"


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder and of its training batch."""

    style: str
    size: str
    d: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int
    eps: float = 1e-5
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.d // self.heads

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return self.batch * self.seq

    def n_params(self) -> int:
        """Parameter count (the tied GPT-2 head counted once)."""
        d, f, v, L = self.d, self.ffn, self.vocab, self.layers
        if self.style == "llama":
            return v * d * 2 + L * (4 * d * d + 3 * d * f + 2 * d) + d
        return v * d + self.seq * d + L * (4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d) + 2 * d


def _llama_ffn(d: int) -> int:
    """LLaMA's hidden width: 2/3 of 4d, rounded up to a multiple of 256."""
    return 256 * math.ceil(int(8 * d / 3) / 256)


# (d, layers, heads, seq, batch). "1b": TinyLlama-1.1B's shape for llama (22 layers, ffn 5632);
# 18 layers for gpt2 (4x MLP, tied head), about 1.0B parameters.
_SIZES: dict[str, dict[str, tuple[int, int, int, int, int]]] = {
    "tiny": {"llama": (64, 2, 4, 32, 2), "gpt2": (64, 2, 4, 32, 2)},
    "d512": {"llama": (512, 8, 8, 512, 8), "gpt2": (512, 8, 8, 512, 8)},
    "d768": {"llama": (768, 12, 12, 1024, 8), "gpt2": (768, 12, 12, 1024, 8)},
    "d2048": {"llama": (2048, 16, 16, 2048, 4), "gpt2": (2048, 16, 16, 2048, 4)},
    "1b": {"llama": (2048, 22, 16, 2048, 4), "gpt2": (2048, 18, 16, 2048, 4)},
}
SIZES = tuple(_SIZES)
_VOCAB = {"llama": 32000, "gpt2": 50304}


def model_config(style: str, size: str) -> ModelConfig:
    """The config of ``style`` (``llama`` / ``gpt2``) at ``size`` (one of ``SIZES``)."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if size not in _SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    d, layers, heads, seq, batch = _SIZES[size][style]
    vocab = 256 if size == "tiny" else _VOCAB[style]
    ffn = _llama_ffn(d) if style == "llama" else 4 * d
    if size == "tiny" and style == "llama":
        ffn = 3 * d
    return ModelConfig(style, size, d, layers, heads, ffn, vocab, seq, batch)


def with_overrides(cfg: ModelConfig, **kw: int) -> ModelConfig:
    """``cfg`` with some fields replaced (``None`` values ignored)."""
    return replace(cfg, **{k: v for k, v in kw.items() if v is not None})


def rotary_tables(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``cos, sin`` of shape ``(seq, head_dim / 2)``, computed in fp32 and stored in ``dtype``."""
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))
    freqs = torch.outer(torch.arange(cfg.seq, dtype=torch.float32, device=device), inv_freq)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


# ------------------------------------------------------------------------------------------ torch


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchLlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.heads = cfg.heads
        self.attn_norm = nn.RMSNorm(cfg.d, eps=cfg.eps, **fk)
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d, bias=False, **fk)
        self.o_proj = nn.Linear(cfg.d, cfg.d, bias=False, **fk)
        self.mlp_norm = nn.RMSNorm(cfg.d, eps=cfg.eps, **fk)
        self.gate_proj = nn.Linear(cfg.d, cfg.ffn, bias=False, **fk)
        self.up_proj = nn.Linear(cfg.d, cfg.ffn, bias=False, **fk)
        self.down_proj = nn.Linear(cfg.ffn, cfg.d, bias=False, **fk)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, S, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, S, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, S, d))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TorchLlama(nn.Module):
    """LLaMA-style decoder on PyTorch's blocks."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d, **fk)
        self.layers = nn.ModuleList(TorchLlamaBlock(cfg, **fk) for _ in range(cfg.layers))
        self.final_norm = nn.RMSNorm(cfg.d, eps=cfg.eps, **fk)
        self.lm_head = nn.Linear(cfg.d, cfg.vocab, bias=False, **fk)
        cos, sin = rotary_tables(cfg, torch.device(device or "cpu"), dtype or torch.get_default_dtype())
        # (S, D) tables for rotate_half, broadcast over (B, H, S, D).
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((sin, sin), dim=-1), persistent=False)

    def head_loss(self, x: Tensor, labels: Tensor) -> Tensor:
        logits = self.lm_head(self.final_norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.head_loss(x, labels)


class TorchGPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.heads = cfg.heads
        self.attn_norm = nn.LayerNorm(cfg.d, eps=cfg.eps, **fk)
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d, **fk)
        self.o_proj = nn.Linear(cfg.d, cfg.d, **fk)
        self.mlp_norm = nn.LayerNorm(cfg.d, eps=cfg.eps, **fk)
        self.fc = nn.Linear(cfg.d, cfg.ffn, **fk)
        self.proj = nn.Linear(cfg.ffn, cfg.d, **fk)

    def forward(self, x: Tensor) -> Tensor:
        B, S, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, S, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, S, d))
        return x + self.proj(F.gelu(self.fc(self.mlp_norm(x)), approximate="tanh"))


class TorchGPT2(nn.Module):
    """GPT-2-style decoder on PyTorch's blocks (LM head tied to ``wte``)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d, **fk)
        self.wpe = nn.Embedding(cfg.seq, cfg.d, **fk)
        self.layers = nn.ModuleList(TorchGPT2Block(cfg, **fk) for _ in range(cfg.layers))
        self.final_norm = nn.LayerNorm(cfg.d, eps=cfg.eps, **fk)

    def head_loss(self, x: Tensor, labels: Tensor) -> Tensor:
        logits = F.linear(self.final_norm(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head_loss(x, labels)


# ----------------------------------------------------------------------------------------- culmen


class CulmenLlamaBlock(nn.Module):
    """``(h, residual) -> (h, residual)``: the residual add happens inside the next norm (flash_attn's
    pre-norm block); ``residual`` is ``None`` before the first block."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        from culmen.flash_attn.ops.triton.layer_norm import RMSNorm

        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.heads = cfg.heads
        self.attn_norm = RMSNorm(cfg.d, eps=cfg.eps, **fk)
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d, bias=False, **fk)
        self.o_proj = nn.Linear(cfg.d, cfg.d, bias=False, **fk)
        self.mlp_norm = RMSNorm(cfg.d, eps=cfg.eps, **fk)
        self.gate_proj = nn.Linear(cfg.d, cfg.ffn, bias=False, **fk)
        self.up_proj = nn.Linear(cfg.d, cfg.ffn, bias=False, **fk)
        self.down_proj = nn.Linear(cfg.ffn, cfg.d, bias=False, **fk)

    def forward(self, h: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        from culmen.flash_attn import flash_attn_func
        from culmen.flash_attn.layers.rotary import apply_rotary_emb, apply_rotary_emb_qkv_
        from culmen.flash_attn.ops.activations import swiglu

        B, S, d = h.shape
        x, residual = self.attn_norm(h, residual, prenorm=True)
        qkv = self.qkv(x).view(B, S, 3, self.heads, d // self.heads)
        if torch.compiler.is_compiling() and COMPILE_ROTARY == "split":
            q, k, v = qkv.unbind(2)
            q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        elif torch.compiler.is_compiling():
            # Out of place under torch.compile: Inductor cannot rotate a slice of qkv in place (each element
            # needs its pair), so the in-place form costs an fp32 buffer plus two copies of Q and K per layer
            # (scripts/compile_graph_dump.py); rotated out of place, Q and K come from one fused kernel.
            q, k = apply_rotary_emb(qkv[:, :, :2].flatten(2, 3), cos, sin).unflatten(2, (2, -1)).unbind(2)
            v = qkv[:, :, 2]
        else:  # in place in eager: the packed gradient needs no slice-backward zero fills and copies
            q, k, v = apply_rotary_emb_qkv_(qkv, cos, sin).unbind(2)
        h = self.o_proj(flash_attn_func(q, k, v, causal=True).reshape(B, S, d))
        x, residual = self.mlp_norm(h, residual, prenorm=True)
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x))), residual


class CulmenLlama(nn.Module):
    """LLaMA-style decoder on culmen's blocks (same parameters as ``TorchLlama``)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        from culmen.flash_attn.ops.triton.layer_norm import RMSNorm

        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d, **fk)
        self.layers = nn.ModuleList(CulmenLlamaBlock(cfg, **fk) for _ in range(cfg.layers))
        self.final_norm = RMSNorm(cfg.d, eps=cfg.eps, **fk)
        self.lm_head = nn.Linear(cfg.d, cfg.vocab, bias=False, **fk)
        cos, sin = rotary_tables(cfg, torch.device(device or "cpu"), dtype or torch.get_default_dtype())
        self.register_buffer("cos", cos, persistent=False)  # (S, D/2), flash_attn's layout
        self.register_buffer("sin", sin, persistent=False)

    def head_loss(self, h: Tensor, residual: Tensor, labels: Tensor) -> Tensor:
        from culmen.ops.cross_entropy import fused_linear_cross_entropy

        return fused_linear_cross_entropy(self.final_norm(h, residual), self.lm_head.weight, labels)

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        h, residual = self.embed(tokens), None
        for layer in self.layers:
            h, residual = layer(h, residual, self.cos, self.sin)
        return self.head_loss(h, residual, labels)


class CulmenGPT2Block(nn.Module):
    """``(h, residual) -> (h, residual)`` as ``CulmenLlamaBlock``, with LayerNorm, biases and GELU."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        from culmen.normalization import FusedLayerNorm

        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.heads = cfg.heads
        self.eps = cfg.eps
        self.attn_norm = FusedLayerNorm(cfg.d, eps=cfg.eps, **fk)
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d, **fk)
        self.o_proj = nn.Linear(cfg.d, cfg.d, **fk)
        self.mlp_norm = FusedLayerNorm(cfg.d, eps=cfg.eps, **fk)
        self.fc = nn.Linear(cfg.d, cfg.ffn, **fk)
        self.proj = nn.Linear(cfg.ffn, cfg.d, **fk)

    def forward(self, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        from culmen.flash_attn import flash_attn_func
        from culmen.flash_attn.ops.fused_dense import fused_mlp_func
        from culmen.flash_attn.ops.triton.layer_norm import layer_norm_fn

        B, S, d = h.shape
        n = self.attn_norm
        x, residual = layer_norm_fn(h, n.weight, n.bias, residual=residual, eps=self.eps, prenorm=True)
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, d // self.heads).unbind(2)
        h = self.o_proj(flash_attn_func(q, k, v, causal=True).reshape(B, S, d))
        n = self.mlp_norm
        x, residual = layer_norm_fn(h, n.weight, n.bias, residual=residual, eps=self.eps, prenorm=True)
        h = fused_mlp_func(x, self.fc.weight, self.proj.weight, self.fc.bias, self.proj.bias,
                           activation="gelu_approx")
        return h, residual


class CulmenGPT2(nn.Module):
    """GPT-2-style decoder on culmen's blocks (same parameters as ``TorchGPT2``)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        from culmen.normalization import FusedLayerNorm

        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d, **fk)
        self.wpe = nn.Embedding(cfg.seq, cfg.d, **fk)
        self.layers = nn.ModuleList(CulmenGPT2Block(cfg, **fk) for _ in range(cfg.layers))
        self.final_norm = FusedLayerNorm(cfg.d, eps=cfg.eps, **fk)

    def head_loss(self, h: Tensor, residual: Tensor, labels: Tensor) -> Tensor:
        from culmen.flash_attn.ops.triton.layer_norm import layer_norm_fn
        from culmen.ops.cross_entropy import fused_linear_cross_entropy

        n = self.final_norm
        x = layer_norm_fn(h, n.weight, n.bias, residual=residual, eps=n.eps)
        return fused_linear_cross_entropy(x, self.wte.weight, labels)

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        h, residual = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]], None
        for layer in self.layers:
            h, residual = layer(h, residual)
        return self.head_loss(h, residual, labels)


_CLASSES = {("llama", "torch"): TorchLlama, ("llama", "culmen"): CulmenLlama,
            ("gpt2", "torch"): TorchGPT2, ("gpt2", "culmen"): CulmenGPT2}


# ------------------------------------------------------------------------------------ construction


_OUT_PROJ = ("o_proj.weight", "down_proj.weight", "proj.weight")


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Fill every parameter from a generator seeded by ``(seed, parameter name)``: norm weights 1, biases
    0, matrices N(0, std) (output projections std / sqrt(2 * layers), as GPT-2). Two models with the
    same parameter names get the same values whatever their module classes."""
    layers = getattr(getattr(model, "cfg", None), "layers", 1)
    for name, p in sorted(model.named_parameters()):
        if p.dim() == 1:
            p.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
            continue
        g = torch.Generator(device=p.device)
        g.manual_seed(seed * 1_000_003 + sum((i + 1) * ord(c) for i, c in enumerate(name)))
        s = std / math.sqrt(2 * layers) if name.endswith(_OUT_PROJ) else std
        p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * s)


def build_model(cfg: ModelConfig, impl: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """The ``impl`` (``torch`` / ``culmen``) model of ``cfg`` on ``device`` in ``dtype``, initialised by
    ``init_weights(seed)``, in training mode."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    model = _CLASSES[(cfg.style, impl)](cfg, device=device, dtype=dtype)
    init_weights(model, seed)
    return model.train()


def build_optimizer(model: nn.Module, impl: str, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                    weight_decay: float = 0.1, eps: float = 1e-8) -> torch.optim.Optimizer:
    """AdamW with the same hyper-parameters: ``torch.optim.AdamW(fused=True)`` (torch) or
    ``culmen.optimizers.FusedAdam(adam_w_mode=True)`` (culmen)."""
    params = list(model.parameters())
    if impl == "culmen":
        from culmen.optimizers import FusedAdam

        return FusedAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)


def compile_model(model: nn.Module, scope: str) -> nn.Module:
    """``torch.compile`` the model's forward and loss. ``scope="model"``: the whole ``forward`` (one graph,
    the way most scripts do it); ``"block"``: each block and ``head_loss`` separately (the blocks share one
    compiled graph, so compile time does not grow with depth; the embedding stays eager). Returns the
    callable to use as ``fn(tokens, labels)``."""
    if scope == "model":
        return torch.compile(model)
    if scope != "block":
        raise ValueError(f"compile scope must be 'model' or 'block', got {scope!r}")
    # Identical blocks reuse one graph; should Dynamo still recompile per block, a limit below the depth
    # would silently leave the deeper blocks eager. Raise it (process-wide, the same for both models).
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 2 * len(model.layers) + 8))
    for layer in model.layers:
        layer.compile()
    model.head_loss = torch.compile(model.head_loss)
    return model


def make_batch(cfg: ModelConfig, device: torch.device, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``(tokens, labels)``, each ``(batch, seq)`` int64: a random token stream and its next tokens."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    stream = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g, device="cpu")
    return stream[:, :-1].contiguous().to(device), stream[:, 1:].contiguous().to(device)
