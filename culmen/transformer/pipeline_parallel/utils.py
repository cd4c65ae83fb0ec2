"""Helpers of pipeline-parallel training (Apex's ``apex.transformer.pipeline_parallel.utils``).

The process-wide microbatch calculator (``setup_microbatch_calculator`` / ``get_num_microbatches`` /
``update_num_microbatches`` ...) that every schedule consults, microbatch slicing
(``get_kth_microbatch``), model unwrapping, loss averaging over the data-parallel group, the
parameter L2 norm over the model-parallel group, GPT-style masks and position ids, and printing
helpers.

Differences from Apex, each a fix: ``param_is_not_shared`` returns what its name says (Apex returned
the ``shared`` flag itself); ``calc_params_l2_norm`` works on any device and skips tensor-parallel
duplicates through the parameters' own attributes (Apex called a ``parallel_state`` function that
does not exist); misuse raises ``RuntimeError`` / ``ValueError`` with a message instead of
``AssertionError`` or ``AttributeError`` on ``None``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from culmen.transformer import parallel_state
from culmen.transformer.enums import ModelType
from culmen.transformer.pipeline_parallel._timers import _Timers

__all__ = [
    "Shape",
    "average_losses_across_data_parallel_group",
    "calc_params_l2_norm",
    "get_autoresume",
    "get_current_global_batch_size",
    "get_kth_microbatch",
    "get_ltor_masks_and_position_ids",
    "get_micro_batch_size",
    "get_model_type",
    "get_num_microbatches",
    "get_timers",
    "is_last_rank",
    "listify_model",
    "param_is_not_shared",
    "print_params_min_max_norm",
    "print_rank_0",
    "print_rank_last",
    "report_memory",
    "setup_microbatch_calculator",
    "unwrap_model",
    "update_num_microbatches",
]

_GLOBAL_ARGS = None
_GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_AUTORESUME = None
_GLOBAL_TIMERS: _Timers | None = None

Shape = list[int] | torch.Size


def listify_model(model: torch.nn.Module | list[torch.nn.Module]) -> list[torch.nn.Module]:
    """``model`` itself if it is a list of model chunks, else ``[model]``."""
    if isinstance(model, list):
        return model
    return [model]


def _ensure_var_is_initialized(var: Any, name: str) -> None:
    if var is None:
        raise RuntimeError(f"{name} is not initialized")


def _ensure_var_is_not_initialized(var: Any, name: str) -> None:
    if var is not None:
        raise RuntimeError(f"{name} is already initialized")


def _build_calculator(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size):
    # Imported here: the calculators live in culmen.transformer.microbatches, which the schedules
    # do not need until a calculator is built.
    from culmen.transformer.microbatches import build_num_microbatches_calculator

    return build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size)


def setup_microbatch_calculator(
    rank: int,
    rampup_batch_size: list[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> None:
    """Build the process-wide microbatch calculator the schedules read (once per process).

    Args:
        rank: this process's global rank (rank 0 prints the set-up).
        rampup_batch_size: ``None`` for a constant global batch size, or
            ``[start_batch_size, batch_size_increment, ramp_up_samples]``.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        micro_batch_size: samples per microbatch on one rank.
        data_parallel_size: number of data-parallel ranks.

    The number of microbatches is ``global_batch_size / (micro_batch_size * data_parallel_size)``;
    a second call raises ``RuntimeError`` (``_reconfigure_microbatch_calculator`` replaces it).
    """
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _ensure_var_is_not_initialized(_GLOBAL_NUM_MICROBATCHES_CALCULATOR, "num microbatches calculator")
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size)


def _reconfigure_microbatch_calculator(
    rank: int,
    rampup_batch_size: list[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> None:
    """Replace the microbatch calculator (meant for tests; warns on rank 0 as Apex does)."""
    if dist.is_initialized() and dist.get_rank() == 0:
        warnings.warn("This function is only for unittest", stacklevel=2)
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size)


def _calculator():
    calc = _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if calc is None:
        raise RuntimeError(
            "the microbatch calculator is not initialized: call "
            "culmen.transformer.pipeline_parallel.utils.setup_microbatch_calculator(...) first")
    return calc


def get_micro_batch_size() -> int:
    """Samples per microbatch (from the calculator)."""
    return _calculator().micro_batch_size


def get_num_microbatches() -> int:
    """Microbatches per step on each data-parallel rank at the current point of the ramp-up."""
    return _calculator().get()


def get_current_global_batch_size() -> int:
    """Global batch size at the current point of the ramp-up."""
    return _calculator().get_current_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True) -> None:
    """Advance a ramp-up calculator to ``consumed_samples`` (no-op for a constant one)."""
    _calculator().update(consumed_samples, consistency_check)


def _split_batch_into_microbatch(
    batch: list[torch.Tensor],
    *,
    _micro_batch_size: int | None = None,
    _global_batch_size: int | None = None,
) -> Iterator[list[torch.Tensor]]:
    """Yield consecutive microbatches (lists of dim-0 slices of every tensor of ``batch``)."""
    micro = get_micro_batch_size() if _micro_batch_size is None else _micro_batch_size
    total = get_current_global_batch_size() if _global_batch_size is None else _global_batch_size
    for start in range(0, total, micro):
        yield [x[start:start + micro] for x in batch]


def get_kth_microbatch(batch: Sequence[torch.Tensor] | None, k: int) -> Any:
    """The ``k``-th microbatch of a local minibatch: ``[x[k*m:(k+1)*m] for x in batch]``, m the micro size.

    Args:
        batch: a list/tuple of tensors whose dim 0 holds the local minibatch's samples
            (``num_microbatches * micro_batch_size`` of them); anything else (``None``, a single
            tensor, a dict) is returned unchanged, as Apex does.
        k: microbatch index.

    Returns:
        A list of views of the tensors in ``batch`` (no copies).
    """
    if batch is None or not isinstance(batch, (list, tuple)):
        return batch
    micro = get_micro_batch_size()
    start = k * micro
    end = start + micro
    out = []
    for i, x in enumerate(batch):
        if x.size(0) < end:
            raise ValueError(
                f"microbatch {k} needs samples [{start}, {end}) but batch[{i}] has only {x.size(0)} "
                f"along dim 0 (micro_batch_size={micro})")
        out.append(x[start:end])
    if not out:
        raise ValueError("batch is an empty list")
    return out


def get_autoresume() -> Any:
    """The auto-resume hook (always ``None`` in Apex and culmen)."""
    return _GLOBAL_AUTORESUME


def _set_timers() -> None:
    """Create the process-wide ``_Timers`` (once)."""
    global _GLOBAL_TIMERS
    _ensure_var_is_not_initialized(_GLOBAL_TIMERS, "timers")
    _GLOBAL_TIMERS = _Timers()


def get_timers() -> _Timers:
    """The process-wide ``_Timers`` created by ``_set_timers``."""
    _ensure_var_is_initialized(_GLOBAL_TIMERS, "timers")
    return _GLOBAL_TIMERS


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only (everywhere when torch.distributed is not initialized)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def is_last_rank() -> bool:
    """Whether this process is the last global rank."""
    return dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message: str) -> None:
    """Print on the last global rank only (everywhere when torch.distributed is not initialized)."""
    if not dist.is_initialized() or is_last_rank():
        print(message, flush=True)


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """True unless ``param.shared`` is set (a parameter tied across stages, e.g. the word embedding)."""
    return not getattr(param, "shared", False)


def unwrap_model(model: torch.nn.Module | list[torch.nn.Module],
                 module_instances: tuple[type, ...] = (DistributedDataParallel,)) -> Any:
    """Strip wrappers of the types in ``module_instances`` (their ``.module``) from a model or a list of them."""
    chunks = model if isinstance(model, list) else [model]
    out = []
    for m in chunks:
        while isinstance(m, module_instances):
            m = m.module
        out.append(m)
    return out if isinstance(model, list) else out[0]


def get_model_type(model: torch.nn.Module) -> ModelType:
    """``model.model_type`` of the unwrapped model, ``ModelType.encoder_or_decoder`` when it has none."""
    return getattr(unwrap_model(model), "model_type", ModelType.encoder_or_decoder)


def _param_is_not_tensor_parallel_duplicate(param: torch.nn.Parameter) -> bool:
    # A parameter replicated over the tensor-parallel group counts once: on tensor-parallel rank 0.
    if getattr(param, "tensor_model_parallel", False):
        return True
    return parallel_state.get_tensor_model_parallel_rank() == 0


def calc_params_l2_norm(model: torch.nn.Module | list[torch.nn.Module], bf16: bool) -> float:
    """L2 norm of all parameters of the whole model-parallel model (shared and TP-duplicate ones once).

    Args:
        model: a module or a list of model chunks on this rank.
        bf16: compute the norms of (bf16) parameters in fp32.

    Returns:
        A Python float, the same on every rank of the model-parallel group (squares are summed
        over it with an all-reduce).
    """
    params = []
    for chunk in listify_model(model):
        for p in chunk.parameters():
            if param_is_not_shared(p) and _param_is_not_tensor_parallel_duplicate(p):
                params.append(p.detach().float() if bf16 else p.detach())
    device = params[0].device if params else _default_device()
    if params:
        # _foreach_norm is one multi-tensor launch per dtype group on GPUs; squares summed in fp32+.
        norms = torch._foreach_norm(params)
        sq = torch.stack([n.to(torch.float64 if n.dtype == torch.float64 else torch.float32) for n in norms])
        norm_2 = sq.square().sum().reshape(1)
    else:
        norm_2 = torch.zeros(1, dtype=torch.float32, device=device)
    group = parallel_state.get_model_parallel_group()
    if _backend_device(group).type != norm_2.device.type:
        norm_2 = norm_2.to(_backend_device(group))
    dist.all_reduce(norm_2, op=dist.ReduceOp.SUM, group=group)
    return norm_2.item() ** 0.5


def average_losses_across_data_parallel_group(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean over the data-parallel group of each loss: a 1-D tensor of ``len(losses)`` values (detached)."""
    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])
    group = parallel_state.get_data_parallel_group()
    dist.all_reduce(averaged, group=group)
    return averaged / dist.get_world_size(group=group)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _backend_device(group) -> torch.device:
    # gloo communicates host tensors; every other backend (nccl, ucc) device tensors.
    if dist.get_backend(group) == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def report_memory(name: str) -> None:
    """Print this rank's CUDA memory use (MB) on data-parallel rank 0; zeros without a GPU."""
    mb = 1024.0 * 1024.0
    if torch.cuda.is_available():
        stats = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),
                 torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved())
    else:
        stats = (0, 0, 0, 0)
    line = (f"{name} memory (MB) | allocated: {stats[0] / mb} | max allocated: {stats[1] / mb}"
            f" | reserved: {stats[2] / mb} | max reserved: {stats[3] / mb}")
    rank0 = parallel_state.get_data_parallel_rank() == 0 if parallel_state.model_parallel_is_initialized() else True
    if rank0:
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"[Rank {rank}] {line}", flush=True)


def print_params_min_max_norm(optimizer: Any, iteration: int) -> None:
    """Print min, max and norm of every parameter of ``optimizer.optimizer`` (a wrapped optimizer)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    lines = ["iteration, rank, index, tensor-model-parallel, min, max, norm"]
    index = 0
    inner = getattr(optimizer, "optimizer", optimizer)
    for group in inner.param_groups:
        for param in group["params"]:
            index += 1
            data = param.detach()
            tp = int(getattr(param, "tensor_model_parallel", False))
            lines.append(f"{iteration:7d}, {rank:4d}, {index:4d}, {tp:2d}, "
                         f"{data.min().item():.6E}, {data.max().item():.6E}, {torch.linalg.norm(data).item():.6E}")
    print("\n".join(lines), flush=True)


def get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention mask, loss mask and position ids for a left-to-right (GPT) model.

    Args:
        data: token ids, ``(micro_batch_size, seq_length)`` integer tensor.
        eod_token: the end-of-document token id.
        reset_position_ids: restart positions at 0 after every ``eod_token``.
        reset_attention_mask: forbid attention across documents (tokens after an ``eod_token`` do
            not see the tokens up to and including it).
        eod_mask_loss: zero the loss mask at ``eod_token`` positions.

    Returns:
        ``attention_mask``: bool ``(b, 1, s, s)`` with ``b = micro_batch_size`` if
        ``reset_attention_mask`` else 1, **True where attention is masked out**;
        ``loss_mask``: float32 ``(micro_batch_size, seq_length)``;
        ``position_ids``: int64 ``(micro_batch_size, seq_length)``.
    """
    if data.dim() != 2:
        raise ValueError(f"data must be 2-D (micro_batch_size, seq_length), got shape {tuple(data.shape)}")
    b, s = data.shape
    mask_batch = b if reset_attention_mask else 1
    allowed = torch.tril(torch.ones((mask_batch, s, s), device=data.device)).view(mask_batch, 1, s, s)

    loss_mask = torch.ones(data.shape, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0

    position_ids = torch.arange(s, dtype=torch.long, device=data.device).unsqueeze(0).expand_as(data)
    if reset_position_ids:
        position_ids = position_ids.clone()

    if reset_position_ids or reset_attention_mask:
        # Per sample, every EOD at index i starts a new document at i + 1.
        for row in range(b):
            eods = (data[row] == eod_token).nonzero().flatten().tolist()
            doc_start = 0
            for i in eods:
                if reset_attention_mask:
                    allowed[row, 0, i + 1:, :i + 1] = 0
                if reset_position_ids:
                    position_ids[row, i + 1:] -= i + 1 - doc_start
                    doc_start = i + 1

    return allowed < 0.5, loss_mask, position_ids
