"""flash_attn's ``flash_attn.utils.generation``: sampling, KV-cache decoding and CUDA-graph decoding.

Same names, arguments and defaults as flash_attn 2.8. A model plugs in by taking
``forward(input_ids, position_ids=None, inference_params=None, num_last_tokens=0)`` and returning an
object with ``.logits``; its attention layers read and write the KV cache through the
:class:`InferenceParams` they are handed (``culmen.flash_attn.modules.mha.MHA`` does).

Differences from flash_attn, all additive:

- ``decode`` also takes ``repetition_penalty`` (last, keyword; default 1.0 = off): the CTRL penalty of
  :func:`modify_logit_for_repetition_penalty` over the prompt and the tokens generated so far.
- ``enable_timing`` works on CPU models too (wall clock instead of CUDA events).
- The output classes are this module's own dataclasses (``sequences``, ``scores``); transformers 5
  no longer has ``GreedySearchDecoderOnlyOutput`` / ``SampleDecoderOnlyOutput``.
- Bad arguments raise ``ValueError`` naming them instead of failing an ``assert``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DecodingCGCache",
    "GenerationMixin",
    "GreedySearchDecoderOnlyOutput",
    "InferenceParams",
    "SampleDecoderOnlyOutput",
    "allocate_inference_cache",
    "capture_graph",
    "decode",
    "decode_speculative",
    "modify_logit_for_repetition_penalty",
    "modify_logits_for_top_k_filtering",
    "modify_logits_for_top_p_filtering",
    "sample",
    "sample_speculative",
    "update_graph_cache",
]


@dataclass
class InferenceParams:
    """Decoding state shared by every attention layer of a model during one generation.

    Attributes:
        max_seqlen: longest sequence (prompt + generated) the KV caches must hold.
        max_batch_size: rows of the KV caches.
        seqlen_offset: tokens already in the caches (0 while the prompt is processed).
        batch_size_offset: first cache row of this batch (for micro-batched decoding).
        key_value_memory_dict: ``layer_idx -> (max_batch_size, max_seqlen, 2, nheads_kv, headdim)``
            KV cache; attention layers allocate theirs on first use when absent.
        lengths_per_sample: int32 ``(max_batch_size,)`` cache lengths per row, or ``None`` (then every
            row holds ``seqlen_offset`` tokens). CUDA-graph decoding sets it before each replay,
            because a captured graph cannot see a new Python ``seqlen_offset``.
    """

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Tensor | None = None

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        """Start a new generation on the same caches: offsets back to 0, new limits."""
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


@dataclass
class GreedySearchDecoderOnlyOutput:
    """``decode``'s result when ``top_k == 1``.

    ``sequences``: int64 ``(batch, seqlen)``, the prompt followed by the generated tokens.
    ``scores``: per generated token, the ``(batch, vocab_size)`` logits it was chosen from (a tuple), or
    one ``(batch, n_generated, vocab_size)`` tensor from ``decode_speculative``; ``None`` when dropped.
    """

    sequences: Tensor
    scores: Any = None


@dataclass
class SampleDecoderOnlyOutput(GreedySearchDecoderOnlyOutput):
    """``decode``'s result when sampling (``top_k != 1``); same fields as the greedy output."""


def _check_sampling(top_k: int, top_p: float, temperature: float) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = no limit), got {top_k!r}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1] (0 = off), got {top_p!r}")
    if top_k != 1 and not temperature > 0.0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature!r}")


def modify_logits_for_top_k_filtering(logits: Tensor, top_k: int) -> None:
    """Set every logit below the ``top_k``-th largest of its row to ``-inf``, in place.

    ``logits``: float ``(..., vocab_size)``; ties with the ``top_k``-th value are kept.
    """
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    logits.masked_fill_(logits < kth, float("-inf"))


def modify_logits_for_top_p_filtering(logits: Tensor, top_p: float) -> None:
    """Nucleus filtering in place: keep the smallest set of largest-probability tokens whose total
    probability reaches ``top_p``; the rest become ``-inf``. No-op unless ``0 < top_p < 1``.

    ``logits``: float ``(batch, vocab_size)``. A token is dropped when the probability mass of the
    tokens ranked at or below it (ascending order, itself included) is at most ``1 - top_p``.
    """
    if top_p <= 0.0 or top_p >= 1.0:
        return
    ascending, order = torch.sort(logits, dim=-1, descending=False)
    mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = mass_below <= (1.0 - top_p)
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    logits.masked_fill_(drop, float("-inf"))


def modify_logit_for_repetition_penalty(logits: Tensor, prev_output_tokens: Tensor,
                                        repetition_penalty: float = 1.0) -> Tensor:
    """CTRL repetition penalty (arXiv:1909.05858), in place: for every token id in
    ``prev_output_tokens``, a positive logit is divided by ``repetition_penalty`` and a negative one
    multiplied by it, once per token id however often it occurred.

    ``logits``: float ``(batch, vocab_size)``; ``prev_output_tokens``: int64 ``(batch, seqlen)``.
    Returns ``logits``.
    """
    if repetition_penalty == 1.0:
        return logits
    if not repetition_penalty > 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty!r}")
    seen = logits.gather(1, prev_output_tokens)
    seen = torch.where(seen < 0, seen * repetition_penalty, seen / repetition_penalty)
    logits.scatter_(1, prev_output_tokens, seen)
    return logits


def sample(logits: Tensor, top_k: int = 1, top_p: float = 0.0, temperature: float = 1.0) -> Tensor:
    """Pick one token per row.

    ``top_k == 1``: greedy (argmax; ``temperature`` and ``top_p`` are ignored). Otherwise the logits
    are restricted to the ``top_k`` largest (``top_k == 0``: all), divided by ``temperature``,
    nucleus-filtered by ``top_p`` and one token is drawn from their softmax.

    Args:
        logits: float ``(batch_size, vocab_size)``; not modified.
    Returns:
        int64 ``(batch_size,)`` token ids.
    """
    if top_k == 1:
        return logits.argmax(dim=-1)
    _check_sampling(top_k, top_p, temperature)
    if top_k > 0:
        top_k = min(top_k, logits.size(-1))
        top_logits, top_ids = torch.topk(logits, top_k, dim=-1)
        if temperature != 1.0:
            top_logits /= temperature
        modify_logits_for_top_p_filtering(top_logits, top_p)
        pick = torch.multinomial(torch.softmax(top_logits, dim=-1), num_samples=1)
        return top_ids.gather(-1, pick).squeeze(-1)
    # Divide out of place (or clone) so the caller's logits survive the in-place top-p filter.
    scaled = logits / temperature if temperature != 1.0 else logits.clone()
    modify_logits_for_top_p_filtering(scaled, top_p)
    return torch.multinomial(torch.softmax(scaled, dim=-1), num_samples=1).squeeze(-1)


class _Stopwatch:
    """Wall time of a generation: CUDA events on GPU models, ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device, enabled: bool, tensor_parallel: int) -> None:
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.tensor_parallel = tensor_parallel
        if enabled and self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def _barrier(self) -> None:
        if self.tensor_parallel > 1:
            torch.distributed.barrier()

    def start(self) -> None:
        if not self.enabled:
            return
        self._barrier()
        if self.cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Milliseconds since ``start`` (0.0 when disabled)."""
        if not self.enabled:
            return 0.0
        if self.cuda:
            self._end.record()
            self._barrier()
            torch.cuda.synchronize()
            return self._start.elapsed_time(self._end)
        self._barrier()
        return (time.perf_counter() - self._t0) * 1000.0


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(iter(model.parameters())).device


def _cg_cache(model: torch.nn.Module, batch_size: int, seqlen_og: int, max_length: int,
              decoding_seqlens: Sequence[int], tensor_parallel: int) -> InferenceParams:
    """The model's graph cache brought up to date, and its InferenceParams reset for a new run."""
    if _model_device(model).type != "cuda":
        raise ValueError(f"cg=True needs a model on a CUDA device, got {_model_device(model)}")
    model._decoding_cache = update_graph_cache(
        model, getattr(model, "_decoding_cache", None), batch_size, seqlen_og, max_length,
        decoding_seqlens=decoding_seqlens, tensor_parallel=tensor_parallel,
    )
    params = model._decoding_cache.inference_params
    params.reset(max_length, batch_size)
    return params


def _positions(input_ids: Tensor, seqlen_offset: int) -> Tensor:
    """Position ids ``(batch, seqlen)`` of tokens that follow ``seqlen_offset`` cached ones."""
    batch, seqlen = input_ids.shape
    pos = torch.arange(seqlen_offset, seqlen_offset + seqlen, dtype=torch.long, device=input_ids.device)
    return pos.expand(batch, seqlen)


def _model_logits(model, input_ids: Tensor, params: InferenceParams, num_last_tokens: int, cg: bool,
                  vocab_size: int | None) -> Tensor:
    """Logits ``(batch, num_last_tokens, vocab)`` of the last tokens of ``input_ids`` fed after the
    cached ones. The prompt (``seqlen_offset == 0``) always runs eagerly: graphs hold decoding steps."""
    offset = params.seqlen_offset
    if offset == 0:
        # Every row of a prompt starts at position 0. The graphs' per-row lengths (sized for the
        # cache's largest batch, possibly more rows than this one) are hidden so layers use the offset.
        lengths, params.lengths_per_sample = params.lengths_per_sample, None
        try:
            logits = model(input_ids, position_ids=None, inference_params=params,
                           num_last_tokens=num_last_tokens).logits
        finally:
            params.lengths_per_sample = lengths
    elif not cg:
        logits = model(input_ids, position_ids=_positions(input_ids, offset), inference_params=params,
                       num_last_tokens=num_last_tokens).logits
    else:
        if num_last_tokens > input_ids.shape[1]:
            raise ValueError(f"num_last_tokens={num_last_tokens} > the {input_ids.shape[1]} tokens fed")
        logits = model._decoding_cache.run(input_ids, _positions(input_ids, offset), offset)
        logits = logits[:, -num_last_tokens:]
    return logits[..., :vocab_size] if vocab_size is not None else logits


@torch.inference_mode()
def decode(
    input_ids: Tensor,
    model,
    max_length: int,
    top_k: int = 1,
    top_p: float = 0.0,
    temperature: float = 1.0,
    eos_token_id: int | None = None,
    teacher_outputs: Tensor | None = None,
    vocab_size: int | None = None,
    tensor_parallel: int = 1,
    cg: bool = False,
    enable_timing: bool = False,
    repetition_penalty: float = 1.0,
) -> GreedySearchDecoderOnlyOutput:
    """Greedy or sampled decoding with a KV cache, optionally replaying CUDA graphs.

    The prompt runs once; then one token per step is fed until the sequences are ``max_length``
    long or every row's latest token is ``eos_token_id``. ``top_k == 0`` samples from all tokens;
    ``top_k`` and ``top_p`` combine (top-k first). All rows share one prompt length.

    Args:
        input_ids: int64 ``(batch, seqlen_og)`` prompt.
        model: see the module docstring; with ``cg=True`` it must live on a CUDA device, its attention
            must decode through ``flash_attn_with_kvcache`` (``use_flash_attn``), and the graphs are
            kept in ``model._decoding_cache`` for later calls.
        max_length: total length (prompt included) to stop at.
        teacher_outputs: int64 ``(batch, >= seqlen_og)``: where given, token ``t`` is taken from
            ``teacher_outputs[:, t]`` instead of being sampled (the logits are still recorded).
        vocab_size: keep only the first ``vocab_size`` logits (drops a padded vocabulary).
        tensor_parallel: ranks of a tensor-parallel model (barriers around the timing).
        enable_timing: print the elapsed time of the whole generation.
        repetition_penalty: CTRL penalty on every token already in the sequence (1.0 = off).
    Returns:
        ``GreedySearchDecoderOnlyOutput`` (``top_k == 1``) or ``SampleDecoderOnlyOutput`` with
        ``sequences`` int64 ``(batch, <= max_length)`` and ``scores``: a tuple of the ``(batch, vocab)``
        logits of each generated token (before any penalty).
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(input_ids.shape)}")
    batch_size, seqlen_og = input_ids.shape
    if not isinstance(max_length, int) or max_length <= seqlen_og:
        raise ValueError(f"max_length must be an int > the prompt length {seqlen_og}, got {max_length!r}")
    if top_k != 1:
        _check_sampling(top_k, top_p, temperature)
    teacher_len = teacher_outputs.shape[1] if teacher_outputs is not None else 0
    if cg:
        params = _cg_cache(model, batch_size, seqlen_og, max_length, (1,), tensor_parallel)
    else:
        params = InferenceParams(max_seqlen=max_length, max_batch_size=batch_size)

    def next_token(logits: Tensor, history: Tensor) -> Tensor:
        # params.seqlen_offset now counts the tokens before the one being chosen: its position.
        if teacher_len > params.seqlen_offset:
            return teacher_outputs[:, params.seqlen_offset]
        if repetition_penalty != 1.0:
            logits = modify_logit_for_repetition_penalty(logits.clone(), history, repetition_penalty)
        return sample(logits, top_k=top_k, top_p=top_p, temperature=temperature)

    clock = _Stopwatch(input_ids.device, enable_timing, tensor_parallel)
    clock.start()
    scores: list[Tensor] = []
    sequences = [input_ids]
    history = input_ids
    while True:
        fed = sequences[-1]
        if params.seqlen_offset > 0:
            if eos_token_id is not None and bool((fed == eos_token_id).all()):
                break
            if params.seqlen_offset >= max_length - 1:
                break
        logits = _model_logits(model, fed, params, 1, cg, vocab_size).squeeze(1)
        scores.append(logits)
        params.seqlen_offset += fed.shape[1]
        token = next_token(logits, history).unsqueeze(1)
        if repetition_penalty != 1.0:
            history = torch.cat([history, token], dim=1)
        sequences.append(token)
    elapsed = clock.stop()
    if enable_timing:
        print(f"Prompt processing + decoding time: {elapsed:.0f}ms")
    output_cls = GreedySearchDecoderOnlyOutput if top_k == 1 else SampleDecoderOnlyOutput
    return output_cls(sequences=torch.cat(sequences, dim=1), scores=tuple(scores))


def sample_speculative(logits: Tensor, logits_draft: Tensor, tokens_draft: Tensor, top_k: int = 1,
                       top_p: float = 0.0, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Speculative sampling (Leviathan et al. 2023, arXiv:2211.17192, Algorithm 1).

    Draft token ``t`` is accepted with probability ``min(1, p(t) / q(t))``; at the first rejection a
    token is drawn from ``max(p - q, 0)``, and when every draft is accepted one more is drawn from the
    target's last distribution. ``p``/``q`` are the target/draft distributions after the same top-k,
    temperature and top-p processing as :func:`sample` (with ``top_k == 1`` both are one-hot, so the
    result is exactly the target's greedy choice).

    Args:
        logits: float ``(batch, seqlen + 1, vocab)`` target logits at the draft positions and one after.
        logits_draft: float ``(batch, seqlen, vocab)`` logits the drafts were sampled from.
        tokens_draft: int64 / int32 ``(batch, seqlen)``.
    Returns:
        ``tokens`` ``(batch, seqlen + 1)`` (valid up to the count) and ``num_generated_tokens`` int64
        ``(batch,)`` in ``[1, seqlen + 1]``.
    """
    batch, seqlen_p1, vocab = logits.shape
    seqlen = seqlen_p1 - 1
    if tuple(logits_draft.shape) != (batch, seqlen, vocab):
        raise ValueError(f"logits_draft must be {(batch, seqlen, vocab)}, got {tuple(logits_draft.shape)}")
    if tuple(tokens_draft.shape) != (batch, seqlen):
        raise ValueError(f"tokens_draft must be {(batch, seqlen)}, got {tuple(tokens_draft.shape)}")
    if tokens_draft.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"tokens_draft must be int64 or int32, got {tokens_draft.dtype}")
    _check_sampling(top_k, top_p, temperature if top_k != 1 else 1.0)

    def distribution(x: Tensor) -> Tensor:
        x = x / temperature if temperature != 1.0 else x.clone()
        if top_k > 0:
            modify_logits_for_top_k_filtering(x, min(top_k, vocab))
        flat = x.reshape(-1, vocab)
        modify_logits_for_top_p_filtering(flat, top_p)
        return torch.softmax(flat, dim=-1).view_as(x)

    p = distribution(logits)
    q = distribution(logits_draft)
    idx = tokens_draft.long().unsqueeze(-1)
    p_tok = p[:, :-1].gather(-1, idx).squeeze(-1)
    q_tok = q.gather(-1, idx).squeeze(-1)
    # u * q <= p is u <= p / q without dividing by a zero q.
    accepted = torch.rand(batch, seqlen, device=p.device) * q_tok <= p_tok
    rejected_any = ~accepted.all(dim=-1)
    first_rejected = torch.where(rejected_any, accepted.int().argmin(dim=-1),
                                 torch.full_like(rejected_any, seqlen, dtype=torch.long))
    # Row s < seqlen: the residual max(p - q, 0) (multinomial normalizes); row seqlen: p itself.
    residual = torch.cat([(p[:, :-1] - q).clamp_min(0.0), p[:, -1:]], dim=1)
    pick_from = residual.gather(1, first_rejected.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1)
    resampled = torch.multinomial(pick_from, num_samples=1).squeeze(-1)
    tokens = F.pad(tokens_draft, (0, 1))
    tokens.scatter_(1, first_rejected.unsqueeze(1), resampled.to(tokens.dtype).unsqueeze(1))
    return tokens, first_rejected + 1


@torch.inference_mode()
def decode_speculative(
    input_ids: Tensor,
    model,
    model_draft,
    max_length: int,
    speculative_lookahead: int = 3,
    top_k: int = 1,
    top_p: float = 0.0,
    temperature: float = 1.0,
    eos_token_id: int | None = None,
    vocab_size: int | None = None,
    tensor_parallel: int = 1,
    cg: bool = False,
    enable_timing: bool = False,
    debug: bool = False,
) -> GreedySearchDecoderOnlyOutput:
    """Speculative decoding: ``model_draft`` proposes ``speculative_lookahead`` tokens, ``model``
    checks them in one call and keeps a prefix (:func:`sample_speculative`). Batch size 1 only, as in
    flash_attn. Greedy (``top_k == 1``) gives exactly ``model``'s greedy sequence.

    Args:
        input_ids: int64 ``(1, seqlen_og)``; model, model_draft: as for :func:`decode` (distinct
            objects when ``cg=True``: each keeps its own graphs). eos_token_id: must be ``None``.
        debug: print, per round, the largest difference between the cached logits and a full
            recompute of both models.
    Returns:
        ``sequences`` int64 ``(1, max_length)`` and ``scores`` float ``(1, max_length - seqlen_og,
        vocab)``: the target's logits for each kept token.
    """
    batch_size, seqlen_og = input_ids.shape
    if batch_size != 1:
        raise ValueError(f"decode_speculative supports batch size 1 only, got {batch_size}")
    if eos_token_id is not None:
        raise ValueError(f"decode_speculative does not support eos_token_id, got {eos_token_id!r}")
    if not isinstance(max_length, int) or max_length <= seqlen_og:
        raise ValueError(f"max_length must be an int > the prompt length {seqlen_og}, got {max_length!r}")
    if speculative_lookahead < 1:
        raise ValueError(f"speculative_lookahead must be >= 1, got {speculative_lookahead!r}")
    _check_sampling(top_k, top_p, temperature if top_k != 1 else 1.0)
    if cg:
        if model is model_draft:
            raise ValueError("cg=True needs distinct model and model_draft objects (one graph cache each)")
        params_draft = _cg_cache(model_draft, batch_size, seqlen_og, max_length, (1, 2), tensor_parallel)
        params = _cg_cache(model, batch_size, seqlen_og, max_length,
                           tuple(range(1, speculative_lookahead + 2)), tensor_parallel)
    else:
        params_draft = InferenceParams(max_seqlen=max_length, max_batch_size=batch_size)
        params = InferenceParams(max_seqlen=max_length, max_batch_size=batch_size)
    sample_fn = partial(sample, top_k=top_k, top_p=top_p, temperature=temperature)

    def draft(fed: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """n tokens from the draft after feeding ``fed``; returns them (1, n) and their logits (1, n, V)."""
        tokens, logits = [], []
        for _ in range(n):
            step = _model_logits(model_draft, fed, params_draft, 1, cg, vocab_size)[:, -1]
            params_draft.seqlen_offset += fed.shape[1]
            fed = sample_fn(step).unsqueeze(1)
            tokens.append(fed)
            logits.append(step)
        return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)

    clock = _Stopwatch(input_ids.device, enable_timing, tensor_parallel)
    clock.start()
    seq = input_ids
    scores: list[Tensor] = []
    main_calls = drafted = accepted = 0
    # Both models' caches hold every token of ``seq`` but the last; the draft's may lag one more
    # (after a fully accepted round it never saw its own last draft).
    main_fed_from = draft_fed_from = 0
    while seq.shape[1] < max_length:
        n_spec = min(speculative_lookahead, max_length - seq.shape[1] - 1)
        if n_spec == 0:
            logits = _model_logits(model, seq[:, main_fed_from:], params, 1, cg, vocab_size)
            params.seqlen_offset = seq.shape[1]
            seq = torch.cat([seq, sample_fn(logits[:, -1]).unsqueeze(1)], dim=1)
            scores.append(logits)
            main_calls += 1
            continue
        tokens_draft, logits_draft = draft(seq[:, draft_fed_from:], n_spec)
        fed = torch.cat([seq[:, main_fed_from:], tokens_draft], dim=1)
        logits = _model_logits(model, fed, params, n_spec + 1, cg, vocab_size)
        main_calls += 1
        drafted += n_spec
        tokens, n_new = sample_speculative(logits, logits_draft, tokens_draft, top_k=top_k, top_p=top_p,
                                           temperature=temperature)
        n_new = int(n_new[0])
        accepted += n_new - 1
        n_before = seq.shape[1]
        seq = torch.cat([seq, tokens[:, :n_new]], dim=1)
        scores.append(logits[:, :n_new])
        # Cache entries past the kept tokens are overwritten later: only the offsets move back.
        params.seqlen_offset = seq.shape[1] - 1
        main_fed_from = seq.shape[1] - 1
        params_draft.seqlen_offset = n_before + min(n_new, n_spec) - 1
        draft_fed_from = params_draft.seqlen_offset
        if debug:
            full = model(seq).logits[:, n_before - 1:-1][..., :vocab_size]
            print(f"round: kept {n_new}/{n_spec + 1}, max |cached - recomputed| logits "
                  f"{(scores[-1] - full).abs().max().item():.3g}")
    elapsed = clock.stop()
    if enable_timing:
        print(f"Prompt processing + decoding time: {elapsed:.0f}ms")
        print(f"Number of calls to main model: {main_calls}")
        if drafted:
            print(f"Acceptance rate: {accepted / drafted * 100:.2f}%")
    output_cls = GreedySearchDecoderOnlyOutput if top_k == 1 else SampleDecoderOnlyOutput
    return output_cls(sequences=seq, scores=torch.cat(scores, dim=1))


class GenerationMixin:
    """``generate`` for models following the decoding protocol of the module docstring."""

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype: torch.dtype | None = None,
                                 **kwargs) -> dict:
        """``layer_idx -> KV cache`` for CUDA-graph decoding; models override it."""
        raise NotImplementedError

    def generate(self, input_ids: Tensor, max_length: int, top_k: int = 1, top_p: float = 0.0,
                 temperature: float = 1.0, return_dict_in_generate: bool = False,
                 output_scores: bool = False, **kwargs):
        """:func:`decode` on this model. Returns the int64 ``(batch, seqlen)`` sequences, or the whole
        output object with ``return_dict_in_generate`` (``scores`` is ``None`` unless ``output_scores``).
        ``kwargs`` go to :func:`decode` (``eos_token_id``, ``cg``, ``teacher_outputs`` ...)."""
        output = decode(input_ids, self, max_length, top_k=top_k, top_p=top_p, temperature=temperature,
                        **kwargs)
        if not output_scores:
            output.scores = None
        return output if return_dict_in_generate else output.sequences


def allocate_inference_cache(
    max_batch_size: int,
    max_seqlen: int,
    nheads: int,
    headdim: int,
    layers: int | Sequence[int],
    device: torch.device | str | None,
    dtype: torch.dtype = torch.float16,
) -> dict[int, Tensor]:
    """Uninitialised KV caches ``(max_batch_size, max_seqlen, 2, nheads, headdim)``, one per layer
    index (``layers``: a count or the indices)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    shape = (max_batch_size, max_seqlen, 2, nheads, headdim)
    indices = range(layers) if isinstance(layers, int) else layers
    return {i: torch.empty(shape, device=device, dtype=dtype) for i in indices}


@dataclass
class DecodingCGCache:
    """The CUDA graphs of one model: one per ``(batch_size, decoding_seqlen)``, all capturing into one
    memory pool over one set of KV caches (``inference_params``). ``run(input_ids, position_ids,
    seqlen)`` replays the graph matching ``input_ids``' shape and returns a copy of its logits."""

    max_batch_size: int = 0
    max_seqlen: int = 0
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    callables: dict = field(default_factory=dict)
    mempool: Any = None
    inference_params: InferenceParams | None = None
    run: Callable | None = None


def _zero_caches(caches: Any) -> None:
    if isinstance(caches, Tensor):
        caches.zero_()
    elif isinstance(caches, dict):
        for c in caches.values():
            _zero_caches(c)
    elif isinstance(caches, (tuple, list)):
        for c in caches:
            _zero_caches(c)


@torch.inference_mode()
def update_graph_cache(
    model,
    cache: DecodingCGCache | None,
    batch_size: int,
    seqlen_og: int,
    max_seqlen: int,
    decoding_seqlens: Sequence[int] = (1,),
    tensor_parallel: int = 1,
    dtype: torch.dtype | None = None,
    n_warmups: int = 2,
) -> DecodingCGCache:
    """Make ``cache`` (or a new one) hold a graph for ``(batch_size, s)``, every ``s`` in
    ``decoding_seqlens``; capture only what is missing.

    A different device/dtype, a larger batch or a longer ``max_seqlen`` than the cache was built for
    drops every graph and reallocates the KV caches; otherwise earlier graphs are reused (a smaller
    batch gets its own graph over the first rows of the same caches).
    """
    if cache is None:
        cache = DecodingCGCache()
    param = next(iter(model.parameters()))
    device = param.device
    dtype = param.dtype if dtype is None else dtype
    if ((device, dtype) != (cache.device, cache.dtype) or batch_size > cache.max_batch_size
            or max_seqlen > cache.max_seqlen):
        cache.callables = {}
        cache.mempool = None
        cache.inference_params = None
        gc.collect()  # let the old graphs' pool and caches go before allocating the new ones
        cache.device, cache.dtype = device, dtype
        cache.max_batch_size, cache.max_seqlen = batch_size, max_seqlen
        if hasattr(model, "allocate_inference_cache"):
            kv = model.allocate_inference_cache(batch_size, max_seqlen, dtype)
        else:
            cfg = model.config
            headdim = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
            kv = allocate_inference_cache(batch_size, max_seqlen, cfg.num_attention_heads // tensor_parallel,
                                          headdim, cfg.num_hidden_layers, device, dtype)
        # Zeroed once: no kernel or reference may then see stale NaN/Inf in the slots not yet written.
        _zero_caches(kv)
        cache.inference_params = InferenceParams(
            max_seqlen=max_seqlen, max_batch_size=batch_size, seqlen_offset=seqlen_og,
            key_value_memory_dict=kv,
            lengths_per_sample=torch.full((batch_size,), seqlen_og, dtype=torch.int32, device=device),
        )
        cache.mempool = torch.cuda.graph_pool_handle()
    for s in decoding_seqlens:
        if (batch_size, s) not in cache.callables:
            cache.callables[batch_size, s] = capture_graph(
                model, cache.inference_params, batch_size, max_seqlen, decoding_seqlen=s,
                mempool=cache.mempool, n_warmups=n_warmups,
            )
    callables = cache.callables

    def dispatch(input_ids: Tensor, position_ids: Tensor, seqlen: int) -> Tensor:
        return callables[input_ids.shape[0], input_ids.shape[1]](input_ids, position_ids, seqlen)

    cache.run = dispatch
    cache.inference_params.seqlen_offset = 0
    return cache


def capture_graph(model, inference_params: InferenceParams, batch_size: int, max_seqlen: int,
                  decoding_seqlen: int = 1, mempool=None, n_warmups: int = 2) -> Callable:
    """Capture one decoding step of ``decoding_seqlen`` tokens for ``batch_size`` rows.

    The graph is recorded at the deepest offset (``max_seqlen - decoding_seqlen``) so every buffer
    sized by the offset (rotary tables) is already at its largest; the real offset reaches the
    kernels through ``inference_params.lengths_per_sample``, which ``run`` fills before replaying.
    Returns ``run(input_ids, position_ids, seqlen) -> logits (batch, decoding_seqlen, vocab)`` (a copy:
    the graph's own output buffer is overwritten by the next replay).
    """
    device = next(iter(model.parameters())).device
    static_ids = torch.zeros((batch_size, decoding_seqlen), dtype=torch.long, device=device)
    static_pos = torch.zeros((batch_size, decoding_seqlen), dtype=torch.long, device=device)
    offset_before = inference_params.seqlen_offset
    inference_params.seqlen_offset = max_seqlen - decoding_seqlen
    inference_params.lengths_per_sample[:] = inference_params.seqlen_offset

    def step() -> Tensor:
        return model(static_ids, position_ids=static_pos, inference_params=inference_params,
                     num_last_tokens=decoding_seqlen).logits

    # Warm-up on a side stream (as torch.cuda.graphs requires): lazy initialisation, kernel compiles
    # and plan caches happen here, not inside the capture.
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(n_warmups):
            step()
        side.synchronize()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        static_logits = step()
    inference_params.seqlen_offset = offset_before
    lengths = inference_params.lengths_per_sample

    def run(input_ids: Tensor, position_ids: Tensor, seqlen: int) -> Tensor:
        lengths[:] = seqlen
        static_ids.copy_(input_ids)
        static_pos.copy_(position_ids)
        graph.replay()
        return static_logits.clone()

    run.graph = graph
    return run
