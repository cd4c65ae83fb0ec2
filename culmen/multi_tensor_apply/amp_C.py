"""culmen's ``amp_C``: Apex's multi-tensor ops with Apex's names, argument order and noop-flag rules.

``import amp_C`` resolves here under :mod:`culmen.compat`. Every op takes
``(chunk_size, noop_flag, tensor_lists, *args)``; ``noop_flag`` is a 1-element int32 tensor. The
scale / axpby / l2norm-scale ops set it on inf/NaN and always write; update ops (sgd, adam, ...)
do nothing while it is set.
"""

from culmen.ops.multi_tensor.adagrad import multi_tensor_adagrad
from culmen.ops.multi_tensor.adam import (
    multi_tensor_adam,
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
)
from culmen.ops.multi_tensor.elementwise import multi_tensor_axpby, multi_tensor_scale
from culmen.ops.multi_tensor.l2norm import (
    multi_tensor_l2norm,
    multi_tensor_l2norm_mp,
    multi_tensor_l2norm_scale,
    multi_tensor_unscale_l2norm,
)
from culmen.ops.multi_tensor.lamb import (
    multi_tensor_lamb,
    multi_tensor_lamb_mp,
    multi_tensor_lamb_stage1_cuda,
    multi_tensor_lamb_stage2_cuda,
)
from culmen.ops.multi_tensor.lars import multi_tensor_lars
from culmen.ops.multi_tensor.novograd import multi_tensor_novograd
from culmen.ops.multi_tensor.scaler import update_scale_hysteresis
from culmen.ops.multi_tensor.sgd import multi_tensor_sgd

__all__ = [
    "multi_tensor_adagrad",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_l2norm_scale",
    "multi_tensor_lamb",
    "multi_tensor_lamb_mp",
    "multi_tensor_lamb_stage1_cuda",
    "multi_tensor_lamb_stage2_cuda",
    "multi_tensor_lars",
    "multi_tensor_novograd",
    "multi_tensor_scale",
    "multi_tensor_sgd",
    "multi_tensor_unscale_l2norm",
    "update_scale_hysteresis",
]
