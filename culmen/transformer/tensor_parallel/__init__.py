"""``apex.transformer.tensor_parallel`` on culmen: Megatron-style tensor and sequence parallelism.

Layers (``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``), the autograd
mappings between replicated, tensor-parallel and sequence-parallel regions, the vocab-parallel
cross-entropy (on culmen's fused cross-entropy op), ``broadcast_data``, the RNG tracker and activation
checkpointing, on ``torch.distributed`` groups from ``culmen.transformer.parallel_state``.
"""

from culmen.transformer.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from culmen.transformer.tensor_parallel.data import broadcast_data
from culmen.transformer.tensor_parallel.layers import (
    ColumnParallelLinear,
    LinearWithGradAccumulationAndAsyncCommunication,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    linear_with_grad_accumulation_and_async_allreduce,
    linear_with_grad_accumulation_and_async_allreduce_in16bit,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from culmen.transformer.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from culmen.transformer.tensor_parallel.memory import MemoryBuffer, RingMemBuffer, allocate_mem_buff
from culmen.transformer.tensor_parallel.random import (
    CheckpointFunction,
    CudaRNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    init_checkpointed_activations_memory_buffer,
    model_parallel_cuda_manual_seed,
    reset_checkpointed_activations_memory_buffer,
)
from culmen.transformer.tensor_parallel.utils import VocabUtility, divide, split_tensor_along_last_dim

__all__ = [
    # cross_entropy.py
    "vocab_parallel_cross_entropy",
    # data.py
    "broadcast_data",
    # layers.py
    "ColumnParallelLinear",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_tensor_model_parallel_attributes",
    "linear_with_grad_accumulation_and_async_allreduce",
    "linear_with_grad_accumulation_and_async_allreduce_in16bit",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    # mappings.py
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    # memory.py
    "MemoryBuffer",
    "RingMemBuffer",
    "allocate_mem_buff",
    # random.py
    "CheckpointFunction",
    "CudaRNGStatesTracker",
    "checkpoint",
    "get_cuda_rng_tracker",
    "init_checkpointed_activations_memory_buffer",
    "model_parallel_cuda_manual_seed",
    "reset_checkpointed_activations_memory_buffer",
    # utils.py
    "VocabUtility",
    "divide",
    "split_tensor_along_last_dim",
]
