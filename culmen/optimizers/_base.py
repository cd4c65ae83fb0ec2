"""What every fused optimizer of :mod:`culmen.optimizers` shares.

* argument checks with torch.optim's messages (``Invalid learning rate: -1`` ...);
* ``zero_grad`` following the Apex ``set_grad_none`` switch;
* the GradScaler contract: ``torch.amp.GradScaler`` sets ``grad_scale`` / ``found_inf`` on an optimizer
  whose ``_step_supports_amp_scaling`` is true and calls ``step()``; the older contract passes the
  scaler itself as ``step(grad_scaler=...)``. :meth:`FusedOptimizer._amp_scaling` turns both into
  ``(grad_scale | None, found_inf | None)`` device tensors, without a host sync;
* a persistent int32 noop flag per device (the ``noop_flag`` of the ``amp_C`` ops);
* ``load_state_dict`` that keeps the dtype of every saved state tensor (torch.optim casts floating state
  to the parameter's dtype, which would turn fp32 moments and master weights of bf16 params into bf16)
  and moves group-level tensors (device ``step`` / ``lr``) to the group's device.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, compress, repeat
from typing import Any

import torch
from torch import Tensor

from culmen.ops.multi_tensor.common import CONTIG, DTYPE, GENERATION, PTR

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _scalar(owner: str, name: str, value: Any, what: str = "a number") -> float:
    """``value`` as a float: a real number (not a bool) or a 1-element tensor; TypeError naming ``name``."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{owner}: a tensor {name} must have 1 element, got shape {tuple(value.shape)}")
        if value.is_floating_point() or not value.is_complex():
            return float(value.detach().reshape(()).cpu()) if value.device.type != "meta" else 0.0
        raise TypeError(f"{owner}: {name} must be {what}, got a {value.dtype} tensor")
    if not _is_number(value):
        raise TypeError(f"{owner}: {name} must be {what}, got {value!r} ({type(value).__name__})")
    return float(value)


def check_lr(lr: Any, owner: str = "optimizer") -> None:
    """torch.optim's check of a learning rate: a number >= 0 or a 1-element tensor (``required`` passes)."""
    if lr is _Required:
        return
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{owner}: Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        return
    if not 0.0 <= _scalar(owner, "lr", lr):
        raise ValueError(f"{owner}: Invalid learning rate: lr={lr!r} (must be >= 0)")


def check_eps(eps: Any, owner: str = "optimizer") -> None:
    if not 0.0 <= _scalar(owner, "eps", eps):
        raise ValueError(f"{owner}: Invalid epsilon value: eps={eps!r} (must be >= 0)")


def check_betas(betas: Any, owner: str = "optimizer") -> None:
    """``betas``: a pair ``(beta1, beta2)`` (tuple or list) of numbers in ``[0, 1)``."""
    if isinstance(betas, (str, bytes, Tensor)) or not isinstance(betas, Sequence):
        raise TypeError(f"{owner}: betas must be a pair (beta1, beta2) of numbers in [0, 1), got {betas!r} "
                        f"({type(betas).__name__})")
    if len(betas) != 2:
        raise ValueError(f"{owner}: betas must be a pair (beta1, beta2), got {len(betas)} values: {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= _scalar(owner, f"betas[{i}]", b) < 1.0:
            raise ValueError(f"{owner}: Invalid beta parameter at index {i}: betas[{i}]={b!r} (must be in [0, 1))")


def check_weight_decay(weight_decay: Any, owner: str = "optimizer") -> None:
    if not 0.0 <= _scalar(owner, "weight_decay", weight_decay):
        raise ValueError(f"{owner}: Invalid weight_decay value: weight_decay={weight_decay!r} (must be >= 0)")


def check_momentum(momentum: Any, owner: str = "optimizer") -> None:
    if not 0.0 <= _scalar(owner, "momentum", momentum):
        raise ValueError(f"{owner}: Invalid momentum value: momentum={momentum!r} (must be >= 0)")


def _check_nonneg(name: str) -> Callable[[Any, str], None]:
    def check(value: Any, owner: str = "optimizer") -> None:
        if not 0.0 <= _scalar(owner, name, value):
            raise ValueError(f"{owner}: Invalid {name} value: {name}={value!r} (must be >= 0)")
    return check


def _check_real(name: str) -> Callable[[Any, str], None]:
    def check(value: Any, owner: str = "optimizer") -> None:
        v = _scalar(owner, name, value)
        if v != v:
            raise ValueError(f"{owner}: {name} must not be NaN")
    return check


def _check_flag(name: str) -> Callable[[Any, str], None]:
    def check(value: Any, owner: str = "optimizer") -> None:
        if not isinstance(value, (bool, int)) and type(value).__name__ != "bool_":  # numpy.bool_ too
            raise TypeError(f"{owner}: {name} must be a bool, got {value!r} ({type(value).__name__})")
    return check


def _check_max_grad_norm(value: Any, owner: str = "optimizer") -> None:
    if value is not None:
        _check_real("max_grad_norm")(value, owner)


def _check_step(value: Any, owner: str = "optimizer") -> None:
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_floating_point():
            raise ValueError(f"{owner}: a tensor step must be a 1-element integer tensor, got {value.dtype} "
                             f"{tuple(value.shape)}")
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{owner}: step must be an int >= 0, got {value!r}")


HYPER_CHECKS: dict[str, Callable[[Any, str], None]] = {
    "lr": check_lr,
    "eps": check_eps,
    "betas": check_betas,
    "weight_decay": check_weight_decay,
    "momentum": check_momentum,
    "dampening": _check_real("dampening"),
    "trust_coefficient": _check_nonneg("trust_coefficient"),
    "max_grad_norm": _check_max_grad_norm,
    "step": _check_step,
    "bias_correction": _check_flag("bias_correction"),
    "grad_averaging": _check_flag("grad_averaging"),
    "nesterov": _check_flag("nesterov"),
    "init_zero": _check_flag("init_zero"),
    "is_skipped": _check_flag("is_skipped"),
}
"""The checks of the fused optimizers' hyper-parameters, by name: each raises ``ValueError`` / ``TypeError``
naming the argument and its value. Run on the constructor's arguments and on every param group's values."""


def check_hyper(owner: str, **values: Any) -> None:
    """Check the hyper-parameters ``values`` (names of :data:`HYPER_CHECKS`) of optimizer ``owner``."""
    for name, value in values.items():
        HYPER_CHECKS[name](value, owner)


class _RequiredParameter:
    """Marker for an argument without a default (torch.optim.optimizer.required)."""

    def __repr__(self) -> str:
        return "<required parameter>"


try:  # the same object torch.optim uses, so ``lr=torch.optim.optimizer.required`` works too
    from torch.optim.optimizer import required as _Required
except ImportError:  # pragma: no cover
    _Required = _RequiredParameter()

required = _Required


_GRAD = operator.attrgetter("grad")
_IS = operator.is_
_IS_NOT = operator.is_not


class GroupPlan:
    """A fused optimizer's cached view of one param group: which params have gradients, their state lists
    and the kernels' plans, reused while the group holds the same params (by identity and data address)
    with gradients present in the same places and of the same dtypes.

    Gradients may be new tensors every step (``zero_grad(set_to_none=True)``): ``refresh`` then re-reads
    their addresses (``gkey``, the key of the kernels' address tables) with a few C-level passes.
    ``fast``: one device, every tensor contiguous, the Triton backend: the optimizer's cached launches
    run; otherwise it takes the general (per-call) path of the ops.
    """

    def __init__(self, group: dict, params: list[Tensor], grads: list, mask: tuple[bool, ...],
                 check: Callable[[list, list], None] | None = None) -> None:
        self.group = group
        self.params = params
        self.n = len(params)
        self.pptrs = tuple(map(PTR, params))
        self.gen = GENERATION.value
        self.mask = mask
        self.all_live = all(mask)
        self.live = params if self.all_live else list(compress(params, mask))
        self.grads = grads
        self.live_grads = grads if self.all_live else list(compress(grads, mask))
        if check is not None:  # before any data_ptr (a sparse gradient has none)
            check(self.live, self.live_grads)
        self.gdtypes = tuple(map(DTYPE, self.live_grads))
        self.gkey = tuple(map(PTR, self.live_grads))
        self.device = self.live[0].device
        self.calls: list = []
        self.variants: dict = {}
        self.fast = False

    def valid(self, group: dict, params: list[Tensor], grads: list) -> bool:
        """Whether this plan still describes ``group`` (refreshing the gradient addresses if they moved)."""
        if self.group is not group or self.params is not params or self.gen != GENERATION.value \
                or len(grads) != self.n or tuple(map(PTR, params)) != self.pptrs:
            return False
        if all(map(_IS, grads, self.grads)):
            return True
        mask = tuple(map(_IS_NOT, grads, repeat(None)))
        if mask != self.mask:
            return False
        live = grads if self.all_live else list(compress(grads, mask))
        try:
            if tuple(map(DTYPE, live)) != self.gdtypes or (self.fast and not all(map(CONTIG, live))):
                return False
            self.gkey = tuple(map(PTR, live))
        except RuntimeError:  # e.g. a sparse gradient: the rebuild's checks explain it
            return False
        self.grads, self.live_grads = grads, live
        return True

    def select(self, idx: list[int] | None):
        """A function taking the live gradients' addresses to those of the live positions ``idx``."""
        if idx is None:
            return None
        if len(idx) == 1:
            i = idx[0]
            return lambda key: (key[i],)
        return operator.itemgetter(*idx)


def _device_of(group: dict) -> torch.device | None:
    params = group["params"]
    return params[0].device if params else None


class FusedOptimizer(torch.optim.Optimizer):
    """Base class: zero_grad, GradScaler plumbing, noop flags and a dtype-keeping ``load_state_dict``."""

    set_grad_none: bool = True

    def __init__(self, params: Iterable, defaults: dict[str, Any]) -> None:
        self._noop_flags: dict[tuple[str, torch.device], Tensor] = {}
        self._lists_cache: dict[Any, tuple[list[Tensor], Any]] = {}
        self._plans: dict[int, GroupPlan] = {}
        super().__init__(params, defaults)

    def _group_plan(self, group: dict, build: Callable[[dict, list, list, tuple], GroupPlan]) -> GroupPlan | None:
        """The cached ``GroupPlan`` of ``group`` (``None``: no param has a gradient), rebuilt by
        ``build(group, params, grads, mask)`` when the params, the gradients' presence or dtypes changed.
        ``build`` validates, creates missing state and may return a plan not to be cached
        (``plan.cacheable`` false, e.g. on a param's first momentum step)."""
        params = group["params"]
        grads = list(map(_GRAD, params))
        plan = self._plans.get(id(group))
        if plan is not None and plan.valid(group, params, grads):
            return plan
        mask = tuple(map(_IS_NOT, grads, repeat(None)))
        if not any(mask):
            self._plans.pop(id(group), None)
            return None
        plan = build(group, params, grads, mask)
        if getattr(plan, "cacheable", True):
            self._plans[id(group)] = plan
        else:
            self._plans.pop(id(group), None)
        return plan

    # ------------------------------------------------------------------------------------ grads

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Drop the gradients (``set_grad_none``, Apex's switch) or zero them; ``set_to_none`` overrides."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else bool(set_to_none))

    def _params_with_grad(self, group: dict) -> list[Tensor]:
        """The params of ``group`` that have a gradient (frozen ones skipped); dense, supported dtypes."""
        live, grads = self._live(group)
        self._check_live(live, grads)
        return live

    @staticmethod
    def _live(group: dict) -> tuple[list[Tensor], list[Tensor]]:
        """(params of ``group`` with a gradient, their gradients), without any check (the hot path)."""
        params = group["params"]
        grads = [p.grad for p in params]
        if all(g is not None for g in grads):
            return params, grads
        live = [p for p, g in zip(params, grads) if g is not None]
        return live, [g for g in grads if g is not None]

    def _check_live(self, live: list[Tensor], grads: list[Tensor]) -> None:
        name = type(self).__name__
        for p, g in zip(live, grads):
            if g.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients (got a sparse grad for a param of "
                                   f"shape {tuple(p.shape)}); use torch.optim.SparseAdam or densify the gradient")
            if p.dtype not in SUPPORTED_DTYPES:
                raise RuntimeError(f"{name} supports float32, float16 and bfloat16 params, got {p.dtype}")

    def _state_lists(self, group: dict, key: Any, live: list[Tensor], grads: list[Tensor],
                     build: Callable[[list[Tensor]], tuple[Any, bool]]) -> Any:
        """The per-param state lists of ``live`` for the kernels, rebuilt only when ``live`` changes.

        ``build(live)`` creates missing state and returns ``(lists, cacheable)``; the result is reused
        while the same params (by identity) have gradients, which keeps the per-step host work to a few
        list operations. The cache is dropped by ``load_state_dict`` and ``add_param_group``.
        """
        ck = (id(group), key)
        hit = self._lists_cache.get(ck)
        if hit is not None and len(hit[0]) == len(live) and all(a is b for a, b in zip(hit[0], live)):
            return hit[1]
        self._check_live(live, grads)
        lists, cacheable = build(live)
        if cacheable:
            self._lists_cache[ck] = (list(live), lists)
        else:
            self._lists_cache.pop(ck, None)
        return lists

    def _zero_state_lists(self, group: dict, live: list[Tensor], grads: list[Tensor], names: tuple[str, ...],
                          dtype: Callable[[Tensor], torch.dtype] = lambda p: torch.float32) -> list[list[Tensor]]:
        """``[params, state[name] for each name]`` for ``live``; missing state starts as zeros of ``dtype(p)``."""

        def build(ps: list[Tensor]) -> tuple[list[list[Tensor]], bool]:
            for p in ps:
                st = self.state[p]
                for n in names:
                    if n not in st:
                        st[n] = torch.zeros_like(p, dtype=dtype(p), memory_format=torch.preserve_format)
            return [list(ps)] + [[self.state[p][n] for p in ps] for n in names], True

        return self._state_lists(group, names, live, grads, build)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, then the group's hyper-parameters are checked (a group may override
        the constructor's values: ``{"params": ..., "lr": -1}`` raises ``ValueError`` naming ``lr``)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        owner = f"{type(self).__name__} (param group {len(self.param_groups) - 1})"
        for name, value in group.items():
            check = HYPER_CHECKS.get(name)
            if check is not None and value is not self.defaults.get(name, _Required):
                check(value, owner)
        self._lists_cache = {}
        self._plans = {}

    # ---------------------------------------------------------------------------------- flags

    def _flag(self, kind: str, device: torch.device) -> Tensor:
        flag = self._noop_flags.get((kind, device))
        if flag is None:
            flag = torch.zeros(1, dtype=torch.int32, device=device)
            self._noop_flags[(kind, device)] = flag
        return flag

    def _noop(self, device: torch.device) -> Tensor:
        """A persistent zero int32 flag on ``device`` (allocated once: CUDA-graph safe)."""
        return self._flag("zero", device)

    def _found_inf_flag(self, found_inf: Tensor, device: torch.device) -> Tensor:
        """``found_inf`` (GradScaler's float tensor, any device) copied into a persistent int32 flag."""
        flag = self._flag("inf", device)
        flag.copy_(found_inf.reshape(-1)[:1], non_blocking=flag.device.type != "cpu")  # to the host: blocking
        return flag

    # ------------------------------------------------------------------------------ GradScaler

    def _amp_scaling(self, grad_scaler: Any = None) -> tuple[Tensor | None, Tensor | None]:
        """``(grad_scale, found_inf)`` for this step: device tensors or ``None``.

        ``grad_scale`` is the factor the gradients are still multiplied by (``None`` when they were
        unscaled already, e.g. by ``scaler.unscale_(opt)`` before clipping); ``found_inf`` is non-zero
        when some gradient holds an inf/NaN, in which case the step must change nothing.
        """
        if grad_scaler is not None and getattr(grad_scaler, "is_enabled", lambda: True)():
            from torch.amp.grad_scaler import OptState

            st = grad_scaler._per_optimizer_states[id(self)]
            if st["stage"] is OptState.UNSCALED:
                scale = None
                per_device = st["found_inf_per_device"]
            else:
                per_device = grad_scaler._check_inf_per_device(self)
                scale = grad_scaler._get_scale_async()
            if not per_device:
                return scale, None
            found = list(per_device.values())
            dev = found[0].device
            found_inf = found[0] if len(found) == 1 else sum(t.to(dev, non_blocking=dev.type != "cpu") for t in found)
            return scale, found_inf
        return getattr(self, "grad_scale", None), getattr(self, "found_inf", None)

    @staticmethod
    def _inv_scale(grad_scale: Tensor | None) -> Tensor | None:
        """``1 / grad_scale`` as a 1-element fp32 device tensor (no host sync), or ``None``."""
        if grad_scale is None:
            return None
        return torch.reciprocal(grad_scale.reshape(1).to(torch.float32))

    @staticmethod
    def _unscale_grads_(grads: list[Tensor], inv_scale: Tensor | None) -> None:
        """Multiply ``grads`` by ``inv_scale`` in place (one multi-tensor launch per device and dtype).

        Used by the optimizers whose kernels take the scale as a host number: the GradScaler's scale is
        a device tensor, and reading it would be a host sync.
        """
        if inv_scale is None or not grads:
            return
        by_dev: dict[torch.device, list[Tensor]] = {}
        for g in grads:
            by_dev.setdefault(g.device, []).append(g)
        for dev, gs in by_dev.items():
            torch._foreach_mul_(gs, inv_scale.to(dev, non_blocking=dev.type != "cpu").reshape(()))

    def _momentum_sets(self, group: dict, live: list, found_inf: Any, fresh: Any) -> dict[bool, list[int]]:
        """Indices of ``live`` split by ``first_run`` (no momentum buffer yet), creating new buffers with ``fresh``.

        Params on their first step form their own launch with ``first_run`` (the kernel copies the
        gradient into the new buffer): Apex passes one flag per launch, which is wrong when a param's
        gradient appears later than the others'. A skipped step (GradScaler overflow) must leave a param
        "first" for the next one: without dampening a zero buffer does that (``momentum*0 + g == g``
        exactly); with dampening the first step under a GradScaler reads ``found_inf`` once (one host
        sync per new param set).
        """
        sets: dict[bool, list[int]] = {}
        for i, p in enumerate(live):
            state = self.state[p]
            first = state.get("momentum_buffer") is None
            if first and found_inf is not None:
                if group["dampening"] == 0:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    first = False
                else:
                    if self._skipped is None:
                        self._skipped = bool(found_inf.reshape(-1)[0].item() != 0)
                    if self._skipped:
                        continue
            if first:
                state["momentum_buffer"] = fresh(p, memory_format=torch.preserve_format)
            sets.setdefault(first, []).append(i)
        return sets

    def _begin_step(self, closure: Any, kwargs: dict[str, Any], legacy: tuple[str, ...] = ()) -> tuple[Any, Any]:
        """Start of every ``step()``: parse its keywords, run ``closure`` with grad on; ``(loss, grad_scaler)``."""
        grad_scaler = self._parse_step_kwargs(kwargs, legacy)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        return loss, grad_scaler

    def _parse_step_kwargs(self, kwargs: dict[str, Any], legacy: tuple[str, ...] = ()) -> Any:
        """Pop ``grad_scaler`` (the older GradScaler contract) and reject anything unexpected."""
        grad_scaler = kwargs.pop("grad_scaler", None)
        for k in legacy:
            if kwargs.pop(k, None) is not None:
                raise RuntimeError(f"{type(self).__name__}.step(): the {k!r} argument was removed (as in Apex); "
                                   "build the optimizer like torch.optim's and call step() without it")
        if kwargs:
            raise TypeError(f"{type(self).__name__}.step() got unexpected keyword arguments {sorted(kwargs)}")
        return grad_scaler

    # ------------------------------------------------------------------------------ step counter

    def _advance_step(self, group: dict, dev: torch.device, on_device: bool, noop: Tensor | None) -> int | Tensor:
        """Advance the group's step counter (Apex keeps one per group); return what the kernel reads.

        A host int unless ``on_device`` (capturable, or a GradScaler in use) or already a tensor: then a
        1-element int32 device tensor, advanced only where ``noop`` is 0 when a noop flag is given (a
        skipped step leaves it unchanged), without a host sync.
        """
        step = group.get("step", 0)
        if not isinstance(step, Tensor) and not on_device:
            group["step"] = int(step) + 1
            return group["step"]
        if not isinstance(step, Tensor):
            step = torch.full((1,), int(step), dtype=torch.int32, device=dev)
            group["step"] = step
        elif step.device != dev:
            step = group["step"] = step.to(dev)
        if noop is not None:
            step.add_(noop.eq(0))
        else:
            step.add_(1)
        return step

    # ------------------------------------------------------------------------------ state dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's ``load_state_dict``, keeping each saved state tensor's dtype.

        torch.optim casts floating state to the param's dtype; the fused optimizers keep fp32 moments
        and fp32 master weights for 16-bit params, so those are restored in their saved dtype (on the
        param's device). Group-level tensors (``step``, ``lr`` of capturable optimizers) move to the
        device of the group's params.
        """
        saved_state = state_dict["state"]
        saved_groups = state_dict["param_groups"]
        self._lists_cache = {}
        self._plans = {}
        super().load_state_dict(state_dict)
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in self.param_groups)))
        for pid, saved in saved_state.items():
            p = id_map.get(pid)
            if p is None or not isinstance(saved, dict):
                continue
            st = self.state[p]
            for k, v in saved.items():
                if isinstance(v, Tensor) and v.is_floating_point() and st.get(k) is not None \
                        and st[k].dtype != v.dtype:
                    st[k] = v.to(device=p.device)
        for group in self.param_groups:
            for k, v in self.defaults.items():  # e.g. a torch.optim checkpoint lacks Apex's group keys
                group.setdefault(k, v.clone() if isinstance(v, Tensor) else v)
            dev = _device_of(group)
            if dev is None:
                continue
            for k in ("step", "lr"):
                v = group.get(k)
                if isinstance(v, Tensor) and v.device != dev:
                    group[k] = v.to(dev)
        self._after_load_state_dict()

    def _after_load_state_dict(self) -> None:
        """Hook for subclasses (e.g. to convert a loaded host step / lr for capturable mode)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if not hasattr(self, "_noop_flags"):
            self._noop_flags = {}
        self._lists_cache = {}
        self._plans = {}


def group_by_device(tensors: list[Tensor]) -> dict[torch.device, list[int]]:
    """Indices of ``tensors`` grouped by device (insertion order kept)."""
    out: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.device, []).append(i)
    return out
