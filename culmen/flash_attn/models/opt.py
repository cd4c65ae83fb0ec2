"""OPT checkpoints on flash_attn's GPT model.

OPT keeps two extra rows at the start of its learned position table (positions are offset by 2);
the GPT embedding has none, so the remap drops them and the inverse (culmen's addition,
``inv_remap_state_dict_hf_opt``) writes zeros there: those rows are only read for padding tokens.
Differences from flash_attn 2.8, each a fix: the converter keeps the config's
``tie_word_embeddings`` and ``enable_bias`` and raises ValueError (not an assert) on what the GPT
model cannot express.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from culmen.flash_attn.models.llama import (
    _gpt2_config,
    _heads,
    _lm_head_from,
    _lm_head_to,
    _n_layer,
    _pad_vocab,
    _rename,
    _unpad_vocab,
)

if TYPE_CHECKING:
    from transformers import GPT2Config, OPTConfig

__all__ = ["remap_state_dict_hf_opt", "inv_remap_state_dict_hf_opt", "opt_config_to_gpt2_config"]

# OPTLearnedPositionalEmbedding's offset: position p reads row p + 2.
_POSITION_OFFSET = 2


def remap_state_dict_hf_opt(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """Hugging Face ``OPTForCausalLM`` state dict -> flash_attn GPT keys.

    Args:
        state_dict: ``model.decoder.*`` keys (or ``decoder.*``, as in the OPT-350m checkpoint), with
            ``project_in`` / ``project_out`` where ``word_embed_proj_dim != hidden_size``.
        config: the GPT2Config of ``opt_config_to_gpt2_config``.

    Returns:
        A new dict: ``Wqkv = cat([q, k, v])`` with the matching bias; the position table without its
        first two rows; ``decoder.layer_norm`` (OPT-175B) or ``decoder.final_layer_norm`` as ``ln_f``;
        the tied head set to the padded word embeddings.
    """
    n_layer = _n_layer(config)
    sd = _rename(
        state_dict,
        [
            (r"^model\.decoder\.", "transformer."),
            (r"^decoder\.", "transformer."),
            (r"^transformer\.embed_tokens\.", "transformer.embeddings.word_embeddings."),
            (r"^transformer\.project_in\.", "transformer.embeddings.project_in."),
            (r"^transformer\.project_out\.", "project_out."),
            (r"^transformer\.embed_positions\.", "transformer.embeddings.position_embeddings."),
            (r"^transformer\.final_layer_norm\.", "transformer.ln_f."),
            (r"^transformer\.layer_norm\.", "transformer.ln_f."),
            (r"^transformer\.layers\.(\d+)\.self_attn_layer_norm\.", r"transformer.layers.\1.norm1."),
            (r"^transformer\.layers\.(\d+)\.final_layer_norm\.", r"transformer.layers.\1.norm2."),
            (r"^transformer\.layers\.(\d+)\.fc(1|2)\.", r"transformer.layers.\1.mlp.fc\2."),
            (r"^transformer\.layers\.(\d+)\.self_attn\.out_proj\.", r"transformer.layers.\1.mixer.out_proj."),
        ],
    )
    pos = "transformer.embeddings.position_embeddings.weight"
    sd[pos] = sd.pop(pos)[_POSITION_OFFSET:]
    key = "transformer.embeddings.word_embeddings.weight"
    sd[key] = _pad_vocab(sd.pop(key), config)
    _lm_head_from(sd, config, "lm_head.weight")
    for i in range(n_layer):
        p = f"transformer.layers.{i}."
        for suffix in ("weight", "bias"):
            if suffix == "weight" or p + "self_attn.q_proj.bias" in sd:
                q, k, v = (sd.pop(p + f"self_attn.{x}_proj.{suffix}") for x in "qkv")
                sd[p + f"mixer.Wqkv.{suffix}"] = torch.cat([q, k, v], dim=0)
    return sd


def inv_remap_state_dict_hf_opt(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """flash_attn GPT keys -> Hugging Face ``OPTForCausalLM`` keys (``model.decoder.*``): the inverse of
    ``remap_state_dict_hf_opt`` except the two offset rows of the position table, which come back as
    zeros."""
    n_layer = _n_layer(config)
    n_head, _, head_dim = _heads(config)
    width = n_head * head_dim
    sd = _rename(
        state_dict,
        [
            (r"^transformer\.embeddings\.word_embeddings\.", "model.decoder.embed_tokens."),
            (r"^transformer\.embeddings\.position_embeddings\.", "model.decoder.embed_positions."),
            (r"^transformer\.embeddings\.project_in\.", "model.decoder.project_in."),
            (r"^project_out\.", "model.decoder.project_out."),
            (r"^transformer\.ln_f\.", "model.decoder.final_layer_norm."),
            (r"^transformer\.layers\.(\d+)\.norm1\.", r"model.decoder.layers.\1.self_attn_layer_norm."),
            (r"^transformer\.layers\.(\d+)\.norm2\.", r"model.decoder.layers.\1.final_layer_norm."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc(1|2)\.", r"model.decoder.layers.\1.fc\2."),
            (r"^transformer\.layers\.(\d+)\.mixer\.out_proj\.", r"model.decoder.layers.\1.self_attn.out_proj."),
            (r"^transformer\.layers\.(\d+)\.mixer\.Wqkv\.", r"model.decoder.layers.\1.self_attn.Wqkv."),
        ],
    )
    pos_key = "model.decoder.embed_positions.weight"
    pos = sd.pop(pos_key)
    sd[pos_key] = torch.cat([pos.new_zeros(_POSITION_OFFSET, pos.shape[1]), pos], dim=0)
    emb_key = "model.decoder.embed_tokens.weight"
    sd[emb_key] = _unpad_vocab(sd.pop(emb_key), config)
    _lm_head_to(sd, config, emb_key, "lm_head.weight")
    for i in range(n_layer):
        p = f"model.decoder.layers.{i}.self_attn."
        for suffix in ("weight", "bias"):
            if suffix == "weight" or p + "Wqkv.bias" in sd:
                q, k, v = torch.split(sd.pop(p + f"Wqkv.{suffix}"), [width, width, width], dim=0)
                sd[p + f"q_proj.{suffix}"], sd[p + f"k_proj.{suffix}"], sd[p + f"v_proj.{suffix}"] = q, k, v
    return sd


def opt_config_to_gpt2_config(opt_config: OPTConfig) -> GPT2Config:
    """The ``GPT2Config`` (with flash_attn's extras) of an OPT model: learned positions, pre-norm or
    (``do_layer_norm_before=False``, OPT-350m) post-norm blocks, ``word_embed_proj_dim`` projections.

    Raises ValueError for ``layerdrop != 0`` or LayerNorms without affine parameters.
    """
    if opt_config.layerdrop != 0.0:
        raise ValueError(f"opt_config.layerdrop must be 0.0 (no layerdrop in GPT), got {opt_config.layerdrop}")
    if not opt_config.layer_norm_elementwise_affine:
        raise ValueError("opt_config.layer_norm_elementwise_affine must be True, got False")
    proj = opt_config.word_embed_proj_dim
    bias = bool(getattr(opt_config, "enable_bias", True))
    return _gpt2_config(
        vocab_size=opt_config.vocab_size,
        n_positions=opt_config.max_position_embeddings,
        n_embd=opt_config.hidden_size,
        n_layer=opt_config.num_hidden_layers,
        n_head=opt_config.num_attention_heads,
        n_inner=opt_config.ffn_dim,
        activation_function=opt_config.activation_function,
        resid_pdrop=opt_config.dropout,
        embd_pdrop=opt_config.dropout,
        attn_pdrop=opt_config.attention_dropout,
        initializer_range=opt_config.init_std,
        bos_token_id=opt_config.bos_token_id,
        eos_token_id=opt_config.eos_token_id,
        pad_token_id=opt_config.pad_token_id,
        prenorm=bool(opt_config.do_layer_norm_before),
        word_embed_proj_dim=None if proj in (None, opt_config.hidden_size) else proj,
        tie_word_embeddings=bool(getattr(opt_config, "tie_word_embeddings", True)),
        qkv_proj_bias=bias,
        out_proj_bias=bias,
        mlp_fc1_bias=bias,
        mlp_fc2_bias=bias,
    )
