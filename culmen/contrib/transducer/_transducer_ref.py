"""``apex.contrib.transducer._transducer_ref``: the plain-PyTorch oracles Apex's transducer tests compare against,
with Apex's signatures and return conventions (so those tests run through the alias).

``transducer_loss_reference`` runs culmen's vectorized RNN-T reference (``culmen.ops.transducer.reference``);
``transducer_joint_reference`` is the broadcast sum with ReLU / dropout in PyTorch autograd. Neither touches the
inputs' ``.grad``: the gradients are returned.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.transducer.reference import rnnt_loss_bwd_ref, rnnt_loss_fwd_ref

__all__ = ["transducer_joint_reference", "transducer_loss_reference"]


def _inside(f_len: Tensor, y_len: Tensor, T: int, U: int) -> Tensor:
    """``(B, T, U)`` bool: ``t < f_len[b]`` and ``u <= y_len[b]`` (the lattice nodes a batch owns)."""
    t = torch.arange(T, device=f_len.device).view(1, T, 1)
    u = torch.arange(U, device=f_len.device).view(1, 1, U)
    return (t < f_len.view(-1, 1, 1)) & (u <= y_len.view(-1, 1, 1))


def transducer_loss_reference(x: Tensor, label: Tensor, f_len: Tensor, y_len: Tensor, blank_idx: int,
                              loss_grad: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """RNN-T loss of the logits ``x`` ``(B, T, U, K)`` (``U = max(y_len) + 1``; softmax taken here) and its gradient.

    ``label`` ``(B, U - 1)`` integer, ``f_len`` / ``y_len`` ``(B,)`` integer, ``loss_grad`` ``(B,)`` the upstream
    gradient of each batch's loss. Returns ``(alpha, beta, x_grad, loss)``: the forward / backward log
    probabilities ``(B, T, U)`` in fp32 (fp64 for fp64 ``x``; zero outside ``t < f_len``, ``u <= y_len``), the
    gradient of ``sum(loss_grad * loss)`` w.r.t. ``x`` in ``x``'s dtype, and ``loss`` ``(B,)`` in ``x``'s dtype.
    """
    B, T, U, _ = x.shape
    xd = x.detach()
    saved = rnnt_loss_fwd_ref(xd, label, f_len, y_len, blank_idx, None, T, False)
    grad = rnnt_loss_bwd_ref(loss_grad, xd, label, f_len, y_len, blank_idx, None, T, False, saved)
    inside = _inside(f_len.to(torch.int64), y_len.to(torch.int64), T, U)
    zero = saved["alpha"].new_zeros(())
    alpha = torch.where(inside, saved["alpha"], zero)
    beta = torch.where(inside, saved["beta"], zero)
    return alpha, beta, grad, saved["loss"]


def transducer_joint_reference(f: Tensor, g: Tensor, h_grad: Tensor, f_len: Tensor, g_len: Tensor,
                               pack_output: bool, relu: bool, dropout: bool, dropout_prob: float = 0,
                               mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The transducer joint ``h[b, t, u] = f[b, t] + g[b, u]`` (then ReLU, then ``mask / (1 - dropout_prob)``)
    and its gradients.

    ``f`` ``(B, T, H)``, ``g`` ``(B, U, H)``, ``h_grad`` ``(B, T, U, H)`` (the upstream gradient over the whole
    grid), ``mask`` the dropout keep-mask broadcastable to ``(B, T, U, H)`` (required with ``dropout``).
    Returns ``(h, f_grad, g_grad)``: ``h`` dense ``(B, T, U, H)`` with ``-1`` outside ``t < f_len``,
    ``u < g_len``, or with ``pack_output`` the valid rows of each batch ``(sum f_len * g_len, H)``.
    """
    if dropout and mask is None:
        raise ValueError("transducer_joint_reference: dropout=True needs the dropout mask (mask=...)")
    fl = f.detach().requires_grad_()
    gl = g.detach().requires_grad_()
    h = fl.unsqueeze(2) + gl.unsqueeze(1)
    if relu:
        h = torch.relu(h)
    if dropout:
        h = h * mask.to(h.dtype) * (1.0 / (1.0 - dropout_prob))
    f_grad, g_grad = torch.autograd.grad(h, (fl, gl), h_grad)
    h = h.detach()
    B, T, U, _ = h.shape
    t = torch.arange(T, device=h.device).view(1, T, 1)
    u = torch.arange(U, device=h.device).view(1, 1, U)
    valid = (t < f_len.view(-1, 1, 1)) & (u < g_len.view(-1, 1, 1))
    if pack_output:
        # Row-major over (b, t, u): each batch's f_len x g_len block, one after the other.
        return h[valid], f_grad, g_grad
    return torch.where(valid.unsqueeze(-1), h, h.new_full((), -1.0)), f_grad, g_grad
