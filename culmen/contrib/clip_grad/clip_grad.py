"""``clip_grad_norm_``: Apex's ``apex.contrib.clip_grad`` (the signature of ``torch.nn.utils.clip_grad_norm_``).

The total norm is one multi-tensor reduction per (device, dtype) of the gradients (``amp_C``'s
``multi_tensor_l2norm`` for the 2-norm; ``torch._foreach_norm`` for other orders), accumulated in fp32,
and the gradients are scaled by ``min(1, max_norm / (norm + 1e-6))`` with one multi-tensor multiply per
(device, dtype) group. The clip coefficient stays on the device: nothing waits for the GPU unless
``error_if_nonfinite=True`` (which has to look at the norm).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from culmen.multi_tensor_apply import amp_C, multi_tensor_applier

_ZERO_FLAGS: dict[torch.device, Tensor] = {}


def _zero_flag(device: torch.device) -> Tensor:
    flag = _ZERO_FLAGS.get(device)
    if flag is None:
        flag = _ZERO_FLAGS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def _by_device_dtype(tensors: list[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def _foreach_norms_f32(tensors: list[Tensor], norm_type: float) -> list[Tensor]:
    try:
        return list(torch._foreach_norm(tensors, norm_type, dtype=torch.float32))
    except TypeError:  # older torch: no dtype argument
        return list(torch._foreach_norm([t.float() for t in tensors], norm_type))


def total_norm(grads: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of all of ``grads`` together: a 0-dim fp32 tensor on ``grads[0]``'s device.

    Any order ``torch.linalg.vector_norm`` accepts (``inf``, ``-inf``, 0, 1, 2, ...); 2 runs culmen's
    multi-tensor L2 norm (one call over every dtype and device), the others ``torch._foreach_norm``.
    """
    device = grads[0].device
    if norm_type == 2.0:
        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, _zero_flag(device), [grads], False)
        return norm.reshape(())
    norms: list[Tensor] = []
    for gs in _by_device_dtype(grads).values():
        norms.extend(n.to(device, non_blocking=True) for n in _foreach_norms_f32(gs, norm_type))
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    """Scale the gradients of ``parameters`` in place so that their total norm is at most ``max_norm``.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped (params without a
            gradient are ignored); gradients may be fp32/fp16/bf16 and on several devices.
        max_norm: the largest allowed total norm.
        norm_type: the order of the norm (``float('inf')`` for the max-norm). Default 2.
        error_if_nonfinite: raise ``RuntimeError`` when the total norm is inf/NaN (this reads the norm on
            the host, the only case that syncs). Default False.
        foreach: ``False`` scales one gradient at a time (torch's meaning); ``None``/``True`` use
            multi-tensor launches (culmen supports every device, so ``True`` never fails).

    Returns:
        The total norm of the gradients before clipping, a 0-dim **fp32** tensor on the first
        gradient's device (torch returns it in the gradients' dtype, which overflows for fp16).
    """
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    for g in grads:
        if g.is_sparse:
            raise RuntimeError("clip_grad_norm_: sparse gradients are not supported; densify them first")
    norm = total_norm(grads, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(
            f"clip_grad_norm_: the total {norm_type:g}-norm of the gradients is {norm.item()} (non-finite), so "
            "they cannot be clipped; pass error_if_nonfinite=False to scale them by it anyway")
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if foreach is False:
        for g in grads:
            g.mul_(coef.to(g.device, non_blocking=True))
    else:
        for (dev, _), gs in _by_device_dtype(grads).items():
            torch._foreach_mul_(gs, coef.to(dev, non_blocking=True))
    return norm


__all__ = ["clip_grad_norm_", "total_norm"]

