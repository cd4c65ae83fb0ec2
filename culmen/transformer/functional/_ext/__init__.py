"""Python stand-ins for Apex's compiled Megatron extensions, importable under their Apex names through
``culmen.compat`` (``import scaled_masked_softmax_cuda`` ...). Megatron-LM and NeMo call them
directly: each module offers the same functions and signatures, backed by culmen's Triton kernels.

Differences from the CUDA extensions: no shape limits (any ``sk >= 1``; Apex stops at 16384 and
needs ``sq`` divisible by its batch-per-block), fp32 inputs work besides fp16/bf16, ``backward``
returns a new tensor instead of overwriting ``output_grads``, and bad arguments raise
``ValueError`` / ``TypeError``.
"""

from __future__ import annotations

from torch import Tensor

from culmen.transformer.functional.fused_softmax import get_batch_per_block as _gbpb


def check_dims(name: str, t: Tensor, dims: int) -> None:
    """``ValueError`` unless ``t`` is a tensor with ``dims`` dims (the extensions' TORCH_CHECKs)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims}D tensor, got shape {tuple(t.shape)}")


def get_batch_per_block(query_seq_len: int, key_seq_len: int, batches: int, attn_heads: int) -> int:
    """Apex's rows per 128-thread block for ``key_seq_len`` (culmen's kernels do not need it)."""
    return _gbpb(query_seq_len, key_seq_len, batches, attn_heads)
