"""flash_attn's ``flash_attn.models.gpt``: the GPT backbone every flash_attn decoder model maps onto.

Same names, arguments, defaults, config fields and ``state_dict`` keys as flash_attn 2.8, so flash_attn
checkpoints load unchanged. The model is configured by a ``transformers.GPT2Config`` whose standard
fields (``n_embd``, ``n_head``, ``n_layer``, ``n_inner``, ``activation_function``, ``*_pdrop``,
``layer_norm_epsilon``, ``initializer_range``, ``scale_attn_weights``,
``scale_attn_by_inverse_layer_idx``, ``n_positions``) are read with flash_attn's extras:

- attention: ``use_flash_attn``, ``fused_bias_fc``, ``n_head_kv`` (GQA/MQA), ``rotary_emb_fraction``,
  ``rotary_emb_base``, ``rotary_emb_scale_base`` (XPos), ``rotary_emb_interleaved``, ``use_alibi``,
  ``window_size``, ``qkv_proj_bias``, ``out_proj_bias``, ``attn_dwconv``, ``head_dim``;
- MLP: ``activation_function`` in gelu / gelu_new / gelu_fast / gelu_approx / gelu_pytorch_tanh / relu /
  sqrelu / glu / swiglu / geglu (the last three build a ``GatedMlp``), ``mlp_fc1_bias``,
  ``mlp_fc2_bias``, ``mlp_multiple_of``, ``fused_mlp``, ``fused_dense_sqrelu_dense``,
  ``mlp_checkpoint_lvl`` (an int, or one per layer);
- blocks: ``prenorm``, ``parallel_block``, ``parallel_block_tied_norm``, ``rms_norm``,
  ``residual_in_fp32``, ``fused_dropout_add_ln``, ``sequence_parallel``;
- embeddings / head: ``pad_vocab_size_multiple``, ``word_embed_proj_dim`` (OPT-350m),
  ``tie_word_embeddings``, ``lm_head_bias``, ``norm_head``;
- muP: ``mup_width_scale``, ``mup_embeddings_multiplier``, ``mup_output_multiplier``,
  ``mup_attn_multiplier``, ``mup_scale_qk_dot_by_d``.

Differences from flash_attn: ``fused_dense_sqrelu_dense`` builds culmen's ``FusedMLP`` with the
``sqrelu`` activation (same parameters and math as flash_attn's Triton ``FusedDenseSqreluDense``);
``remap_state_dict_hf_gpt2`` also accepts the keys of ``GPT2LMHeadModel.state_dict()`` (with the
``transformer.`` prefix) and ``inv_remap_state_dict_hf_gpt2`` maps back to Hugging Face's GPT-2;
``remap_state_dict_megatron`` also maps Megatron's learned position embeddings and drops its rotary
``inv_freq`` (a buffer culmen derives from the config); ``combine_state_dicts_tp`` combines gated-MLP
``fc1`` biases like their weights; ``load_state_dict`` does not modify the dict it is given.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections import OrderedDict, namedtuple
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from culmen.flash_attn.modules.block import Block
from culmen.flash_attn.modules.embedding import GPT2Embeddings
from culmen.flash_attn.modules.mha import MHA
from culmen.flash_attn.modules.mlp import GatedMlp, Mlp
from culmen.flash_attn.ops.activations import sqrelu_fwd
from culmen.flash_attn.ops.fused_dense import ColumnParallelLinear, FusedMLP
from culmen.flash_attn.ops.triton.layer_norm import RMSNorm, layer_norm_fn
from culmen.flash_attn.utils.distributed import all_gather, all_gather_raw, get_dim_for_local_rank, sync_shared_params
from culmen.flash_attn.utils.generation import GenerationMixin

try:  # flash_attn requires transformers; culmen only needs it to type-check the config
    from transformers import GPT2Config
except ImportError:  # pragma: no cover - transformers is installed wherever configs are built
    GPT2Config = None

__all__ = [
    "GPTLMHeadModel",
    "GPTModel",
    "GPTPreTrainedModel",
    "combine_state_dicts_tp",
    "create_block",
    "create_mixer_cls",
    "create_mlp_cls",
    "inv_remap_state_dict_hf_gpt2",
    "remap_state_dict_hf_gpt2",
    "remap_state_dict_megatron",
    "shard_state_dict_tp",
]

logger = logging.getLogger(__name__)

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])

_ACTIVATIONS = ("gelu", "gelu_new", "gelu_fast", "gelu_approx", "gelu_pytorch_tanh", "relu", "sqrelu",
                "glu", "swiglu", "geglu")
_TANH_GELUS = ("gelu_new", "gelu_fast", "gelu_approx", "gelu_pytorch_tanh")
_GATED = ("glu", "swiglu", "geglu")
_FUSED_MLP_ACTIVATIONS = (*_TANH_GELUS, "relu", "sqrelu")


def _parallel_module(module: str, name: str):
    """A tensor-parallel module class, imported only when a process group asks for one."""
    import importlib

    return getattr(importlib.import_module(f"culmen.flash_attn.modules.{module}"), name)


def _check_activation(config) -> None:
    if config.activation_function not in _ACTIVATIONS:
        raise ValueError(f"config.activation_function must be one of {list(_ACTIVATIONS)}, "
                         f"got {config.activation_function!r}")


def _padded_vocab(config) -> int:
    multiple = getattr(config, "pad_vocab_size_multiple", 1)
    return math.ceil(config.vocab_size / multiple) * multiple


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _tp_kwargs(config, process_group) -> dict:
    if process_group is None:
        return {}
    return {"process_group": process_group, "sequence_parallel": getattr(config, "sequence_parallel", True)}


def create_mixer_cls(config, layer_idx: int | None = None, process_group=None, device=None, dtype=None):
    """``partial(MHA, ...)`` (``ParallelMHA`` with a ``process_group``) for one layer, from ``config``.

    The softmax scale is ``head_dim ** -0.5`` (``** -1`` with ``mup_scale_qk_dot_by_d``; 1 without
    ``scale_attn_weights``) times ``mup_attn_multiplier``, divided by ``layer_idx + 1`` with
    ``scale_attn_by_inverse_layer_idx``. Attention is causal; rotary covers
    ``int(rotary_emb_fraction * head_dim)`` dims.
    """
    head_dim = _head_dim(config)
    power = 1.0 if getattr(config, "mup_scale_qk_dot_by_d", False) else 0.5
    softmax_scale = head_dim ** (-power) if config.scale_attn_weights else 1.0
    softmax_scale *= getattr(config, "mup_attn_multiplier", 1.0)
    if config.scale_attn_by_inverse_layer_idx:
        if layer_idx is None:
            raise ValueError("scale_attn_by_inverse_layer_idx needs layer_idx, got None")
        softmax_scale /= float(layer_idx + 1)
    dwconv = getattr(config, "attn_dwconv", False)
    fused_bias_fc = getattr(config, "fused_bias_fc", False)
    if process_group is not None:
        if dwconv:
            raise ValueError("tensor-parallel MHA does not support attn_dwconv=True")
        if not fused_bias_fc:
            raise ValueError("tensor-parallel MHA requires fused_bias_fc=True in the config")
        mha_cls = _parallel_module("mha", "ParallelMHA")
        extra = _tp_kwargs(config, process_group)
    else:
        mha_cls = MHA
        extra = {"fused_bias_fc": fused_bias_fc, "dwconv": dwconv}
    return partial(
        mha_cls,
        num_heads=config.num_attention_heads,
        num_heads_kv=getattr(config, "n_head_kv", None),
        qkv_proj_bias=getattr(config, "qkv_proj_bias", True),
        out_proj_bias=getattr(config, "out_proj_bias", True),
        dropout=config.attn_pdrop,
        softmax_scale=softmax_scale,
        causal=True,
        layer_idx=layer_idx,
        rotary_emb_dim=int(getattr(config, "rotary_emb_fraction", 0.0) * head_dim),
        rotary_emb_base=getattr(config, "rotary_emb_base", 10000.0),
        rotary_emb_scale_base=getattr(config, "rotary_emb_scale_base", None),
        rotary_emb_interleaved=getattr(config, "rotary_emb_interleaved", False),
        use_alibi=getattr(config, "use_alibi", False),
        window_size=getattr(config, "window_size", (-1, -1)),
        use_flash_attn=getattr(config, "use_flash_attn", False),
        **extra,
        device=device,
        dtype=dtype,
    )


def create_mlp_cls(config, layer_idx: int | None = None, process_group=None, device=None, dtype=None):
    """``partial`` of the layer's MLP class from ``config``: ``GatedMlp`` for glu / swiglu / geglu
    (sigmoid / silu / gelu gate), ``FusedMLP`` with ``fused_mlp`` or ``fused_dense_sqrelu_dense``,
    else ``Mlp`` (parallel variants with a ``process_group``); ``n_inner`` is the hidden size.
    """
    act = config.activation_function
    factory = {"device": device, "dtype": dtype}
    bias = {"bias1": getattr(config, "mlp_fc1_bias", True), "bias2": getattr(config, "mlp_fc2_bias", True)}
    fused_mlp = getattr(config, "fused_mlp", False)
    sqrelu_dense = getattr(config, "fused_dense_sqrelu_dense", False)
    if fused_mlp and sqrelu_dense:
        raise ValueError("fused_mlp and fused_dense_sqrelu_dense cannot both be set")
    if fused_mlp and act not in _FUSED_MLP_ACTIVATIONS:
        raise ValueError(f"fused_mlp supports activation_function in {list(_FUSED_MLP_ACTIVATIONS)}, got {act!r}")
    if sqrelu_dense and act != "sqrelu":
        raise ValueError(f"fused_dense_sqrelu_dense needs activation_function='sqrelu', got {act!r}")
    if not (fused_mlp or sqrelu_dense):
        _check_activation(config)
        tp = _tp_kwargs(config, process_group)
        if act in _GATED:
            # GatedMlp recognises GLU and SwiGLU by identity with F.sigmoid / F.silu (fused paths).
            activation = {"glu": F.sigmoid, "swiglu": F.silu, "geglu": F.gelu}[act]
            cls = GatedMlp if process_group is None else _parallel_module("mlp", "ParallelGatedMlp")
            return partial(cls, hidden_features=config.n_inner, activation=activation,
                           multiple_of=getattr(config, "mlp_multiple_of", 128), **bias, **tp, **factory)
        if act == "relu":
            activation = partial(F.relu, inplace=True)
        elif act == "sqrelu":
            activation = sqrelu_fwd
        else:
            activation = partial(F.gelu, approximate="tanh" if act in _TANH_GELUS else "none")
        cls = Mlp if process_group is None else _parallel_module("mlp", "ParallelMLP")
        return partial(cls, hidden_features=config.n_inner, activation=activation, **bias, **tp, **factory)
    checkpoint_lvl = getattr(config, "mlp_checkpoint_lvl", 0)
    if isinstance(checkpoint_lvl, Sequence):
        if layer_idx is None:
            raise ValueError("a per-layer mlp_checkpoint_lvl needs layer_idx, got None")
        checkpoint_lvl = checkpoint_lvl[layer_idx]
    if sqrelu_dense:
        if process_group is not None:
            raise ValueError("fused_dense_sqrelu_dense has no tensor-parallel version")
        return partial(FusedMLP, hidden_features=config.n_inner, activation="sqrelu",
                       checkpoint_lvl=checkpoint_lvl, **factory)
    activation = "gelu_approx" if act in _TANH_GELUS else act
    if process_group is None:
        cls = FusedMLP
    else:
        from culmen.flash_attn.ops.fused_dense import ParallelFusedMLP as cls
    return partial(cls, hidden_features=config.n_inner, activation=activation, checkpoint_lvl=checkpoint_lvl,
                   **bias, **_tp_kwargs(config, process_group), **factory)


def create_block(config, layer_idx: int | None = None, process_group=None, device=None, dtype=None) -> nn.Module:
    """One transformer layer from ``config``: ``Block`` (``ParallelBlock`` with ``parallel_block``),
    with ``nn.LayerNorm`` or ``RMSNorm`` (``rms_norm``). Layer 0's first residual dropout is
    ``embd_pdrop`` (the blocks' dropout-add-norm order puts the embedding dropout there)."""
    factory = {"device": device, "dtype": dtype}
    mixer_cls = create_mixer_cls(config, layer_idx, process_group=process_group, **factory)
    mlp_cls = create_mlp_cls(config, layer_idx, process_group=process_group, **factory)
    norm_cls = partial(RMSNorm if getattr(config, "rms_norm", False) else nn.LayerNorm,
                       eps=config.layer_norm_epsilon, **factory)
    common = dict(
        norm_cls=norm_cls,
        resid_dropout1=config.resid_pdrop if layer_idx is None or layer_idx > 0 else config.embd_pdrop,
        resid_dropout2=config.resid_pdrop,
        fused_dropout_add_ln=getattr(config, "fused_dropout_add_ln", False),
        residual_in_fp32=getattr(config, "residual_in_fp32", False),
        sequence_parallel=getattr(config, "sequence_parallel", True) and process_group is not None,
        mark_shared_params=process_group is not None,
    )
    prenorm = getattr(config, "prenorm", True)
    if getattr(config, "parallel_block", False):
        if not prenorm:
            raise ValueError("parallel_block=True needs prenorm=True")
        parallel_block_cls = _parallel_module("block", "ParallelBlock")
        block = parallel_block_cls(config.hidden_size, mixer_cls, mlp_cls,
                                   tied_norm=getattr(config, "parallel_block_tied_norm", False), **common)
    else:
        block = Block(config.hidden_size, mixer_cls, mlp_cls, prenorm=prenorm, **common)
    block.layer_idx = layer_idx
    return block


class GPTPreTrainedModel(nn.Module):
    """Base of the GPT models: keeps ``config`` and loads pretrained checkpoints."""

    def __init__(self, config, *inputs, **kwargs) -> None:
        super().__init__()
        if GPT2Config is not None and not isinstance(config, GPT2Config):
            raise ValueError(
                f"Parameter config in `{type(self).__name__}(config)` should be an instance of class "
                f"`GPT2Config`, got {type(config).__name__}"
            )
        self.config = config

    @classmethod
    def from_pretrained(cls, model_name: str | os.PathLike, config, *args, strict: bool = True, device=None, dtype=None,
                        world_size: int = 1, rank: int = 0, **kwargs):
        """Build ``cls(config, *args, device=device, dtype=dtype, **kwargs)`` and load ``model_name``'s
        checkpoint (``state_dict_from_pretrained``: a hub name or a local directory), remapped by the
        name's family (gpt2, facebook/opt, EleutherAI/gpt-j / GPT-JT, gpt-neox / pythia / RedPajama,
        tiiuae/falcon, meta-llama/Llama, bigcode / WizardLM; for a local directory, its path or its last
        component, e.g. ``.../gpt2-medium``) and sharded for tensor parallelism when ``world_size > 1``."""
        import importlib

        model = cls(config, *args, device=device, dtype=dtype, **kwargs)
        # Loaded on CPU: the model already sits on its device, the checkpoint should not join it there.
        pretrained = importlib.import_module("culmen.flash_attn.utils.pretrained")
        state_dict = pretrained.state_dict_from_pretrained(model_name, device="cpu", dtype=dtype)
        families = (
            (("gpt2",), "gpt", "remap_state_dict_hf_gpt2"),
            (("facebook/opt",), "opt", "remap_state_dict_hf_opt"),
            (("EleutherAI/gpt-j-", "togethercomputer/GPT-JT-"), "gptj", "remap_state_dict_hf_gptj"),
            (("EleutherAI/gpt-neox-", "EleutherAI/pythia-", "togethercomputer/RedPajama-INCITE-"),
             "gpt_neox", "remap_state_dict_hf_gpt_neox"),
            (("tiiuae/falcon-",), "falcon", "remap_state_dict_hf_falcon"),
            (("meta-llama/Llama-",), "llama", "remap_state_dict_hf_llama"),
            (("bigcode/", "WizardLM/"), "bigcode", "remap_state_dict_hf_bigcode"),
        )
        name = str(model_name)
        candidates = (name, os.path.basename(os.path.normpath(name)))
        for prefixes, module, fn in families:
            if any(c.startswith(prefixes) for c in candidates):
                remap = getattr(importlib.import_module(f"culmen.flash_attn.models.{module}"), fn)
                state_dict = remap(state_dict, config)
                break
        else:
            raise NotImplementedError(f"Model {name} not supported")
        if world_size > 1:
            state_dict = shard_state_dict_tp(state_dict, config, world_size, rank)
        logger.info(model.load_state_dict(state_dict, strict=strict))
        return model


def _init_weights(module: nn.Module, n_layer: int, initializer_range: float = 0.02,
                  mup_width_scale: float = 1.0, rescale_prenorm_residual: bool = True) -> None:
    """GPT-2 initialisation: N(0, initializer_range) linears (times sqrt(mup_width_scale), their weight
    tagged with ``_optim = {"lr_multiplier": mup_width_scale}``) and embeddings, zero biases, and the
    residual-output projections (``out_proj``, ``fc2``) scaled down by sqrt(2 * n_layer)."""
    scale = math.sqrt(mup_width_scale)
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=initializer_range * scale)
        optim = getattr(module.weight, "_optim", {})
        optim.update({"lr_multiplier": mup_width_scale})
        module.weight._optim = optim
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for name, p in module.named_parameters():
            if name in ("out_proj.weight", "fc2.weight"):
                nn.init.normal_(p, mean=0.0, std=initializer_range * scale / math.sqrt(2 * n_layer))


class GPTModel(GPTPreTrainedModel):
    """Embeddings, ``n_layer`` blocks and the final norm (``ln_f``, pre-norm models only).

    ``forward(input_ids, position_ids=None, inference_params=None)``: ``input_ids`` int64
    ``(batch, seqlen)``; returns hidden states ``(batch, seqlen, hidden)`` (``(batch * seqlen, hidden)``
    split over ranks under sequence parallelism) in the parameters' dtype.
    """

    def __init__(self, config, process_group=None, device=None, dtype=None) -> None:
        super().__init__(config)
        factory = {"device": device, "dtype": dtype}
        self.process_group = process_group
        self.sequence_parallel = getattr(config, "sequence_parallel", True)
        _check_activation(config)
        vocab_size = _padded_vocab(config)
        self.embeddings_multiplier = getattr(config, "mup_embeddings_multiplier", 1.0)
        self.residual_in_fp32 = getattr(config, "residual_in_fp32", False)
        self.prenorm = getattr(config, "prenorm", True)
        use_rms_norm = getattr(config, "rms_norm", False)
        word_embed_proj_dim = getattr(config, "word_embed_proj_dim", None)
        self.parallel_block = getattr(config, "parallel_block", False)
        if process_group is None:
            self.embeddings = GPT2Embeddings(config.hidden_size, vocab_size, config.max_position_embeddings,
                                             word_embed_proj_dim=word_embed_proj_dim, **factory)
        else:
            embeddings_cls = _parallel_module("embedding", "ParallelGPT2Embeddings")
            self.embeddings = embeddings_cls(config.hidden_size, vocab_size, config.max_position_embeddings,
                                             process_group=process_group,
                                             sequence_parallel=self.sequence_parallel, **factory)
        self.layers = nn.ModuleList(
            [create_block(config, layer_idx=i, process_group=process_group, **factory)
             for i in range(config.num_hidden_layers)]
        )
        if getattr(config, "rotary_emb_fraction", 0.0) > 0.0:
            # One cos/sin cache for the whole model instead of one per layer.
            for layer in self.layers[1:]:
                layer.mixer.rotary_emb = self.layers[0].mixer.rotary_emb
        self.fused_dropout_add_ln = getattr(config, "fused_dropout_add_ln", False)
        if self.prenorm:
            self.drop_f = nn.Dropout(config.resid_pdrop)
            norm_cls = RMSNorm if use_rms_norm else nn.LayerNorm
            self.ln_f = norm_cls(config.hidden_size, eps=config.layer_norm_epsilon, **factory)
            self._ln_f_is_rms = use_rms_norm
        if process_group is not None and self.prenorm:
            for p in self.ln_f.parameters():
                p._shared_params = True  # replicated: synced from rank 0 at init
                if self.sequence_parallel:
                    p._sequence_parallel = True  # each rank saw part of the sequence: grads all-reduced
        # The embedding / mixer keyword arguments depend only on the configuration: built once here.
        self._seq_parallel_tp = process_group is not None and self.sequence_parallel
        self._embedding_kwargs = {"combine_batch_seqlen_dim": True} if self._seq_parallel_tp else {}
        self.apply(partial(_init_weights, n_layer=config.num_hidden_layers,
                           initializer_range=config.initializer_range,
                           mup_width_scale=getattr(config, "mup_width_scale", 1.0)))
        self.tie_weights()

    def tie_weights(self) -> None:
        """Under tensor parallelism, broadcast the replicated parameters from rank 0."""
        if self.process_group is not None:
            sync_shared_params(self, self.process_group)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs) -> dict:
        """``layer_idx -> KV cache`` of every layer (see ``MHA.allocate_inference_cache``)."""
        return {i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
                for i, layer in enumerate(self.layers)}

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, inference_params=None) -> Tensor:
        hidden_states = self.embeddings(input_ids, position_ids=position_ids, **self._embedding_kwargs)
        if self.embeddings_multiplier != 1.0:
            hidden_states = hidden_states * self.embeddings_multiplier
        mixer_kwargs = {"seqlen": input_ids.shape[1]} if self._seq_parallel_tp else {}
        if inference_params is not None:
            mixer_kwargs["inference_params"] = inference_params
        residual = hidden_states2 = None
        for layer in self.layers:
            if not self.prenorm:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            elif self.parallel_block:
                hidden_states, hidden_states2, residual = layer(hidden_states, hidden_states2, residual,
                                                                mixer_kwargs=mixer_kwargs)
            else:
                hidden_states, residual = layer(hidden_states, residual, mixer_kwargs=mixer_kwargs)
        if not self.prenorm:
            return hidden_states
        if self.fused_dropout_add_ln:
            # One kernel: dropout, residual add (both branches of a parallel block) and the final norm.
            return layer_norm_fn(
                hidden_states, self.ln_f.weight, self.ln_f.bias, residual=residual,
                x1=hidden_states2 if self.parallel_block else None, eps=self.ln_f.eps,
                dropout_p=self.drop_f.p if self.training else 0.0, prenorm=False, is_rms_norm=self._ln_f_is_rms,
            )
        dropped = self.drop_f(hidden_states)
        if self.parallel_block:
            dropped = dropped + self.drop_f(hidden_states2)
        residual = dropped if residual is None else residual + dropped
        return self.ln_f(residual.to(dtype=self.ln_f.weight.dtype))


class GPTLMHeadModel(GPTPreTrainedModel, GenerationMixin):
    """``GPTModel`` (``self.transformer``) and the language-model head ``lm_head`` (tied to the word
    embeddings unless ``tie_word_embeddings=False``); generates through ``GenerationMixin``.

    ``forward(input_ids, position_ids=None, inference_params=None, num_last_tokens=0)``: ``input_ids``
    int64 ``(batch, seqlen)``; returns ``CausalLMOutput(logits)``, logits ``(batch, seqlen or
    num_last_tokens, padded vocab)`` in the parameters' dtype (gathered over ranks while decoding under
    tensor parallelism).
    """

    def __init__(self, config, process_group=None, device=None, dtype=None) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__(config)
        self.process_group = process_group
        self.transformer = GPTModel(config, process_group=process_group, **factory)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
        lm_head_bias = getattr(config, "lm_head_bias", False)
        vocab_size = _padded_vocab(config)
        word_embed_proj_dim = getattr(config, "word_embed_proj_dim", None)
        embed_dim = config.n_embd if word_embed_proj_dim is None else word_embed_proj_dim
        self.project_out = (nn.Linear(config.n_embd, embed_dim, bias=False, **factory)
                            if word_embed_proj_dim is not None else None)
        mup_width_scale = getattr(config, "mup_width_scale", 1.0)
        self.output_scale = getattr(config, "mup_output_multiplier", 1.0) * mup_width_scale
        if process_group is None:
            self.lm_head = nn.Linear(embed_dim, vocab_size, bias=lm_head_bias, **factory)
        else:
            self.lm_head = ColumnParallelLinear(embed_dim, vocab_size, process_group, bias=lm_head_bias,
                                                sequence_parallel=getattr(config, "sequence_parallel", True),
                                                **factory)
        self.norm_head = getattr(config, "norm_head", False)
        self._tp_head = isinstance(self.lm_head, ColumnParallelLinear)
        self.apply(partial(_init_weights, n_layer=config.num_hidden_layers,
                           initializer_range=config.initializer_range, mup_width_scale=mup_width_scale))
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the word-embedding weight with ``lm_head`` (when tied) and sync replicated params."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.transformer.embeddings.word_embeddings.weight
        if self.process_group is not None:
            sync_shared_params(self, self.process_group)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs) -> dict:
        """``layer_idx -> KV cache`` for CUDA-graph decoding (see ``GPTModel.allocate_inference_cache``)."""
        return self.transformer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, inference_params=None,
                num_last_tokens: int = 0):
        if input_ids.ndim != 2:
            raise ValueError(f"Expected `input_ids` to have shape [b, slen], but got shape {tuple(input_ids.shape)}")
        batch = input_ids.shape[0]
        hidden_states = self.transformer(input_ids, position_ids=position_ids, inference_params=inference_params)
        if inference_params is not None and hidden_states.ndim != 3:
            raise ValueError("sequence_parallel is not supported in generation mode")
        if num_last_tokens > 0:
            hidden_states = hidden_states[:, -num_last_tokens:]
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        if self.output_scale != 1.0:
            hidden_states = hidden_states * self.output_scale
        if not self.norm_head:
            logits = self.lm_head(hidden_states)
        else:
            weight = F.normalize(self.lm_head.weight)
            if self._tp_head and self.lm_head.sequence_parallel:
                hidden_states = all_gather(hidden_states, self.lm_head.process_group)
            logits = F.linear(hidden_states, weight, bias=self.lm_head.bias)
        if self._tp_head and inference_params is not None:
            # Sampling needs every rank's vocabulary shard: (world * b, ..., v) -> (b, ..., world * v).
            gathered, _ = all_gather_raw(logits, self.lm_head.process_group)
            world = gathered.shape[0] // batch
            gathered = gathered.view(world, batch, *logits.shape[1:])
            logits = gathered.movedim(0, -2).reshape(batch, *logits.shape[1:-1], -1)
        return CausalLMOutput(logits=logits)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, also accepting flash_attn's early checkpoints whose blocks
        normed after the residual add (a ``transformer.ln_0`` in front): their norms move one place
        along (``ln_0`` -> layer 0 ``norm1``, each ``norm2`` -> the next layer's ``norm1``, each ``norm1``
        -> ``norm2``, the last ``norm2`` -> ``ln_f``)."""
        if "transformer.ln_0.weight" in state_dict:
            state_dict = _shift_legacy_norms(dict(state_dict), len(self.transformer.layers))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def _shift_legacy_norms(sd: dict, n_layers: int) -> dict:
    def move(src: str, dst: str) -> None:
        for suffix in ("weight", "bias"):
            if f"{src}.{suffix}" in sd:
                sd[f"{dst}.{suffix}"] = sd.pop(f"{src}.{suffix}")

    layer = "transformer.layers.{}.norm{}".format
    move(layer(n_layers - 1, 2), "transformer.ln_f")
    for i in reversed(range(n_layers)):
        move(layer(i, 1), layer(i, 2))
        if i > 0:
            move(layer(i - 1, 2), layer(i, 1))
    move("transformer.ln_0", layer(0, 1))
    return sd


# ---------------------------------------------------------------------------------------------------
# Tensor-parallel sharding of checkpoints
# ---------------------------------------------------------------------------------------------------

def _tp_sizes(config, world_size: int) -> tuple[int, int, int, int]:
    """(padded vocab, n_head, n_head_kv, head_dim) after checking the model splits over world_size."""
    vocab = _padded_vocab(config)
    inner = config.n_inner if config.n_inner is not None else 4 * config.hidden_size
    for name, value in (("padded vocab_size", vocab), ("hidden_size", config.hidden_size), ("n_inner", inner)):
        if value % world_size:
            raise ValueError(f"{name} ({value}) must be divisible by world_size ({world_size})")
    n_head = config.n_head
    n_head_kv = getattr(config, "n_head_kv", None) or n_head
    return vocab, n_head, n_head_kv, config.hidden_size // n_head


def _rank_range(total: int, world_size: int, rank: int, multiple_of: int = 1) -> tuple[int, int]:
    sizes = [get_dim_for_local_rank(total, world_size, r, multiple_of) for r in range(world_size)]
    return sum(sizes[:rank]), sum(sizes[: rank + 1])


def _qkv_rank_heads(n_head: int, n_head_kv: int, world_size: int, rank: int) -> list[tuple[int, int]]:
    """(first row, row count) in head units of this rank's q, k and v heads in a fused Wqkv.

    Heads are dealt by kv group (one kv head with its ``n_head // n_head_kv`` query heads), as
    ``ParallelMHA`` holds them; this is flash_attn's split wherever flash_attn's is consistent (an even
    split of the kv heads, or plain MHA), and keeps every rank's query / kv ratio when it is not.
    """
    group = n_head // n_head_kv
    kv_beg, kv_end = _rank_range(n_head_kv, world_size, rank)
    return [(group * kv_beg, group * (kv_end - kv_beg)), (n_head + kv_beg, kv_end - kv_beg),
            (n_head + n_head_kv + kv_beg, kv_end - kv_beg)]


def shard_state_dict_tp(state_dict: dict, config, world_size: int, rank: int) -> dict:
    """Rank ``rank``'s share of a full GPT ``state_dict`` for ``world_size``-way tensor parallelism
    (what ``GPTLMHeadModel(config, process_group)`` holds on that rank). Modifies and returns
    ``state_dict``.

    Vocabulary rows (word embeddings, ``lm_head``) and the MLP's ``fc1`` rows (each half separately for
    gated MLPs) split evenly; position embeddings and ``fc2`` split by columns; ``Wqkv`` keeps this
    rank's heads and ``out_proj`` the matching columns, dealt by kv group (an uneven count of groups:
    the first ranks take one more; see ``ParallelMHA``). ``out_proj`` / ``fc2`` biases stay on rank 0.
    """
    _, n_head, n_head_kv, head_dim = _tp_sizes(config, world_size)
    group = n_head // n_head_kv

    def rows(key: str) -> None:
        if key in state_dict:
            x = state_dict[key]
            n = x.shape[0] // world_size
            state_dict[key] = x[rank * n:(rank + 1) * n]

    def columns(key: str, multiple_of: int = 1) -> None:
        if key in state_dict:
            x = state_dict[key]
            beg, end = _rank_range(x.shape[-1], world_size, rank, multiple_of)
            state_dict[key] = x[..., beg:end]

    def gated_rows(key: str) -> None:
        if key in state_dict:
            x = state_dict[key]
            half = x.shape[0] // 2
            n = half // world_size
            state_dict[key] = torch.cat([x[rank * n:(rank + 1) * n], x[half + rank * n:half + (rank + 1) * n]])

    def qkv_heads(key: str) -> None:
        if key in state_dict:
            x = state_dict[key]
            heads = x.view(n_head + 2 * n_head_kv, head_dim, *x.shape[1:])
            ranges = _qkv_rank_heads(n_head, n_head_kv, world_size, rank)
            parts = [heads[start:start + count] for start, count in ranges]
            state_dict[key] = torch.cat(parts).flatten(0, 1)

    rows("transformer.embeddings.word_embeddings.weight")
    rows("lm_head.weight")
    columns("transformer.embeddings.position_embeddings.weight")
    gated = config.activation_function in _GATED
    for i in range(config.num_hidden_layers):
        p = f"transformer.layers.{i}."
        qkv_heads(p + "mixer.Wqkv.weight")
        qkv_heads(p + "mixer.Wqkv.bias")
        columns(p + "mixer.out_proj.weight", multiple_of=head_dim * group)
        for key in (p + "mlp.fc1.weight", p + "mlp.fc1.bias"):
            gated_rows(key) if gated else rows(key)
        columns(p + "mlp.fc2.weight")
        if rank != 0:
            state_dict.pop(p + "mixer.out_proj.bias", None)
            state_dict.pop(p + "mlp.fc2.bias", None)
    return state_dict


def combine_state_dicts_tp(state_dicts: list[dict[str, Tensor]], config) -> dict[str, Tensor]:
    """The full GPT ``state_dict`` from the per-rank ones of :func:`shard_state_dict_tp` (listed in rank
    order); the inverse of the sharding. The inputs are not modified."""
    world_size = len(state_dicts)
    vocab, n_head, n_head_kv, head_dim = _tp_sizes(config, world_size)
    if config.hidden_size % n_head:
        raise ValueError(f"hidden_size ({config.hidden_size}) must be divisible by n_head ({n_head})")
    out = dict(state_dicts[0])

    def cat(key: str, dim: int) -> None:
        if key in out:
            out[key] = torch.cat([s[key] for s in state_dicts], dim=dim)

    def vocab_rows(key: str) -> None:
        if key in out:
            # Some checkpoints shard the embedding by columns instead; the shard's shape tells.
            cat(key, 0 if out[key].shape[0] == vocab // world_size else 1)

    def gated_rows(key: str) -> None:
        if key in out:
            halves = [s[key].chunk(2, dim=0) for s in state_dicts]
            out[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])

    def qkv_heads(key: str) -> None:
        if key not in out:
            return
        per_rank = []
        for rank, s in enumerate(state_dicts):
            counts = [count for _, count in _qkv_rank_heads(n_head, n_head_kv, world_size, rank)]
            x = s[key]
            per_rank.append(x.view(sum(counts), head_dim, *x.shape[1:]).split(counts))
        # Ranks hold consecutive heads of each of q, k, v: concatenating in rank order restores them.
        full = [torch.cat([parts[g] for parts in per_rank]) for g in range(3)]
        out[key] = torch.cat(full).flatten(0, 1)

    vocab_rows("transformer.embeddings.word_embeddings.weight")
    vocab_rows("lm_head.weight")
    cat("transformer.embeddings.position_embeddings.weight", -1)
    gated = config.activation_function in _GATED
    for i in range(config.num_hidden_layers):
        p = f"transformer.layers.{i}."
        qkv_heads(p + "mixer.Wqkv.weight")
        qkv_heads(p + "mixer.Wqkv.bias")
        cat(p + "mixer.out_proj.weight", -1)
        for key in (p + "mlp.fc1.weight", p + "mlp.fc1.bias"):
            gated_rows(key) if gated else cat(key, 0)
        cat(p + "mlp.fc2.weight", -1)
    return out


# ---------------------------------------------------------------------------------------------------
# Checkpoint remaps
# ---------------------------------------------------------------------------------------------------

def _rename(state_dict: Mapping[str, Tensor], rules: Sequence[tuple[str, str]]) -> OrderedDict:
    """Every key rewritten by the first matching ``(pattern, replacement)`` rule (unmatched: unchanged)."""
    compiled = [(re.compile(p), r) for p, r in rules]
    out = OrderedDict()
    for key, value in state_dict.items():
        for pattern, repl in compiled:
            new, n = pattern.subn(repl, key)
            if n:
                key = new
                break
        out[key] = value
    return out


def _pad_vocab(word_embeddings: Tensor, vocab_size: int) -> Tensor:
    return F.pad(word_embeddings, (0, 0, 0, vocab_size - word_embeddings.shape[0]))


_HF_GPT2_RULES = (
    (r"^wpe\.", "transformer.embeddings.position_embeddings."),
    (r"^ln_f\.(weight|bias)$", r"transformer.ln_f.\1"),
    (r"^h\.(\d+)\.ln_(1|2)\.(weight|bias)$", r"transformer.layers.\1.norm\2.\3"),
    (r"^h\.(\d+)\.mlp\.c_fc\.", r"transformer.layers.\1.mlp.fc1."),
    (r"^h\.(\d+)\.mlp\.c_proj\.", r"transformer.layers.\1.mlp.fc2."),
    (r"^h\.(\d+)\.attn\.c_attn\.", r"transformer.layers.\1.mixer.Wqkv."),
    (r"^h\.(\d+)\.attn\.c_proj\.", r"transformer.layers.\1.mixer.out_proj."),
)
# Hugging Face's Conv1D stores (in, out): these weights are transposed into nn.Linear's (out, in).
_HF_GPT2_CONV1D = re.compile(r"^transformer\.layers\.\d+\.(mlp\.fc[12]|mixer\.Wqkv|mixer\.out_proj)\.weight$")


def remap_state_dict_hf_gpt2(state_dict: Mapping[str, Tensor], config) -> OrderedDict:
    """A Hugging Face GPT-2 checkpoint (``wte``, ``wpe``, ``h.{i}...``, ``ln_f``; a leading
    ``transformer.`` is accepted) as a ``GPTLMHeadModel`` state dict: Conv1D weights transposed, the
    word embeddings padded to ``pad_vocab_size_multiple`` and shared with ``lm_head.weight``, the
    causal-mask buffers (``attn.bias`` / ``attn.masked_bias``) dropped."""
    sd = OrderedDict()
    for key, value in state_dict.items():
        key = key.removeprefix("transformer.")
        if key == "lm_head.weight" or re.match(r"^h\.\d+\.attn\.(masked_)?bias$", key):
            continue  # lm_head is tied to wte; the mask buffers are not parameters
        sd[key] = value
    word = sd.pop("wte.weight")
    sd = _rename(sd, _HF_GPT2_RULES)
    for key in list(sd):
        if _HF_GPT2_CONV1D.match(key):
            sd[key] = sd[key].t()
    sd["transformer.embeddings.word_embeddings.weight"] = _pad_vocab(word, _padded_vocab(config))
    sd["lm_head.weight"] = sd["transformer.embeddings.word_embeddings.weight"]
    return sd


def inv_remap_state_dict_hf_gpt2(state_dict: Mapping[str, Tensor], config) -> OrderedDict:
    """The inverse of :func:`remap_state_dict_hf_gpt2`: a ``GPTLMHeadModel`` state dict as the
    ``state_dict`` of ``transformers.GPT2LMHeadModel`` (``transformer.``-prefixed, Conv1D layouts, the
    vocabulary padding removed, ``lm_head.weight`` tied to ``wte``). culmen addition (flash_attn has
    inverse remaps for LLaMA only)."""
    rules = (
        (r"^transformer\.embeddings\.position_embeddings\.", "wpe."),
        (r"^transformer\.ln_f\.", "ln_f."),
        (r"^transformer\.layers\.(\d+)\.norm(1|2)\.", r"h.\1.ln_\2."),
        (r"^transformer\.layers\.(\d+)\.mlp\.fc1\.", r"h.\1.mlp.c_fc."),
        (r"^transformer\.layers\.(\d+)\.mlp\.fc2\.", r"h.\1.mlp.c_proj."),
        (r"^transformer\.layers\.(\d+)\.mixer\.Wqkv\.", r"h.\1.attn.c_attn."),
        (r"^transformer\.layers\.(\d+)\.mixer\.out_proj\.", r"h.\1.attn.c_proj."),
    )
    sd = OrderedDict((k, v) for k, v in state_dict.items() if k != "lm_head.weight")
    word = sd.pop("transformer.embeddings.word_embeddings.weight")[: config.vocab_size]
    out = OrderedDict()
    for key, value in _rename(sd, rules).items():
        if re.match(r"^h\.\d+\.(mlp\.c_fc|mlp\.c_proj|attn\.c_attn|attn\.c_proj)\.weight$", key):
            value = value.t()
        out["transformer." + key] = value
    out["transformer.wte.weight"] = word
    out["lm_head.weight"] = word
    return out


def remap_state_dict_megatron(state_dict: Mapping[str, Tensor], config) -> OrderedDict:
    """A Megatron-LM GPT checkpoint (``language_model.{embedding,encoder}...``) as a ``GPTLMHeadModel``
    state dict: layer names mapped, the word embeddings padded to ``pad_vocab_size_multiple`` and shared
    with ``lm_head``, and Megatron's per-head ``(nheads, 3, headdim)`` qkv rows reordered to
    ``(3, nheads, headdim)``."""
    sd = _rename(state_dict, ((r"^language_model\.encoder\.", "transformer."), (r"^language_model\.", "transformer.")))
    sd = OrderedDict((k, v) for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq"))
    word = sd.pop("transformer.embedding.word_embeddings.weight")
    multiple = getattr(config, "pad_vocab_size_multiple", 1)
    padded = math.ceil(word.shape[0] / multiple) * multiple
    sd = _rename(sd, (
        (r"^(wpe|transformer\.embedding\.position_embeddings)\.", "transformer.embeddings.position_embeddings."),
        (r"^transformer\.final_layernorm\.", "transformer.ln_f."),
        (r"^transformer\.layers\.(\d+)\.input_layernorm\.", r"transformer.layers.\1.norm1."),
        (r"^transformer\.layers\.(\d+)\.post_attention_layernorm\.", r"transformer.layers.\1.norm2."),
        (r"^transformer\.layers\.(\d+)\.mlp\.dense_h_to_4h\.", r"transformer.layers.\1.mlp.fc1."),
        (r"^transformer\.layers\.(\d+)\.mlp\.dense_4h_to_h\.", r"transformer.layers.\1.mlp.fc2."),
        (r"^transformer\.layers\.(\d+)\.self_attention\.query_key_value\.", r"transformer.layers.\1.mixer.Wqkv."),
        (r"^transformer\.layers\.(\d+)\.self_attention\.dense\.", r"transformer.layers.\1.mixer.out_proj."),
    ))
    sd["transformer.embeddings.word_embeddings.weight"] = _pad_vocab(word, padded)
    sd["lm_head.weight"] = sd["transformer.embeddings.word_embeddings.weight"]
    head_dim = config.hidden_size // config.num_attention_heads
    for i in range(config.num_hidden_layers):
        for suffix in ("weight", "bias"):
            key = f"transformer.layers.{i}.mixer.Wqkv.{suffix}"
            if key in sd:
                x = sd[key]
                per_head = x.reshape(-1, 3, head_dim, *x.shape[1:])
                sd[key] = per_head.transpose(0, 1).reshape(x.shape)
    return sd
