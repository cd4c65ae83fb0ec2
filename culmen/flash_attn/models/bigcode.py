"""BigCode (StarCoder, SantaCoder: ``GPTBigCode``) checkpoints on flash_attn's GPT model.

As in flash_attn, a multi-query checkpoint's single key/value head is repeated for every query head
(the GPT config has no ``n_head_kv``), and the inverse keeps the first copy.

Differences from flash_attn 2.8, each a fix: multi-head checkpoints (``multi_query=False``, whose
fused rows are per-head ``(q, k, v)`` groups) convert too, where flash_attn asserted; the layout is
read from the fused weight's shape when the config does not say; the inverse trims the vocabulary
*rows* (flash_attn sliced the hidden dimension) and writes an untied head when the config is untied.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

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
    from transformers import GPT2Config, GPTBigCodeConfig

__all__ = ["remap_state_dict_hf_bigcode", "inv_remap_state_dict_hf_bigcode", "bigcode_config_to_gpt2_config"]


def _is_multi_query(config: Any, rows: int, n_head: int, head_dim: int) -> bool:
    flag = getattr(config, "multi_query", None)
    if flag is not None:
        return bool(flag)
    return rows == (n_head + 2) * head_dim


def remap_state_dict_hf_bigcode(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """Hugging Face ``GPTBigCodeForCausalLM`` state dict -> flash_attn GPT keys.

    Args:
        state_dict: ``transformer.wte/wpe.weight``, ``transformer.h.{i}.attn.c_attn.*`` ... (``nn.Linear``
            layout, ``(out, in)``).
        config: the GPT2Config of ``bigcode_config_to_gpt2_config`` (``multi_query`` is read; without it
            the layout follows from the shape of ``c_attn``).

    Returns:
        A new dict with ``Wqkv`` of ``3 * n_embd`` rows ``[q; k; v]``: multi-query key and value rows
        tiled ``n_head`` times, multi-head per-head groups reordered.
    """
    n_layer = _n_layer(config)
    n_head, _, head_dim = _heads(config)
    embed = n_head * head_dim
    sd = _rename(
        state_dict,
        [
            (r"^transformer\.wte\.", "transformer.embeddings.word_embeddings."),
            (r"^transformer\.wpe\.", "transformer.embeddings.position_embeddings."),
            (r"^transformer\.h\.(\d+)\.ln_(1|2)\.", r"transformer.layers.\1.norm\2."),
            (r"^transformer\.h\.(\d+)\.mlp\.c_fc\.", r"transformer.layers.\1.mlp.fc1."),
            (r"^transformer\.h\.(\d+)\.mlp\.c_proj\.", r"transformer.layers.\1.mlp.fc2."),
            (r"^transformer\.h\.(\d+)\.attn\.c_attn\.", r"transformer.layers.\1.mixer.Wqkv."),
            (r"^transformer\.h\.(\d+)\.attn\.c_proj\.", r"transformer.layers.\1.mixer.out_proj."),
        ],
    )
    key = "transformer.embeddings.word_embeddings.weight"
    sd[key] = _pad_vocab(sd.pop(key), config)
    _lm_head_from(sd, config, "lm_head.weight")
    for i in range(n_layer):
        for suffix in ("weight", "bias"):
            name = f"transformer.layers.{i}.mixer.Wqkv.{suffix}"
            if suffix == "bias" and name not in sd:
                continue
            w = sd.pop(name)
            rest = w.shape[1:]
            if _is_multi_query(config, w.shape[0], n_head, head_dim):
                if w.shape[0] != embed + 2 * head_dim:
                    raise ValueError(f"state_dict: {name} has {w.shape[0]} rows, expected {embed + 2 * head_dim}")
                q, k, v = torch.split(w, [embed, head_dim, head_dim], dim=0)
                reps = (n_head,) + (1,) * len(rest)
                sd[name] = torch.cat([q, k.repeat(reps), v.repeat(reps)], dim=0)
            else:
                if w.shape[0] != 3 * embed:
                    raise ValueError(f"state_dict: {name} has {w.shape[0]} rows, expected {3 * embed}")
                sd[name] = w.reshape(n_head, 3, head_dim, *rest).transpose(0, 1).reshape(w.shape)
    return sd


def inv_remap_state_dict_hf_bigcode(
    state_dict: Mapping[str, Tensor], config: GPT2Config
) -> OrderedDict[str, Tensor]:
    """flash_attn GPT keys -> Hugging Face ``GPTBigCodeForCausalLM`` keys (inverse of
    ``remap_state_dict_hf_bigcode``; multi-query keeps the first head's key/value rows; the
    vocabulary padding is trimmed to ``config.vocab_size``)."""
    n_layer = _n_layer(config)
    n_head, _, head_dim = _heads(config)
    embed = n_head * head_dim
    multi_query = bool(getattr(config, "multi_query", True))
    sd = _rename(
        state_dict,
        [
            (r"^transformer\.embeddings\.word_embeddings\.", "transformer.wte."),
            (r"^transformer\.embeddings\.position_embeddings\.", "transformer.wpe."),
            (r"^transformer\.layers\.(\d+)\.norm(1|2)\.", r"transformer.h.\1.ln_\2."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc1\.", r"transformer.h.\1.mlp.c_fc."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc2\.", r"transformer.h.\1.mlp.c_proj."),
            (r"^transformer\.layers\.(\d+)\.mixer\.Wqkv\.", r"transformer.h.\1.attn.c_attn."),
            (r"^transformer\.layers\.(\d+)\.mixer\.out_proj\.", r"transformer.h.\1.attn.c_proj."),
        ],
    )
    sd["transformer.wte.weight"] = _unpad_vocab(sd.pop("transformer.wte.weight"), config)
    _lm_head_to(sd, config, "transformer.wte.weight", "lm_head.weight")
    for i in range(n_layer):
        for suffix in ("weight", "bias"):
            name = f"transformer.h.{i}.attn.c_attn.{suffix}"
            if suffix == "bias" and name not in sd:
                continue
            w = sd.pop(name)
            if w.shape[0] != 3 * embed:
                raise ValueError(f"state_dict: Wqkv.{suffix} of layer {i} has {w.shape[0]} rows, expected {3 * embed}")
            rest = w.shape[1:]
            if multi_query:
                q, k, v = torch.split(w, [embed, embed, embed], dim=0)
                sd[name] = torch.cat([q, k[:head_dim], v[:head_dim]], dim=0)
            else:
                sd[name] = w.reshape(3, n_head, head_dim, *rest).transpose(0, 1).reshape(w.shape)
    return sd


def bigcode_config_to_gpt2_config(bigcode_config: GPTBigCodeConfig) -> GPT2Config:
    """The ``GPT2Config`` (with flash_attn's extras) of a GPTBigCode model: GPT-2 blocks (learned
    positions, pre-norm LayerNorm, biases everywhere) whose key/value heads the remap expands to
    ``n_head``; ``multi_query`` is carried for the remaps."""
    return _gpt2_config(
        vocab_size=bigcode_config.vocab_size,
        n_positions=bigcode_config.n_positions,
        n_embd=bigcode_config.n_embd,
        n_layer=bigcode_config.n_layer,
        n_head=bigcode_config.n_head,
        n_inner=bigcode_config.n_inner,
        activation_function=bigcode_config.activation_function,
        resid_pdrop=bigcode_config.resid_pdrop,
        embd_pdrop=bigcode_config.embd_pdrop,
        attn_pdrop=bigcode_config.attn_pdrop,
        layer_norm_epsilon=bigcode_config.layer_norm_epsilon,
        initializer_range=bigcode_config.initializer_range,
        bos_token_id=bigcode_config.bos_token_id,
        eos_token_id=bigcode_config.eos_token_id,
        scale_attn_weights=bigcode_config.scale_attn_weights,
        multi_query=bool(bigcode_config.multi_query),
        tie_word_embeddings=bool(getattr(bigcode_config, "tie_word_embeddings", True)),
        use_cache=bigcode_config.use_cache,
    )
