"""``update_scale_hysteresis``: Apex's loss-scale update with hysteresis, on the device, no host sync.

One single-program kernel reads ``found_inf`` and updates three one-element device tensors in place:
the fp32 ``current_scale`` and the int32 ``growth_tracker`` / ``hysteresis_tracker``. The rule (as in
Apex's ``amp_C.update_scale_hysteresis``, used by Megatron/NeMo-style grad scalers):

* overflow (``found_inf > 0``): the hysteresis tracker is decremented; while it is still positive
  the growth tracker is reset and nothing else changes. Once it reaches 0 (``hysteresis`` overflows
  without a clean step in between) the scale is multiplied by ``backoff_factor`` and the growth
  tracker reset; the hysteresis tracker is *not* restored, so every further overflow backs off
  again until a clean step.
* clean step (``found_inf == 0``): the growth tracker counts; when it reaches ``growth_interval``
  the scale is multiplied by ``growth_factor`` (kept unchanged if the product is not finite in fp32)
  and the tracker restarts at 0. The hysteresis tracker is restored to ``hysteresis``.

The products are computed in float64 and rounded to fp32, like Apex (its factors are doubles); a product
below the smallest normal fp32 is flushed to 0, as Apex's fast-math build of the kernel does.
"""

from __future__ import annotations

import numpy as np
import torch

from culmen.ops.backend import choose_backend
from culmen.ops.common.launch import Launch, stream_getter
from culmen.ops.multi_tensor.common import cached_plan, triton

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["growth_interval", "hysteresis"])
    def _update_scale_hysteresis_kernel(scale_ptr, growth_ptr, hyst_ptr, found_ptr, g_hi, g_lo, b_hi, b_lo,
                                        growth_interval, hysteresis):
        f = tl.load(found_ptr).to(tl.float32)
        s = tl.load(scale_ptr)
        gt = tl.load(growth_ptr)
        ht = tl.load(hyst_ptr)
        overflow = f > 0.0
        ht = tl.where(overflow, ht - 1, ht)
        held = overflow & (ht > 0)  # overflow absorbed by the hysteresis: only the growth tracker resets
        nonzero = f != 0.0  # true for NaN too
        backoff = nonzero & (held == 0)
        clean = nonzero == 0
        succ = gt + 1
        grow = clean & (succ == growth_interval)
        s64 = s.to(tl.float64)
        grown = (s64 * g_hi + s64 * g_lo).to(tl.float32)  # exact product up to the last fp64 rounding
        shrunk = (s64 * b_hi + s64 * b_lo).to(tl.float32)
        # Apex's kernel is built with --use_fast_math (flush-to-zero): a product below the smallest
        # normal fp32 becomes 0, and a scale backed off that far stays 0.
        grown = tl.where(tl.abs(grown) < 1.1754943508222875e-38, 0.0, grown)
        shrunk = tl.where(tl.abs(shrunk) < 1.1754943508222875e-38, 0.0, shrunk)
        grown_ok = (grown - grown) == 0.0  # finite
        s = tl.where(backoff, shrunk, tl.where(grow & grown_ok, grown, s))
        gt = tl.where(clean & (grow == 0), succ, 0)
        ht = tl.where(f <= 0.0, hysteresis, ht)
        tl.store(scale_ptr, s)
        tl.store(growth_ptr, gt)
        tl.store(hyst_ptr, ht)


def _split(x: float) -> tuple[float, float]:
    """``x`` as the sum of two fp32 numbers (so the kernel can rebuild a float64 factor)."""
    hi = float(np.float32(x))
    return hi, float(np.float32(x - hi))


def update_scale_hysteresis_ref(current_scale: torch.Tensor, growth_tracker: torch.Tensor,
                                hysteresis_tracker: torch.Tensor, found_inf: torch.Tensor, growth_factor: float,
                                backoff_factor: float, growth_interval: int, hysteresis: int) -> torch.Tensor:
    """Reference of :func:`update_scale_hysteresis` (tensor ops only: no host sync)."""
    f = found_inf.reshape(-1)[0].to(device=current_scale.device, dtype=torch.float32)
    s = current_scale.reshape(-1)[0]
    gt = growth_tracker.reshape(-1)[0]
    ht = hysteresis_tracker.reshape(-1)[0]
    overflow = f > 0
    ht_new = torch.where(overflow, ht - 1, ht)
    held = overflow & (ht_new > 0)
    nonzero = f != 0
    backoff = nonzero & ~held
    clean = ~nonzero
    succ = gt + 1
    grow = clean & (succ == growth_interval)
    s64 = s.double()
    tiny = torch.finfo(torch.float32).tiny
    grown = (s64 * growth_factor).float()
    shrunk = (s64 * backoff_factor).float()
    grown = torch.where(grown.abs() < tiny, torch.zeros_like(grown), grown)  # flush-to-zero, as Apex's build
    shrunk = torch.where(shrunk.abs() < tiny, torch.zeros_like(shrunk), shrunk)
    s_new = torch.where(backoff, shrunk, torch.where(grow & torch.isfinite(grown), grown, s))
    gt_new = torch.where(clean & ~grow, succ, torch.zeros_like(gt))
    ht_new = torch.where(f <= 0, torch.full_like(ht, hysteresis), ht_new)
    current_scale.reshape(-1)[0].copy_(s_new)
    growth_tracker.reshape(-1)[0].copy_(gt_new)
    hysteresis_tracker.reshape(-1)[0].copy_(ht_new)
    return current_scale


def _check(name: str, x, dtypes: tuple[torch.dtype, ...] | None, device: torch.device | None) -> None:
    op = "update_scale_hysteresis"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.numel() != 1:
        raise ValueError(f"{op}: {name} must have exactly one element, got {x.numel()}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must be {' or '.join(map(str, dtypes))}, got {x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{op}: {name} is on {x.device} but current_scale is on {device}")


def update_scale_hysteresis(current_scale: torch.Tensor, growth_tracker: torch.Tensor,
                            hysteresis_tracker: torch.Tensor, found_inf: torch.Tensor, growth_factor: float,
                            backoff_factor: float, growth_interval: int, hysteresis: int) -> torch.Tensor:
    """Apex ``amp_C.update_scale_hysteresis``: update the loss scale in place and return ``current_scale``.

    ``current_scale``: 1-element fp32 tensor; ``growth_tracker``, ``hysteresis_tracker``: 1-element
    int32 tensors; ``found_inf``: 1-element float tensor (non-zero after an overflow). All on one
    device; one single-program launch, no host sync. See the module docstring for the rule.
    """
    if torch.compiler.is_compiling():
        from culmen.ops.multi_tensor.library import hysteresis_op

        hysteresis_op(current_scale, growth_tracker, hysteresis_tracker, found_inf, float(growth_factor),
                      float(backoff_factor), int(growth_interval), int(hysteresis))
        return current_scale
    try:
        key = ("update_scale_hysteresis", current_scale.dtype, current_scale.device, current_scale.numel(),
               growth_tracker.dtype, growth_tracker.device, growth_tracker.numel(), hysteresis_tracker.dtype,
               hysteresis_tracker.device, hysteresis_tracker.numel(), found_inf.dtype, found_inf.device,
               found_inf.numel())
    except (TypeError, AttributeError, ValueError):
        key = None
    plan = cached_plan(key, lambda: _HysteresisPlan(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                                                    growth_interval))
    args = (current_scale, growth_tracker, hysteresis_tracker, found_inf, float(growth_factor),
            float(backoff_factor), int(growth_interval), int(hysteresis))
    if plan.launch is None:
        return update_scale_hysteresis_ref(*args)
    g_hi, g_lo = _split(float(growth_factor))
    b_hi, b_lo = _split(float(backoff_factor))
    aligned = (current_scale.data_ptr() | growth_tracker.data_ptr() | hysteresis_tracker.data_ptr()
               | found_inf.data_ptr()) & 15 == 0
    plan.launch(plan.stream(), aligned, current_scale, growth_tracker, hysteresis_tracker, found_inf, g_hi, g_lo, b_hi,
                b_lo, int(growth_interval), int(hysteresis))
    return current_scale


class _HysteresisPlan:
    """Checks passed and the bound single-program launch (``launch`` ``None``: the reference runs)."""

    def __init__(self, current_scale, growth_tracker, hysteresis_tracker, found_inf, growth_interval) -> None:
        _check("current_scale", current_scale, (torch.float32,), None)
        dev = current_scale.device
        _check("growth_tracker", growth_tracker, (torch.int32,), dev)
        _check("hysteresis_tracker", hysteresis_tracker, (torch.int32,), dev)
        _check("found_inf", found_inf, None, dev)
        if int(growth_interval) <= 0:
            raise ValueError(f"update_scale_hysteresis: growth_interval must be positive, got {growth_interval}")
        self.launch = None
        if choose_backend(dev) == "triton":
            self.launch = Launch(_update_scale_hysteresis_kernel, (1,), {}, 1, device=dev)
        self.stream = stream_getter(dev)
