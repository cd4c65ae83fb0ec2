"""The GPT that ``culmen bench model_parallel`` trains (``culmen.bench.parallel_models``): its shapes, and one
model definition whose linear layers, embedding and loss come either from ``torch.nn`` (single device, FSDP2,
the pipeline stages, PyTorch's TP, which shards them after construction) or from culmen's tensor-parallel
layers (with or without sequence parallelism)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTShape:
    """Model and batch sizes: ``tp_batch`` (sequences per step, shared by the TP ranks), ``micro`` x
    ``microbatches`` (pipeline), ``zero_batch`` (sequences per GPU per step)."""

    name: str
    d: int
    layers: int
    heads: int
    vocab: int
    seq: int
    tp_batch: int
    micro: int
    microbatches: int
    zero_batch: int

    @property
    def params(self) -> int:
        per_block = 12 * self.d * self.d + 13 * self.d  # qkv, proj, fc1, fc2 weights + biases, two norms
        return self.layers * per_block + 2 * self.vocab * self.d + 2 * self.d


SHAPES = {
    "1.3b": GPTShape("1.3b", 2048, 24, 16, 32768, 2048, tp_batch=8, micro=2, microbatches=8, zero_batch=4),
    "tiny": GPTShape("tiny", 64, 2, 4, 256, 32, tp_batch=2, micro=1, microbatches=8, zero_batch=2),
}


# ------------------------------------------------------------------------------------------- model


class _Linears:
    """How a GPT builds its linear layers, embedding and loss: ``plain`` (``nn`` modules: single device,
    FSDP2, pipeline, and PyTorch TP, which shards them after construction) or ``culmen`` (culmen's
    tensor-parallel layers, ``sp``: with sequence parallelism)."""

    def __init__(self, kind: str, dtype: torch.dtype, device: torch.device, sp: bool = False) -> None:
        self.kind, self.dtype, self.device, self.sp = kind, dtype, device, sp

    def _init(self, w: torch.Tensor) -> None:
        nn.init.normal_(w, std=0.02)

    def col(self, n_in: int, n_out: int, bias: bool = True) -> nn.Module:
        if self.kind == "plain":
            return nn.Linear(n_in, n_out, bias=bias, device=self.device, dtype=self.dtype)
        from culmen.transformer.tensor_parallel import ColumnParallelLinear

        return _FirstOutput(ColumnParallelLinear(
            n_in, n_out, bias=bias, gather_output=False, init_method=self._init, params_dtype=self.dtype,
            sequence_parallel_enabled=self.sp, no_async_tensor_model_parallel_allreduce=self.sp))

    def row(self, n_in: int, n_out: int) -> nn.Module:
        if self.kind == "plain":
            return nn.Linear(n_in, n_out, device=self.device, dtype=self.dtype)
        from culmen.transformer.tensor_parallel import RowParallelLinear

        return _FirstOutput(RowParallelLinear(n_in, n_out, input_is_parallel=True, init_method=self._init,
                                              params_dtype=self.dtype, sequence_parallel_enabled=self.sp))

    def embedding(self, vocab: int, d: int) -> nn.Module:
        if self.kind == "plain":
            return nn.Embedding(vocab, d, device=self.device, dtype=self.dtype)
        from culmen.transformer.tensor_parallel import VocabParallelEmbedding

        return VocabParallelEmbedding(vocab, d, init_method=self._init, params_dtype=self.dtype)

    def norm(self, d: int) -> nn.LayerNorm:
        ln = nn.LayerNorm(d, device=self.device, dtype=self.dtype)
        if self.sp:  # each TP rank sees part of the sequence: the norm's gradients are partial sums
            for p in ln.parameters():
                p.sequence_parallel_enabled = True
        return ln

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """``(s, b, d)`` embedding output -> the residual stream (this rank's sequence rows under SP)."""
        if self.sp:
            from culmen.transformer.tensor_parallel import scatter_to_sequence_parallel_region

            return scatter_to_sequence_parallel_region(x)
        return x

    def loss(self, logits: Any, labels_sb: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of ``(s, b, V[/tp])`` logits against ``(s, b)`` labels."""
        if self.kind == "culmen":
            from culmen.transformer.tensor_parallel import vocab_parallel_cross_entropy

            return vocab_parallel_cross_entropy(logits, labels_sb).float().mean()
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels_sb.flatten())
        # PyTorch TP (loss_parallel) returns a replicated DTensor: hand back the local scalar
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


class _FirstOutput(nn.Module):
    """culmen's parallel linears return ``(output, bias)``; the blocks want the output."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)[0]


class _Mark(torch.autograd.Function):
    """Identity that stamps ``clock`` with ``fwd_key`` in forward and ``bwd_key`` in backward."""

    @staticmethod
    def forward(ctx, x, clock, fwd_key, bwd_key):
        clock.stamp(fwd_key)
        ctx.clock, ctx.key = clock, bwd_key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.stamp(ctx.key)
        return grad, None, None, None


class Block(nn.Module):
    """Pre-norm transformer block on ``(s, b, d)`` (``(s / tp, b, d)`` under sequence parallelism)."""

    def __init__(self, d: int, heads: int, lin: _Linears) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.ln1, self.ln2 = lin.norm(d), lin.norm(d)
        self.qkv, self.proj = lin.col(d, 3 * d), lin.row(d, d)
        self.fc1, self.fc2 = lin.col(d, 4 * d), lin.row(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))
        s, b = qkv.shape[0], qkv.shape[1]
        # QKV is laid out head by head, so a contiguous split of its rows gives each TP rank whole heads
        q, k, v = qkv.view(s, b, -1, 3, self.head_dim).permute(3, 1, 2, 0, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(o.permute(2, 0, 1, 3).reshape(s, b, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Blocks ``layers`` of the GPT; ``pre``: embeds the tokens, ``post``: norm, LM head and mean loss.

    ``forward(tokens (b, s) int64, labels (b, s) int64)``: the scalar loss (``post``) or the hidden state
    ``(s, b, d)``. A later pipeline stage reads its input from ``set_input_tensor``. With ``clock`` set,
    forward and backward of the stage are stamped (``f0``/``f1``, ``b0``/``b1``)."""

    def __init__(self, shape: GPTShape, lin: _Linears, layers: range | None = None, pre: bool = True,
                 post: bool = True) -> None:
        super().__init__()
        self.lin, self.pre, self.post = lin, pre, post
        self.embed = lin.embedding(shape.vocab, shape.d) if pre else None
        self.blocks = nn.ModuleList(Block(shape.d, shape.heads, lin) for _ in (layers or range(shape.layers)))
        self.norm = lin.norm(shape.d) if post else None
        self.head = lin.col(shape.d, shape.vocab, bias=False) if post else None
        self.input_tensor: torch.Tensor | None = None
        self.clock: Any = None  # a parallel_models._Clock while a pipeline run stamps its stages

    def set_input_tensor(self, tensors: Any) -> None:
        self.input_tensor = tensors[0] if isinstance(tensors, (list, tuple)) else tensors

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.lin.enter(self.embed(tokens).transpose(0, 1).contiguous()) if self.pre else self.input_tensor
        if self.clock is not None:
            x = _Mark.apply(x, self.clock, "f0", "b1")
        for blk in self.blocks:
            x = blk(x)
        if self.post:
            x = self.lin.loss(self.head(self.norm(x)), labels.transpose(0, 1))
        if self.clock is not None:
            x = _Mark.apply(x, self.clock, "f1", "b0")
        return x
