"""What every pipeline schedule shares: model building, one forward step, one backward step.

Apex's ``apex.transformer.pipeline_parallel.schedules.common``. The contracts:

- ``forward_step_func(batch, model)`` (or ``(batch, model, checkpoint_activations_micro_batch)``
  when a schedule passes ``num_micro_batches_with_partial_activation_checkpoints``) runs the model
  chunk and returns ``(output_tensor, loss_func)``; on the last stage ``loss_func(output_tensor)``
  returns ``(loss, loss_reduced)``, ``loss`` a scalar tensor and ``loss_reduced`` anything (usually a
  dict of detached, averaged losses), which the schedules collect and return.
- The model (after unwrapping DDP) implements ``set_input_tensor(list_of_tensors)``: a stage that is
  not the first reads its input from there, not from the batch.
- The loss each microbatch back-propagates is ``loss / num_microbatches``, so the accumulated
  gradients are those of the mean loss over the microbatches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.autograd.variable import Variable

from culmen.transformer import parallel_state
from culmen.transformer.enums import ModelType
from culmen.transformer.log_util import get_transformer_logger
from culmen.transformer.pipeline_parallel.p2p_communication import FutureTensor, _comm_device
from culmen.transformer.pipeline_parallel.utils import (
    get_model_type,
    get_num_microbatches,
    listify_model,
    unwrap_model,
)

__all__ = [
    "Batch",
    "FwdStepFunc",
    "LossFunc",
    "PipelineConfigError",
    "backward_step",
    "build_model",
    "custom_backward",
    "deallocate_output_tensor",
    "forward_step",
    "free_output_tensor",
]

_logger = get_transformer_logger(__name__)

Batch = (torch.Tensor | FutureTensor | list[torch.Tensor | FutureTensor]
         | tuple[torch.Tensor | FutureTensor, ...])
LossFunc = Callable[[torch.Tensor], torch.Tensor]
FwdStepFunc = Callable[[Batch | None, torch.nn.Module], tuple[torch.Tensor, LossFunc]]


class PipelineConfigError(ValueError, RuntimeError):
    """A schedule's arguments do not fit together (numbers that must divide, a model that must be a
    list). A ``ValueError``, and a ``RuntimeError`` as Apex raised."""


def _set_default_tp_attributes(param: torch.nn.Parameter) -> None:
    # Apex gives every parameter the tensor-parallel attributes optimizers and norm helpers read.
    try:
        from culmen.transformer.tensor_parallel.layers import (
            set_defaults_if_not_set_tensor_model_parallel_attributes,
        )
    except ModuleNotFoundError:
        for name, value in (("tensor_model_parallel", False), ("partition_dim", -1), ("partition_stride", 1)):
            if not hasattr(param, name):
                setattr(param, name, value)
    else:
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)


class _DDPGradSync:
    """Data-parallel gradient reduction for DDP-wrapped chunks driven by a pipelined schedule.

    ``torch.nn.parallel.DistributedDataParallel`` reduces gradients only for a backward whose forward
    ran outside ``no_sync`` and before the next forward; pipelined schedules run several forwards
    before their backwards, so DDP would reduce some microbatches and silently skip the others (Apex
    left that to ``custom_sync_context_handler`` / ``custom_grad_sync_func``). The schedules therefore
    run DDP chunks under ``no_sync`` and call ``all_reduce`` once at the end: one flattened all-reduce
    per (dtype, device) over each chunk's process group, averaged like DDP.
    """

    def __init__(self, chunks: list[torch.nn.parallel.DistributedDataParallel]):
        self.chunks = chunks

    @classmethod
    def for_model(cls, chunks: list[torch.nn.Module]) -> _DDPGradSync | None:
        ddp = [c for c in chunks if isinstance(c, torch.nn.parallel.DistributedDataParallel)]
        return cls(ddp) if ddp else None

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for chunk in self.chunks:
                stack.enter_context(chunk.no_sync())
            yield

    def all_reduce(self) -> None:
        for chunk in self.chunks:
            group = chunk.process_group
            world = dist.get_world_size(group)
            if world == 1:
                continue
            buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
            for p in chunk.parameters():
                if p.requires_grad and p.grad is not None:
                    buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
            for grads in buckets.values():
                flat = _flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=group)
                flat.div_(world)
                for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                    g.copy_(reduced)


class _GradSyncToggle:
    """Suppresses data-parallel gradient reduction between ``disable()`` and ``enable()`` (idempotent),
    through ``custom_sync_context_handler`` or, for DDP-wrapped chunks and no custom hooks, through
    :class:`_DDPGradSync` (whose deferred reduction ``finish`` runs once the backward passes are done)."""

    def __init__(self, chunks: list[torch.nn.Module], custom_sync_context_handler, custom_grad_sync_func) -> None:
        self.handler = custom_sync_context_handler or contextlib.nullcontext
        self.ddp: _DDPGradSync | None = None
        if custom_sync_context_handler is None and custom_grad_sync_func is None:
            self.ddp = _DDPGradSync.for_model(chunks)
            if self.ddp is not None:
                self.handler = self.ddp.no_sync
        self._context = None

    def disable(self) -> None:
        if self._context is None:
            self._context = self.handler()
            self._context.__enter__()

    def enable(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def finish(self, forward_only: bool) -> None:
        """The DDP chunks' one deferred all-reduce (nothing with custom hooks or in forward-only mode)."""
        if self.ddp is not None and not forward_only:
            self.ddp.all_reduce()


def _model_device() -> torch.device:
    # Chunks go where the pipeline's messages live (host memory for gloo, the current GPU otherwise),
    # so a received activation can enter the chunk as is.
    if parallel_state.model_parallel_is_initialized():
        return _comm_device(parallel_state.get_pipeline_model_parallel_group())
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_model(
    model_provider_func: Callable[..., torch.nn.Module],
    wrap_with_ddp: bool = True,
    virtual_pipeline_model_parallel_size: int | None = None,
    model_type: ModelType = ModelType.encoder_or_decoder,
    *args: Any,
    **kwargs: Any,
) -> list[torch.nn.Module]:
    """Build this rank's model chunk(s) for pipeline parallelism.

    ``model_provider_func(*args, **kwargs, pre_process=..., post_process=...)`` is called once per
    chunk with ``pre_process`` (the chunk holds the input embedding: first stage) and
    ``post_process`` (it holds the head and loss: last stage); encoder-decoder models
    (``model_type=ModelType.encoder_and_decoder``) also get ``add_encoder`` / ``add_decoder`` from
    the pipeline split rank.

    Args:
        model_provider_func: builds one ``nn.Module`` chunk.
        wrap_with_ddp: wrap each chunk in ``torch.nn.parallel.DistributedDataParallel`` over the
            data-parallel group.
        virtual_pipeline_model_parallel_size: chunks per stage for the interleaved schedule
            (the virtual pipeline rank is set to each chunk's index while it is built).
        model_type: ``ModelType.encoder_or_decoder`` or ``ModelType.encoder_and_decoder``.
        *args, **kwargs: passed to ``model_provider_func``.

    Returns:
        A list of chunks (one unless interleaving), moved to the device the pipeline communicates on
        (the current CUDA device; host memory with the gloo backend).
    """
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size > 1 and virtual_pipeline_model_parallel_size is not None:
        model = []
        for i in range(virtual_pipeline_model_parallel_size):
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
            # pre/post_process depend on the virtual rank just set.
            kwargs.update(pre_process=parallel_state.is_pipeline_first_stage(),
                          post_process=parallel_state.is_pipeline_last_stage())
            model.append(model_provider_func(*args, **kwargs))
    else:
        if model_type == ModelType.encoder_or_decoder:
            kwargs.update(pre_process=parallel_state.is_pipeline_first_stage(),
                          post_process=parallel_state.is_pipeline_last_stage())
        elif model_type == ModelType.encoder_and_decoder:
            pre_process = parallel_state.is_pipeline_first_stage()
            post_process = parallel_state.is_pipeline_last_stage()
            add_encoder = add_decoder = True
            if pp_size > 1:
                split_rank = parallel_state.get_pipeline_model_parallel_split_rank()
                if split_rank is None:
                    raise PipelineConfigError(
                        "Split rank needs to be specified for model with both encoder and decoder.")
                rank = parallel_state.get_pipeline_model_parallel_rank()
                pre_process = rank in (0, split_rank)
                post_process = rank in (split_rank - 1, pp_size - 1)
                add_encoder = parallel_state.is_pipeline_stage_before_split()
                add_decoder = parallel_state.is_pipeline_stage_after_split()
            kwargs.update(pre_process=pre_process, post_process=post_process,
                          add_encoder=add_encoder, add_decoder=add_decoder)
        else:
            raise ValueError(f"model_type must be a ModelType, got {model_type!r}")
        model = model_provider_func(*args, **kwargs)
        model.model_type = model_type

    if not isinstance(model, list):
        model = [model]

    for chunk in model:
        for param in chunk.parameters():
            _set_default_tp_attributes(param)

    if parallel_state.model_parallel_is_initialized() and parallel_state.get_data_parallel_rank() == 0:
        print(" > number of parameters on (tensor, pipeline) model parallel rank "
              f"({parallel_state.get_tensor_model_parallel_rank()}, "
              f"{parallel_state.get_pipeline_model_parallel_rank()}): {_calc_number_of_params(model)}", flush=True)

    device = _model_device()
    for chunk in model:
        chunk.to(device)

    if wrap_with_ddp:
        device_ids = [device.index] if device.type == "cuda" else None
        model = [
            torch.nn.parallel.DistributedDataParallel(
                chunk, device_ids=device_ids, output_device=device_ids[0] if device_ids else None,
                process_group=parallel_state.get_data_parallel_group())
            for chunk in model
        ]
    return model


def _calc_number_of_params(model: list[torch.nn.Module]) -> int:
    if not isinstance(model, list):
        raise TypeError(f"model must be a list of modules, got {type(model).__name__}")
    return sum(p.nelement() for chunk in model for p in chunk.parameters())


def _get_params_for_weight_decay_optimization(
    model: torch.nn.Module | list[torch.nn.Module],
    *,
    no_weight_decay_modules: tuple[type, ...] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two optimizer param groups: weights (with decay) and biases + norm parameters (``weight_decay=0``).

    ``no_weight_decay_modules`` defaults to ``(FusedLayerNorm,)`` (culmen's, which Apex's norms alias).
    """
    if no_weight_decay_modules is None:
        from culmen.normalization import FusedLayerNorm

        no_weight_decay_modules = (FusedLayerNorm,)
    decay: dict[str, Any] = {"params": []}
    no_decay: dict[str, Any] = {"params": [], "weight_decay": 0.0}
    for chunk in listify_model(model):
        for module in chunk.modules():
            own = [(n, p) for n, p in module._parameters.items() if p is not None]
            if isinstance(module, no_weight_decay_modules):
                no_decay["params"].extend(p for _, p in own)
            else:
                decay["params"].extend(p for n, p in own if n != "bias")
                no_decay["params"].extend(p for n, p in own if n == "bias")
    return decay, no_decay


def free_output_tensor(
    output_tensors: torch.Tensor | Sequence[torch.Tensor] | None,
    deallocate_pipeline_outputs: bool = False,
) -> None:
    """Release the memory of stage outputs already sent downstream, keeping their autograd graph.

    With ``deallocate_pipeline_outputs`` each tensor's ``.data`` becomes a 1-element tensor of the same
    dtype and device (Apex used a CUDA float32 tensor whatever the output was): only ``.grad_fn`` is
    needed later, and ``custom_backward`` back-propagates through it without the shape check.
    """
    if not deallocate_pipeline_outputs or output_tensors is None:
        return
    if isinstance(output_tensors, torch.Tensor):
        output_tensors = [output_tensors]
    for out in output_tensors:
        if out is not None:
            out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def deallocate_output_tensor(out: torch.Tensor | None, deallocate_pipeline_outputs: bool = False) -> None:
    """Megatron's name for ``free_output_tensor`` on one tensor."""
    free_output_tensor(out, deallocate_pipeline_outputs)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Back-propagate ``grad_output`` from a pseudo-freed ``output`` (see ``free_output_tensor``).

    ``torch.autograd.backward`` checks that ``grad_output`` has ``output``'s (now 1-element) shape;
    the autograd engine itself only checks it against the shape its graph recorded, so it is called
    directly. ``grad_output=None`` means a scalar loss (gradient 1).
    """
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"output must be a tensor, got {type(output).__name__}")
    if grad_output is not None and not isinstance(grad_output, torch.Tensor):
        raise TypeError(f"grad_output must be a tensor or None, got {type(grad_output).__name__}")
    if output.numel() != 1:
        raise ValueError(f"output should be pseudo-freed (1 element) before custom_backward, "
                         f"got shape {tuple(output.shape)}")
    if grad_output is None:
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)


def _autocast_device_type(model: torch.nn.Module) -> str:
    p = next(model.parameters(), None)
    if p is not None:
        return p.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def forward_step(
    forward_step_func: FwdStepFunc,
    batch: Batch | None,
    model: torch.nn.Module,
    input_tensor: torch.Tensor | FutureTensor | list | None,
    losses_reduced: list[Any],
    dtype: torch.dtype | None = None,
    disable_autocast: bool = False,
    checkpoint_activations_micro_batch: bool | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Run one microbatch through ``model`` (one chunk); on the last stage, also its loss.

    Args:
        forward_step_func: see the module docstring.
        batch: this microbatch (the first stage reads its input from it).
        model: the chunk, possibly DDP-wrapped; its unwrapped module gets ``set_input_tensor``.
        input_tensor: the activation received from the previous stage (``None`` on the first
            stage), a ``FutureTensor``, or a list of them (encoder-decoder models).
        losses_reduced: on the last stage, ``loss_func``'s second output is appended to it.
        dtype: with ``torch.half`` / ``torch.bfloat16`` (and not ``disable_autocast``) the step runs
            under ``torch.autocast`` of that dtype on the chunk's device type; otherwise under a
            disabled autocast, as Apex.
        disable_autocast: see ``dtype``.
        checkpoint_activations_micro_batch: when not ``None``, passed as the third argument of
            ``forward_step_func``.

    Returns:
        The stage output (on the last stage ``loss / num_microbatches``, a scalar); a list when
        ``input_tensor`` was a list; ``[output, encoder_hidden_state]`` for decoder stages of
        encoder-decoder models.
    """
    unwrapped_model = unwrap_model(model)
    model_type = get_model_type(unwrapped_model)
    unwrap_output_tensor = not isinstance(input_tensor, list)
    inputs = [input_tensor] if unwrap_output_tensor else input_tensor
    inputs = [x.get() if isinstance(x, FutureTensor) else x for x in inputs]

    unwrapped_model.set_input_tensor(inputs)
    enabled = not disable_autocast and dtype in (torch.half, torch.bfloat16)
    autocast_kwargs = {"dtype": dtype} if enabled else {}
    with torch.autocast(_autocast_device_type(unwrapped_model), enabled=enabled, **autocast_kwargs):
        if checkpoint_activations_micro_batch is None:
            output_tensor, loss_func = forward_step_func(batch, model)
        else:
            output_tensor, loss_func = forward_step_func(batch, model, checkpoint_activations_micro_batch)
        if parallel_state.is_pipeline_last_stage():
            loss, loss_reduced = loss_func(output_tensor)
            output_tensor = loss / get_num_microbatches()
            losses_reduced.append(loss_reduced)

    if parallel_state.is_pipeline_stage_after_split() and model_type == ModelType.encoder_and_decoder:
        # Decoder stages of an encoder-decoder model forward the encoder's hidden state as well.
        return [output_tensor, inputs[-1]]
    if unwrap_output_tensor:
        return output_tensor
    return [output_tensor]


def backward_step(
    input_tensor: torch.Tensor | FutureTensor | list | None,
    output_tensor: torch.Tensor | FutureTensor | list,
    output_tensor_grad: torch.Tensor | FutureTensor | list | None,
    model_type: ModelType,
    *,
    grad_scaler: Any | None = None,
    deallocate_pipeline_outputs: bool = False,
) -> None | torch.Tensor | list[torch.Tensor | None]:
    """Back-propagate one microbatch through its chunk; return the gradient of its input.

    Args:
        input_tensor: what ``forward_step`` received (``None`` on the first stage, or a list).
        output_tensor: what ``forward_step`` returned.
        output_tensor_grad: the gradient received from the next stage; ``None`` on the last stage,
            where ``output_tensor`` is the scalar loss (scaled by ``grad_scaler`` when given).
        model_type: the chunk's ``ModelType`` (encoder-decoder decoder stages add the gradient of
            the forwarded encoder state).
        grad_scaler: a ``torch.amp.GradScaler``-like object whose ``scale`` is applied to the loss.
        deallocate_pipeline_outputs: the output was pseudo-freed; use ``custom_backward``.

    Returns:
        The gradient of ``input_tensor`` (``None`` on the first stage), a list when
        ``input_tensor`` was a list.
    """
    unwrap_input_tensor_grad = not isinstance(input_tensor, list)
    inputs = [input_tensor] if unwrap_input_tensor_grad else input_tensor
    inputs = [x.get() if isinstance(x, FutureTensor) else x for x in inputs]
    for x in inputs:
        if x is not None:
            x.retain_grad()

    outputs = output_tensor if isinstance(output_tensor, list) else [output_tensor]
    outputs = [x.get() if isinstance(x, FutureTensor) else x for x in outputs]
    grads = output_tensor_grad if isinstance(output_tensor_grad, list) else [output_tensor_grad]
    grads = [x.get() if isinstance(x, FutureTensor) else x for x in grads]

    if grad_scaler is not None and grads[0] is None:
        outputs[0] = grad_scaler.scale(outputs[0])
    if deallocate_pipeline_outputs:
        custom_backward(outputs[0], grads[0])
    else:
        torch.autograd.backward(outputs[0], grad_tensors=grads[0])

    input_tensor_grad = [None if x is None else x.grad for x in inputs]

    if (parallel_state.get_pipeline_model_parallel_world_size() > 1
            and parallel_state.is_pipeline_stage_after_split()
            and model_type == ModelType.encoder_and_decoder
            and len(grads) > 1 and grads[1] is not None):
        input_tensor_grad[-1].add_(grads[1])

    return input_tensor_grad[0] if unwrap_input_tensor_grad else input_tensor_grad
