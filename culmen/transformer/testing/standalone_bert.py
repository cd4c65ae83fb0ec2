"""``apex.transformer.testing.standalone_bert``: the BERT of Apex's model-parallel tests (padding-masked
``TransformerLanguageModel``, masked-LM head tied to the word embeddings, optional sentence-order
binary head), on culmen's layers.

Differences from Apex: the masked-LM loss is returned ``[b, s]`` like the labels (Apex returned
``[s, b]``); the LM head's vocab-sharded bias is marked tensor-parallel (Apex left a TODO), its layer
norm takes ``sequence_parallel_enabled`` (Apex passed an unknown ``sequence_parallel`` keyword);
``cpu_offload`` is honoured (Apex's ``BertModel`` never stored it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from culmen.transformer import tensor_parallel
from culmen.transformer.enums import AttnMaskType
from culmen.transformer.layers import FusedLayerNorm as LayerNorm
from culmen.transformer.testing.global_vars import get_args
from culmen.transformer.testing.standalone_transformer_lm import (
    InitMethod,
    MegatronModule,
    _forward_context,
    _sequence_parallel,
    erf_gelu,
    get_language_model,
    get_linear_layer,
    init_method_normal,
    openai_gelu,
    parallel_lm_logits,
    scaled_init_method_normal,
)

__all__ = ["BertLMHead", "BertModel", "bert_extended_attention_mask", "bert_model_provider", "bert_position_ids",
           "post_language_model_processing"]


def bert_extended_attention_mask(attention_mask: Tensor) -> Tensor:
    """``[b, s]`` padding mask (1 = token, 0 = padding) -> bool ``[b, 1, s, s]``, True where query or key
    is padding (masked)."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [b, s], got shape {tuple(attention_mask.shape)}")
    keep = attention_mask.unsqueeze(1) * attention_mask.unsqueeze(2)  # [b, s, s]
    return keep.unsqueeze(1) < 0.5


def bert_position_ids(token_ids: Tensor) -> Tensor:
    """``0 .. s-1`` for every row of ``token_ids [b, s]`` (int64 ``[b, s]``)."""
    s = token_ids.size(1)
    return torch.arange(s, dtype=torch.long, device=token_ids.device).unsqueeze(0).expand_as(token_ids)


class BertLMHead(MegatronModule):
    """Masked-LM head: ``Linear(h, h)``, GeLU, layer norm, logits against the word embeddings + bias.

    Args:
        mpu_vocab_size: this TP rank's vocabulary rows (the bias size).
        hidden_size: h.
        init_method: initializer of the dense layer.
        layernorm_epsilon: the layer norm's epsilon.
        parallel_output: keep the logits split over the TP ranks.

    ``forward(hidden_states [s, b, h], word_embeddings_weight [vocab / tp, h])`` returns logits
    ``[s, b, vocab / tp]``. With sequence parallelism the dense layer and layer norm see this rank's
    tokens only; their parameters are marked ``sequence_parallel_enabled`` (gradients to be summed
    over the TP ranks).
    """

    def __init__(self, mpu_vocab_size: int, hidden_size: int, init_method: InitMethod, layernorm_epsilon: float,
                 parallel_output: bool) -> None:
        super().__init__()
        args = get_args()
        sp = _sequence_parallel(args)
        self.bias = torch.nn.Parameter(torch.zeros(mpu_vocab_size, dtype=args.params_dtype))
        tensor_parallel.set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        self.parallel_output = parallel_output
        self.dense = get_linear_layer(hidden_size, hidden_size, init_method)
        for p in (self.dense.weight, self.dense.bias):
            p.sequence_parallel_enabled = sp
            p.sequence_parallel = sp  # Apex's attribute name for these two
        self.layernorm = LayerNorm(hidden_size, eps=layernorm_epsilon, sequence_parallel_enabled=sp,
                                   dtype=args.params_dtype)
        self.gelu: Callable[[Tensor], Tensor] = F.gelu
        if args.openai_gelu:
            self.gelu = openai_gelu
        elif args.onnx_safe:
            self.gelu = erf_gelu

    def forward(self, hidden_states: Tensor, word_embeddings_weight: Tensor) -> Tensor:
        hidden_states = self.layernorm(self.gelu(self.dense(hidden_states)))
        return parallel_lm_logits(hidden_states, word_embeddings_weight, self.parallel_output, bias=self.bias)


def post_language_model_processing(lm_output: Tensor, pooled_output: Tensor | None, lm_head: BertLMHead,
                                   binary_head: torch.nn.Module | None, lm_labels: Tensor | None,
                                   logit_weights: Tensor, fp16_lm_cross_entropy: bool):
    """``(lm_loss [b, s], binary_logits [b, 2] or None)`` given ``lm_labels [b, s]``, else
    ``(lm_logits [b, s, vocab / tp], binary_logits)``."""
    lm_logits = lm_head(lm_output, logit_weights)
    binary_logits = binary_head(pooled_output) if binary_head is not None else None
    if lm_labels is None:
        return lm_logits.transpose(0, 1).contiguous(), binary_logits
    labels_sb = lm_labels.transpose(0, 1).contiguous()
    if fp16_lm_cross_entropy:
        if lm_logits.dtype != torch.half:
            raise ValueError(f"fp16_lm_cross_entropy needs fp16 logits, got {lm_logits.dtype}")
    elif lm_logits.dtype in (torch.half, torch.bfloat16):
        lm_logits = lm_logits.float()
    lm_loss = tensor_parallel.vocab_parallel_cross_entropy(lm_logits, labels_sb)
    return lm_loss.transpose(0, 1).contiguous(), binary_logits


class BertModel(MegatronModule):
    """BERT (one pipeline chunk).

    Args:
        num_tokentypes: token-type rows (2 with the binary head).
        add_binary_head: pool the first token and add the 2-way sentence-order head.
        parallel_output: keep the LM logits split over the TP ranks.
        pre_process, post_process: this chunk is the first / last pipeline stage.
        cpu_offload: keep saved activations in host memory.

    ``forward(bert_model_input [b, s], attention_mask [b, s] (1 = token), tokentype_ids=None,
    lm_labels=None)``: on the last stage ``(lm_loss [b, s], binary_logits [b, 2] or None)`` given
    ``lm_labels``, else ``(lm_logits [b, s, vocab / tp], binary_logits)``; elsewhere the hidden states.
    """

    def __init__(self, num_tokentypes: int = 2, add_binary_head: bool = True, parallel_output: bool = True,
                 pre_process: bool = True, post_process: bool = True, cpu_offload: bool = False) -> None:
        super().__init__()
        args = get_args()
        self.fp16_lm_cross_entropy = args.fp16_lm_cross_entropy
        self.add_binary_head = add_binary_head
        self.parallel_output = parallel_output
        self.pre_process = pre_process
        self.post_process = post_process
        self.cpu_offload = cpu_offload
        self._forward_context = _forward_context(cpu_offload)
        init_method = init_method_normal(args.init_method_std)
        scaled_init_method = scaled_init_method_normal(args.init_method_std, args.num_layers)
        self.language_model, self._language_model_key = get_language_model(
            num_tokentypes=num_tokentypes, add_pooler=add_binary_head, encoder_attn_mask_type=AttnMaskType.padding,
            init_method=init_method, scaled_init_method=scaled_init_method, pre_process=pre_process,
            post_process=post_process)
        self.initialize_word_embeddings(init_method_normal)
        if post_process:
            self.lm_head = BertLMHead(self.word_embeddings_weight().size(0), args.hidden_size, init_method,
                                      args.layernorm_epsilon, parallel_output)
            self._lm_head_key = "lm_head"
            self.binary_head = None
            if add_binary_head:
                self.binary_head = get_linear_layer(args.hidden_size, 2, init_method)
                self._binary_head_key = "binary_head"

    def set_input_tensor(self, input_tensor: Tensor | list[Tensor] | None) -> None:
        """The activation received from the previous pipeline stage."""
        self.language_model.set_input_tensor(input_tensor)

    def forward(self, bert_model_input: Tensor | None, attention_mask: Tensor, tokentype_ids: Tensor | None = None,
                lm_labels: Tensor | None = None):
        with self._forward_context():
            extended_attention_mask = bert_extended_attention_mask(attention_mask)
            position_ids = bert_position_ids(bert_model_input) if bert_model_input is not None else None
            lm_output = self.language_model(bert_model_input, position_ids, extended_attention_mask,
                                            tokentype_ids=tokentype_ids)
            if not self.post_process:
                return lm_output
            pooled_output = None
            if self.add_binary_head:
                lm_output, pooled_output = lm_output
            return post_language_model_processing(lm_output, pooled_output, self.lm_head, self.binary_head, lm_labels,
                                                  self.word_embeddings_weight(), self.fp16_lm_cross_entropy)

    def state_dict_for_save_checkpoint(self, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """The nested checkpoint form: ``language_model``, ``lm_head``, ``binary_head``,
        ``word_embeddings_for_head`` as this chunk holds them."""
        state = {self._language_model_key: self.language_model.state_dict_for_save_checkpoint(
            prefix=prefix, keep_vars=keep_vars)}
        if self.post_process:
            state[self._lm_head_key] = self.lm_head.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
            if self.add_binary_head:
                state[self._binary_head_key] = self.binary_head.state_dict(prefix=prefix, keep_vars=keep_vars)
            if not self.pre_process:
                state[self._word_embeddings_for_head_key] = self.word_embeddings.state_dict(prefix=prefix,
                                                                                           keep_vars=keep_vars)
        return state

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load either ``state_dict_for_save_checkpoint``'s nested form or a plain ``state_dict``."""
        if self._language_model_key not in state_dict:
            return super().load_state_dict(state_dict, strict=strict)
        self.language_model.load_state_dict(state_dict[self._language_model_key], strict=strict)
        if self.post_process:
            self.lm_head.load_state_dict(state_dict[self._lm_head_key], strict=strict)
            if self.add_binary_head:
                self.binary_head.load_state_dict(state_dict[self._binary_head_key], strict=strict)
            if not self.pre_process:
                self.word_embeddings.load_state_dict(state_dict[self._word_embeddings_for_head_key], strict=strict)


def bert_model_provider(pre_process: bool = True, post_process: bool = True, cpu_offload: bool = False) -> BertModel:
    """Build this pipeline chunk's ``BertModel`` from ``get_args()`` (binary head and two token types unless
    ``--bert-no-binary-head``)."""
    args = get_args()
    return BertModel(num_tokentypes=2 if args.bert_binary_head else 0, add_binary_head=args.bert_binary_head,
                     parallel_output=True, pre_process=pre_process, post_process=post_process,
                     cpu_offload=bool(cpu_offload or args.cpu_offload))
