"""Model- and data-parallel process groups: Apex's ``apex.transformer.parallel_state``.

``initialize_model_parallel`` splits the ``torch.distributed`` world into tensor-parallel (TP),
pipeline-parallel (PP), data-parallel (DP), model-parallel (TP x PP), embedding, position-embedding,
relative-position-embedding and (with ``use_fp8_``) amax-reduction groups, with Apex's rank layout.
For ``world_size = tp * pp * dp``:

- TP groups are runs of ``tp`` consecutive ranks: ``[0..tp-1], [tp..2tp-1], ...``;
- PP groups stride by ``world_size // pp``: ``[i, i + w/pp, i + 2w/pp, ...]``;
- DP groups take, inside each block of ``w/pp`` consecutive ranks, the ranks with equal TP rank;
- a model-parallel group holds the ranks with the same DP rank across all DP groups.

With 8 ranks, tp=2, pp=2: TP ``[0,1] [2,3] [4,5] [6,7]``; PP ``[0,4] [1,5] [2,6] [3,7]``;
DP ``[0,2] [1,3] [4,6] [5,7]``; model-parallel ``[0,1,4,5] [2,3,6,7]``.

Every collective runs on ``torch.distributed``; nothing here replaces the collective engine.

Differences from Apex, on purpose:

- ``world_size % (tp * pp) != 0`` and non-positive sizes raise :class:`ModelParallelConfigError`, a
  ``ValueError`` that is also a ``RuntimeError`` (Apex raised ``RuntimeError``), naming the numbers.
- A getter used before :func:`initialize_model_parallel` raises :class:`ModelParallelNotInitializedError`,
  a ``RuntimeError`` that is also an ``AssertionError`` (Apex asserted), so code catching either works.
- ``default_backend`` / ``p2p_backend`` also accept ``"gloo"`` (CPU runs); ``None`` means the
  backend ``init_process_group`` was called with (Apex's hybrid IB/socket helper forced NCCL).
- The interleaved (virtual) pipeline needs ``pipeline_model_parallel_size_ >= 2`` (Apex demanded
  more than 2, a limit Megatron-LM has since dropped).
- ``get_data_parallel_src_rank`` returns the first rank of the caller's DP group for any layout
  (Apex's modulo formula was wrong once pp > 1 and dp > 1).
- ``destroy_model_parallel`` also clears the rank lists and the split rank, so a second
  ``initialize_model_parallel`` with other sizes starts clean.

Ranks and world sizes are cached at initialization, so the getters tensor-parallel layers call on
every forward cost a global lookup, not a call into ``torch.distributed``.

A rank that dies makes its peers' next collective fail after the process group's timeout (the
``timeout`` passed to ``init_process_group``; with NCCL set ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``,
the default since torch 2.2, so the failure surfaces as an exception instead of a hang).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from culmen.transformer.log_util import get_transformer_logger

_logger = get_transformer_logger(__name__)


class ExperimentalWarning(Warning):
    """Warned when an experimental backend (UCC) is requested, as Apex does."""


class ModelParallelConfigError(ValueError, RuntimeError):
    """Bad sizes for :func:`initialize_model_parallel` (a ``ValueError``; also a ``RuntimeError`` as in Apex)."""


class ModelParallelNotInitializedError(RuntimeError, AssertionError):
    """A group or rank was asked for before :func:`initialize_model_parallel` (Apex asserted)."""


HAS_UCC: bool = bool(getattr(dist, "is_ucc_available", lambda: False)()) if dist.is_available() else False

# Process groups the calling rank belongs to.
_TENSOR_MODEL_PARALLEL_GROUP = None
_PIPELINE_MODEL_PARALLEL_GROUP = None
_MODEL_PARALLEL_GROUP = None
_EMBEDDING_GROUP = None
_POSITION_EMBEDDING_GROUP = None
_ENCODER_RELATIVE_POSITION_EMBEDDING_GROUP = None
_DECODER_RELATIVE_POSITION_EMBEDDING_GROUP = None
_DATA_PARALLEL_GROUP = None
_AMAX_REDUCTION_GROUP = None

_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK: int | None = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE: int | None = None
_PIPELINE_MODEL_PARALLEL_SPLIT_RANK: int | None = None

# Overrides set through the set_* functions (Apex's "change the mpu sizes on the fly").
_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE: int | None = None
_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE: int | None = None
_MPU_TENSOR_MODEL_PARALLEL_RANK: int | None = None
_MPU_PIPELINE_MODEL_PARALLEL_RANK: int | None = None

# Global ranks of the caller's groups (lists), fixed at initialization.
_EMBEDDING_GLOBAL_RANKS: list[int] | None = None
_POSITION_EMBEDDING_GLOBAL_RANKS: list[int] | None = None
_ENCODER_RELATIVE_POSITION_EMBEDDING_GLOBAL_RANKS: list[int] | None = None
_DECODER_RELATIVE_POSITION_EMBEDDING_GLOBAL_RANKS: list[int] | None = None
_PIPELINE_GLOBAL_RANKS: list[int] | None = None
_DATA_PARALLEL_GLOBAL_RANKS: list[int] | None = None
_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS: list[int] | None = None

# Sizes and ranks cached at initialization: the hot getters read these.
_GLOBAL_RANK: int | None = None
_TP_WORLD_SIZE: int | None = None
_TP_RANK: int | None = None
_PP_WORLD_SIZE: int | None = None
_PP_RANK: int | None = None
_DP_WORLD_SIZE: int | None = None
_DP_RANK: int | None = None

_VALID_BACKENDS = ("nccl", "ucc", "gloo", "mpi")


def _not_initialized(what: str) -> ModelParallelNotInitializedError:
    return ModelParallelNotInitializedError(
        f"{what} is not initialized: call culmen.transformer.parallel_state.initialize_model_parallel() "
        "(after torch.distributed.init_process_group) first")


def is_unitialized() -> bool:
    """True while no data-parallel group exists (Apex's spelling, for code that runs with or without it)."""
    return _DATA_PARALLEL_GROUP is None


def _set_nccl_socket_envs() -> None:
    if os.getenv("NCCL_SOCKET_IFNAME") is None:
        raise RuntimeError("NCCL_SOCKET_IFNAME was not set: socket NCCL groups need it")
    os.environ["NCCL_NET"] = "Socket"


def _set_nccl_ib_envs() -> None:
    os.environ["NCCL_NET"] = "IB"


def _warm_nccl_group(group) -> None:
    # NCCL reads NCCL_NET when the communicator is created, i.e. on the first collective, so run one
    # while the environment still holds the network this group must use.
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize()


def new_process_group(ranks: Sequence[int], backend: str | None):
    """Create a process group over ``ranks``; with NCCL and ``NUM_GPUS_PER_IB_BLOCK`` set, choose the network.

    When ``NUM_GPUS_PER_IB_BLOCK`` is set and the backend is NCCL, a group whose ranks all sit in one
    block of that many GPUs is created with ``NCCL_NET=IB``, any other with ``NCCL_NET=Socket`` (which
    needs ``NCCL_SOCKET_IFNAME``), as Apex does for hybrid IB / TCP clusters. Otherwise this is
    ``torch.distributed.new_group(ranks, backend=backend)``.
    """
    ranks = list(ranks)
    block = os.getenv("NUM_GPUS_PER_IB_BLOCK")
    effective = backend if backend is not None else dist.get_backend()
    if block is not None and str(effective).lower() == "nccl":
        size = int(block)
        same_block = len({r // size for r in ranks}) == 1
        if same_block:
            _set_nccl_ib_envs()
        else:
            _set_nccl_socket_envs()
        group = dist.new_group(ranks, backend=backend)
        if dist.get_rank() in ranks:
            _warm_nccl_group(group)
        return group
    return dist.new_group(ranks, backend=backend)


def _check_size(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelParallelConfigError(f"{name} must be a positive int, got {value!r}")


def initialize_model_parallel(
    tensor_model_parallel_size_: int = 1,
    pipeline_model_parallel_size_: int = 1,
    virtual_pipeline_model_parallel_size_: int | None = None,
    pipeline_model_parallel_split_rank_: int | None = None,
    use_fp8_: bool = False,
    init_mpi_proc_group: bool = False,
    *,
    default_backend: str | None = None,
    p2p_backend: str | None = None,
) -> None:
    """Build the model- and data-parallel groups on the initialized default process group.

    Args:
        tensor_model_parallel_size_: ranks that split each layer's tensors (clamped to the world size).
        pipeline_model_parallel_size_: pipeline stages (clamped to the world size).
        virtual_pipeline_model_parallel_size_: model chunks per stage for the interleaved schedule;
            the virtual rank starts at 0.
        pipeline_model_parallel_split_rank_: for encoder-decoder models, the first pipeline rank of
            the decoder; it joins the embedding and position-embedding groups.
        use_fp8_: also build the amax-reduction groups (TP x DP ranks of one pipeline stage).
        init_mpi_proc_group: also create an MPI process group (for UCX-based communication).
        default_backend: backend of every group except the pipeline ones; ``None`` means the
            default group's backend.
        p2p_backend: backend of the pipeline, embedding and position-embedding groups.

    Raises:
        ModelParallelConfigError (ValueError): sizes are not positive ints, ``world_size`` is not
            divisible by ``tp * pp``, or the split rank / virtual size do not fit the pipeline.
        RuntimeError: ``torch.distributed`` is not initialized, or the groups already exist.
        ImportError: ``"ucc"`` was requested but torch has no UCC.
    """
    global _TENSOR_MODEL_PARALLEL_GROUP, _PIPELINE_MODEL_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP
    global _EMBEDDING_GROUP, _POSITION_EMBEDDING_GROUP, _DATA_PARALLEL_GROUP, _AMAX_REDUCTION_GROUP
    global _ENCODER_RELATIVE_POSITION_EMBEDDING_GROUP, _DECODER_RELATIVE_POSITION_EMBEDDING_GROUP
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    global _PIPELINE_MODEL_PARALLEL_SPLIT_RANK
    global _EMBEDDING_GLOBAL_RANKS, _POSITION_EMBEDDING_GLOBAL_RANKS, _PIPELINE_GLOBAL_RANKS
    global _ENCODER_RELATIVE_POSITION_EMBEDDING_GLOBAL_RANKS, _DECODER_RELATIVE_POSITION_EMBEDDING_GLOBAL_RANKS
    global _DATA_PARALLEL_GLOBAL_RANKS, _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS
    global _GLOBAL_RANK, _TP_WORLD_SIZE, _TP_RANK, _PP_WORLD_SIZE, _PP_RANK, _DP_WORLD_SIZE, _DP_RANK

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("initialize_model_parallel needs torch.distributed.init_process_group() to have run")
    for name, backend in (("default_backend", default_backend), ("p2p_backend", p2p_backend)):
        if backend is not None and backend not in _VALID_BACKENDS:
            raise ValueError(f"{name} must be None or one of {_VALID_BACKENDS}, got {backend!r}")
    if "ucc" in (default_backend, p2p_backend):
        if not HAS_UCC:
            raise ImportError("the 'ucc' backend needs a torch build with UCC enabled")
        warnings.warn("`ucc` backend support is experimental", ExperimentalWarning, stacklevel=2)
    if default_backend == "ucc":
        warnings.warn("UCC as `default_backend` is not well verified", ExperimentalWarning, stacklevel=2)
    _check_size("tensor_model_parallel_size_", tensor_model_parallel_size_)
    _check_size("pipeline_model_parallel_size_", pipeline_model_parallel_size_)
    _check_size("virtual_pipeline_model_parallel_size_", virtual_pipeline_model_parallel_size_, allow_none=True)
    if _DATA_PARALLEL_GROUP is not None or _TENSOR_MODEL_PARALLEL_GROUP is not None:
        raise RuntimeError("model parallel groups are already initialized: call destroy_model_parallel() first")

    world_size = dist.get_world_size()
    tp = min(tensor_model_parallel_size_, world_size)
    pp = min(pipeline_model_parallel_size_, world_size)
    if world_size % (tp * pp) != 0:
        raise ModelParallelConfigError(
            f"world_size ({world_size}) is not divisible by tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp}) = {tp * pp}")
    dp = world_size // (tp * pp)
    if virtual_pipeline_model_parallel_size_ is not None and pp < 2:
        raise ModelParallelConfigError(
            f"virtual_pipeline_model_parallel_size_ ({virtual_pipeline_model_parallel_size_}) needs "
            f"pipeline_model_parallel_size_ >= 2, got {pp}")
    split = pipeline_model_parallel_split_rank_
    if split is not None and (isinstance(split, bool) or not isinstance(split, int) or not 0 <= split < pp):
        raise ModelParallelConfigError(
            f"pipeline_model_parallel_split_rank_ must be an int in [0, {pp}) "
            f"(pipeline_model_parallel_size_={pp}), got {split!r}")

    rank = dist.get_rank()
    if rank == 0:
        _logger.info("> initializing tensor model parallel with size %d", tp)
        _logger.info("> initializing pipeline model parallel with size %d", pp)
        _logger.info("> initializing data parallel with size %d", dp)

    # Restore NCCL_NET afterwards: new_process_group may flip it per group.
    saved_nccl_net = os.environ.get("NCCL_NET")
    try:
        stage_size = world_size // pp  # ranks per pipeline stage (= tp * dp)

        # Data-parallel groups: inside each pipeline stage's block, the ranks sharing a TP rank.
        all_dp_ranks: list[list[int]] = []
        for stage in range(pp):
            start = stage * stage_size
            for j in range(tp):
                ranks = list(range(start + j, start + stage_size, tp))
                all_dp_ranks.append(ranks)
                group = new_process_group(ranks, default_backend)
                if rank in ranks:
                    _DATA_PARALLEL_GROUP = group
                    _DATA_PARALLEL_GLOBAL_RANKS = ranks

        if use_fp8_:
            # Amax reduction spans one pipeline stage's TP x DP ranks (consecutive blocks).
            for stage in range(pp):
                ranks = list(range(stage * stage_size, (stage + 1) * stage_size))
                group = dist.new_group(ranks, backend=default_backend)
                if rank in ranks:
                    _AMAX_REDUCTION_GROUP = group

        # Model-parallel groups: the i-th member of every DP group.
        for i in range(dp):
            ranks = [dp_ranks[i] for dp_ranks in all_dp_ranks]
            group = new_process_group(ranks, default_backend)
            if rank in ranks:
                _MODEL_PARALLEL_GROUP = group

        # Tensor-parallel groups: consecutive runs of tp ranks.
        for i in range(world_size // tp):
            ranks = list(range(i * tp, (i + 1) * tp))
            group = new_process_group(ranks, default_backend)
            if rank in ranks:
                _TENSOR_MODEL_PARALLEL_GROUP = group
                _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = ranks

        # Pipeline groups (strided) and, per pipeline, the embedding-sharing groups.
        for i in range(stage_size):
            ranks = list(range(i, world_size, stage_size))
            group = new_process_group(ranks, p2p_backend)
            if rank in ranks:
                _PIPELINE_MODEL_PARALLEL_GROUP = group
                _PIPELINE_GLOBAL_RANKS = ranks
            if len(ranks) > 1:
                # First and last stage share the word embedding; the first holds position embeddings.
                embedding_ranks = [ranks[0], ranks[-1]]
                position_ranks = [ranks[0]]
                encoder_rel_ranks = [ranks[0]]
                decoder_rel_ranks = [ranks[0]]
                if split is not None:
                    encoder_rel_ranks = ranks[:split]
                    decoder_rel_ranks = ranks[split:]
                    if ranks[split] not in embedding_ranks:
                        embedding_ranks = [ranks[0], ranks[split], ranks[-1]]
                    if ranks[split] not in position_ranks:
                        position_ranks = [ranks[0], ranks[split]]
            else:
                embedding_ranks = position_ranks = encoder_rel_ranks = decoder_rel_ranks = ranks

            group = new_process_group(embedding_ranks, p2p_backend)
            if rank in embedding_ranks:
                _EMBEDDING_GROUP = group
            if rank in ranks:
                _EMBEDDING_GLOBAL_RANKS = embedding_ranks

            group = new_process_group(position_ranks, p2p_backend)
            if rank in position_ranks:
                _POSITION_EMBEDDING_GROUP = group
            if rank in ranks:
                _POSITION_EMBEDDING_GLOBAL_RANKS = position_ranks

            # encoder_rel_ranks is empty only for split == 0, where Apex creates no group.
            if encoder_rel_ranks:
                group = new_process_group(encoder_rel_ranks, p2p_backend)
                if rank in encoder_rel_ranks:
                    _ENCODER_RELATIVE_POSITION_EMBEDDING_GROUP = group
            if rank in ranks:
                _ENCODER_RELATIVE_POSITION_EMBEDDING_GLOBAL_RANKS = encoder_rel_ranks

            if decoder_rel_ranks:
                group = new_process_group(decoder_rel_ranks, p2p_backend)
                if rank in decoder_rel_ranks:
                    _DECODER_RELATIVE_POSITION_EMBEDDING_GROUP = group
            if rank in ranks:
                _DECODER_RELATIVE_POSITION_EMBEDDING_GLOBAL_RANKS = decoder_rel_ranks

        if init_mpi_proc_group:
            dist.new_group(backend="mpi")
    finally:
        if saved_nccl_net is None:
            os.environ.pop("NCCL_NET", None)
        else:
            os.environ["NCCL_NET"] = saved_nccl_net

    if virtual_pipeline_model_parallel_size_ is not None:
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size_
    if split is not None:
        _PIPELINE_MODEL_PARALLEL_SPLIT_RANK = split

    _GLOBAL_RANK = rank
    _TP_WORLD_SIZE, _TP_RANK = tp, _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS.index(rank)
    _PP_WORLD_SIZE, _PP_RANK = pp, _PIPELINE_GLOBAL_RANKS.index(rank)
    _DP_WORLD_SIZE, _DP_RANK = dp, _DATA_PARALLEL_GLOBAL_RANKS.index(rank)


def get_rank_info() -> tuple[int, int, int, int | None]:
    """``(data, tensor, pipeline, virtual pipeline)`` parallel ranks, or ``(0, 0, 0, 0)`` before initialization."""
    if model_parallel_is_initialized():
        return (get_data_parallel_rank(), get_tensor_model_parallel_rank(),
                get_pipeline_model_parallel_rank(), get_virtual_pipeline_model_parallel_rank())
    return (0, 0, 0, 0)


def model_parallel_is_initialized() -> bool:
    """True once the tensor, pipeline and data parallel groups exist."""
    return (_TENSOR_MODEL_PARALLEL_GROUP is not None and _PIPELINE_MODEL_PARALLEL_GROUP is not None
            and _DATA_PARALLEL_GROUP is not None)


def get_model_parallel_group():
    """The caller's model-parallel group (its TP x PP ranks)."""
    if _MODEL_PARALLEL_GROUP is None:
        raise _not_initialized("model parallel group")
    return _MODEL_PARALLEL_GROUP


def get_tensor_model_parallel_group():
    """The caller's tensor-parallel group."""
    if _TENSOR_MODEL_PARALLEL_GROUP is None:
        raise _not_initialized("tensor model parallel group")
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_pipeline_model_parallel_group():
    """The caller's pipeline-parallel group."""
    if _PIPELINE_MODEL_PARALLEL_GROUP is None:
        raise _not_initialized("pipeline model parallel group")
    return _PIPELINE_MODEL_PARALLEL_GROUP


def get_data_parallel_group():
    """The caller's data-parallel group."""
    if _DATA_PARALLEL_GROUP is None:
        raise _not_initialized("data parallel group")
    return _DATA_PARALLEL_GROUP


def get_amax_reduction_group():
    """The caller's amax-reduction group (built only with ``use_fp8_=True``)."""
    if _AMAX_REDUCTION_GROUP is None:
        raise _not_initialized("AMAX reduction group (initialize_model_parallel(..., use_fp8_=True))")
    return _AMAX_REDUCTION_GROUP


def get_embedding_group():
    """The group of the first and last pipeline stages (and the split stage) sharing the word embedding."""
    if _EMBEDDING_GROUP is None:
        raise _not_initialized("embedding group")
    return _EMBEDDING_GROUP


def get_position_embedding_group():
    """The group of the stages holding position embeddings (first, and the split stage)."""
    if _POSITION_EMBEDDING_GROUP is None:
        raise _not_initialized("position embedding group")
    return _POSITION_EMBEDDING_GROUP


def get_encoder_relative_position_embedding_group():
    """The group of the encoder stages holding relative position embeddings."""
    if _ENCODER_RELATIVE_POSITION_EMBEDDING_GROUP is None:
        raise _not_initialized("encoder relative position embedding group")
    return _ENCODER_RELATIVE_POSITION_EMBEDDING_GROUP


def get_decoder_relative_position_embedding_group():
    """The group of the decoder stages holding relative position embeddings."""
    if _DECODER_RELATIVE_POSITION_EMBEDDING_GROUP is None:
        raise _not_initialized("decoder relative position embedding group")
    return _DECODER_RELATIVE_POSITION_EMBEDDING_GROUP


def _global_rank() -> int:
    return _GLOBAL_RANK if _GLOBAL_RANK is not None else dist.get_rank()


def _ranks_or_raise(ranks: list[int] | None, what: str) -> list[int]:
    if ranks is None:
        raise _not_initialized(what)
    return ranks


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """Whether the caller holds a copy of the word embedding.

    Without ``ignore_virtual``, the first rank counts only on its first virtual chunk and the last
    rank only on its last one.
    """
    ranks = _ranks_or_raise(_EMBEDDING_GLOBAL_RANKS, "embedding group")
    rank = _global_rank()
    if rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False)
    return True


def is_rank_in_position_embedding_group() -> bool:
    """Whether the caller holds a copy of the position embedding."""
    return _global_rank() in _ranks_or_raise(_POSITION_EMBEDDING_GLOBAL_RANKS, "position embedding group")


def is_rank_in_encoder_relative_position_embedding_group() -> bool:
    """Whether the caller holds the encoder's relative position embedding."""
    ranks = _ranks_or_raise(_ENCODER_RELATIVE_POSITION_EMBEDDING_GLOBAL_RANKS,
                            "encoder relative position embedding group")
    return _global_rank() in ranks


def is_rank_in_decoder_relative_position_embedding_group() -> bool:
    """Whether the caller holds the decoder's relative position embedding."""
    ranks = _ranks_or_raise(_DECODER_RELATIVE_POSITION_EMBEDDING_GLOBAL_RANKS,
                            "decoder relative position embedding group")
    return _global_rank() in ranks


def is_pipeline_stage_before_split(rank: int | None = None) -> bool:
    """Whether pipeline rank ``rank`` (default: the caller's) runs the encoder of an encoder-decoder model.

    True with a single stage or without a split rank.
    """
    if get_pipeline_model_parallel_world_size() == 1:
        return True
    if rank is None:
        rank = get_pipeline_model_parallel_rank()
    if _PIPELINE_MODEL_PARALLEL_SPLIT_RANK is None:
        return True
    return rank < _PIPELINE_MODEL_PARALLEL_SPLIT_RANK


def is_pipeline_stage_after_split(rank: int | None = None) -> bool:
    """Whether pipeline rank ``rank`` (default: the caller's) runs the decoder of an encoder-decoder model.

    True with a single stage or without a split rank.
    """
    if get_pipeline_model_parallel_world_size() == 1:
        return True
    if rank is None:
        rank = get_pipeline_model_parallel_rank()
    if _PIPELINE_MODEL_PARALLEL_SPLIT_RANK is None:
        return True
    return rank >= _PIPELINE_MODEL_PARALLEL_SPLIT_RANK


def is_pipeline_stage_at_split() -> bool:
    """Whether the caller runs the encoder and the next stage the decoder (the last encoder stage)."""
    rank = get_pipeline_model_parallel_rank()
    return is_pipeline_stage_before_split(rank) and is_pipeline_stage_after_split(rank + 1)


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """Override the tensor-parallel world size the getters report (``None`` removes the override)."""
    global _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the pipeline-parallel world size the getters report (``None`` removes the override)."""
    global _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Override the tensor-parallel rank the getters report (``None`` removes the override)."""
    global _MPU_TENSOR_MODEL_PARALLEL_RANK
    _MPU_TENSOR_MODEL_PARALLEL_RANK = rank


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Override the pipeline-parallel rank the getters report (``None`` removes the override)."""
    global _MPU_PIPELINE_MODEL_PARALLEL_RANK
    _MPU_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_tensor_model_parallel_world_size() -> int:
    """Number of ranks in the caller's tensor-parallel group."""
    if _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    if _TP_WORLD_SIZE is None:
        raise _not_initialized("tensor model parallel group")
    return _TP_WORLD_SIZE


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    if _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    if _PP_WORLD_SIZE is None:
        raise _not_initialized("pipeline model parallel group")
    return _PP_WORLD_SIZE


def get_tensor_model_parallel_rank() -> int:
    """The caller's rank inside its tensor-parallel group."""
    if _MPU_TENSOR_MODEL_PARALLEL_RANK is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_RANK
    if _TP_RANK is None:
        raise _not_initialized("tensor model parallel group")
    return _TP_RANK


def get_pipeline_model_parallel_rank() -> int:
    """The caller's pipeline stage."""
    if _MPU_PIPELINE_MODEL_PARALLEL_RANK is not None:
        return _MPU_PIPELINE_MODEL_PARALLEL_RANK
    if _PP_RANK is None:
        raise _not_initialized("pipeline model parallel group")
    return _PP_RANK


def get_pipeline_model_parallel_split_rank() -> int | None:
    """The first decoder stage of an encoder-decoder pipeline, or ``None``."""
    return _PIPELINE_MODEL_PARALLEL_SPLIT_RANK


def set_pipeline_model_parallel_split_rank(pipeline_model_parallel_split_rank: int | None) -> None:
    """Set the first decoder stage (changes the split predicates, not the groups)."""
    global _PIPELINE_MODEL_PARALLEL_SPLIT_RANK
    _PIPELINE_MODEL_PARALLEL_SPLIT_RANK = pipeline_model_parallel_split_rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """Whether the caller is pipeline stage 0 (and, unless ``ignore_virtual``, on virtual chunk 0)."""
    if (not ignore_virtual and _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE is not None
            and _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK != 0):
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """Whether the caller is the last pipeline stage (and, unless ``ignore_virtual``, on its last chunk)."""
    vsize = _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    if not ignore_virtual and vsize is not None and _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK != vsize - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The model chunk the interleaved schedule is running (``None`` without a virtual pipeline)."""
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Set the model chunk the interleaved schedule is running."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Model chunks per pipeline stage (``None`` without a virtual pipeline)."""
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def set_virtual_pipeline_model_parallel_world_size(size: int | None) -> None:
    """Set the number of model chunks per pipeline stage."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = size


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in the caller's group (the source of TP broadcasts)."""
    size = get_tensor_model_parallel_world_size()
    return (_global_rank() // size) * size


def get_data_parallel_src_rank() -> int:
    """Global rank of data-parallel rank 0 in the caller's group."""
    return _ranks_or_raise(_DATA_PARALLEL_GLOBAL_RANKS, "data parallel group")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of the caller's pipeline."""
    return _ranks_or_raise(_PIPELINE_GLOBAL_RANKS, "pipeline model parallel group")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of the caller's pipeline."""
    ranks = _ranks_or_raise(_PIPELINE_GLOBAL_RANKS, "pipeline model parallel group")
    return ranks[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wrapping from the last stage to the first)."""
    ranks = _ranks_or_raise(_PIPELINE_GLOBAL_RANKS, "pipeline model parallel group")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % get_pipeline_model_parallel_world_size()]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (wrapping from the first stage to the last)."""
    ranks = _ranks_or_raise(_PIPELINE_GLOBAL_RANKS, "pipeline model parallel group")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % get_pipeline_model_parallel_world_size()]


def get_data_parallel_world_size() -> int:
    """Number of ranks in the caller's data-parallel group."""
    if _DP_WORLD_SIZE is None:
        raise _not_initialized("data parallel group")
    return _DP_WORLD_SIZE


def get_data_parallel_rank() -> int:
    """The caller's rank inside its data-parallel group."""
    if _DP_RANK is None:
        raise _not_initialized("data parallel group")
    return _DP_RANK


def destroy_model_parallel() -> None:
    """Forget every group, rank list, override and virtual/split setting (the groups themselves stay alive
    in ``torch.distributed`` until ``destroy_process_group``)."""
    g = globals()
    for name in _STATE_NAMES:
        g[name] = None


# Every module-level setting destroy_model_parallel clears.
_STATE_NAMES = (
    "_TENSOR_MODEL_PARALLEL_GROUP", "_PIPELINE_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP",
    "_EMBEDDING_GROUP", "_POSITION_EMBEDDING_GROUP", "_ENCODER_RELATIVE_POSITION_EMBEDDING_GROUP",
    "_DECODER_RELATIVE_POSITION_EMBEDDING_GROUP", "_DATA_PARALLEL_GROUP", "_AMAX_REDUCTION_GROUP",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_PIPELINE_MODEL_PARALLEL_SPLIT_RANK", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK", "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
    "_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS", "_ENCODER_RELATIVE_POSITION_EMBEDDING_GLOBAL_RANKS",
    "_DECODER_RELATIVE_POSITION_EMBEDDING_GLOBAL_RANKS", "_PIPELINE_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "_GLOBAL_RANK", "_TP_WORLD_SIZE", "_TP_RANK", "_PP_WORLD_SIZE",
    "_PP_RANK", "_DP_WORLD_SIZE", "_DP_RANK",
)
