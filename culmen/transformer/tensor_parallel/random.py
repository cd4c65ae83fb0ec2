"""RNG state tracking for tensor parallelism, and activation checkpointing that replays it.

Two RNG streams are kept (Megatron / Apex semantics):

* the default generator, seeded with ``seed`` on every rank: the same across a tensor-parallel group,
  so dropout on replicated activations (outside TP regions) drops the same elements on every TP rank;
* the tracker's ``"model-parallel-rng"`` state, seeded with ``seed + 2718 + tp_rank``: different per TP
  rank, used (``with get_cuda_rng_tracker().fork():``) for dropout on sharded activations and for
  initializing sharded weights.

The "device generator" is CUDA's default generator of the current device when CUDA is available, and
torch's CPU generator otherwise (so the same code runs, and is tested, on CPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from culmen.transformer import parallel_state
from culmen.transformer.tensor_parallel.memory import allocate_mem_buff
from culmen.transformer.tensor_parallel.utils import divide

__all__ = [
    "CheckpointFunction",
    "CudaRNGStatesTracker",
    "checkpoint",
    "get_cuda_rng_tracker",
    "init_checkpointed_activations_memory_buffer",
    "model_parallel_cuda_manual_seed",
    "reset_checkpointed_activations_memory_buffer",
]

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"

_CHECKPOINTED_ACTIVATIONS_MEMORY_BUFFER = None


def _device_rng_state() -> Tensor:
    """The device generator's state (a CPU byte tensor; reading it does not sync with the GPU)."""
    if torch.cuda.is_available():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_device_rng_state(new_state: Tensor) -> None:
    """Set the device generator's state. The CUDA path does not clone ``new_state`` (``torch.cuda.set_rng_state``
    does; Megatron found the clone costly with many ranks)."""
    if torch.cuda.is_available():
        torch.cuda.default_generators[torch.cuda.current_device()].set_state(new_state)
    else:
        torch.set_rng_state(new_state)


def _device_manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


# Apex's private helper name, kept for code that imports it.
_set_cuda_rng_state = _set_device_rng_state


def init_checkpointed_activations_memory_buffer(
    micro_batch_size: int,
    max_position_embeddings: int,
    hidden_size: int,
    num_layers: int,
    tensor_model_parallel_size: int,
    checkpoint_num_layers: int,
    fp16: bool,
) -> None:
    """Allocate the (Megatron-legacy) buffer for checkpointed activations: one
    ``micro_batch_size * max_position_embeddings * hidden_size / tensor_model_parallel_size`` slab per
    checkpointed block, fp16 or fp32. ``ValueError`` when ``num_layers`` is not a multiple of
    ``checkpoint_num_layers`` or the buffer already exists."""
    global _CHECKPOINTED_ACTIVATIONS_MEMORY_BUFFER
    per_layer = micro_batch_size * max_position_embeddings * hidden_size // tensor_model_parallel_size
    num_checkpointed = divide(num_layers, checkpoint_num_layers)
    if _CHECKPOINTED_ACTIVATIONS_MEMORY_BUFFER is not None:
        raise ValueError("the checkpointed activations memory buffer is already allocated")
    dtype = torch.half if fp16 else torch.float
    _CHECKPOINTED_ACTIVATIONS_MEMORY_BUFFER = allocate_mem_buff(
        "checkpointed activations", per_layer * num_checkpointed, dtype, track_usage=False)


def reset_checkpointed_activations_memory_buffer() -> None:
    """Mark the checkpointed activations buffer empty (it keeps its memory)."""
    if _CHECKPOINTED_ACTIVATIONS_MEMORY_BUFFER is not None:
        _CHECKPOINTED_ACTIVATIONS_MEMORY_BUFFER.reset()


class CudaRNGStatesTracker:
    """Named device-generator states: ``add(name, seed)`` creates one, ``fork(name)`` runs a block with it
    (and keeps what the block consumed) and restores the outer state afterwards."""

    def __init__(self) -> None:
        self.states_: dict[str, Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, Tensor]:
        """A shallow copy of the ``name -> state`` dict (the states themselves are not copied)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, Tensor]) -> None:
        """Replace the tracked states by ``states`` (as returned by ``get_states``)."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``; the current device state is left as it was.

        Raises ``ValueError`` when ``seed`` or ``name`` is already tracked (Apex raises a bare ``Exception``).
        """
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        orig = _device_rng_state()
        _device_manual_seed(seed)
        self.states_[name] = _device_rng_state()
        _set_device_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block with the tracked state ``name``; afterwards store its advanced state and restore
        the state the block started from. ``KeyError`` when ``name`` was never added (call
        ``model_parallel_cuda_manual_seed`` first)."""
        if name not in self.states_:
            raise KeyError(f"cuda rng state {name} is not added (call model_parallel_cuda_manual_seed first)")
        orig = _device_rng_state()
        _set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _device_rng_state()
            _set_device_rng_state(orig)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide ``CudaRNGStatesTracker``."""
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed both streams after ``parallel_state.initialize_model_parallel``: the default device generator
    with ``seed`` (same on every TP rank) and the tracker's model-parallel state with
    ``seed + 2718 + tp_rank`` (different per TP rank, same across data-parallel replicas)."""
    tensor_model_parallel_seed = seed + 2718 + parallel_state.get_tensor_model_parallel_rank()
    _CUDA_RNG_STATE_TRACKER.reset()
    _device_manual_seed(seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_model_parallel_seed)


def _split_1d_chunk(t: Tensor) -> Tensor:
    """This TP rank's equal chunk of ``t`` flattened (a copy: the full tensor can then be freed)."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    n = divide(t.numel(), world)
    rank = parallel_state.get_tensor_model_parallel_rank()
    return t.reshape(-1)[rank * n:(rank + 1) * n].clone()


def _gather_1d_chunks(chunk: Tensor, shape: torch.Size) -> Tensor:
    world = parallel_state.get_tensor_model_parallel_world_size()
    out = torch.empty(world * chunk.numel(), dtype=chunk.dtype, device=chunk.device)
    from culmen.ops.common.collectives import all_gather_single

    all_gather_single(out, chunk, group=parallel_state.get_tensor_model_parallel_group())
    return out.view(shape)


class CheckpointFunction(torch.autograd.Function):
    """Activation checkpointing that records the CPU, device and tracker RNG states at the forward and
    replays them for the recomputation, so dropout masks (inside and outside TP regions) are identical."""

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        ctx.run_function = run_function
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.fwd_cpu_rng_state = torch.get_rng_state()
        ctx.fwd_cuda_rng_state = _device_rng_state()
        ctx.fwd_cuda_rng_state_tracker = get_cuda_rng_tracker().get_states()

        with torch.no_grad():
            outputs = run_function(*args)

        tensor_idx = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx.tensor_idx = tensor_idx
        ctx.non_tensor_args = [None if isinstance(a, Tensor) else a for a in args]
        ctx.requires_grad_flags = [a.requires_grad if isinstance(a, Tensor) else False for a in args]
        saved = [args[i] for i in tensor_idx]
        ctx.input_0_shape = None
        if distribute_saved_activations and tensor_idx and tensor_idx[0] == 0 \
                and parallel_state.get_tensor_model_parallel_world_size() > 1:
            # Keep only this rank's 1/tp of the first input; backward all-gathers it back.
            ctx.input_0_shape = args[0].shape
            saved[0] = _split_1d_chunk(args[0].detach())
        ctx.save_for_backward(*saved)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpointing is not compatible with .grad(); use .backward()")
        saved = list(ctx.saved_tensors)
        if ctx.input_0_shape is not None:
            saved[0] = _gather_1d_chunks(saved[0], ctx.input_0_shape)
        args = list(ctx.non_tensor_args)
        for i, t in zip(ctx.tensor_idx, saved):
            args[i] = t.detach().requires_grad_(ctx.requires_grad_flags[i])

        bwd_cpu_rng_state = torch.get_rng_state()
        bwd_cuda_rng_state = _device_rng_state()
        bwd_tracker_states = get_cuda_rng_tracker().get_states()
        torch.set_rng_state(ctx.fwd_cpu_rng_state)
        _set_device_rng_state(ctx.fwd_cuda_rng_state)
        get_cuda_rng_tracker().set_states(ctx.fwd_cuda_rng_state_tracker)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*args)
        finally:
            torch.set_rng_state(bwd_cpu_rng_state)
            _set_device_rng_state(bwd_cuda_rng_state)
            get_cuda_rng_tracker().set_states(bwd_tracker_states)

        if isinstance(outputs, Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if isinstance(o, Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(a.grad if isinstance(a, Tensor) else None for a in args)
        return (None, None) + grads


def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
    """Run ``function(*args)`` without keeping its activations; recompute them in backward with the RNG
    states (CPU, device and tracker) of the forward.

    Args:
        function: the block; returns a tensor or a tuple of tensors.
        distribute_saved_activations: keep only this TP rank's ``1/tp`` of ``args[0]`` (flattened; its
            element count must divide by the TP size) and all-gather it in backward. Unlike Megatron,
            the caller's ``args[0]`` is not modified: the saving comes when the caller drops it.
        args: the block's inputs; tensors and other values.

    Returns:
        ``function(*args)``.
    """
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)


