"""``apex.transformer.testing.arguments``: Megatron-LM's command line, as Apex's model tests parse it.

``parse_args`` builds the parser (network size, regularization, training, initialization, learning
rate, checkpointing, mixed precision, distributed, validation, data, autoresume, biencoder, vision and
logging groups, plus ``--cpu-offload``), parses, then derives what Megatron derives: the data-parallel
size from ``RANK`` / ``WORLD_SIZE`` and the model-parallel sizes, ``params_dtype``, ``ffn_hidden_size``,
``kv_channels``, ``seq_length`` / ``encoder_seq_length``, the virtual pipeline size, the global batch
size, the weight-decay range, and the recompute settings of the deprecated flags.

Differences from Apex (each where Apex's behaviour was a bug):

* ``--no-async-tensor-model-parallel-allreduce`` turns the asynchronous all-reduce *off* (default on);
  Apex declared it ``store_true`` into ``async_tensor_model_parallel_allreduce``, so the flag did the
  opposite of its name and the default was off.
* Inconsistent arguments raise ``ValueError`` naming the values (Apex asserted).
* ``args=`` parses an explicit list instead of ``sys.argv`` (``None`` keeps Apex's behaviour).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["parse_args"]


def _bad(cond: bool, message: str) -> None:
    if cond:
        raise ValueError(message)


def parse_args(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    defaults: dict[str, Any] | None = None,
    override_args: dict[str, Any] | None = None,
    ignore_unknown_args: bool = False,
    *,
    args: list[str] | None = None,
) -> argparse.Namespace:
    """Parse Megatron's arguments and derive the dependent settings.

    Args:
        extra_args_provider: ``parser -> parser`` adding task arguments.
        defaults: ``{dest: value}`` for arguments the command line left at ``None`` (a value given on
            the command line wins, with a warning on rank 0).
        override_args: ``{dest: value}`` set right after parsing, before anything is derived.
        ignore_unknown_args: skip unknown arguments instead of exiting.
        args: the argument list (default ``sys.argv[1:]``).

    Returns:
        The namespace, with ``rank``, ``world_size``, ``data_parallel_size``, ``params_dtype`` and the
        derived sizes filled in.

    Raises:
        ValueError: inconsistent arguments (sizes that do not divide, both ``--fp16`` and ``--bf16``,
            a missing required size, deprecated arguments ...), naming the values.
    """
    defaults = defaults or {}
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    for add in (_add_network_size_args, _add_regularization_args, _add_training_args, _add_initialization_args,
                _add_learning_rate_args, _add_checkpointing_args, _add_mixed_precision_args,
                _add_distributed_args, _add_validation_args, _add_data_args, _add_autoresume_args,
                _add_biencoder_args, _add_vision_args, _add_logging_args):
        parser = add(parser)
    # Apex's switch for torch.autograd.graph.save_on_cpu() in the standalone models.
    parser.add_argument("--cpu-offload", action="store_true", default=False, help="Turns on CPU offloading")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)

    if ignore_unknown_args:
        ns, _ = parser.parse_known_args(args)
    else:
        ns = parser.parse_args(args)

    ns.rank = int(os.getenv("RANK", "0"))
    ns.world_size = int(os.getenv("WORLD_SIZE", "1"))
    for key, value in (override_args or {}).items():
        setattr(ns, key, value)
    _derive_parallel_sizes(ns)
    _drop_deprecated(ns)

    for key, value in defaults.items():
        # A default applies only to an argument the command line left unset.
        if getattr(ns, key, None) is not None:
            if ns.rank == 0:
                print(f"WARNING: overriding default arguments for {key}:{value} with {key}:{getattr(ns, key)}",
                      flush=True)
        else:
            setattr(ns, key, value)

    _derive_batch_and_dtype(ns)
    _derive_schedule(ns)
    _derive_model_sizes(ns)
    _print_args(ns)
    return ns


# ------------------------------------------------------------------------------ derivations


def _derive_parallel_sizes(ns: argparse.Namespace) -> None:
    _bad(ns.tensor_model_parallel_size < 1 or ns.pipeline_model_parallel_size < 1,
         f"tensor_model_parallel_size ({ns.tensor_model_parallel_size}) and pipeline_model_parallel_size "
         f"({ns.pipeline_model_parallel_size}) must be positive")
    ns.tensor_model_parallel_size = min(ns.tensor_model_parallel_size, ns.world_size)
    _bad(ns.world_size % ns.tensor_model_parallel_size != 0,
         f"world size ({ns.world_size}) is not divisible by tensor model parallel size "
         f"({ns.tensor_model_parallel_size})")
    ns.pipeline_model_parallel_size = min(ns.pipeline_model_parallel_size,
                                          ns.world_size // ns.tensor_model_parallel_size)
    ns.transformer_pipeline_model_parallel_size = (
        ns.pipeline_model_parallel_size - 1 if ns.standalone_embedding_stage else ns.pipeline_model_parallel_size)
    model_parallel_size = ns.pipeline_model_parallel_size * ns.tensor_model_parallel_size
    _bad(ns.world_size % model_parallel_size != 0,
         f"world size ({ns.world_size}) is not divisible by tensor parallel size ({ns.tensor_model_parallel_size}) "
         f"times pipeline parallel size ({ns.pipeline_model_parallel_size})")
    ns.data_parallel_size = ns.world_size // model_parallel_size
    if ns.rank == 0:
        print(f"using world size: {ns.world_size}, data-parallel-size: {ns.data_parallel_size}, "
              f"tensor-model-parallel size: {ns.tensor_model_parallel_size}, "
              f"pipeline-model-parallel size: {ns.pipeline_model_parallel_size} ", flush=True)
    split = ns.pipeline_model_parallel_split_rank
    _bad(ns.pipeline_model_parallel_size > 1 and split is not None and split >= ns.pipeline_model_parallel_size,
         f"split rank ({split}) needs to be less than pipeline model parallel size "
         f"({ns.pipeline_model_parallel_size})")


def _drop_deprecated(ns: argparse.Namespace) -> None:
    _bad(ns.batch_size is not None, "--batch-size argument is no longer valid, use --micro-batch-size instead")
    _bad(ns.warmup is not None, "--warmup argument is no longer valid, use --lr-warmup-fraction instead")
    _bad(ns.model_parallel_size is not None,
         "--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead")
    del ns.batch_size, ns.warmup, ns.model_parallel_size
    if ns.checkpoint_activations:
        ns.recompute_granularity = "full"
        ns.recompute_method = "uniform"
        if ns.rank == 0:
            print("--checkpoint-activations is no longer valid, use --recompute-granularity and "
                  "--recompute-method instead. Defaulting to recompute-granularity=full and "
                  "recompute-method=uniform.", flush=True)
    del ns.checkpoint_activations
    if ns.recompute_activations:
        ns.recompute_granularity = "selective"
    del ns.recompute_activations


def _derive_batch_and_dtype(ns: argparse.Namespace) -> None:
    _bad(ns.micro_batch_size is None or ns.micro_batch_size <= 0,
         f"micro_batch_size must be a positive int, got {ns.micro_batch_size!r}")
    if ns.global_batch_size is None:
        ns.global_batch_size = ns.micro_batch_size * ns.data_parallel_size
        if ns.rank == 0:
            print(f"setting global batch size to {ns.global_batch_size}", flush=True)
    _bad(ns.global_batch_size <= 0, f"global_batch_size must be positive, got {ns.global_batch_size}")
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        _bad(ns.pipeline_model_parallel_size <= 2,
             f"pipeline-model-parallel size ({ns.pipeline_model_parallel_size}) should be greater than 2 with "
             "interleaved schedule")
        _bad(ns.num_layers % ns.num_layers_per_virtual_pipeline_stage != 0,
             f"number of layers ({ns.num_layers}) is not divisible by number of layers per virtual pipeline "
             f"stage ({ns.num_layers_per_virtual_pipeline_stage})")
        ns.virtual_pipeline_model_parallel_size = (
            ns.num_layers // ns.pipeline_model_parallel_size) // ns.num_layers_per_virtual_pipeline_stage
    else:
        ns.virtual_pipeline_model_parallel_size = None

    _bad(ns.fp16 and ns.bf16, "--fp16 and --bf16 cannot both be set")
    ns.params_dtype = torch.half if ns.fp16 else torch.bfloat16 if ns.bf16 else torch.float
    if ns.bf16 and not ns.accumulate_allreduce_grads_in_fp32:
        # bf16 training accumulates and all-reduces gradients in fp32.
        ns.accumulate_allreduce_grads_in_fp32 = True
        if ns.rank == 0:
            print("accumulate and all-reduce gradients in fp32 for bfloat16 data type.", flush=True)
    if ns.rank == 0:
        print(f"using {ns.params_dtype} for parameters ...", flush=True)
    if ns.accumulate_allreduce_grads_in_fp32:
        _bad(ns.DDP_impl != "local", f"fp32 gradient accumulation needs --DDP-impl local, got {ns.DDP_impl!r}")
        _bad(not ns.use_contiguous_buffers_in_local_ddp,
             "fp32 gradient accumulation needs contiguous buffers in local DDP")
    elif ns.gradient_accumulation_fusion:
        ns.gradient_accumulation_fusion = False
        if ns.rank == 0:
            print("Gradient accumulation fusion to linear layer weight gradient computation is supported only "
                  "with fp32 gradient accumulation. Setting gradient_accumulation_fusion to False", flush=True)
    if ns.DDP_impl == "torch":
        ns.use_contiguous_buffers_in_local_ddp = False
    if ns.dataloader_type is None:
        ns.dataloader_type = "single"
    ns.consumed_train_samples = 0
    ns.consumed_valid_samples = 0


def _derive_schedule(ns: argparse.Namespace) -> None:
    if ns.train_iters:
        _bad(ns.train_samples is not None, "expected iteration-based training (train_samples is set)")
        _bad(ns.lr_decay_samples is not None, "expected iteration-based learning rate decay")
        _bad(ns.lr_warmup_samples != 0, "expected iteration-based learning rate warmup")
        _bad(ns.rampup_batch_size is not None, "expected no batch-size rampup for iteration-based training")
        _bad(ns.lr_warmup_fraction is not None and ns.lr_warmup_iters != 0,
             "can only specify one of lr-warmup-fraction and lr-warmup-iters")
    if ns.train_samples:
        _bad(ns.train_iters is not None, "expected sample-based training (train_iters is set)")
        _bad(ns.lr_decay_iters is not None, "expected sample-based learning rate decay")
        _bad(ns.lr_warmup_iters != 0, "expected sample-based learning rate warmup")
        _bad(ns.lr_warmup_fraction is not None and ns.lr_warmup_samples != 0,
             "can only specify one of lr-warmup-fraction and lr-warmup-samples")


def _derive_model_sizes(ns: argparse.Namespace) -> None:
    for name in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):
        _bad(getattr(ns, name) is None, f"{name} argument is None (pass --{name.replace('_', '-')})")
    if ns.ffn_hidden_size is None:
        ns.ffn_hidden_size = 4 * ns.hidden_size
    if ns.kv_channels is None:
        _bad(ns.hidden_size % ns.num_attention_heads != 0,
             f"hidden_size ({ns.hidden_size}) is not divisible by num_attention_heads ({ns.num_attention_heads})")
        ns.kv_channels = ns.hidden_size // ns.num_attention_heads
    if ns.seq_length is not None:
        _bad(ns.encoder_seq_length is not None, "pass only one of --seq-length and --encoder-seq-length")
        ns.encoder_seq_length = ns.seq_length
    else:
        _bad(ns.encoder_seq_length is None, "one of --seq-length and --encoder-seq-length is required")
        ns.seq_length = ns.encoder_seq_length
    _bad(ns.max_position_embeddings < ns.seq_length,
         f"max_position_embeddings ({ns.max_position_embeddings}) < seq_length ({ns.seq_length})")
    _bad(ns.decoder_seq_length is not None and ns.max_position_embeddings < ns.decoder_seq_length,
         f"max_position_embeddings ({ns.max_position_embeddings}) < decoder_seq_length ({ns.decoder_seq_length})")
    _bad(ns.lr is not None and ns.min_lr > ns.lr, f"min_lr ({ns.min_lr}) > lr ({ns.lr})")
    _bad(ns.save is not None and ns.save_interval is None, "--save needs --save-interval")
    _bad(ns.fp16_lm_cross_entropy and not ns.fp16, "lm cross entropy in fp16 only supported in fp16 mode")
    _bad(ns.fp32_residual_connection and not (ns.fp16 or ns.bf16),
         "residual connection in fp32 only supported when using fp16 or bf16")
    if ns.weight_decay_incr_style == "constant":
        _bad(ns.start_weight_decay is not None or ns.end_weight_decay is not None,
             "--start/--end-weight-decay need a non-constant --weight-decay-incr-style")
        ns.start_weight_decay = ns.end_weight_decay = ns.weight_decay
    else:
        _bad(ns.start_weight_decay is None or ns.end_weight_decay is None,
             f"--weight-decay-incr-style {ns.weight_decay_incr_style} needs --start- and --end-weight-decay")
    if ns.distribute_saved_activations:
        _bad(ns.tensor_model_parallel_size <= 1,
             "can distribute recomputed activations only across tensor model parallel groups")
        _bad(ns.recompute_granularity != "full",
             "distributed recompute activations is only applicable to full recompute granularity")
        _bad(ns.recompute_method is None, "distributed recompute activations needs a --recompute-method")
    _bad(ns.recompute_granularity == "selective" and ns.recompute_method is not None,
         "recompute method is not yet supported for selective recomputing granularity")
    if ns.sequence_parallel:
        # Sequence parallelism reduce-scatters the input gradient itself.
        ns.async_tensor_model_parallel_allreduce = False


def _print_args(ns: argparse.Namespace) -> None:
    if ns.rank != 0:
        return
    lines = [f"  {k} {'.' * (48 - len(k))} {v}" for k, v in vars(ns).items()]
    print("------------------------ arguments ------------------------", flush=True)
    print("\n".join(sorted(lines, key=str.lower)), flush=True)
    print("-------------------- end of arguments ---------------------", flush=True)


# ------------------------------------------------------------------------------ argument groups
#
# Each group is a table of (flag, keyword arguments of add_argument); help strings are kept short.


def _add(parser: argparse.ArgumentParser, title: str, table: list[tuple[str, dict]]) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title=title)
    for flag, kwargs in table:
        group.add_argument(flag, **kwargs)
    return parser


def _int(default=None, **kw):
    return {"type": int, "default": default, **kw}


def _float(default=None, **kw):
    return {"type": float, "default": default, **kw}


def _str(default=None, **kw):
    return {"type": str, "default": default, **kw}


_TRUE = {"action": "store_true"}


def _off(dest: str) -> dict:
    """A ``--no-x`` flag that turns ``dest`` (default on) off."""
    return {"action": "store_false", "dest": dest}


def _add_network_size_args(parser):
    return _add(parser, "network size", [
        ("--num-layers", _int(help="Number of transformer layers.")),
        ("--hidden-size", _int(help="Transformer hidden size.")),
        ("--ffn-hidden-size", _int(help="Feed-forward hidden size (default 4 * hidden size).")),
        ("--num-attention-heads", _int(help="Number of attention heads.")),
        ("--kv-channels", _int(help="Per-head projection size (default hidden size / heads).")),
        ("--max-position-embeddings", _int(help="Size of the position embedding.")),
        ("--make-vocab-size-divisible-by", _int(128, help="Pad the vocab size to a multiple of this.")),
        ("--layernorm-epsilon", _float(1e-5, help="Layer norm epsilon.")),
        ("--apply-residual-connection-post-layernorm", {**_TRUE, "help": "BERT's original residual order."}),
        ("--openai-gelu", {**_TRUE, "help": "Use OpenAI's tanh GeLU."}),
        ("--onnx-safe", {"type": bool, "required": False, "help": "ONNX exporter workarounds."}),
        ("--bert-no-binary-head", {**_off("bert_binary_head"), "help": "Disable BERT binary head."}),
        ("--num-experts", _int(help="Experts of a Switch MLP (None: no Switch; unsupported).")),
    ])


def _add_logging_args(parser):
    return _add(parser, "logging", [
        ("--log-params-norm", _TRUE),
        ("--log-num-zeros-in-grad", _TRUE),
        ("--tensorboard-log-interval", _int(1)),
        ("--tensorboard-queue-size", _int(1000)),
        ("--log-timers-to-tensorboard", _TRUE),
        ("--log-batch-size-to-tensorboard", _TRUE),
        ("--no-log-learnig-rate-to-tensorboard", _off("log_learning_rate_to_tensorboard")),
        ("--no-log-loss-scale-to-tensorboard", _off("log_loss_scale_to_tensorboard")),
        ("--log-validation-ppl-to-tensorboard", _TRUE),
        ("--log-memory-to-tensorboard", _TRUE),
        ("--log-world-size-to-tensorboard", _TRUE),
    ])


def _add_regularization_args(parser):
    return _add(parser, "regularization", [
        ("--attention-dropout", _float(0.1)),
        ("--hidden-dropout", _float(0.1)),
        ("--weight-decay", _float(0.01)),
        ("--start-weight-decay", _float()),
        ("--end-weight-decay", _float()),
        ("--weight-decay-incr-style", _str("constant", choices=["constant", "linear", "cosine"])),
        ("--clip-grad", _float(1.0)),
        ("--adam-beta1", _float(0.9)),
        ("--adam-beta2", _float(0.999)),
        ("--adam-eps", _float(1e-08)),
        ("--sgd-momentum", _float(0.9)),
    ])


def _add_training_args(parser):
    return _add(parser, "training", [
        ("--micro-batch-size", _int(help="Batch size per model instance.")),
        ("--batch-size", _int(help="Deprecated: use --micro-batch-size.")),
        ("--global-batch-size", _int(help="Training batch size (default micro batch * data parallel size).")),
        ("--rampup-batch-size", {"nargs": "*", "default": None,
                                 "help": "<start batch size> <increment> <ramp-up samples>"}),
        ("--recompute-activations", _TRUE),
        ("--recompute-granularity", _str(choices=["full", "selective"])),
        ("--distribute-saved-activations", _TRUE),
        ("--recompute-method", _str(choices=["uniform", "block"])),
        ("--recompute-num-layers", _int(1)),
        ("--checkpoint-activations", {**_TRUE, "help": "Deprecated: use --recompute-granularity."}),
        ("--train-iters", _int()),
        ("--train-samples", _int()),
        ("--log-interval", _int(100)),
        ("--exit-interval", _int()),
        ("--exit-duration-in-mins", _int()),
        ("--tensorboard-dir", _str()),
        ("--no-masked-softmax-fusion", _off("masked_softmax_fusion")),
        ("--no-bias-gelu-fusion", _off("bias_gelu_fusion")),
        ("--no-bias-dropout-fusion", _off("bias_dropout_fusion")),
        ("--optimizer", _str("adam", choices=["adam", "sgd"])),
        ("--dataloader-type", _str(choices=["single", "cyclic"])),
        ("--no-async-tensor-model-parallel-allreduce", _off("async_tensor_model_parallel_allreduce")),
        ("--no-persist-layer-norm", _TRUE),
        ("--sequence-parallel", {**_TRUE, "help": "Enable sequence parallel optimization."}),
        ("--no-gradient-accumulation-fusion", _off("gradient_accumulation_fusion")),
    ])


def _add_initialization_args(parser):
    return _add(parser, "initialization", [
        ("--seed", _int(1234)),
        ("--init-method-std", _float(0.02)),
        ("--init-method-xavier-uniform", _TRUE),
    ])


def _add_learning_rate_args(parser):
    return _add(parser, "learning rate", [
        ("--lr", _float()),
        ("--lr-decay-style", _str("linear", choices=["constant", "linear", "cosine"])),
        ("--lr-decay-iters", _int()),
        ("--lr-decay-samples", _int()),
        ("--lr-warmup-fraction", _float()),
        ("--lr-warmup-iters", _int(0)),
        ("--lr-warmup-samples", _int(0)),
        ("--warmup", _int(help="Deprecated: use --lr-warmup-*.")),
        ("--min-lr", _float(0.0)),
        ("--override-lr-scheduler", _TRUE),
        ("--use-checkpoint-lr-scheduler", _TRUE),
    ])


def _add_checkpointing_args(parser):
    return _add(parser, "checkpointing", [
        ("--save", _str()),
        ("--save-interval", _int()),
        ("--no-save-optim", {**_TRUE, "default": None}),
        ("--no-save-rng", {**_TRUE, "default": None}),
        ("--load", _str()),
        ("--no-load-optim", {**_TRUE, "default": None}),
        ("--no-load-rng", {**_TRUE, "default": None}),
        ("--finetune", _TRUE),
    ])


def _add_mixed_precision_args(parser):
    return _add(parser, "mixed precision", [
        ("--fp16", _TRUE),
        ("--bf16", _TRUE),
        ("--loss-scale", _float()),
        ("--initial-loss-scale", _float(2**32)),
        ("--min-loss-scale", _float(1.0)),
        ("--loss-scale-window", _float(1000)),
        ("--hysteresis", _int(2)),
        ("--fp32-residual-connection", _TRUE),
        ("--no-query-key-layer-scaling", _off("apply_query_key_layer_scaling")),
        ("--attention-softmax-in-fp32", _TRUE),
        ("--accumulate-allreduce-grads-in-fp32", _TRUE),
        ("--fp16-lm-cross-entropy", _TRUE),
    ])


def _add_distributed_args(parser):
    return _add(parser, "distributed", [
        ("--tensor-model-parallel-size", _int(1)),
        ("--pipeline-model-parallel-size", _int(1)),
        ("--pipeline-model-parallel-split-rank", _int()),
        ("--model-parallel-size", _int(help="Deprecated: use --tensor-model-parallel-size.")),
        ("--num-layers-per-virtual-pipeline-stage", _int()),
        ("--distributed-backend", {"default": "nccl", "choices": ["nccl", "gloo"]}),
        ("--DDP-impl", {"default": "local", "choices": ["local", "torch"]}),
        ("--no-contiguous-buffers-in-local-ddp", _off("use_contiguous_buffers_in_local_ddp")),
        ("--no-scatter-gather-tensors-in-pipeline", _off("scatter_gather_tensors_in_pipeline")),
        ("--local_rank", _int(help="local rank passed from distributed launcher.")),
        ("--lazy-mpu-init", {"type": bool, "required": False}),
        ("--use-cpu-initialization", {**_TRUE, "default": None}),
        ("--empty-unused-memory-level", _int(0, choices=[0, 1, 2])),
        ("--standalone-embedding-stage", {**_TRUE, "default": False}),
    ])


def _add_validation_args(parser):
    return _add(parser, "validation", [
        ("--eval-iters", _int(100)),
        ("--eval-interval", _int(1000)),
    ])


def _add_data_args(parser):
    return _add(parser, "data and dataloader", [
        ("--data-path", {"nargs": "*", "default": None}),
        ("--split", _str("969, 30, 1")),
        ("--vocab-file", _str()),
        ("--merge-file", _str()),
        ("--vocab-extra-ids", _int(0)),
        ("--seq-length", _int()),
        ("--encoder-seq-length", _int()),
        ("--decoder-seq-length", _int()),
        ("--retriever-seq-length", _int(256)),
        ("--sample-rate", _float(1.0)),
        ("--mask-prob", _float(0.15)),
        ("--short-seq-prob", _float(0.1)),
        ("--mmap-warmup", _TRUE),
        ("--num-workers", _int(2)),
        ("--tokenizer-type", _str(choices=["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer"])),
        ("--data-impl", _str("infer", choices=["lazy", "cached", "mmap", "infer"])),
        ("--reset-position-ids", _TRUE),
        ("--reset-attention-mask", _TRUE),
        ("--eod-mask-loss", _TRUE),
    ])


def _add_autoresume_args(parser):
    return _add(parser, "autoresume", [
        ("--adlr-autoresume", _TRUE),
        ("--adlr-autoresume-interval", _int(1000)),
    ])


def _add_biencoder_args(parser):
    return _add(parser, "biencoder", [
        ("--ict-head-size", _int()),
        ("--biencoder-projection-dim", _int(0)),
        ("--biencoder-shared-query-context-model", _TRUE),
        ("--ict-load", _str()),
        ("--bert-load", _str()),
        ("--titles-data-path", _str()),
        ("--query-in-block-prob", _float(0.1)),
        ("--use-one-sent-docs", _TRUE),
        ("--evidence-data-path", _str()),
        ("--retriever-report-topk-accuracies", {"nargs": "+", "type": int, "default": []}),
        ("--retriever-score-scaling", _TRUE),
        ("--block-data-path", _str()),
        ("--embedding-path", _str()),
        ("--indexer-batch-size", _int(128)),
        ("--indexer-log-interval", _int(1000)),
    ])


def _add_vision_args(parser):
    return _add(parser, "vision", [
        ("--num-classes", _int(1000)),
        ("--img-h", _int(224)),
        ("--img-w", _int(224)),
        ("--num-channels", _int(3)),
        ("--patch-dim", _int(16)),
        ("--classes-fraction", _float(1.0)),
        ("--data-per-class-fraction", _float(1.0)),
        ("--no-data-sharding", _off("data_sharding")),
        ("--head-lr-mult", _float(1.0)),
        ("--vision-pretraining", _TRUE),
        ("--vision-pretraining-type", _str("classify", choices=["classify", "inpaint", "dino"])),
        ("--vision-backbone-type", _str("vit", choices=["vit", "mit", "swin"])),
        ("--swin-backbone-type", _str("tiny", choices=["tiny", "base", "h3"])),
        ("--mask-type", _str("random", choices=["random", "row"])),
        ("--mask-factor", _float(1.0)),
        ("--iter-per-epoch", _int(1250)),
        ("--dino-local-img-size", _int(96)),
        ("--dino-local-crops-number", _int(10)),
        ("--dino-head-hidden-size", _int(2048)),
        ("--dino-bottleneck-size", _int(256)),
        ("--dino-freeze-last-layer", _float(1)),
        ("--dino-norm-last-layer", _TRUE),
        ("--dino-warmup-teacher-temp", _float(0.04)),
        ("--dino-teacher-temp", _float(0.07)),
        ("--dino-warmup-teacher-temp-epochs", _int(30)),
    ])
