"""GPT-NeoX / Pythia checkpoints on flash_attn's GPT model.

Differences from flash_attn 2.8, each a fix: the converter reads the rotary base and fraction from
either transformers layout (``rope_parameters`` or ``rotary_emb_base`` / ``rotary_pct``) instead of
asserting a base of 10000, and carries ``attention_bias``; the remap accepts the output head under
either name (``embed_out`` in older checkpoints, ``lm_head`` in transformers 5); the inverse
(``inv_remap_state_dict_hf_gpt_neox``) is culmen's addition and writes ``lm_head.weight``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import Tensor

from culmen.flash_attn.models.llama import (
    _cfg,
    _gpt2_config,
    _heads,
    _lm_head_from,
    _lm_head_to,
    _n_layer,
    _pad_vocab,
    _rename,
    _rope_theta,
    _unpad_vocab,
    _warn_rope_scaling,
)

if TYPE_CHECKING:
    from transformers import GPT2Config, GPTNeoXConfig

__all__ = ["remap_state_dict_hf_gpt_neox", "inv_remap_state_dict_hf_gpt_neox", "gpt_neox_config_to_gpt2_config"]


def _heads_major_to_qkv_major(w: Tensor, n_head: int) -> Tensor:
    """GPT-NeoX's fused rows ``(n_head, 3, head_dim)`` -> flash_attn's ``(3, n_head, head_dim)``."""
    d = w.shape[0] // (3 * n_head)
    rest = w.shape[1:]
    return w.reshape(n_head, 3, d, *rest).transpose(0, 1).reshape(3 * n_head * d, *rest)


def _qkv_major_to_heads_major(w: Tensor, n_head: int) -> Tensor:
    d = w.shape[0] // (3 * n_head)
    rest = w.shape[1:]
    return w.reshape(3, n_head, d, *rest).transpose(0, 1).reshape(3 * n_head * d, *rest)


def remap_state_dict_hf_gpt_neox(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """Hugging Face ``GPTNeoXForCausalLM`` state dict -> flash_attn GPT keys.

    Args:
        state_dict: ``gpt_neox.embed_in.weight``, ``gpt_neox.layers.{i}.attention.query_key_value.*`` ...
        config: the GPT2Config of ``gpt_neox_config_to_gpt2_config`` (``n_layer``, ``n_head``,
            ``tie_word_embeddings``, ``pad_vocab_size_multiple``).

    Returns:
        A new dict; the fused query/key/value rows (and bias) are reordered from per-head
        ``(q, k, v)`` groups to ``[all q; all k; all v]``; the causal-mask and rotary buffers older
        transformers stored are dropped.
    """
    n_layer = _n_layer(config)
    n_head, _, _ = _heads(config)
    sd = _rename(
        state_dict,
        [
            (r"^gpt_neox\.", "transformer."),
            (r"^transformer\.embed_in\.", "transformer.embeddings.word_embeddings."),
            (r"^embed_out\.", "lm_head."),
            (r"^transformer\.final_layer_norm\.", "transformer.ln_f."),
            (r"^transformer\.layers\.(\d+)\.input_layernorm\.", r"transformer.layers.\1.norm1."),
            (r"^transformer\.layers\.(\d+)\.post_attention_layernorm\.", r"transformer.layers.\1.norm2."),
            (r"^transformer\.layers\.(\d+)\.mlp\.dense_h_to_4h\.", r"transformer.layers.\1.mlp.fc1."),
            (r"^transformer\.layers\.(\d+)\.mlp\.dense_4h_to_h\.", r"transformer.layers.\1.mlp.fc2."),
            (r"^transformer\.layers\.(\d+)\.attention\.dense\.", r"transformer.layers.\1.mixer.out_proj."),
            (r"^transformer\.layers\.(\d+)\.attention\.query_key_value\.", r"transformer.layers.\1.mixer.Wqkv."),
        ],
    )
    key = "transformer.embeddings.word_embeddings.weight"
    sd[key] = _pad_vocab(sd.pop(key), config)
    _lm_head_from(sd, config, "lm_head.weight")
    for i in range(n_layer):
        p = f"transformer.layers.{i}."
        for buffer in ("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq"):
            sd.pop(p + buffer, None)
        for suffix in ("weight", "bias"):
            if suffix == "weight" or p + "mixer.Wqkv.bias" in sd:
                sd[p + f"mixer.Wqkv.{suffix}"] = _heads_major_to_qkv_major(sd.pop(p + f"mixer.Wqkv.{suffix}"), n_head)
    return sd


def inv_remap_state_dict_hf_gpt_neox(
    state_dict: Mapping[str, Tensor], config: GPT2Config
) -> OrderedDict[str, Tensor]:
    """flash_attn GPT keys -> Hugging Face ``GPTNeoXForCausalLM`` keys (inverse of
    ``remap_state_dict_hf_gpt_neox``; the vocabulary padding is trimmed to ``config.vocab_size``)."""
    n_layer = _n_layer(config)
    n_head, _, _ = _heads(config)
    sd = _rename(
        state_dict,
        [
            (r"^transformer\.embeddings\.word_embeddings\.", "gpt_neox.embed_in."),
            (r"^transformer\.ln_f\.", "gpt_neox.final_layer_norm."),
            (r"^transformer\.layers\.(\d+)\.norm1\.", r"gpt_neox.layers.\1.input_layernorm."),
            (r"^transformer\.layers\.(\d+)\.norm2\.", r"gpt_neox.layers.\1.post_attention_layernorm."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc1\.", r"gpt_neox.layers.\1.mlp.dense_h_to_4h."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc2\.", r"gpt_neox.layers.\1.mlp.dense_4h_to_h."),
            (r"^transformer\.layers\.(\d+)\.mixer\.out_proj\.", r"gpt_neox.layers.\1.attention.dense."),
            (r"^transformer\.layers\.(\d+)\.mixer\.Wqkv\.", r"gpt_neox.layers.\1.attention.query_key_value."),
        ],
    )
    sd["gpt_neox.embed_in.weight"] = _unpad_vocab(sd.pop("gpt_neox.embed_in.weight"), config)
    _lm_head_to(sd, config, "gpt_neox.embed_in.weight", "lm_head.weight")
    for i in range(n_layer):
        p = f"gpt_neox.layers.{i}.attention.query_key_value."
        for suffix in ("weight", "bias"):
            if suffix == "weight" or p + "bias" in sd:
                sd[p + suffix] = _qkv_major_to_heads_major(sd.pop(p + suffix), n_head)
    return sd


def gpt_neox_config_to_gpt2_config(gpt_neox_config: GPTNeoXConfig) -> GPT2Config:
    """The ``GPT2Config`` (with flash_attn's extras) of a GPT-NeoX model: pre-norm LayerNorm blocks,
    parallel attention + MLP with separate norms when ``use_parallel_residual``, non-interleaved
    partial rotary (``rotary_emb_fraction`` = the rotary fraction of the head), no dropout."""
    params = getattr(gpt_neox_config, "rope_parameters", None)
    fraction = None
    if isinstance(params, Mapping):
        fraction = params.get("partial_rotary_factor")
    if fraction is None:
        fraction = _cfg(gpt_neox_config, "rotary_pct", "partial_rotary_factor", default=1.0)
    _warn_rope_scaling(gpt_neox_config, "GPT-NeoX")
    bias = bool(getattr(gpt_neox_config, "attention_bias", True))
    return _gpt2_config(
        vocab_size=gpt_neox_config.vocab_size,
        n_positions=0,
        n_embd=gpt_neox_config.hidden_size,
        n_layer=gpt_neox_config.num_hidden_layers,
        n_head=gpt_neox_config.num_attention_heads,
        n_inner=gpt_neox_config.intermediate_size,
        activation_function=gpt_neox_config.hidden_act,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=gpt_neox_config.layer_norm_eps,
        initializer_range=gpt_neox_config.initializer_range,
        bos_token_id=gpt_neox_config.bos_token_id,
        eos_token_id=gpt_neox_config.eos_token_id,
        prenorm=True,
        parallel_block=bool(gpt_neox_config.use_parallel_residual),
        parallel_block_tied_norm=False,
        rotary_emb_fraction=float(fraction),
        rotary_emb_base=_rope_theta(gpt_neox_config),
        rotary_emb_interleaved=False,
        qkv_proj_bias=bias,
        out_proj_bias=bias,
        tie_word_embeddings=bool(gpt_neox_config.tie_word_embeddings),
    )
