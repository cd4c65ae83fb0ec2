"""``apex.contrib.optimizers.FusedLAMB``: Apex's deprecated contrib LAMB (the constructor without ``use_nvlamb``)."""

from __future__ import annotations

from collections.abc import Iterable

from culmen.optimizers.fused_lamb import FusedLAMB as _FusedLAMB

__all__ = ["FusedLAMB"]


class FusedLAMB(_FusedLAMB):
    """LAMB with global gradient-norm clipping: :class:`culmen.optimizers.FusedLAMB` under Apex's old contrib
    signature ``(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
    amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0)``; the
    trust ratio applies to params with non-zero weight decay (no NVLAMB switch)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float = 1.0) -> None:
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adam_w_mode=adam_w_mode,
                         grad_averaging=grad_averaging, set_grad_none=set_grad_none, max_grad_norm=max_grad_norm,
                         use_nvlamb=False)
