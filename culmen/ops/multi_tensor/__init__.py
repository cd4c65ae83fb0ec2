"""Multi-tensor kernels: one launch updates many tensors (Apex's ``amp_C`` op set).

Modules: ``common`` (launch tables, shared Triton helpers), ``elementwise`` (scale, axpby),
``l2norm`` (norm family), ``adam``, ``sgd``, and the layer-wise optimizers' ops. The Apex-named
functions are collected in :mod:`culmen.multi_tensor_apply.amp_C`.
"""

from culmen.ops.backend import register_op

for _name, _desc in (
    ("multi_tensor_scale", "out = in * scale over tensor lists, inf/nan flag"),
    ("multi_tensor_axpby", "out = a x + b y over tensor lists, inf/nan flag"),
    ("multi_tensor_l2norm", "global and per-tensor L2 norms of tensor lists"),
    ("multi_tensor_adam", "Adam/AdamW step over tensor lists (capturable, master weights)"),
    ("multi_tensor_sgd", "SGD with momentum over tensor lists"),
    ("multi_tensor_adagrad", "Adagrad over tensor lists (L2 or decoupled weight decay)"),
    ("multi_tensor_novograd", "NovoGrad over tensor lists with per-tensor moving grad norms"),
    ("multi_tensor_lamb", "LAMB over tensor lists (+ _mp, stage1/stage2): per-tensor trust ratios"),
    ("multi_tensor_lars", "LARS (SGD with per-tensor trust ratio) over tensor lists"),
    ("update_scale_hysteresis", "loss-scale update with hysteresis, on the device (no host sync)"),
):
    register_op(_name, "multi_tensor", _desc)
