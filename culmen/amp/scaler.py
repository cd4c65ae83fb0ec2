"""``LossScaler``: Apex's amp loss scaler (static or dynamic), with an optional hysteresis.

Unscaling and the inf/NaN check run in one multi-tensor launch per device and dtype group
(``amp_C.multi_tensor_scale`` / ``multi_tensor_axpby``), which raises an int32 overflow flag on the
device; :meth:`LossScaler.update_scale` reads that flag once, so a step costs one device-to-host
sync however many tensors it unscales.

Dynamic rule (Apex's): start at ``min(init_scale, max_loss_scale)``; on an overflow skip the step and
divide the scale by ``scale_factor`` (not below ``min_loss_scale`` when one is set); after
``scale_window`` clean steps in a row multiply it by ``scale_factor`` (not above ``max_loss_scale``).
A static scaler never checks for overflow and never skips, as in Apex.

culmen additions: when every optimizer of a ``scale_loss`` can skip a step on the device (it takes
a ``found_inf`` tensor: culmen's fused optimizers, ``torch.optim`` with ``fused=True``), the flag is
handed to it and copied to the host asynchronously (:meth:`LossScaler.defer_update`): the scale is
updated by the same rule one step later, when it is next read, and no step waits for the device.
``hysteresis`` (Megatron/NeMo's rule, as in ``amp_C.update_scale_hysteresis``):
with ``hysteresis=h`` the scale backs off only on the ``h``-th overflow without a clean step in
between (each of them still skips its step); ``h=1`` is Apex's behaviour. ``scale_factor`` is also
honoured (Apex stores it but always uses 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from culmen.amp._amp_state import maybe_print
from culmen.multi_tensor_apply import amp_C, multi_tensor_applier

__all__ = ["LossScaler", "axpby_check_overflow_python", "scale_check_overflow_python"]


def _nonfinite_sum(t: Tensor) -> bool:
    s = float(t.float().sum())
    return not math.isfinite(s)


def scale_check_overflow_python(model_grad: Tensor, master_grad: Tensor, scale: float,
                                check_overflow: bool = False) -> bool:
    """Apex's per-tensor fallback of the unscale: with ``check_overflow``, True (and nothing written) when
    ``model_grad`` holds an inf or NaN (one host sync); else ``master_grad = model_grad * scale`` and False."""
    if check_overflow and _nonfinite_sum(model_grad):
        return True
    if master_grad is not model_grad:
        master_grad.copy_(model_grad)
    if scale != 1.0:
        master_grad.mul_(scale)
    return False


def axpby_check_overflow_python(model_grad: Tensor, stashed_grad: Tensor, master_grad: Tensor, a: float, b: float,
                                check_overflow: bool = False) -> bool:
    """Apex's per-tensor fallback of the unscale with stashed gradients: with ``check_overflow``, True when
    ``model_grad`` holds an inf or NaN; else ``master_grad = a * model_grad + b * stashed_grad`` (in
    ``master_grad``'s dtype, which ``stashed_grad`` must share) and False."""
    if check_overflow and _nonfinite_sum(model_grad):
        return True
    if stashed_grad.dtype != master_grad.dtype:
        raise TypeError(f"stashed_grad must have master_grad's dtype {master_grad.dtype}, got {stashed_grad.dtype}")
    master_grad.data = a * model_grad.data.to(master_grad.dtype) + b * stashed_grad.data
    return False


def _group_by_device(*lists: Sequence[Tensor]) -> dict[torch.device, list[list[Tensor]]]:
    """Split parallel tensor lists by the device of the first list's tensors (one group almost always)."""
    first = lists[0]
    dev0 = first[0].device
    if all(t.device == dev0 for t in first):
        return {dev0: [list(lst) for lst in lists]}
    groups: dict[torch.device, list[list[Tensor]]] = {}
    for i, t in enumerate(first):
        g = groups.setdefault(t.device, [[] for _ in lists])
        for k, lst in enumerate(lists):
            g[k].append(lst[i])
    return groups


class LossScaler:
    """Loss scaler of ``culmen.amp`` (Apex's ``apex.amp.scaler.LossScaler``).

    Args:
        loss_scale: ``"dynamic"`` or a positive number (static scale).
        init_scale: first dynamic scale (clamped to ``max_loss_scale``).
        scale_factor: back-off divisor and growth multiplier of the dynamic scale.
        scale_window: clean steps in a row before the dynamic scale grows.
        min_loss_scale: floor of the dynamic scale (None or 0: no floor, as in Apex).
        max_loss_scale: ceiling of the dynamic scale.
        hysteresis: overflows in a row needed before the dynamic scale backs off (culmen extension).
    """

    warned_no_fused_kernel = False
    warned_unscaling_non_fp32_grad = False
    has_fused_kernel = True

    def __init__(self, loss_scale: float | str, init_scale: float = 2.0**16, scale_factor: float = 2.0,
                 scale_window: int = 2000, min_loss_scale: float | None = None, max_loss_scale: float = 2.0**24,
                 hysteresis: int = 1) -> None:
        if loss_scale == "dynamic":
            self.dynamic = True
            self._loss_scale = float(min(max_loss_scale, init_scale))
        else:
            try:
                value = float(loss_scale)
            except (TypeError, ValueError):
                raise ValueError(f"loss_scale must be 'dynamic' or a number, got {loss_scale!r}") from None
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"a static loss_scale must be a positive finite number, got {loss_scale!r}")
            self.dynamic = False
            self._loss_scale = value
        if not (scale_factor > 1.0):
            raise ValueError(f"scale_factor must be > 1, got {scale_factor!r}")
        if int(scale_window) != scale_window or scale_window < 1:
            raise ValueError(f"scale_window must be a positive int, got {scale_window!r}")
        if int(hysteresis) != hysteresis or hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
        if min_loss_scale and max_loss_scale < min_loss_scale:
            raise ValueError(f"max_loss_scale ({max_loss_scale}) is below min_loss_scale ({min_loss_scale})")
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = int(scale_window)
        self._scale_factor = float(scale_factor)
        self._hysteresis = int(hysteresis)
        self._hysteresis_tracker = int(hysteresis)
        self._unskipped = 0
        self._has_overflow = False
        self._overflow_bufs: dict[torch.device, Tensor] = {}
        self._pinned: dict[torch.device, Tensor] = {}
        self._pending: tuple[Tensor, Any, int] | None = None

    # ------------------------------------------------------------------------------ accessors

    def loss_scale(self) -> float:
        """The current scale (a Python float); applies a deferred update first."""
        if self._pending is not None:
            self._resolve()
        return self._loss_scale

    @property
    def _overflow_buf(self) -> Tensor:
        """The int32 overflow flag of the first device used (Apex's attribute)."""
        if not self._overflow_bufs:
            cuda = torch.cuda.is_available()
            return self._buf(torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
        return next(iter(self._overflow_bufs.values()))

    def _buf(self, device: torch.device) -> Tensor:
        buf = self._overflow_bufs.get(device)
        if buf is None:
            buf = torch.zeros(1, dtype=torch.int32, device=device)
            self._overflow_bufs[device] = buf
        return buf

    def _warn_non_fp32(self, master_grads: Sequence[Tensor]) -> None:
        if not LossScaler.warned_unscaling_non_fp32_grad and master_grads[0].dtype != torch.float32:
            maybe_print(f"Warning: unscaling a gradient of type {master_grads[0].dtype}. Unscaling non-fp32 "
                        "gradients may indicate an error: amp does not need the model to be cast by hand.")
            LossScaler.warned_unscaling_non_fp32_grad = True

    # ------------------------------------------------------------------------------ unscaling

    def unscale(self, model_grads: Sequence[Tensor], master_grads: Sequence[Tensor], unused_scale=None,
                models_are_masters: bool = False, scale_override: float | None = None) -> None:
        """``master_grads[i] = model_grads[i] / scale``, raising the overflow flag on inf/NaN.

        ``scale`` is the current loss scale unless ``scale_override`` is given. ``unused_scale`` is
        kept for Apex's signature. Nothing happens once an overflow was recorded (``_has_overflow``),
        or when a static scale of 1 unscales grads in place.
        """
        if self._has_overflow:
            return
        scale = self.loss_scale() if scale_override is None else scale_override
        if scale == 1.0 and models_are_masters and not self.dynamic:
            return
        model_grads = list(model_grads)
        master_grads = list(master_grads)
        if not model_grads:
            return
        self._warn_non_fp32(master_grads)
        for dev, (mg, ms) in _group_by_device(model_grads, master_grads).items():
            multi_tensor_applier(amp_C.multi_tensor_scale, self._buf(dev), [mg, ms], 1.0 / scale)

    def unscale_with_stashed(self, model_grads: Sequence[Tensor], stashed_master_grads: Sequence[Tensor],
                             master_grads: Sequence[Tensor],
                             scale_override: tuple[float, float, float] | None = None) -> None:
        """``master = out_scale * (model / grads_scale + stashed / stashed_scale)`` (grad accumulation).

        ``scale_override = (grads_have_scale, stashed_have_scale, out_scale)``; by default the new
        grads carry the current loss scale and the stashed ones none. Only the incoming model grads
        are checked for inf/NaN (as in Apex).
        """
        if self._has_overflow:
            return
        grads_have_scale, stashed_have_scale, out_scale = self.loss_scale(), 1.0, 1.0
        if scale_override is not None:
            grads_have_scale, stashed_have_scale, out_scale = scale_override
        model_grads = list(model_grads)
        if not model_grads:
            return
        master_grads = list(master_grads)
        self._warn_non_fp32(master_grads)
        a, b = out_scale / grads_have_scale, out_scale / stashed_have_scale
        for dev, (mg, sg, ms) in _group_by_device(model_grads, list(stashed_master_grads), master_grads).items():
            multi_tensor_applier(amp_C.multi_tensor_axpby, self._buf(dev), [mg, sg, ms], a, b, 0)

    # --------------------------------------------------------------------------- scale update

    def clear_overflow_state(self) -> None:
        """Forget the overflow of the previous step (host flag and device flags)."""
        self._has_overflow = False
        for buf in self._overflow_bufs.values():
            buf.zero_()

    def _read_overflow(self) -> bool:
        # The one device-to-host sync of a step (one per device when grads span several devices).
        return any(bool(buf.item()) for buf in self._overflow_bufs.values())

    def update_scale(self) -> bool:
        """Read the overflow flag, update a dynamic scale; return True when the step must be skipped."""
        self._resolve()
        if self.dynamic and not self._has_overflow:
            self._has_overflow = self._read_overflow()
        return self._apply(self._has_overflow)

    def _apply(self, overflow: bool) -> bool:
        """Apex's update rule (plus the hysteresis) for one step that did or did not overflow."""
        if overflow and self.dynamic:
            should_skip = True
            self._hysteresis_tracker -= 1
            self._unskipped = 0
            if self._hysteresis_tracker <= 0:
                smaller = self._loss_scale / self._scale_factor
                self._loss_scale = max(self._min_loss_scale, smaller) if self._min_loss_scale else smaller
        else:
            should_skip = False
            self._unskipped += 1
            self._hysteresis_tracker = self._hysteresis
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * self._scale_factor)
            self._unskipped = 0
        return should_skip

    # ------------------------------------------------------------- deferred (sync-free) update

    def can_defer(self) -> bool:
        """True when the overflow flag lives on one device, so :meth:`defer_update` applies."""
        return self.dynamic and len(self._overflow_bufs) == 1

    def defer_update(self, loss_id: int = 0) -> Tensor:
        """Start reading the overflow flag without waiting; return it as a device ``found_inf`` tensor.

        The step is then skipped on the device by an optimizer that takes ``found_inf`` (culmen's fused
        optimizers, ``torch.optim`` with ``fused=True``). The copy to the host runs asynchronously;
        the scale is updated by the same rule as :meth:`update_scale` as soon as anything reads it
        (:meth:`loss_scale`, the next ``scale_loss``, ``amp.state_dict``), by which time the copy has
        long finished: no step waits for the device.
        """
        self._resolve()
        ((device, flag),) = self._overflow_bufs.items()
        found_inf = flag.to(torch.float32).reshape(())  # 0-dim, as torch.amp.GradScaler hands it
        if device.type == "cuda":
            host = self._pinned.get(device)
            if host is None:
                host = self._pinned[device] = torch.zeros(1, dtype=torch.int32, device="cpu", pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        else:
            host, event = flag.clone(), None
        self._pending = (host, event, loss_id)
        return found_inf

    def _resolve(self) -> None:
        """Apply a deferred update once its flag has reached the host."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        host, event, loss_id = pending
        if event is not None:
            event.synchronize()
        if self._apply(bool(host[0].item())):
            maybe_print(f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
                        f"{self._loss_scale}")

    def __getstate__(self) -> dict:
        self._resolve()
        state = dict(self.__dict__)
        state["_pinned"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("_pinned", {})
        state.setdefault("_pending", None)
        self.__dict__.update(state)

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, loss_scale={self._loss_scale}, unskipped={self._unskipped})"
