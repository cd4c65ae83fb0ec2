"""The work of ``amp.initialize`` once the options are settled (Apex's ``apex.amp._initialize``).

* O2 / O3 / O5 (``cast_model_type`` set): cast the model (batch norm kept in fp32 when
  ``keep_batchnorm_fp32``), patch its ``forward`` to cast floating inputs to that type and outputs to
  fp32 (or ``cast_model_outputs``), and make its ``state_dict()`` return fp32 tensors.
* Patch every optimizer (:mod:`culmen.amp._process_optimizer`), create ``num_losses`` loss scalers.
* O1 / O4 (``patch_torch_functions``): switch on the cast engine for the models' device types and
  wrap each model's ``forward`` so casts of its parameters are cached for one forward.

Differences from Apex: models may live on the CPU (CPU autocast supports fp16 and bf16), so Apex's
"expected torch.cuda.FloatTensor" check only rejects 16-bit parameters; passing the same model or
optimizer through ``initialize`` twice raises a ``RuntimeError`` saying so; under O2 the model's
``state_dict()`` holds the fp32 master values (Apex: the 16-bit values upcast), and loading a state
dict into the model also loads the masters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from culmen.amp._amp_state import _amp_state, warn_or_err
from culmen.amp._process_optimizer import LOW_DTYPES, MASTER_OF, PENDING_MASTER, _process_optimizer
from culmen.amp.scaler import LossScaler

__all__ = ["_initialize", "applier", "to_type"]


def to_type(dtype: torch.dtype, t: Any) -> Any:
    """Cast a floating tensor to ``dtype``; other tensors pass; non-tensors with ``.to`` get ``.to(dtype)``."""
    if isinstance(t, Tensor):
        return t.to(dtype) if t.is_floating_point() else t
    return t.to(dtype)


def applier(value: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every tensor (or object with ``.to``) inside nested lists, tuples and dicts."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (str, bytes, np.ndarray)):
        return value
    if hasattr(value, "to") and not isinstance(value, type):  # custom batch classes
        return fn(value)
    if isinstance(value, Mapping):
        return {applier(k, fn): applier(v, fn) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(applier(v, fn) for v in value))
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(applier(v, fn) for v in value)
    return value


def _parallel_types() -> list[tuple[type, str]]:
    types_ = [(torch.nn.parallel.DistributedDataParallel, "torch.nn.parallel.DistributedDataParallel"),
              (torch.nn.parallel.DataParallel, "torch.nn.parallel.DataParallel")]
    try:
        from culmen.parallel import DistributedDataParallel as culmen_DDP  # type: ignore[attr-defined]

        types_.append((culmen_DDP, "culmen.parallel.DistributedDataParallel"))
    except Exception:  # culmen.parallel may not exist yet
        pass
    return types_


def check_models(models: list[torch.nn.Module]) -> None:
    """Reject parallel wrappers and models already initialized."""
    for model in models:
        for cls, name in _parallel_types():
            if isinstance(model, cls):
                raise RuntimeError(f"Incoming model is an instance of {name}. Parallel wrappers should only be "
                                   "applied to the model(s) AFTER \nthe model(s) have been returned from "
                                   "amp.initialize.")
        if getattr(model, "_amp_initialized", False):
            raise RuntimeError(f"This {type(model).__name__} was already passed through amp.initialize. Call "
                               "amp.initialize once, with every model and optimizer (lists are accepted), and use "
                               "the objects it returns.")


def check_params_fp32(models: list[torch.nn.Module]) -> None:
    """Apex's check that incoming parameters and buffers are fp32 (16-bit ones are an error)."""
    for model in models:
        for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, t in named:
                if t.is_floating_point() and t.dtype in LOW_DTYPES:
                    warn_or_err(f"Found {kind} {name} with type {t.dtype}, expected torch.float32.\n"
                                "When using amp.initialize, you do not need to call .half() on your model\n"
                                "before passing it, no matter what optimization level you choose.")


def check_optimizers(optimizers: list[Any]) -> None:
    """Reject optimizers already wrapped by ``FP16_Optimizer``."""
    from culmen.fp16_utils import FP16_Optimizer

    for optim in optimizers:
        if isinstance(optim, FP16_Optimizer):
            raise RuntimeError("An incoming optimizer is an instance of culmen.fp16_utils.FP16_Optimizer. The "
                               "optimizer(s) passed to amp.initialize() must be bare instances of either ordinary "
                               "PyTorch optimizers or culmen's fused optimizers; amp.initialize creates master "
                               "weights itself when the opt_level asks for them.")


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) or (hasattr(obj, "param_groups") and hasattr(obj, "step"))


def _model_device_types(models: list[torch.nn.Module]) -> list[str]:
    found: dict[str, None] = {}
    for model in models:
        for t in (*model.parameters(), *model.buffers()):
            found[t.device.type] = None
    if not found:
        found["cuda" if torch.cuda.is_available() else "cpu"] = None
    return list(found)


def _state_dict_hook(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """O2: 16-bit entries become fp32; a parameter with a master reports the master's exact value."""
    for name, param in module._parameters.items():
        key = prefix + name
        if param is None or key not in state_dict:
            continue
        master = MASTER_OF.get(param)
        if master is not None:
            state_dict[key] = master.detach()
        elif state_dict[key].dtype in LOW_DTYPES:
            state_dict[key] = state_dict[key].to(torch.float32)
    for name, buf in module._buffers.items():
        key = prefix + name
        if buf is not None and key in state_dict and state_dict[key].dtype in LOW_DTYPES:
            state_dict[key] = state_dict[key].to(torch.float32)


def _load_state_dict_pre_hook(module: torch.nn.Module, state_dict: Mapping, prefix: str, local_metadata: Any,
                              strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """O2: an fp32 value loaded into a 16-bit parameter also sets its master (now or when it is made)."""
    for name, param in module._parameters.items():
        key = prefix + name
        if param is None or param.dtype not in LOW_DTYPES or key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, Tensor) or value.dtype != torch.float32 or value.shape != param.shape:
            continue
        master = MASTER_OF.get(param)
        if master is not None:
            with torch.no_grad():
                master.copy_(value)
        else:
            PENDING_MASTER[param] = value.detach().clone()


def _patch_forward(model: torch.nn.Module, input_caster: Callable | None, output_caster: Callable | None,
                   cast_cache: bool = False) -> None:
    old_fwd = model.forward

    @functools.wraps(old_fwd)
    def new_fwd(*args: Any, **kwargs: Any) -> Any:
        if input_caster is not None:
            args, kwargs = applier(args, input_caster), applier(kwargs, input_caster)
        engine = _amp_state.cast_engine if cast_cache else None
        if engine is not None and engine.active:
            with engine.forward_context():
                output = old_fwd(*args, **kwargs)
        else:
            output = old_fwd(*args, **kwargs)
        return applier(output, output_caster) if output_caster is not None else output

    model.forward = new_fwd


def _initialize(models: Any, optimizers: Any, properties: Any, num_losses: int = 1,
                cast_model_outputs: torch.dtype | None = None) -> Any:
    from culmen.amp.amp import _start_casts
    from culmen.fp16_utils.fp16util import convert_network

    optimizers_was_list = False
    if optimizers is None:
        optimizers = []
    elif isinstance(optimizers, list):
        optimizers_was_list = True
        check_optimizers(optimizers)
        for i, opt in enumerate(optimizers):
            if not _is_optimizer(opt):
                raise TypeError(f"optimizers[{i}] is a {type(opt).__name__}, not an optimizer.")
    elif _is_optimizer(optimizers):
        check_optimizers([optimizers])
        optimizers = [optimizers]
    else:
        raise TypeError("optimizers must be either a single optimizer or a list of optimizers.")

    if isinstance(models, torch.nn.Module):
        models_was_list = False
        models = [models]
    elif isinstance(models, list):
        models_was_list = True
        for i, m in enumerate(models):
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"models[{i}] is a {type(m).__name__}, not a torch.nn.Module.")
    else:
        raise TypeError("models must be either a single model or a list of models.")
    if not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"num_losses must be a positive int, got {num_losses!r}")

    check_models(models)
    for opt in optimizers:
        if hasattr(opt, "_amp_stash"):
            raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    if not _amp_state.allow_incoming_model_not_fp32:
        check_params_fp32(models)

    if properties.cast_model_type:
        for model in models:
            if properties.keep_batchnorm_fp32:
                convert_network(model, properties.cast_model_type)
            else:
                model.to(properties.cast_model_type)
        input_caster = functools.partial(to_type, properties.cast_model_type)
        output_caster = functools.partial(to_type, cast_model_outputs or torch.float32)
        for model in models:
            _patch_forward(model, input_caster, output_caster)
            for module in model.modules():
                module._register_state_dict_hook(_state_dict_hook)
                module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
        for optimizer in optimizers:  # recast preexisting per-parameter state (as Apex)
            optimizer.load_state_dict(optimizer.state_dict())
    elif cast_model_outputs is not None:
        output_caster = functools.partial(to_type, cast_model_outputs)
        for model in models:
            _patch_forward(model, None, output_caster)

    for i, optimizer in enumerate(optimizers):
        optimizers[i] = _process_optimizer(optimizer, properties)

    _amp_state.loss_scalers = [
        LossScaler(properties.loss_scale, min_loss_scale=_amp_state.min_loss_scale,
                   max_loss_scale=_amp_state.max_loss_scale, hysteresis=_amp_state.hysteresis)
        for _ in range(num_losses)
    ]

    if properties.patch_torch_functions:
        from culmen.amp.handle import AmpHandle

        dtype = properties.patch_torch_functions_type or torch.float16
        engine = _start_casts(_model_device_types(models), dtype, verbose=_amp_state.verbosity == 2)
        # As Apex's initialize (which calls amp.init): the handle that owns the casts, so that
        # ``_amp_state.handle._deactivate()`` switches O1 off again.
        _amp_state.handle = AmpHandle(properties.loss_scale, True, _amp_state.verbosity == 2, engine=engine)
        for model in models:
            _patch_forward(model, None, None, cast_cache=True)

    for model in models:
        model._amp_initialized = True

    if optimizers_was_list:
        return (models, optimizers) if models_was_list else (models[0], optimizers)
    if len(optimizers) == 0:
        return models if models_was_list else models[0]
    return (models, optimizers[0]) if models_was_list else (models[0], optimizers[0])
