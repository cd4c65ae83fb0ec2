"""Python stand-ins for Apex's compiled Megatron extensions, importable under their Apex names through
``culmen.compat`` (``import scaled_masked_softmax_cuda`` ...). Megatron-LM and NeMo call them
directly: each module offers the same functions and signatures, backed by culmen's Triton kernels.

Differences from the CUDA extensions: no shape limits (any ``sk >= 1``; Apex stops at 16384 and
needs ``sq`` divisible by its batch-per-block), fp32 inputs work besides fp16/bf16, ``backward``
returns a new tensor instead of overwriting ``output_grads``, and bad arguments raise
``ValueError`` / ``TypeError``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.softmax import softmax_backward, softmax_forward
from culmen.ops.softmax.op import as_scale, bwd_plan, fwd_plan
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


def softmax_fwd(input: Tensor, mask: Tensor | None, scale, causal: bool, check) -> Tensor:
    """The forward of a softmax extension: ``check(input, mask)`` (its TORCH_CHECKs) runs once per call
    signature, when the cached plan is built."""
    if torch.compiler.is_compiling():
        check(input, mask)
        return softmax_forward(input, mask, scale, causal)
    return fwd_plan(input, mask, causal, (3, 4), "input", check).forward(
        input, mask, scale if type(scale) is float else as_scale(scale))


def softmax_bwd(output_grads: Tensor, softmax_results: Tensor, scale, causal: bool, check) -> Tensor:
    """The backward of a softmax extension (``check(output_grads, softmax_results)`` as in ``softmax_fwd``)."""
    if torch.compiler.is_compiling():
        check(output_grads, softmax_results)
        return softmax_backward(output_grads, softmax_results, scale, causal)
    return bwd_plan(output_grads, softmax_results, causal, check).backward(
        output_grads, softmax_results, scale if type(scale) is float else as_scale(scale))



def check_4d(output_grads: Tensor, softmax_results: Tensor) -> None:
    """The backward extensions' checks: two 4-D tensors."""
    check_dims("output_grads", output_grads, 4)
    check_dims("softmax_results", softmax_results, 4)
