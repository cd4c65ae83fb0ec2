"""A plain attention oracle for tests: the math written out with PyTorch ops in a chosen dtype.

``plain(..., dtype=float64)`` is the high-precision oracle (its autograd gives the reference
gradients); ``plain(..., dtype=bf16)`` is the "same math in the input precision" baseline of the
tolerance rule. Heads are expanded for GQA and the mask is applied additively, independently of
``culmen.ops.attention.reference``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def plain(q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype, *, causal: bool = False,
          window: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi: Tensor | None = None,
          keep: Tensor | None = None, p: float = 0.0) -> Tensor:
    """Attention written out in ``dtype`` (heads expanded, additive mask), the low-precision baseline
    and, in float64, the oracle of the gradients."""
    B, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qq, kk, vv = (t.to(dtype) for t in (q, k, v))
    kk, vv = kk.repeat_interleave(h // hk, 2), vv.repeat_interleave(h // hk, 2)
    s = torch.einsum("bihd,bjhd->bhij", qq, kk) * d ** -0.5
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    rel = torch.arange(sk, device=q.device).view(1, sk) - (torch.arange(sq, device=q.device).view(sq, 1) + sk - sq)
    if alibi is not None:
        s = s - alibi.to(dtype).reshape(-1, h)[:, :, None, None] * rel.abs().to(dtype)
    left, right = window[0], (0 if causal else window[1])
    ok = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        ok &= rel <= right
    if left >= 0:
        ok &= rel >= -left
    seen = ok.any(-1).view(1, 1, sq, 1)
    a = torch.softmax(s.masked_fill(~ok, float("-inf")).masked_fill(~seen, 0.0), -1) * seen
    if keep is not None:
        a = a * keep.to(dtype) / (1 - p)
    return torch.einsum("bhij,bjhd->bihd", a, vv)


def grads(out: Tensor, dout: Tensor, inputs: tuple[Tensor, ...]) -> list[Tensor]:
    """Gradients of ``out`` (seeded with ``dout``) w.r.t. ``inputs``, cloned; earlier grads are dropped."""
    for t in inputs:
        t.grad = None
    out.backward(dout)
    return [t.grad.clone() for t in inputs]
