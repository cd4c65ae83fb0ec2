"""Baichuan / Baichuan 2 checkpoints (remote-code models) on flash_attn's GPT model.

Baichuan is LLaMA-shaped with a fused ``W_pack`` (``[q; k; v]`` rows, already flash_attn's order) and
Hugging Face's non-interleaved rotary (7B) or ALiBi (13B); Baichuan 2 normalises its output head
(``norm_head``). As in flash_attn, the config converter infers rotary vs ALiBi from the width (7B:
4096 < 5000) and the normalised head from the vocabulary (v2: 125696 > 70000), since the remote
configs do not say. ``inv_remap_state_dict_hf_baichuan`` is culmen's addition; flash_attn's converter
is otherwise followed, with ``mlp_multiple_of=1`` added (the checkpoint's MLP width is exact).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from culmen.flash_attn.models.llama import (
    _gpt2_config,
    _lm_head_from,
    _lm_head_to,
    _n_layer,
    _pad_vocab,
    _rename,
    _unpad_vocab,
)

if TYPE_CHECKING:
    from transformers import GPT2Config, PretrainedConfig

__all__ = ["remap_state_dict_hf_baichuan", "inv_remap_state_dict_hf_baichuan", "baichuan_config_to_gpt2_config"]


def remap_state_dict_hf_baichuan(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """Baichuan state dict (``model.embed_tokens``, ``model.layers.{i}.self_attn.W_pack`` ...) -> flash_attn GPT keys.

    Args:
        state_dict: the Hugging Face Baichuan checkpoint.
        config: the GPT2Config of ``baichuan_config_to_gpt2_config``.

    Returns:
        A new dict: ``W_pack`` becomes ``Wqkv`` unchanged, ``mlp.fc1 = cat([up_proj, gate_proj])``, the
        embedding and head zero-padded to ``pad_vocab_size_multiple`` rows, rotary buffers dropped.
    """
    n_layer = _n_layer(config)
    sd = _rename(
        state_dict,
        [
            (r"^model\.", "transformer."),
            (r"^transformer\.embed_tokens\.", "transformer.embeddings.word_embeddings."),
            (r"^transformer\.norm\.", "transformer.ln_f."),
            (r"^transformer\.layers\.(\d+)\.input_layernorm\.", r"transformer.layers.\1.norm1."),
            (r"^transformer\.layers\.(\d+)\.post_attention_layernorm\.", r"transformer.layers.\1.norm2."),
            (r"^transformer\.layers\.(\d+)\.mlp\.down_proj\.", r"transformer.layers.\1.mlp.fc2."),
            (r"^transformer\.layers\.(\d+)\.self_attn\.W_pack\.", r"transformer.layers.\1.mixer.Wqkv."),
            (r"^transformer\.layers\.(\d+)\.self_attn\.o_proj\.", r"transformer.layers.\1.mixer.out_proj."),
        ],
    )
    key = "transformer.embeddings.word_embeddings.weight"
    sd[key] = _pad_vocab(sd.pop(key), config)
    _lm_head_from(sd, config, "lm_head.weight")
    for i in range(n_layer):
        p = f"transformer.layers.{i}."
        gate = sd.pop(p + "mlp.gate_proj.weight")
        up = sd.pop(p + "mlp.up_proj.weight")
        sd[p + "mlp.fc1.weight"] = torch.cat([up, gate], dim=0)
        sd.pop(p + "self_attn.rotary_emb.inv_freq", None)
    return sd


def inv_remap_state_dict_hf_baichuan(
    state_dict: Mapping[str, Tensor], config: GPT2Config
) -> OrderedDict[str, Tensor]:
    """flash_attn GPT keys -> Baichuan keys (inverse of ``remap_state_dict_hf_baichuan``; vocabulary
    padding trimmed to ``config.vocab_size``)."""
    n_layer = _n_layer(config)
    sd = _rename(
        state_dict,
        [
            (r"^transformer\.embeddings\.word_embeddings\.", "model.embed_tokens."),
            (r"^transformer\.ln_f\.", "model.norm."),
            (r"^transformer\.layers\.(\d+)\.norm1\.", r"model.layers.\1.input_layernorm."),
            (r"^transformer\.layers\.(\d+)\.norm2\.", r"model.layers.\1.post_attention_layernorm."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc2\.", r"model.layers.\1.mlp.down_proj."),
            (r"^transformer\.layers\.(\d+)\.mixer\.Wqkv\.", r"model.layers.\1.self_attn.W_pack."),
            (r"^transformer\.layers\.(\d+)\.mixer\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
        ],
    )
    sd["model.embed_tokens.weight"] = _unpad_vocab(sd.pop("model.embed_tokens.weight"), config)
    _lm_head_to(sd, config, "model.embed_tokens.weight", "lm_head.weight")
    for i in range(n_layer):
        up, gate = torch.chunk(sd.pop(f"transformer.layers.{i}.mlp.fc1.weight"), 2, dim=0)
        sd[f"model.layers.{i}.mlp.gate_proj.weight"] = gate
        sd[f"model.layers.{i}.mlp.up_proj.weight"] = up
    return sd


def baichuan_config_to_gpt2_config(baichuan_config: PretrainedConfig) -> GPT2Config:
    """The ``GPT2Config`` (with flash_attn's extras) of a Baichuan model: RMSNorm, SwiGLU, no biases,
    non-interleaved rotary when ``hidden_size < 5000`` (7B) and ALiBi otherwise (13B), a normalised
    output head when ``vocab_size > 70000`` (Baichuan 2)."""
    use_rotary = baichuan_config.hidden_size < 5000
    return _gpt2_config(
        vocab_size=baichuan_config.vocab_size,
        n_positions=0,
        n_embd=baichuan_config.hidden_size,
        n_layer=baichuan_config.num_hidden_layers,
        n_head=baichuan_config.num_attention_heads,
        n_inner=baichuan_config.intermediate_size,
        activation_function="swiglu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=baichuan_config.rms_norm_eps,
        initializer_range=baichuan_config.initializer_range,
        bos_token_id=baichuan_config.bos_token_id,
        eos_token_id=baichuan_config.eos_token_id,
        pad_token_id=baichuan_config.pad_token_id,
        rms_norm=True,
        rotary_emb_fraction=1.0 if use_rotary else 0.0,
        rotary_emb_interleaved=False,
        use_alibi=not use_rotary,
        use_flash_attn=not use_rotary,  # flash_attn's ALiBi path lives in the flash attention kernel
        tie_word_embeddings=False,
        norm_head=baichuan_config.vocab_size > 70000,
        qkv_proj_bias=False,
        out_proj_bias=False,
        mlp_fc1_bias=False,
        mlp_fc2_bias=False,
        mlp_multiple_of=1,
    )
