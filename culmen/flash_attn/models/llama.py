"""LLaMA checkpoints (Meta's ``consolidated.*.pth`` and Hugging Face's) on flash_attn's GPT model.

flash_attn runs LLaMA as a ``GPTLMHeadModel`` configured through ``GPT2Config`` extras (RMSNorm,
SwiGLU, rotary, no biases). This module converts configs and state dicts between the Meta / Hugging
Face key layouts and the GPT one (``transformer.layers.{i}.mixer.Wqkv`` ...), both ways for Hugging
Face. The small helpers at the top are shared with the other model families of this package.

Differences from flash_attn 2.8, each a fix:

- ``llama_config_to_gpt2_config`` reads the rotary base from the Hugging Face config (``rope_theta``
  / ``rope_parameters``; flash_attn kept 10000 unless the config had ``rotary_emb_base``), keeps the
  config's ``tie_word_embeddings`` (flash_attn forced ``False``, which breaks tied checkpoints such as
  Llama 3.2 1B), carries ``attention_bias`` / ``mlp_bias``, sets ``mlp_multiple_of=1`` (the Hugging
  Face ``intermediate_size`` is exact; flash_attn's default rounds it up to a multiple of 128) and
  warns about RoPE scaling, which the GPT model does not implement.
- ``remap_state_dict_hf_llama`` un-permutes the key projection with the number of key/value heads, so
  grouped-query checkpoints convert; ``inv_remap_state_dict_hf_llama`` trims the vocabulary padding
  back to ``config.vocab_size`` so the round trip is exact.
- ``config_from_meta_checkpoint`` takes ``vocab_size`` from ``params.json`` when it is given (Llama 3)
  and reads ``tokenizer.model`` only if ``sentencepiece`` is installed.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:  # transformers is an optional dependency of culmen
    from transformers import GPT2Config, LlamaConfig

__all__ = [
    "remap_state_dict_meta_llama",
    "remap_state_dict_hf_llama",
    "inv_remap_state_dict_hf_llama",
    "config_from_meta_checkpoint",
    "config_from_hf_checkpoint",
    "config_from_checkpoint",
    "state_dicts_from_checkpoint",
    "llama_config_to_gpt2_config",
]


# ----------------------------------------------------------------------------------------------
# Helpers shared by the model families of culmen.flash_attn.models
# ----------------------------------------------------------------------------------------------


def _cfg(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that ``config`` has and that is not None (GPT2Config and the families'
    own configs spell the same field differently: ``n_layer`` / ``num_hidden_layers`` ...)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _n_layer(config: Any) -> int:
    n = _cfg(config, "n_layer", "num_hidden_layers")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"config: n_layer / num_hidden_layers must be a non-negative int, got {n!r}")
    return n


def _heads(config: Any) -> tuple[int, int, int]:
    """``(n_head, n_head_kv, head_dim)`` of a GPT2Config (or a family config) as flash_attn's MHA sees
    them: ``head_dim = n_embd // n_head``."""
    n_embd = _cfg(config, "n_embd", "hidden_size")
    n_head = _cfg(config, "n_head", "num_attention_heads")
    n_head_kv = _cfg(config, "n_head_kv", default=n_head)
    if not n_head or n_embd % n_head != 0:
        raise ValueError(f"config: n_embd ({n_embd!r}) must be a multiple of n_head ({n_head!r})")
    if not n_head_kv or n_head % n_head_kv != 0:
        raise ValueError(f"config: n_head ({n_head!r}) must be a multiple of n_head_kv ({n_head_kv!r})")
    return n_head, n_head_kv, n_embd // n_head


def _rename(state_dict: Mapping[str, Tensor], rules: Iterable[tuple[str, str]]) -> OrderedDict[str, Tensor]:
    """A new dict whose keys went through every ``re.sub(pattern, repl, key)`` of ``rules`` in turn;
    the tensors are the same objects."""
    compiled = [(re.compile(p), r) for p, r in rules]
    out: OrderedDict[str, Tensor] = OrderedDict()
    for key, value in state_dict.items():
        for pattern, repl in compiled:
            key = pattern.sub(repl, key)
        out[key] = value
    return out


def _pad_vocab(weight: Tensor, config: Any) -> Tensor:
    """``weight`` (rows = vocabulary, 1-D or 2-D) zero-padded to a multiple of the config's
    ``pad_vocab_size_multiple`` rows, as flash_attn's GPT embedding allocates it."""
    multiple = getattr(config, "pad_vocab_size_multiple", 1) or 1
    rows = math.ceil(weight.shape[0] / multiple) * multiple
    if rows == weight.shape[0]:
        return weight
    pad = (0, 0) * (weight.dim() - 1) + (0, rows - weight.shape[0])
    return F.pad(weight, pad)


def _unpad_vocab(weight: Tensor, config: Any) -> Tensor:
    """Undo ``_pad_vocab``: the first ``config.vocab_size`` rows."""
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and weight.shape[0] > vocab:
        return weight[:vocab]
    return weight


def _rope_theta(hf_config: Any, default: float = 10000.0) -> float:
    """The rotary base of a Hugging Face config, whichever transformers version wrote it."""
    explicit = getattr(hf_config, "rotary_emb_base", None)
    if explicit is not None:
        return float(explicit)
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, Mapping) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = getattr(hf_config, "rope_theta", None)
    return float(theta) if theta is not None else default


def _rope_type(hf_config: Any) -> str:
    """``"default"`` unless the Hugging Face config asks for a scaled RoPE (linear, dynamic, llama3 ...)."""
    for source in (getattr(hf_config, "rope_parameters", None), getattr(hf_config, "rope_scaling", None)):
        if isinstance(source, Mapping):
            kind = source.get("rope_type", source.get("type"))
            if kind not in (None, "default"):
                return str(kind)
    return "default"


def _warn_rope_scaling(hf_config: Any, family: str) -> None:
    kind = _rope_type(hf_config)
    if kind != "default":
        warnings.warn(
            f"{family} config asks for RoPE scaling {kind!r}; flash_attn's GPT model applies plain RoPE, "
            "so long-context outputs differ from the Hugging Face model",
            UserWarning,
            stacklevel=3,
        )


def _gpt2_config(**kwargs: Any) -> GPT2Config:
    try:
        from transformers import GPT2Config
    except ImportError as exc:  # pragma: no cover - transformers is installed wherever configs are converted
        raise ImportError("converting a model config needs the `transformers` package") from exc
    return GPT2Config(**kwargs)


# ----------------------------------------------------------------------------------------------
# Rotary layouts. Meta's checkpoints (and flash_attn with rotary_emb_interleaved=True) rotate
# adjacent pairs (x0, x1), (x2, x3) ... of each head; Hugging Face's conversion script permuted the
# rows of wq / wk so that its rotate_half pairs (x_j, x_{j+d/2}) hit the same numbers.
# ----------------------------------------------------------------------------------------------


def _halves_to_pairs(w: Tensor, n_heads: int) -> Tensor:
    """Hugging Face row order -> Meta (interleaved) row order, per head; ``w`` is ``(n_heads*d, ...)``."""
    d = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, d // 2, *rest).transpose(1, 2).reshape(n_heads * d, *rest)


def _pairs_to_halves(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of ``_halves_to_pairs``."""
    d = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, d // 2, 2, *rest).transpose(1, 2).reshape(n_heads * d, *rest)


def _lm_head_from(state_dict: OrderedDict[str, Tensor], config: Any, source_key: str) -> None:
    """Set ``lm_head.weight`` (vocab-padded) from ``source_key`` or, tied, from the word embeddings.
    A tied checkpoint may or may not store its own copy of the head; it is dropped either way."""
    emb = state_dict["transformer.embeddings.word_embeddings.weight"]
    if getattr(config, "tie_word_embeddings", True):
        state_dict.pop(source_key, None)
        state_dict["lm_head.weight"] = emb
    else:
        state_dict["lm_head.weight"] = _pad_vocab(state_dict.pop(source_key), config)


def _lm_head_to(state_dict: OrderedDict[str, Tensor], config: Any, emb_key: str, head_key: str) -> None:
    """Inverse of ``_lm_head_from``: ``head_key`` gets the unpadded head (tied: the embedding itself)."""
    head = state_dict.pop("lm_head.weight", None)
    if getattr(config, "tie_word_embeddings", True):
        state_dict[head_key] = state_dict[emb_key]
    else:
        if head is None:
            raise KeyError("lm_head.weight")
        state_dict[head_key] = _unpad_vocab(head, config)


# ----------------------------------------------------------------------------------------------
# Meta checkpoints
# ----------------------------------------------------------------------------------------------


def remap_state_dict_meta_llama(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """Meta LLaMA state dict (``tok_embeddings``, ``layers.{i}.attention.wq`` ...) -> flash_attn GPT keys.

    Args:
        state_dict: one model-parallel shard or the whole checkpoint of ``consolidated.*.pth``.
        config: the GPT2Config of ``llama_config_to_gpt2_config`` (``n_layer``, ``tie_word_embeddings``,
            ``pad_vocab_size_multiple`` are read).

    Returns:
        A new dict; ``Wqkv`` is ``cat([wq, wk, wv])`` (Meta's rows are already in the interleaved rotary
        order), ``mlp.fc1`` is ``cat([w3, w1])`` (value rows, then gate rows, as flash_attn's GatedMlp
        splits them). The embedding and head are zero-padded to ``pad_vocab_size_multiple`` rows;
        rotary frequency buffers are dropped. Keys it does not know pass through unchanged.
    """
    n_layer = _n_layer(config)
    sd = _rename(
        state_dict,
        [
            (r"^(?!output\.)", "transformer."),
            (r"^transformer\.tok_embeddings\.", "transformer.embeddings.word_embeddings."),
            (r"^transformer\.norm\.", "transformer.ln_f."),
            (r"^transformer\.layers\.(\d+)\.attention_norm\.", r"transformer.layers.\1.norm1."),
            (r"^transformer\.layers\.(\d+)\.ffn_norm\.", r"transformer.layers.\1.norm2."),
            (r"^transformer\.layers\.(\d+)\.feed_forward\.w2\.", r"transformer.layers.\1.mlp.fc2."),
            (r"^transformer\.layers\.(\d+)\.attention\.wo\.", r"transformer.layers.\1.mixer.out_proj."),
        ],
    )
    key = "transformer.embeddings.word_embeddings.weight"
    sd[key] = _pad_vocab(sd.pop(key), config)
    _lm_head_from(sd, config, "output.weight")

    for i in range(n_layer):
        p = f"transformer.layers.{i}."
        w1 = sd.pop(p + "feed_forward.w1.weight")
        w3 = sd.pop(p + "feed_forward.w3.weight")
        sd[p + "mlp.fc1.weight"] = torch.cat([w3, w1], dim=0)
        wq, wk, wv = (sd.pop(p + f"attention.w{x}.weight") for x in "qkv")
        sd[p + "mixer.Wqkv.weight"] = torch.cat([wq, wk, wv], dim=0)
        sd.pop(p + "attention.inner_attention.rope.freqs", None)
    sd.pop("transformer.rope.freqs", None)
    return sd


# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoints
# ----------------------------------------------------------------------------------------------


def remap_state_dict_hf_llama(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """Hugging Face ``LlamaForCausalLM`` state dict -> flash_attn GPT keys.

    Args:
        state_dict: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight`` ...
            (``lm_head.weight`` may be absent when the embeddings are tied).
        config: the GPT2Config of ``llama_config_to_gpt2_config``; ``n_head``, ``n_head_kv``,
            ``n_embd``, ``n_layer``, ``tie_word_embeddings`` and ``pad_vocab_size_multiple`` are read.

    Returns:
        A new dict. The rows of ``q_proj`` / ``k_proj`` (and their biases) are put back into Meta's
        interleaved rotary order (``rotary_emb_interleaved=True``), per query head and per key/value
        head respectively; ``Wqkv = cat([q, k, v])`` of ``(n_head + 2 * n_head_kv) * head_dim`` rows;
        ``mlp.fc1 = cat([up_proj, gate_proj])``. ``rotary_emb.inv_freq`` buffers are dropped.
    """
    n_layer = _n_layer(config)
    n_head, n_head_kv, _ = _heads(config)
    sd = _rename(
        state_dict,
        [
            (r"^model\.embed_tokens\.", "transformer.embeddings.word_embeddings."),
            (r"^model\.norm\.", "transformer.ln_f."),
            (r"^model\.layers\.(\d+)\.input_layernorm\.", r"transformer.layers.\1.norm1."),
            (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"transformer.layers.\1.norm2."),
            (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"transformer.layers.\1.mlp.fc2."),
            (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"transformer.layers.\1.mixer.out_proj."),
        ],
    )
    key = "transformer.embeddings.word_embeddings.weight"
    sd[key] = _pad_vocab(sd.pop(key), config)
    _lm_head_from(sd, config, "lm_head.weight")

    for i in range(n_layer):
        hf, p = f"model.layers.{i}.", f"transformer.layers.{i}."
        # weights always, biases where the config has them (attention_bias / mlp_bias)
        for suffix in ("weight", "bias"):
            if suffix == "weight" or hf + "mlp.gate_proj.bias" in sd:
                gate = sd.pop(hf + f"mlp.gate_proj.{suffix}")
                up = sd.pop(hf + f"mlp.up_proj.{suffix}")
                sd[p + f"mlp.fc1.{suffix}"] = torch.cat([up, gate], dim=0)
            if suffix == "weight" or hf + "self_attn.q_proj.bias" in sd:
                q = _halves_to_pairs(sd.pop(hf + f"self_attn.q_proj.{suffix}"), n_head)
                k = _halves_to_pairs(sd.pop(hf + f"self_attn.k_proj.{suffix}"), n_head_kv)
                v = sd.pop(hf + f"self_attn.v_proj.{suffix}")
                sd[p + f"mixer.Wqkv.{suffix}"] = torch.cat([q, k, v], dim=0)
        sd.pop(hf + "self_attn.rotary_emb.inv_freq", None)
    return sd


def inv_remap_state_dict_hf_llama(state_dict: Mapping[str, Tensor], config: GPT2Config) -> OrderedDict[str, Tensor]:
    """flash_attn GPT keys -> Hugging Face ``LlamaForCausalLM`` keys (inverse of ``remap_state_dict_hf_llama``).

    Args:
        state_dict: a ``GPTLMHeadModel`` state dict of a LLaMA config.
        config: its GPT2Config (``n_head``, ``n_head_kv``, ``n_embd``, ``n_layer``, ``vocab_size``,
            ``tie_word_embeddings``).

    Returns:
        A new dict whose embedding and head keep the first ``config.vocab_size`` rows (the padding
        rows are dropped), so ``inv_remap(remap(sd)) == sd`` exactly. Tied configs get
        ``lm_head.weight`` as the same tensor as ``model.embed_tokens.weight``. Tensors may be views of
        the input's (``Wqkv`` is split, not copied).
    """
    n_layer = _n_layer(config)
    n_head, n_head_kv, head_dim = _heads(config)
    q_rows, kv_rows = n_head * head_dim, n_head_kv * head_dim
    sd = _rename(
        state_dict,
        [
            (r"^transformer\.embeddings\.word_embeddings\.", "model.embed_tokens."),
            (r"^transformer\.ln_f\.", "model.norm."),
            (r"^transformer\.layers\.(\d+)\.norm1\.", r"model.layers.\1.input_layernorm."),
            (r"^transformer\.layers\.(\d+)\.norm2\.", r"model.layers.\1.post_attention_layernorm."),
            (r"^transformer\.layers\.(\d+)\.mlp\.fc2\.", r"model.layers.\1.mlp.down_proj."),
            (r"^transformer\.layers\.(\d+)\.mixer\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
        ],
    )
    sd["model.embed_tokens.weight"] = _unpad_vocab(sd.pop("model.embed_tokens.weight"), config)
    _lm_head_to(sd, config, "model.embed_tokens.weight", "lm_head.weight")

    for i in range(n_layer):
        hf, p = f"model.layers.{i}.", f"transformer.layers.{i}."
        for suffix in ("weight", "bias"):
            if suffix == "weight" or p + "mlp.fc1.bias" in sd:
                up, gate = torch.chunk(sd.pop(p + f"mlp.fc1.{suffix}"), 2, dim=0)
                sd[hf + f"mlp.gate_proj.{suffix}"] = gate
                sd[hf + f"mlp.up_proj.{suffix}"] = up
            if suffix == "weight" or p + "mixer.Wqkv.bias" in sd:
                wqkv = sd.pop(p + f"mixer.Wqkv.{suffix}")
                if wqkv.shape[0] != q_rows + 2 * kv_rows:
                    raise ValueError(
                        f"state_dict: {p}mixer.Wqkv.{suffix} has {wqkv.shape[0]} rows, expected "
                        f"{q_rows + 2 * kv_rows} for n_head={n_head}, n_head_kv={n_head_kv}"
                    )
                q, k, v = torch.split(wqkv, [q_rows, kv_rows, kv_rows], dim=0)
                sd[hf + f"self_attn.q_proj.{suffix}"] = _pairs_to_halves(q, n_head)
                sd[hf + f"self_attn.k_proj.{suffix}"] = _pairs_to_halves(k, n_head_kv)
                sd[hf + f"self_attn.v_proj.{suffix}"] = v
    return sd


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------


def _meta_vocab_size(params: Mapping[str, Any], folder: Path) -> int:
    vocab = params.get("vocab_size")
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    tokenizer = folder / "tokenizer.model"
    if tokenizer.is_file():
        try:
            from sentencepiece import SentencePieceProcessor
        except ImportError:
            warnings.warn(
                f"{tokenizer} gives the vocabulary size but sentencepiece is not installed; assuming 32000",
                UserWarning,
                stacklevel=3,
            )
        else:
            return int(SentencePieceProcessor(model_file=str(tokenizer)).vocab_size())
    return 32000  # LLaMA 1/2; some Code Llama checkpoints have 32016 and say so only in tokenizer.model


def config_from_meta_checkpoint(checkpoint_path: str | os.PathLike, model_name: str) -> LlamaConfig:
    """A ``LlamaConfig`` from Meta's ``<checkpoint_path>/<model_name>/params.json``.

    The MLP width follows Meta's rule: ``int(2 * 4 * dim / 3)``, times ``ffn_dim_multiplier`` when
    given, rounded up to ``multiple_of``. ``rope_theta`` becomes ``config.rotary_emb_base``.
    """
    from transformers import LlamaConfig

    folder = Path(checkpoint_path) / model_name
    with open(folder / "params.json") as f:
        params = json.load(f)
    dim = int(params["dim"])
    hidden = int(2 * (4 * dim) / 3)
    if params.get("ffn_dim_multiplier") is not None:
        hidden = int(params["ffn_dim_multiplier"] * hidden)
    multiple_of = int(params.get("multiple_of", 1))
    hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
    config = LlamaConfig(
        hidden_size=dim,
        intermediate_size=hidden,
        num_attention_heads=params["n_heads"],
        num_hidden_layers=params["n_layers"],
        rms_norm_eps=params["norm_eps"],
        num_key_value_heads=params.get("n_kv_heads") or params["n_heads"],
        vocab_size=_meta_vocab_size(params, folder),
    )
    if "rope_theta" in params:
        config.rotary_emb_base = float(params["rope_theta"])
    return config


def config_from_hf_checkpoint(checkpoint_path: str | os.PathLike, model_name: str) -> LlamaConfig:
    """``LlamaConfig`` of ``<checkpoint_path>/<model_name>-hf/config.json`` (Meta's folder naming)."""
    from transformers import LlamaConfig

    return LlamaConfig.from_pretrained(Path(checkpoint_path) / f"{model_name}-hf" / "config.json")


def config_from_checkpoint(
    checkpoint_path: str | os.PathLike, model_name: str, checkpoint_format: str = "meta"
) -> LlamaConfig:
    """``config_from_meta_checkpoint`` for ``checkpoint_format="meta"``, ``config_from_hf_checkpoint`` otherwise."""
    if checkpoint_format == "meta":
        return config_from_meta_checkpoint(checkpoint_path, model_name)
    return config_from_hf_checkpoint(checkpoint_path, model_name)


def state_dicts_from_checkpoint(checkpoint_path: str | os.PathLike, model_name: str) -> list[dict[str, Tensor]]:
    """The model-parallel shards ``consolidated.{k}.pth`` of a Meta checkpoint, loaded on the CPU in
    shard order (``k`` compared as a number, so shard 10 follows shard 9). Combine them with
    ``culmen.flash_attn.models.gpt.combine_state_dicts_tp`` after remapping each one."""
    folder = Path(checkpoint_path) / model_name
    paths = list(folder.glob("consolidated.*.pth"))

    def shard_index(path: Path) -> tuple[int, str]:
        middle = path.name[len("consolidated.") : -len(".pth")]
        return (int(middle), path.name) if middle.isdigit() else (1 << 62, path.name)

    return [torch.load(path, map_location="cpu", weights_only=True) for path in sorted(paths, key=shard_index)]


def llama_config_to_gpt2_config(llama_config: LlamaConfig) -> GPT2Config:
    """The ``GPT2Config`` (with flash_attn's extras) that builds a LLaMA as ``GPTLMHeadModel``.

    RMSNorm, SwiGLU of width ``intermediate_size``, interleaved rotary on the whole head (the remap
    puts Hugging Face's rows back into that order), grouped-query attention through ``n_head_kv``,
    no dropout. Raises ValueError when ``head_dim`` differs from ``hidden_size // num_attention_heads``
    (flash_attn's MHA derives the head size from the width).
    """
    hidden = llama_config.hidden_size
    n_head = llama_config.num_attention_heads
    head_dim = getattr(llama_config, "head_dim", None)
    if head_dim is not None and head_dim * n_head != hidden:
        raise ValueError(
            f"llama_config: head_dim={head_dim} with num_attention_heads={n_head} does not tile "
            f"hidden_size={hidden}; flash_attn's MHA needs head_dim == hidden_size // num_attention_heads"
        )
    _warn_rope_scaling(llama_config, "LLaMA")
    attention_bias = bool(getattr(llama_config, "attention_bias", False))
    mlp_bias = bool(getattr(llama_config, "mlp_bias", False))
    return _gpt2_config(
        vocab_size=llama_config.vocab_size,
        n_positions=0,  # rotary only, no learned positions
        n_embd=hidden,
        n_layer=llama_config.num_hidden_layers,
        n_head=n_head,
        n_inner=llama_config.intermediate_size,
        activation_function="swiglu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=llama_config.rms_norm_eps,
        initializer_range=llama_config.initializer_range,
        bos_token_id=llama_config.bos_token_id,
        eos_token_id=llama_config.eos_token_id,
        pad_token_id=llama_config.pad_token_id,
        rms_norm=True,
        rotary_emb_fraction=1.0,
        rotary_emb_interleaved=True,
        rotary_emb_base=_rope_theta(llama_config),
        tie_word_embeddings=bool(getattr(llama_config, "tie_word_embeddings", False)),
        qkv_proj_bias=attention_bias,
        out_proj_bias=attention_bias,
        mlp_fc1_bias=mlp_bias,
        mlp_fc2_bias=mlp_bias,
        mlp_multiple_of=1,
        n_head_kv=_cfg(llama_config, "num_key_value_heads", default=n_head),
    )
