"""``apex.transformer.testing.commons``: the small models, step functions and set-up helpers that Apex's
model-parallel and pipeline tests import.

* ``MyLayer`` / ``MyModel`` / ``model_provider_func``: one ``nn.Linear(h, h)`` per pipeline chunk;
  ``fwd_step_func`` runs it and sums the output as the loss.
* ``ToyParallelMLP`` / ``mlp_provider_func`` / ``ToyParallelMLPFwdBwdStepFunc``: a column- then
  row-parallel MLP (optionally sequence-parallel) for tensor + pipeline tests.
* ``IdentityLayer``: a parameter returned by ``forward()`` (gradients of a tensor as a module).
* ``set_random_seed``, ``initialize_distributed``, ``print_separator``, ``TEST_SUCCESS_MESSAGE``.

Difference from Apex: ``initialize_distributed`` also takes ``backend="gloo"`` (CPU), and reads the local
rank from ``LOCAL_RANK`` when the global arguments are not set.
"""

from __future__ import annotations

import datetime
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy
import torch
import torch.nn as nn
from torch import Tensor

from culmen.distributed_testing.distributed_test_base import HAS_UCC
from culmen.transformer import tensor_parallel
from culmen.transformer.pipeline_parallel.utils import average_losses_across_data_parallel_group
from culmen.transformer.testing import global_vars

__all__ = [
    "TEST_SUCCESS_MESSAGE",
    "IdentityLayer",
    "MyLayer",
    "MyModel",
    "ToyParallelMLP",
    "ToyParallelMLPFwdBwdStepFunc",
    "fwd_step_func",
    "initialize_distributed",
    "mlp_provider_func",
    "model_provider_func",
    "print_separator",
    "process_batch",
    "set_random_seed",
]

TEST_SUCCESS_MESSAGE = ">> passed the test :-)"


def _set_input(module: nn.Module, input_tensor: Tensor | list[Tensor] | None) -> None:
    if not isinstance(input_tensor, list):
        input_tensor = [input_tensor]
    module.input_tensor = input_tensor[0]


class MyLayer(nn.Module):
    """``nn.Linear(hidden_size, hidden_size)``; ``pre_process`` / ``post_process`` are only recorded."""

    def __init__(self, hidden_size: int, pre_process: bool, post_process: bool) -> None:
        super().__init__()
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)


class MyModel(nn.Module):
    """A one-``MyLayer`` pipeline chunk: it reads ``x`` on the first stage and the received activation
    (``set_input_tensor``) elsewhere. ``forward(x [..., h]) -> [..., h]``."""

    def __init__(self, hidden_size: int, pre_process: bool = False, post_process: bool = False, *,
                 add_encoder: bool = False, add_decoder: bool = False) -> None:
        super().__init__()
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer = MyLayer(hidden_size=hidden_size, pre_process=pre_process, post_process=post_process)
        self.input_tensor = None

    def set_input_tensor(self, input_tensor: Tensor | list[Tensor] | None) -> None:
        """The activation from the previous stage (``None`` on the first stage)."""
        _set_input(self, input_tensor)

    def forward(self, x: Tensor | None) -> Tensor:
        return self.layer(x if self.input_tensor is None else self.input_tensor)


class ToyParallelMLP(nn.Module):
    """``RowParallelLinear(gelu(ColumnParallelLinear(x) + b1))``, ``h -> 4h -> h`` (bias of the first
    projection added after the GEMM, as Megatron's MLP).

    Args:
        hidden_size: h (``4h`` must divide by the TP size).
        pre_process, post_process: recorded.
        sequence_parallel_enabled: the input and output are this rank's ``[s / tp, b, h]``.
        add_encoder, add_decoder: accepted and ignored.

    ``forward(x [s, b, h] or None)`` -> ``[s, b, h]`` (the received activation when one was set).
    """

    def __init__(self, hidden_size: int, pre_process: bool = False, post_process: bool = False, *,
                 sequence_parallel_enabled: bool = False, add_encoder: bool = False, add_decoder: bool = False) -> None:
        super().__init__()
        self.pre_process = pre_process
        self.post_process = post_process
        self.sequence_parallel_enabled = sequence_parallel_enabled
        ffn_hidden_size = 4 * hidden_size
        self.dense_h_to_4h = tensor_parallel.ColumnParallelLinear(
            hidden_size, ffn_hidden_size, gather_output=False, skip_bias_add=True, bias=True,
            sequence_parallel_enabled=sequence_parallel_enabled, no_async_tensor_model_parallel_allreduce=True)
        self.dense_4h_to_h = tensor_parallel.RowParallelLinear(
            ffn_hidden_size, hidden_size, input_is_parallel=True, skip_bias_add=False, bias=True,
            sequence_parallel_enabled=sequence_parallel_enabled)
        self.activation_func = nn.GELU()
        self.input_tensor = None

    def set_input_tensor(self, input_tensor: Tensor | list[Tensor] | None) -> None:
        """The activation from the previous stage (``None`` on the first stage)."""
        _set_input(self, input_tensor)

    def forward(self, x: Tensor | None) -> Tensor:
        h, b1 = self.dense_h_to_4h(x if self.input_tensor is None else self.input_tensor)
        if b1 is not None:
            h = h + b1
        out, _ = self.dense_4h_to_h(self.activation_func(h))
        return out


def model_provider_func(hidden_size: int, pre_process: bool, post_process: bool, *, add_encoder: bool = False,
                        add_decoder: bool = False) -> MyModel:
    """``MyModel`` for ``build_model``."""
    return MyModel(hidden_size, pre_process, post_process, add_encoder=add_encoder, add_decoder=add_decoder)


def mlp_provider_func(hidden_size: int, pre_process: bool, post_process: bool, *, add_encoder: bool = False,
                      add_decoder: bool = False, sequence_parallel_enabled: bool = False) -> ToyParallelMLP:
    """``ToyParallelMLP`` for ``build_model``."""
    return ToyParallelMLP(hidden_size, pre_process, post_process, add_encoder=add_encoder, add_decoder=add_decoder,
                          sequence_parallel_enabled=sequence_parallel_enabled)


def process_batch(batch: Any) -> Any:
    """The model input of a batch: its first element when it is a list, else the batch."""
    return batch[0] if isinstance(batch, list) else batch


def _sum_loss(output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    loss = torch.sum(output)
    return loss, {"avg": average_losses_across_data_parallel_group([loss])}


def fwd_step_func(batch: Any, model: nn.Module) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, dict]]]:
    """Pipeline forward step: ``model(batch input)`` and a loss function returning ``(sum(output),
    {"avg": sum averaged over the data-parallel group})``."""
    return model(process_batch(batch)), _sum_loss


@dataclass(frozen=True)
class ToyParallelMLPFwdBwdStepFunc:
    """Forward step of ``ToyParallelMLP``: the batch input ``[b, s, h]`` is transposed to ``[s, b, h]``
    (and scattered along the sequence with sequence parallelism); the loss is the output's sum."""

    sequence_parallel_enabled: bool

    def __call__(self, batch: Any, model: nn.Module) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, dict]]]:
        x = process_batch(batch)
        if isinstance(x, Tensor):
            x = x.transpose(0, 1).contiguous()
            if self.sequence_parallel_enabled:
                x = tensor_parallel.scatter_to_sequence_parallel_region(x)
        return model(x), _sum_loss


class IdentityLayer(nn.Module):
    """A parameter of shape ``size`` (``scale * randn``) that ``forward()`` returns."""

    def __init__(self, size: int | tuple[int, ...], scale: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(scale * torch.randn(size))

    def forward(self) -> Tensor:
        return self.weight


def set_random_seed(seed: int) -> None:
    """Seed Python, NumPy, torch and the model-parallel RNG tracker (call after
    ``parallel_state.initialize_model_parallel``)."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def initialize_distributed(backend: str = "nccl") -> None:
    """``torch.distributed.init_process_group`` from ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` /
    ``MASTER_PORT`` (defaults 0, 1, localhost, 6000), with a 60 s timeout.

    With ``nccl`` / ``ucc`` the CUDA device is ``args.local_rank`` (global arguments) or ``LOCAL_RANK``,
    else ``rank % device_count``. ``gloo`` runs on CPU.

    Raises:
        ValueError: an unsupported backend. ImportError: ``ucc`` without a UCC-enabled torch.
    """
    if backend not in ("nccl", "ucc", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'ucc' or 'gloo', got {backend!r}")
    if backend == "ucc" and not HAS_UCC:
        raise ImportError("UCC backend requires pytorch source build with UCC installed and enabled")
    try:
        local_rank = global_vars.get_args().local_rank
    except RuntimeError:
        local_rank = None
    if local_rank is None and os.getenv("LOCAL_RANK") is not None:
        local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.getenv("RANK", "0"))
    world_size = int(os.getenv("WORLD_SIZE", "1"))
    print(f"> initializing torch.distributed with local rank: {local_rank}, rank: {rank}, world size: {world_size}",
          flush=True)
    if backend != "gloo":
        device = local_rank if local_rank is not None else rank % torch.cuda.device_count()
        torch.cuda.set_device(device)
    init_method = f"tcp://{os.getenv('MASTER_ADDR', 'localhost')}:{os.getenv('MASTER_PORT', '6000')}"
    torch.distributed.init_process_group(backend=backend, world_size=world_size, rank=rank, init_method=init_method,
                                         timeout=datetime.timedelta(seconds=60))


def print_separator(message: str) -> None:
    """Print ``---- message ----`` on rank 0 between two barriers."""
    torch.distributed.barrier()
    filler = "-" * ((78 - len(message)) // 2)
    if torch.distributed.get_rank() == 0:
        print(f"\n{filler} {message} {filler}", flush=True)
    torch.distributed.barrier()
