"""Cerebras BTLM checkpoints (remote-code ``BTLMLMHeadModel``) on flash_attn's GPT model.

BTLM is GPT-2 shaped (``Conv1D`` weights stored ``(in, out)``), with a SwiGLU MLP (``c_fc`` the value
branch, ``c_fc2`` the gate), ALiBi or learned positions and muP multipliers. The remap transposes the
``Conv1D`` weights into ``nn.Linear`` layout and drops the ALiBi slopes (the GPT model computes them);
``inv_remap_state_dict_hf_btlm`` (culmen's addition) restores both, the slopes as standard ALiBi
slopes of shape ``(n_head, 1)``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from culmen.flash_attn.models.llama import _cfg, _gpt2_config, _n_layer, _pad_vocab, _rename, _unpad_vocab

if TYPE_CHECKING:
    from transformers import GPT2Config, PretrainedConfig

__all__ = ["remap_state_dict_hf_btlm", "inv_remap_state_dict_hf_btlm", "btlm_config_to_gpt2_config"]


def _alibi_slopes(n_head: int) -> list[float]:
    """ALiBi's geometric head slopes (Press et al.): for a power of two ``n``, ``2^(-8 i / n)``,
    otherwise those of the nearest lower power of two followed by every other slope of twice that."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_head).is_integer():
        return power_of_two(n_head)
    base = 2 ** math.floor(math.log2(n_head))
    return power_of_two(base) + power_of_two(2 * base)[0::2][: n_head - base]


def remap_state_dict_hf_btlm(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """BTLM state dict (``transformer.wte``, ``transformer.h.{i}.attn.c_attn`` ... in ``Conv1D`` layout)
    -> flash_attn GPT keys.

    Args:
        state_dict: the Hugging Face BTLM checkpoint.
        config: the GPT2Config of ``btlm_config_to_gpt2_config`` (``n_layer``, ``pad_vocab_size_multiple``).

    Returns:
        A new dict: weights transposed to ``(out, in)``; ``mlp.fc1 = [c_fc; c_fc2]`` (value rows, then
        gate rows) with the matching bias; the head tied to the padded word embeddings;
        ``transformer.relative_pe.slopes`` dropped.
    """
    n_layer = _n_layer(config)
    sd = _rename(
        state_dict,
        [
            (r"^transformer\.wpe\.", "transformer.embeddings.position_embeddings."),
            (r"^transformer\.wte\.", "transformer.embeddings.word_embeddings."),
            (r"^transformer\.h\.(\d+)\.ln_(1|2)\.", r"transformer.layers.\1.norm\2."),
            (r"^transformer\.h\.(\d+)\.mlp\.c_proj\.", r"transformer.layers.\1.mlp.fc2."),
            (r"^transformer\.h\.(\d+)\.attn\.c_attn\.", r"transformer.layers.\1.mixer.Wqkv."),
            (r"^transformer\.h\.(\d+)\.attn\.c_proj\.", r"transformer.layers.\1.mixer.out_proj."),
        ],
    )
    key = "transformer.embeddings.word_embeddings.weight"
    sd[key] = _pad_vocab(sd.pop(key), config)
    sd.pop("lm_head.weight", None)
    sd["lm_head.weight"] = sd[key]
    sd.pop("transformer.relative_pe.slopes", None)
    for i in range(n_layer):
        hf, p = f"transformer.h.{i}.mlp.", f"transformer.layers.{i}."
        w1, w3 = sd.pop(hf + "c_fc.weight"), sd.pop(hf + "c_fc2.weight")
        sd[p + "mlp.fc1.weight"] = torch.cat([w1.t(), w3.t()], dim=0)
        b1, b3 = sd.pop(hf + "c_fc.bias"), sd.pop(hf + "c_fc2.bias")
        sd[p + "mlp.fc1.bias"] = torch.cat([b1, b3], dim=0)
        for name in ("mlp.fc2.weight", "mixer.Wqkv.weight", "mixer.out_proj.weight"):
            sd[p + name] = sd.pop(p + name).t()
    return sd


def inv_remap_state_dict_hf_btlm(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """flash_attn GPT keys -> BTLM keys (inverse of ``remap_state_dict_hf_btlm``): ``Conv1D`` layout,
    ``c_fc`` / ``c_fc2`` split from ``fc1``, vocabulary trimmed to ``config.vocab_size``, and, for ALiBi
    configs (``use_alibi``), ``transformer.relative_pe.slopes`` of shape ``(n_head, 1)`` in the word
    embedding's dtype. Transposed weights are views of the input's tensors."""
    n_layer = _n_layer(config)
    sd = _rename(
        state_dict,
        [
            (r"^transformer\.embeddings\.position_embeddings\.", "transformer.wpe."),
            (r"^transformer\.embeddings\.word_embeddings\.", "transformer.wte."),
            (r"^transformer\.layers\.(\d+)\.norm(1|2)\.", r"transformer.h.\1.ln_\2."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc2\.", r"transformer.h.\1.mlp.c_proj."),
            (r"^transformer\.layers\.(\d+)\.mixer\.Wqkv\.", r"transformer.h.\1.attn.c_attn."),
            (r"^transformer\.layers\.(\d+)\.mixer\.out_proj\.", r"transformer.h.\1.attn.c_proj."),
        ],
    )
    emb = _unpad_vocab(sd.pop("transformer.wte.weight"), config)
    sd["transformer.wte.weight"] = emb
    sd.pop("lm_head.weight", None)
    sd["lm_head.weight"] = emb
    for i in range(n_layer):
        hf, p = f"transformer.h.{i}.", f"transformer.layers.{i}."
        w1, w3 = torch.chunk(sd.pop(p + "mlp.fc1.weight"), 2, dim=0)
        sd[hf + "mlp.c_fc.weight"], sd[hf + "mlp.c_fc2.weight"] = w1.t(), w3.t()
        b1, b3 = torch.chunk(sd.pop(p + "mlp.fc1.bias"), 2, dim=0)
        sd[hf + "mlp.c_fc.bias"], sd[hf + "mlp.c_fc2.bias"] = b1, b3
        for name in ("mlp.c_proj.weight", "attn.c_attn.weight", "attn.c_proj.weight"):
            sd[hf + name] = sd.pop(hf + name).t()
    if getattr(config, "use_alibi", False):
        n_head = _cfg(config, "n_head", "num_attention_heads")
        sd["transformer.relative_pe.slopes"] = torch.tensor(_alibi_slopes(n_head), dtype=emb.dtype).unsqueeze(-1)
    return sd


def btlm_config_to_gpt2_config(btlm_config: PretrainedConfig) -> GPT2Config:
    """The ``GPT2Config`` (with flash_attn's extras) of a BTLM model: GPT-2 blocks with a SwiGLU MLP of
    width ``n_inner``, ALiBi (``position_embedding_type="alibi"``) or learned positions, and BTLM's
    muP multipliers (``mup_width_scale``, ``mup_embeddings_multiplier``, ``mup_output_multiplier``,
    ``mup_scale_qk_dot_by_d``)."""
    alibi = getattr(btlm_config, "position_embedding_type", "learned") == "alibi"
    return _gpt2_config(
        vocab_size=btlm_config.vocab_size,
        n_positions=0 if alibi else btlm_config.n_positions,
        n_embd=_cfg(btlm_config, "hidden_size", "n_embd"),
        n_layer=_cfg(btlm_config, "num_hidden_layers", "n_layer"),
        n_head=_cfg(btlm_config, "num_attention_heads", "n_head"),
        n_inner=btlm_config.n_inner,
        activation_function=btlm_config.activation_function,
        resid_pdrop=btlm_config.resid_pdrop,
        embd_pdrop=btlm_config.embd_pdrop,
        attn_pdrop=btlm_config.attn_pdrop,
        layer_norm_epsilon=btlm_config.layer_norm_epsilon,
        initializer_range=btlm_config.initializer_range,
        bos_token_id=btlm_config.bos_token_id,
        eos_token_id=btlm_config.eos_token_id,
        use_alibi=alibi,
        use_flash_attn=alibi,  # flash_attn's ALiBi path lives in the flash attention kernel
        mup_width_scale=btlm_config.mup_width_scale,
        mup_embeddings_multiplier=btlm_config.mup_embeddings_scale,
        mup_output_multiplier=btlm_config.mup_output_alpha,
        mup_scale_qk_dot_by_d=btlm_config.mup_scale_qk_dot_by_d,
        mlp_multiple_of=1,
    )
