"""culmen's ``amp_C``: Apex's multi-tensor ops with Apex's names, argument order and noop-flag rules.

``import amp_C`` resolves here under :mod:`culmen.compat`. Every op takes
``(chunk_size, noop_flag, tensor_lists, *args)``; ``noop_flag`` is a 1-element int32 tensor. The
scale / axpby / l2norm-scale ops set it on inf/NaN and always write; update ops (sgd, adam, ...)
do nothing while it is set.
"""

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
from culmen.ops.multi_tensor.sgd import multi_tensor_sgd

__all__ = [
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_l2norm_scale",
    "multi_tensor_scale",
    "multi_tensor_sgd",
    "multi_tensor_unscale_l2norm",
]
