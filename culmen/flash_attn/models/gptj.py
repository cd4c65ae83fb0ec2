"""GPT-J checkpoints on flash_attn's GPT model.

Differences from flash_attn 2.8, each a fix: the converter sets ``lm_head_bias=True`` (GPT-J's output
layer has a bias, which flash_attn's config dropped while its remap kept the key), and the inverse
``inv_remap_state_dict_hf_gptj`` is culmen's addition.
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
    from transformers import GPT2Config, GPTJConfig

__all__ = ["remap_state_dict_hf_gptj", "inv_remap_state_dict_hf_gptj", "gptj_config_to_gpt2_config"]


def remap_state_dict_hf_gptj(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """Hugging Face ``GPTJForCausalLM`` state dict -> flash_attn GPT keys.

    Args:
        state_dict: ``transformer.wte.weight``, ``transformer.h.{i}.attn.q_proj.weight`` ...,
            ``lm_head.weight`` and ``lm_head.bias``.
        config: the GPT2Config of ``gptj_config_to_gpt2_config``.

    Returns:
        A new dict: ``Wqkv = cat([q_proj, k_proj, v_proj])`` (GPT-J's rows are already in the
        interleaved rotary order), the single ``ln_1`` becomes ``norm1`` (tied parallel block), the
        head weight and bias are zero-padded to ``pad_vocab_size_multiple`` rows, causal-mask buffers
        of older transformers are dropped.
    """
    n_layer = _n_layer(config)
    sd = _rename(
        state_dict,
        [
            (r"^transformer\.h\.", "transformer.layers."),
            (r"^transformer\.wte\.", "transformer.embeddings.word_embeddings."),
            (r"^transformer\.layers\.(\d+)\.ln_1\.", r"transformer.layers.\1.norm1."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc_in\.", r"transformer.layers.\1.mlp.fc1."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc_out\.", r"transformer.layers.\1.mlp.fc2."),
            (r"^transformer\.layers\.(\d+)\.attn\.out_proj\.", r"transformer.layers.\1.mixer.out_proj."),
        ],
    )
    key = "transformer.embeddings.word_embeddings.weight"
    sd[key] = _pad_vocab(sd.pop(key), config)
    _lm_head_from(sd, config, "lm_head.weight")
    if "lm_head.bias" in sd:
        sd["lm_head.bias"] = _pad_vocab(sd.pop("lm_head.bias"), config)
    for i in range(n_layer):
        p = f"transformer.layers.{i}."
        q, k, v = (sd.pop(p + f"attn.{x}_proj.weight") for x in "qkv")
        sd[p + "mixer.Wqkv.weight"] = torch.cat([q, k, v], dim=0)
        sd.pop(p + "attn.bias", None)
        sd.pop(p + "attn.masked_bias", None)
    return sd


def inv_remap_state_dict_hf_gptj(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """flash_attn GPT keys -> Hugging Face ``GPTJForCausalLM`` keys (inverse of ``remap_state_dict_hf_gptj``;
    vocabulary padding trimmed to ``config.vocab_size``)."""
    n_layer = _n_layer(config)
    n_head, _, head_dim = _heads(config)
    width = n_head * head_dim
    sd = _rename(
        state_dict,
        [
            (r"^transformer\.embeddings\.word_embeddings\.", "transformer.wte."),
            (r"^transformer\.layers\.(\d+)\.norm1\.", r"transformer.h.\1.ln_1."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc1\.", r"transformer.h.\1.mlp.fc_in."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc2\.", r"transformer.h.\1.mlp.fc_out."),
            (r"^transformer\.layers\.(\d+)\.mixer\.out_proj\.", r"transformer.h.\1.attn.out_proj."),
            (r"^transformer\.layers\.(\d+)\.mixer\.Wqkv\.", r"transformer.h.\1.attn.Wqkv."),
        ],
    )
    sd["transformer.wte.weight"] = _unpad_vocab(sd.pop("transformer.wte.weight"), config)
    _lm_head_to(sd, config, "transformer.wte.weight", "lm_head.weight")
    if "lm_head.bias" in sd:
        sd["lm_head.bias"] = _unpad_vocab(sd.pop("lm_head.bias"), config)
    for i in range(n_layer):
        p = f"transformer.h.{i}.attn."
        q, k, v = torch.split(sd.pop(p + "Wqkv.weight"), [width, width, width], dim=0)
        sd[p + "q_proj.weight"], sd[p + "k_proj.weight"], sd[p + "v_proj.weight"] = q, k, v
    return sd


def gptj_config_to_gpt2_config(gptj_config: GPTJConfig) -> GPT2Config:
    """The ``GPT2Config`` (with flash_attn's extras) of a GPT-J model: parallel attention + MLP behind
    one shared LayerNorm, interleaved rotary on the first ``rotary_dim`` channels of each head, no
    attention biases, an output layer with bias, untied embeddings."""
    head_dim = gptj_config.n_embd // gptj_config.n_head
    rotary_dim = gptj_config.rotary_dim if gptj_config.rotary_dim is not None else head_dim
    return _gpt2_config(
        vocab_size=gptj_config.vocab_size,
        n_positions=0,
        n_embd=gptj_config.n_embd,
        n_layer=gptj_config.n_layer,
        n_head=gptj_config.n_head,
        n_inner=gptj_config.n_inner,
        activation_function=gptj_config.activation_function,
        resid_pdrop=gptj_config.resid_pdrop,
        embd_pdrop=gptj_config.embd_pdrop,
        attn_pdrop=gptj_config.attn_pdrop,
        layer_norm_epsilon=gptj_config.layer_norm_epsilon,
        initializer_range=gptj_config.initializer_range,
        bos_token_id=gptj_config.bos_token_id,
        eos_token_id=gptj_config.eos_token_id,
        prenorm=True,
        parallel_block=True,
        parallel_block_tied_norm=True,
        rotary_emb_fraction=rotary_dim / head_dim,
        rotary_emb_interleaved=True,
        tie_word_embeddings=False,
        qkv_proj_bias=False,
        out_proj_bias=False,
        lm_head_bias=True,
    )
