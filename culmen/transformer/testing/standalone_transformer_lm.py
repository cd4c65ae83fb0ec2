"""``apex.transformer.testing.standalone_transformer_lm``: Megatron's transformer language model built from
culmen's tensor-parallel layers, fused softmax and layer norm (the base of the standalone GPT and BERT).

The blocks (``ParallelMLP``, ``CoreAttention``, ``ParallelAttention``, ``ParallelTransformerLayer``,
``ParallelTransformer``, ``MegatronModule`` and the init helpers) live in
:mod:`culmen.transformer.testing.standalone_transformer_layers` and are re-exported here. This module adds
the embedding, the pooler, ``TransformerLanguageModel`` with its pipeline ``pre_process`` /
``post_process`` flags, ``get_language_model``, the vocab-parallel logits and loss.

Shapes (Megatron's): token ids ``[b, s]``; hidden states ``[s, b, h]`` (``[s / tp, b, h]`` per TP rank
with sequence parallelism); logits ``[s, b, vocab / tp]`` unless gathered.

Differences from Apex: ``post_language_model_processing`` upcasts only 16-bit logits before the loss
(Apex's ``.float()`` also downcast float64); the pooler gathers the sequence-parallel shards with
``to_model_parallel=False`` (every rank pools the same token, so the gradient must not be summed over
the TP ranks; Apex's default multiplied it by the TP size); ``InferenceParams`` is provided for the
key-value cache the attention reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from culmen.transformer import parallel_state, tensor_parallel
from culmen.transformer.enums import AttnMaskType, LayerType
from culmen.transformer.testing.global_vars import get_args
from culmen.transformer.testing.standalone_transformer_layers import (
    CoreAttention,
    InitMethod,
    MegatronModule,
    NoopTransformerLayer,
    ParallelAttention,
    ParallelMLP,
    ParallelTransformer,
    ParallelTransformerLayer,
    _sequence_parallel,
    attention_mask_func,
    bias_dropout_add,
    erf_gelu,
    get_bias_dropout_add,
    get_linear_layer,
    get_num_layers,
    init_method_normal,
    openai_gelu,
    param_is_not_shared,
    scaled_init_method_normal,
)

__all__ = [
    "CoreAttention",
    "Embedding",
    "InferenceParams",
    "MegatronModule",
    "NoopTransformerLayer",
    "ParallelAttention",
    "ParallelMLP",
    "ParallelTransformer",
    "ParallelTransformerLayer",
    "Pooler",
    "TransformerLanguageModel",
    "attention_mask_func",
    "bias_dropout_add",
    "erf_gelu",
    "get_bias_dropout_add",
    "get_language_model",
    "get_linear_layer",
    "get_num_layers",
    "init_method_normal",
    "module_size",
    "openai_gelu",
    "parallel_lm_logits",
    "param_is_not_shared",
    "post_language_model_processing",
    "scaled_init_method_normal",
]


class InferenceParams:
    """Key-value cache bookkeeping for incremental decoding (Megatron's ``InferenceParams``).

    Args:
        max_batch_size, max_sequence_len: the cache's capacity.

    Attributes the attention reads: ``sequence_len_offset`` (positions already cached; advance it
    after each step), ``batch_size_offset``, ``key_value_memory_dict`` (layer number -> (keys, values),
    each ``[max_sequence_len, max_batch_size, heads / tp, head_dim]``).
    """

    def __init__(self, max_batch_size: int, max_sequence_len: int) -> None:
        for name, value in (("max_batch_size", max_batch_size), ("max_sequence_len", max_sequence_len)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_batch_size = max_batch_size
        self.max_sequence_len = max_sequence_len
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict: dict[int, tuple[Tensor, Tensor]] = {}


def parallel_lm_logits(input_: Tensor, word_embeddings_weight: Tensor, parallel_output: bool,
                       bias: Tensor | None = None) -> Tensor:
    """Logits ``input_ @ word_embeddings_weight.T (+ bias)`` with the vocabulary split over the TP ranks.

    Args:
        input_: hidden states ``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism: gathered
            inside the GEMM, the input gradient reduce-scattered back).
        word_embeddings_weight: ``[vocab / tp, h]``.
        parallel_output: return this rank's ``[s, b, vocab / tp]``; else all-gather ``[s, b, vocab]``.
        bias: ``[vocab / tp]`` or None.
    """
    args = get_args()
    sp = _sequence_parallel(args)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if args.async_tensor_model_parallel_allreduce or sp:
        input_parallel = input_
        async_grad_allreduce = bool(args.async_tensor_model_parallel_allreduce) and tp > 1 and not sp
    else:
        input_parallel = tensor_parallel.copy_to_tensor_model_parallel_region(input_)
        async_grad_allreduce = False
    logits_parallel = tensor_parallel.linear_with_grad_accumulation_and_async_allreduce(
        input_parallel, word_embeddings_weight, bias, bool(args.gradient_accumulation_fusion), async_grad_allreduce,
        sp)
    if parallel_output:
        return logits_parallel
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits_parallel)


def post_language_model_processing(lm_output: Tensor, labels: Tensor | None, logit_weights: Tensor,
                                   parallel_output: bool, fp16_lm_cross_entropy: bool) -> Tensor:
    """Logits of ``lm_output [s, b, h]``; with ``labels [s, b]`` the per-token vocab-parallel loss ``[s, b]``
    instead (16-bit logits upcast to fp32 first unless ``fp16_lm_cross_entropy``)."""
    output = parallel_lm_logits(lm_output, logit_weights, parallel_output)
    if labels is None:
        return output
    if fp16_lm_cross_entropy:
        if output.dtype != torch.half:
            raise ValueError(f"fp16_lm_cross_entropy needs fp16 logits, got {output.dtype}")
    elif output.dtype in (torch.half, torch.bfloat16):
        output = output.float()
    return tensor_parallel.vocab_parallel_cross_entropy(output, labels)


def module_size(m: torch.nn.Module, only_trainable: bool = False) -> int:
    """Elements in ``m``'s parameters, shared tensors counted once (only those requiring grad if
    ``only_trainable``)."""
    params = [p for p in m.parameters() if p.requires_grad or not only_trainable]
    return sum(p.numel() for p in {p.data_ptr(): p for p in params}.values())


class Pooler(MegatronModule):
    """``tanh(Linear(h, h))`` of one token's hidden state (BERT's [CLS] pooling).

    ``forward(hidden_states [s, b, h], sequence_index=0)`` returns ``[b, h]`` (with sequence
    parallelism the shards are gathered first).
    """

    def __init__(self, hidden_size: int, init_method: InitMethod) -> None:
        super().__init__()
        args = get_args()
        self.dense = get_linear_layer(hidden_size, hidden_size, init_method)
        self.sequence_parallel = _sequence_parallel(args)

    def forward(self, hidden_states: Tensor, sequence_index: int = 0) -> Tensor:
        if self.sequence_parallel:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(hidden_states,
                                                                                 to_model_parallel=False)
        return torch.tanh(self.dense(hidden_states[sequence_index, :, :]))


class Embedding(MegatronModule):
    """Word (vocab-parallel) + position (+ token-type) embeddings, transposed to ``[s, b, h]``, dropout.

    Args:
        hidden_size: h.
        vocab_size: the padded vocabulary (divisible by the TP size).
        max_sequence_length: rows of the position embedding.
        embedding_dropout_prob: dropout on the sum.
        init_method: initializer of every embedding table.
        num_tokentypes: rows of the token-type embedding (0: none).

    ``forward(input_ids [b, s], position_ids [b, s], tokentype_ids=None)`` returns ``[s, b, h]``, or this
    rank's ``[s / tp, b, h]`` with sequence parallelism (dropped out with the per-TP-rank stream).
    """

    def __init__(self, hidden_size: int, vocab_size: int, max_sequence_length: int, embedding_dropout_prob: float,
                 init_method: InitMethod, num_tokentypes: int = 0) -> None:
        super().__init__()
        args = get_args()
        self.hidden_size = hidden_size
        self.init_method = init_method
        self.num_tokentypes = num_tokentypes
        self.params_dtype = args.params_dtype
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            vocab_size, hidden_size, init_method=init_method, params_dtype=args.params_dtype,
            use_cpu_initialization=bool(args.use_cpu_initialization))
        self._word_embeddings_key = "word_embeddings"
        self.position_embeddings = torch.nn.Embedding(max_sequence_length, hidden_size, dtype=args.params_dtype)
        self._position_embeddings_key = "position_embeddings"
        init_method(self.position_embeddings.weight)
        self._tokentype_embeddings_key = "tokentype_embeddings"
        self.tokentype_embeddings = None
        if num_tokentypes > 0:
            self.tokentype_embeddings = torch.nn.Embedding(num_tokentypes, hidden_size, dtype=args.params_dtype)
            init_method(self.tokentype_embeddings.weight)
        self.fp32_residual_connection = args.fp32_residual_connection
        self.sequence_parallel = _sequence_parallel(args)
        self.embedding_dropout = torch.nn.Dropout(embedding_dropout_prob)

    def zero_parameters(self) -> None:
        """Zero every table and mark it ``shared`` (a pipeline copy that another stage fills in)."""
        for emb in (self.word_embeddings, self.position_embeddings, self.tokentype_embeddings):
            if emb is not None:
                emb.weight.data.fill_(0)
                emb.weight.shared = True

    def add_tokentype_embeddings(self, num_tokentypes: int) -> None:
        """Add a token-type table to a model built without one (e.g. loaded from a checkpoint)."""
        if self.tokentype_embeddings is not None:
            raise RuntimeError("tokentype embeddings is already initialized")
        if not isinstance(num_tokentypes, int) or num_tokentypes <= 0:
            raise ValueError(f"num_tokentypes must be a positive int, got {num_tokentypes!r}")
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"adding embedding for {num_tokentypes} tokentypes", flush=True)
        self.num_tokentypes = num_tokentypes
        self.tokentype_embeddings = torch.nn.Embedding(num_tokentypes, self.hidden_size, dtype=self.params_dtype,
                                                       device=self.position_embeddings.weight.device)
        self.init_method(self.tokentype_embeddings.weight)

    def forward(self, input_ids: Tensor, position_ids: Tensor, tokentype_ids: Tensor | None = None) -> Tensor:
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        if tokentype_ids is not None:
            if self.tokentype_embeddings is None:
                raise ValueError("tokentype_ids given but the embedding has no token-type table (num_tokentypes=0)")
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids)
        elif self.tokentype_embeddings is not None:
            raise ValueError("the embedding has a token-type table: pass tokentype_ids")
        embeddings = embeddings.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.fp32_residual_connection:
            embeddings = embeddings.float()
        if self.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.embedding_dropout(embeddings)
        return self.embedding_dropout(embeddings)


class TransformerLanguageModel(MegatronModule):
    """Embedding (first stage), encoder and/or decoder ``ParallelTransformer``, pooler (last stage).

    Args:
        init_method, output_layer_init_method: weight initializers.
        encoder_attn_mask_type: ``AttnMaskType`` of the encoder's self-attention.
        num_tokentypes: token-type rows of the embedding.
        add_encoder, add_decoder: which stacks this chunk holds (encoder-decoder pipelines split them).
        decoder_attn_mask_type: ``AttnMaskType`` of the decoder's self-attention.
        add_pooler: pool the first token on the last stage.
        pre_process, post_process: this chunk is the first / last pipeline stage.

    ``forward(enc_input_ids, enc_position_ids, enc_attn_mask, ...)`` returns the encoder output
    ``[s, b, h]`` (with the pooled ``[b, h]`` when pooling); with a decoder,
    ``(decoder_output, encoder_output[, pooled])``.
    """

    def __init__(self, init_method: InitMethod, output_layer_init_method: InitMethod,
                 encoder_attn_mask_type: AttnMaskType, num_tokentypes: int = 0, add_encoder: bool = True,
                 add_decoder: bool = False, decoder_attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 add_pooler: bool = False, pre_process: bool = True, post_process: bool = True) -> None:
        super().__init__()
        args = get_args()
        if getattr(args, "padded_vocab_size", None) is None:
            raise ValueError("args.padded_vocab_size is not set: set it on get_args() before building the model")
        self.pre_process = pre_process
        self.post_process = post_process
        self.hidden_size = args.hidden_size
        self.num_tokentypes = num_tokentypes
        self.init_method = init_method
        self.add_encoder = add_encoder
        self.encoder_attn_mask_type = encoder_attn_mask_type
        self.add_decoder = add_decoder
        self.decoder_attn_mask_type = decoder_attn_mask_type
        self.add_pooler = add_pooler
        self.encoder_hidden_state = None

        if pre_process:
            self.embedding = Embedding(self.hidden_size, args.padded_vocab_size, args.max_position_embeddings,
                                       args.hidden_dropout, init_method, num_tokentypes)
            self._embedding_key = "embedding"
        self.encoder = None
        if add_encoder:
            self.encoder = ParallelTransformer(init_method, output_layer_init_method,
                                               self_attn_mask_type=encoder_attn_mask_type,
                                               pre_process=pre_process, post_process=post_process)
            self._encoder_key = "encoder"
        self.decoder = None
        if add_decoder:
            self.decoder = ParallelTransformer(init_method, output_layer_init_method, layer_type=LayerType.decoder,
                                               self_attn_mask_type=decoder_attn_mask_type,
                                               pre_process=pre_process, post_process=post_process)
            self._decoder_key = "decoder"
        if post_process and add_pooler:
            self.pooler = Pooler(self.hidden_size, init_method)
            self._pooler_key = "pooler"

    def set_input_tensor(self, input_tensor: Tensor | list[Tensor | None] | None) -> None:
        """Route the pipeline's received activation(s) to the encoder or decoder."""
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        if self.add_encoder:
            if len(input_tensor) != 1:
                raise ValueError(f"input_tensor should only be length 1 for a stage with an encoder, "
                                 f"got {len(input_tensor)}")
            self.encoder.set_input_tensor(input_tensor[0])
        elif self.add_decoder:
            if len(input_tensor) == 2:
                self.decoder.set_input_tensor(input_tensor[0])
                self.encoder_hidden_state = input_tensor[1]
            elif len(input_tensor) == 1:
                self.decoder.set_input_tensor(None)
                self.encoder_hidden_state = input_tensor[0]
            else:
                raise ValueError(f"input_tensor must have either length 1 or 2, got {len(input_tensor)}")
        else:
            raise RuntimeError("Stage must have at least either encoder or decoder")

    def forward(self, enc_input_ids: Tensor | None, enc_position_ids: Tensor | None, enc_attn_mask: Tensor | None,
                dec_input_ids: Tensor | None = None, dec_position_ids: Tensor | None = None,
                dec_attn_mask: Tensor | None = None, enc_dec_attn_mask: Tensor | None = None,
                tokentype_ids: Tensor | None = None, inference_params: Any = None, pooling_sequence_index: int = 0,
                enc_hidden_states: Tensor | None = None, output_enc_hidden: bool = False):
        encoder_input = None
        if self.pre_process:
            encoder_input = self.embedding(enc_input_ids, enc_position_ids, tokentype_ids=tokentype_ids)
        if enc_hidden_states is not None:
            encoder_output = enc_hidden_states if encoder_input is None else enc_hidden_states.to(encoder_input.dtype)
        elif self.encoder is not None:
            encoder_output = self.encoder(encoder_input, enc_attn_mask, inference_params=inference_params)
        else:
            encoder_output = self.encoder_hidden_state
        pooled_output = None
        if self.post_process and self.add_pooler:
            pooled_output = self.pooler(encoder_output, pooling_sequence_index)
        if not self.add_decoder or output_enc_hidden:
            return (encoder_output, pooled_output) if pooled_output is not None else encoder_output

        decoder_input = self.embedding(dec_input_ids, dec_position_ids) if self.pre_process else None
        decoder_output = self.decoder(decoder_input, dec_attn_mask, encoder_output=encoder_output,
                                      enc_dec_attn_mask=enc_dec_attn_mask, inference_params=inference_params)
        if pooled_output is not None:
            return decoder_output, encoder_output, pooled_output
        return decoder_output, encoder_output


def get_language_model(num_tokentypes: int, add_pooler: bool, encoder_attn_mask_type: AttnMaskType,
                       init_method: InitMethod | None = None, scaled_init_method: InitMethod | None = None,
                       add_encoder: bool = True, add_decoder: bool = False,
                       decoder_attn_mask_type: AttnMaskType = AttnMaskType.causal, pre_process: bool = True,
                       post_process: bool = True) -> tuple[TransformerLanguageModel, str]:
    """Build a ``TransformerLanguageModel`` (initializers default to N(0, init_method_std) and its scaled
    form) and return it with its checkpoint key ``"language_model"``."""
    args = get_args()
    if init_method is None:
        init_method = init_method_normal(args.init_method_std)
    if scaled_init_method is None:
        scaled_init_method = scaled_init_method_normal(args.init_method_std, args.num_layers)
    language_model = TransformerLanguageModel(
        init_method, scaled_init_method, encoder_attn_mask_type, num_tokentypes=num_tokentypes,
        add_encoder=add_encoder, add_decoder=add_decoder, decoder_attn_mask_type=decoder_attn_mask_type,
        add_pooler=add_pooler, pre_process=pre_process, post_process=post_process)
    return language_model, "language_model"


def _forward_context(cpu_offload: bool) -> Callable[[], Any]:
    """A factory of ``torch.autograd.graph.save_on_cpu`` (saved activations kept in host memory) or of a
    no-op context."""
    if cpu_offload:
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    return contextlib.nullcontext
