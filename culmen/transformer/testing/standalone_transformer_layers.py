"""The Megatron transformer blocks of Apex's standalone test models, on culmen's parallel layers.

Re-exported by :mod:`culmen.transformer.testing.standalone_transformer_lm` (the module Apex's tests
import); kept apart only to keep each file short. Layout conventions (Megatron's): activations are
``[s, b, h]`` (sequence first); under sequence parallelism each tensor-parallel (TP) rank holds
``[s / tp, b, h]`` between the blocks; the attention and MLP weights are split over the TP ranks by
``ColumnParallelLinear`` / ``RowParallelLinear``; masks are bool, **True where attention is masked
out**. Every size and switch comes from :func:`culmen.transformer.testing.global_vars.get_args`.

Differences from Apex's version (each where Apex was wrong or CUDA-only):

* ``param_is_not_shared`` returns True for parameters *not* marked ``shared`` (Apex returned the flag).
* Buffers are allocated on the activations' device (Apex used the current CUDA device), so the models
  run on CPU (gloo) as well.
* Sequence parallelism is switched on only when the TP group has more than one rank (Apex passed the
  flag through and the layers warned on one rank).
* ``no_async_tensor_model_parallel_allreduce`` is forced with sequence parallelism even when the
  arguments were edited after parsing (the layers refuse the combination).
* The weights are created in ``args.params_dtype`` (layer norms included) and honour
  ``args.use_cpu_initialization`` and ``args.gradient_accumulation_fusion`` in every linear layer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from culmen.transformer import parallel_state, tensor_parallel
from culmen.transformer.enums import AttnMaskType, AttnType, LayerType, ModelType
from culmen.transformer.functional import FusedScaleMaskSoftmax
from culmen.transformer.layers import FusedLayerNorm as LayerNorm
from culmen.transformer.testing.global_vars import get_args
from culmen.transformer.utils import divide

__all__ = [
    "CoreAttention",
    "MegatronModule",
    "NoopTransformerLayer",
    "ParallelAttention",
    "ParallelMLP",
    "ParallelTransformer",
    "ParallelTransformerLayer",
    "attention_mask_func",
    "bias_dropout_add",
    "erf_gelu",
    "get_bias_dropout_add",
    "get_linear_layer",
    "get_num_layers",
    "init_method_normal",
    "openai_gelu",
    "param_is_not_shared",
    "scaled_init_method_normal",
]

InitMethod = Callable[[Tensor], Any]


def param_is_not_shared(param: Tensor) -> bool:
    """True unless ``param`` is marked ``shared`` (a copy of another stage's embedding)."""
    return not getattr(param, "shared", False)


def _sequence_parallel(args) -> bool:
    return bool(args.sequence_parallel) and parallel_state.get_tensor_model_parallel_world_size() > 1


def _linear_kwargs(args) -> dict:
    """Keyword arguments every tensor-parallel linear of the model shares."""
    return {"params_dtype": args.params_dtype, "use_cpu_initialization": bool(args.use_cpu_initialization),
            "gradient_accumulation_fusion": bool(args.gradient_accumulation_fusion),
            "sequence_parallel_enabled": _sequence_parallel(args)}


def _no_async_allreduce(args) -> bool:
    return not args.async_tensor_model_parallel_allreduce or _sequence_parallel(args)


class MegatronModule(torch.nn.Module):
    """``nn.Module`` with Megatron's pipeline hooks: the word-embedding weight shared by the first stage
    (input embedding) and the last stage (output logits).

    Args:
        share_word_embeddings: the last stage computes logits with the input embedding's weight.
    """

    def __init__(self, share_word_embeddings: bool = True) -> None:
        super().__init__()
        self.share_word_embeddings = share_word_embeddings

    def state_dict_for_save_checkpoint(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The state dict saved in checkpoints (the plain ``state_dict`` unless a model overrides it)."""
        return self.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def word_embeddings_weight(self) -> Tensor:
        """The ``(vocab / tp, h)`` word-embedding weight this stage holds: the input embedding's on the
        first stage, the last stage's copy (``self.word_embeddings``) elsewhere."""
        if self.pre_process:
            return self.language_model.embedding.word_embeddings.weight
        if not self.share_word_embeddings:
            raise RuntimeError("word_embeddings_weight() called for last stage, but share_word_embeddings is false")
        return self.word_embeddings.weight

    def initialize_word_embeddings(self, init_method_normal: Callable[[float], InitMethod]) -> None:
        """With more than one pipeline stage, give the last stage a copy of the word embeddings (zeroed,
        then all-reduced over the embedding group so it equals the first stage's).

        The copy is marked ``shared``; the training loop must all-reduce the two copies' gradients over
        ``parallel_state.get_embedding_group()`` so both stay equal. With an encoder-decoder split, the
        decoder's position embeddings are synchronized with the encoder's as well.
        """
        args = get_args()
        if not self.share_word_embeddings:
            raise RuntimeError("initialize_word_embeddings() was called but share_word_embeddings is false")
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return
        if parallel_state.is_pipeline_last_stage() and not self.pre_process:
            if parallel_state.is_pipeline_first_stage():
                raise RuntimeError("a one-stage pipeline chunk without pre_process cannot hold the logits")
            self._word_embeddings_for_head_key = "word_embeddings_for_head"
            self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
                args.padded_vocab_size, args.hidden_size, init_method=init_method_normal(args.init_method_std),
                params_dtype=args.params_dtype, use_cpu_initialization=bool(args.use_cpu_initialization))
            # Zero so the all-reduce below copies the first stage's values.
            self.word_embeddings.weight.data.fill_(0)
            self.word_embeddings.weight.shared = True
        if not parallel_state.is_pipeline_first_stage(ignore_virtual=True) and self.pre_process:
            # The decoder's embedding of an encoder-decoder split: it takes the encoder's values below.
            self.language_model.embedding.zero_parameters()
        if not dist.is_initialized():
            print("WARNING! Distributed processes aren't initialized, so word embeddings in the last layer are "
                  "not initialized. If you are just manipulating a model this is fine, but this needs to be "
                  "handled manually. If you are training something is definitely wrong.", flush=True)
            return
        if parallel_state.is_rank_in_embedding_group():
            dist.all_reduce(self.word_embeddings_weight().data, group=parallel_state.get_embedding_group())
        if (parallel_state.is_rank_in_position_embedding_group() and self.pre_process
                and args.pipeline_model_parallel_split_rank is not None):
            dist.all_reduce(self.language_model.embedding.position_embeddings.weight.data,
                            group=parallel_state.get_position_embedding_group())


def get_linear_layer(rows: int, columns: int, init_method: InitMethod) -> torch.nn.Linear:
    """A replicated ``nn.Linear(rows, columns)`` in ``args.params_dtype`` (when global arguments are set),
    weight from ``init_method``, bias zero."""
    try:
        dtype = get_args().params_dtype
    except RuntimeError:
        dtype = None
    layer = torch.nn.Linear(rows, columns, dtype=dtype)
    init_method(layer.weight)
    with torch.no_grad():
        layer.bias.zero_()
    return layer


def attention_mask_func(attention_scores: Tensor, attention_mask: Tensor) -> Tensor:
    """Scores with masked positions (``attention_mask`` True) set to -10000 (out of place)."""
    return attention_scores.masked_fill(attention_mask, -10000.0)


def init_method_normal(sigma: float) -> InitMethod:
    """An init method drawing from N(0, sigma)."""

    def init_(tensor: Tensor) -> Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> InitMethod:
    """An init method drawing from N(0, sigma / sqrt(2 * num_layers)) (the residual output projections)."""
    std = sigma / math.sqrt(2.0 * num_layers)

    def init_(tensor: Tensor) -> Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def openai_gelu(x: Tensor) -> Tensor:
    """OpenAI's tanh approximation of GeLU."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))


def erf_gelu(x: Tensor) -> Tensor:
    """GeLU through ``erf`` with Megatron's ONNX-safe constant (``1.41421``)."""
    return x * 0.5 * (torch.erf(x / 1.41421).to(dtype=x.dtype) + 1.0)


def _activation(args) -> Callable[[Tensor], Tensor]:
    if args.openai_gelu:
        return openai_gelu
    if args.onnx_safe:
        return erf_gelu
    return F.gelu


class ParallelMLP(MegatronModule):
    """``h -> ffn_hidden_size -> h`` MLP: a column-parallel projection, GeLU, a row-parallel projection.

    ``forward(hidden_states [s, b, h])`` returns ``(output [s, b, h], output_bias [h])``: the bias of the
    second projection is returned unadded so the caller fuses it with dropout and the residual.
    """

    def __init__(self, init_method: InitMethod, output_layer_init_method: InitMethod) -> None:
        super().__init__()
        args = get_args()
        common = _linear_kwargs(args)
        self.dense_h_to_4h = tensor_parallel.ColumnParallelLinear(
            args.hidden_size, args.ffn_hidden_size, gather_output=False, init_method=init_method, skip_bias_add=True,
            no_async_tensor_model_parallel_allreduce=_no_async_allreduce(args), **common)
        self.bias_gelu_fusion = args.bias_gelu_fusion
        self.activation_func = _activation(args)
        self.dense_4h_to_h = tensor_parallel.RowParallelLinear(
            args.ffn_hidden_size, args.hidden_size, input_is_parallel=True, init_method=output_layer_init_method,
            skip_bias_add=True, **common)

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        intermediate, bias = self.dense_h_to_4h(hidden_states)
        intermediate = self.activation_func(intermediate + bias)
        return self.dense_4h_to_h(intermediate)


class CoreAttention(MegatronModule):
    """``softmax(q k^T / sqrt(hn)) v`` over this TP rank's heads, with culmen's ``FusedScaleMaskSoftmax``.

    Args:
        layer_number: 1-based layer index; with ``apply_query_key_layer_scaling`` the scores are divided
            by it before the (fp32) softmax multiplies it back, which keeps fp16 scores in range.
        attn_mask_type: ``AttnMaskType.padding`` or ``AttnMaskType.causal``.

    ``forward(query [sq, b, np, hn], key [sk, b, np, hn], value [sk, b, np, hn], attention_mask)``, the
    mask bool ``[b or 1, 1, sq, sk]`` True where masked, returns the context ``[sq, b, np * hn]``.
    """

    def __init__(self, layer_number: int, attn_mask_type: AttnMaskType = AttnMaskType.padding) -> None:
        super().__init__()
        args = get_args()
        self.fp16 = args.fp16
        self.bf16 = args.bf16
        self.apply_query_key_layer_scaling = args.apply_query_key_layer_scaling
        self.attention_softmax_in_fp32 = args.attention_softmax_in_fp32 or self.apply_query_key_layer_scaling
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.sequence_parallel = _sequence_parallel(args)
        projection_size = args.kv_channels * args.num_attention_heads
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, args.num_attention_heads)
        self.num_attention_heads_per_partition = divide(args.num_attention_heads, world_size)
        coeff = None
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        if self.apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.norm_factor *= coeff
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            self.fp16, self.bf16, self.attn_mask_type, args.masked_softmax_fusion, attention_mask_func,
            self.attention_softmax_in_fp32, coeff)
        self.attention_dropout = torch.nn.Dropout(args.attention_dropout)

    def forward(self, query_layer: Tensor, key_layer: Tensor, value_layer: Tensor,
                attention_mask: Tensor | None) -> Tensor:
        sq, b, np_, hn = query_layer.shape
        sk = key_layer.size(0)
        q = query_layer.reshape(sq, b * np_, hn).transpose(0, 1)  # [b*np, sq, hn]
        k = key_layer.reshape(sk, b * np_, hn).permute(1, 2, 0)  # [b*np, hn, sk]
        # beta=0 ignores the uninitialized buffer; the scale rides on the GEMM.
        scores = torch.baddbmm(torch.empty(b * np_, sq, sk, dtype=q.dtype, device=q.device), q, k,
                               beta=0.0, alpha=1.0 / self.norm_factor)
        probs = self.scale_mask_softmax(scores.view(b, np_, sq, sk), attention_mask)
        if self.sequence_parallel:
            # The whole transformer already runs under the tracker's fork with sequence parallelism.
            probs = self.attention_dropout(probs)
        else:
            # Each TP rank holds different heads: draw their dropout from the per-rank stream.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        v = value_layer.reshape(sk, b * np_, hn).transpose(0, 1)  # [b*np, sk, hn]
        context = torch.bmm(probs.view(b * np_, sq, sk), v)  # [b*np, sq, hn]
        return context.view(b, np_, sq, hn).permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


class ParallelAttention(MegatronModule):
    """Self- or cross-attention: fused QKV (or Q and KV) column-parallel projection, ``CoreAttention``,
    row-parallel output projection.

    Args:
        init_method, output_layer_init_method: initializers of the input and output projections.
        layer_number: 1-based layer index (query-key scaling, inference cache key).
        attention_type: ``AttnType.self_attn`` or ``AttnType.cross_attn`` (keys/values from
            ``encoder_output``).
        attn_mask_type: ``AttnMaskType.padding`` or ``AttnMaskType.causal``.

    ``forward(hidden_states [sq, b, h], attention_mask, encoder_output=None, inference_params=None)``
    returns ``(output [sq, b, h], bias [h])`` (bias unadded). With ``inference_params`` the keys and
    values are cached per layer and the attention covers every cached position.
    """

    def __init__(self, init_method: InitMethod, output_layer_init_method: InitMethod, layer_number: int,
                 attention_type: AttnType = AttnType.self_attn,
                 attn_mask_type: AttnMaskType = AttnMaskType.padding) -> None:
        super().__init__()
        args = get_args()
        self.layer_number = max(1, layer_number)
        self.attention_type = attention_type
        self.attn_mask_type = attn_mask_type
        self.params_dtype = args.params_dtype
        projection_size = args.kv_channels * args.num_attention_heads
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.hidden_size_per_attention_head = divide(projection_size, args.num_attention_heads)
        self.num_attention_heads_per_partition = divide(args.num_attention_heads, world_size)
        common = _linear_kwargs(args)
        no_async = _no_async_allreduce(args)
        if attention_type == AttnType.self_attn:
            self.query_key_value = tensor_parallel.ColumnParallelLinear(
                args.hidden_size, 3 * projection_size, gather_output=False, init_method=init_method,
                no_async_tensor_model_parallel_allreduce=no_async, **common)
        elif attention_type == AttnType.cross_attn:
            self.query = tensor_parallel.ColumnParallelLinear(
                args.hidden_size, projection_size, gather_output=False, init_method=init_method,
                no_async_tensor_model_parallel_allreduce=no_async, **common)
            self.key_value = tensor_parallel.ColumnParallelLinear(
                args.hidden_size, 2 * projection_size, gather_output=False, init_method=init_method,
                no_async_tensor_model_parallel_allreduce=no_async, **common)
        else:
            raise ValueError(f"attention_type must be an AttnType, got {attention_type!r}")
        self.core_attention = CoreAttention(self.layer_number, self.attn_mask_type)
        self.checkpoint_core_attention = args.recompute_granularity == "selective"
        self.dense = tensor_parallel.RowParallelLinear(
            projection_size, args.hidden_size, input_is_parallel=True, init_method=output_layer_init_method,
            skip_bias_add=True, **common)

    def _checkpointed_attention_forward(self, query_layer, key_layer, value_layer, attention_mask):
        """``core_attention`` recomputed in backward (selective recompute)."""
        return tensor_parallel.checkpoint(self.core_attention, False, query_layer, key_layer, value_layer,
                                          attention_mask)

    def _allocate_memory(self, inference_max_sequence_len: int, batch_size: int, device) -> Tensor:
        return torch.empty(inference_max_sequence_len, batch_size, self.num_attention_heads_per_partition,
                           self.hidden_size_per_attention_head, dtype=self.params_dtype, device=device)

    def _split_heads(self, x: Tensor, parts: int) -> tuple[Tensor, ...]:
        x = x.view(*x.shape[:-1], self.num_attention_heads_per_partition, parts * self.hidden_size_per_attention_head)
        return tensor_parallel.split_tensor_along_last_dim(x, parts) if parts > 1 else (x,)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None, encoder_output: Tensor | None = None,
                inference_params: Any = None) -> tuple[Tensor, Tensor]:
        if self.attention_type == AttnType.self_attn:
            mixed, _ = self.query_key_value(hidden_states)
            query_layer, key_layer, value_layer = self._split_heads(mixed, 3)
        else:
            if encoder_output is None:
                raise ValueError("cross attention needs encoder_output")
            mixed_kv, _ = self.key_value(encoder_output)
            key_layer, value_layer = self._split_heads(mixed_kv, 2)
            query, _ = self.query(hidden_states)
            (query_layer,) = self._split_heads(query, 1)

        if inference_params:
            memory = inference_params.key_value_memory_dict
            if self.layer_number not in memory:
                memory[self.layer_number] = tuple(
                    self._allocate_memory(inference_params.max_sequence_len, inference_params.max_batch_size,
                                          hidden_states.device) for _ in range(2))
            key_memory, value_memory = memory[self.layer_number]
            b0 = inference_params.batch_size_offset
            b1 = b0 + key_layer.size(1)
            s0 = inference_params.sequence_len_offset
            s1 = s0 + key_layer.size(0)
            if b1 > key_memory.size(1) or s1 > key_memory.size(0):
                raise ValueError(f"inference cache overflow: batch {b1} > {key_memory.size(1)} or sequence "
                                 f"{s1} > {key_memory.size(0)}")
            key_memory[s0:s1, b0:b1] = key_layer
            value_memory[s0:s1, b0:b1] = value_layer
            key_layer = key_memory[:s1, b0:b1]
            value_layer = value_memory[:s1, b0:b1]

        if self.checkpoint_core_attention and self.training:
            context = self._checkpointed_attention_forward(query_layer, key_layer, value_layer, attention_mask)
        else:
            context = self.core_attention(query_layer, key_layer, value_layer, attention_mask)
        return self.dense(context)


def bias_dropout_add(x: Tensor, bias: Tensor | None, residual: Tensor, prob: float, training: bool) -> Tensor:
    """``residual + dropout(x + bias)``."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=training)


def get_bias_dropout_add(training: bool) -> Callable[[Tensor, Tensor | None, Tensor, float], Tensor]:
    """``bias_dropout_add`` with ``training`` bound."""

    def _bias_dropout_add(x, bias, residual, prob):
        return bias_dropout_add(x, bias, residual, prob, training)

    return _bias_dropout_add


class ParallelTransformerLayer(MegatronModule):
    """One pre-LN transformer layer: LN, attention, bias-dropout-add, (LN, cross-attention,
    bias-dropout-add for decoders), LN, MLP, bias-dropout-add.

    Args:
        init_method, output_layer_init_method: weight initializers.
        layer_number: 1-based global layer index.
        layer_type: ``LayerType.encoder`` or ``LayerType.decoder`` (adds cross-attention).
        self_attn_mask_type: ``AttnMaskType`` of the self-attention.
        drop_path_rate: stochastic depth; only 0 is supported (as in Apex).

    ``forward(hidden_states [s, b, h], attention_mask, encoder_output=None, enc_dec_attn_mask=None,
    inference_params=None)`` returns ``[s, b, h]`` (``[s / tp, b, h]`` in and out with sequence
    parallelism).
    """

    def __init__(self, init_method: InitMethod, output_layer_init_method: InitMethod, layer_number: int,
                 layer_type: LayerType = LayerType.encoder, self_attn_mask_type: AttnMaskType = AttnMaskType.padding,
                 drop_path_rate: float = 0.0) -> None:
        super().__init__()
        args = get_args()
        if drop_path_rate > 0.0:
            raise ValueError(f"drop_path_rate > 0 is not supported (as in Apex), got {drop_path_rate}")
        if args.num_experts is not None:
            raise ValueError(f"num_experts (Switch MLP) is not supported (as in Apex), got {args.num_experts}")
        self.layer_number = layer_number
        self.layer_type = layer_type
        self.apply_residual_connection_post_layernorm = args.apply_residual_connection_post_layernorm
        self.bf16 = args.bf16
        self.fp32_residual_connection = args.fp32_residual_connection
        sp = _sequence_parallel(args)

        def norm():
            return LayerNorm(args.hidden_size, eps=args.layernorm_epsilon, sequence_parallel_enabled=sp,
                             dtype=args.params_dtype)

        self.input_layernorm = norm()
        self.self_attention = ParallelAttention(init_method, output_layer_init_method, layer_number,
                                                attention_type=AttnType.self_attn, attn_mask_type=self_attn_mask_type)
        self.hidden_dropout = args.hidden_dropout
        self.bias_dropout_fusion = args.bias_dropout_fusion
        self.drop_path = None
        self.post_attention_layernorm = norm()
        if layer_type == LayerType.decoder:
            self.inter_attention = ParallelAttention(init_method, output_layer_init_method, layer_number,
                                                     attention_type=AttnType.cross_attn)
            self.post_inter_attention_layernorm = norm()
        self.mlp = ParallelMLP(init_method, output_layer_init_method)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None, encoder_output: Tensor | None = None,
                enc_dec_attn_mask: Tensor | None = None, inference_params: Any = None) -> Tensor:
        bda = get_bias_dropout_add(self.training)
        post_ln = self.apply_residual_connection_post_layernorm

        ln_out = self.input_layernorm(hidden_states)
        attn_out, attn_bias = self.self_attention(ln_out, attention_mask, inference_params=inference_params)
        ln_in = bda(attn_out, attn_bias, ln_out if post_ln else hidden_states, self.hidden_dropout)
        ln_out = self.post_attention_layernorm(ln_in)

        if self.layer_type == LayerType.decoder:
            attn_out, attn_bias = self.inter_attention(ln_out, enc_dec_attn_mask, encoder_output=encoder_output)
            ln_in = bda(attn_out, attn_bias, ln_out if post_ln else ln_in, self.hidden_dropout)
            ln_out = self.post_inter_attention_layernorm(ln_in)

        mlp_out, mlp_bias = self.mlp(ln_out)
        return bda(mlp_out, mlp_bias, ln_out if post_ln else ln_in, self.hidden_dropout)


class NoopTransformerLayer(MegatronModule):
    """A layer that returns a copy of its input: stands in on a standalone-embedding stage with no
    transformer layers, so the stage output is not its input tensor (which the pipeline may free)."""

    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, encoder_output=None,
                enc_dec_attn_mask=None, inference_params=None) -> Tensor:
        return hidden_states.clone()


def get_num_layers(args, is_encoder_and_decoder_model: bool) -> int:
    """Transformer layers on this pipeline rank (before the split into virtual chunks).

    Raises:
        ValueError: ``num_layers`` does not divide by the ranks that share it.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() <= 1:
        return args.num_layers
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    standalone = bool(args.standalone_embedding_stage)
    # From parallel_state, not from the parsed arguments: tests size the pipeline after parsing.
    transformer_pp = parallel_state.get_pipeline_model_parallel_world_size() - (1 if standalone else 0)
    if is_encoder_and_decoder_model:
        split = args.pipeline_model_parallel_split_rank
        if split is None:
            raise ValueError("an encoder-decoder model needs pipeline_model_parallel_split_rank")
        # A standalone embedding stage takes one of the encoder's ranks; the split rank stays put.
        enc_ranks = split - 1 if standalone else split
        dec_ranks = transformer_pp - enc_ranks
        for what, ranks in (("encoder", enc_ranks), ("decoder", dec_ranks)):
            if ranks <= 0 or args.num_layers % ranks != 0:
                raise ValueError(f"num_layers ({args.num_layers}) must be divisible by number of ranks given to "
                                 f"{what} ({ranks})")
        if parallel_state.is_pipeline_stage_before_split():
            return 0 if standalone and pp_rank == 0 else args.num_layers // enc_ranks
        return args.num_layers // dec_ranks
    if args.num_layers % transformer_pp != 0:
        raise ValueError(f"num_layers ({args.num_layers}) must be divisible by "
                         f"transformer_pipeline_model_parallel_size ({transformer_pp})")
    return 0 if standalone and pp_rank == 0 else args.num_layers // transformer_pp


class ParallelTransformer(MegatronModule):
    """This pipeline chunk's stack of ``ParallelTransformerLayer`` (and the final LN on the last stage).

    Args:
        init_method, output_layer_init_method: weight initializers.
        layer_type: ``LayerType.encoder`` or ``LayerType.decoder``.
        self_attn_mask_type: ``AttnMaskType`` of the layers' self-attention.
        post_layer_norm: add the final LN when ``post_process``.
        pre_process: this chunk is the first (reads ``forward``'s ``hidden_states``); otherwise the
            input comes from ``set_input_tensor`` (the pipeline's received activation).
        post_process: this chunk is the last.
        drop_path_rate: only 0 (see ``ParallelTransformerLayer``).

    Layers are numbered globally (1-based) from this chunk's pipeline (and virtual) rank; recompute
    follows ``args.recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers``.
    ``forward(hidden_states [s, b, h], attention_mask, encoder_output=None, enc_dec_attn_mask=None,
    inference_params=None)`` returns ``[s, b, h]``.
    """

    def __init__(self, init_method: InitMethod, output_layer_init_method: InitMethod,
                 layer_type: LayerType = LayerType.encoder, self_attn_mask_type: AttnMaskType = AttnMaskType.padding,
                 post_layer_norm: bool = True, pre_process: bool = True, post_process: bool = True,
                 drop_path_rate: float = 0.0) -> None:
        super().__init__()
        args = get_args()
        self.layer_type = layer_type
        self.model_type = getattr(args, "model_type", None) or ModelType.encoder_or_decoder
        self.bf16 = args.bf16
        self.fp32_residual_connection = args.fp32_residual_connection
        self.post_layer_norm = post_layer_norm
        self.pre_process = pre_process
        self.post_process = post_process
        self.input_tensor = None
        self.drop_path_rate = drop_path_rate
        self.recompute_granularity = args.recompute_granularity
        self.recompute_method = args.recompute_method
        self.recompute_num_layers = args.recompute_num_layers
        self.sequence_parallel = _sequence_parallel(args)
        self.distribute_saved_activations = bool(args.distribute_saved_activations) and not self.sequence_parallel
        if self.recompute_granularity == "full" and self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_method must be 'uniform' or 'block' with full recompute, "
                             f"got {self.recompute_method!r}")

        enc_dec = self.model_type == ModelType.encoder_and_decoder
        self.num_layers = get_num_layers(args, enc_dec)
        vpp = (parallel_state.get_virtual_pipeline_model_parallel_world_size()
               or args.virtual_pipeline_model_parallel_size)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        if vpp is not None and parallel_state.get_pipeline_model_parallel_world_size() > 1:
            if args.num_layers % vpp != 0:
                raise ValueError(f"num_layers ({args.num_layers}) must be divisible by "
                                 f"virtual_pipeline_model_parallel_size ({vpp})")
            if enc_dec:
                raise ValueError("the interleaved schedule does not support encoder-decoder models")
            # Chunk v of stage p holds layers [v * L / vpp + p * n, ... + n), n = L / (pp * vpp).
            self.num_layers //= vpp
            offset = (parallel_state.get_virtual_pipeline_model_parallel_rank() * (args.num_layers // vpp)
                      + pp_rank * self.num_layers)
        elif enc_dec and parallel_state.get_pipeline_model_parallel_world_size() > 1:
            first_rank = 0 if layer_type == LayerType.encoder else args.pipeline_model_parallel_split_rank
            offset = (pp_rank - first_rank) * self.num_layers
        else:
            offset = pp_rank * self.num_layers

        if self.num_layers == 0:
            self.num_layers = 1
            self.layers = torch.nn.ModuleList([NoopTransformerLayer(1)])
        else:
            self.layers = torch.nn.ModuleList([
                ParallelTransformerLayer(init_method, output_layer_init_method, i + 1 + offset, layer_type=layer_type,
                                         self_attn_mask_type=self_attn_mask_type)
                for i in range(self.num_layers)])
        if self.post_process and self.post_layer_norm:
            self.final_layernorm = LayerNorm(args.hidden_size, eps=args.layernorm_epsilon,
                                             sequence_parallel_enabled=self.sequence_parallel, dtype=args.params_dtype)

    def _get_layer(self, layer_number: int) -> torch.nn.Module:
        return self.layers[layer_number]

    def _run_layers(self, start: int, end: int):
        def run(hidden_states, attention_mask, encoder_output, enc_dec_attn_mask):
            for index in range(start, end):
                hidden_states = self.layers[index](hidden_states, attention_mask, encoder_output, enc_dec_attn_mask)
            return hidden_states

        return run

    def _checkpointed_forward(self, hidden_states, attention_mask, encoder_output, enc_dec_attn_mask):
        """The layers with full activation recompute (``uniform``: every group of ``recompute_num_layers``
        layers; ``block``: the first ``recompute_num_layers`` layers one by one)."""
        inputs = (attention_mask, encoder_output, enc_dec_attn_mask)
        n = self.recompute_num_layers
        if self.recompute_method == "uniform":
            for start in range(0, self.num_layers, n):
                hidden_states = tensor_parallel.checkpoint(
                    self._run_layers(start, min(start + n, self.num_layers)), self.distribute_saved_activations,
                    hidden_states, *inputs)
        else:
            for index in range(self.num_layers):
                if index < n:
                    hidden_states = tensor_parallel.checkpoint(
                        self._run_layers(index, index + 1), self.distribute_saved_activations, hidden_states, *inputs)
                else:
                    hidden_states = self._run_layers(index, index + 1)(hidden_states, *inputs)
        return hidden_states

    def set_input_tensor(self, input_tensor: Tensor | None) -> None:
        """The activation received from the previous pipeline stage, used instead of ``forward``'s input."""
        self.input_tensor = input_tensor

    def forward(self, hidden_states: Tensor | None, attention_mask: Tensor | None,
                encoder_output: Tensor | None = None, enc_dec_attn_mask: Tensor | None = None,
                inference_params: Any = None) -> Tensor:
        if inference_params and self.recompute_granularity is not None:
            raise ValueError("inference does not work with activation checkpointing")
        if not self.pre_process:
            hidden_states = self.input_tensor
        # With sequence parallelism each rank holds different tokens: their dropout comes from the
        # per-TP-rank stream.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.sequence_parallel else contextlib.nullcontext()
        with rng:
            if self.recompute_granularity == "full" and self.training:
                hidden_states = self._checkpointed_forward(hidden_states, attention_mask, encoder_output,
                                                           enc_dec_attn_mask)
            else:
                for layer in self.layers:
                    hidden_states = layer(hidden_states, attention_mask, encoder_output=encoder_output,
                                          enc_dec_attn_mask=enc_dec_attn_mask, inference_params=inference_params)
        if self.post_process and self.post_layer_norm:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
