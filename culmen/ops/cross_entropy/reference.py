"""Pure-PyTorch cross-entropy: the oracle of the tests and the CPU path of the ops.

``cross_entropy_ref`` is the differentiable definition, computed in the dtype it is given (float64
for the oracle, fp32 for PyTorch's usual upcast computation). ``cross_entropy_fwd_ref`` /
``cross_entropy_bwd_ref`` compute what the kernels compute per row (fp32 statistics, NaN rows for invalid
labels, the in-place gradient write), so the op runs the same on every backend.
``fused_linear_cross_entropy_ref`` is the unfused ``hidden @ weight.T + bias`` then cross-entropy.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _softcap(z: Tensor, softcap: float) -> Tensor:
    return softcap * torch.tanh(z / softcap) if softcap > 0.0 else z


def _label_info(labels: Tensor, V: int, vocab_start: int, total_classes: int, ignore_index: int):
    labels = labels.long()
    valid = labels != ignore_index
    local = labels - vocab_start
    in_shard = valid & (local >= 0) & (local < V)
    bad = valid & ((labels < 0) | (labels >= total_classes))
    return valid, local, in_shard, bad


def cross_entropy_ref(
    logits: Tensor,
    labels: Tensor,
    *,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    ignore_index: int = -100,
    softcap: float = 0.0,
    vocab_start: int = 0,
    total_classes: int | None = None,
    precomputed_lse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row ``(loss, z_loss, lse)`` of ``logits (N, V)`` in ``logits.dtype``, differentiable.

    ``z = softcap(logit_scale * logits)``; ``loss = lse - (1 - s) z_t - s * sum(z) / total_classes +
    lse_square_scale * lse^2`` and ``z_loss`` is the last term; rows labelled ``ignore_index`` are 0.
    ``vocab_start`` / ``total_classes`` describe a vocab shard (then ``lse`` is this shard's). A
    ``precomputed_lse`` is used as a constant (no gradient flows through it).
    """
    V = logits.shape[-1]
    total = total_classes if total_classes is not None else V
    valid, local, in_shard, _ = _label_info(labels, V, vocab_start, total, ignore_index)
    z = _softcap(logits * logit_scale, softcap)
    lse = torch.logsumexp(z, dim=-1) if precomputed_lse is None else precomputed_lse.to(z.dtype)
    z_t = torch.gather(z, -1, local.clamp(0, max(V - 1, 0)).unsqueeze(-1)).squeeze(-1)
    z_t = torch.where(in_shard, z_t, torch.zeros_like(z_t))
    loss = lse - (1.0 - label_smoothing) * z_t
    if label_smoothing > 0.0:
        loss = loss - label_smoothing * z.sum(-1) / total
    zl = lse_square_scale * lse * lse
    zero = torch.zeros_like(loss)
    return torch.where(valid, loss + zl, zero), torch.where(valid, zl, zero).detach(), lse.detach()


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@torch.no_grad()
def cross_entropy_fwd_ref(logits: Tensor, labels: Tensor, lse_in: Tensor | None, label_smoothing: float,
                          logit_scale: float, lse_square_scale: float, ignore_index: int, softcap: float,
                          vocab_start: int, total_classes: int, add_lse: bool,
                          grad_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The forward kernels in PyTorch: per-row fp32 ``(loss, z_loss, lse)`` of ``logits (N, V)`` (a shard of
    ``total_classes`` from ``vocab_start``; ``add_lse=False``: the shard's partial loss and zero z-loss);
    ``grad_scale`` (1 element) also overwrites ``logits`` with ``grad_scale * d loss / d logits``."""
    x = logits.to(_compute_dtype(logits))
    valid, local, in_shard, bad = _label_info(labels, logits.shape[-1], vocab_start, total_classes, ignore_index)
    z = _softcap(x * logit_scale, softcap)
    lse = torch.logsumexp(z, dim=-1) if lse_in is None else lse_in.to(z.dtype)
    z_t = torch.gather(z, -1, local.clamp(0, max(z.shape[-1] - 1, 0)).unsqueeze(-1)).squeeze(-1)
    z_t = torch.where(in_shard, z_t, torch.zeros_like(z_t))
    loss = -(1.0 - label_smoothing) * z_t
    if label_smoothing > 0.0:
        loss = loss - label_smoothing * z.sum(-1) / total_classes
    zl = torch.zeros_like(loss)
    if add_lse:
        zl = torch.where(valid, lse_square_scale * lse * lse, zl)
        loss = loss + lse + zl
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    loss = torch.where(bad, torch.full_like(loss, float("nan")), loss)
    if grad_scale is not None:
        dloss = grad_scale.reshape(1).to(z.dtype).expand(logits.shape[0])
        cross_entropy_bwd_ref(dloss, logits, lse, labels, label_smoothing, logit_scale, lse_square_scale,
                              ignore_index, softcap, vocab_start, total_classes, out=logits)
    f32 = torch.float32
    return loss.to(f32), zl.to(f32), lse.to(f32)


@torch.no_grad()
def cross_entropy_bwd_ref(dloss: Tensor, logits: Tensor, lse: Tensor, labels: Tensor, label_smoothing: float,
                          logit_scale: float, lse_square_scale: float, ignore_index: int, softcap: float,
                          vocab_start: int, total_classes: int, out: Tensor | None = None) -> Tensor:
    """The backward kernel in PyTorch: ``d loss / d logits`` for per-row ``dloss`` (into ``out`` if given)."""
    cdt = _compute_dtype(logits)
    x = logits.to(cdt)
    V = logits.shape[-1]
    valid, local, in_shard, bad = _label_info(labels, V, vocab_start, total_classes, ignore_index)
    z = _softcap(x * logit_scale, softcap)
    lse = lse.to(cdt)
    g = torch.exp(z - lse[:, None]) * (1.0 + 2.0 * lse_square_scale * lse)[:, None]
    g = g - label_smoothing / total_classes
    onehot = torch.zeros_like(g)
    onehot.scatter_(-1, local.clamp(0, max(V - 1, 0)).unsqueeze(-1), in_shard.to(cdt).unsqueeze(-1))
    g = g - (1.0 - label_smoothing) * onehot
    coef = torch.where(valid, dloss.to(cdt) * logit_scale, torch.zeros((), dtype=cdt, device=g.device))
    g = g * coef[:, None]
    if softcap > 0.0:
        g = g * (1.0 - (z / softcap) ** 2)
    g = torch.where(bad[:, None], torch.full_like(g, float("nan")), g)
    if out is None:
        return g.to(logits.dtype)
    out.copy_(g)
    return out


def fused_linear_cross_entropy_ref(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
) -> tuple[Tensor, Tensor]:
    """Unfused ``logits = hidden @ weight.T (+ bias)`` then cross-entropy, in the inputs' dtype.

    Returns ``(loss, z_loss)`` reduced by ``reduction`` (``mean`` divides by the non-ignored rows).
    """
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    if bias is not None:
        logits = logits + bias
    loss, zl, _ = cross_entropy_ref(logits, labels.reshape(-1), label_smoothing=label_smoothing,
                                    lse_square_scale=lse_square_scale, ignore_index=ignore_index,
                                    softcap=float(softcap or 0.0))
    if reduction == "none":
        return loss.reshape(labels.shape), zl.reshape(labels.shape)
    if reduction == "sum":
        return loss.sum(), zl.sum()
    n = (labels != ignore_index).sum()
    return loss.sum() / n, zl.sum() / n
