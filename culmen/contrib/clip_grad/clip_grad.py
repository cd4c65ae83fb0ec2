"""``clip_grad_norm_``: Apex's ``apex.contrib.clip_grad`` (the signature of ``torch.nn.utils.clip_grad_norm_``).

The computation is torch's, group by group: the gradients are split by (device, dtype); each group's
norms are taken, stacked on the first gradient's device and reduced to the total norm; the gradients
are multiplied in place by ``clamp(max_norm / (total + 1e-6), max=1)``. What culmen changes:

* the 2-norm of the fp32/fp16/bf16 gradients of a device is one multi-tensor reduction (``amp_C``'s
  ``multi_tensor_l2norm``, fp32 accumulation) instead of one per dtype;
* the norms of 16-bit gradients are accumulated and returned in fp32 (torch returns them in the
  gradients' dtype, where an fp16 norm above 65504 becomes inf and the clip zeroes every gradient);
  float64 gradients keep float64 math (torch's ``_foreach_norm``), so fp64 results match torch's to
  the last bits;
* the clip coefficient stays on the device: nothing waits for the GPU unless ``error_if_nonfinite=True``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from culmen.multi_tensor_apply import amp_C, multi_tensor_applier

_ZERO_FLAGS: dict[torch.device, Tensor] = {}
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def _group_norms(tensors: list[Tensor], norm_type: float, foreach: bool | None) -> list[Tensor]:
    """The ``norm_type``-norm of each of ``tensors`` (one device and dtype): fp32 for 16-bit tensors, the
    tensors' dtype otherwise. ``foreach=False``: one ``vector_norm`` per tensor (torch's meaning)."""
    dtype = torch.float32 if tensors[0].dtype in (torch.float16, torch.bfloat16) else None
    if foreach is False:
        return [torch.linalg.vector_norm(t, norm_type, dtype=dtype) for t in tensors]
    return list(torch._foreach_norm(tensors, norm_type, dtype=dtype))


def total_norm(grads: list[Tensor], norm_type: float = 2.0, foreach: bool | None = None) -> Tensor:
    """The ``norm_type``-norm of all of ``grads`` together: a 0-dim tensor on ``grads[0]``'s device.

    Any order ``torch.linalg.vector_norm`` accepts (``inf``, ``-inf``, 0, 1, 2, other ``p``). The result
    is float64 when some gradient is float64, else float32 (also for 16-bit gradients). The 2-norm of the
    fp32/fp16/bf16 gradients of a device is one culmen multi-tensor reduction (unless ``foreach=False``);
    everything else runs ``torch._foreach_norm`` per (device, dtype) group, as torch does.
    """
    if not grads:
        raise ValueError("total_norm: grads is empty")
    first = grads[0].device
    acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    norms: list[Tensor] = []
    fused: dict[torch.device, list[Tensor]] = {}
    for (dev, dt), gs in _by_device_dtype(grads).items():
        if norm_type == 2.0 and foreach is not False and dt in _KERNEL_DTYPES:
            fused.setdefault(dev, []).extend(gs)  # one reduction per device whatever the dtypes
        else:
            norms.extend(_group_norms(gs, norm_type, foreach))
    for dev, gs in fused.items():
        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, _zero_flag(dev), [gs], False)
        norms.append(norm)
    # A copy to the host must block (a non_blocking device-to-host copy returns before the data lands, and
    # the CPU reduction would read it early); copies to a GPU are stream-ordered and can overlap.
    to_gpu = first.type != "cpu"
    stacked = torch.stack([n.reshape(()).to(device=first, dtype=acc, non_blocking=to_gpu) for n in norms])
    return torch.linalg.vector_norm(stacked, norm_type)


def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    """Scale the gradients of ``parameters`` in place so that their total norm is at most ``max_norm``.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped (params without a
            gradient are ignored); gradients may be fp16/bf16/fp32/fp64, mixed, on several devices.
        max_norm: the largest allowed total norm (a number).
        norm_type: the order of the norm (``float('inf')`` for the max-norm; any order
            ``torch.linalg.vector_norm`` accepts). Default 2.
        error_if_nonfinite: raise ``RuntimeError`` when the total norm is inf/NaN (this reads the norm on
            the host, the only case that syncs). Default False.
        foreach: ``False`` takes norms and scales one gradient at a time (torch's meaning); ``None``/``True``
            use multi-tensor launches (culmen supports every device, so ``True`` never fails).

    Returns:
        The total norm of the gradients before clipping: a 0-dim tensor on the first gradient's device,
        float64 when some gradient is float64, else **float32** (torch returns 16-bit gradients' norm in
        their dtype, which overflows for fp16). With no gradient at all: ``0.0`` on the first parameter's
        device (torch's default device when ``parameters`` is empty).
    """
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    try:
        max_norm = float(max_norm)
    except (TypeError, ValueError):
        raise TypeError(f"clip_grad_norm_: max_norm must be a number, got {max_norm!r}") from None
    try:
        norm_type = float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(f"clip_grad_norm_: norm_type must be a number (or inf), got {norm_type!r}") from None
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        if parameters:
            return torch.zeros((), device=parameters[0].device)
        return torch.tensor(0.0)  # torch's result for an empty list: on the default device
    for g in grads:
        if g.is_sparse:
            raise RuntimeError("clip_grad_norm_: sparse gradients are not supported; densify them first")
    norm = total_norm(grads, norm_type, foreach)
    if error_if_nonfinite and bool(torch.logical_or(norm.isnan(), norm.isinf())):
        raise RuntimeError(
            f"clip_grad_norm_: the total {norm_type:g}-norm of the gradients is {norm.item()} (non-finite), so "
            "they cannot be clipped; pass error_if_nonfinite=False to scale them by it anyway")
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if foreach is False:
        for g in grads:
            g.mul_(coef.to(g.device, non_blocking=g.device.type != "cpu"))
    else:
        for (dev, _), gs in _by_device_dtype(grads).items():
            torch._foreach_mul_(gs, coef.to(dev, non_blocking=dev.type != "cpu"))
    return norm


__all__ = ["clip_grad_norm_", "total_norm"]
