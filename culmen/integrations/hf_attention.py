"""culmen's attention as a Hugging Face ``transformers`` attention implementation (``"culmen"``).

``register()`` adds two entries under the name ``"culmen"``:

* ``transformers.AttentionInterface`` -> :func:`culmen_attention_forward`, the function every
  ``transformers`` 5 attention module calls with ``(module, query, key, value, attention_mask, dropout=,
  scaling=, sliding_window=, softcap=, is_causal=, **kwargs)``;
* ``transformers.masking_utils.AttentionMaskInterface`` -> :func:`culmen_attention_mask`, which decides
  what ``attention_mask`` the model hands to that function. Without a mask entry ``transformers`` builds
  no mask at all for a custom implementation (padding would be ignored), so both are needed.

Then ``AutoModelForCausalLM.from_pretrained(..., attn_implementation="culmen")`` (or ``from_config``, or
``model.set_attn_implementation("culmen")``) runs culmen's FlashAttention kernels
(``culmen.flash_attn.flash_attn_interface``): Triton on GPUs, the PyTorch reference on CPU.

What the mask function produces, and what the attention function then runs:

* the plain causal or sliding-window causal pattern without padding -> ``None`` ->
  ``flash_attn_func`` (bottom-right causal, so a query block after a ``DynamicCache`` prefix is aligned
  to the last keys; ``sliding_window`` from the module becomes ``window_size=(sliding_window - 1, 0)``;
  ``softcap`` and ``scaling`` are passed on; GQA keys/values go in with their own head count, no
  ``repeat_kv`` copy);
* the same patterns with padding, or with a ``StaticCache`` (whose unfilled tail must not be attended)
  -> a 2-D bool ``(batch, kv_length)`` mask of the keys that may be attended, aligned with the keys the
  cache returns:

  - ``q_len == kv_len`` (training, a prefill without cache): the valid tokens are packed with
    ``culmen.flash_attn.bert_padding`` and ``flash_attn_varlen_func`` runs (differentiable; left, right
    or any padding; the unpacking indices are computed once per mask, not per layer);
  - ``q_len < kv_len`` without autograd (``generate``: decoding, prefill into a ``StaticCache``):
    ``flash_attn_with_kvcache`` with per-row ``cache_leftpad`` / ``cache_seqlens`` taken from the mask
    (no host sync). The queries are taken to be the last tokens before the first unfilled key, which
    is how ``transformers``' caches lay them out. Each row's valid keys are taken to be one contiguous
    run (left padding), as ``generate`` produces;
  - ``q_len < kv_len`` with autograd, and every 2-D mask under ``torch.compile`` (unpadding has
    data-dependent sizes; culmen's KV-cache op has no traced form yet, and ``transformers`` compiles
    ``StaticCache`` decoding on GPUs): SDPA with the equivalent dense mask (below);

* anything else (a 4-D mask the caller built, packed sequences found from ``position_ids``, chunked or
  bidirectional patterns, image-token overlays, sliding windows under ``torch.compile`` (the pattern is
  recognised by reading the mask function's closure, which Dynamo cannot do), a mask function this
  module does not recognise) -> the 4-D bool mask ``transformers`` builds for SDPA ->
  :func:`torch.nn.functional.scaled_dot_product_attention` with that mask (or, with ``softcap``, the
  same math written out in PyTorch). Rows that see no key get a uniform mask instead of NaNs. These
  cases are correct but do not use culmen's kernels.

Padded query rows (padding tokens themselves) output 0 on the culmen paths; their values differ from
SDPA's but nothing downstream reads them (no valid query attends a padding key).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.flash_attn.bert_padding import index_first_axis, pad_input
from culmen.flash_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["ATTN_IMPLEMENTATION", "culmen_attention_forward", "culmen_attention_mask", "is_registered", "register"]

ATTN_IMPLEMENTATION = "culmen"
"""The ``attn_implementation`` name culmen registers."""

# Derived per-mask data (unpacking indices, key ranges) reused by every layer of one forward: the model
# passes the very same mask object to each layer. A few entries: Gemma-style models alternate two masks.
_MASK_CACHE: list[tuple[Tensor, str, tuple]] = []
_MASK_CACHE_SIZE = 4


def _derived(mask: Tensor, what: str, make) -> tuple:
    if torch.compiler.is_compiling():
        return make(mask)
    for m, w, data in _MASK_CACHE:
        if m is mask and w == what:
            return data
    data = make(mask)
    _MASK_CACHE.append((mask, what, data))
    if len(_MASK_CACHE) > _MASK_CACHE_SIZE:
        del _MASK_CACHE[0]
    return data


def _unpad_meta(mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """``(indices (total,) int64 into batch * seqlen, cu_seqlens (B + 1,) int32, max_seqlen)`` of a 2-D
    bool mask. ``max_seqlen`` is the padded length, a bound the kernels accept: reading the true maximum
    would cost a host sync (a padded batch's longest row is usually that long anyway)."""
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu, mask.shape[-1]


def _key_range(mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(start, end)`` int32 ``(B,)``: each row's first valid key and one past its last (no host sync)."""
    m = mask.to(torch.int8)
    start = m.argmax(dim=-1).to(torch.int32)
    end = (mask.shape[-1] - m.flip(-1).argmax(dim=-1)).to(torch.int32)
    return start, end


def _window(sliding_window: int | None, causal: bool) -> tuple[int, int]:
    # transformers' sliding pattern keeps keys with ``kv_idx > q_idx - sliding_window``: the query and the
    # sliding_window - 1 keys before it (bidirectional sliding masks keep |q - kv| <= sliding_window).
    if sliding_window is None or sliding_window <= 0:
        return (-1, -1)
    return (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)


def _fallback(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, dropout: float,
              scaling: float | None, softcap: float, causal: bool) -> Tensor:
    """Attention of HF-layout ``query (B, h, sq, d)``, ``key``/``value`` ``(B, hk, sk, d)`` with a mask
    broadcastable to ``(B, h, sq, sk)`` (bool: True = attend, or additive float), in PyTorch. Returns
    ``(B, sq, h, d)``."""
    h, hk = query.shape[1], key.shape[1]
    if mask is not None and mask.dtype == torch.bool:
        # A row that sees no key would give NaN, which a later layer's masked product would spread.
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    if not softcap:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                             is_causal=causal and mask is None, scale=scaling,
                                             enable_gqa=h != hk)
        return out.transpose(1, 2)
    if h != hk:
        key = key.repeat_interleave(h // hk, dim=1)
        value = value.repeat_interleave(h // hk, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    s = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    s = softcap * torch.tanh(s / softcap)
    if mask is None and causal:
        sq, sk = s.shape[-2], s.shape[-1]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(sk - sq)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    p = torch.softmax(s, dim=-1).to(value.dtype)
    if dropout:
        p = F.dropout(p, p=dropout)
    return torch.matmul(p, value).transpose(1, 2)


def _dense_mask(keymask: Tensor, sq: int, window: tuple[int, int], causal: bool) -> Tensor:
    """The ``(B, 1, sq, sk)`` bool mask a 2-D key mask stands for: queries are the ``sq`` positions ending at
    each row's last valid key, bottom-right causal and windowed as the kernels would run."""
    sk = keymask.shape[-1]
    _, end = _key_range(keymask)
    qpos = end[:, None].long() - sq + torch.arange(sq, device=keymask.device)[None, :]  # (B, sq)
    kpos = torch.arange(sk, device=keymask.device)
    keep = keymask[:, None, :].expand(-1, sq, -1)
    if causal:
        keep = keep & (kpos[None, None, :] <= qpos[:, :, None])
    if window[0] >= 0:
        keep = keep & (kpos[None, None, :] >= qpos[:, :, None] - window[0])
    if window[1] >= 0 and not causal:
        keep = keep & (kpos[None, None, :] <= qpos[:, :, None] + window[1])
    return keep[:, None]


def culmen_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The ``transformers`` attention function of ``attn_implementation="culmen"``.

    Args:
        module: the calling attention module (its ``is_causal`` is used unless ``is_causal`` is given).
        query: ``(B, h, sq, d)``; key, value: ``(B, hk, sk, d)`` with ``h % hk == 0`` (any strides with a
            contiguous last dim); fp16/bf16/fp32.
        attention_mask: what :func:`culmen_attention_mask` produced (``None``, a 2-D bool key mask
            ``(B, sk)``), or a 4-D mask ``(B, 1 or h, sq, sk)`` (bool or additive float) for the SDPA path.
        dropout: attention dropout probability (the module passes 0 in eval mode).
        scaling: softmax scale (default ``d ** -0.5``).
        sliding_window: keys within ``sliding_window - 1`` positions before the query (and itself).
        softcap: ``softcap * tanh(scores / softcap)`` before the softmax (Gemma 2).
        kwargs: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` (packed
            sequences in a batch of one, as ``transformers``' flattening collator passes them) run the
            varlen kernel directly; the rest is ignored.

    Returns ``(attn_output (B, sq, h, d) in query's dtype, None)``; attention weights are never formed.
    """
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    cap = float(softcap) if softcap else 0.0
    window = _window(sliding_window, causal)
    if key.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    B, h, sq, d = query.shape
    sk = key.shape[2]
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)

    if attention_mask is None:
        cu_q = kwargs.get("cu_seq_lens_q")
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_q is not None and cu_k is not None and B == 1:
            out = flash_attn_varlen_func(q[0], k[0], v[0], cu_q.to(torch.int32), cu_k.to(torch.int32),
                                         int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), dropout,
                                         scaling, causal, window, cap)
            return out.unsqueeze(0), None
        return flash_attn_func(q, k, v, dropout, scaling, causal and sq > 1, window, cap), None

    if attention_mask.dim() == 2 and attention_mask.dtype == torch.bool and attention_mask.shape[-1] == sk:
        if torch.compiler.is_compiling():
            # Unpadding has data-dependent sizes and culmen's KV-cache op has no traced form yet: compiled
            # graphs (transformers compiles StaticCache decoding on GPUs) take the dense-mask path.
            dense = _dense_mask(attention_mask, sq, window, causal)
            return _fallback(query, key, value, dense, dropout, scaling, cap, False).contiguous(), None
        if sq == sk:
            indices, cu, max_s = _derived(attention_mask, "unpad", _unpad_meta)
            qu = index_first_axis(q.reshape(B * sq, h, d), indices)
            ku = index_first_axis(k.reshape(B * sk, k.shape[2], d), indices)
            vu = index_first_axis(v.reshape(B * sk, v.shape[2], v.shape[3]), indices)
            out = flash_attn_varlen_func(qu, ku, vu, cu, cu, max_s, max_s, dropout, scaling, causal, window, cap)
            return pad_input(out, indices, B, sq), None
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        if not grad and not dropout:
            start, end = _derived(attention_mask, "range", _key_range)
            out = flash_attn_with_kvcache(q, k, v, cache_seqlens=end, cache_leftpad=start, softmax_scale=scaling,
                                          causal=causal, window_size=window, softcap=cap)
            return out, None
        attention_mask = _dense_mask(attention_mask, sq, window, causal)
        return _fallback(query, key, value, attention_mask, dropout, scaling, cap, False).contiguous(), None

    if attention_mask.dim() == 2:  # a 2-D mask of some other form: transformers' (B, L) padding convention
        raise ValueError(f"attention_mask: a 2-D mask must be bool (batch, kv_length={sk}), got "
                         f"{attention_mask.dtype} {tuple(attention_mask.shape)}")
    # An explicit 4-D mask encodes the whole pattern (causality and window included).
    return _fallback(query, key, value, attention_mask, dropout, scaling, cap, False).contiguous(), None


def _classify(mask_function) -> str | None:
    """``"causal"`` for transformers' plain causal pattern or its sliding-window form, else ``None``
    (the pattern is left to a dense mask)."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is causal_mask_function:
        return "causal"
    if torch.compiler.is_compiling():
        return None  # Dynamo cannot read closures: compiled sliding-window layers take the dense-mask path
    code = getattr(mask_function, "__code__", None)
    closure = getattr(mask_function, "__closure__", None)
    if code is None or code.co_name != "and_mask" or not closure:
        return None
    cells = dict(zip(code.co_freevars, closure))
    parts = cells["mask_functions"].cell_contents if "mask_functions" in cells else None
    if (isinstance(parts, tuple) and len(parts) == 2 and parts[1] is causal_mask_function
            and getattr(parts[0], "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask"):
        return "causal"  # the window itself reaches the attention function as ``sliding_window``
    return None


def culmen_attention_mask(
    batch_size: int,
    q_length: int | None = None,
    kv_length: int | None = None,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Tensor | None = None,
    cache_position: Tensor | None = None,
    **kwargs,
) -> Tensor | None:
    """The ``transformers`` mask function of ``attn_implementation="culmen"`` (called once per forward and
    mask type by ``create_causal_mask`` and friends, with their keyword arguments).

    Args:
        batch_size, kv_length, kv_offset, mask_function, attention_mask: as transformers passes them
            (``attention_mask``: the 2-D ``(batch, seen + q_length)`` padding mask, or None).
        q_length, q_offset: the queries' count and first position (``q_offset`` is a tensor for a
            ``StaticCache``). Before transformers 5.4 ``cache_position`` (the queries' positions, a 1-D
            tensor) is passed instead, and is accepted too.
        kwargs: the rest of transformers' arguments (``device``, ``allow_is_causal_skip``, ``local_size`` ...).

    Returns ``None`` (plain causal / sliding causal, no padding, keys ending at the last query), a 2-D
    bool ``(batch_size, kv_length)`` mask of the attendable keys (padding, a ``StaticCache``'s unfilled
    tail), or, for patterns culmen's kernels cannot express, transformers' 4-D bool SDPA mask
    ``(batch_size, 1, q_length, kv_length)``.
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if mask_function is None:
        mask_function = causal_mask_function
    if _classify(mask_function) is None:
        kwargs.pop("allow_is_causal_skip", None)
        kwargs.pop("allow_is_bidirectional_skip", None)
        where = (dict(cache_position=cache_position) if cache_position is not None
                 else dict(q_length=q_length, q_offset=q_offset))
        return sdpa_mask(batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset, mask_function=mask_function,
                         attention_mask=attention_mask, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                         **where, **kwargs)
    if cache_position is not None:
        # Older transformers: the query positions as a tensor. Keys past the last query are never attended.
        q_length = cache_position.shape[0]
        q_end = cache_position[-1] + 1
        tail = kv_offset + kv_length != q_length  # more keys than queries: maybe unfilled slots (no host sync)
        device = cache_position.device
    else:
        q_end = q_offset + q_length
        # A StaticCache's ``q_offset`` is a tensor (its layers advance it in place later on).
        tail = isinstance(q_offset, Tensor) or kv_offset + kv_length != q_end
        device = kwargs.get("device", attention_mask.device if attention_mask is not None else "cpu")
    if attention_mask is None and not tail:
        return None
    kpos = torch.arange(kv_length, device=device) + kv_offset
    if attention_mask is not None:
        pm = attention_mask.to(device=device, dtype=torch.bool)
        short = kv_offset + kv_length - pm.shape[-1]
        if short > 0:  # keys past the 2-D mask (a static cache's unfilled slots) are not attended
            pm = F.pad(pm, (0, short), value=False)
        keys = pm[:, kv_offset:kv_offset + kv_length]
    else:
        keys = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    if tail:
        keys = keys & (kpos < q_end)[None, :]  # computed now, before the cache advances
    if not tail and not _tracing(keys) and bool(keys.all()):
        return None
    return keys


def _tracing(t: Tensor) -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def is_registered() -> bool:
    """Whether ``"culmen"`` is in transformers' attention and mask interfaces (pointing at culmen)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return (AttentionInterface._global_mapping.get(ATTN_IMPLEMENTATION) is culmen_attention_forward
            and AttentionMaskInterface._global_mapping.get(ATTN_IMPLEMENTATION) is culmen_attention_mask)


def register() -> str:
    """Register ``"culmen"`` with ``transformers.AttentionInterface`` and ``AttentionMaskInterface``
    (idempotent). Returns the name to pass as ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not is_registered():
        AttentionInterface.register(ATTN_IMPLEMENTATION, culmen_attention_forward)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, culmen_attention_mask)
    return ATTN_IMPLEMENTATION
