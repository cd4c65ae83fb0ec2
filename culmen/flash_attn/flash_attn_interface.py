"""flash_attn 2.8's training interface on culmen's attention ops (``culmen.ops.attention``).

Same names, argument order, defaults and returns as ``flash_attn.flash_attn_interface``: each
function returns ``out`` or, with ``return_attn_probs=True``, ``(out, softmax_lse, S_dmask)``.
Differences from flash_attn (all supersets): fp32 (and fp64) inputs are accepted; head dims up to
512 with no padding requirement; ``softcap`` can be combined with dropout; ``S_dmask`` holds the
normalized probabilities (dropped entries negated) whenever ``return_attn_probs`` is set, also
without dropout (flash_attn returns an empty tensor then).

``window_size`` may be any two-element sequence of integers, as flash_attn indexes it: a tuple, a list,
a 1-D integer tensor or numpy array, or a sequence of int-like scalars (numpy integers, 0-d integer
tensors); it is normalized to a tuple of two Python ints here, before the cached call plans see it.

The internals other libraries import (ring / context-parallel attention, flash_attn's test utilities)
are here too, with flash_attn 2.8's signatures: ``_flash_attn_forward`` / ``_flash_attn_backward`` and
their varlen forms (``torch.library`` custom ops ``culmen::fa_*`` underneath, reachable as
``_wrapped_flash_attn_*``, so ``torch.compile`` sees them as opaque ops with fake implementations), the
autograd classes ``FlashAttn*Func`` (``apply`` takes flash_attn's positional arguments), the extension
object ``flash_attn_gpu`` (``culmen.flash_attn.flash_attn_2_cuda``) and ``USE_TRITON_ROCM``. The public
functions above do not go through those classes: they call culmen's cached attention plans directly
(a few microseconds of host time less per call); the numbers are the same.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor

from culmen.flash_attn import flash_attn_2_cuda as flash_attn_gpu
from culmen.flash_attn.flash_attn_2_cuda import gather_keys
from culmen.ops.attention.kvcache import attention_kvcache
from culmen.ops.attention.op import attention, attention_varlen
from culmen.ops.attention.reference import round_multiple  # flash_attn_interface.round_multiple, imported by others

__all__ = [
    "FlashAttnFunc",
    "FlashAttnKVPackedFunc",
    "FlashAttnQKVPackedFunc",
    "FlashAttnVarlenFunc",
    "FlashAttnVarlenKVPackedFunc",
    "FlashAttnVarlenQKVPackedFunc",
    "USE_TRITON_ROCM",
    "flash_attn_func",
    "flash_attn_gpu",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

USE_TRITON_ROCM = False
"""flash_attn sets this when it runs AMD's Triton backend (``FLASH_ATTENTION_TRITON_AMD_ENABLE``), whose
feature set is smaller. culmen's Triton kernels implement every feature on every GPU, so code that
branches on it takes flash_attn's full-feature path."""


def _window_pair(window_size) -> tuple[int, int]:
    """``window_size`` as ``(left, right)`` Python ints, from any two-element sequence flash_attn accepts:
    a tuple or list, a 1-D integer tensor or numpy array, or a sequence of int-like scalars (numpy
    integers, 0-d integer tensors; anything with ``__index__``). Raises ``ValueError`` naming
    ``window_size`` and the value for another length, a float or bool entry, or a non-sequence."""
    w = window_size
    if hasattr(w, "ndim") and hasattr(w, "tolist"):  # torch.Tensor, numpy.ndarray (or numpy scalar)
        if w.ndim != 1:
            raise ValueError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
        w = w.tolist()  # Python ints for integer dtypes; floats / bools are refused below
    if isinstance(w, (str, bytes)) or not (hasattr(w, "__len__") and hasattr(w, "__getitem__")) or len(w) != 2:
        raise ValueError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    pair = []
    for x in (w[0], w[1]):
        if isinstance(x, bool) or (isinstance(x, Tensor) and x.dtype == torch.bool):
            raise ValueError(f"window_size entries must be integers, got {window_size!r}")
        try:
            pair.append(operator.index(x))
        except TypeError:
            raise ValueError(f"window_size entries must be integers, got {window_size!r}") from None
    return pair[0], pair[1]


def _check_packed(name: str, t, rank: int, n: int, dim: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank or t.shape[dim] != n:
        raise ValueError(f"{name} must be {rank}-D with size {n} at dim {dim}, got shape {tuple(t.shape)}")


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | Sequence[int] | Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Attention on packed ``qkv`` ``(batch, seqlen, 3, nheads, headdim)``.

    Args:
        dropout_p: drop probability in ``[0, 1)`` (0 for evaluation).
        softmax_scale: default ``headdim ** -0.5``.
        causal: bottom-right aligned causal mask.
        window_size: ``(left, right)``, -1 = unbounded (bottom-right aligned); any two-element sequence of
            ints (tuple, list, 1-D integer tensor or numpy array, numpy integers).
        softcap: ``> 0`` caps scores with ``softcap * tanh(s / softcap)``.
        alibi_slopes: fp32 ``(nheads,)`` or ``(batch, nheads)``; adds ``-slope * |i + sk - sq - j|``.
        deterministic: bitwise reproducible backward.
        return_attn_probs: also return ``softmax_lse`` ``(batch, nheads, seqlen)`` fp32 and ``S_dmask``.

    Returns:
        ``out`` ``(batch, seqlen, nheads, headdim)`` in qkv's dtype (or the tuple).
    """
    # A plain tuple of two ints passes with no call (the cached path stays as it is; ``type`` and slices
    # are not calls a profiler sees, and torch.compile traces them); any other form is normalized.
    if not (type(window_size) is tuple and window_size[1:2] and not window_size[2:]
            and type(window_size[0]) is int and type(window_size[1]) is int):
        window_size = _window_pair(window_size)
    _check_packed("qkv", qkv, 5, 3, 2)
    q, k, v = qkv.unbind(dim=2)
    return attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                     return_attn_probs, return_attn_probs)


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | Sequence[int] | Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Attention with ``q`` ``(batch, seqlen_q, nheads, headdim)`` and packed ``kv``
    ``(batch, seqlen_k, 2, nheads_k, headdim)``; MQA/GQA when ``nheads_k < nheads``. Other
    arguments and the return as ``flash_attn_qkvpacked_func``."""
    if not (type(window_size) is tuple and window_size[1:2] and not window_size[2:]  # see flash_attn_qkvpacked_func
            and type(window_size[0]) is int and type(window_size[1]) is int):
        window_size = _window_pair(window_size)
    _check_packed("kv", kv, 5, 2, 2)
    k, v = kv.unbind(dim=2)
    return attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                     return_attn_probs, return_attn_probs)


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | Sequence[int] | Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Attention with ``q`` ``(batch, seqlen_q, nheads, headdim)`` and ``k``/``v``
    ``(batch, seqlen_k, nheads_k, headdim)``, ``nheads % nheads_k == 0``; fp16/bf16/fp32.

    Returns ``out`` ``(batch, seqlen_q, nheads, headdim)``, or with ``return_attn_probs``
    ``(out, softmax_lse (batch, nheads, seqlen_q) fp32, S_dmask (batch, nheads, seqlen_q_rounded,
    seqlen_k_rounded))``. Rows that see no key output 0 and have ``softmax_lse = +inf``. Other
    arguments as ``flash_attn_qkvpacked_func``.

    A call with the signature (shapes, strides, dtypes, options) of an earlier one reuses its cached
    plan: the checks and launch geometry are not redone.
    """
    if not (type(window_size) is tuple and window_size[1:2] and not window_size[2:]  # see flash_attn_qkvpacked_func
            and type(window_size[0]) is int and type(window_size[1]) is int):
        window_size = _window_pair(window_size)
    return attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                     return_attn_probs, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | Sequence[int] | Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Varlen attention on packed ``qkv`` ``(total, 3, nheads, headdim)`` with int32 ``cu_seqlens``
    ``(batch + 1,)`` and ``max_seqlen``. Returns ``out`` ``(total, nheads, headdim)`` or
    ``(out, softmax_lse (nheads, total) fp32, S_dmask)``."""
    if not (type(window_size) is tuple and window_size[1:2] and not window_size[2:]  # see flash_attn_qkvpacked_func
            and type(window_size[0]) is int and type(window_size[1]) is int):
        window_size = _window_pair(window_size)
    _check_packed("qkv", qkv, 4, 3, 1)
    q, k, v = qkv.unbind(dim=1)
    return attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | Sequence[int] | Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Varlen attention with ``q`` ``(total_q, nheads, headdim)`` and packed ``kv``
    ``(total_k, 2, nheads_k, headdim)``; see ``flash_attn_varlen_func``."""
    if not (type(window_size) is tuple and window_size[1:2] and not window_size[2:]  # see flash_attn_qkvpacked_func
            and type(window_size[0]) is int and type(window_size[1]) is int):
        window_size = _window_pair(window_size)
    _check_packed("kv", kv, 4, 2, 1)
    k, v = kv.unbind(dim=1)
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                            causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                            return_attn_probs)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | Sequence[int] | Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
):
    """Varlen attention on packed ``q`` ``(total_q, nheads, headdim)`` and ``k``/``v``
    ``(total_k, nheads_k, headdim)``; sequence ``b`` spans ``cu_seqlens[b]:cu_seqlens[b + 1]``
    (int32 ``(batch + 1,)``). Returns ``out`` ``(total_q, nheads, headdim)`` or ``(out,
    softmax_lse (nheads, total_q) fp32, S_dmask (batch, nheads, max_seqlen_q_rounded,
    max_seqlen_k_rounded))``. ``block_table`` ``(batch, max_blocks)`` int32 makes ``k``/``v`` a paged
    cache ``(num_blocks, page_block_size, nheads_k, headdim)``: sequence ``b``'s keys are its pages in
    order (gathered into packed form first; meant for inference, as in flash_attn).
    """
    if not (type(window_size) is tuple and window_size[1:2] and not window_size[2:]  # see flash_attn_qkvpacked_func
            and type(window_size[0]) is int and type(window_size[1]) is int):
        window_size = _window_pair(window_size)
    if block_table is not None:
        k, v = _unpage(k, v, cu_seqlens_k, block_table)
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                            causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                            return_attn_probs)


def _unpage(k: Tensor, v: Tensor, cu_seqlens_k: Tensor, block_table: Tensor) -> tuple[Tensor, Tensor]:
    """Packed ``(total_k, hk, d)`` keys/values of the sequences whose pages ``block_table`` lists (page
    numbers are checked on CPU tensors, and on GPUs under ``set_check_values(True)``; unchecked bad ones
    are clamped into the pages: wrong numbers, never an access outside ``k``/``v``)."""
    k, v, _ = gather_keys(k, v, cu_seqlens_k, block_table)
    return k, v


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key-block granularity of ``S_dmask``'s padding. flash_attn's tests use it to undo its CUDA
    kernels' tile layout; culmen's ``S_dmask`` is in plain row-major order, padded to 128, so this is 128."""
    return 128


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | Sequence[int] | Tensor = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Decoding attention over a KV cache (no backward), flash_attn's signature.

    ``q (B, sq, h, d)``; ``k_cache``/``v_cache`` ``(B_cache, seqlen_cache, hk, d)`` or, with
    ``block_table (B, max_blocks)`` int32, pages ``(num_blocks, page_block_size, hk, d)``. New tokens
    ``k``/``v`` ``(B, s_new, hk, d)`` are written into the caches **in place** at ``cache_seqlens`` (int
    or int32 ``(B,)``; default: the caches are full). ``rotary_cos``/``rotary_sin`` ``(seqlen_ro,
    rotary_dim / 2)`` rotate the new K at ``cache_seqlens + t`` and Q at the same positions when causal
    or local, else at ``cache_seqlens``. ``cache_batch_idx (B,)`` picks cache rows; ``cache_leftpad (B,)``
    is where each row's keys start. ``num_splits``: split-KV decoding; > 1 splits the keys into that many runs
    merged by their lse (a fixed schedule, CUDA-graph capturable), 0 chooses on GPUs for decoding that would
    not fill the SMs, 1 never splits.
    Returns ``out`` or ``(out, softmax_lse (B, h, sq) fp32)``.
    """
    if not (type(window_size) is tuple and window_size[1:2] and not window_size[2:]  # see flash_attn_qkvpacked_func
            and type(window_size[0]) is int and type(window_size[1]) is int):
        window_size = _window_pair(window_size)
    return attention_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                             rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)


# ------------------------------------------------------------------- internals other libraries import


def maybe_contiguous(x: Tensor | None) -> Tensor | None:
    """``x`` with a unit-stride last dim (a copy only when it has none); ``None`` stays ``None``."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _fresh(t: Tensor) -> Tensor:
    """Custom-op outputs are contiguous (as their fake implementations say)."""
    return t if t.is_contiguous() else t.contiguous()


@torch.library.custom_op("culmen::fa_forward", mutates_args=())
def _fa_forward(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float | None, causal: bool,
                window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Tensor | None,
                return_softmax: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, lse, S, rng = flash_attn_gpu.fwd(q, k, v, None, alibi_slopes, dropout_p, softmax_scale, causal,
                                          window_size_left, window_size_right, softcap, return_softmax, None)
    return _fresh(out), _fresh(lse), S, rng


@_fa_forward.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
      return_softmax):
    B, sq, h, _ = q.shape
    S = (q.new_empty(B, h, round_multiple(sq, 128), round_multiple(k.shape[1], 128)) if return_softmax
         else q.new_empty(0))
    return (q.new_empty(q.shape), q.new_empty((B, h, sq), dtype=torch.float32), S,
            q.new_empty(2, dtype=torch.int64))


@torch.library.custom_op("culmen::fa_varlen_forward", mutates_args=())
def _fa_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                       max_seqlen_k: int, dropout_p: float, softmax_scale: float | None, causal: bool,
                       window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                       alibi_slopes: Tensor | None = None, return_softmax: bool = False,
                       block_table: Tensor | None = None, leftpad_k: Tensor | None = None,
                       seqused_k: Tensor | None = None,
                       zero_tensors: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, lse, S, rng = flash_attn_gpu.varlen_fwd(
        q, k, v, None, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes, max_seqlen_q,
        max_seqlen_k, dropout_p, softmax_scale, zero_tensors, causal, window_size_left, window_size_right, softcap,
        return_softmax, None)
    return _fresh(out), _fresh(lse), S, rng


@_fa_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
      window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
      block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False):
    total_q, h, _ = q.shape
    B = cu_seqlens_q.shape[0] - 1
    S = (q.new_empty(B, h, round_multiple(max_seqlen_q, 128), round_multiple(max_seqlen_k, 128))
         if return_softmax else q.new_empty(0))
    return (q.new_empty(q.shape), q.new_empty((h, total_q), dtype=torch.float32), S,
            q.new_empty(2, dtype=torch.int64))


@torch.library.custom_op("culmen::fa_backward", mutates_args=("dq", "dk", "dv"))
def _fa_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dq: Tensor | None,
                 dk: Tensor | None, dv: Tensor | None, dropout_p: float, softmax_scale: float | None, causal: bool,
                 window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Tensor | None,
                 deterministic: bool, rng_state: Tensor | None = None) -> Tensor:
    return flash_attn_gpu.bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, dropout_p, softmax_scale,
                              causal, window_size_left, window_size_right, softcap, deterministic, None,
                              rng_state)[3]


@_fa_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
      window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    B, sq, h, _ = q.shape
    return q.new_empty((B, h, round_multiple(sq, 128)), dtype=torch.float32)


@torch.library.custom_op("culmen::fa_varlen_backward", mutates_args=("dq", "dk", "dv"))
def _fa_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                        dq: Tensor | None, dk: Tensor | None, dv: Tensor | None, cu_seqlens_q: Tensor,
                        cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                        softmax_scale: float | None, causal: bool, window_size_left: int, window_size_right: int,
                        softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
                        rng_state: Tensor | None = None, zero_tensors: bool = False) -> Tensor:
    return flash_attn_gpu.varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                     alibi_slopes, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, zero_tensors,
                                     causal, window_size_left, window_size_right, softcap, deterministic, None,
                                     rng_state)[3]


@_fa_varlen_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
      softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
      rng_state=None, zero_tensors=False):
    total_q, h, _ = q.shape
    return q.new_empty((h, total_q + 128 * (cu_seqlens_q.shape[0] - 1)), dtype=torch.float32)


def noop_custom_op_wrapper(name, fn=None, /, *, mutates_args, device_types=None, schema=None):
    """flash_attn's stand-in for ``torch.library.custom_op`` on torch < 2.4: a decorator (or, given ``fn``, a
    call) that returns the function unchanged. culmen needs torch >= 2.4, so ``_torch_custom_op_wrapper`` is the
    real one; this exists for code that imports it."""
    return fn if fn is not None else (lambda func: func)


def noop_register_fake_wrapper(op, fn=None, /, *, lib=None, _stacklevel=1):
    """flash_attn's stand-in for ``torch.library.register_fake`` on torch < 2.4 (see ``noop_custom_op_wrapper``)."""
    return fn if fn is not None else (lambda func: func)


# what flash_attn decorates its ops with on torch >= 2.4 (the versions culmen supports)
_torch_custom_op_wrapper = torch.library.custom_op
_torch_register_fake_wrapper = torch.library.register_fake

_wrapped_flash_attn_forward = torch.ops.culmen.fa_forward
_wrapped_flash_attn_varlen_forward = torch.ops.culmen.fa_varlen_forward
_wrapped_flash_attn_backward = torch.ops.culmen.fa_backward
_wrapped_flash_attn_varlen_backward = torch.ops.culmen.fa_varlen_backward


def _flash_attn_forward(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool,
                        window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Tensor | None,
                        return_softmax: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Dense forward (flash_attn 2.8's internal; not differentiable): ``q (B, sq, h, d)``, ``k``/``v``
    ``(B, sk, hk, d)`` -> ``(out (B, sq, h, d), softmax_lse (B, h, sq) fp32, S_dmask (B, h, round128(sq),
    round128(sk)) or empty, rng_state int64 (2,))``. Pass ``out``, ``softmax_lse`` and ``rng_state`` to
    ``_flash_attn_backward``. ``softmax_scale=None`` means ``headdim ** -0.5``."""
    return _wrapped_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                                       window_size_right, softcap, alibi_slopes, return_softmax)


def _flash_attn_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
                               causal: bool, window_size_left: int = -1, window_size_right: int = -1,
                               softcap: float = 0.0, alibi_slopes: Tensor | None = None, return_softmax: bool = False,
                               block_table: Tensor | None = None, leftpad_k: Tensor | None = None,
                               seqused_k: Tensor | None = None,
                               zero_tensors: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Varlen forward (flash_attn 2.8's internal): packed ``q (total_q, h, d)``, ``k``/``v`` ``(total_k, hk,
    d)`` (pages with ``block_table``), int32 ``cu_seqlens`` ``(B + 1,)`` -> ``(out (total_q, h, d),
    softmax_lse (h, total_q) fp32, S_dmask, rng_state)``. ``leftpad_k`` / ``seqused_k`` ``(B,)``: sequence
    ``b`` uses keys ``[leftpad_k[b], seqused_k[b])`` of its own (see ``flash_attn_2_cuda.gather_keys``)."""
    return _wrapped_flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                              softcap, alibi_slopes, return_softmax, block_table, leftpad_k,
                                              seqused_k, zero_tensors)


def _flash_attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                         dq: Tensor | None, dk: Tensor | None, dv: Tensor | None, dropout_p: float,
                         softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                         softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
                         rng_state: Tensor | None = None) -> Tensor:
    """Dense backward (flash_attn 2.8's internal) from ``out`` and ``softmax_lse`` as given (a ring step
    passes the combined ones): writes the gradients into ``dq (B, sq, h, d)``, ``dk``/``dv`` ``(B, sk, hk,
    d)`` and returns ``softmax_d (B, h, round128(sq))`` fp32 (``(1 - dropout_p) * rowsum(dout * out)``).
    ``rng_state`` is the forward's (needed when ``dropout_p > 0``)."""
    return _wrapped_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                                        causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                        deterministic, rng_state)


def _flash_attn_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                                dq: Tensor | None, dk: Tensor | None, dv: Tensor | None, cu_seqlens_q: Tensor,
                                cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                                softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                                softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
                                rng_state: Tensor | None = None, zero_tensors: bool = False) -> Tensor:
    """Varlen backward (flash_attn 2.8's internal): gradients into ``dq``/``dk``/``dv`` (packed like ``q``,
    ``k``, ``v``); returns ``softmax_d (h, total_q + 128 * B)`` fp32."""
    return _wrapped_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                               cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                               causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                               deterministic, rng_state, zero_tensors)


# ---------------------------------------------------------------------------- the autograd classes


def _options(ctx, inputs, is_grad_enabled, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
             deterministic, head_dim: int) -> tuple:
    """Normalize the shared options onto ``ctx``; returns ``(dropout_p, scale, causal, left, right, softcap,
    alibi_slopes)`` in the internals' argument order."""
    ctx.is_grad = bool(is_grad_enabled) and any(t.requires_grad for t in inputs)
    ctx.deterministic = bool(deterministic)
    ctx.set_materialize_grads(False)
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    left, right = _window_pair(window_size)
    ctx.opts = (dropout_p, scale, causal, left, right, softcap, alibi_slopes)
    return ctx.opts


def _result(ctx, out, lse, S, return_softmax):
    if not return_softmax:
        return out
    ctx.mark_non_differentiable(lse, S)
    return out, lse, S


def _dense_bwd(ctx, dout, q, k, v, out, lse, rng, dq, dk, dv) -> None:
    p, scale, causal, left, right, softcap, alibi = ctx.opts
    _wrapped_flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, p, scale, causal, left, right, softcap, alibi,
                                 ctx.deterministic, rng)


def _varlen_bwd(ctx, dout, q, k, v, out, lse, rng, cu_q, cu_k, dq, dk, dv) -> None:
    p, scale, causal, left, right, softcap, alibi = ctx.opts
    _wrapped_flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, ctx.max_q, ctx.max_k, p, scale,
                                        causal, left, right, softcap, alibi, ctx.deterministic, rng)


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    """flash_attn's autograd function of ``flash_attn_qkvpacked_func``: ``apply(qkv, dropout_p, softmax_scale,
    causal, window_size, softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled=True)`` with
    ``qkv (B, S, 3, h, d)``; returns ``out`` or ``(out, softmax_lse, S_dmask)``. The backward writes one
    ``dqkv`` buffer."""

    @staticmethod
    def forward(ctx, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        o = _options(ctx, (qkv,), is_grad_enabled, dropout_p, softmax_scale, causal, window_size, softcap,
                     alibi_slopes, deterministic, qkv.shape[-1])
        out, lse, S, rng = _wrapped_flash_attn_forward(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], *o, return_softmax)
        if ctx.is_grad:
            ctx.save_for_backward(qkv, out, lse, rng)
        return _result(ctx, out, lse, S, return_softmax)

    @staticmethod
    def backward(ctx, dout, *_):
        if dout is None:
            return (None,) * 10
        qkv, out, lse, rng = ctx.saved_tensors
        dqkv = torch.empty_like(qkv)
        _dense_bwd(ctx, dout, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], out, lse, rng, dqkv[:, :, 0], dqkv[:, :, 1],
                   dqkv[:, :, 2])
        return (dqkv,) + (None,) * 9


class FlashAttnKVPackedFunc(torch.autograd.Function):
    """flash_attn's autograd function of ``flash_attn_kvpacked_func``: ``apply(q, kv, dropout_p, ...,
    return_softmax, is_grad_enabled=True)`` with ``q (B, sq, h, d)``, ``kv (B, sk, 2, hk, d)``."""

    @staticmethod
    def forward(ctx, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        o = _options(ctx, (q, kv), is_grad_enabled, dropout_p, softmax_scale, causal, window_size, softcap,
                     alibi_slopes, deterministic, q.shape[-1])
        out, lse, S, rng = _wrapped_flash_attn_forward(q, kv[:, :, 0], kv[:, :, 1], *o, return_softmax)
        if ctx.is_grad:
            ctx.save_for_backward(q, kv, out, lse, rng)
        return _result(ctx, out, lse, S, return_softmax)

    @staticmethod
    def backward(ctx, dout, *_):
        if dout is None:
            return (None,) * 11
        q, kv, out, lse, rng = ctx.saved_tensors
        dq, dkv = torch.empty_like(q), torch.empty_like(kv)
        _dense_bwd(ctx, dout, q, kv[:, :, 0], kv[:, :, 1], out, lse, rng, dq, dkv[:, :, 0], dkv[:, :, 1])
        return (dq, dkv) + (None,) * 9


class FlashAttnFunc(torch.autograd.Function):
    """flash_attn's autograd function of ``flash_attn_func``: ``apply(q, k, v, dropout_p, softmax_scale, causal,
    window_size, softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled=True)``."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        o = _options(ctx, (q, k, v), is_grad_enabled, dropout_p, softmax_scale, causal, window_size, softcap,
                     alibi_slopes, deterministic, q.shape[-1])
        out, lse, S, rng = _wrapped_flash_attn_forward(q, k, v, *o, return_softmax)
        if ctx.is_grad:
            ctx.save_for_backward(q, k, v, out, lse, rng)
        return _result(ctx, out, lse, S, return_softmax)

    @staticmethod
    def backward(ctx, dout, *_):
        if dout is None:
            return (None,) * 12
        q, k, v, out, lse, rng = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _dense_bwd(ctx, dout, q, k, v, out, lse, rng, dq, dk, dv)
        return (dq, dk, dv) + (None,) * 9


class FlashAttnVarlenQKVPackedFunc(torch.autograd.Function):
    """flash_attn's autograd function of ``flash_attn_varlen_qkvpacked_func``: ``apply(qkv, cu_seqlens,
    max_seqlen, dropout_p, ..., return_softmax, is_grad_enabled=True)`` with ``qkv (total, 3, h, d)``."""

    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax, is_grad_enabled=True):
        o = _options(ctx, (qkv,), is_grad_enabled, dropout_p, softmax_scale, causal, window_size, softcap,
                     alibi_slopes, deterministic, qkv.shape[-1])
        ctx.max_q = ctx.max_k = max_seqlen
        out, lse, S, rng = _wrapped_flash_attn_varlen_forward(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens,
                                                              max_seqlen, max_seqlen, *o, return_softmax)
        if ctx.is_grad:
            ctx.save_for_backward(qkv, out, lse, rng, cu_seqlens)
        return _result(ctx, out, lse, S, return_softmax)

    @staticmethod
    def backward(ctx, dout, *_):
        if dout is None:
            return (None,) * 12
        qkv, out, lse, rng, cu = ctx.saved_tensors
        dqkv = torch.empty_like(qkv)
        _varlen_bwd(ctx, dout, qkv[:, 0], qkv[:, 1], qkv[:, 2], out, lse, rng, cu, cu, dqkv[:, 0], dqkv[:, 1],
                    dqkv[:, 2])
        return (dqkv,) + (None,) * 11


class FlashAttnVarlenKVPackedFunc(torch.autograd.Function):
    """flash_attn's autograd function of ``flash_attn_varlen_kvpacked_func``: ``apply(q, kv, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, ..., return_softmax, is_grad_enabled=True)``."""

    @staticmethod
    def forward(ctx, q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled=True):
        o = _options(ctx, (q, kv), is_grad_enabled, dropout_p, softmax_scale, causal, window_size, softcap,
                     alibi_slopes, deterministic, q.shape[-1])
        ctx.max_q, ctx.max_k = max_seqlen_q, max_seqlen_k
        out, lse, S, rng = _wrapped_flash_attn_varlen_forward(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k,
                                                              max_seqlen_q, max_seqlen_k, *o, return_softmax)
        if ctx.is_grad:
            ctx.save_for_backward(q, kv, out, lse, rng, cu_seqlens_q, cu_seqlens_k)
        return _result(ctx, out, lse, S, return_softmax)

    @staticmethod
    def backward(ctx, dout, *_):
        if dout is None:
            return (None,) * 15
        q, kv, out, lse, rng, cu_q, cu_k = ctx.saved_tensors
        dq, dkv = torch.empty_like(q), torch.empty_like(kv)
        _varlen_bwd(ctx, dout, q, kv[:, 0], kv[:, 1], out, lse, rng, cu_q, cu_k, dq, dkv[:, 0], dkv[:, 1])
        return (dq, dkv) + (None,) * 13


class FlashAttnVarlenFunc(torch.autograd.Function):
    """flash_attn's autograd function of ``flash_attn_varlen_func``: ``apply(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
    alibi_slopes, deterministic, return_softmax, block_table, is_grad_enabled=True)``. With ``block_table``
    (paged ``k``/``v``) the used pages are gathered first and their gradients scattered back (flash_attn
    has no backward there)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, window_size, softcap, alibi_slopes, deterministic, return_softmax, block_table=None,
                is_grad_enabled=True):
        o = _options(ctx, (q, k, v), is_grad_enabled, dropout_p, softmax_scale, causal, window_size, softcap,
                     alibi_slopes, deterministic, q.shape[-1])
        ctx.max_q, ctx.max_k = max_seqlen_q, max_seqlen_k
        ctx.paged_shape = None
        kp, vp, cu_k = k, v, cu_seqlens_k
        if block_table is not None:
            kp, vp, cu_k, rows = gather_keys(k, v, cu_seqlens_k, block_table, return_rows=True)
            ctx.paged_shape = k.shape
        out, lse, S, rng = _wrapped_flash_attn_varlen_forward(q, kp, vp, cu_seqlens_q, cu_k, max_seqlen_q,
                                                              max_seqlen_k, *o, return_softmax)
        if ctx.is_grad:
            extra = (rows,) if block_table is not None else ()
            ctx.save_for_backward(q, kp, vp, out, lse, rng, cu_seqlens_q, cu_k, *extra)
        return _result(ctx, out, lse, S, return_softmax)

    @staticmethod
    def backward(ctx, dout, *_):
        if dout is None:
            return (None,) * 17
        q, k, v, out, lse, rng, cu_q, cu_k, *rows = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _varlen_bwd(ctx, dout, q, k, v, out, lse, rng, cu_q, cu_k, dq, dk, dv)
        if rows:  # back onto the pages: a page row used twice gets both gradients
            shape = ctx.paged_shape
            flat = (shape[0] * shape[1], *shape[2:])
            dk = dk.new_zeros(flat).index_add_(0, rows[0], dk).view(shape)
            dv = dv.new_zeros(flat).index_add_(0, rows[0], dv).view(shape)
        return (dq, dk, dv) + (None,) * 14
