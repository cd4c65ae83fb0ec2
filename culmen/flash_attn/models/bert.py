"""``flash_attn.models.bert``: BERT built from culmen's ``MHA`` / ``Mlp`` / ``Block`` modules.

Names, constructor arguments, config fields and ``state_dict`` keys are flash_attn 2.8's, so
checkpoints move between flash_attn and culmen unchanged. The config is a ``transformers.BertConfig``
read through flash_attn's extra fields:

- ``use_flash_attn``: with an ``attention_mask``, the encoder packs the valid tokens
  (``bert_padding.unpad_input``) and runs varlen attention on ``(total_tokens, hidden)``; padded
  positions of ``last_hidden_state`` come back as zeros.
- ``fused_bias_fc`` (``FusedDense`` projections), ``fused_mlp`` (+ ``mlp_checkpoint_lvl``, an int or
  one per layer; needs a tanh GELU ``hidden_act``), ``fused_dropout_add_ln`` (culmen's fused LayerNorm).
- ``dense_seq_output``: the MLM head runs only on tokens with ``labels > 0``.
- ``last_layer_subset`` (needs ``dense_seq_output``): the last layer computes only the masked
  tokens and the CLS tokens, as cross-attention against the whole sequence.
- ``use_xentropy``: the losses are culmen's ``CrossEntropyLoss`` (``inplace_backward=True``).
- ``pad_vocab_size_multiple``: rounds ``config.vocab_size`` up (in place, as flash_attn).

As in flash_attn, the MLM loss ignores label 0 and the NSP loss label -1 (Hugging Face uses -100).

Differences from flash_attn, on purpose: invalid configs raise ``ValueError`` (flash_attn asserts);
``transformers`` is optional (without it any object with ``BertConfig``'s fields serves as config
and the outputs are small stand-ins with the same attributes); ``inv_remap_state_dict`` emits the
key names of today's ``transformers`` ``BertForPreTraining.state_dict()`` (``LayerNorm.weight`` /
``.bias`` and both ``cls.predictions.bias`` and ``cls.predictions.decoder.bias``), so its result
loads with ``strict=True``; flash_attn emits the legacy ``gamma`` / ``beta`` names and drops
``cls.predictions.decoder.bias``.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from culmen.flash_attn.bert_padding import index_first_axis, pad_input, unpad_input
from culmen.flash_attn.losses.cross_entropy import CrossEntropyLoss
from culmen.flash_attn.modules.block import Block
from culmen.flash_attn.modules.embedding import BertEmbeddings
from culmen.flash_attn.modules.mha import MHA
from culmen.flash_attn.modules.mlp import Mlp
from culmen.flash_attn.ops.fused_dense import FusedDense, FusedMLP
from culmen.flash_attn.ops.triton.layer_norm import layer_norm_fn
from culmen.flash_attn.utils.pretrained import state_dict_from_pretrained

try:
    from transformers import BertConfig, PretrainedConfig
    from transformers.models.bert.modeling_bert import (
        BaseModelOutputWithPoolingAndCrossAttentions,
        BertForPreTrainingOutput,
    )
except ImportError:  # transformers is optional: duck-typed configs and plain output records
    BertConfig = None
    PretrainedConfig = Any

    class _Output:
        """Attribute record standing in for a ``transformers`` ``ModelOutput``."""

        _fields: tuple[str, ...] = ()

        def __init__(self, **kwargs):
            for name in self._fields:
                setattr(self, name, kwargs.pop(name, None))
            if kwargs:
                raise TypeError(f"unexpected output fields {sorted(kwargs)}")

        def __getitem__(self, key):
            return getattr(self, key) if isinstance(key, str) else self.to_tuple()[key]

        def to_tuple(self) -> tuple:
            return tuple(v for v in (getattr(self, n) for n in self._fields) if v is not None)

    class BaseModelOutputWithPoolingAndCrossAttentions(_Output):
        _fields = ("last_hidden_state", "pooler_output", "hidden_states", "past_key_values", "attentions",
                   "cross_attentions")

    class BertForPreTrainingOutput(_Output):
        _fields = ("loss", "prediction_logits", "seq_relationship_logits", "hidden_states", "attentions")


__all__ = [
    "BertEncoder",
    "BertForPreTraining",
    "BertLMPredictionHead",
    "BertModel",
    "BertPooler",
    "BertPreTrainedModel",
    "BertPredictionHeadTransform",
    "BertPreTrainingHeads",
    "create_block",
    "create_mixer_cls",
    "create_mlp_cls",
    "inv_remap_state_dict",
    "remap_state_dict",
]

logger = logging.getLogger(__name__)

_GELUS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")
_TANH_GELUS = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")
_CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
                  "vocab_size", "max_position_embeddings", "type_vocab_size", "layer_norm_eps",
                  "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range", "pad_token_id")


def _gelu_approximate(config) -> str:
    return "tanh" if config.hidden_act in _TANH_GELUS else "none"


def _linear_cls(config) -> type[nn.Linear]:
    return FusedDense if getattr(config, "fused_bias_fc", False) else nn.Linear


def create_mixer_cls(config, cross_attn: bool = False, return_residual: bool = False):
    """``partial(MHA, ...)`` for a BERT layer: bidirectional, the config's heads, dropout and flags."""
    rotary_kwargs = {}
    if getattr(config, "position_embedding_type", "absolute") == "rotary":
        rotary_kwargs = dict(
            rotary_emb_dim=getattr(config, "rotary_emb_dim", config.hidden_size),
            rotary_emb_base=getattr(config, "rotary_emb_base", 10000.0),
            rotary_emb_scale_base=getattr(config, "rotary_emb_scale_base", None),
            rotary_emb_interleaved=getattr(config, "rotary_emb_interleaved", False),
        )
    return partial(
        MHA,
        num_heads=config.num_attention_heads,
        cross_attn=cross_attn,
        dropout=config.attention_probs_dropout_prob,
        causal=False,
        fused_bias_fc=getattr(config, "fused_bias_fc", False),
        use_flash_attn=getattr(config, "use_flash_attn", False),
        return_residual=return_residual,
        **rotary_kwargs,
    )


def create_mlp_cls(config, layer_idx: int | None = None, return_residual: bool = False):
    """``partial(Mlp, ...)`` (exact or tanh GELU per ``hidden_act``), or ``partial(FusedMLP, ...)``
    with ``config.fused_mlp`` (tanh GELU only; ``mlp_checkpoint_lvl`` an int or one per layer)."""
    if not getattr(config, "fused_mlp", False):
        return partial(Mlp, hidden_features=config.intermediate_size,
                       activation=partial(F.gelu, approximate=_gelu_approximate(config)),
                       return_residual=return_residual)
    if config.hidden_act not in _TANH_GELUS:
        raise ValueError(f"fused_mlp only supports approximate gelu (hidden_act in {_TANH_GELUS}), "
                         f"got hidden_act={config.hidden_act!r}")
    lvl = getattr(config, "mlp_checkpoint_lvl", 0)
    if isinstance(lvl, Sequence):
        if layer_idx is None:
            raise ValueError("a per-layer mlp_checkpoint_lvl needs layer_idx")
        lvl = lvl[layer_idx]
    return partial(FusedMLP, hidden_features=config.intermediate_size, checkpoint_lvl=lvl,
                   return_residual=return_residual)


def create_block(config, layer_idx: int | None = None) -> Block:
    """One post-norm BERT layer. With ``last_layer_subset`` the last layer's mixer is cross-attention
    (``Wq`` / ``Wkv``) and, like flash_attn, its sub-layers do not return their residuals."""
    cross_attn = getattr(config, "last_layer_subset", False) and layer_idx == config.num_hidden_layers - 1
    return_residual = not cross_attn
    return Block(
        config.hidden_size,
        create_mixer_cls(config, cross_attn, return_residual=return_residual),
        create_mlp_cls(config, layer_idx, return_residual=return_residual),
        norm_cls=partial(nn.LayerNorm, eps=config.layer_norm_eps),
        prenorm=False,
        resid_dropout1=config.hidden_dropout_prob,
        resid_dropout2=config.hidden_dropout_prob,
        fused_dropout_add_ln=getattr(config, "fused_dropout_add_ln", False),
        return_residual=return_residual,
    )


def _init_weights(module: nn.Module, initializer_range: float = 0.02) -> None:
    # BERT's init: N(0, initializer_range) weights, zero biases, a zero padding embedding row.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=initializer_range)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()


def _subset_cu_seqlens(mask: Tensor) -> Tensor:
    return F.pad(torch.cumsum(mask.sum(dim=-1, dtype=torch.int32), dim=0, dtype=torch.int32), (1, 0))


class BertEncoder(nn.Module):
    """The stack of ``config.num_hidden_layers`` post-norm blocks (``self.layers``)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.use_flash_attn = getattr(config, "use_flash_attn", False)
        self.layers = nn.ModuleList([create_block(config, layer_idx=i) for i in range(config.num_hidden_layers)])

    def forward(self, hidden_states: Tensor, key_padding_mask: Tensor | None = None,
                subset_mask: Tensor | None = None) -> Tensor:
        """``hidden_states (B, S, H)``; ``key_padding_mask (B, S)`` bool, True = valid token.

        Returns ``(B, S, H)``; with ``subset_mask (B, S)`` bool, only the subset's rows
        ``(n_subset, H)`` (in row-major order), and the last layer computes only those.
        """
        if key_padding_mask is None or not self.use_flash_attn:
            mixer_kwargs = {"key_padding_mask": key_padding_mask} if key_padding_mask is not None else None
            for layer in self.layers:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            return hidden_states[subset_mask] if subset_mask is not None else hidden_states
        batch, seqlen = hidden_states.shape[:2]
        hidden_states, indices, cu_seqlens, max_seqlen, _ = unpad_input(hidden_states, key_padding_mask)
        mixer_kwargs = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
        if subset_mask is None:
            for layer in self.layers:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            return pad_input(hidden_states, indices, batch, seqlen)
        for layer in self.layers[:-1]:
            hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
        # The last layer's queries are the subset's packed rows; keys/values stay the whole packed
        # sequence. max_seqlen bounds the subset's lengths too, which is all varlen attention needs.
        subset_idx = torch.nonzero(subset_mask[key_padding_mask], as_tuple=False).flatten()
        mixer_kwargs = {
            "x_kv": hidden_states,
            "cu_seqlens": _subset_cu_seqlens(subset_mask & key_padding_mask),
            "max_seqlen": max_seqlen,
            "cu_seqlens_k": cu_seqlens,
            "max_seqlen_k": max_seqlen,
        }
        return self.layers[-1](index_first_axis(hidden_states, subset_idx), mixer_kwargs=mixer_kwargs)


class BertPooler(nn.Module):
    """``tanh(dense(h[:, 0]))`` (``pool=False``: of ``h`` itself, rows already picked)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.dense = _linear_cls(config)(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: Tensor, pool: bool = True) -> Tensor:
        """``(B, S, H)`` -> ``(B, H)`` (``pool=False``: ``(N, H)`` -> ``(N, H)``)."""
        return self.activation(self.dense(hidden_states[:, 0] if pool else hidden_states))


class BertPredictionHeadTransform(nn.Module):
    """``LayerNorm(gelu(dense(h)))`` over ``(..., H)``; the LayerNorm is culmen's kernel with
    ``fused_dropout_add_ln``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.fused_dropout_add_ln = getattr(config, "fused_dropout_add_ln", False)
        self.dense = _linear_cls(config)(config.hidden_size, config.hidden_size)
        self.transform_act_fn = nn.GELU(approximate=_gelu_approximate(config))
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """``(..., H)`` -> ``(..., H)``."""
        hidden_states = self.transform_act_fn(self.dense(hidden_states))
        if not self.fused_dropout_add_ln:
            return self.layer_norm(hidden_states)
        return layer_norm_fn(hidden_states, self.layer_norm.weight, self.layer_norm.bias, eps=self.layer_norm.eps)


class BertLMPredictionHead(nn.Module):
    """The MLM head: ``transform`` then ``decoder (vocab_size, H)`` (tied to the word embeddings by
    ``BertForPreTraining``) with its own bias. ``(..., H)`` -> ``(..., vocab_size)``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = _linear_cls(config)(config.hidden_size, config.vocab_size, bias=True)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """``(..., H)`` -> ``(..., vocab_size)`` logits."""
        return self.decoder(self.transform(hidden_states))


class BertPreTrainingHeads(nn.Module):
    """MLM logits of the sequence output and next-sentence logits ``(…, 2)`` of the pooled output."""

    def __init__(self, config) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence_output: Tensor, pooled_output: Tensor) -> tuple[Tensor, Tensor]:
        """Returns ``(prediction_scores (..., vocab), seq_relationship_score (B, 2))``."""
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


def _check_config(config, owner: str) -> None:
    if BertConfig is not None:
        if not isinstance(config, BertConfig):
            raise ValueError(f"Parameter config in `{owner}(config)` should be an instance of class `BertConfig`, "
                             f"got {type(config).__name__}. To create a model from a Google pretrained model use "
                             f"`model = {owner}.from_pretrained(PRETRAINED_MODEL_NAME, config)`")
        return
    missing = [f for f in _CONFIG_FIELDS if not hasattr(config, f)]
    if missing:
        raise ValueError(f"config of `{owner}` lacks BertConfig fields {missing}")


class BertPreTrainedModel(nn.Module):
    """Base class: keeps ``config`` and loads Hugging Face BERT checkpoints (``from_pretrained``)."""

    def __init__(self, config, *inputs, **kwargs) -> None:
        super().__init__()
        _check_config(config, self.__class__.__name__)
        self.config = config

    @classmethod
    def from_pretrained(cls, model_name: str, config, *inputs, **kwargs):
        """Build ``cls(config, *inputs, **kwargs)`` and load the Hugging Face BERT checkpoint
        ``model_name`` (a local directory or a hub name, see ``utils.pretrained``) into it through
        ``remap_state_dict`` (``strict=False``). A bare ``BertModel`` (keys without the ``bert.``
        prefix) gets the checkpoint's ``bert.`` part; flash_attn loads nothing into it then."""
        model = cls(config, *inputs, **kwargs)
        state_dict = remap_state_dict(state_dict_from_pretrained(model_name), config)
        if not any(k.startswith("bert.") for k in model.state_dict()):
            state_dict = OrderedDict((k[len("bert."):], v) for k, v in state_dict.items() if k.startswith("bert."))
        load_return = model.load_state_dict(state_dict, strict=False)
        logger.info(load_return)
        return model


class BertModel(BertPreTrainedModel):
    """BERT encoder: embeddings -> LayerNorm -> dropout -> ``BertEncoder`` -> optional pooler.

    ``add_pooling_layer``: build ``pooler`` (``BertPooler``); without it ``pooler_output`` is None.
    """

    def __init__(self, config, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.pad_vocab_size_multiple = getattr(config, "pad_vocab_size_multiple", 1)
        if config.vocab_size % self.pad_vocab_size_multiple != 0:
            config.vocab_size += self.pad_vocab_size_multiple - config.vocab_size % self.pad_vocab_size_multiple
        self.fused_dropout_add_ln = getattr(config, "fused_dropout_add_ln", False)
        if config.hidden_act not in _GELUS:
            raise ValueError(f"config.hidden_act must be one of {_GELUS}, got {config.hidden_act!r}")
        self.embeddings = BertEmbeddings(config.hidden_size, config.vocab_size, config.max_position_embeddings,
                                         config.type_vocab_size, padding_idx=config.pad_token_id)
        self.emb_drop = nn.Dropout(config.hidden_dropout_prob)
        self.emb_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.apply(partial(_init_weights, initializer_range=config.initializer_range))

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, token_type_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, masked_tokens_mask: Tensor | None = None):
        """``input_ids (B, S)`` int64; ``position_ids`` / ``token_type_ids (B, S)``; ``attention_mask
        (B, S)`` bool (True = token); ``masked_tokens_mask (B, S)`` bool.

        Returns ``last_hidden_state (B, S, H)`` and ``pooler_output (B, H)``. With
        ``masked_tokens_mask`` (``last_layer_subset``), ``last_hidden_state`` is only the masked
        tokens' rows ``(n_masked, H)`` and the last layer computes only them and the CLS tokens.
        """
        hidden_states = self.embeddings(input_ids, position_ids=position_ids, token_type_ids=token_type_ids)
        # BERT normalizes the embeddings before their dropout.
        if not self.fused_dropout_add_ln:
            hidden_states = self.emb_ln(hidden_states)
        else:
            hidden_states = layer_norm_fn(hidden_states, self.emb_ln.weight, self.emb_ln.bias, eps=self.emb_ln.eps)
        hidden_states = self.emb_drop(hidden_states)

        subset_mask = first_col_mask = None
        if masked_tokens_mask is not None:
            first_col_mask = torch.zeros_like(masked_tokens_mask, dtype=torch.bool)
            first_col_mask[:, 0] = True  # the pooler needs every CLS token
            subset_mask = masked_tokens_mask | first_col_mask

        sequence_output = self.encoder(hidden_states, key_padding_mask=attention_mask, subset_mask=subset_mask)

        if masked_tokens_mask is None:
            pooled_output = self.pooler(sequence_output) if self.pooler is not None else None
        else:
            # sequence_output holds the subset's rows in row-major order; select CLS and masked rows
            # among them (the valid tokens' order when padded).
            if attention_mask is not None:
                in_subset = subset_mask[attention_mask]
                pool_input = sequence_output[first_col_mask[attention_mask][in_subset]]
                sequence_output = sequence_output[masked_tokens_mask[attention_mask][in_subset]]
            else:
                pool_input = sequence_output[first_col_mask[subset_mask]]
                sequence_output = sequence_output[masked_tokens_mask[subset_mask]]
            pooled_output = self.pooler(pool_input, pool=False) if self.pooler is not None else None
        return BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=sequence_output,
                                                            pooler_output=pooled_output)


class BertForPreTraining(BertPreTrainedModel):
    """``BertModel`` + MLM and next-sentence heads (``cls``), the MLM decoder tied to the word embeddings.

    ``mlm_loss`` ignores label 0 and ``nsp_loss`` label -1 (flash_attn's convention).
    """

    def __init__(self, config) -> None:
        super().__init__(config)
        # dense_seq_output: the MLM head sees only the masked tokens (about 15%).
        self.dense_seq_output = getattr(config, "dense_seq_output", False)
        # last_layer_subset: the last layer computes only the tokens the losses read.
        self.last_layer_subset = getattr(config, "last_layer_subset", False)
        if self.last_layer_subset and not self.dense_seq_output:
            raise ValueError("last_layer_subset requires dense_seq_output")
        loss_cls = (partial(CrossEntropyLoss, inplace_backward=True) if getattr(config, "use_xentropy", False)
                    else nn.CrossEntropyLoss)
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.mlm_loss = loss_cls(ignore_index=0)
        self.nsp_loss = loss_cls(ignore_index=-1)
        self.apply(partial(_init_weights, initializer_range=config.initializer_range))
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the MLM decoder's weight with the word embeddings."""
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, token_type_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, labels: Tensor | None = None,
                next_sentence_label: Tensor | None = None):
        """``input_ids (B, S)``; ``attention_mask (B, S)`` (any dtype, nonzero = token); ``labels (B, S)``
        int64 with 0 at unmasked and padded tokens; ``next_sentence_label (B,)`` (-1 ignored).

        Returns ``loss`` (fp32, MLM + NSP, when both label tensors are given), ``prediction_logits``
        (``(B, S, vocab)``, or ``(n_masked, vocab)`` with ``dense_seq_output`` and ``labels``) and
        ``seq_relationship_logits (B, 2)``.
        """
        masked_tokens_mask = labels > 0 if (self.last_layer_subset and labels is not None) else None
        outputs = self.bert(input_ids, position_ids=position_ids, token_type_ids=token_type_ids,
                            attention_mask=attention_mask.bool() if attention_mask is not None else None,
                            masked_tokens_mask=masked_tokens_mask)
        sequence_output, pooled_output = outputs.last_hidden_state, outputs.pooler_output
        dense = self.dense_seq_output and labels is not None
        if dense:
            masked_token_idx = torch.nonzero(labels.flatten() > 0, as_tuple=False).flatten()
            if not self.last_layer_subset:
                sequence_output = index_first_axis(sequence_output.reshape(-1, sequence_output.shape[-1]),
                                                   masked_token_idx)
        prediction_scores, seq_relationship_score = self.cls(sequence_output, pooled_output)

        total_loss = None
        if labels is not None and next_sentence_label is not None:
            if dense:  # the scores are already the masked rows
                masked_lm_loss = self.mlm_loss(prediction_scores, labels.flatten()[masked_token_idx])
            else:
                masked_lm_loss = self.mlm_loss(prediction_scores.reshape(-1, prediction_scores.shape[-1]),
                                               labels.reshape(-1))
            next_sentence_loss = self.nsp_loss(seq_relationship_score.reshape(-1, seq_relationship_score.shape[-1]),
                                               next_sentence_label.reshape(-1))
            total_loss = masked_lm_loss.float() + next_sentence_loss.float()
        return BertForPreTrainingOutput(loss=total_loss, prediction_logits=prediction_scores,
                                        seq_relationship_logits=seq_relationship_score)


# ------------------------------------------------------------------------------------ state dicts

_LAYER = r"^bert\.encoder\.layers\.(\d+)\."
# Hugging Face name -> flash_attn name, applied in order to every key (after layer -> layers).
_HF_TO_FLASH = [
    (re.compile(r"LayerNorm\.gamma$"), "LayerNorm.weight"),
    (re.compile(r"LayerNorm\.beta$"), "LayerNorm.bias"),
    (re.compile(r"^bert\.encoder\.layer\."), "bert.encoder.layers."),
    (re.compile(r"^bert\.embeddings\.LayerNorm\."), "bert.emb_ln."),
    (re.compile(_LAYER + r"attention\.output\.LayerNorm\."), r"bert.encoder.layers.\1.norm1."),
    (re.compile(_LAYER + r"output\.LayerNorm\."), r"bert.encoder.layers.\1.norm2."),
    (re.compile(r"^cls\.predictions\.transform\.LayerNorm\."), "cls.predictions.transform.layer_norm."),
    (re.compile(_LAYER + r"intermediate\.dense\."), r"bert.encoder.layers.\1.mlp.fc1."),
    (re.compile(_LAYER + r"output\.dense\."), r"bert.encoder.layers.\1.mlp.fc2."),
    (re.compile(_LAYER + r"attention\.output\.dense\."), r"bert.encoder.layers.\1.mixer.out_proj."),
    (re.compile(r"^cls\.predictions\.bias$"), "cls.predictions.decoder.bias"),
]
_FLASH_TO_HF = [
    (re.compile(r"^bert\.emb_ln\."), "bert.embeddings.LayerNorm."),
    (re.compile(_LAYER + r"norm1\."), r"bert.encoder.layers.\1.attention.output.LayerNorm."),
    (re.compile(_LAYER + r"norm2\."), r"bert.encoder.layers.\1.output.LayerNorm."),
    (re.compile(r"^cls\.predictions\.transform\.layer_norm\."), "cls.predictions.transform.LayerNorm."),
    (re.compile(_LAYER + r"mlp\.fc1\."), r"bert.encoder.layers.\1.intermediate.dense."),
    (re.compile(_LAYER + r"mlp\.fc2\."), r"bert.encoder.layers.\1.output.dense."),
    (re.compile(_LAYER + r"mixer\.out_proj\."), r"bert.encoder.layers.\1.attention.output.dense."),
    (re.compile(r"^bert\.encoder\.layers\."), "bert.encoder.layer."),
]


def _rename(key: str, rules) -> str:
    for pattern, repl in rules:
        key = pattern.sub(repl, key)
    return key


def _pop_required(state_dict: dict, key: str) -> Tensor:
    if key not in state_dict:
        raise ValueError(f"state_dict lacks {key!r} (does config.num_hidden_layers / last_layer_subset "
                         "match the checkpoint?)")
    return state_dict.pop(key)


def _last_subset_layer(config) -> int:
    return config.num_hidden_layers - 1 if getattr(config, "last_layer_subset", False) else -1


def remap_state_dict(state_dict: Mapping[str, Tensor], config: PretrainedConfig) -> OrderedDict[str, Tensor]:
    """Map a Hugging Face BERT pre-training ``state_dict`` (``bert.`` / ``cls.`` keys, either
    ``LayerNorm.weight`` or legacy ``gamma`` / ``beta`` names) to this module's keys.

    Query/key/value become ``mixer.Wqkv`` (``(3H, H)``, q then k then v), or ``mixer.Wq`` +
    ``mixer.Wkv`` for the last layer with ``config.last_layer_subset``. With
    ``config.pad_vocab_size_multiple`` the word embeddings and decoder are zero-padded to
    ``config.vocab_size`` rows and the decoder bias with -100 (padded tokens are never predicted).
    Tensors are not copied where only their name changes; the input mapping is left unchanged.
    """
    out = OrderedDict((_rename(k, _HF_TO_FLASH), v) for k, v in state_dict.items())
    subset_layer = _last_subset_layer(config)
    for d in range(config.num_hidden_layers):
        base = f"bert.encoder.layers.{d}."
        w = [_pop_required(out, f"{base}attention.self.{n}.weight") for n in ("query", "key", "value")]
        b = [_pop_required(out, f"{base}attention.self.{n}.bias") for n in ("query", "key", "value")]
        if d != subset_layer:
            out[f"{base}mixer.Wqkv.weight"] = torch.cat(w, dim=0)
            out[f"{base}mixer.Wqkv.bias"] = torch.cat(b, dim=0)
        else:
            out[f"{base}mixer.Wq.weight"] = w[0]
            out[f"{base}mixer.Wkv.weight"] = torch.cat(w[1:], dim=0)
            out[f"{base}mixer.Wq.bias"] = b[0]
            out[f"{base}mixer.Wkv.bias"] = torch.cat(b[1:], dim=0)
    if getattr(config, "pad_vocab_size_multiple", 1) > 1:
        for key in ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"):
            if key in out:
                out[key] = F.pad(out[key], (0, 0, 0, config.vocab_size - out[key].shape[0]))
        key = "cls.predictions.decoder.bias"
        if key in out:
            out[key] = F.pad(out[key], (0, config.vocab_size - out[key].shape[0]), value=-100.0)
    return out


def inv_remap_state_dict(state_dict: Mapping[str, Tensor], config: PretrainedConfig) -> OrderedDict[str, Tensor]:
    """The inverse of ``remap_state_dict``: this module's ``state_dict`` to Hugging Face BERT keys.

    ``Wqkv`` (or ``Wq`` / ``Wkv``) are split back into query/key/value (views, not copies); with
    ``config.pad_vocab_size_multiple > 1`` the vocab rows are cut to ``config.orig_vocab_size``. The
    result has the keys of ``transformers``' ``BertForPreTraining.state_dict()``, including both
    ``cls.predictions.bias`` and the tied ``cls.predictions.decoder.bias``.
    """
    out = OrderedDict(state_dict.items())
    if getattr(config, "pad_vocab_size_multiple", 1) > 1:
        vocab = getattr(config, "orig_vocab_size", None)
        if not isinstance(vocab, int):
            raise ValueError("inv_remap_state_dict with pad_vocab_size_multiple > 1 needs config.orig_vocab_size "
                             f"(the unpadded vocabulary size), got {vocab!r}")
        for key in ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight",
                    "cls.predictions.decoder.bias"):
            if key in out:
                out[key] = out[key][:vocab]
    subset_layer = _last_subset_layer(config)
    for d in range(config.num_hidden_layers):
        base = f"bert.encoder.layers.{d}."
        if d != subset_layer:
            q_w, k_w, v_w = _pop_required(out, f"{base}mixer.Wqkv.weight").chunk(3, dim=0)
            q_b, k_b, v_b = _pop_required(out, f"{base}mixer.Wqkv.bias").chunk(3, dim=0)
        else:
            q_w = _pop_required(out, f"{base}mixer.Wq.weight")
            k_w, v_w = _pop_required(out, f"{base}mixer.Wkv.weight").chunk(2, dim=0)
            q_b = _pop_required(out, f"{base}mixer.Wq.bias")
            k_b, v_b = _pop_required(out, f"{base}mixer.Wkv.bias").chunk(2, dim=0)
        for name, w, b in (("query", q_w, q_b), ("key", k_w, k_b), ("value", v_w, v_b)):
            out[f"{base}attention.self.{name}.weight"] = w
            out[f"{base}attention.self.{name}.bias"] = b
    out = OrderedDict((_rename(k, _FLASH_TO_HF), v) for k, v in out.items())
    if "cls.predictions.decoder.bias" in out:
        out["cls.predictions.bias"] = out["cls.predictions.decoder.bias"]
    return out
