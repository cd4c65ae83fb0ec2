"""``culmen.amp``: Apex's automatic mixed precision (``apex.amp``), complete.

Three lines change in a training script::

    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")   # or "O2", "O4" (bf16) ...
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()

Engines: O1 is ``torch.autocast`` switched on for the thread, plus the entries of Apex's cast lists
torch does not cover (:mod:`culmen.amp.lists`); loss scaling and the overflow check run in culmen's
multi-tensor kernels with one device-to-host sync per step; O2 keeps fp32 master weights for any
optimizer (``torch.optim`` or culmen's fused ones). Every difference from Apex is listed in the
docstring of the module that implements it.
"""

from culmen.amp import lists
from culmen.amp._amp_state import DeprecatedFeatureWarning, _amp_state, master_params
from culmen.amp.amp import (
    bfloat16_function,
    float_function,
    half_function,
    init,
    promote_function,
    register_bfloat16_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from culmen.amp.frontend import Properties, deinitialize, initialize, load_state_dict, opt_levels, state_dict
from culmen.amp.handle import AmpHandle, NoOpHandle, disable_casts, scale_loss
from culmen.amp.opt import OptimWrapper
from culmen.amp.scaler import LossScaler

__all__ = [
    "AmpHandle",
    "DeprecatedFeatureWarning",
    "LossScaler",
    "NoOpHandle",
    "OptimWrapper",
    "Properties",
    "_amp_state",
    "bfloat16_function",
    "deinitialize",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "lists",
    "load_state_dict",
    "master_params",
    "opt_levels",
    "promote_function",
    "register_bfloat16_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]
