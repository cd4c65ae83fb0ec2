"""``culmen.fp16_utils``: Apex's manual mixed-precision utilities (``apex.fp16_utils``).

``FP16_Optimizer`` (master weights + loss scaling around any optimizer), the standalone
``LossScaler`` / ``DynamicLossScaler``, and helpers to convert networks and to keep fp32 master
copies by hand. Apex deprecated these in favour of ``amp``; culmen keeps them working (with a
one-time ``FutureWarning`` where Apex warned).
"""

from culmen.fp16_utils.fp16_optimizer import FP16_Optimizer
from culmen.fp16_utils.fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from culmen.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]
