"""``apex.optimizers``: fused optimizers whose step updates all tensors of a group in a few Triton launches.

Every class takes Apex's constructor arguments and defaults, groups its params by device and dtype
(fp32, fp16 and bf16 params may be mixed, on several devices) and skips params without a gradient.
On CPU tensors the same optimizers run the ops' pure-PyTorch references. ``culmen.optimizers.reference``
holds plain per-tensor implementations of LAMB, MixedPrecisionLamb, NovoGrad and LARS (the oracles of
the tests and benchmarks).

================================  =====================================  ==============================
class                             update                                 GradScaler (no host sync)
================================  =====================================  ==============================
:class:`FusedAdam`                Adam / AdamW, optional fp32 masters    unscale + skip in the kernel
:class:`FusedLAMB`                LAMB, global-norm clipping             unscale + skip in the kernels
:class:`FusedMixedPrecisionLamb`  LAMB, device lr/step, fp32 masters     unscale + skip in the kernels
:class:`FusedSGD`                 SGD, momentum / Nesterov               multi-tensor unscale, skip
:class:`FusedAdagrad`             Adagrad (L2 or decoupled decay)        multi-tensor unscale, skip
:class:`FusedLARS`                LARS (per-layer trust ratio)           multi-tensor unscale, skip
:class:`FusedNovoGrad`            NovoGrad (per-layer norm moment)       GradScaler's standard path
================================  =====================================  ==============================

Under ``torch.amp.GradScaler`` every one of them leaves ``.grad`` as torch's optimizers do: unscaled after
``scaler.step(opt)``, skipped steps included (LAMB, as Apex, overwrites the gradients of a taken step with
its updates). Hyper-parameters are checked at construction and in every param group: a bad value raises
``ValueError`` / ``TypeError`` naming the argument.
"""

from culmen.optimizers.fused_adagrad import FusedAdagrad
from culmen.optimizers.fused_adam import FusedAdam
from culmen.optimizers.fused_lamb import FusedLAMB
from culmen.optimizers.fused_lars import Fused_LARS, FusedLARS
from culmen.optimizers.fused_mixed_precision_lamb import FusedMixedPrecisionLamb
from culmen.optimizers.fused_novograd import FusedNovoGrad
from culmen.optimizers.fused_sgd import FusedSGD

__all__ = [
    "FusedAdagrad",
    "FusedAdam",
    "FusedLAMB",
    "FusedLARS",
    "FusedMixedPrecisionLamb",
    "FusedNovoGrad",
    "FusedSGD",
    "Fused_LARS",
]
