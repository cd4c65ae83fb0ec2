"""RNN-T benchmark ``transducer``: joint + vocabulary projection + loss, forward and backward.

The pipeline of a speech transducer's training step after the encoder and the prediction network:
``h = joint(f, g)`` (``(B, T, U, H)``), ``logits = h @ W.T`` (``K`` classes), the RNN-T loss, its mean,
and the gradients of ``f``, ``g`` and ``W``. Shapes are the issue's speech shapes (B=16, T=500, U=100,
H=512, K=1024) with ragged lengths (``f_len`` in ``[T/2, T]``, ``y_len`` in ``[(U-1)/2, U-1]``, one batch
at the maximum), fp16 and bf16 activations.

Providers, on the same tensors:

* ``culmen``: ``TransducerJoint`` + ``F.linear`` + ``TransducerLoss``. Case ``dense``: padded
  ``(B, T, U, .)`` tensors; case ``packed``: Apex's packed layout (only the valid ``(t, u)`` rows are
  formed, projected and scored), the way Apex's users run it.
* ``culmen-fused``: ``TransducerJoint`` then ``TransducerProjectionLoss`` (culmen's own fused projection +
  loss, not in Apex): the logits are formed a chunk of rows at a time and never exist whole, in the
  same layout (dense or packed) as the case's ``culmen`` provider. Shown for its memory and speed; not
  counted as a peer of ``culmen`` (``Case.informational``).
* ``torch``: the broadcast-add joint and ``F.linear`` in PyTorch, then ``torchaudio.functional.rnnt_loss``
  when torchaudio imports (bf16 logits are cast to fp32 for it: it takes fp16/fp32 only), else a plain
  PyTorch RNN-T loss: fp32 ``log_softmax``, the blank / label log-probabilities, and the alpha
  recursion one label position at a time as a log-space prefix sum (``torch.logcumsumexp``), all
  differentiated by autograd.

The projection's matmuls (about ``6 B T U H K`` flops dense) are the same PyTorch call for every
provider. Peak memory (the most allocated during one fwd+bwd call beyond what was allocated before it)
is measured once per provider and printed under each case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.bench.providers import grad_provider, peak_extra_bytes
from culmen.bench.registry import CULMEN, BenchConfig, Case, register_benchmark
from culmen.testing import randn

_DT_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
BLANK = 0
FUSED = "culmen-fused"  # culmen's fused projection + loss (TransducerProjectionLoss), shown beside the peers
_NEG = -1.0e30


def rnnt_loss_torch(logits: Tensor, labels: Tensor, f_len: Tensor, y_len: Tensor, blank: int) -> Tensor:
    """Per-batch RNN-T loss in plain PyTorch (fp32), differentiable by autograd.

    Column ``u`` of alpha solves ``a[t] = logaddexp(a[t-1] + blank[t-1], c[t])`` with
    ``c[t] = alpha[t, u-1] + emit[t, u-1]``, i.e. ``a = S + logcumsumexp(c - S)`` where ``S`` is the
    exclusive prefix sum of the blank log-probabilities: one vectorized step per label position.
    """
    lp = logits.float().log_softmax(-1)
    B, T, U, _ = lp.shape
    lpb = lp[..., blank]
    lpe = lp[:, :, :-1].gather(3, labels[:, None, :U - 1, None].long().expand(B, T, U - 1, 1)).squeeze(-1)
    s = torch.cumsum(lpb, 1) - lpb
    t0 = torch.arange(T, device=lp.device) == 0
    col = torch.where(t0, 0.0, _NEG).expand(B, T)
    cols = []
    for u in range(U):
        c = col if u == 0 else col + lpe[:, :, u - 1]
        col = s[:, :, u] + torch.logcumsumexp(c - s[:, :, u], 1)
        cols.append(col)
    alpha = torch.stack(cols, 2)
    b = torch.arange(B, device=lp.device)
    t_end, u_end = f_len.long() - 1, y_len.long()
    return -(alpha[b, t_end, u_end] + lpb[b, t_end, u_end])


def _loss_peer(notes: list[str]) -> tuple[str, Callable[..., Tensor]]:
    try:
        import torchaudio.functional as ta
    except Exception as exc:  # not installed (the usual case) or broken
        notes.append(f"torch: torchaudio not importable ({type(exc).__name__}); the loss is the plain-PyTorch "
                     "formulation (culmen.bench.transducer.rnnt_loss_torch)")
        return "plain", rnnt_loss_torch

    def loss(logits, labels, f_len, y_len, blank):
        if logits.dtype not in (torch.float16, torch.float32):
            logits = logits.float()
        return ta.rnnt_loss(logits, labels.int(), f_len.int(), y_len.int(), blank=blank, reduction="none")

    notes.append("torch: loss = torchaudio.functional.rnnt_loss (fused log-softmax; bf16 logits cast to fp32)")
    return "torchaudio", loss


def _peak_memory(fn: Callable[[], object], device: torch.device) -> float | None:
    """GiB allocated at the peak of one call of ``fn`` beyond what was allocated before it."""
    peak = peak_extra_bytes(fn, device)
    return None if peak is None else peak / 2**30


@register_benchmark("transducer", "loss")
def transducer_bench(cfg: BenchConfig) -> Iterator[Case]:
    """RNN-T joint + projection + loss fwd+bwd (B=16, T=500, U=100, H=512, K=1024), dense and packed."""
    from culmen.contrib.transducer import TransducerJoint, TransducerLoss, TransducerProjectionLoss

    dev = cfg.device
    B, T, U, H, K = (2, 12, 5, 16, 32) if cfg.quick else (16, 500, 100, 512, 1024)
    gen = torch.Generator().manual_seed(0)
    f_len = torch.randint(T // 2, T + 1, (B,), generator=gen, dtype=torch.int32)
    y_len = torch.randint((U - 1) // 2, U, (B,), generator=gen, dtype=torch.int32)
    f_len[0], y_len[-1] = T, U - 1
    labels = torch.randint(1, K, (B, U - 1), generator=gen, dtype=torch.int32)
    rows = int((f_len.long() * (y_len.long() + 1)).sum())
    f_len, y_len, labels = f_len.to(dev), y_len.to(dev), labels.to(dev)
    g_len = y_len + 1
    boff = torch.cumsum(f_len.long() * g_len.long(), 0)
    for dtype in (torch.float16, torch.bfloat16):
        for layout in ("dense", "packed"):
            f = randn((B, T, H), dtype, dev, requires_grad=True)
            g = randn((B, U, H), dtype, dev, requires_grad=True)
            w = randn((K, H), dtype, dev, H ** -0.5, requires_grad=True)
            notes: list[str] = ["compile: not timed (the loss recursion unrolls into one graph step per label)"]
            peer_name, peer_loss = _loss_peer(notes)
            if layout == "packed":
                joint, crit = TransducerJoint(pack_output=True), TransducerLoss(packed_input=True)

                def ours(f=f, g=g, w=w, joint=joint, crit=crit):
                    h = joint(f, g, f_len, g_len, boff, rows)
                    return crit(F.linear(h, w), labels, f_len, y_len, BLANK, boff, T).float().mean()

                fcrit = TransducerProjectionLoss(packed_input=True)

                def fused(f=f, g=g, w=w, joint=joint, crit=fcrit):
                    h = joint(f, g, f_len, g_len, boff, rows)
                    return crit(h, w, None, labels, f_len, y_len, BLANK, boff, T).float().mean()
            else:
                joint, crit = TransducerJoint(), TransducerLoss()

                def ours(f=f, g=g, w=w, joint=joint, crit=crit):
                    h = joint(f, g, f_len, g_len)
                    return crit(F.linear(h, w), labels, f_len, y_len, BLANK).float().mean()

                fcrit = TransducerProjectionLoss()

                def fused(f=f, g=g, w=w, joint=joint, crit=fcrit):
                    h = joint(f, g, f_len, g_len)
                    return crit(h, w, None, labels, f_len, y_len, BLANK).float().mean()

            def eager(f=f, g=g, w=w, peer_loss=peer_loss):
                logits = F.linear(f.unsqueeze(2) + g.unsqueeze(1), w)
                return peer_loss(logits, labels, f_len, y_len, BLANK).float().mean()

            leaves = {"f": f, "g": g, "w": w}
            dy = torch.ones((), device=dev)
            providers = {name: grad_provider(fn, "fwd+bwd", leaves, dy)
                         for name, fn in ((CULMEN, ours), (FUSED, fused), ("torch", eager))}
            peaks = {name: _peak_memory(p, dev) for name, p in providers.items()}
            if peaks[CULMEN] is not None:
                ours_gib = ", ".join(f"{n} {peaks[n]:.2f} GiB (torch/{n} {peaks['torch'] / max(peaks[n], 1e-9):.2f}x)"
                                     for n in (CULMEN, FUSED))
                notes.append(f"peak memory per fwd+bwd call ({layout} {_DT_NAME[dtype]}): torch ({peer_name}) "
                             f"{peaks['torch']:.2f} GiB, {ours_gib}")
            mm_rows = rows if layout == "packed" else B * T * U
            # culmen-fused recomputes the projection in the backward: 8 B*T*U*H*K flops, counted as 6 like the rest
            yield Case(f"B{B} T{T} U{U} H{H} K{K} {_DT_NAME[dtype]} {layout} fwd+bwd", providers,
                       flops=6 * mm_rows * H * K, notes=notes, informational=(FUSED,))
