"""Falcon checkpoints on flash_attn's GPT model.

Falcon fuses its query/key/value projection in groups: for each of ``n_head_kv`` key/value heads,
``n_head // n_head_kv`` query heads, then that key head, then that value head. Multi-query Falcon-7B
is one group; the classic multi-head layout is ``n_head`` groups of one query head.

Differences from flash_attn 2.8, each a fix: the fused query/key/value *bias* is regrouped like the
weight (flash_attn left it in Falcon's order); the number of key/value heads and of LayerNorms per
layer come from ``new_decoder_architecture`` / ``num_kv_heads`` / ``num_ln_in_parallel_attn`` /
``multi_query`` (flash_attn guessed the norms from ``n_head_kv == 1``, wrong for multi-head
``parallel_attn`` models); the converter reads transformers 5 field names, the rotary base,
``ffn_hidden_size`` and ``tie_word_embeddings``, and raises ValueError for ALiBi Falcons (flash_attn
built a rotary model for them). ``inv_remap_state_dict_hf_falcon`` is culmen's addition.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
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
    from transformers import FalconConfig, GPT2Config

__all__ = ["remap_state_dict_hf_falcon", "inv_remap_state_dict_hf_falcon", "falcon_config_to_gpt2_config"]


def _grouped_to_qkv(w: Tensor, n_head: int, n_head_kv: int) -> Tensor:
    """Falcon's rows ``(n_head_kv, ratio + 2, head_dim)`` -> ``[q (n_head); k (n_head_kv); v (n_head_kv)]``."""
    ratio = n_head // n_head_kv
    d = w.shape[0] // (n_head + 2 * n_head_kv)
    rest = w.shape[1:]
    g = w.reshape(n_head_kv, ratio + 2, d, *rest)
    q = g[:, :ratio].reshape(n_head * d, *rest)
    k = g[:, ratio].reshape(n_head_kv * d, *rest)
    v = g[:, ratio + 1].reshape(n_head_kv * d, *rest)
    return torch.cat([q, k, v], dim=0)


def _qkv_to_grouped(w: Tensor, n_head: int, n_head_kv: int) -> Tensor:
    ratio = n_head // n_head_kv
    d = w.shape[0] // (n_head + 2 * n_head_kv)
    rest = w.shape[1:]
    q, k, v = torch.split(w, [n_head * d, n_head_kv * d, n_head_kv * d], dim=0)
    groups = torch.cat(
        [q.reshape(n_head_kv, ratio, d, *rest), k.reshape(n_head_kv, 1, d, *rest), v.reshape(n_head_kv, 1, d, *rest)],
        dim=1,
    )
    return groups.reshape(w.shape)


def _check_rows(w: Tensor, key: str, n_head: int, n_head_kv: int, head_dim: int) -> None:
    rows = (n_head + 2 * n_head_kv) * head_dim
    if w.shape[0] != rows:
        raise ValueError(
            f"state_dict: {key} has {w.shape[0]} rows, expected {rows} for n_head={n_head}, n_head_kv={n_head_kv}, "
            f"head_dim={head_dim} (is config.n_head_kv right?)"
        )


def remap_state_dict_hf_falcon(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """Hugging Face ``FalconForCausalLM`` state dict -> flash_attn GPT keys.

    Args:
        state_dict: ``transformer.word_embeddings.weight``, ``transformer.h.{i}.self_attention.query_key_value.*`` ...
        config: the GPT2Config of ``falcon_config_to_gpt2_config`` (``n_head``, ``n_head_kv``, ``n_embd``,
            ``n_layer``, ``tie_word_embeddings``, ``pad_vocab_size_multiple``).

    Returns:
        A new dict with ``Wqkv`` (and its bias) regrouped to ``[q; k; v]``; ``input_layernorm`` /
        ``ln_attn`` become ``norm1`` and ``post_attention_layernorm`` / ``ln_mlp`` become ``norm2``.
    """
    n_layer = _n_layer(config)
    n_head, n_head_kv, head_dim = _heads(config)
    sd = _rename(
        state_dict,
        [
            (r"^transformer\.h\.", "transformer.layers."),
            (r"^transformer\.word_embeddings\.", "transformer.embeddings.word_embeddings."),
            (r"^transformer\.layers\.(\d+)\.(input_layernorm|ln_attn)\.", r"transformer.layers.\1.norm1."),
            (r"^transformer\.layers\.(\d+)\.(post_attention_layernorm|ln_mlp)\.", r"transformer.layers.\1.norm2."),
            (r"^transformer\.layers\.(\d+)\.mlp\.dense_h_to_4h\.", r"transformer.layers.\1.mlp.fc1."),
            (r"^transformer\.layers\.(\d+)\.mlp\.dense_4h_to_h\.", r"transformer.layers.\1.mlp.fc2."),
            (r"^transformer\.layers\.(\d+)\.self_attention\.query_key_value\.", r"transformer.layers.\1.mixer.Wqkv."),
            (r"^transformer\.layers\.(\d+)\.self_attention\.dense\.", r"transformer.layers.\1.mixer.out_proj."),
        ],
    )
    key = "transformer.embeddings.word_embeddings.weight"
    sd[key] = _pad_vocab(sd.pop(key), config)
    _lm_head_from(sd, config, "lm_head.weight")
    if "lm_head.bias" in sd:
        sd["lm_head.bias"] = _pad_vocab(sd.pop("lm_head.bias"), config)
    for i in range(n_layer):
        for suffix in ("weight", "bias"):
            name = f"transformer.layers.{i}.mixer.Wqkv.{suffix}"
            if suffix == "weight" or name in sd:
                w = sd.pop(name)
                _check_rows(w, name, n_head, n_head_kv, head_dim)
                sd[name] = _grouped_to_qkv(w, n_head, n_head_kv)
    return sd


def inv_remap_state_dict_hf_falcon(
    state_dict: Mapping[str, Tensor], config: GPT2Config
) -> OrderedDict[str, Tensor]:
    """flash_attn GPT keys -> Hugging Face ``FalconForCausalLM`` keys (inverse of ``remap_state_dict_hf_falcon``).

    The norms are named as transformers names them for the config: ``ln_attn`` / ``ln_mlp`` for a
    parallel block with two norms, ``input_layernorm`` (and ``post_attention_layernorm`` for a
    sequential block) otherwise. The vocabulary padding is trimmed to ``config.vocab_size``.
    """
    n_layer = _n_layer(config)
    n_head, n_head_kv, head_dim = _heads(config)
    two_parallel_norms = bool(getattr(config, "parallel_block", False)) and not getattr(
        config, "parallel_block_tied_norm", False
    )
    norm1, norm2 = ("ln_attn", "ln_mlp") if two_parallel_norms else ("input_layernorm", "post_attention_layernorm")
    sd = _rename(
        state_dict,
        [
            (r"^transformer\.embeddings\.word_embeddings\.", "transformer.word_embeddings."),
            (r"^transformer\.layers\.(\d+)\.norm1\.", rf"transformer.h.\1.{norm1}."),
            (r"^transformer\.layers\.(\d+)\.norm2\.", rf"transformer.h.\1.{norm2}."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc1\.", r"transformer.h.\1.mlp.dense_h_to_4h."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc2\.", r"transformer.h.\1.mlp.dense_4h_to_h."),
            (r"^transformer\.layers\.(\d+)\.mixer\.Wqkv\.", r"transformer.h.\1.self_attention.query_key_value."),
            (r"^transformer\.layers\.(\d+)\.mixer\.out_proj\.", r"transformer.h.\1.self_attention.dense."),
        ],
    )
    emb_key = "transformer.word_embeddings.weight"
    sd[emb_key] = _unpad_vocab(sd.pop(emb_key), config)
    _lm_head_to(sd, config, emb_key, "lm_head.weight")
    if "lm_head.bias" in sd:
        sd["lm_head.bias"] = _unpad_vocab(sd.pop("lm_head.bias"), config)
    for i in range(n_layer):
        for suffix in ("weight", "bias"):
            name = f"transformer.h.{i}.self_attention.query_key_value.{suffix}"
            if suffix == "weight" or name in sd:
                w = sd.pop(name)
                _check_rows(w, name, n_head, n_head_kv, head_dim)
                sd[name] = _qkv_to_grouped(w, n_head, n_head_kv)
    return sd


def _falcon_kv_heads(falcon_config: Any, n_head: int) -> int:
    if getattr(falcon_config, "new_decoder_architecture", False):
        return int(_cfg(falcon_config, "num_kv_heads", "n_head_kv", default=n_head))
    # RefinedWeb-era configs spelled it n_head_kv
    legacy = getattr(falcon_config, "n_head_kv", None)
    if legacy is not None:
        return int(legacy)
    return 1 if getattr(falcon_config, "multi_query", False) else n_head


def falcon_config_to_gpt2_config(falcon_config: FalconConfig) -> GPT2Config:
    """The ``GPT2Config`` (with flash_attn's extras) of a Falcon model.

    Parallel attention + MLP (``parallel_attn`` or ``new_decoder_architecture``) with one shared
    LayerNorm, or two for the new architecture with ``num_ln_in_parallel_attn`` 2 (its default);
    sequential pre-norm blocks otherwise. Non-interleaved rotary on the whole head, multi-query or
    grouped key/value heads through ``n_head_kv``, GELU MLP of width ``ffn_hidden_size``.

    Raises ValueError for ``alibi=True`` (Falcon's ALiBi variant is not modelled).
    """
    if getattr(falcon_config, "alibi", False):
        raise ValueError("falcon_config.alibi=True is not supported: flash_attn's GPT model runs Falcon with rotary")
    n_head = _cfg(falcon_config, "num_attention_heads", "n_head")
    hidden = falcon_config.hidden_size
    new_arch = bool(getattr(falcon_config, "new_decoder_architecture", False))
    parallel = new_arch or bool(getattr(falcon_config, "parallel_attn", True))
    num_ln = getattr(falcon_config, "num_ln_in_parallel_attn", None)
    tied_norm = not (new_arch and num_ln in (None, 2))
    _warn_rope_scaling(falcon_config, "Falcon")
    bias = bool(getattr(falcon_config, "bias", False))
    activation = getattr(falcon_config, "activation", "gelu") or "gelu"
    return _gpt2_config(
        vocab_size=falcon_config.vocab_size,
        n_positions=0,
        n_embd=hidden,
        n_layer=_cfg(falcon_config, "num_hidden_layers", "n_layer"),
        n_head=n_head,
        n_inner=_cfg(falcon_config, "ffn_hidden_size", default=4 * hidden),
        activation_function=activation,
        resid_pdrop=falcon_config.hidden_dropout,
        embd_pdrop=0.0,
        attn_pdrop=falcon_config.attention_dropout,
        layer_norm_epsilon=falcon_config.layer_norm_epsilon,
        initializer_range=falcon_config.initializer_range,
        bos_token_id=falcon_config.bos_token_id,
        eos_token_id=falcon_config.eos_token_id,
        parallel_block=parallel,
        n_head_kv=_falcon_kv_heads(falcon_config, n_head),
        parallel_block_tied_norm=tied_norm,
        rotary_emb_fraction=1.0,
        rotary_emb_interleaved=False,
        rotary_emb_base=_rope_theta(falcon_config),
        tie_word_embeddings=bool(getattr(falcon_config, "tie_word_embeddings", True)),
        qkv_proj_bias=bias,
        out_proj_bias=bias,
        mlp_fc1_bias=bias,
        mlp_fc2_bias=bias,
        lm_head_bias=False,
    )
