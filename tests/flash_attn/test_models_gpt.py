"""``culmen.flash_attn.models.gpt``: tiny GPT-2 / LLaMA-style / parallel-block models against a plain
PyTorch implementation of the same architecture that reads flash_attn's state-dict names (forward and
the gradient of every parameter, float64 reference), the Hugging Face GPT-2 and Megatron remaps,
tensor-parallel sharding round trips, and KV-cache decoding of the model. GPU-marked: the same in
bf16 on CUDA, and CUDA-graph decoding.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config  # noqa: E402

from culmen.flash_attn.models.gpt import (  # noqa: E402
    GPTLMHeadModel,
    GPTModel,
    combine_state_dicts_tp,
    inv_remap_state_dict_hf_gpt2,
    remap_state_dict_hf_gpt2,
    remap_state_dict_megatron,
    shard_state_dict_tp,
)
from culmen.flash_attn.utils.generation import decode, decode_speculative  # noqa: E402
from culmen.testing.tolerance import assert_close_tolerance  # noqa: E402

_QUIET = {"bos_token_id": 0, "eos_token_id": 0}  # the tiny vocabularies lack GPT-2's 50256


def gpt2_config(**kw) -> GPT2Config:
    base = dict(n_embd=48, n_head=4, n_layer=2, vocab_size=101, n_positions=64, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, pad_vocab_size_multiple=8, **_QUIET)
    return GPT2Config(**{**base, **kw})


def llama_config(**kw) -> GPT2Config:
    base = dict(n_embd=64, n_head=4, n_head_kv=2, n_layer=2, vocab_size=97, n_positions=0, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, rotary_emb_fraction=1.0, rms_norm=True,
                activation_function="swiglu", mlp_multiple_of=16, mlp_fc1_bias=False, mlp_fc2_bias=False,
                qkv_proj_bias=False, out_proj_bias=False, tie_word_embeddings=False, layer_norm_epsilon=1e-5,
                use_flash_attn=True, **_QUIET)
    return GPT2Config(**{**base, **kw})


def parallel_config(**kw) -> GPT2Config:
    """GPT-J / NeoX style: parallel attention + MLP, partial rotary, gelu, muP multipliers, head bias."""
    base = dict(n_embd=32, n_head=2, n_layer=3, vocab_size=53, n_positions=0, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, rotary_emb_fraction=0.5, parallel_block=True, activation_function="gelu",
                n_inner=40, tie_word_embeddings=False, lm_head_bias=True, mup_embeddings_multiplier=1.7,
                mup_width_scale=0.5, mup_output_multiplier=1.3, **_QUIET)
    return GPT2Config(**{**base, **kw})


# ---------------------------------------------------------------------------------------------------
# The plain-PyTorch reference: same architecture, parameters looked up by flash_attn's names
# ---------------------------------------------------------------------------------------------------

def _norm(x, p, prefix, cfg):
    w = p[prefix + ".weight"]
    if getattr(cfg, "rms_norm", False):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layer_norm_epsilon) * w
    return F.layer_norm(x, x.shape[-1:], w, p[prefix + ".bias"], cfg.layer_norm_epsilon)


def _linear(x, p, prefix):
    return F.linear(x, p[prefix + ".weight"], p.get(prefix + ".bias"))


def _rotary(x, rot_dim, base=10000.0):
    """GPT-NeoX rotary on the first rot_dim dims of x (b, s, h, d), positions 0..s-1."""
    if rot_dim == 0:
        return x
    s = x.shape[1]
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64, device=x.device) / rot_dim)
    ang = torch.arange(s, dtype=torch.float64, device=x.device)[:, None] * inv_freq
    cos, sin = ang.cos().to(x.dtype)[None, :, None], ang.sin().to(x.dtype)[None, :, None]
    x1, x2 = x[..., :rot_dim // 2], x[..., rot_dim // 2:rot_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot_dim:]], dim=-1)


def _attention(h, p, prefix, cfg, layer):
    nh = cfg.n_head
    nkv = getattr(cfg, "n_head_kv", None) or nh
    hd = cfg.n_embd // nh
    b, s, _ = h.shape
    qkv = _linear(h, p, prefix + ".Wqkv")
    q = qkv[..., :nh * hd].view(b, s, nh, hd)
    k = qkv[..., nh * hd:(nh + nkv) * hd].view(b, s, nkv, hd)
    v = qkv[..., (nh + nkv) * hd:].view(b, s, nkv, hd)
    rot = int(getattr(cfg, "rotary_emb_fraction", 0.0) * hd)
    q, k = _rotary(q, rot), _rotary(k, rot)
    k = k.repeat_interleave(nh // nkv, dim=2)
    v = v.repeat_interleave(nh // nkv, dim=2)
    scale = hd ** -0.5 if cfg.scale_attn_weights else 1.0
    if cfg.scale_attn_by_inverse_layer_idx:
        scale /= layer + 1
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    causal = torch.ones(s, s, dtype=torch.bool, device=h.device).tril()
    att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, nh * hd)
    return _linear(out, p, prefix + ".out_proj")


def _mlp(h, p, prefix, cfg):
    y = _linear(h, p, prefix + ".fc1")
    act = cfg.activation_function
    if act in ("swiglu", "glu", "geglu"):
        y, gate = y.chunk(2, dim=-1)
        return _linear(y * {"swiglu": F.silu, "glu": torch.sigmoid, "geglu": F.gelu}[act](gate), p, prefix + ".fc2")
    if act == "gelu_new":
        y = 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))
    elif act in ("relu", "sqrelu"):
        y = F.relu(y) ** (2 if act == "sqrelu" else 1)
    else:
        y = F.gelu(y)
    return _linear(y, p, prefix + ".fc2")


def reference_logits(p: dict, cfg, input_ids):
    """Logits of the architecture ``cfg`` describes, from the parameters ``p`` (flash_attn names)."""
    x = p["transformer.embeddings.word_embeddings.weight"][input_ids]
    if "transformer.embeddings.project_in.weight" in p:  # OPT-350m: narrower word embeddings
        x = x @ p["transformer.embeddings.project_in.weight"].T
    if cfg.n_positions > 0:
        x = x + p["transformer.embeddings.position_embeddings.weight"][: input_ids.shape[1]]
    x = x * getattr(cfg, "mup_embeddings_multiplier", 1.0)
    residual = x
    for i in range(cfg.n_layer):
        pre = f"transformer.layers.{i}"
        if not getattr(cfg, "prenorm", True):  # post-norm: the norms follow the residual adds
            residual = _norm(residual + _attention(residual, p, pre + ".mixer", cfg, i), p, pre + ".norm1", cfg)
            residual = _norm(residual + _mlp(residual, p, pre + ".mlp", cfg), p, pre + ".norm2", cfg)
        elif getattr(cfg, "parallel_block", False):
            h1 = _norm(residual, p, pre + ".norm1", cfg)
            h2 = _norm(residual, p, pre + ".norm2", cfg)
            residual = residual + _attention(h1, p, pre + ".mixer", cfg, i) + _mlp(h2, p, pre + ".mlp", cfg)
        else:
            residual = residual + _attention(_norm(residual, p, pre + ".norm1", cfg), p, pre + ".mixer", cfg, i)
            residual = residual + _mlp(_norm(residual, p, pre + ".norm2", cfg), p, pre + ".mlp", cfg)
    h = _norm(residual, p, "transformer.ln_f", cfg) if getattr(cfg, "prenorm", True) else residual
    if "project_out.weight" in p:
        h = h @ p["project_out.weight"].T
    h = h * getattr(cfg, "mup_output_multiplier", 1.0) * getattr(cfg, "mup_width_scale", 1.0)
    head = p.get("lm_head.weight", p["transformer.embeddings.word_embeddings.weight"])
    return F.linear(h, head, p.get("lm_head.bias"))


def _check_against_reference(model, cfg, input_ids, dtype=torch.float32):
    """Forward and every parameter's gradient against the float64 reference, tolerance rule with the
    same plain-PyTorch computation in ``dtype`` as the baseline."""
    params = dict(model.named_parameters())
    weight = torch.randn(*input_ids.shape, model.lm_head.weight.shape[0], device=input_ids.device)
    logits = model(input_ids).logits
    assert logits.dtype == dtype
    (logits.float() * weight).sum().backward()
    refs = {}
    for prec in (torch.float64, dtype):
        p = {n: t.detach().to(prec).requires_grad_() for n, t in params.items()}
        out = reference_logits(p, cfg, input_ids)
        (out.float() * weight).sum().backward()
        refs[prec] = (out, {n: t.grad for n, t in p.items()})
    hi, lo = refs[torch.float64], refs[dtype]
    assert_close_tolerance(logits, hi[0], lo[0], name="logits")
    for n, t in params.items():
        assert t.grad is not None, n
        assert_close_tolerance(t.grad, hi[1][n], lo[1][n], name=f"grad {n}")


def fused_config():
    return gpt2_config(fused_mlp=True, fused_bias_fc=True, fused_dropout_add_ln=True, residual_in_fp32=True)


def sqrelu_config():
    return llama_config(activation_function="sqrelu", fused_dense_sqrelu_dense=True, mlp_checkpoint_lvl=[1, 2])


def postnorm_config():
    return gpt2_config(prenorm=False, word_embed_proj_dim=32, activation_function="relu")


@pytest.mark.parametrize("make_config", [gpt2_config, llama_config, parallel_config, fused_config, sqrelu_config,
                                         postnorm_config],
                         ids=["gpt2", "llama", "parallel_block", "fused", "sqrelu", "postnorm_opt350m"])
def test_lm_head_model_forward_backward_matches_reference(make_config):
    cfg = make_config()
    model = GPTLMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    _check_against_reference(model, cfg, ids)


def test_state_dict_keys_and_shapes_follow_flash_attn():
    cfg = llama_config()
    sd = GPTLMHeadModel(cfg).state_dict()
    # GQA: Wqkv rows (n_head + 2 * n_head_kv) * head_dim; SwiGLU hidden int(8 * 64 / 3) -> multiple of 16.
    assert sd["transformer.layers.0.mixer.Wqkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert sd["transformer.layers.1.mlp.fc1.weight"].shape == (2 * 176, 64)
    assert sd["transformer.layers.1.mlp.fc2.weight"].shape == (64, 176)
    assert sd["lm_head.weight"].shape == (97, 64) and "lm_head.bias" not in sd
    assert "transformer.layers.0.mixer.Wqkv.bias" not in sd and "transformer.ln_f.bias" not in sd
    assert not any("rotary_emb" in k or "position_embeddings" in k for k in sd)
    tied = GPTLMHeadModel(gpt2_config())
    assert tied.lm_head.weight is tied.transformer.embeddings.word_embeddings.weight
    assert tied.lm_head.weight.shape == (104, 48)  # 101 padded to a multiple of 8


def test_config_selects_flash_attn_modules():
    from culmen.flash_attn.modules.block import Block, ParallelBlock
    from culmen.flash_attn.modules.mlp import GatedMlp, Mlp
    from culmen.flash_attn.ops.fused_dense import FusedDense, FusedMLP
    from culmen.flash_attn.ops.triton.layer_norm import RMSNorm

    llama = GPTLMHeadModel(llama_config(window_size=(8, 0), mup_attn_multiplier=2.0, mup_scale_qk_dot_by_d=True))
    layer = llama.transformer.layers[1]
    assert isinstance(layer, Block) and isinstance(layer.mlp, GatedMlp) and layer.mlp.activation is F.silu
    assert isinstance(layer.norm1, RMSNorm) and isinstance(llama.transformer.ln_f, RMSNorm)
    mixer = layer.mixer
    assert (mixer.num_heads, mixer.num_heads_kv, mixer.rotary_emb_dim, mixer.causal) == (4, 2, 16, True)
    assert mixer.inner_attn.softmax_scale == pytest.approx(2.0 / 16)  # muP: 1/d instead of 1/sqrt(d)
    assert tuple(mixer.inner_attn.window_size) == (8, 0) and mixer.layer_idx == 1 and layer.layer_idx == 1
    sq = GPTLMHeadModel(sqrelu_config())
    assert [type(blk.mlp) for blk in sq.transformer.layers] == [FusedMLP, FusedMLP]
    assert [blk.mlp.checkpoint_lvl for blk in sq.transformer.layers] == [1, 2]
    fused = GPTLMHeadModel(fused_config())
    assert isinstance(fused.transformer.layers[0].mixer.Wqkv, FusedDense)
    assert fused.transformer.layers[0].mlp.activation == "gelu_approx"
    gpt2 = GPTLMHeadModel(gpt2_config(activation_function="gelu", resid_pdrop=0.1, embd_pdrop=0.2))
    mlp = gpt2.transformer.layers[0].mlp
    assert isinstance(mlp, Mlp) and mlp.activation.keywords == {"approximate": "none"}
    # The blocks' dropout-add-norm order puts the embedding dropout in layer 0's first residual dropout.
    assert [blk.dropout1.p for blk in gpt2.transformer.layers] == [0.2, 0.1]
    assert isinstance(GPTLMHeadModel(parallel_config()).transformer.layers[0], ParallelBlock)
    extras = GPTLMHeadModel(gpt2_config(use_flash_attn=True, use_alibi=True, attn_dwconv=True,
                                        qkv_proj_bias=False, out_proj_bias=False, n_positions=0,
                                        rotary_emb_fraction=0.5, rotary_emb_interleaved=True,
                                        rotary_emb_scale_base=512.0, rotary_emb_base=500.0))
    mixer = extras.transformer.layers[0].mixer
    assert mixer.inner_attn.alibi_slopes is not None and hasattr(mixer, "dwconv_qkv")
    assert mixer.Wqkv.bias is None and mixer.out_proj.bias is None
    rot = mixer.rotary_emb
    assert (mixer.rotary_emb_dim, rot.interleaved, rot.scale_base, rot.base) == (6, True, 512.0, 500.0)
    assert extras(torch.randint(0, 101, (2, 5))).logits.shape == (2, 5, 104)


def test_model_options_and_config_errors():
    cfg = gpt2_config(scale_attn_by_inverse_layer_idx=True, n_layer=3)
    model = GPTLMHeadModel(cfg)
    _check_against_reference(model, cfg, torch.randint(0, 101, (1, 9)))
    # num_last_tokens keeps the last positions only; GPTModel returns the final hidden states.
    ids = torch.randint(0, 101, (2, 7))
    full = model(ids).logits
    torch.testing.assert_close(model(ids, num_last_tokens=3).logits, full[:, -3:])
    assert GPTModel(cfg)(ids).shape == (2, 7, 48)
    with pytest.raises(ValueError, match="activation_function"):
        GPTLMHeadModel(gpt2_config(activation_function="tanh"))
    with pytest.raises(ValueError, match="GPT2Config"):
        GPTLMHeadModel(transformers.LlamaConfig())
    with pytest.raises(ValueError, match="input_ids"):
        model(ids[0])


def test_norm_head_rotary_shared_and_init():
    cfg = gpt2_config(norm_head=True, tie_word_embeddings=False, rotary_emb_fraction=0.5, n_positions=0)
    model = GPTLMHeadModel(cfg)
    layers = model.transformer.layers
    assert layers[1].mixer.rotary_emb is layers[0].mixer.rotary_emb
    ids = torch.randint(0, 101, (1, 6))
    h = model.transformer(ids)
    want = F.linear(h, F.normalize(model.lm_head.weight))
    torch.testing.assert_close(model(ids).logits, want)
    # GPT-2 init: residual output projections shrink by sqrt(2 * n_layer); linears carry lr_multiplier.
    std = layers[0].mixer.out_proj.weight.std().item()
    assert 0.5 * 0.02 / 2 < std < 1.5 * 0.02 / 2
    assert layers[0].mlp.fc1.weight._optim == {"lr_multiplier": 1.0}


# ---------------------------------------------------------------------------------------------------
# Checkpoints: Hugging Face GPT-2, Megatron, flash_attn's legacy layout, tensor-parallel shards
# ---------------------------------------------------------------------------------------------------

def test_remap_hf_gpt2_round_trip_logits():
    cfg = gpt2_config()
    hf = transformers.GPT2LMHeadModel(GPT2Config(**{k: getattr(cfg, k) for k in (
        "n_embd", "n_head", "n_layer", "vocab_size", "n_positions", "resid_pdrop", "embd_pdrop", "attn_pdrop")},
        **_QUIET, attn_implementation="eager")).eval()
    hf_sd = hf.state_dict()
    model = GPTLMHeadModel(cfg).eval()
    model.load_state_dict(remap_state_dict_hf_gpt2(hf_sd, cfg))
    ids = torch.randint(0, 101, (2, 11))
    with torch.no_grad():
        got = model(ids).logits[..., :101]
        want = hf(ids).logits
        want64 = hf.double()(ids).logits
    hf.float()
    assert_close_tolerance(got, want64, want, name="logits vs HF GPT-2")
    assert (got - want).abs().max() < 1e-4
    # The hub layout (no "transformer." prefix, no lm_head) remaps the same.
    hub = {k.removeprefix("transformer."): v for k, v in hf_sd.items() if k != "lm_head.weight"}
    again = remap_state_dict_hf_gpt2(hub, cfg)
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())
    back = inv_remap_state_dict_hf_gpt2(model.state_dict(), cfg)
    assert sorted(back) == sorted(hf_sd)
    for k, v in hf_sd.items():
        assert torch.equal(back[k], v), k
    fresh = transformers.GPT2LMHeadModel(hf.config)
    fresh.load_state_dict(back, strict=True)


def test_from_pretrained_local_gpt2_directory(tmp_path):
    cfg = gpt2_config()
    hf = transformers.GPT2LMHeadModel(GPT2Config(n_embd=48, n_head=4, n_layer=2, vocab_size=101, n_positions=64,
                                                 **_QUIET, attn_implementation="eager")).eval()
    hf.save_pretrained(tmp_path / "gpt2-tiny")
    model = GPTLMHeadModel.from_pretrained(str(tmp_path / "gpt2-tiny"), cfg).eval()
    ids = torch.randint(0, 101, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :101], hf(ids).logits, rtol=1e-4, atol=1e-4)
    # The family is read from the name: an unknown one is refused.
    (tmp_path / "gpt2-tiny").rename(tmp_path / "mystery")
    with pytest.raises(NotImplementedError, match="not supported"):
        GPTLMHeadModel.from_pretrained(str(tmp_path / "mystery"), cfg)


def test_remap_megatron_layout():
    cfg = gpt2_config(n_positions=0, rotary_emb_fraction=0.5)
    model = GPTLMHeadModel(cfg)
    sd = model.state_dict()
    hd, nh = 12, 4
    meg = {"language_model.embedding.word_embeddings.weight": sd["transformer.embeddings.word_embeddings.weight"][:101]}
    names = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm", "mlp.fc1": "mlp.dense_h_to_4h",
             "mlp.fc2": "mlp.dense_4h_to_h", "mixer.out_proj": "self_attention.dense"}
    for k, v in sd.items():
        if not k.startswith("transformer.layers."):
            continue
        _, _, i, rest = k.split(".", 3)
        mod, suffix = rest.rsplit(".", 1)
        if mod == "mixer.Wqkv":
            # Megatron keeps each head's q, k, v rows together: (nheads, 3, headdim).
            v = v.reshape(3, nh, hd, *v.shape[1:]).transpose(0, 1).reshape(v.shape)
            meg[f"language_model.encoder.layers.{i}.self_attention.query_key_value.{suffix}"] = v
        else:
            meg[f"language_model.encoder.layers.{i}.{names[mod]}.{suffix}"] = v
        meg[f"language_model.encoder.layers.{i}.self_attention.rotary_emb.inv_freq"] = torch.ones(3)
    meg["language_model.encoder.final_layernorm.weight"] = sd["transformer.ln_f.weight"]
    meg["language_model.encoder.final_layernorm.bias"] = sd["transformer.ln_f.bias"]
    out = remap_state_dict_megatron(meg, cfg)
    assert sorted(out) == sorted(sd)
    word = out["transformer.embeddings.word_embeddings.weight"]
    assert word.shape == (104, 48) and torch.equal(word[101:], torch.zeros(3, 48))  # padded to 8
    assert out["lm_head.weight"] is word
    sd["transformer.embeddings.word_embeddings.weight"] = sd["lm_head.weight"] = word
    for k, v in sd.items():
        assert torch.equal(out[k], v), k


def test_load_legacy_postnorm_ordered_checkpoint():
    cfg = gpt2_config(n_layer=3)
    model = GPTLMHeadModel(cfg)
    sd = model.state_dict()
    legacy = {k: v for k, v in sd.items() if ".norm" not in k and "ln_f" not in k}
    # flash_attn's early layout: ln_0 in front, each layer's norm1/norm2 after its mixer/MLP.
    legacy["transformer.ln_0.weight"], legacy["transformer.ln_0.bias"] = (sd["transformer.layers.0.norm1.weight"],
                                                                          sd["transformer.layers.0.norm1.bias"])
    for i in range(3):
        for s in ("weight", "bias"):
            legacy[f"transformer.layers.{i}.norm1.{s}"] = sd[f"transformer.layers.{i}.norm2.{s}"]
            nxt = sd[f"transformer.layers.{i + 1}.norm1.{s}"] if i < 2 else sd[f"transformer.ln_f.{s}"]
            legacy[f"transformer.layers.{i}.norm2.{s}"] = nxt
    copy = dict(legacy)
    fresh = GPTLMHeadModel(cfg)
    fresh.load_state_dict(legacy)
    assert legacy.keys() == copy.keys(), "load_state_dict modified its argument"
    for k, v in sd.items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_load_flash_attn_keyed_checkpoint_file(tmp_path):
    cfg = llama_config()
    model = GPTLMHeadModel(cfg)
    path = tmp_path / "ckpt.pt"
    torch.save(model.state_dict(), path)
    fresh = GPTLMHeadModel(cfg)
    result = fresh.load_state_dict(torch.load(path, weights_only=True), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    ids = torch.randint(0, 97, (1, 8))
    torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=0, atol=0)


def _llama_tp():
    return llama_config(pad_vocab_size_multiple=8)


@pytest.mark.parametrize("make_config,world", [(gpt2_config, 2), (_llama_tp, 2), (_llama_tp, 4),
                                                (lambda: gpt2_config(n_head=6, n_embd=48, n_inner=96), 4)],
                         ids=["gpt2-2", "gqa-2", "gqa-4", "uneven-heads-4"])
def test_shard_combine_tp_round_trip(make_config, world):
    cfg = make_config()
    sd = GPTLMHeadModel(cfg).state_dict()
    shards = [shard_state_dict_tp(dict(sd), cfg, world, r) for r in range(world)]
    nh, nkv = cfg.n_head, getattr(cfg, "n_head_kv", None) or cfg.n_head
    hd = cfg.n_embd // nh
    kv_heads = [nkv // world + (r < nkv % world) for r in range(world)]
    heads = [nh // nkv * k for k in kv_heads]  # dealt by kv group, as ParallelMHA holds them
    for r, s in enumerate(shards):
        assert s["transformer.layers.0.mixer.Wqkv.weight"].shape[0] == (heads[r] + 2 * kv_heads[r]) * hd
        assert s["transformer.layers.0.mixer.out_proj.weight"].shape[1] == heads[r] * hd
        assert ("transformer.layers.1.mlp.fc2.bias" in s) == (r == 0 and getattr(cfg, "mlp_fc2_bias", True))
    # Rank r's q rows are heads [sum(heads[:r]), ...), its k rows kv heads [sum(kv_heads[:r]), ...).
    w = sd["transformer.layers.1.mixer.Wqkv.weight"]
    local = shards[1]["transformer.layers.1.mixer.Wqkv.weight"]
    first, k_first = heads[0], kv_heads[0]
    torch.testing.assert_close(local[:hd], w[first * hd:(first + 1) * hd], rtol=0, atol=0)
    got_k = local[heads[1] * hd:(heads[1] + 1) * hd]
    torch.testing.assert_close(got_k, w[(nh + k_first) * hd:(nh + k_first + 1) * hd], rtol=0, atol=0)
    combined = combine_state_dicts_tp(shards, cfg)
    assert sorted(combined) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(combined[k], v), k


def _tp_configs():
    return {
        "gpt2": gpt2_config(fused_bias_fc=True),
        "llama": llama_config(fused_bias_fc=True, pad_vocab_size_multiple=8),
        "gpt2-no-sp": gpt2_config(fused_bias_fc=True, sequence_parallel=False),
    }


def _tp_worker(rank, world):
    """Each config: the full model's state dict sharded into GPTLMHeadModel(config, process_group) on
    this rank; returns (name, logits gathered over the vocabulary, parameter gradients, decoded ids)."""
    import torch.distributed as dist

    from culmen.flash_attn.utils.distributed import allreduce_sequence_parallel_grad

    out = []
    for name, cfg in _tp_configs().items():
        torch.manual_seed(0)
        full = GPTLMHeadModel(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 7))
        weight = torch.randn(2, 7, full.lm_head.weight.shape[0])
        model = GPTLMHeadModel(cfg, process_group=dist.group.WORLD)
        model.load_state_dict(shard_state_dict_tp(full.state_dict(), cfg, world, rank), strict=True)
        logits = model(ids).logits  # (batch * seqlen, vocab / world) this rank's vocabulary columns
        vocab = logits.shape[-1]
        local_w = weight.flatten(0, 1)[:, rank * vocab:(rank + 1) * vocab].reshape(logits.shape)
        (logits * local_w).sum().backward()
        allreduce_sequence_parallel_grad(model, dist.group.WORLD)
        parts = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(parts, logits.detach().contiguous())
        gathered = torch.cat(parts, dim=-1).reshape(2, 7, -1)
        grads = {n: p.grad for n, p in model.named_parameters()}
        decoded = None
        if not getattr(cfg, "sequence_parallel", True):
            decoded = decode(ids[:, :3], model.eval(), 9, tensor_parallel=world).sequences
        # numpy arrays travel back by value (tensors would be shared through files the rank deletes).
        out.append((name, gathered.detach().numpy(), {n: g.numpy() for n, g in grads.items()},
                    None if decoded is None else decoded.numpy()))
    return out


def test_tensor_parallel_model_equals_full_model():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
    from dist_harness import run_group

    results = run_group(_tp_worker, 2)
    for i, (name, cfg) in enumerate(_tp_configs().items()):
        torch.manual_seed(0)
        full = GPTLMHeadModel(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 7))
        weight = torch.randn(2, 7, full.lm_head.weight.shape[0])
        logits = full(ids).logits
        (logits * weight).sum().backward()
        for rank in range(2):
            got_name, gathered, _, decoded = results[rank][i]
            assert got_name == name
            torch.testing.assert_close(torch.from_numpy(gathered), logits.detach(), rtol=1e-5, atol=1e-5, msg=name)
            if decoded is not None:
                assert torch.equal(torch.from_numpy(decoded), decode(ids[:, :3], full.eval(), 9).sequences), name
        combined = combine_state_dicts_tp(
            [{n: torch.from_numpy(g) for n, g in results[r][i][2].items()} for r in range(2)], cfg)
        want = {n: p.grad for n, p in full.named_parameters()}
        assert sorted(combined) == sorted(want), name
        for n, g in want.items():
            torch.testing.assert_close(combined[n], g, rtol=1e-4, atol=1e-5, msg=f"{name}: grad {n}")


def test_shard_tp_rejects_indivisible_sizes():
    cfg = gpt2_config()
    with pytest.raises(ValueError, match="world_size"):
        shard_state_dict_tp(GPTLMHeadModel(cfg).state_dict(), cfg, 3, 0)


# ---------------------------------------------------------------------------------------------------
# Decoding with the model's KV cache
# ---------------------------------------------------------------------------------------------------

class _FilledCaches(dict):
    """A ``key_value_memory_dict`` whose caches (allocated by the attention layers on first use, with
    ``torch.empty``) start filled with ``value`` instead of whatever memory they reuse."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def __setitem__(self, key, cache):
        if key not in self:
            cache.fill_(self.value)
        super().__setitem__(key, cache)


def _fill_new_caches(monkeypatch, value: float) -> None:
    from dataclasses import dataclass, field

    from culmen.flash_attn.utils import generation

    @dataclass
    class Params(generation.InferenceParams):
        key_value_memory_dict: dict = field(default_factory=lambda: _FilledCaches(value))

    monkeypatch.setattr(generation, "InferenceParams", Params)


@pytest.fixture
def stale_caches(monkeypatch):
    """Decoding caches start filled with NaN (stale memory, as torch.empty may give): unfilled slots
    must never reach the output."""
    _fill_new_caches(monkeypatch, float("nan"))


def test_decode_ignores_unfilled_cache_slots(monkeypatch):
    _fill_new_caches(monkeypatch, float("nan"))
    model = GPTLMHeadModel(llama_config()).eval()
    out = decode(torch.randint(0, 97, (2, 5)), model, 12)
    assert not any(bool(s.isnan().any()) for s in out.scores)


def _full_recompute_greedy(model, ids, max_length):
    with torch.no_grad():
        while ids.shape[1] < max_length:
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("make_config", [gpt2_config, llama_config, lambda: llama_config(use_flash_attn=False)],
                         ids=["gpt2", "llama-flash", "llama-torch"])
def test_greedy_decode_equals_full_recompute(make_config, stale_caches):
    cfg = make_config()
    model = GPTLMHeadModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    out = model.generate(ids, 16, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(out.sequences, _full_recompute_greedy(model, ids, 16))
    with torch.no_grad():
        full = model(out.sequences).logits
    for t, score in enumerate(out.scores):
        torch.testing.assert_close(score, full[:, 4 + t], rtol=1e-4, atol=1e-4)


def test_decode_speculative_on_gpt_equals_greedy(stale_caches):
    cfg = llama_config()
    model = GPTLMHeadModel(cfg).eval()
    draft = GPTLMHeadModel(llama_config(n_layer=1)).eval()
    ids = torch.randint(0, 97, (1, 4))
    want = decode(ids, model, 15).sequences
    assert torch.equal(decode_speculative(ids, model, model, 15, speculative_lookahead=3).sequences, want)
    assert torch.equal(decode_speculative(ids, model, draft, 15, speculative_lookahead=2).sequences, want)


@pytest.fixture
def fake_graphs(monkeypatch):
    """CUDA-graph decoding on CPU: each "graph" replays the model with the Python state it was captured
    with (``seqlen_offset = max_seqlen - decoding_seqlen``), as a real graph does, so only what reaches
    the model through tensors (``lengths_per_sample``, ids, positions) may change between replays."""
    from culmen.flash_attn.utils import generation

    captures = []

    def capture(model, params, batch_size, max_seqlen, decoding_seqlen=1, mempool=None, n_warmups=2):
        frozen = max_seqlen - decoding_seqlen
        captures.append((batch_size, decoding_seqlen, mempool))

        def run(input_ids, position_ids, seqlen):
            assert input_ids.shape == (batch_size, decoding_seqlen)
            params.lengths_per_sample[:] = seqlen
            live, params.seqlen_offset = params.seqlen_offset, frozen
            try:
                return model(input_ids, position_ids=position_ids, inference_params=params,
                             num_last_tokens=decoding_seqlen).logits.clone()
            finally:
                params.seqlen_offset = live

        return run

    pools = iter(range(1000))
    monkeypatch.setattr(generation, "capture_graph", capture)
    monkeypatch.setattr(generation, "_model_device", lambda model: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(pools))
    return captures


def test_graph_decoding_protocol_on_cpu(fake_graphs, stale_caches):
    model = GPTLMHeadModel(llama_config()).eval()  # rotary dim 16 + flash: the graph-safe decode path
    ids = torch.randint(0, 97, (2, 5))
    want = decode(ids, model, 14)
    got = decode(ids, model, 14, cg=True)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-5, atol=1e-5)
    cache = model._decoding_cache
    assert fake_graphs == [(2, 1, 0)] and cache.max_seqlen == 14
    kv = cache.inference_params.key_value_memory_dict
    assert sorted(kv) == [0, 1] and kv[0].shape == (2, 14, 2, 2, 16)
    # Reuse: same shapes capture nothing; a smaller batch adds a graph in the same pool; a longer
    # max_length rebuilds the caches and the pool.
    ids2 = torch.randint(0, 97, (2, 3))
    assert torch.equal(decode(ids2, model, 14, cg=True).sequences, decode(ids2, model, 14).sequences)
    assert len(fake_graphs) == 1 and model._decoding_cache is cache
    assert torch.equal(decode(ids2[:1], model, 10, cg=True).sequences, decode(ids2[:1], model, 10).sequences)
    assert fake_graphs[1] == (1, 1, 0)
    decode(ids2, model, 16, cg=True)
    assert fake_graphs[2] == (2, 1, 1) and set(cache.callables) == {(2, 1)} and cache.max_seqlen == 16


def test_graph_speculative_decoding_protocol_on_cpu(fake_graphs, stale_caches):
    model = GPTLMHeadModel(llama_config()).eval()
    draft = GPTLMHeadModel(llama_config(n_layer=1)).eval()
    ids = torch.randint(0, 97, (1, 4))
    want = decode(ids, model, 16).sequences
    got = decode_speculative(ids, model, draft, 16, speculative_lookahead=3, cg=True)
    assert torch.equal(got.sequences, want)
    assert sorted(model._decoding_cache.callables) == [(1, 1), (1, 2), (1, 3), (1, 4)]
    assert sorted(draft._decoding_cache.callables) == [(1, 1), (1, 2)]
    with pytest.raises(ValueError, match="distinct"):
        decode_speculative(ids, model, model, 16, cg=True)


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("make_config", [lambda **kw: gpt2_config(n_embd=64, **kw), llama_config, parallel_config],
                         ids=["gpt2", "llama", "parallel_block"])
def test_gpu_bf16_matches_reference(make_config):
    cfg = make_config(use_flash_attn=True, fused_bias_fc=True, fused_dropout_add_ln=True)
    model = GPTLMHeadModel(cfg, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (3, 61), device="cuda")
    _check_against_reference(model, cfg, ids, dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_greedy_decode_and_cuda_graphs():
    cfg = llama_config(n_layer=3)  # rotary dim 16: the fused kvcache rotary path graphs can replay
    model = GPTLMHeadModel(cfg, device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 97, (2, 7), device="cuda")
    eager = decode(ids, model, 40)
    # The cached logits match a full recompute (bf16 kernels differ, so not bitwise) and each token is
    # their argmax.
    with torch.no_grad():
        full = model(eager.sequences).logits[:, 6:-1].float()
    cached = torch.stack(eager.scores, dim=1).float()
    torch.testing.assert_close(cached, full, rtol=0.03, atol=0.03)
    assert torch.equal(cached.argmax(-1), eager.sequences[:, 7:])
    graphed = decode(ids, model, 40, cg=True)
    assert torch.equal(graphed.sequences, eager.sequences)
    for a, b in zip(graphed.scores, eager.scores):
        torch.testing.assert_close(a, b, rtol=0.02, atol=0.02)
    cache = model._decoding_cache
    graphs = dict(cache.callables)
    assert list(graphs) == [(2, 1)]
    # A second call with the same shapes replays the same graphs; a smaller batch adds one graph
    # over the same caches and pool; a longer max_length rebuilds everything.
    ids2 = torch.randint(0, 97, (2, 9), device="cuda")
    again = decode(ids2, model, 40, cg=True)
    assert model._decoding_cache is cache and cache.callables[(2, 1)] is graphs[(2, 1)]
    assert torch.equal(again.sequences, decode(ids2, model, 40).sequences)
    one = decode(ids2[:1], model, 40, cg=True)
    assert set(cache.callables) == {(2, 1), (1, 1)} and cache.callables[(2, 1)] is graphs[(2, 1)]
    assert torch.equal(one.sequences, decode(ids2[:1], model, 40).sequences)
    decode(ids2, model, 48, cg=True)
    assert cache.max_seqlen == 48 and cache.callables[(2, 1)] is not graphs[(2, 1)]


@pytest.mark.gpu
def test_gpu_speculative_decoding_with_graphs():
    cfg = llama_config()
    model = GPTLMHeadModel(cfg, device="cuda", dtype=torch.float32).eval()
    draft = GPTLMHeadModel(llama_config(n_layer=1), device="cuda", dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (1, 5), device="cuda")
    got = decode_speculative(ids, model, draft, 30, speculative_lookahead=3, cg=True)
    assert got.sequences.shape == (1, 30) and torch.equal(got.sequences[:, :5], ids)
    # Greedy speculative decoding keeps the target's argmax at every position: check against a full
    # recompute of the target (up to TF32 rounding of near-ties).
    with torch.no_grad():
        full = model(got.sequences).logits[0, 4:-1]
    chosen = full.gather(-1, got.sequences[0, 5:, None]).squeeze(-1)
    assert bool((chosen >= full.max(-1).values - 1e-3).all())
    torch.testing.assert_close(got.scores[0], full, rtol=1e-3, atol=1e-3)
