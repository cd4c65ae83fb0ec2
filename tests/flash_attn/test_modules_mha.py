"""``culmen.flash_attn.modules.mha``: ``MHA`` (plain and flash paths, GQA, cross-attention, partial rotary,
ALiBi, sliding window, dwconv, fused dense, return_residual, checkpointing, varlen) against float64 formulas
written out here (tolerance rule, gradients of the input and every parameter), ``SelfAttention`` /
``CrossAttention`` with padding masks, token-by-token decoding through a duck-typed ``inference_params``
equal to the full forward, flash_attn's state_dict keys and the argument errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from culmen.flash_attn.modules.mha import (
    MHA,
    CrossAttention,
    FlashSelfAttention,
    LinearResidual,
    SelfAttention,
    get_alibi_slopes,
)
from culmen.testing import assert_close_tolerance, randn
from culmen.testing.attention import plain

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
E, H, D = 32, 4, 8  # embed dim, heads, head dim


# ----------------------------------------------------------------------------- helpers


def _rope(x, rd, interleaved, base=10000.0, offset=0):
    """Rotary embedding of the first ``rd`` dims of ``x`` ``(B, S, H, D)`` at positions offset.."""
    if rd == 0:
        return x
    inv = 1.0 / base ** (torch.arange(0, rd, 2, dtype=F64, device=x.device) / rd)
    ang = torch.outer(torch.arange(offset, offset + x.shape[1], dtype=F64, device=x.device), inv)
    cos, sin = ang.cos().to(x.dtype)[:, None], ang.sin().to(x.dtype)[:, None]
    xr, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    else:
        a, b = xr.chunk(2, -1)
        rot = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    return torch.cat([rot, rest], -1)


def _dwconv(t, w, b):
    return F.conv1d(t.transpose(1, 2), w, b, padding=2, groups=t.shape[-1])[..., :-2].transpose(1, 2)


def mha_ref(p, x, dtype, nh=H, nkv=H, causal=False, rd=0, interleaved=False, alibi=None, window=(-1, -1),
            x_kv=None, dwconv=False):
    """MHA written out: projections, optional causal depthwise conv, rotary, attention, output projection."""
    d = E // nh
    if "Wqkv.weight" in p:
        qkv = F.linear(x, p["Wqkv.weight"], p.get("Wqkv.bias"))
        if dwconv and "dwconv_qkv.weight" in p:
            qkv = _dwconv(qkv, p["dwconv_qkv.weight"], p["dwconv_qkv.bias"])
        q, kv = qkv[..., :E], qkv[..., E:]
    else:
        q = F.linear(x, p["Wq.weight"], p.get("Wq.bias"))
        kv = F.linear(x if x_kv is None else x_kv, p["Wkv.weight"], p.get("Wkv.bias"))
    if dwconv and "dwconv_q.weight" in p:
        q, kv = _dwconv(q, p["dwconv_q.weight"], p["dwconv_q.bias"]), _dwconv(kv, p["dwconv_kv.weight"],
                                                                             p["dwconv_kv.bias"])
    q = q.unflatten(-1, (nh, d))
    k, v = kv.unflatten(-1, (2, nkv, d)).unbind(2)
    q, k = _rope(q, rd, interleaved), _rope(k, rd, interleaved)
    ctx = plain(q, k, v, dtype, causal=causal, window=window, alibi=alibi)
    return F.linear(ctx.flatten(-2), p["out_proj.weight"], p.get("out_proj.bias"))


def check_module(m, inputs, ref, dtype, name=""):
    """Output and gradients (inputs that require grad, every parameter) of ``m(*inputs)`` against
    ``ref(params, *inputs, dtype)`` in float64 (oracle) and in ``dtype`` (baseline)."""
    out = m(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    g = randn(out.shape, dtype, device=out.device)
    names = [n for n, _ in m.named_parameters()]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    got = (out, *torch.autograd.grad(out, [*leaves, *m.parameters()], g))
    refs = []
    for rdt in (F64, dtype):
        cp = {n: t.detach().to(rdt).requires_grad_() for n, t in m.named_parameters()}
        ins = [t.detach().to(rdt).requires_grad_() if isinstance(t, torch.Tensor) and t.requires_grad else t
               for t in inputs]
        r = ref(cp, *ins, rdt)
        lv = [t for t in ins if isinstance(t, torch.Tensor) and t.requires_grad]
        refs.append((r, *torch.autograd.grad(r, [*lv, *cp.values()], g.to(rdt))))
    labels = ["out", *[f"d_input{i}" for i in range(len(leaves))], *[f"d_{n}" for n in names]]
    for a, hi, lo, lab in zip(got, *refs, labels):
        assert torch.isfinite(a).all(), f"{name} {lab}"
        assert_close_tolerance(a, hi, lo, name=f"{name} {lab}")


# ----------------------------------------------------------------------------- get_alibi_slopes


def test_get_alibi_slopes():
    assert get_alibi_slopes(1) == [2 ** -8]
    assert get_alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    torch.testing.assert_close(torch.tensor(get_alibi_slopes(16), dtype=F64),
                               torch.tensor([2 ** (-(i + 1) / 2) for i in range(16)], dtype=F64))
    # Not a power of two: the 8-head series, then every other slope of the 16-head series.
    twelve = get_alibi_slopes(12)
    assert twelve[:8] == get_alibi_slopes(8)
    torch.testing.assert_close(torch.tensor(twelve[8:], dtype=F64), torch.tensor(get_alibi_slopes(16)[0:8:2],
                                                                                     dtype=F64))
    assert get_alibi_slopes(3) == [2 ** -4, 2 ** -8, 2 ** -2]
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="nheads must be a positive int"):
            get_alibi_slopes(bad)


# ----------------------------------------------------------------------------- inner attention


def _masked_ref(q, k, v, dtype, keep, causal, scale=None, self_attn=False):
    """flash_attn's plain formulas: additive -10000 for padded keys; future keys penalised: self-attention
    adds -10000 above the diagonal, cross-attention sets -10000 past the bottom-right aligned diagonal of
    each row's kept-key count."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    h, hk = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(h // hk, 2), v.repeat_interleave(h // hk, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * (scale or q.shape[-1] ** -0.5)
    if keep is not None:
        s = s + torch.where(keep, 0.0, -10000.0).to(dtype)[:, None, None, :]
    if causal and self_attn:
        s = s + torch.full((q.shape[1], k.shape[1]), -10000.0, dtype=dtype).triu(1)
    elif causal:
        sq, sk = q.shape[1], k.shape[1]
        kept = keep.sum(-1).view(-1, 1, 1, 1) if keep is not None else sk
        future = torch.arange(sk).view(1, sk) > torch.arange(sq).view(sq, 1) + kept - sq
        s = torch.where(future, torch.tensor(-10000.0, dtype=dtype), s)
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("dtype,causal,padded", [(F32, False, True), (BF16, True, True), (F32, True, False)])
def test_self_attention(dtype, causal, padded):
    qkv = randn((2, 7, 3, 3, 8), dtype, requires_grad=True)
    keep = torch.tensor([[True] * 7, [True] * 4 + [False] * 3]) if padded else None
    m = SelfAttention(causal=causal)
    check_module(m, (qkv, None, keep),
                 lambda p, t, c, kp, dt: _masked_ref(*t.unbind(2), dt, kp, causal, self_attn=True),
                 dtype, "SelfAttention")


@pytest.mark.parametrize("dtype,causal,hk", [(F32, True, 1), (BF16, False, 3), (F32, True, 3)])
def test_cross_attention(dtype, causal, hk):
    q = randn((2, 5, 3, 8), dtype, requires_grad=True)
    kv = randn((2, 9, 2, hk, 8), dtype, requires_grad=True)
    keep = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    m = CrossAttention(causal=causal, softmax_scale=0.3)
    check_module(m, (q, kv, None, keep),
                 lambda p, a, b, c, kp, dt: _masked_ref(a, *b.unbind(2), dt, kp, causal, 0.3), dtype, "CrossAttention")


def test_fully_padded_row_stays_finite():
    # flash_attn's finite penalty shifts every score of a fully padded row alike: the row gets the
    # unmasked attention (no NaN, as -inf masking would give).
    qkv = randn((1, 4, 3, 2, 8))
    out = SelfAttention()(qkv, key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))
    torch.testing.assert_close(out, SelfAttention()(qkv), atol=2e-3, rtol=0)  # fp32 ulp of 1e4: 1e-3


def test_inner_attention_dropout_is_training_only():
    qkv = randn((2, 6, 3, 2, 8))
    m = SelfAttention(attention_dropout=0.5)
    assert torch.equal(m.eval()(qkv), m(qkv))
    assert not torch.allclose(m.train()(qkv), m.eval()(qkv))


# ----------------------------------------------------------------------------- MHA


CASES = {
    # name: (MHA kwargs, reference kwargs)
    "plain": (dict(), dict()),
    "causal_gqa": (dict(num_heads_kv=2, causal=True), dict(nkv=2, causal=True)),
    "mqa_rotary": (dict(num_heads_kv=1, causal=True, rotary_emb_dim=4), dict(nkv=1, causal=True, rd=4)),
    "rotary_interleaved": (dict(rotary_emb_dim=6, rotary_emb_interleaved=True, causal=True),
                           dict(rd=6, interleaved=True, causal=True)),
    "dwconv": (dict(dwconv=True, causal=True), dict(dwconv=True, causal=True)),
    "dwconv_gqa": (dict(dwconv=True, num_heads_kv=2), dict(dwconv=True, nkv=2)),
    "no_bias_fused": (dict(qkv_proj_bias=False, out_proj_bias=False, fused_bias_fc=True), dict()),
    "return_residual": (dict(return_residual=True, num_heads_kv=2), dict(nkv=2)),
}


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_mha_against_formula(case, flash):
    kw, rkw = CASES[case]
    dtype = BF16 if case in ("causal_gqa", "rotary_interleaved") else F32
    m = MHA(E, H, use_flash_attn=flash, dtype=dtype, **kw)
    x = randn((2, 7, E), dtype, requires_grad=True)
    check_module(m, (x,), lambda p, t, dt: mha_ref(p, t, dt, **rkw), dtype, f"MHA[{case}, flash={flash}]")
    if kw.get("return_residual"):
        assert m(x)[1] is x


@pytest.mark.parametrize("flash", [False, True])
def test_mha_cross_attention(flash):
    m = MHA(E, H, num_heads_kv=2, cross_attn=True, causal=True, use_flash_attn=flash)
    assert {n for n, _ in m.named_parameters()} == {"Wq.weight", "Wq.bias", "Wkv.weight", "Wkv.bias",
                                                     "out_proj.weight", "out_proj.bias"}
    x, xkv = randn((2, 5, E), requires_grad=True), randn((2, 9, E), requires_grad=True)
    out = m(x, x_kv=xkv)
    g = randn(out.shape)
    got = torch.autograd.grad(out, [x, xkv, *m.parameters()], g)
    cp = {n: t.detach().double().requires_grad_() for n, t in m.named_parameters()}
    xd, xkvd = x.detach().double().requires_grad_(), xkv.detach().double().requires_grad_()
    ref = mha_ref(cp, xd, F64, nkv=2, causal=True, x_kv=xkvd)
    want = torch.autograd.grad(ref, [xd, xkvd, *cp.values()], g.double())
    assert_close_tolerance(out, ref, None, name="cross out")
    for a, b in zip(got, want):
        assert_close_tolerance(a, b, None, name="cross grad")
    # mixer_subset: queries for a subset of positions only.
    sub = m(x, x_kv=xkv, mixer_subset=slice(0, 1))
    torch.testing.assert_close(sub, mha_ref(cp, xd[:, :1], F64, nkv=2, causal=True, x_kv=xkvd).float())


def test_mha_alibi_and_window_flash_path():
    m = MHA(E, H, causal=True, use_alibi=True, use_flash_attn=True).to(BF16)
    assert m.inner_attn.alibi_slopes.dtype == F32  # kept fp32 through .to(bf16)
    slopes = torch.tensor(get_alibi_slopes(H), dtype=F64)
    torch.testing.assert_close(m.inner_attn.alibi_slopes.double(), slopes)
    x = randn((2, 9, E), BF16, requires_grad=True)
    check_module(m, (x,), lambda p, t, dt: mha_ref(p, t, dt, causal=True, alibi=slopes), BF16, "MHA alibi")
    w = MHA(E, H, window_size=(2, 1), use_flash_attn=True)
    x = randn((2, 9, E), requires_grad=True)
    check_module(w, (x,), lambda p, t, dt: mha_ref(p, t, dt, window=(2, 1)), F32, "MHA window")


def test_mha_checkpointing_and_varlen():
    torch.manual_seed(1)
    m = MHA(E, H, num_heads_kv=2, causal=True, use_flash_attn=True)
    mc = MHA(E, H, num_heads_kv=2, causal=True, use_flash_attn=True, checkpointing=True)
    mc.load_state_dict(m.state_dict())
    x = randn((2, 7, E), requires_grad=True)
    a, b = m(x), mc(x)
    torch.testing.assert_close(a, b)
    ga = torch.autograd.grad(a.square().sum(), [x, *m.parameters()])
    gb = torch.autograd.grad(b.square().sum(), [x, *mc.parameters()])
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v)
    # Varlen (GQA: cu_seqlens_k defaults to cu_seqlens): two packed sequences equal two separate calls.
    lens = [5, 3]
    xs = [randn((1, n, E)) for n in lens]
    packed = torch.cat([t[0] for t in xs])
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    out = m(packed, cu_seqlens=cu, max_seqlen=5)
    torch.testing.assert_close(out, torch.cat([m(t)[0] for t in xs]))


def test_mha_state_dict_keys_and_shapes():
    def keys(**kw):
        return {n: tuple(t.shape) for n, t in MHA(E, H, **kw).state_dict().items()}

    assert keys() == {"Wqkv.weight": (3 * E, E), "Wqkv.bias": (3 * E,), "out_proj.weight": (E, E),
                      "out_proj.bias": (E,)}
    assert keys(num_heads_kv=1, qkv_proj_bias=False) == {"Wqkv.weight": (E + 2 * D, E),
                                                          "out_proj.weight": (E, E), "out_proj.bias": (E,)}
    k = keys(dwconv=True)
    assert k["dwconv_qkv.weight"] == (3 * E, 1, 3) and k["dwconv_qkv.bias"] == (3 * E,)
    k = keys(dwconv=True, num_heads_kv=2)
    assert k["dwconv_q.weight"] == (E, 1, 3) and k["dwconv_kv.weight"] == (4 * D, 1, 3)
    # rotary tables and ALiBi slopes are not saved
    assert keys(rotary_emb_dim=4, use_alibi=True, use_flash_attn=True) == keys()
    assert isinstance(MHA(E, H, return_residual=True).Wqkv, LinearResidual)
    assert isinstance(MHA(E, H, use_flash_attn=True).inner_attn, FlashSelfAttention)
    m = MHA(E, H, dtype=BF16)
    assert m.Wqkv.weight.dtype == BF16 and m.head_dim == D and m.num_heads_kv == H


def test_mha_bad_arguments():
    with pytest.raises(ValueError, match="embed_dim \\(30\\) must be divisible by num_heads \\(4\\)"):
        MHA(30, 4)
    with pytest.raises(ValueError, match="num_heads \\(4\\) must be divisible by num_heads_kv \\(3\\)"):
        MHA(E, 4, num_heads_kv=3)
    with pytest.raises(ValueError, match="use_alibi=True needs use_flash_attn=True"):
        MHA(E, H, use_alibi=True)
    with pytest.raises(ValueError, match="window_size=\\(4, 0\\).*needs use_flash_attn=True"):
        MHA(E, H, window_size=(4, 0))
    with pytest.raises(ValueError, match="does not support cross_attn"):
        MHA(E, H, cross_attn=True, rotary_emb_dim=4)
    x = randn((2, 3, E))
    with pytest.raises(ValueError, match="key_padding_mask needs use_flash_attn=False"):
        MHA(E, H, use_flash_attn=True)(x, key_padding_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="cu_seqlens \\(varlen input\\) needs use_flash_attn=True"):
        MHA(E, H)(x[0], cu_seqlens=torch.tensor([0, 3], dtype=torch.int32), max_seqlen=3)
    with pytest.raises(ValueError, match="x_kv and mixer_subset are for cross_attn=True"):
        MHA(E, H)(x, x_kv=x)


def test_mha_key_padding_mask_plain_path():
    m = MHA(E, H)
    x = randn((2, 6, E))
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    out = m(x, key_padding_mask=keep)
    # The kept positions of the padded row equal the unpadded call on its first 4 tokens.
    torch.testing.assert_close(out[1, :4], m(x[1:, :4])[0])
    torch.testing.assert_close(out[0], m(x[:1])[0])


# ----------------------------------------------------------------------------- decoding


class Params:
    """A duck-typed stand-in for flash_attn's ``InferenceParams``."""

    def __init__(self, max_seqlen, max_batch_size, lengths=False):
        self.max_seqlen, self.max_batch_size = max_seqlen, max_batch_size
        self.seqlen_offset = self.batch_size_offset = 0
        self.key_value_memory_dict = {}
        self.lengths_per_sample = torch.zeros(max_batch_size, dtype=torch.int32) if lengths else None


@pytest.mark.parametrize("flash,nkv,rd,lengths", [
    (False, 4, 8, False),  # plain path, partial rotary
    (True, 4, 16, False),  # fused rotary + cache update in one flash_attn_with_kvcache call
    (True, 2, 16, True),   # GQA, per-sample lengths (cache_seqlens tensor)
    (True, 1, 6, False),   # rotary dim not a multiple of 16: unfused rotary, then the kvcache call
    (True, 4, 0, False),   # no rotary: flash_attn_with_kvcache without tables
])
def test_decoding_equals_full_forward(flash, nkv, rd, lengths):
    e, h = 64, 4
    m = MHA(e, h, num_heads_kv=nkv, causal=True, layer_idx=3, rotary_emb_dim=rd, use_flash_attn=flash).eval()
    b, s, prompt = 2, 9, 4
    x = randn((b, s, e))
    with torch.no_grad():
        full = m(x)
        params = Params(s, b, lengths)
        cache = m.allocate_inference_cache(b, s)
        assert cache.shape == (b, s, 2, nkv, e // h) and cache.dtype == F32
        if flash:  # generation allocates the caches up front; the plain path allocates on first use
            # Zeroed: culmen's CPU reference of flash_attn_with_kvcache lets NaN garbage past cache_seqlens
            # leak into the output (reported; the Triton kernel masks it).
            params.key_value_memory_dict[3] = cache.zero_()
        outs = [m(x[:, :prompt], inference_params=params)]
        params.seqlen_offset += prompt
        if lengths:
            params.lengths_per_sample += prompt
        for t in range(prompt, s):
            outs.append(m(x[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
            if lengths:
                params.lengths_per_sample += 1
    assert 3 in params.key_value_memory_dict
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=2e-5, rtol=2e-5)


def test_update_kv_cache_bounds():
    m = MHA(E, H, causal=True, layer_idx=0)
    params = Params(4, 1)
    params.seqlen_offset = 3
    with pytest.raises(ValueError, match="does not fit"):
        m(randn((1, 2, E)), inference_params=params)
    with pytest.raises(ValueError, match="needs layer_idx"):
        MHA(E, H, causal=True)(randn((1, 2, E)), inference_params=Params(4, 1))


def test_mha_bf16_softmax_scale_matches_default_formula():
    # softmax_scale reaches the kernel: a scale of 2/sqrt(d) equals doubling the query projection.
    m = MHA(E, H, softmax_scale=2 / math.sqrt(D), use_flash_attn=True)
    m2 = MHA(E, H, use_flash_attn=True)
    m2.load_state_dict(m.state_dict())
    with torch.no_grad():
        m2.Wqkv.weight[:E] *= 2
        m2.Wqkv.bias[:E] *= 2
    x = randn((2, 5, E))
    torch.testing.assert_close(m(x), m2(x))


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["plain", "causal_gqa", "rotary_interleaved", "dwconv", "no_bias_fused"])
def test_mha_gpu_bf16_flash(case):
    kw, rkw = CASES[case]
    m = MHA(E, H, use_flash_attn=True, device="cuda", dtype=BF16, **kw)
    x = randn((2, 67, E), BF16, device="cuda", requires_grad=True)
    check_module(m, (x,), lambda p, t, dt: mha_ref(p, t, dt, **rkw), BF16, f"MHA gpu[{case}]")


@pytest.mark.gpu
@pytest.mark.parametrize("nkv,rd", [(4, 16), (2, 8), (4, 0)])
def test_decoding_gpu_uninitialised_cache(nkv, rd):
    # As generation runs it: caches from allocate_inference_cache (torch.empty, never zeroed).
    e, h, b, s, prompt = 128, 4, 2, 37, 11
    m = MHA(e, h, num_heads_kv=nkv, causal=True, layer_idx=0, rotary_emb_dim=rd, use_flash_attn=True,
            device="cuda").eval()
    x = randn((b, s, e), device="cuda")
    with torch.no_grad():
        full = m(x)
        params = Params(s, b)
        params.key_value_memory_dict[0] = m.allocate_inference_cache(b, s)
        outs = [m(x[:, :prompt], inference_params=params)]
        params.seqlen_offset = prompt
        for t in range(prompt, s):
            outs.append(m(x[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    got = torch.cat(outs, 1)
    assert torch.isfinite(got).all()
    # fp32 on the GPU: the kernels may use TF32 dot products.
    torch.testing.assert_close(got, full, atol=3e-3, rtol=3e-3)
