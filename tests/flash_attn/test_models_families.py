"""flash_attn's model-family adapters (LLaMA, GPT-NeoX, GPT-J, OPT, Falcon, BigCode, BTLM, Baichuan).

For every family with a transformers implementation: a tiny random Hugging Face model's state dict
goes to flash_attn's GPT layout and back bit-exactly, the GPT layout has exactly the keys and shapes
of ``GPTLMHeadModel(converted config)``, and that model loaded with the remapped weights gives the
Hugging Face model's logits and (mapped back through the inverse remap) its parameter gradients
within the tolerance rule (float64 Hugging Face model as the reference, float32 as the baseline).
BTLM and Baichuan are remote-code models: their layouts are built here from their published
architecture (Baichuan-7B is LLaMA with a fused ``W_pack``; BTLM is checked against a plain-PyTorch
forward written below).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import PretrainedConfig

from culmen.flash_attn.models import baichuan, bigcode, btlm, falcon, gpt_neox, gptj, llama, opt
from culmen.flash_attn.models.gpt import GPTLMHeadModel
from culmen.testing.tolerance import assert_close_tolerance

VOCAB = 61  # odd, so pad_vocab_size_multiple=8 adds 3 rows
PAD_MULTIPLE = 8


@dataclass(frozen=True)
class Family:
    hf_class: str
    hf_config: dict[str, Any]
    to_gpt2: Callable
    remap: Callable
    inv_remap: Callable


CASES: dict[str, Family] = {
    "llama_gqa": Family(
        "LlamaForCausalLM",
        dict(hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2),
        llama.llama_config_to_gpt2_config, llama.remap_state_dict_hf_llama, llama.inv_remap_state_dict_hf_llama,
    ),
    "llama_tied_bias_theta": Family(
        "LlamaForCausalLM",
        dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, tie_word_embeddings=True,
             attention_bias=True, mlp_bias=True, rope_theta=500.0),
        llama.llama_config_to_gpt2_config, llama.remap_state_dict_hf_llama, llama.inv_remap_state_dict_hf_llama,
    ),
    "gpt_neox_parallel": Family(
        "GPTNeoXForCausalLM",
        dict(hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.5),
        gpt_neox.gpt_neox_config_to_gpt2_config, gpt_neox.remap_state_dict_hf_gpt_neox,
        gpt_neox.inv_remap_state_dict_hf_gpt_neox,
    ),
    "gpt_neox_sequential_tied": Family(
        "GPTNeoXForCausalLM",
        dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             use_parallel_residual=False, tie_word_embeddings=True, attention_bias=False, rotary_emb_base=1000.0),
        gpt_neox.gpt_neox_config_to_gpt2_config, gpt_neox.remap_state_dict_hf_gpt_neox,
        gpt_neox.inv_remap_state_dict_hf_gpt_neox,
    ),
    "gptj": Family(
        "GPTJForCausalLM",
        dict(n_embd=48, n_layer=2, n_head=4, rotary_dim=8, bos_token_id=0, eos_token_id=0),
        gptj.gptj_config_to_gpt2_config, gptj.remap_state_dict_hf_gptj, gptj.inv_remap_state_dict_hf_gptj,
    ),
    "opt_prenorm": Family(
        "OPTForCausalLM",
        dict(hidden_size=48, ffn_dim=72, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=24,
             pad_token_id=1, bos_token_id=2, eos_token_id=2),
        opt.opt_config_to_gpt2_config, opt.remap_state_dict_hf_opt, opt.inv_remap_state_dict_hf_opt,
    ),
    "opt_postnorm_projected": Family(
        "OPTForCausalLM",
        dict(hidden_size=48, ffn_dim=72, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=24,
             do_layer_norm_before=False, word_embed_proj_dim=24, pad_token_id=1, bos_token_id=2, eos_token_id=2),
        opt.opt_config_to_gpt2_config, opt.remap_state_dict_hf_opt, opt.inv_remap_state_dict_hf_opt,
    ),
    "falcon_multi_query": Family(
        "FalconForCausalLM",
        dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, bos_token_id=0, eos_token_id=0),
        falcon.falcon_config_to_gpt2_config, falcon.remap_state_dict_hf_falcon, falcon.inv_remap_state_dict_hf_falcon,
    ),
    "falcon_new_arch_gqa": Family(
        "FalconForCausalLM",
        dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_kv_heads=2, new_decoder_architecture=True,
             bos_token_id=0, eos_token_id=0, rope_theta=2000.0),
        falcon.falcon_config_to_gpt2_config, falcon.remap_state_dict_hf_falcon, falcon.inv_remap_state_dict_hf_falcon,
    ),
    "falcon_mha_sequential_bias": Family(
        "FalconForCausalLM",
        dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, multi_query=False, parallel_attn=False,
             bias=True, ffn_hidden_size=72, bos_token_id=0, eos_token_id=0),
        falcon.falcon_config_to_gpt2_config, falcon.remap_state_dict_hf_falcon, falcon.inv_remap_state_dict_hf_falcon,
    ),
    "bigcode_multi_query": Family(
        "GPTBigCodeForCausalLM",
        dict(n_embd=48, n_layer=2, n_head=4, n_positions=24, bos_token_id=0, eos_token_id=0),
        bigcode.bigcode_config_to_gpt2_config, bigcode.remap_state_dict_hf_bigcode,
        bigcode.inv_remap_state_dict_hf_bigcode,
    ),
    "bigcode_multi_head": Family(
        "GPTBigCodeForCausalLM",
        dict(n_embd=48, n_layer=2, n_head=4, n_positions=24, multi_query=False, bos_token_id=0, eos_token_id=0),
        bigcode.bigcode_config_to_gpt2_config, bigcode.remap_state_dict_hf_bigcode,
        bigcode.inv_remap_state_dict_hf_bigcode,
    ),
}


def _randomize(model: torch.nn.Module, std: float = 0.3) -> None:
    """Random values everywhere (norm weights and biases too), so a swapped row or norm shows up."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)


def _widened(fields: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The same architecture with ``head_dim``-wide heads (GPU cases use realistic head sizes)."""
    out = dict(fields)
    width = head_dim * (out.get("num_attention_heads") or out["n_head"])
    out["hidden_size" if "hidden_size" in out else "n_embd"] = width
    for key in ("intermediate_size", "ffn_dim", "ffn_hidden_size"):
        if key in out:
            out[key] = 2 * width
    if "rotary_dim" in out:
        out["rotary_dim"] = head_dim // 2
    if "word_embed_proj_dim" in out:
        out["word_embed_proj_dim"] = width // 2
    return out


def _build(case: str, head_dim: int | None = None):
    fam = CASES[case]
    config_cls = getattr(transformers, fam.hf_class.replace("ForCausalLM", "Config"))
    fields = fam.hf_config if head_dim is None else _widened(fam.hf_config, head_dim)
    hf_config = config_cls(vocab_size=VOCAB, **fields)
    hf = getattr(transformers, fam.hf_class)(hf_config).eval()
    _randomize(hf)
    cfg = fam.to_gpt2(hf_config)
    cfg.pad_vocab_size_multiple = PAD_MULTIPLE
    return fam, hf, cfg


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()
    yield


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_exact_and_matches_gpt_layout(case):
    fam, hf, cfg = _build(case)
    hf_sd = hf.state_dict()
    before = {k: v.clone() for k, v in hf_sd.items()}

    fa = fam.remap(hf_sd, cfg)
    model_sd = GPTLMHeadModel(cfg).state_dict()
    assert set(fa) == set(model_sd), (set(fa) ^ set(model_sd))
    for k, v in model_sd.items():
        assert fa[k].shape == v.shape, (k, fa[k].shape, v.shape)
    emb = fa["transformer.embeddings.word_embeddings.weight"]
    assert emb.shape[0] == 64 and torch.count_nonzero(emb[VOCAB:]) == 0

    back = fam.inv_remap(fa, cfg)
    assert set(back) == set(hf_sd)
    for k, v in hf_sd.items():
        if case.startswith("opt") and k.endswith("embed_positions.weight"):
            # OPT's two offset rows have no GPT counterpart; the inverse writes zeros there
            assert torch.equal(back[k][2:], v[2:]) and torch.count_nonzero(back[k][:2]) == 0
            continue
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    # the remaps build new dicts and leave the caller's untouched
    assert set(hf_sd) == set(before) and all(torch.equal(hf_sd[k], before[k]) for k in before)


def _fold_tiled_kv(grads: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """A multi-query checkpoint's one key/value head is tiled over every head of the GPT model, so its
    Hugging Face gradient is the sum over the tiles: put that sum in the tile the inverse keeps."""
    embed, n_head = cfg.n_embd, cfg.n_head
    out = dict(grads)
    for name, g in grads.items():
        if name.endswith("mixer.Wqkv.weight") or name.endswith("mixer.Wqkv.bias"):
            q, k, v = g.split([embed, embed, embed])
            rest = k.shape[1:]
            k = k.reshape(n_head, embed // n_head, *rest).sum(0).repeat((n_head,) + (1,) * len(rest))
            v = v.reshape(n_head, embed // n_head, *rest).sum(0).repeat((n_head,) + (1,) * len(rest))
            out[name] = torch.cat([q, k, v])
    return out


def _logits_and_grads(model, ids, weight, vocab=VOCAB):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits[..., :vocab]
    (logits * weight.to(logits.dtype)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _compare_with_hf(hf, model, cfg, inv_remap, ids, *, fold_tiled_kv=False, vocab=VOCAB):
    weight = torch.randn(*ids.shape, vocab, dtype=torch.float64)
    lo_logits, lo_grads = _logits_and_grads(hf, ids, weight, vocab)
    hf64 = copy.deepcopy(hf).double()
    hi_logits, hi_grads = _logits_and_grads(hf64, ids, weight, vocab)
    logits, grads = _logits_and_grads(model, ids, weight, vocab)

    assert_close_tolerance(logits, hi_logits, lo_logits, name="logits")
    if fold_tiled_kv:
        grads = _fold_tiled_kv(grads, cfg)
    mapped = inv_remap(grads, cfg)
    assert set(hi_grads) <= set(mapped), set(hi_grads) - set(mapped)
    for name, g_hi in hi_grads.items():
        assert_close_tolerance(mapped[name], g_hi, lo_grads[name], name=f"d{name}")


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients_match_hugging_face(case):
    fam, hf, cfg = _build(case)
    model = GPTLMHeadModel(cfg).eval()
    model.load_state_dict(fam.remap(hf.state_dict(), cfg), strict=True)
    ids = torch.randint(0, VOCAB, (2, 13))
    _compare_with_hf(hf, model, cfg, fam.inv_remap, ids, fold_tiled_kv=case == "bigcode_multi_query")


def test_llama_gqa_through_triton_kernels(triton_backend):
    """The same comparison with culmen's Triton kernels (fused add + RMSNorm, rotary, flash attention,
    SwiGLU) in the interpreter."""
    fam, hf, cfg = _build("llama_gqa")
    cfg.use_flash_attn = True
    cfg.fused_dropout_add_ln = True
    model = GPTLMHeadModel(cfg).eval()
    model.load_state_dict(fam.remap(hf.state_dict(), cfg))
    ids = torch.randint(0, VOCAB, (1, 9))
    _compare_with_hf(hf, model, cfg, fam.inv_remap, ids)


# ---------------------------------------------------------------------------------------------
# LLaMA: Meta checkpoints and configs
# ---------------------------------------------------------------------------------------------


def _hf_rows_from_meta(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The row permutation of Meta's published LLaMA -> Hugging Face conversion (pairs -> halves)."""
    d = w.shape[0] // n_heads
    return w.view(n_heads, d // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def test_meta_llama_remap_equals_hf_remap():
    fam, hf, cfg = _build("llama_gqa")
    hf_sd = hf.state_dict()
    n_layer, n_head, n_kv = cfg.n_layer, cfg.n_head, cfg.n_head_kv
    # A Meta checkpoint of the same model: Meta's rows are the un-permuted ones. Build them by
    # inverting the published permutation numerically (a permutation matrix, not the code under test).
    meta = {"tok_embeddings.weight": hf_sd["model.embed_tokens.weight"], "norm.weight": hf_sd["model.norm.weight"],
            "output.weight": hf_sd["lm_head.weight"], "rope.freqs": torch.randn(4)}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        for meta_name, hf_name, heads in (("wq", "q_proj", n_head), ("wk", "k_proj", n_kv)):
            w = hf_sd[p + f"self_attn.{hf_name}.weight"]
            perm = _hf_rows_from_meta(torch.arange(w.shape[0]).float().unsqueeze(1), heads).squeeze(1).long()
            meta_w = torch.empty_like(w)
            meta_w[perm] = w
            assert torch.equal(_hf_rows_from_meta(meta_w, heads), w)
            meta[f"layers.{i}.attention.{meta_name}.weight"] = meta_w
        meta[f"layers.{i}.attention.wv.weight"] = hf_sd[p + "self_attn.v_proj.weight"]
        meta[f"layers.{i}.attention.wo.weight"] = hf_sd[p + "self_attn.o_proj.weight"]
        meta[f"layers.{i}.feed_forward.w1.weight"] = hf_sd[p + "mlp.gate_proj.weight"]
        meta[f"layers.{i}.feed_forward.w2.weight"] = hf_sd[p + "mlp.down_proj.weight"]
        meta[f"layers.{i}.feed_forward.w3.weight"] = hf_sd[p + "mlp.up_proj.weight"]
        meta[f"layers.{i}.attention_norm.weight"] = hf_sd[p + "input_layernorm.weight"]
        meta[f"layers.{i}.ffn_norm.weight"] = hf_sd[p + "post_attention_layernorm.weight"]
    from_meta = llama.remap_state_dict_meta_llama(meta, cfg)
    from_hf = llama.remap_state_dict_hf_llama(hf_sd, cfg)
    assert set(from_meta) == set(from_hf)
    for k in from_hf:
        assert torch.equal(from_meta[k], from_hf[k]), k


@pytest.mark.parametrize(
    "params, intermediate, vocab",
    [
        # LLaMA-2 7B: 2/3 * 4 * 4096 rounded up to a multiple of 256; vocabulary from the default
        (dict(dim=4096, n_heads=32, n_layers=32, norm_eps=1e-5, multiple_of=256, vocab_size=-1), 11008, 32000),
        # LLaMA-3 8B: ffn_dim_multiplier 1.3, multiple_of 1024, grouped KV, vocabulary in params.json
        (dict(dim=4096, n_heads=32, n_kv_heads=8, n_layers=32, norm_eps=1e-5, multiple_of=1024,
              ffn_dim_multiplier=1.3, rope_theta=500000.0, vocab_size=128256), 14336, 128256),
    ],
)
def test_config_from_meta_checkpoint(tmp_path, params, intermediate, vocab):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "params.json").write_text(json.dumps(params))
    config = llama.config_from_checkpoint(tmp_path, "m")
    assert config.intermediate_size == intermediate and config.vocab_size == vocab
    assert config.hidden_size == params["dim"] and config.num_hidden_layers == params["n_layers"]
    assert config.num_key_value_heads == params.get("n_kv_heads", params["n_heads"])
    gpt2 = llama.llama_config_to_gpt2_config(config)
    assert gpt2.rotary_emb_base == params.get("rope_theta", 10000.0)
    assert gpt2.n_head_kv == params.get("n_kv_heads", params["n_heads"]) and gpt2.n_inner == intermediate


def test_config_from_hf_checkpoint(tmp_path):
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, vocab_size=77)
    config.save_pretrained(tmp_path / "tiny-hf")
    for loaded in (llama.config_from_hf_checkpoint(tmp_path, "tiny"),
                   llama.config_from_checkpoint(tmp_path, "tiny", checkpoint_format="hf")):
        assert (loaded.hidden_size, loaded.num_hidden_layers, loaded.vocab_size) == (64, 3, 77)


def test_state_dicts_from_checkpoint_orders_shards_numerically(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    for k in range(11):  # "consolidated.10.pth" sorts before "consolidated.2.pth" as a string
        torch.save({"w": torch.full((2,), float(k))}, folder / f"consolidated.{k}.pth")
    shards = llama.state_dicts_from_checkpoint(tmp_path, "m")
    assert [int(s["w"][0]) for s in shards] == list(range(11))


def test_llama_config_conversion_details():
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=100, rope_theta=12345.0, tie_word_embeddings=True)
    gpt2 = llama.llama_config_to_gpt2_config(config)
    assert (gpt2.n_head_kv, gpt2.rotary_emb_base, gpt2.tie_word_embeddings) == (2, 12345.0, True)
    assert gpt2.rms_norm and gpt2.rotary_emb_interleaved and gpt2.activation_function == "swiglu"
    assert gpt2.mlp_multiple_of == 1 and gpt2.n_inner == 100

    odd_head = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32)
    with pytest.raises(ValueError, match="head_dim"):
        llama.llama_config_to_gpt2_config(odd_head)
    scaled = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.warns(UserWarning, match="linear"):
        llama.llama_config_to_gpt2_config(scaled)


def test_other_config_converters():
    neox = gpt_neox.gpt_neox_config_to_gpt2_config(
        transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, rotary_pct=0.25, rotary_emb_base=777.0))
    assert (neox.rotary_emb_fraction, neox.rotary_emb_base, neox.parallel_block) == (0.25, 777.0, True)

    f7b = falcon.falcon_config_to_gpt2_config(transformers.FalconConfig(hidden_size=64, num_attention_heads=8))
    assert (f7b.n_head_kv, f7b.parallel_block, f7b.parallel_block_tied_norm, f7b.n_inner) == (1, True, True, 256)
    f40b = falcon.falcon_config_to_gpt2_config(transformers.FalconConfig(
        hidden_size=64, num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True))
    assert (f40b.n_head_kv, f40b.parallel_block_tied_norm) == (2, False)
    f11b = falcon.falcon_config_to_gpt2_config(transformers.FalconConfig(
        hidden_size=64, num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True,
        num_ln_in_parallel_attn=1))
    assert f11b.parallel_block_tied_norm
    with pytest.raises(ValueError, match="alibi"):
        falcon.falcon_config_to_gpt2_config(transformers.FalconConfig(alibi=True))

    with pytest.raises(ValueError, match="layerdrop"):
        opt.opt_config_to_gpt2_config(transformers.OPTConfig(layerdrop=0.1))
    with pytest.raises(ValueError, match="layer_norm_elementwise_affine"):
        opt.opt_config_to_gpt2_config(transformers.OPTConfig(layer_norm_elementwise_affine=False))
    assert opt.opt_config_to_gpt2_config(transformers.OPTConfig(hidden_size=64)).word_embed_proj_dim is None

    gj = gptj.gptj_config_to_gpt2_config(transformers.GPTJConfig(n_embd=64, n_head=4, rotary_dim=8))
    assert (gj.rotary_emb_fraction, gj.lm_head_bias, gj.parallel_block_tied_norm) == (0.5, True, True)


def test_remap_rejects_mismatched_fused_rows():
    fam, hf, cfg = _build("falcon_new_arch_gqa")
    cfg.n_head_kv = 3  # 6 query heads, but the checkpoint has 2 key/value heads
    with pytest.raises(ValueError, match="n_head_kv"):
        falcon.remap_state_dict_hf_falcon(hf.state_dict(), cfg)


# ---------------------------------------------------------------------------------------------
# Baichuan (remote code): Baichuan-7B is LLaMA with q/k/v fused into W_pack (Hugging Face rotary order)
# ---------------------------------------------------------------------------------------------


def _baichuan_config(**overrides) -> PretrainedConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=72,
                  rms_norm_eps=1e-6, initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    fields.update(overrides)
    return PretrainedConfig(**fields)


def _baichuan_state_dict_from_llama(hf_sd: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in hf_sd.items():
        if ".self_attn.q_proj." in k:
            out[k.replace("q_proj", "W_pack")] = torch.cat(
                [v, hf_sd[k.replace("q_proj", "k_proj")], hf_sd[k.replace("q_proj", "v_proj")]])
        elif ".self_attn.k_proj." not in k and ".self_attn.v_proj." not in k:
            out[k] = v
    return out


def test_baichuan_7b_matches_llama_reference_and_round_trips():
    bc_config = _baichuan_config()
    cfg = baichuan.baichuan_config_to_gpt2_config(bc_config)
    cfg.pad_vocab_size_multiple = PAD_MULTIPLE
    assert cfg.rotary_emb_fraction == 1.0 and not cfg.use_alibi and not cfg.norm_head
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=72,
        rms_norm_eps=1e-6)).eval()
    _randomize(hf)
    bc_sd = _baichuan_state_dict_from_llama(hf.state_dict(), 2)

    fa = baichuan.remap_state_dict_hf_baichuan(bc_sd, cfg)
    back = baichuan.inv_remap_state_dict_hf_baichuan(fa, cfg)
    assert set(back) == set(bc_sd) and all(torch.equal(back[k], bc_sd[k]) for k in bc_sd)

    model = GPTLMHeadModel(cfg).eval()
    model.load_state_dict(fa, strict=True)
    ids = torch.randint(0, VOCAB, (2, 11))

    def llama_inv(grads, cfg):  # Baichuan grads -> LLaMA names, to compare with the Hugging Face LLaMA
        bc = baichuan.inv_remap_state_dict_hf_baichuan(grads, cfg)
        out = {}
        for k, v in bc.items():
            if ".W_pack." in k:
                q, kk, vv = v.chunk(3)
                out[k.replace("W_pack", "q_proj")], out[k.replace("W_pack", "k_proj")] = q, kk
                out[k.replace("W_pack", "v_proj")] = vv
            else:
                out[k] = v
        return out

    _compare_with_hf(hf, model, cfg, llama_inv, ids)


def test_baichuan_config_infers_alibi_and_norm_head():
    cfg13b = baichuan.baichuan_config_to_gpt2_config(_baichuan_config(hidden_size=5120, vocab_size=64000))
    assert cfg13b.use_alibi and cfg13b.rotary_emb_fraction == 0.0 and not cfg13b.norm_head
    cfg2 = baichuan.baichuan_config_to_gpt2_config(_baichuan_config(hidden_size=4096, vocab_size=125696))
    assert not cfg2.use_alibi and cfg2.norm_head


# ---------------------------------------------------------------------------------------------
# BTLM (remote code): GPT-2 with Conv1D weights, SwiGLU, ALiBi or learned positions, muP scales
# ---------------------------------------------------------------------------------------------

BTLM_FIELDS = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, n_inner=40,
                   n_positions=24, activation_function="swiglu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                   layer_norm_epsilon=1e-5, initializer_range=0.02, bos_token_id=0, eos_token_id=0,
                   mup_width_scale=0.5, mup_embeddings_scale=1.7, mup_output_alpha=1.3, mup_scale_qk_dot_by_d=True)


def _alibi_reference_slopes(n: int) -> torch.Tensor:
    # n is a power of two in these tests: slopes 2^(-8 i / n), i = 1..n
    return torch.tensor([2.0 ** (-8.0 * i / n) for i in range(1, n + 1)], dtype=torch.float64)


def _btlm_state_dict(alibi: bool, dtype=torch.float32) -> dict[str, torch.Tensor]:
    d, inner, n_layer, heads = 48, 40, 2, 4
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).to(dtype)

    sd = {"transformer.wte.weight": r(VOCAB, d), "transformer.ln_f.weight": r(d), "transformer.ln_f.bias": r(d)}
    if alibi:
        sd["transformer.relative_pe.slopes"] = _alibi_reference_slopes(heads).to(dtype).unsqueeze(-1)
    else:
        sd["transformer.wpe.weight"] = r(24, d)
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        sd.update({p + "ln_1.weight": r(d), p + "ln_1.bias": r(d), p + "ln_2.weight": r(d), p + "ln_2.bias": r(d),
                   p + "attn.c_attn.weight": r(d, 3 * d), p + "attn.c_attn.bias": r(3 * d),
                   p + "attn.c_proj.weight": r(d, d), p + "attn.c_proj.bias": r(d),
                   p + "mlp.c_fc.weight": r(d, inner), p + "mlp.c_fc.bias": r(inner),
                   p + "mlp.c_fc2.weight": r(d, inner), p + "mlp.c_fc2.bias": r(inner),
                   p + "mlp.c_proj.weight": r(inner, d), p + "mlp.c_proj.bias": r(d)})
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def _btlm_reference(sd: dict[str, torch.Tensor], ids: torch.Tensor, alibi: bool) -> torch.Tensor:
    """BTLM's forward in plain PyTorch on its own checkpoint layout (Conv1D: ``y = x @ W + b``)."""
    f = BTLM_FIELDS
    heads, eps = f["num_attention_heads"], f["layer_norm_epsilon"]
    b, t = ids.shape
    x = sd["transformer.wte.weight"][ids]
    if not alibi:
        x = x + sd["transformer.wpe.weight"][torch.arange(t)]
    x = x * f["mup_embeddings_scale"]
    d = x.shape[-1]
    hd = d // heads
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    dist = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).abs().to(x.dtype)
    for i in range(f["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        h = F.layer_norm(x, (d,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], eps)
        q, k, v = (h @ sd[p + "attn.c_attn.weight"] + sd[p + "attn.c_attn.bias"]).split(d, dim=-1)
        q, k, v = (z.view(b, t, heads, hd).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / hd  # mup_scale_qk_dot_by_d: 1/d, not 1/sqrt(d)
        if alibi:
            slopes = sd["transformer.relative_pe.slopes"].to(x.dtype).view(heads, 1, 1)
            scores = scores - slopes * dist
        scores = scores.masked_fill(~causal, float("-inf"))
        a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + a @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"]
        h = F.layer_norm(x, (d,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], eps)
        x1 = h @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"]
        x2 = h @ sd[p + "mlp.c_fc2.weight"] + sd[p + "mlp.c_fc2.bias"]
        x = x + (x1 * F.silu(x2)) @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (d,), sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"], eps)
    return (x @ sd["transformer.wte.weight"].t()) * (f["mup_output_alpha"] * f["mup_width_scale"])


@pytest.mark.parametrize("alibi", [False, True], ids=["learned_positions", "alibi"])
def test_btlm_round_trip_and_reference_forward(alibi):
    config = PretrainedConfig(position_embedding_type="alibi" if alibi else "learned", **BTLM_FIELDS)
    cfg = btlm.btlm_config_to_gpt2_config(config)
    cfg.pad_vocab_size_multiple = PAD_MULTIPLE
    assert cfg.use_alibi == alibi and cfg.n_positions == (0 if alibi else 24)
    sd = _btlm_state_dict(alibi)

    fa = btlm.remap_state_dict_hf_btlm(sd, cfg)
    back = btlm.inv_remap_state_dict_hf_btlm(fa, cfg)
    assert set(back) == set(sd)
    for k in sd:
        assert back[k].shape == sd[k].shape and torch.equal(back[k], sd[k]), k

    model = GPTLMHeadModel(cfg).eval()
    model.load_state_dict(fa, strict=True)
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        logits = model(ids).logits[..., :VOCAB]
    sd64 = {k: v.double() for k, v in sd.items()}
    assert_close_tolerance(logits, _btlm_reference(sd64, ids, alibi), _btlm_reference(sd, ids, alibi), name="logits")


def test_btlm_inverse_slopes_follow_alibi_formula():
    # 6 heads is not a power of two: 4 slopes of the 4-head series, then every other one of the 8-head series
    slopes = torch.tensor(btlm._alibi_slopes(6))
    expected = [2.0 ** (-8.0 * i / 4) for i in range(1, 5)] + [2.0 ** (-8.0 * i / 8) for i in (1, 3)]
    assert torch.allclose(slopes, torch.tensor(expected), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# GPU: the same models in bf16 through culmen's kernels, against Hugging Face in fp32
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["llama_gqa", "gpt_neox_parallel", "gptj", "opt_prenorm", "falcon_new_arch_gqa",
                                  "bigcode_multi_query"])
def test_gpu_bf16_logits_match_hugging_face(case):
    fam, hf, cfg = _build(case, head_dim=64)
    cfg.use_flash_attn = True
    cfg.fused_dropout_add_ln = True
    cfg.fused_bias_fc = True
    hf = hf.cuda()
    model = GPTLMHeadModel(cfg, device="cuda", dtype=torch.bfloat16).eval()
    model.load_state_dict(fam.remap(hf.state_dict(), cfg), strict=True)
    ids = torch.randint(0, VOCAB, (3, 23), device="cuda")  # OPT / BigCode have 24 learned positions
    with torch.no_grad():
        ref = hf(ids).logits.float()
        base = copy.deepcopy(hf).to(torch.bfloat16)(ids).logits
        out = model(ids).logits[..., :VOCAB]
    assert out.dtype == torch.bfloat16
    assert_close_tolerance(out, ref, base, name="logits")


def test_names_import_through_flash_attn_alias():
    """flash_attn's names for these adapters, imported as a flash_attn script would."""
    code = textwrap.dedent("""
        import culmen.compat as compat
        compat.install()
        import culmen.flash_attn.models.llama as culmen_llama
        from flash_attn.models.llama import (config_from_checkpoint, config_from_hf_checkpoint,
            config_from_meta_checkpoint, inv_remap_state_dict_hf_llama, llama_config_to_gpt2_config,
            remap_state_dict_hf_llama, remap_state_dict_meta_llama, state_dicts_from_checkpoint)
        from flash_attn.models.gpt_neox import gpt_neox_config_to_gpt2_config, remap_state_dict_hf_gpt_neox
        from flash_attn.models.gptj import gptj_config_to_gpt2_config, remap_state_dict_hf_gptj
        from flash_attn.models.opt import opt_config_to_gpt2_config, remap_state_dict_hf_opt
        from flash_attn.models.falcon import falcon_config_to_gpt2_config, remap_state_dict_hf_falcon
        from flash_attn.models.btlm import btlm_config_to_gpt2_config, remap_state_dict_hf_btlm
        from flash_attn.models.bigcode import (bigcode_config_to_gpt2_config, inv_remap_state_dict_hf_bigcode,
            remap_state_dict_hf_bigcode)
        from flash_attn.models.baichuan import baichuan_config_to_gpt2_config, remap_state_dict_hf_baichuan
        from flash_attn.utils.pretrained import state_dict_from_pretrained
        assert remap_state_dict_hf_llama is culmen_llama.remap_state_dict_hf_llama
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-2000:]
