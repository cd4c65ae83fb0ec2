"""flash_attn's ``flash_attn.layers.rotary``: rotary embedding functions and the ``RotaryEmbedding`` module.

Same names, arguments and defaults as flash_attn, on culmen's rotary kernel. The in-place functions
(``apply_rotary_emb_qkv_``, ``apply_rotary_emb_kv_``, ``inplace=True``) rotate views of their input
in place and let autograd route the gradient through those views; their backward writes a fresh
gradient (flash_attn rotates the incoming gradient in place). Q and K of a packed qkv are rotated by
one launch. cos/sin may have any float dtype
(flash_attn requires x's), and bad arguments raise ``ValueError`` / ``TypeError``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.rotary import rotary, rotary_emb_ref
from culmen.ops.rotary import rotate_half as _rotate_half

__all__ = [
    "ApplyRotaryEmb",
    "ApplyRotaryEmbKV_",
    "ApplyRotaryEmbQKV_",
    "RotaryEmbedding",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
    "apply_rotary_emb_torch",
    "rotate_half",
]


def rotate_half(x: Tensor, interleaved: bool = False) -> Tensor:
    """``(-x2, x1)`` of the halves of the last dim, or of each (even, odd) pair when ``interleaved``."""
    return _rotate_half(x, interleaved)


def apply_rotary_emb_torch(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Unfused PyTorch rotary (the reference): ``x`` ``(batch, seqlen, nheads, headdim)``, ``cos``/``sin``
    ``(seqlen, rotary_dim / 2)`` or ``(batch, seqlen, rotary_dim / 2)``; computes in x's dtype."""
    return rotary_emb_ref(x, cos, sin, interleaved)


def apply_rotary_emb(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: int | Tensor = 0,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
) -> Tensor:
    """Rotary embedding of the first ``rotary_dim = 2 * cos.shape[1]`` columns of ``x``; differentiable.

    Args:
        x: ``(batch_size, seqlen, nheads, headdim)``, or ``(total_seqlen, nheads, headdim)`` with ``cu_seqlens``.
        cos, sin: ``(seqlen_rotary, rotary_dim / 2)``, ``rotary_dim <= headdim``.
        interleaved: GPT-J pairs ``(2i, 2i+1)`` instead of GPT-NeoX halves.
        inplace: rotate ``x`` in place and return it.
        seqlen_offsets: int or ``(batch_size,)`` tensor: each sequence's positions are shifted by it
            (KV-cache decoding).
        cu_seqlens: ``(batch + 1,)`` int32 starts of the packed sequences; max_seqlen: their longest.

    Returns ``x``'s shape; columns past ``rotary_dim`` pass through.
    """
    return rotary(x, cos, sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                  interleaved=interleaved, inplace=inplace)


# For backward compatibility (flash_attn keeps the old name).
apply_rotary_emb_func = apply_rotary_emb


class _PackedInPlace(torch.autograd.Function):
    """flash_attn's autograd for an in-place rotation of part of a packed tensor that autograd cannot mark
    as modified (a leaf that requires grad, or a view of one): the part ``view(whole)`` is rotated in
    ``whole``'s memory and ``whole`` comes back carrying the gradient (the rotated part's gradient
    rotated back, the rest passed through). Elsewhere the parts are rotated with a true in-place op.

    The callers test for it inline (``whole.requires_grad`` with a leaf ``whole`` or base: a view that
    requires grad of a leaf means the leaf does), since a helper would be a Python call per rotation."""

    @staticmethod
    def forward(ctx, whole, view, kw):
        rotary(view(whole), **kw, inplace=True)
        ctx.view, ctx.kw = view, kw
        return whole

    @staticmethod
    def backward(ctx, dy):
        d = dy.clone(memory_format=torch.contiguous_format)
        rotary(ctx.view(d), **ctx.kw, conjugate=True, inplace=True)
        return d, None, None


def _q_and_k(qkv: Tensor) -> Tensor:
    return qkv.narrow(2, 0, 2)


def _k_of_kv(kv: Tensor) -> Tensor:
    return kv.select(2, 0)


class _Heads:
    """The first ``n`` heads of a ``(b, s, heads, d)`` tensor (a picklable view function)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, t: Tensor) -> Tensor:
        return t.narrow(2, 0, self.n)


def _whole(t: Tensor) -> Tensor:
    return t


def _qkv_parts(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q) -> tuple:
    """``(view, kw)``: the view of a packed ``qkv`` holding Q and K, and the ``rotary`` arguments rotating it
    (validated; see ``apply_rotary_emb_qkv_``)."""
    if not isinstance(qkv, Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if (cos_k is None) != (sin_k is None):
        raise ValueError("cos_k and sin_k must be given together")
    shape = qkv.shape
    if len(shape) == 5:
        if shape[2] != 3:
            raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got shape {tuple(shape)}")
        # Q and K as the two head groups of one (b, s, 2, h, d) view.
        return _q_and_k, dict(cos=cos, sin=sin, cos_k=cos_k, sin_k=sin_k, seqlen_offsets=seqlen_offsets,
                              interleaved=interleaved)
    if len(shape) != 4:
        raise ValueError(f"qkv must be 5-D (b, s, 3, h, d) or 4-D (b, s, hq + 2 hk, d), got shape {tuple(shape)}")
    if num_heads_q is None:
        raise ValueError("qkv of shape (batch, seqlen, nheads_q + 2 * nheads_k, headdim) needs num_heads_q")
    nq = int(num_heads_q)
    nk = (shape[2] - nq) // 2
    if nq <= 0 or nk < 0 or shape[2] != nq + 2 * nk:
        raise ValueError(f"qkv.shape[2] = {shape[2]} must equal num_heads_q + 2 * num_heads_k with "
                         f"num_heads_q = {num_heads_q}")
    # Q and K heads are adjacent: one (b, s, hq + hk, d) view; K's own tables start at head nq.
    split = nq if (cos_k is not None and nk) else None
    return _Heads(nq + nk), dict(cos=cos, sin=sin, cos_k=cos_k, sin_k=sin_k, nheads_q=split,
                                 seqlen_offsets=seqlen_offsets, interleaved=interleaved)


def _kv_kw(kv, cos, sin, interleaved, seqlen_offsets) -> dict:
    if not isinstance(kv, Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen, 2, nheads, headdim), got "
                         f"{tuple(kv.shape) if isinstance(kv, Tensor) else type(kv).__name__}")
    return dict(cos=cos, sin=sin, seqlen_offsets=seqlen_offsets, interleaved=interleaved)


def apply_rotary_emb_qkv_(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    cos_k: Tensor | None = None,
    sin_k: Tensor | None = None,
    interleaved: bool = False,
    seqlen_offsets: int | Tensor = 0,
    num_heads_q: int | None = None,
) -> Tensor:
    """Rotary embedding of Q and K *in place* in a packed ``qkv``; returns ``qkv``.

    Args:
        qkv: ``(batch, seqlen, 3, nheads, headdim)``, or ``(batch, seqlen, num_heads_q + 2 * num_heads_k,
            headdim)`` (MQA / GQA), which needs ``num_heads_q``.
        cos, sin: ``(seqlen, rotary_dim / 2)`` for Q (and K); cos_k, sin_k: separate tables for K (XPos).
        interleaved, seqlen_offsets: as in ``apply_rotary_emb``.

    Q and K are rotated by one kernel launch (one autograd node), whatever qkv's strides, also with
    separate K tables.
    """
    if type(qkv) is Tensor and qkv.dim() == 5 and qkv.shape[2] == 3 and (cos_k is None) == (sin_k is None):
        # the common layout without a helper call (the cached path's host budget, tests/host)
        view, kw = _q_and_k, dict(cos=cos, sin=sin, cos_k=cos_k, sin_k=sin_k, seqlen_offsets=seqlen_offsets,
                                  interleaved=interleaved)
    else:
        view, kw = _qkv_parts(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)
    if qkv.requires_grad and (qkv._base if qkv._base is not None else qkv).is_leaf and torch.is_grad_enabled():
        return _PackedInPlace.apply(qkv, view, kw)
    rotary(view(qkv), **kw, inplace=True)
    return qkv


def apply_rotary_emb_kv_(
    kv: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    seqlen_offsets: int | Tensor = 0,
) -> Tensor:
    """Rotary embedding of K *in place* in a packed ``kv`` ``(batch, seqlen, 2, nheads, headdim)``;
    returns ``kv``. cos, sin: ``(seqlen, rotary_dim / 2)``."""
    kw = _kv_kw(kv, cos, sin, interleaved, seqlen_offsets)
    if kv.requires_grad and (kv._base if kv._base is not None else kv).is_leaf and torch.is_grad_enabled():
        return _PackedInPlace.apply(kv, _k_of_kv, kw)
    rotary(kv.select(2, 0), **kw, inplace=True)
    return kv


class ApplyRotaryEmb(torch.autograd.Function):
    """flash_attn's autograd function behind ``apply_rotary_emb``: ``ApplyRotaryEmb.apply(x, cos, sin,
    interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None)`` (arguments as
    ``apply_rotary_emb``'s). With ``inplace`` it rotates ``x``'s memory and returns it without marking it
    dirty, as flash_attn does (so a leaf that requires grad may be rotated); the backward rotates a copy
    of the incoming gradient back."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                max_seqlen=None):
        kw = dict(cos=cos, sin=sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                  interleaved=interleaved)
        if inplace:
            return _PackedInPlace.forward(ctx, x, _whole, kw)
        ctx.view, ctx.kw = _whole, kw
        return rotary(x, **kw)

    @staticmethod
    def backward(ctx, do):
        return _PackedInPlace.backward(ctx, do)[0], None, None, None, None, None, None, None


class ApplyRotaryEmbQKV_(torch.autograd.Function):
    """flash_attn's autograd function behind ``apply_rotary_emb_qkv_``: ``ApplyRotaryEmbQKV_.apply(qkv, cos,
    sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0, num_heads_q=None)``; Q and K rotated in
    ``qkv``'s memory, which is returned (not marked dirty, as flash_attn)."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0, num_heads_q=None):
        view, kw = _qkv_parts(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)
        return _PackedInPlace.forward(ctx, qkv, view, kw)

    @staticmethod
    def backward(ctx, dqkv):
        return _PackedInPlace.backward(ctx, dqkv)[0], None, None, None, None, None, None, None


class ApplyRotaryEmbKV_(torch.autograd.Function):
    """flash_attn's autograd function behind ``apply_rotary_emb_kv_``: ``ApplyRotaryEmbKV_.apply(kv, cos, sin,
    interleaved=False, seqlen_offsets=0)``; K rotated in ``kv``'s memory, which is returned."""

    @staticmethod
    def forward(ctx, kv, cos, sin, interleaved=False, seqlen_offsets=0):
        return _PackedInPlace.forward(ctx, kv, _k_of_kv, _kv_kw(kv, cos, sin, interleaved, seqlen_offsets))

    @staticmethod
    def backward(ctx, dkv):
        return _PackedInPlace.backward(ctx, dkv)[0], None, None, None, None


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embeddings (RoFormer, Su et al.) with a cos/sin cache; XPos when ``scale_base``.

    Args:
        dim: rotary dim (``<= headdim``; the rest of each head passes through).
        base: frequency base: ``inv_freq = base ** (-arange(0, dim, 2) / dim)``.
        interleaved: GPT-J pairs instead of GPT-NeoX halves.
        scale_base: XPos (Sun et al.): Q is scaled by ``scale ** ((pos - seqlen // 2) / scale_base)`` and
            K by its inverse, ``scale = (arange(0, dim, 2) + 0.4 dim) / 1.4 dim``. ``None``: plain RoPE.
        device: where the buffers live (flash_attn's fifth positional argument).
        pos_idx_in_fp32: keyword only (culmen's): build positions (and ``inv_freq``) in fp32 even when the
            module was cast to a lower precision, so large positions stay exact.
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base: float | None = None,
                 device: torch.device | str | None = None, *, pos_idx_in_fp32: bool = True) -> None:
        super().__init__()
        if int(dim) <= 0 or int(dim) % 2:
            raise ValueError(f"dim must be a positive even number, got {dim}")
        self.dim = int(dim)
        self.base = float(base)
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.interleaved = interleaved
        self.scale_base = scale_base
        scale = self._compute_scale(device) if scale_base is not None else None
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached: Tensor | None = None
        self._sin_cached: Tensor | None = None
        self._cos_k_cached: Tensor | None = None
        self._sin_k_cached: Tensor | None = None

    def _compute_inv_freq(self, device=None) -> Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _compute_scale(self, device=None) -> Tensor:
        return (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        # Rebuild when longer positions are needed, on a new device or dtype, or when switching from
        # inference mode to training (inference tensors cannot be saved for backward).
        if (seqlen > self._seq_len_cached or self._cos_cached is None or self._cos_cached.device != device
                or self._cos_cached.dtype != dtype or (self.training and self._cos_cached.is_inference())):
            self._seq_len_cached = seqlen
            if self.pos_idx_in_fp32:
                # fp32 positions and frequencies: in bf16, positions past 256 would not be exact.
                t = torch.arange(seqlen, device=device, dtype=torch.float32)
                inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
            else:
                t = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
                inv_freq = self.inv_freq
            freqs = torch.outer(t, inv_freq.to(t.device))  # not einsum: autocast would make it bf16
            if self.scale is None:
                self._cos_cached = torch.cos(freqs).to(dtype)
                self._sin_cached = torch.sin(freqs).to(dtype)
            else:
                scale = self.scale if self.scale.dtype == torch.float32 else self._compute_scale(self.scale.device)
                power = (torch.arange(seqlen, dtype=torch.float32, device=scale.device) - seqlen // 2) / self.scale_base
                xscale = scale.to(power.device) ** power[:, None]
                # The scaling runs in fp32, then the tables take the activations' dtype.
                self._cos_cached = (torch.cos(freqs) * xscale).to(dtype)
                self._sin_cached = (torch.sin(freqs) * xscale).to(dtype)
                self._cos_k_cached = (torch.cos(freqs) / xscale).to(dtype)
                self._sin_k_cached = (torch.sin(freqs) / xscale).to(dtype)

    def forward(self, qkv: Tensor, kv: Tensor | None = None, seqlen_offset: int | Tensor = 0,
                max_seqlen: int | None = None, num_heads_q: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Rotate Q and K *in place*.

        Args:
            qkv: ``(batch, seqlen, 3, nheads, headdim)`` or ``(batch, seqlen, num_heads_q + 2 *
                num_heads_k, headdim)`` when ``kv`` is None; else Q ``(batch, seqlen, nheads, headdim)``.
            kv: ``(batch, seqlen, 2, nheads, headdim)`` or None.
            seqlen_offset: int or ``(batch,)`` tensor shifting positions (KV-cache decoding). With a
                tensor pass ``max_seqlen`` so the cache covers every position.
            num_heads_q: Q heads of a GQA-packed ``qkv``.

        Returns ``qkv``, or ``(q, kv)`` when ``kv`` is given.
        """
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        elif self._cos_cached is None:
            raise ValueError("a tensor seqlen_offset needs max_seqlen the first time (to size the cos/sin cache)")
        xpos = self.scale_base is not None  # (a plain attribute: the buffer lookup costs more)
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached,
                                         self._cos_k_cached if xpos else None, self._sin_k_cached if xpos else None,
                                         interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                                         num_heads_q=num_heads_q)
        q = apply_rotary_emb_func(qkv, self._cos_cached, self._sin_cached, interleaved=self.interleaved,
                                  inplace=True, seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, self._cos_k_cached if xpos else self._cos_cached,
                                  self._sin_k_cached if xpos else self._sin_cached, interleaved=self.interleaved,
                                  seqlen_offsets=seqlen_offset)
        return q, kv
