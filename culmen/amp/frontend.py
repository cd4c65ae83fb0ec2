"""``amp.initialize``, the opt levels and their ``Properties``, ``amp.state_dict`` / ``load_state_dict``.

Opt levels (Apex's defaults; O4 / O5 are ROCm Apex's bf16 levels):

====  ===============  =====================  ===================  ==============  ==========
      cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale
====  ===============  =====================  ===================  ==============  ==========
O0    float32          False                  None                 False           1.0
O1    None             True (fp16 casts)      None                 None            "dynamic"
O2    float16          False                  True                 True            "dynamic"
O3    float16          False                  False                False           1.0
O4    None             True (bf16 casts)      None                 None            1.0
O5    bfloat16         False                  True                 True            1.0
====  ===============  =====================  ===================  ==============  ==========

Any keyword that is not None overrides the level's default, through the same checks as Apex: an
override that contradicts the level raises ``RuntimeError`` (only printed when
``amp._amp_state.hard_override`` is True), ``keep_batchnorm_fp32`` also accepts the strings
``"True"`` / ``"False"``, ``loss_scale`` accepts ``"dynamic"`` or anything ``float()`` accepts.

culmen additions, all keyword-only: ``patch_torch_functions_type`` (ROCm's name: the O1 cast dtype;
culmen also accepts ``torch.bfloat16`` under O1, where ROCm required O4) and ``hysteresis`` (see
:class:`~culmen.amp.scaler.LossScaler`); :func:`deinitialize` undoes the global part of
``initialize`` (O1 casting, loss scalers), for notebooks and tests.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from typing import Any

import torch

from culmen.amp._amp_state import _amp_state, maybe_print, warn_or_err
from culmen.amp._initialize import _initialize

__all__ = ["O0", "O1", "O2", "O3", "O4", "O5", "Properties", "deinitialize", "initialize", "load_state_dict",
           "opt_levels", "state_dict"]

_O1_LIKE = ("O1", "O4")


def _loss_scale(value: Any) -> float | str:
    """``loss_scale`` as amp keeps it: ``"dynamic"`` or a positive finite float (numeric strings, as
    Apex accepted them, included). Anything else is an error naming the argument."""
    if isinstance(value, str) and value == "dynamic":
        return value
    if isinstance(value, bool):
        raise TypeError(f"loss_scale must be 'dynamic' or a number, got {value!r}")
    try:
        scale = float(value)
    except TypeError:
        raise TypeError(f"loss_scale must be 'dynamic' or a number, got {type(value).__name__} {value!r}") from None
    except ValueError:
        raise ValueError(f"loss_scale must be 'dynamic' or a number, got {value!r}") from None
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"loss_scale must be 'dynamic' or a positive finite number, got {value!r}")
    return scale


class Properties:
    """The amp options of one ``initialize`` call; assignments are checked against the opt level."""

    def __init__(self) -> None:
        self.options: dict[str, Any] = {
            "enabled": False,
            "opt_level": None,
            "cast_model_type": None,
            "patch_torch_functions": False,
            "patch_torch_functions_type": None,
            "keep_batchnorm_fp32": None,
            "master_weights": None,
            "loss_scale": 1.0,
        }

    def _update_options_dict(self, new_options: Any) -> None:
        """Set several options without the consistency checks (Apex's escape hatch)."""
        items = new_options.items() if hasattr(new_options, "items") else new_options
        for k, v in items:
            if k not in self.options:
                raise ValueError(f"Tried to set unexpected option {k}")
            self.options[k] = v

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options")
        if options is not None and name in options:
            return options[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        if "options" not in self.__dict__ or name not in self.options:
            super().__setattr__(name, value)
            return
        level = self.opt_level
        if name == "cast_model_type":
            if level in _O1_LIKE and value is not None and value is not False and value is not torch.float32:
                warn_or_err("O1 inserts casts around Torch functions rather than model weights, so with O1, the "
                            "model weights themselves should remain FP32. If you wish to cast the model to a "
                            "different type, use opt_level='O2' or 'O3' (for bf16 casts under O1, use opt_level="
                            f"'O4' or patch_torch_functions_type=torch.bfloat16). cast_model_type was {value}")
            self.options[name] = value
        elif name == "patch_torch_functions":
            if level not in _O1_LIKE and value:
                warn_or_err("Currently, patch_torch_functions=True should only be set by selecting "
                            "opt_level='O1' or 'O4'.")
            self.options[name] = value
        elif name == "patch_torch_functions_type":
            if value is not None and value not in (torch.float16, torch.bfloat16):
                warn_or_err(f"patch_torch_functions_type must be torch.float16 or torch.bfloat16, got {value}.")
            elif value is not None and level not in _O1_LIKE:
                warn_or_err("patch_torch_functions_type should only be set with opt_level='O1' or 'O4'.")
            self.options[name] = value
        elif name == "keep_batchnorm_fp32":
            if level in _O1_LIKE and value is not None:
                warn_or_err("With opt_level O1, batchnorm functions are automatically patched to run in FP32, so "
                            f"keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was {value}")
            if value == "False":
                self.options[name] = False
            elif value == "True":
                self.options[name] = True
            else:
                if not (value is True or value is False or value is None):
                    raise AssertionError("keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', "
                                         f"or None, found keep_batchnorm_fp32={value}")
                self.options[name] = value
        elif name == "master_weights":
            if level in _O1_LIKE and value is not None:
                warn_or_err("It doesn't make sense to use master_weights with O1. With O1, your model weights "
                            "themselves should be FP32.")
            self.options[name] = value
        elif name == "loss_scale":
            self.options[name] = _loss_scale(value)
        else:
            self.options[name] = value

    def __repr__(self) -> str:
        return f"Properties({self.options})"


class _OptLevel:
    brief = ""
    more = ""
    defaults: dict[str, Any] = {}

    def __call__(self, properties: Properties) -> Properties:
        for k, v in self.defaults.items():
            setattr(properties, k, v)
        return properties


class O0(_OptLevel):
    """Pure fp32 training."""

    brief = "O0:  Pure FP32 training."
    more = "The model is kept (cast) in fp32 and no op is cast. A baseline for accuracy."
    defaults = dict(enabled=True, opt_level="O0", cast_model_type=torch.float32, patch_torch_functions=False,
                    patch_torch_functions_type=None, keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0)


class O1(_OptLevel):
    """Per-op casts (torch.autocast with Apex's lists); fp32 weights; dynamic loss scaling."""

    brief = "O1:  Insert automatic casts around PyTorch functions and Tensor methods."
    more = ("Weights stay fp32. Tensor-core friendly ops (matmul, conv, linear) run in fp16, ops that need the range "
            "of fp32 (softmax, norms, losses, exp, sums) run in fp32. The safest mixed-precision level.")
    defaults = dict(enabled=True, opt_level="O1", cast_model_type=None, patch_torch_functions=True,
                    patch_torch_functions_type=torch.float16, keep_batchnorm_fp32=None, master_weights=None,
                    loss_scale="dynamic")


class O2(_OptLevel):
    """fp16 model (batch norm fp32), fp32 master weights, dynamic loss scaling."""

    brief = "O2:  FP16 training with FP32 batchnorm and FP32 master weights."
    more = ("The model is cast to fp16 except batch norms; inputs are cast by a patched forward; the optimizers "
            "update fp32 master weights that are copied back into the model after every step.")
    defaults = dict(enabled=True, opt_level="O2", cast_model_type=torch.float16, patch_torch_functions=False,
                    patch_torch_functions_type=None, keep_batchnorm_fp32=True, master_weights=True,
                    loss_scale="dynamic")


class O3(_OptLevel):
    """Pure fp16 training (a speed ceiling)."""

    brief = "O3:  Pure FP16 training."
    more = "The whole model is cast to fp16, inputs too. Useful as a performance ceiling."
    defaults = dict(enabled=True, opt_level="O3", cast_model_type=torch.float16, patch_torch_functions=False,
                    patch_torch_functions_type=None, keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0)


class O4(_OptLevel):
    """O1 with bf16 casts and no loss scaling (ROCm Apex)."""

    brief = "O4:  Insert automatic casts around PyTorch functions and Tensor methods (bf16)."
    more = "Like O1 with bfloat16 instead of float16; bf16 has fp32's range, so the loss is not scaled."
    defaults = dict(enabled=True, opt_level="O4", cast_model_type=None, patch_torch_functions=True,
                    patch_torch_functions_type=torch.bfloat16, keep_batchnorm_fp32=None, master_weights=None,
                    loss_scale=1.0)


class O5(_OptLevel):
    """O2 with a bf16 model and no loss scaling (ROCm Apex)."""

    brief = "O5:  BF16 training with FP32 batchnorm and FP32 master weights."
    more = "Like O2 with bfloat16 instead of float16; the loss is not scaled."
    defaults = dict(enabled=True, opt_level="O5", cast_model_type=torch.bfloat16, patch_torch_functions=False,
                    patch_torch_functions_type=None, keep_batchnorm_fp32=True, master_weights=True, loss_scale=1.0)


opt_levels: dict[str, _OptLevel] = {"O3": O3(), "O2": O2(), "O1": O1(), "O0": O0(), "O4": O4(), "O5": O5()}


def _check_scale_args(num_losses: Any, min_loss_scale: Any, max_loss_scale: Any, hysteresis: Any) -> None:
    """Errors naming the argument for the loss-scaler arguments of ``initialize``."""
    if isinstance(num_losses, bool) or not isinstance(num_losses, numbers.Integral):
        raise TypeError(f"num_losses must be an int >= 1, got {type(num_losses).__name__} {num_losses!r}")
    if num_losses < 1:
        raise ValueError(f"num_losses must be an int >= 1, got {num_losses!r}")
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, numbers.Real) or int(hysteresis) != hysteresis \
            or hysteresis < 1:
        raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
    for name, v in (("min_loss_scale", min_loss_scale), ("max_loss_scale", max_loss_scale)):
        if v is None and name == "min_loss_scale":
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a number, got {type(v).__name__} {v!r}")
        # min_loss_scale 0 means no floor (as in Apex); the comparisons are False for NaN.
        if not (v >= 0 if name == "min_loss_scale" else v > 0):
            raise ValueError(f"{name} must be {'>= 0' if name == 'min_loss_scale' else 'positive'}, got {v!r}")
    if min_loss_scale is not None and min_loss_scale > max_loss_scale:
        raise ValueError(f"min_loss_scale ({min_loss_scale!r}) must not exceed max_loss_scale ({max_loss_scale!r})")


def deinitialize() -> None:
    """Switch O1 casting off and forget the loss scalers (culmen extension, for notebooks and tests).

    Models and optimizers keep what ``initialize`` did to them (an O2 model stays fp16); use new
    objects with the next ``initialize``.
    """
    if _amp_state.cast_engine is not None:
        _amp_state.cast_engine.deactivate()
    _amp_state._reset_run_state()


def initialize(models: Any, optimizers: Any = None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type: torch.dtype | None = None, patch_torch_functions: bool | None = None,
               keep_batchnorm_fp32: bool | str | None = None, master_weights: bool | None = None,
               loss_scale: float | str | None = None, cast_model_outputs: torch.dtype | None = None,
               num_losses: int = 1, verbosity: int = 1, min_loss_scale: float | None = None,
               max_loss_scale: float = 2.0**24, *, patch_torch_functions_type: torch.dtype | None = None,
               hysteresis: int = 1) -> Any:
    """Prepare models and optimizers for mixed precision at ``opt_level``; return them in the same shape.

    Call it once, after building the model(s) and optimizer(s) and before wrapping in DDP::

        model, optimizer = amp.initialize(model, optimizer, opt_level="O1")

    Args:
        models: a ``torch.nn.Module`` or a list of them.
        optimizers: an optimizer, a list of them, or None (inference).
        enabled: False makes every amp call a no-op (models/optimizers returned unchanged).
        opt_level: "O0", "O1", "O2", "O3" (Apex) or "O4", "O5" (bf16, as in ROCm's Apex).
        cast_model_type: override: dtype the model is cast to (fp16 or bf16 for O2/O3).
        patch_torch_functions: override: O1-style per-op casting.
        keep_batchnorm_fp32: override (bool or "True"/"False"): batch norms stay fp32 in a cast model.
        master_weights: override: the optimizers update fp32 master copies of 16-bit weights.
        loss_scale: override: a number (static) or "dynamic".
        cast_model_outputs: dtype the models' floating outputs are cast to, whatever the level.
        num_losses: number of losses, each with its own loss scaler (``scale_loss(..., loss_id=i)``).
        verbosity: 0 silent, 1 the options and overflow messages, 2 also the ops O1 covers.
        min_loss_scale: floor of the dynamic loss scale (None: no floor).
        max_loss_scale: ceiling of the dynamic loss scale.
        patch_torch_functions_type: O1 cast dtype, torch.float16 or torch.bfloat16 (culmen / ROCm).
        hysteresis: overflows in a row before a dynamic scale backs off (culmen; 1 is Apex's rule).

    Returns:
        ``model`` / ``[models]`` alone when ``optimizers`` is None, else ``(models, optimizers)`` with each
        a single object or a list exactly as passed in.

    Raises:
        RuntimeError: unknown opt level, contradictory overrides, a model or optimizer passed twice,
            a parallel-wrapped model, 16-bit incoming parameters.
        TypeError: ``models`` / ``optimizers`` of the wrong type.
    """
    if _amp_state.cast_engine is not None:
        _amp_state.cast_engine.deactivate()
    _amp_state._reset_run_state()
    _amp_state.opt_properties = Properties()
    _amp_state.verbosity = verbosity

    if not enabled:
        return models if optimizers is None else (models, optimizers)

    if not torch.backends.cudnn.enabled and torch.cuda.is_available():
        raise RuntimeError("Amp requires torch.backends.cudnn.enabled = True")

    if opt_level not in opt_levels:
        raise RuntimeError(f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', 'O2', 'O3' (and "
                           "'O4', 'O5' for bfloat16). Note that in `O0`, `O1`, etc., the prefix O is the letter O, "
                           "not the number zero.")
    props = opt_levels[opt_level](_amp_state.opt_properties)
    maybe_print(f"Selected optimization level {opt_levels[opt_level].brief}", True)
    maybe_print("Defaults for this optimization level are:", True)
    for k, v in props.options.items():
        maybe_print(f"{k:22} : {v}", True)

    _check_scale_args(num_losses, min_loss_scale, max_loss_scale, hysteresis)
    _amp_state.min_loss_scale = min_loss_scale
    _amp_state.max_loss_scale = max_loss_scale
    _amp_state.hysteresis = int(hysteresis)

    maybe_print("Processing user overrides (additional kwargs that are not None)...", True)
    overrides = dict(enabled=enabled, opt_level=opt_level, cast_model_type=cast_model_type,
                     patch_torch_functions=patch_torch_functions,
                     patch_torch_functions_type=patch_torch_functions_type,
                     keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights, loss_scale=loss_scale)
    for k, v in overrides.items():
        if v is not None:
            setattr(props, k, v)
    if props.patch_torch_functions and props.patch_torch_functions_type is None:
        props.patch_torch_functions_type = torch.float16

    maybe_print("After processing overrides, optimization options are:", True)
    for k, v in props.options.items():
        maybe_print(f"{k:22} : {v}", True)

    return _initialize(models, optimizers, props, num_losses, cast_model_outputs)


def state_dict(destination: dict | None = None) -> dict:
    """The loss scalers' state: ``{"loss_scaler{i}": {"loss_scale": float, "unskipped": int}}``.

    A scaler built with ``hysteresis > 1`` also saves its ``hysteresis_tracker`` (culmen extension).
    """
    if destination is None:
        destination = OrderedDict()
    for idx, scaler in enumerate(_amp_state.loss_scalers):
        entry = {"loss_scale": scaler.loss_scale(), "unskipped": scaler._unskipped}
        if scaler._hysteresis != 1:
            entry["hysteresis_tracker"] = scaler._hysteresis_tracker
        destination[f"loss_scaler{idx}"] = entry
    return destination


def load_state_dict(state_dict: dict) -> None:
    """Restore the loss scalers from :func:`state_dict` (entries beyond ``num_losses`` are skipped).

    Raises:
        RuntimeError: a key that is not ``loss_scaler<i>``.
    """
    if len(state_dict) != len(_amp_state.loss_scalers):
        print(f"Warning: state_dict contains {len(state_dict)} entries, while {len(_amp_state.loss_scalers)} "
              "loss_scalers are used")
    unexpected = [k for k in state_dict if "loss_scaler" not in k]
    idx = 0
    for key, entry in state_dict.items():
        if "loss_scaler" not in key:
            continue
        if idx >= len(_amp_state.loss_scalers):
            print(f"Skipping loss_scaler[{idx}], since num_losses was set to {len(_amp_state.loss_scalers)}")
            break
        scaler = _amp_state.loss_scalers[idx]
        scaler._resolve()
        scaler._loss_scale = entry["loss_scale"]
        scaler._unskipped = entry["unskipped"]
        scaler._hysteresis_tracker = entry.get("hysteresis_tracker", scaler._hysteresis)
        idx += 1
    if unexpected:
        raise RuntimeError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
                           + ", ".join(f'"{k}"' for k in unexpected) + ". ")
