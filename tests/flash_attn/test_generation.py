"""``culmen.flash_attn.utils.generation``: the logit filters and ``sample`` against their formulas, and
``decode`` / ``decode_speculative`` against step-by-step full-recompute loops.

The decoding tests use a small causal LM defined here (learned positions, one attention layer with a
KV cache in ``InferenceParams``), so the decoding protocol is tested on its own; the GPT model's
decoding is tested in ``test_models_gpt.py``.
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from culmen.flash_attn.utils.generation import (
    DecodingCGCache,
    GenerationMixin,
    GreedySearchDecoderOnlyOutput,
    InferenceParams,
    SampleDecoderOnlyOutput,
    allocate_inference_cache,
    decode,
    decode_speculative,
    modify_logit_for_repetition_penalty,
    modify_logits_for_top_k_filtering,
    modify_logits_for_top_p_filtering,
    sample,
    sample_speculative,
)

Out = namedtuple("Out", ["logits"])


class ToyLM(nn.Module, GenerationMixin):
    """Causal LM with one attention layer whose K/V live in ``inference_params`` (float64)."""

    def __init__(self, vocab: int = 29, dim: int = 12, max_pos: int = 48, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Parameter(torch.randn(vocab, dim, generator=g, dtype=torch.float64))
        self.pos = nn.Parameter(torch.randn(max_pos, dim, generator=g, dtype=torch.float64))
        self.wqkv = nn.Parameter(torch.randn(3 * dim, dim, generator=g, dtype=torch.float64) / dim**0.5)
        self.head = nn.Parameter(torch.randn(vocab, dim, generator=g, dtype=torch.float64) * 2)
        self.calls = []

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0):
        b, s = input_ids.shape
        offset = inference_params.seqlen_offset if inference_params is not None else 0
        self.calls.append((s, offset, position_ids is None))
        if position_ids is None:
            position_ids = torch.arange(offset, offset + s).expand(b, s)
        x = self.emb[input_ids] + self.pos[position_ids]
        q, k, v = F.linear(x, self.wqkv).chunk(3, dim=-1)
        if inference_params is not None:
            cache = inference_params.key_value_memory_dict.setdefault(
                0, torch.full((inference_params.max_batch_size, inference_params.max_seqlen, 2, x.shape[-1]),
                              float("nan"), dtype=x.dtype))
            cache[:b, offset:offset + s, 0] = k
            cache[:b, offset:offset + s, 1] = v
            k, v = cache[:b, :offset + s, 0], cache[:b, :offset + s, 1]
        total = k.shape[1]
        mask = torch.ones(s, total, dtype=torch.bool).tril(diagonal=total - s)
        att = (q @ k.transpose(1, 2) / x.shape[-1] ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1)
        logits = F.linear(torch.tanh(x + att @ v), self.head)
        if num_last_tokens > 0:
            logits = logits[:, -num_last_tokens:]
        return Out(logits)


def full_recompute_greedy(model, ids, max_length, eos=None, penalty=1.0, vocab_size=None):
    """Reference: re-run the whole sequence every step and take the argmax of the last logits."""
    scores = []
    with torch.no_grad():
        while ids.shape[1] < max_length:
            logits = model(ids).logits[:, -1]
            if vocab_size is not None:
                logits = logits[:, :vocab_size]
            scores.append(logits)
            chosen = logits.clone()
            if penalty != 1.0:
                for r in range(ids.shape[0]):
                    for t in set(ids[r].tolist()):
                        chosen[r, t] = chosen[r, t] * penalty if chosen[r, t] < 0 else chosen[r, t] / penalty
            ids = torch.cat([ids, chosen.argmax(-1, keepdim=True)], dim=1)
            if eos is not None and bool((ids[:, -1] == eos).all()):
                break
    return ids, scores


# ---------------------------------------------------------------------------------------------------
# Logit filters and sample()
# ---------------------------------------------------------------------------------------------------

def test_top_k_filtering_formula_with_ties():
    logits = torch.randn(5, 37)
    logits[2, :4] = logits[2].max() + 1  # four-way tie at the top
    for k in (1, 4, 7, 37):
        got = logits.clone()
        modify_logits_for_top_k_filtering(got, k)
        for r in range(5):
            kth = sorted(logits[r].tolist(), reverse=True)[k - 1]
            want = torch.where(logits[r] >= kth, logits[r], torch.tensor(float("-inf")))
            assert torch.equal(got[r], want), (k, r)
        # Ties with the k-th value are all kept.
        assert int(torch.isfinite(got[2]).sum()) >= min(max(k, 4), 37)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_filtering_keeps_smallest_nucleus(top_p):
    logits = torch.randn(6, 41) * 3
    got = logits.clone()
    modify_logits_for_top_p_filtering(got, top_p)
    probs = logits.double().softmax(-1)
    for r in range(6):
        order = probs[r].argsort(descending=True)
        cum = probs[r][order].cumsum(0)
        # Smallest prefix (by decreasing probability) whose mass exceeds top_p (within rounding).
        n_keep = int((cum < top_p - 1e-6).sum()) + 1
        keep = torch.zeros(41, dtype=torch.bool)
        keep[order[:n_keep]] = True
        assert torch.equal(torch.isfinite(got[r]), keep), (r, n_keep)
        assert torch.equal(got[r][keep], logits[r][keep])


def test_top_p_filtering_off_values_leave_logits():
    logits = torch.randn(3, 11)
    for top_p in (0.0, 1.0):
        got = logits.clone()
        modify_logits_for_top_p_filtering(got, top_p)
        assert torch.equal(got, logits)


def test_repetition_penalty_formula_counts_each_token_once():
    logits = torch.randn(3, 13)
    prev = torch.tensor([[1, 1, 5, 12], [0, 0, 0, 0], [3, 4, 5, 3]])
    got = modify_logit_for_repetition_penalty(logits.clone(), prev, 1.7)
    want = logits.clone()
    for r in range(3):
        for t in set(prev[r].tolist()):
            want[r, t] = logits[r, t] * 1.7 if logits[r, t] < 0 else logits[r, t] / 1.7
    assert torch.equal(got, want)
    same = logits.clone()
    assert modify_logit_for_repetition_penalty(same, prev, 1.0) is same and torch.equal(same, logits)
    with pytest.raises(ValueError, match="repetition_penalty"):
        modify_logit_for_repetition_penalty(logits.clone(), prev, 0.0)


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def _expected_probs(row: torch.Tensor, top_k: int, top_p: float, temperature: float) -> torch.Tensor:
    """The distribution sample() draws from, by the formula: top-k, temperature, nucleus, softmax."""
    x = row.double().clone()
    if top_k > 0:
        kth = x.topk(top_k).values[-1]
        x[x < kth] = float("-inf")
    x = x / temperature
    if 0 < top_p < 1:
        p = x.softmax(-1)
        order = p.argsort(descending=True)
        n_keep = int((p[order].cumsum(0) < top_p).sum()) + 1
        drop = torch.ones_like(p, dtype=torch.bool)
        drop[order[:n_keep]] = False
        x[drop] = float("-inf")
    return x.softmax(-1)


@pytest.mark.parametrize("top_k,top_p,temperature", [(0, 0.0, 1.0), (4, 0.0, 0.7), (0, 0.8, 1.3), (5, 0.6, 0.5)])
def test_sample_distribution_matches_formula(top_k, top_p, temperature):
    vocab, n = 9, 40000
    row = torch.tensor([1.2, -0.3, 0.8, 2.0, 0.1, -1.5, 0.9, 1.6, -0.2])
    logits = row.expand(n, vocab).clone()
    before = logits.clone()
    tokens = sample(logits, top_k=top_k, top_p=top_p, temperature=temperature)
    assert torch.equal(logits, before), "sample must not modify its input"
    assert tokens.shape == (n,) and tokens.dtype == torch.int64
    want = _expected_probs(row, top_k, top_p, temperature)
    got = _frequencies(tokens, vocab)
    assert torch.all(got[want == 0] == 0), "a filtered-out token was sampled"
    assert (got - want).abs().max() < 0.015, (got, want)


def test_sample_greedy_is_argmax_and_bad_arguments():
    logits = torch.randn(7, 50)
    assert torch.equal(sample(logits), logits.argmax(-1))
    assert torch.equal(sample(logits, top_k=1, top_p=0.3, temperature=0.0), logits.argmax(-1))
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, top_k=0, top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, top_k=5, temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        sample(logits, top_k=-2)


# ---------------------------------------------------------------------------------------------------
# decode()
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch,prompt,max_length", [(1, 1, 9), (3, 5, 17)])
def test_greedy_decode_equals_full_recompute(batch, prompt, max_length):
    model = ToyLM()
    ids = torch.randint(0, 29, (batch, prompt))
    out = decode(ids, model, max_length)
    calls = list(model.calls)
    want, want_scores = full_recompute_greedy(model, ids, max_length)
    assert isinstance(out, GreedySearchDecoderOnlyOutput)
    assert torch.equal(out.sequences, want)
    assert len(out.scores) == max_length - prompt
    for got, ref in zip(out.scores, want_scores):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    # The prompt ran once without position ids, then one token per call at increasing offsets.
    assert calls[0] == (prompt, 0, True)
    assert [c[:2] for c in calls[1:]] == [(1, prompt + i) for i in range(max_length - prompt - 1)]


def test_decode_vocab_size_and_repetition_penalty():
    model = ToyLM()
    ids = torch.randint(0, 20, (2, 4))
    out = decode(ids, model, 14, vocab_size=20, repetition_penalty=3.0)
    want, want_scores = full_recompute_greedy(model, ids, 14, penalty=3.0, vocab_size=20)
    assert torch.equal(out.sequences, want)
    assert all(s.shape == (2, 20) for s in out.scores)
    # The recorded scores are the raw logits, before the penalty.
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(want_scores), rtol=1e-12, atol=1e-12)
    plain = decode(ids, model, 14, vocab_size=20).sequences
    assert not torch.equal(plain, out.sequences), "the penalty changed nothing (weak test data)"


def test_decode_teacher_forcing():
    model = ToyLM()
    ids = torch.randint(0, 29, (2, 3))
    teacher = torch.randint(0, 29, (2, 8))
    teacher[:, :3] = ids
    out = decode(ids, model, 12, teacher_outputs=teacher)
    # Tokens 3..7 come from the teacher; 8.. are the model's greedy continuation of that prefix.
    assert torch.equal(out.sequences[:, :8], teacher)
    want, want_scores = full_recompute_greedy(model, teacher, 12)
    assert torch.equal(out.sequences, want)
    ref_scores = [model(teacher[:, :t]).logits[:, -1] for t in range(3, 8)] + want_scores
    for got, ref in zip(out.scores, ref_scores):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_decode_stops_at_eos():
    model = ToyLM()
    ids = torch.randint(0, 29, (1, 3))
    full = decode(ids, model, 20).sequences
    eos = int(full[0, 6])
    first = int((full[0, 3:] == eos).nonzero()[0]) + 3
    out = decode(ids, model, 20, eos_token_id=eos)
    assert torch.equal(out.sequences, full[:, :first + 1])
    assert out.sequences[0, -1] == eos and out.sequences.shape[1] < 20
    # A batch stops only once every row's latest token is eos.
    two = torch.cat([ids, torch.randint(0, 29, (1, 3))])
    seqs = decode(two, model, 20, eos_token_id=eos).sequences
    assert seqs.shape[1] == 20 or bool((seqs[:, -1] == eos).all())


def test_sampled_decode_reproducible_and_generate():
    model = ToyLM()
    ids = torch.randint(0, 29, (2, 3))
    torch.manual_seed(5)
    a = decode(ids, model, 11, top_k=0, top_p=0.9, temperature=0.8)
    torch.manual_seed(5)
    b = model.generate(ids, 11, top_k=0, top_p=0.9, temperature=0.8, return_dict_in_generate=True,
                       output_scores=True)
    assert isinstance(a, SampleDecoderOnlyOutput) and torch.equal(a.sequences, b.sequences)
    assert len(b.scores) == 8
    seqs = model.generate(ids, 11)
    assert torch.equal(seqs, decode(ids, model, 11).sequences)
    assert model.generate(ids, 11, return_dict_in_generate=True).scores is None


def test_decode_bad_arguments():
    model = ToyLM()
    ids = torch.randint(0, 29, (2, 5))
    with pytest.raises(ValueError, match="max_length"):
        decode(ids, model, 5)
    with pytest.raises(ValueError, match="input_ids"):
        decode(ids[0], model, 9)
    with pytest.raises(ValueError, match="cg=True"):
        decode(ids, model, 9, cg=True)
    with pytest.raises(ValueError, match="top_p"):
        decode(ids, model, 9, top_k=0, top_p=2.0)


def test_decode_enable_timing_on_cpu(capsys):
    decode(torch.randint(0, 29, (1, 2)), ToyLM(), 5, enable_timing=True)
    assert "decoding time" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------------

def test_sample_speculative_greedy_accept_and_reject():
    logits = torch.randn(2, 4, 10)
    target = logits.argmax(-1)
    logits_draft = logits[:, :3].clone()
    wrong = int(target[1, 1] + 1) % 10
    logits_draft[1, 1, wrong] = 100.0  # the draft's greedy choice differs from the target's here
    draft = logits_draft.argmax(-1)
    tokens, n = sample_speculative(logits, logits_draft, draft)
    assert n.tolist() == [4, 2]
    assert torch.equal(tokens[0], target[0])
    assert torch.equal(tokens[1, :2], target[1, :2])


def test_sample_speculative_output_follows_target_distribution():
    n, vocab = 40000, 6
    p_logits = torch.tensor([0.5, 1.5, -0.5, 0.2, 1.0, -1.0])
    q_logits = torch.tensor([1.5, 0.0, 0.5, 0.2, -0.5, 1.0])
    logits = torch.stack([p_logits, p_logits]).expand(n, 2, vocab).clone()
    logits_draft = q_logits.expand(n, 1, vocab).clone()
    drafts = torch.multinomial(q_logits.softmax(-1), n, replacement=True).view(n, 1)
    tokens, count = sample_speculative(logits, logits_draft, drafts, top_k=0)
    first = tokens[:, 0]
    got = _frequencies(first, vocab)
    assert (got - p_logits.double().softmax(-1)).abs().max() < 0.015, got
    assert set(count.unique().tolist()) <= {1, 2}


def test_sample_speculative_bad_arguments():
    logits = torch.randn(1, 3, 5)
    with pytest.raises(ValueError, match="logits_draft"):
        sample_speculative(logits, torch.randn(1, 3, 5), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="tokens_draft"):
        sample_speculative(logits, torch.randn(1, 2, 5), torch.zeros(1, 2))


@pytest.mark.parametrize("lookahead", [1, 3])
def test_decode_speculative_greedy_equals_greedy(lookahead):
    model = ToyLM()
    ids = torch.randint(0, 29, (1, 4))
    want = decode(ids, model, 19)
    same = decode_speculative(ids, model, model, 19, speculative_lookahead=lookahead)
    assert torch.equal(same.sequences, want.sequences)
    torch.testing.assert_close(same.scores, torch.stack(want.scores, dim=1), rtol=1e-10, atol=1e-10)
    # A different draft model changes how many tokens each round keeps, never the result.
    other = decode_speculative(ids, model, ToyLM(seed=3), 19, speculative_lookahead=lookahead)
    assert torch.equal(other.sequences, want.sequences)
    assert other.scores.shape == (1, 15, 29)


def test_decode_speculative_bad_arguments():
    model = ToyLM()
    with pytest.raises(ValueError, match="batch size 1"):
        decode_speculative(torch.zeros(2, 3, dtype=torch.long), model, model, 9)
    with pytest.raises(ValueError, match="eos_token_id"):
        decode_speculative(torch.zeros(1, 3, dtype=torch.long), model, model, 9, eos_token_id=2)


# ---------------------------------------------------------------------------------------------------
# Cache helpers
# ---------------------------------------------------------------------------------------------------

def test_inference_params_reset_and_allocate_inference_cache():
    params = InferenceParams(max_seqlen=10, max_batch_size=2, seqlen_offset=7,
                             lengths_per_sample=torch.full((2,), 7, dtype=torch.int32))
    params.reset(20, 3)
    assert (params.max_seqlen, params.max_batch_size, params.seqlen_offset) == (20, 3, 0)
    assert params.lengths_per_sample.tolist() == [0, 0]
    caches = allocate_inference_cache(3, 11, 4, 8, 2, "cpu", dtype=torch.bfloat16)
    assert sorted(caches) == [0, 1]
    assert caches[0].shape == (3, 11, 2, 4, 8) and caches[1].dtype == torch.bfloat16
    assert sorted(allocate_inference_cache(1, 2, 1, 8, [3, 5], "cpu")) == [3, 5]
    with pytest.raises(TypeError, match="dtype"):
        allocate_inference_cache(1, 2, 1, 8, 1, "cpu", dtype=torch.int32)
    assert DecodingCGCache().callables == {}
    with pytest.raises(NotImplementedError):
        GenerationMixin().allocate_inference_cache(1, 2)
