"""``vocab_parallel_cross_entropy``: cross-entropy over logits whose vocabulary is split across TP ranks.

Runs on culmen's cross-entropy op (``culmen.ops.cross_entropy.cross_entropy`` with a ``process_group``):
one fused pass per rank over its vocab shard (online softmax, fp32 statistics), a MAX and a SUM
all-reduce of per-row scalars, and a backward that needs no communication. Apex's version instead
materialises ``exp(logits)`` in the logits' dtype and all-reduces three times.

Differences from Apex, both where Apex is wrong for more than one rank:

* label smoothing uses the global vocabulary size ``K = tp * V_local`` and the mean log-probability over
  the whole vocabulary. Apex takes ``K`` and the mean from the local shard, so its smoothed loss
  depends on the TP size; with one rank the two agree.
* statistics are fp32 whatever the logits' dtype (Apex computes in the logits' dtype); the loss is
  returned in the logits' dtype, as Apex's.
"""

from __future__ import annotations

from torch import Tensor

from culmen.ops.cross_entropy import cross_entropy
from culmen.transformer import parallel_state

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(vocab_parallel_logits: Tensor, target: Tensor,
                                 label_smoothing: float = 0.0) -> Tensor:
    """Per-token cross-entropy of logits sharded along the vocabulary over the tensor-parallel group.

    Args:
        vocab_parallel_logits: ``(..., V_local)`` fp16/bf16/fp32/fp64, this rank's vocab columns
            ``[rank * V_local, (rank + 1) * V_local)`` of ``K = tp * V_local`` classes (typically
            ``(s, b, V_local)``).
        target: ``(...)`` integer class ids in ``[0, K)`` (the same on every TP rank).
        label_smoothing: ``alpha`` in ``[0, (K - 1) / K]``; as in Apex/NeMo the target keeps
            ``1 - alpha`` of the mass and every other class gets ``alpha / (K - 1)``.

    Returns:
        ``(...)`` loss in the logits' dtype, differentiable w.r.t. ``vocab_parallel_logits``.
    """
    if vocab_parallel_logits.dim() < 1:
        raise ValueError("vocab_parallel_logits must have a vocab dimension, got a 0-d tensor")
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must be the logits' shape without the vocab "
                         f"dimension, {tuple(vocab_parallel_logits.shape[:-1])}")
    world = parallel_state.get_tensor_model_parallel_world_size()
    v_local = vocab_parallel_logits.shape[-1]
    k = v_local * world
    smoothing = 0.0
    if label_smoothing != 0.0:
        label_smoothing = float(label_smoothing)
        # alpha / (K - 1) to each other class == alpha * K / (K - 1) spread uniformly over all K classes.
        if not 0.0 < label_smoothing <= (k - 1) / k:
            raise ValueError(f"label_smoothing must be in [0, (K - 1) / K] = [0, {(k - 1) / k:g}] for K={k} "
                             f"classes, got {label_smoothing}")
        smoothing = label_smoothing * k / (k - 1)
    group = parallel_state.get_tensor_model_parallel_group() if world > 1 else None
    loss = cross_entropy(vocab_parallel_logits.reshape(-1, v_local), target.reshape(-1),
                         label_smoothing=smoothing, process_group=group,
                         out_dtype=vocab_parallel_logits.dtype).loss
    return loss.view(target.shape)
