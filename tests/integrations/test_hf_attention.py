"""attn_implementation="culmen" for Hugging Face transformers: the attention and mask functions against a
float64 oracle written here, and tiny random models (no downloads) against transformers' eager attention
in training, padded batches and greedy generation with DynamicCache and StaticCache."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, StaticCache  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    bidirectional_mask_function,
    causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

import culmen.integrations.huggingface as culmen_hf  # noqa: E402
from culmen.integrations import hf_attention  # noqa: E402
from culmen.testing.tolerance import assert_close_tolerance, default_atol  # noqa: E402

V = 80


class _Attn(torch.nn.Module):
    """The attributes transformers' attention modules expose to the attention function."""

    def __init__(self, causal: bool = True):
        super().__init__()
        self.is_causal = causal


# --------------------------------------------------------------------------------------------- oracle


def oracle(q, k, v, keep, scale, softcap=0.0, dtype=torch.float64):
    """Attention in ``dtype`` for HF layouts ``q (B, h, sq, d)``, ``k``/``v`` ``(B, hk, sk, d)`` and a
    per-batch keep mask ``(B, sq, sk)``; rows that keep no key give 0. Returns ``(B, sq, h, d)``."""
    h, hk = q.shape[1], k.shape[1]
    qq, kk, vv = q.to(dtype), k.to(dtype).repeat_interleave(h // hk, 1), v.to(dtype).repeat_interleave(h // hk, 1)
    s = qq @ kk.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    keep = keep[:, None]
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0) * keep.any(-1, keepdim=True)
    return (p @ vv).transpose(1, 2)


def keep_mask(keymask, sq, causal=True, window=None):
    """``(B, sq, sk)``: queries are the ``sq`` positions ending at each row's last valid key."""
    B, sk = keymask.shape
    end = sk - keymask.flip(-1).to(torch.int8).argmax(-1)
    qpos = end[:, None] - sq + torch.arange(sq)[None]
    kpos = torch.arange(sk)[None, None]
    keep = keymask[:, None, :].expand(B, sq, sk).clone()
    if causal:
        keep &= kpos <= qpos[..., None]
    if window:
        keep &= kpos > qpos[..., None] - window
    return keep


def hf_inputs(B, h, hk, sq, sk, d, requires_grad=True):
    # transformers' layout: (B, heads, seq, d) views of (B, seq, heads, d) projections (non-contiguous).
    q = torch.randn(B, sq, h, d).transpose(1, 2)
    k = torch.randn(B, sk, hk, d).transpose(1, 2)
    v = torch.randn(B, sk, hk, d).transpose(1, 2)
    return [t.detach().requires_grad_(requires_grad) for t in (q, k, v)]


def check_fwd_bwd(out, q, k, v, keep, scale, softcap, rows=None):
    """Output and q/k/v gradients against the float64 oracle, fp32 oracle as the low-precision baseline."""
    g = torch.randn_like(out)
    if rows is not None:
        g = g * rows[:, :, None, None]
        out = out * rows[:, :, None, None]
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = {}
    for dt in (torch.float64, torch.float32):
        qq, kk, vv = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        o = oracle(qq, kk, vv, keep, scale, softcap, dt)
        if rows is not None:
            o = o * rows[:, :, None, None]
        refs[dt] = (o, *torch.autograd.grad(o, (qq, kk, vv), g.to(dt)))
    for name, a, hi, lo in zip(("out", "dq", "dk", "dv"), (out, *grads), refs[torch.float64], refs[torch.float32]):
        assert_close_tolerance(a, hi, lo, name=name)


# ---------------------------------------------------------------------------------- attention function


@pytest.mark.parametrize("window, softcap", [(None, 0.0), (3, 0.0), (None, 2.5), (4, 1.5)])
def test_dense_causal_gqa(window, softcap):
    q, k, v = hf_inputs(2, 6, 2, 11, 11, 24)
    out, w = hf_attention.culmen_attention_forward(_Attn(), q, k, v, None, scaling=0.3, sliding_window=window,
                                                   softcap=softcap)
    assert w is None and out.shape == (2, 11, 6, 24)
    keep = keep_mask(torch.ones(2, 11, dtype=torch.bool), 11, True, window)
    check_fwd_bwd(out, q, k, v, keep, 0.3, softcap)


def test_dense_decode_against_longer_keys_and_noncausal():
    q, k, v = hf_inputs(3, 4, 4, 1, 9, 16)
    out, _ = hf_attention.culmen_attention_forward(_Attn(), q, k, v, None, sliding_window=5)
    keep = keep_mask(torch.ones(3, 9, dtype=torch.bool), 1, True, 5)
    check_fwd_bwd(out, q, k, v, keep, 16 ** -0.5, 0.0)
    q, k, v = hf_inputs(2, 4, 2, 5, 5, 16)
    out, _ = hf_attention.culmen_attention_forward(_Attn(causal=True), q, k, v, None, is_causal=False)
    check_fwd_bwd(out, q, k, v, torch.ones(2, 5, 5, dtype=torch.bool), 16 ** -0.5, 0.0)


@pytest.mark.parametrize("window, softcap", [(None, 0.0), (3, 2.0)])
def test_padded_batch_unpadded_varlen(window, softcap):
    B, S = 3, 10
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    mask[2, 7:] = False  # right padding
    q, k, v = hf_inputs(B, 4, 2, S, S, 16)
    out, _ = hf_attention.culmen_attention_forward(_Attn(), q, k, v, mask, scaling=0.2, sliding_window=window,
                                                   softcap=softcap)
    # Every token sees the valid keys at or before it (positions, not counts: q == k here).
    keep = mask[:, None, :] & torch.ones(S, S, dtype=torch.bool).tril()[None]
    if window:
        keep &= ~torch.ones(S, S, dtype=torch.bool).tril(-window)[None]
    check_fwd_bwd(out, q, k, v, keep, 0.2, softcap, rows=mask.to(torch.float32))
    assert torch.all(out[~mask] == 0)  # padding rows are written (zeros), never left as garbage


@pytest.mark.parametrize("sq", [1, 3])
def test_cache_path_leftpad_and_static_tail(sq):
    """q_len < kv_len without autograd (generate): per-row key ranges from the 2-D mask, including a
    StaticCache's unfilled tail, through flash_attn_with_kvcache."""
    B, sk = 3, 12
    mask = torch.zeros(B, sk, dtype=torch.bool)
    mask[0, 2:8] = True  # left padding 2, unfilled tail from 8
    mask[1, 0:8] = True
    mask[2, 5:12] = True  # full to the end (a DynamicCache row)
    q, k, v = hf_inputs(B, 4, 2, sq, sk, 16, requires_grad=False)
    with torch.no_grad():
        k[0, :, 8:] = 1e4  # garbage in the unfilled slots must not be read
        out, _ = hf_attention.culmen_attention_forward(_Attn(), q, k, v, mask, sliding_window=6, softcap=3.0)
    keep = keep_mask(mask, sq, True, 6)
    want = oracle(q, k, v, keep, 16 ** -0.5, 3.0)
    assert_close_tolerance(out, want, oracle(q, k, v, keep, 16 ** -0.5, 3.0, torch.float32), name="out")


def test_cache_path_with_autograd_falls_back_to_dense_mask():
    B, sq, sk = 2, 3, 8
    mask = torch.ones(B, sk, dtype=torch.bool)
    mask[0, :2] = False
    q, k, v = hf_inputs(B, 4, 2, sq, sk, 8)
    out, _ = hf_attention.culmen_attention_forward(_Attn(), q, k, v, mask, sliding_window=4)
    check_fwd_bwd(out, q, k, v, keep_mask(mask, sq, True, 4), 8 ** -0.5, 0.0)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_four_d_masks_use_the_sdpa_fallback(softcap):
    B, S = 2, 7
    keep = torch.rand(B, S, S) > 0.4
    keep[:, :, 0] = True
    keep[1, 3] = False  # a row that sees nothing: 0 out, never NaN
    q, k, v = hf_inputs(B, 4, 2, S, S, 8)
    out, _ = hf_attention.culmen_attention_forward(_Attn(), q, k, v, keep[:, None], softcap=softcap)
    assert torch.isfinite(out).all()
    rows = torch.ones(B, S)
    rows[1, 3] = 0.0
    check_fwd_bwd(out, q, k, v, keep, 8 ** -0.5, softcap, rows=rows)
    additive = torch.zeros(B, 1, S, S).masked_fill(~keep[:, None], torch.finfo(torch.float32).min)
    out2, _ = hf_attention.culmen_attention_forward(_Attn(), q, k, v, additive, softcap=softcap)
    torch.testing.assert_close(out2 * rows[:, :, None, None], out * rows[:, :, None, None])


def test_packed_cu_seq_lens_kwargs():
    lens = [4, 2, 5]
    cu = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q, k, v = hf_inputs(1, 4, 2, 11, 11, 8)
    out, _ = hf_attention.culmen_attention_forward(_Attn(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                                   max_length_q=5, max_length_k=5)
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    keep = (seg[:, None] == seg[None, :]) & torch.ones(11, 11, dtype=torch.bool).tril()
    check_fwd_bwd(out, q, k, v, keep[None], 8 ** -0.5, 0.0)


@pytest.mark.parametrize("path", ["dense", "varlen", "fallback"])
def test_dropout_in_training(path):
    """Dropout reaches the kernels: seeded runs repeat, differ from no dropout, and stay finite."""
    q, k, v = hf_inputs(2, 4, 2, 8, 8, 16)
    mask = None
    if path == "varlen":
        mask = torch.ones(2, 8, dtype=torch.bool)
        mask[0, :3] = False
    elif path == "fallback":
        mask = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    runs = []
    for p in (0.4, 0.4, 0.0):
        torch.manual_seed(7)
        out, _ = hf_attention.culmen_attention_forward(_Attn(), q, k, v, mask, dropout=p)
        runs.append(out)
    valid = mask[:, :, None, None] if path == "varlen" else 1.0  # padding rows are 0 either way
    assert torch.equal(runs[0], runs[1]) and torch.isfinite(runs[0]).all()
    assert not torch.allclose(runs[0] * valid, runs[2] * valid)
    (dq,) = torch.autograd.grad(runs[0].sum(), (q,))
    assert torch.isfinite(dq).all() and dq.abs().sum() > 0


def test_from_pretrained_round_trip(tmp_path):
    mod, ref = pair("llama")
    culmen_hf.patch(mod)
    mod.save_pretrained(tmp_path)  # a patched model saves as the plain architecture
    back = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="culmen")
    assert back.config._attn_implementation == "culmen" and type(back) is type(ref)
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        a, b = back(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert_close_tolerance(a[valid], b[valid], None, name="logits")


def test_bad_two_d_mask_raises():
    q, k, v = hf_inputs(1, 2, 2, 3, 3, 8, requires_grad=False)
    with pytest.raises(ValueError, match="attention_mask"):
        hf_attention.culmen_attention_forward(_Attn(), q, k, v, torch.ones(1, 3))


def test_kernels_under_the_interpreter(triton_backend):
    """The same paths through culmen's Triton kernels (TRITON_INTERPRET on CPU)."""
    q, k, v = hf_inputs(2, 4, 2, 6, 6, 16)
    out, _ = hf_attention.culmen_attention_forward(_Attn(), q, k, v, None, sliding_window=3, softcap=2.0)
    check_fwd_bwd(out, q, k, v, keep_mask(torch.ones(2, 6, dtype=torch.bool), 6, True, 3), 0.25, 2.0)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :2] = False
    q, k, v = hf_inputs(2, 4, 2, 6, 6, 16)
    out, _ = hf_attention.culmen_attention_forward(_Attn(), q, k, v, mask)
    keep = mask[:, None, :] & torch.ones(6, 6, dtype=torch.bool).tril()[None]
    check_fwd_bwd(out, q, k, v, keep, 0.25, 0.0, rows=mask.float())
    q, k, v = hf_inputs(2, 4, 2, 1, 9, 16, requires_grad=False)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, 7:] = False
    with torch.no_grad():
        out, _ = hf_attention.culmen_attention_forward(_Attn(), q, k, v, mask)
    keep = keep_mask(mask, 1)
    assert_close_tolerance(out, oracle(q, k, v, keep, 0.25), oracle(q, k, v, keep, 0.25, 0.0, torch.float32))


# --------------------------------------------------------------------------------------- mask function


def _mask(**kw):
    base = dict(batch_size=2, q_length=4, kv_length=4, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                attention_mask=None, allow_is_causal_skip=True, dtype=torch.float32, config=None, use_vmap=False,
                device=torch.device("cpu"))
    base.update(kw)
    return hf_attention.culmen_attention_mask(**base)


def test_mask_function_outputs():
    assert _mask() is None
    assert _mask(attention_mask=torch.ones(2, 4, dtype=torch.bool)) is None
    pad = torch.tensor([[False, True, True, True], [True, True, True, True]])
    assert torch.equal(_mask(attention_mask=pad), pad)
    assert _mask(mask_function=sliding_window_causal_mask_function(2), local_size=2) is None
    # A DynamicCache decode step: kv_length = past + 1, keys aligned with the 2-D mask.
    dec = torch.tensor([[False, True, True, True, True], [True] * 5])
    assert torch.equal(_mask(q_length=1, kv_length=5, q_offset=4, attention_mask=dec), dec)
    # A sliding cache returns keys from kv_offset on.
    got = _mask(q_length=1, kv_length=3, q_offset=4, kv_offset=2, attention_mask=dec,
                mask_function=sliding_window_causal_mask_function(3))
    assert got is None  # every key of the window is valid
    # A StaticCache: the offset is a tensor and slots past the written tokens are excluded.
    got = _mask(q_length=2, kv_length=8, q_offset=torch.tensor(3), attention_mask=torch.ones(2, 5, dtype=torch.bool))
    assert torch.equal(got, torch.tensor([[True] * 5 + [False] * 3] * 2))
    got = _mask(q_length=1, kv_length=8, q_offset=torch.tensor(2), attention_mask=None)
    assert torch.equal(got, torch.tensor([[True] * 3 + [False] * 5] * 2))


def test_mask_function_older_cache_position_convention():
    """transformers before 5.4 passes the query positions (``cache_position``) instead of q_length/q_offset."""
    pad = torch.tensor([[False, True, True, True], [True, True, True, True]])
    old = dict(batch_size=2, kv_offset=0, mask_function=causal_mask_function, allow_is_causal_skip=True,
               dtype=torch.float32, config=None)
    assert hf_attention.culmen_attention_mask(cache_position=torch.arange(4), kv_length=4, **old) is None
    got = hf_attention.culmen_attention_mask(cache_position=torch.arange(4), kv_length=4, attention_mask=pad, **old)
    assert torch.equal(got, pad)
    # Decoding position 4 of a static cache of 8 slots: slots 5.. are unfilled.
    got = hf_attention.culmen_attention_mask(cache_position=torch.tensor([4]), kv_length=8,
                                             attention_mask=torch.ones(2, 5, dtype=torch.bool), **old)
    assert torch.equal(got, torch.tensor([[True] * 5 + [False] * 3] * 2))


def test_mask_function_falls_back_to_a_dense_mask():
    custom = lambda b, h, q, kv: (kv <= q) & (kv != 1)  # noqa: E731
    got = _mask(mask_function=custom)
    want = sdpa_mask(batch_size=2, q_length=4, kv_length=4, mask_function=custom, allow_is_causal_skip=False)
    assert got.shape == (2, 1, 4, 4) and torch.equal(got, want)
    got = _mask(mask_function=bidirectional_mask_function)
    assert got.shape == (2, 1, 4, 4) and bool(got.all())


def test_register_is_idempotent_and_visible_to_transformers():
    assert culmen_hf.is_registered()
    assert culmen_hf.register() == "culmen" and culmen_hf.register() == "culmen"
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert AttentionInterface()["culmen"] is hf_attention.culmen_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["culmen"] is hf_attention.culmen_attention_mask


# ------------------------------------------------------------------------------------------ tiny models


def tiny_config(family: str):
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=40, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
                  bos_token_id=1, eos_token_id=None)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=4)
    return transformers.Gemma2Config(**common, head_dim=8, sliding_window=4, query_pre_attn_scalar=12,
                                     attn_logit_softcapping=4.0, final_logit_softcapping=5.0)


def pair(family: str, dtype=torch.float32, device="cpu"):
    """(culmen-attention model, eager model) with the same weights."""
    cfg = tiny_config(family)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    mod = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="culmen")
    mod.load_state_dict(ref.state_dict())
    return mod.to(device, dtype), ref.to(device, dtype)


def _oracle_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, **kwargs):
    """This file's oracle as a transformers attention function (4-D bool masks from ``_oracle_mask``)."""
    keep = attention_mask[:, 0] if attention_mask is not None else None
    if keep is None:
        sq, sk = query.shape[2], key.shape[2]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)[None]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return oracle(query, key, value, keep, scale, softcap or 0.0, query.dtype), None


def _oracle_mask(**kwargs):
    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(allow_is_causal_skip=False, **kwargs)


transformers.AttentionInterface.register("culmen_test_oracle", _oracle_attention)
transformers.masking_utils.AttentionMaskInterface.register("culmen_test_oracle", _oracle_mask)


def hi_copy(ref, dtype=torch.float64):
    """The high-precision reference model: this file's oracle attention (transformers' eager attention adds
    finfo.min to masked scores, which overflows to -inf in float64 on padding rows and spreads NaN)."""
    hi = copy.deepcopy(ref).to(dtype)
    hi.set_attn_implementation("culmen_test_oracle")
    return hi


def padded_batch(B=3, S=9, device="cpu"):
    ids = torch.randint(3, V, (B, S), device=device)
    mask = torch.ones(B, S, dtype=torch.long, device=device)
    mask[0, :3] = 0
    mask[-1, S - 2:] = 0
    # No label is predicted from a padding position (those outputs differ between implementations).
    prev = torch.nn.functional.pad(mask[:, :-1], (1, 0))
    labels = ids.masked_fill((mask == 0) | (prev == 0), -100)
    return ids, mask, labels


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_model_training_padded_matches_eager(family):
    mod, ref = pair(family)
    hi = hi_copy(ref)
    ids, mask, labels = padded_batch()
    outs = {}
    for name, m in (("culmen", mod), ("eager", ref), ("hi", hi)):
        m.train()
        o = m(ids, attention_mask=mask, labels=labels)
        o.loss.backward()
        outs[name] = o
    valid = mask.bool()
    assert_close_tolerance(outs["culmen"].logits[valid], outs["hi"].logits[valid], outs["eager"].logits[valid],
                           name="logits")
    assert_close_tolerance(outs["culmen"].loss, outs["hi"].loss, outs["eager"].loss, name="loss")
    for (n, p), p_ref, p_hi in zip(mod.named_parameters(), ref.parameters(), hi.parameters()):
        assert_close_tolerance(p.grad, p_hi.grad, p_ref.grad, name=n)


def _prompt(device="cpu"):
    ids = torch.randint(3, V, (3, 7), device=device)
    mask = torch.ones(3, 7, dtype=torch.long, device=device)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("cache", [None, "static"])
def test_model_generate_matches_eager(family, cache):
    mod, ref = pair(family)
    ids, mask = _prompt()
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation=cache)
    for m in (mod.eval(), ref.eval()):
        m.generation_config.pad_token_id = 0
    want = ref.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(mod.generate(ids, attention_mask=mask, **kw), want)
    nopad = torch.ones_like(mask)
    assert torch.equal(mod.generate(ids, attention_mask=nopad, **kw), ref.generate(ids, attention_mask=nopad, **kw))


def decode_logits(model, ids, mask, steps, cache):
    """Prefill then one token at a time (teacher forced with ``steps`` (B, n)), through ``cache``; returns the
    logits of each step's last position ``(n + 1, B, V)``."""
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = [model(ids, attention_mask=mask, position_ids=pos, use_cache=True, **{key: cache}).logits[:, -1]]
    for t in range(steps.shape[1]):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], -1)
        pos = pos[:, -1:] + 1
        out.append(model(steps[:, t:t + 1], attention_mask=mask, position_ids=pos, use_cache=True,
                         **{key: cache}).logits[:, -1])
    return torch.stack(out)


def static_cache(model, max_len):
    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # older signatures take the batch size and device up front
        return StaticCache(config=model.config, max_batch_size=3, max_cache_len=max_len,
                           device=model.device, dtype=model.dtype)


def test_teacher_forced_decoding_static_and_dynamic_caches():
    mod, ref = pair("gemma2")
    hi = hi_copy(ref)
    ids, mask = _prompt()
    steps = torch.randint(3, V, (3, 4))
    with torch.no_grad():
        want = decode_logits(hi.eval(), ids, mask, steps, transformers.DynamicCache())
        base = decode_logits(ref.eval(), ids, mask, steps, transformers.DynamicCache())
        for cache in (transformers.DynamicCache(), static_cache(mod, 16)):
            got = decode_logits(mod.eval(), ids, mask, steps, cache)
            assert_close_tolerance(got, want, base, name=type(cache).__name__)


def test_packed_position_ids_use_the_dense_fallback():
    mod, ref = pair("llama")
    ids = torch.randint(3, V, (1, 10))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    with torch.no_grad():
        a = mod(ids, position_ids=pos).logits
        b = ref(ids, position_ids=pos).logits
        c = hi_copy(ref)(ids, position_ids=pos).logits
    assert_close_tolerance(a, c, b, name="logits")


# ------------------------------------------------------------------------------------------------- GPU


def bf16_training_and_decoding(family, device):
    """bf16 model with culmen attention vs the same in eager bf16, both against an fp32 oracle model:
    loss and logits under the tolerance rule, gradients as one vector in the L2 norm (a whole bf16 model's
    gradients are chaotic entry by entry, see test_hf_patch.check_training), then decoding through a
    StaticCache, teacher-forced, against DynamicCache decoding of the references."""
    mod, ref = pair(family, torch.bfloat16, device)
    hi = hi_copy(ref, torch.float32)
    ids, mask, labels = padded_batch(device=device)
    outs = {}
    for name, m in (("culmen", mod), ("eager", ref), ("hi", hi)):
        m.train()
        o = m(ids, attention_mask=mask, labels=labels)
        o.loss.backward()
        outs[name] = o
    valid = mask.bool()
    assert_close_tolerance(outs["culmen"].logits[valid], outs["hi"].logits[valid], outs["eager"].logits[valid],
                           name="logits")
    assert_close_tolerance(outs["culmen"].loss, outs["hi"].loss, outs["eager"].loss, name="loss",
                           atol=default_atol(torch.bfloat16) * max(1.0, abs(outs["hi"].loss.item())))
    a, h, r = (torch.cat([p.grad.double().flatten() for p in m.parameters()]) for m in (mod, hi, ref))
    err, base = (a - h).norm().item(), (r - h).norm().item()
    assert err <= 2 * base + 0.02 * h.norm().item(), f"gradients: |culmen - hi| = {err:.4g}, |eager - hi| = {base:.4g}"
    pids, pmask = _prompt(device)
    steps = torch.randint(3, V, (3, 4), device=device)
    with torch.no_grad():
        want = decode_logits(hi.eval(), pids, pmask, steps, transformers.DynamicCache())
        base = decode_logits(ref.eval(), pids, pmask, steps, transformers.DynamicCache())
        got = decode_logits(mod.eval(), pids, pmask, steps, static_cache(mod, 16))
    assert_close_tolerance(got, want, base, name="static cache logits")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gpu_bf16_training_and_static_cache_decoding(family):
    bf16_training_and_decoding(family, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [None, "static"])
def test_gpu_fp32_generate_matches_eager(cache):
    mod, ref = pair("mistral", torch.float32, "cuda")
    ids, mask = _prompt("cuda")
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation=cache)
    for m in (mod.eval(), ref.eval()):
        m.generation_config.pad_token_id = 0
    assert torch.equal(mod.generate(ids, attention_mask=mask, **kw), ref.generate(ids, attention_mask=mask, **kw))
