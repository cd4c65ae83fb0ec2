"""``apex.contrib.openfold_triton.fused_adam_swa``: ``FusedAdamSWA``, OpenFold's fused optimizer step.

One launch per (device, dtypes) group does, per element: gradient clipping by a scale, an Adam step on
the fp32 (or fp64) state parameters, a copy of the new parameters into the compute (bf16/fp32) copies the
model runs with, and a stochastic-weight-averaging (exponential moving average) update of the SWA copies.
It runs on culmen's multi-tensor machinery (``culmen.ops.multi_tensor.common``: launch groups, device
address tables, a cached plan per tensor-list signature); the math is done in the state dtype.

SWA update (OpenFold's ``swa_avg_fn``): ``swa = p`` on the first update (``n_averaged == 0``), else
``swa += (1 - swa_decay_rate) * (p - swa)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import Enum, unique
from itertools import chain

import numpy as np
import torch
from torch import Tensor, nn
from torch.optim import Adam, Optimizer

from culmen.ops.multi_tensor.common import TL_DTYPE, ListPlan, cached_plan, signature, triton

if triton is not None:
    import triton.language as tl

    from culmen.ops.multi_tensor.common import block_offsets, chunk_coords, tensor_ptr

__all__ = ["AdamMathType", "FusedAdamSWA", "adam_swa_ref"]


@unique
class AdamMathType(Enum):
    """Which Adam formula the step uses (Apex's enum; the values are the kernels' ``MODE``)."""

    ApexAdam = 0  # L2: grad += wd * p; p -= lr * (m / bc1) / (sqrt(v / bc2) + eps)
    ApexAdamW = 1  # decoupled: p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd * p)
    PyTorchAdam = 2  # torch.optim.Adam: grad += wd * p; p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)


if triton is not None:

    @triton.jit
    def _adam_swa_range(gp, pp, mp, vp, cp, sp, start, n, lr, b1, b2, eps, wd, bc1, bc2, clip, keep, first,
                        MODE: tl.constexpr, CDT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        for i in range(0, CHUNK, BLOCK):
            offs = block_offsets(start, i, BLOCK)
            ok = offs < n
            g = tl.load(gp + offs, mask=ok, other=0.0).to(CDT) * clip
            p = tl.load(pp + offs, mask=ok, other=0.0).to(CDT)
            m = tl.load(mp + offs, mask=ok, other=0.0).to(CDT)
            v = tl.load(vp + offs, mask=ok, other=0.0).to(CDT)
            if MODE != 1:
                g = g + wd * p
            m = b1 * m + (1.0 - b1) * g
            v = b2 * v + (1.0 - b2) * g * g
            if MODE == 2:
                p = p - (lr / bc1) * (m / (tl.sqrt(v) / tl.sqrt(bc2) + eps))
            else:
                upd = (m / bc1) / (tl.sqrt(v / bc2) + eps)
                if MODE == 1:
                    upd = upd + wd * p
                p = p - lr * upd
            s = tl.load(sp + offs, mask=ok, other=0.0).to(CDT)
            s = tl.where(first != 0, p, s + keep * (p - s))
            tl.store(pp + offs, p.to(pp.dtype.element_ty), mask=ok)
            tl.store(mp + offs, m.to(mp.dtype.element_ty), mask=ok)
            tl.store(vp + offs, v.to(vp.dtype.element_ty), mask=ok)
            tl.store(cp + offs, p.to(cp.dtype.element_ty), mask=ok)
            tl.store(sp + offs, s.to(sp.dtype.element_ty), mask=ok)

    @triton.jit
    def _f(hi, lo, cdt: tl.constexpr):
        """A host double passed as two fp32 halves (Triton passes Python floats as fp32), in ``cdt``."""
        return tl.cast(hi, cdt) + tl.cast(lo, cdt)

    @triton.jit(do_not_specialize=["T", "C", "first"])
    def _adam_swa_kernel(ptrs, geo, clip_ptr, T, C, lr, lr_, b1, b1_, b2, b2_, eps, eps_, wd, wd_, bc1, bc1_, bc2,
                         bc2_, clip, clip_, keep, keep_, first,
                         G_DT: tl.constexpr, S_DT: tl.constexpr, C_DT: tl.constexpr, MODE: tl.constexpr,
                         CLIP_T: tl.constexpr, SHIFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Program = one chunk of one tensor of ``[grad, param, exp_avg, exp_avg_sq, compute_param, swa]``."""
        cdt = tl.float64 if S_DT == tl.float64 else tl.float32
        t, j, n = chunk_coords(geo, T, C)
        gp = tensor_ptr(ptrs, T, t, 0, G_DT, SHIFT)
        pp = tensor_ptr(ptrs, T, t, 1, S_DT, SHIFT)
        mp = tensor_ptr(ptrs, T, t, 2, S_DT, SHIFT)
        vp = tensor_ptr(ptrs, T, t, 3, S_DT, SHIFT)
        cp = tensor_ptr(ptrs, T, t, 4, C_DT, SHIFT)
        sp = tensor_ptr(ptrs, T, t, 5, S_DT, SHIFT)
        clip_v = _f(clip, clip_, cdt)
        if CLIP_T:
            clip_v = tl.load(clip_ptr).to(cdt)
        _adam_swa_range(gp, pp, mp, vp, cp, sp, j * CHUNK, n, _f(lr, lr_, cdt), _f(b1, b1_, cdt), _f(b2, b2_, cdt),
                        _f(eps, eps_, cdt), _f(wd, wd_, cdt), _f(bc1, bc1_, cdt), _f(bc2, bc2_, cdt), clip_v,
                        _f(keep, keep_, cdt), first, MODE, cdt, CHUNK, BLOCK)


def _split(x) -> tuple[float, float]:
    """``x`` as ``(hi, lo)`` fp32 values with ``hi + lo == x`` to about 2^-48 (the kernels' ``_f``)."""
    x = float(x)
    hi = float(np.float32(x))
    return hi, float(np.float32(x - hi))


class _AdamSWAPlan(ListPlan):
    """The launch groups and tables of one ``[grads, params, exp_avgs, exp_avg_sqs, compute, swa]`` signature."""

    chunk = 4096
    block = 1024

    def __init__(self, tensor_lists, mode: int) -> None:
        self.mode = mode
        super().__init__("FusedAdamSWA", tensor_lists, 6, (1, 2, 3, 4, 5))

    def meta(self, g, kernel, variant) -> dict:
        dts = [TL_DTYPE[d] for d in g.dtypes]
        return dict(G_DT=dts[0], S_DT=dts[1], C_DT=dts[4], MODE=self.mode, CLIP_T=variant, CHUNK=self.chunk,
                    BLOCK=self.block)


def adam_swa_ref(tensor_lists, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 bias_correction1: float, bias_correction2: float, mode: int, grad_clip_scale,
                 swa_decay_rate: float, n_averaged: int) -> None:
    """The same step in PyTorch, one tensor at a time, in place (the CPU path and the tests' oracle).

    ``tensor_lists`` = ``[grads, params, exp_avgs, exp_avg_sqs, compute_params, swa_params]``; the math is in
    the state (``params``) dtype.
    """
    for g, p, m, v, c, s in zip(*tensor_lists):
        cd = torch.float64 if p.dtype == torch.float64 else torch.float32
        clip = grad_clip_scale.to(device=p.device, dtype=cd) if isinstance(grad_clip_scale, Tensor) else \
            float(grad_clip_scale)
        gf, pf, mf, vf = g.to(cd) * clip, p.to(cd), m.to(cd), v.to(cd)
        if mode != AdamMathType.ApexAdamW.value:
            gf = gf + weight_decay * pf
        mf = beta1 * mf + (1.0 - beta1) * gf
        vf = beta2 * vf + (1.0 - beta2) * gf * gf
        if mode == AdamMathType.PyTorchAdam.value:
            pf = pf - (lr / bias_correction1) * (mf / (vf.sqrt() / bias_correction2 ** 0.5 + eps))
        else:
            upd = (mf / bias_correction1) / ((vf / bias_correction2).sqrt() + eps)
            if mode == AdamMathType.ApexAdamW.value:
                upd = upd + weight_decay * pf
            pf = pf - lr * upd
        sf = pf.clone() if n_averaged == 0 else s.to(cd) + (1.0 - swa_decay_rate) * (pf - s.to(cd))
        p.copy_(pf)
        m.copy_(mf)
        v.copy_(vf)
        c.copy_(pf)
        s.copy_(sf)


class FusedAdamSWA(Optimizer):
    """Adam on the state parameters, the compute copies refreshed and SWA copies averaged, in one step.

    Args:
        params: the state (master) parameters, fp32 or fp64, contiguous; ``param_groups[0]``.
        compute_params: the copies the model computes with (bf16/fp32/...), same shapes; gradients are read
            from their ``.grad`` (in their dtype) and the new parameters are written into them.
        swa_params: the averaged copies, the state dtype.
        swa_decay_rate: EMA decay of the SWA copies.
        lr, bias_correction, betas, eps, weight_decay: Adam's hyper-parameters.
        adam_math_mode: an ``AdamMathType`` (default ``PyTorchAdam``, ``torch.optim.Adam``'s formula).
        amsgrad, capturable, master_weights: not supported (``NotImplementedError`` when true, as in Apex).
        set_grad_none: ``zero_grad`` sets the compute parameters' gradients to ``None`` (else zeros).

    ``step(closure=None, grad_clip_scale=None)`` multiplies the gradients by ``grad_clip_scale`` (a number or
    a one-element tensor; default 1) first, advances ``param_groups[0]["step"]`` and
    ``swa_param_groups[0]["n_averaged"]``. All parameters share one step count. Compute parameters whose
    ``.grad`` is ``None`` are skipped (Apex assumes every one has a gradient). Differences from Apex: the
    device address tables follow the tensors (a ``load_state_dict`` after the first step is picked up), and
    ``zero_grad`` also clears the compute parameters' gradients.
    """

    def __init__(self, params: Iterable[nn.Parameter], compute_params: Iterable[nn.Parameter],
                 swa_params: Iterable[nn.Parameter], swa_decay_rate: float, lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_math_mode: AdamMathType = AdamMathType.PyTorchAdam, weight_decay: float = 0.0,
                 amsgrad: bool = False, set_grad_none: bool = True, capturable: bool = False,
                 master_weights: bool = False) -> None:
        params, compute_params, swa_params = list(params), list(compute_params), list(swa_params)
        if not compute_params or not swa_params:
            raise ValueError("FusedAdamSWA requires both compute_params and swa_params (got an empty list)")
        if not len(params) == len(compute_params) == len(swa_params):
            raise ValueError(f"FusedAdamSWA: params, compute_params and swa_params must have the same length, got "
                             f"{len(params)}, {len(compute_params)}, {len(swa_params)}")
        for i, (p, c, s) in enumerate(zip(params, compute_params, swa_params)):
            if not p.shape == c.shape == s.shape:
                raise ValueError(f"FusedAdamSWA: params[{i}], compute_params[{i}], swa_params[{i}] have shapes "
                                 f"{tuple(p.shape)}, {tuple(c.shape)}, {tuple(s.shape)}; they must match")
            if p.dtype != s.dtype:
                raise ValueError(f"FusedAdamSWA: params[{i}] is {p.dtype} but swa_params[{i}] is {s.dtype}")
            if p.dtype not in (torch.float32, torch.float64):
                raise TypeError(f"FusedAdamSWA: params[{i}] must be float32 or float64, got {p.dtype}")
        if not all(t.is_contiguous() for t in chain(params, compute_params, swa_params)):
            raise ValueError("FusedAdamSWA expects every tensor of params, compute_params, swa_params contiguous")
        if amsgrad:
            raise NotImplementedError("amsgrad is not supported by FusedAdamSWA")
        if capturable:
            raise NotImplementedError("capturable is not supported by FusedAdamSWA")
        if master_weights:
            raise NotImplementedError("master_weights is not supported by FusedAdamSWA")
        if not isinstance(adam_math_mode, AdamMathType):
            raise ValueError(f"FusedAdamSWA: adam_math_mode must be an AdamMathType, got {adam_math_mode!r}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_math_mode = adam_math_mode
        self.set_grad_none = set_grad_none
        self.compute_param_groups = [{"params": compute_params}]
        self.swa_param_groups = [{"params": swa_params, "n_averaged": 0}]
        self.swa_decay_rate = swa_decay_rate

    def _lists(self) -> list[list[Tensor]]:
        if not all(len(pg) == 1 for pg in (self.param_groups, self.compute_param_groups, self.swa_param_groups)):
            raise RuntimeError("FusedAdamSWA does not support multiple param groups")
        params = self.param_groups[0]["params"]
        compute = self.compute_param_groups[0]["params"]
        swa = self.swa_param_groups[0]["params"]
        lists: list[list[Tensor]] = [[], [], [], [], [], []]
        for p, c, s in zip(params, compute, swa):
            g = c.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("FusedAdamSWA does not support sparse gradients, please consider SparseAdam")
            state = self.state[p]
            if "exp_avg" not in state or "exp_avg_sq" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            for lst, t in zip(lists, (g, p.detach(), state["exp_avg"], state["exp_avg_sq"], c.detach(), s.detach())):
                lst.append(t)
        return lists

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None, grad_clip_scale: Tensor | float | None = None):
        """One fused step (see the class docstring); returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        group["step"] = group.get("step", 0) + 1
        (beta1, beta2), step = group["betas"], group["step"]
        if group["bias_correction"]:
            bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
        else:
            bc1 = bc2 = 1.0
        swa_group = self.swa_param_groups[0]
        lists = self._lists()
        clip = 1.0 if grad_clip_scale is None else grad_clip_scale
        if lists[0]:
            kw = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                      bias_correction1=bc1, bias_correction2=bc2, mode=self.adam_math_mode.value,
                      grad_clip_scale=clip, swa_decay_rate=self.swa_decay_rate, n_averaged=swa_group["n_averaged"])
            self._launch(lists, kw)
        swa_group["n_averaged"] += 1
        return loss

    def _launch(self, lists: list[list[Tensor]], kw: dict) -> None:
        flat, sig = signature(lists)
        mode = kw["mode"]
        plan = cached_plan(("FusedAdamSWA", mode, sig), lambda: _AdamSWAPlan(lists, mode))
        if not plan.use_kernel:
            adam_swa_ref(lists, **kw)
            return
        tabs, copy_back = plan.pointers(lists, flat)
        clip = kw["grad_clip_scale"]
        clip_t = isinstance(clip, Tensor)
        doubles = (kw["lr"], kw["beta1"], kw["beta2"], kw["eps"], kw["weight_decay"], kw["bias_correction1"],
                   kw["bias_correction2"], 1.0 if clip_t else clip, 1.0 - float(kw["swa_decay_rate"]))
        scalars = (*chain.from_iterable(map(_split, doubles)), int(kw["n_averaged"] == 0))
        for i, g in enumerate(plan.tables.groups):
            if not g.C:
                continue
            ptab, shift, _ = tabs[i]
            clip_ptr = clip.reshape(-1)[:1].to(g.device) if clip_t else g.geo
            aligned = clip_ptr.data_ptr() & 15 == 0
            plan.launch(i, _adam_swa_kernel, shift, variant=clip_t)(g.stream(), aligned, ptab, g.geo, clip_ptr, g.T,
                                                                    g.C, *scalars)
        for c, x in copy_back:
            if x is not None:
                x.copy_(c)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients of the compute parameters (and of ``params``): ``None`` when ``set_to_none``
        (default: the constructor's ``set_grad_none``), else zeros."""
        none = self.set_grad_none if set_to_none is None else set_to_none
        for p in chain(self.compute_param_groups[0]["params"], self.param_groups[0]["params"]):
            if p.grad is not None:
                if none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @classmethod
    def from_optim(cls, adam_optimizer: Adam, fp32_params: list[nn.Parameter], bf16_params: list[nn.Parameter],
                   swa_params: list[nn.Parameter], swa_decay_rate: float) -> FusedAdamSWA:
        """A ``FusedAdamSWA`` (PyTorch Adam math) taking over ``adam_optimizer``'s hyper-parameters and state."""
        if len(adam_optimizer.param_groups) != 1:
            raise ValueError(f"FusedAdamSWA.from_optim: adam_optimizer must have one param group, got "
                             f"{len(adam_optimizer.param_groups)}")
        pg = adam_optimizer.param_groups[0]
        opt = cls(params=fp32_params, compute_params=bf16_params, swa_params=swa_params,
                  swa_decay_rate=swa_decay_rate, lr=pg["lr"], betas=pg["betas"], eps=pg["eps"],
                  weight_decay=pg["weight_decay"], amsgrad=pg["amsgrad"], adam_math_mode=AdamMathType.PyTorchAdam)
        sd = adam_optimizer.state_dict()
        sd["param_groups"][0].setdefault("bias_correction", True)
        steps = [st["step"] for st in sd["state"].values()]
        if not steps:
            steps = [torch.tensor(1)]
        elif not all(s == steps[0] for s in steps):
            raise ValueError("FusedAdamSWA requires all parameters were updated by same steps!")
        sd["param_groups"][0].setdefault("step", int(torch.as_tensor(steps[0]).item()))
        opt.load_state_dict(sd)
        return opt
