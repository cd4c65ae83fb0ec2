"""How ``amp.initialize`` patches an optimizer (Apex's ``apex.amp._process_optimizer``).

Every optimizer gets an ``_amp_stash`` and the methods ``scale_loss`` calls around the backward:
``_prepare_amp_backward`` (set the current gradients aside, so the new backward writes fresh scaled
ones) and ``_post_amp_backward(scaler)`` (unscale the new gradients, adding the set-aside ones in the
same multi-tensor launch: ``out = new / scale + old``).

With master weights (O2) the 16-bit parameters of each group are replaced in ``param_groups`` by
fp32 copies, created lazily (first ``zero_grad`` / backward / ``step`` / ``state_dict`` /
``load_state_dict``, as in Apex, so a model checkpoint loaded after ``initialize`` still reaches
them). ``_post_amp_backward`` writes ``fp16_grad / scale`` into the fp32 master gradients;
``step()`` updates the masters and copies them back into the model in one launch.

Works with any ``torch.optim`` optimizer and culmen's fused optimizers (they see fp32 parameters).

Differences from Apex (all fixes of known Apex problems):

* ``optimizer.load_state_dict`` creates the master weights first, so the saved fp32 state is loaded
  into fp32 masters (Apex loaded it into the 16-bit parameters first, rounding Adam's moments).
* The masters are registered with the model's ``state_dict`` hook (see ``_initialize``): the model's
  state dict holds the exact fp32 master values and loading it restores them, so an O2 checkpoint
  resumes bit-identically (Apex saved the rounded 16-bit values).
* ``zero_grad(set_to_none=True)`` is honoured (Apex's patched ``zero_grad`` took no argument and
  always zeroed in place; that stays the default here).
* Parameters may be fp16, bf16 or fp32 on any device (Apex: CUDA fp16 / fp32 only).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from culmen.amp._amp_state import maybe_print
from culmen.amp.handle import disable_casts
from culmen.amp.scaler import LossScaler, _group_by_device
from culmen.multi_tensor_apply import amp_C, multi_tensor_applier

__all__ = ["AmpOptimizerState", "MASTER_OF", "PENDING_MASTER", "_process_optimizer"]

LOW_DTYPES = (torch.float16, torch.bfloat16)

MASTER_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""16-bit model parameter -> its fp32 master parameter (for the model's state-dict hooks)."""

PENDING_MASTER: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""16-bit model parameter -> fp32 value loaded by ``model.load_state_dict`` before its master existed."""


class AmpOptimizerState:
    """Attribute stash attached to an optimizer as ``_amp_stash``."""


_DUMMY_FLAGS: dict[torch.device, Tensor] = {}


def _copy(src: Sequence[Tensor], dst: Sequence[Tensor], scale: float = 1.0) -> None:
    """``dst[i] = src[i] * scale`` in one multi-tensor launch per device (overflow flag ignored)."""
    if not src:
        return
    with torch.no_grad():
        for dev, (s, d) in _group_by_device(list(src), list(dst)).items():
            flag = _DUMMY_FLAGS.get(dev)
            if flag is None:
                flag = _DUMMY_FLAGS[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
            multi_tensor_applier(amp_C.multi_tensor_scale, flag, [s, d], scale)


def _zero_(grad: Tensor) -> None:
    """Zero a gradient in place like ``Optimizer.zero_grad`` (works on DDP bucket views too)."""
    if grad.grad_fn is not None:
        grad.detach_()
    else:
        grad.requires_grad_(False)
    grad.zero_()


def _check_dtype(param: Tensor) -> None:
    if param.dtype not in (*LOW_DTYPES, torch.float32):
        raise TypeError("Optimizer's parameters must be float16, bfloat16 or float32 tensors under amp. "
                        f"Received a {param.dtype} parameter of shape {tuple(param.shape)}.")


def _make_master(param: Tensor) -> Tensor:
    pending = PENDING_MASTER.pop(param, None)
    master = None
    if pending is not None and pending.shape == param.shape:
        cand = pending.to(device=param.device, dtype=torch.float32)
        # Use the loaded fp32 value only if the model still holds its rounding (nothing changed since).
        if torch.equal(cand.to(param.dtype), param.detach()):
            master = cand if cand is not pending else cand.clone()
    if master is None:
        master = param.detach().float()
    master.requires_grad_(True)
    MASTER_OF[param] = master
    return master


# ------------------------------------------------------------------------------- lazy init


def _add_master_group(stash: Any, params: list, state: dict) -> tuple[list, list, list]:
    """Replace the trainable 16-bit ``params`` (in place) by fp32 masters, moving any optimizer state to
    them; append the group's ``(fp16, masters, fp32)`` lists to the stash's per-group lists and return them."""
    fp16_this, masters_this, fp32_this = [], [], []
    for i, param in enumerate(params):
        if not param.requires_grad:
            continue
        _check_dtype(param)
        if param.dtype in LOW_DTYPES:
            fp16_this.append(param)
            master = params[i] = _make_master(param)
            masters_this.append(master)
            if param in state:
                state[master] = state.pop(param)
        else:
            fp32_this.append(param)
    stash.fp16_groups.append(fp16_this)
    stash.fp32_from_fp16_groups.append(masters_this)
    stash.fp32_from_fp32_groups.append(fp32_this)
    return fp16_this, masters_this, fp32_this


def lazy_init_with_master_weights(self: Any) -> None:
    stash = self._amp_stash
    stash.fp16_groups, stash.fp32_from_fp16_groups, stash.fp32_from_fp32_groups = [], [], []
    for group in self.param_groups:
        _add_master_group(stash, group["params"], self.state)
    stash.all_fp16_params = [p for g in stash.fp16_groups for p in g]
    stash.all_fp32_from_fp16_params = [p for g in stash.fp32_from_fp16_groups for p in g]
    stash.all_fp32_from_fp32_params = [p for g in stash.fp32_from_fp32_groups for p in g]
    stash.all_fp16_grad_stash = [None] * len(stash.all_fp16_params)
    stash.all_fp32_from_fp32_grad_stash = [None] * len(stash.all_fp32_from_fp32_params)
    for param in stash.all_fp32_from_fp16_params:
        param.grad = None
    for param in stash.all_fp32_from_fp32_params:
        param.grad = None
    # Recast any per-parameter state that already exists to the masters' dtype (as Apex).
    stash.orig_load_state_dict(stash.orig_state_dict())


def lazy_init_no_master_weights(self: Any) -> None:
    stash = self._amp_stash
    stash.all_fp16_params, stash.all_fp32_params = [], []
    for group in self.param_groups:
        for param in group["params"]:
            _check_dtype(param)
            (stash.all_fp16_params if param.dtype in LOW_DTYPES else stash.all_fp32_params).append(param)
    stash.all_fp16_grad_stash = [None] * len(stash.all_fp16_params)
    stash.all_fp32_grad_stash = [None] * len(stash.all_fp32_params)


def _amp_lazy_init(self: Any) -> None:
    stash = self._amp_stash
    if not stash.lazy_init_called:
        stash.lazy_init_called = True
        self._lazy_init_maybe_master_weights()


def _master_params_to_model_params(self: Any) -> None:
    stash = self._amp_stash
    _copy(stash.all_fp32_from_fp16_params, stash.all_fp16_params)


# ------------------------------------------------------------------------- backward hooks


def post_backward_models_are_masters(scaler: LossScaler, params: Sequence[Tensor], stashed_grads: list,
                                     scale_override: tuple[float, float, float] | None = None) -> None:
    """Unscale the new grads of ``params`` in place, adding the grads set aside before the backward."""
    grads_have_scale, stashed_have_scale, out_scale = scaler.loss_scale(), 1.0, 1.0
    if scaler.loss_scale() == 1.0 and not scaler.dynamic:
        for i, (param, stashed) in enumerate(zip(params, stashed_grads)):
            if stashed is not None:
                if param.grad is None:
                    param.grad = stashed
                else:
                    param.grad.add_(stashed)
            stashed_grads[i] = None
        return
    if scale_override is not None:
        grads_have_scale, stashed_have_scale, out_scale = scale_override
    needing_unscale, needing_unscale_with_stash, stashed = [], [], []
    for param, stashed_grad in zip(params, stashed_grads):
        if param.grad is None and stashed_grad is not None:
            param.grad = stashed_grad
        elif param.grad is not None and stashed_grad is None:
            needing_unscale.append(param.grad)
        elif param.grad is not None and stashed_grad is not None:
            needing_unscale_with_stash.append(param.grad)
            stashed.append(stashed_grad)
    with torch.no_grad():
        if needing_unscale:
            scaler.unscale(needing_unscale, needing_unscale, None, models_are_masters=True,
                           scale_override=grads_have_scale / out_scale)
        if needing_unscale_with_stash:
            scaler.unscale_with_stashed(needing_unscale_with_stash, stashed, needing_unscale_with_stash,
                                        scale_override=(grads_have_scale, stashed_have_scale, out_scale))
    for i in range(len(stashed_grads)):
        stashed_grads[i] = None


def prepare_backward_with_master_weights(self: Any) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    for param in stash.all_fp16_params:
        param.grad = None  # the backward writes a fresh grad; the master grad keeps the accumulation
    for i, param in enumerate(stash.all_fp32_from_fp32_params):
        stash.all_fp32_from_fp32_grad_stash[i] = param.grad
        param.grad = None


def post_backward_with_master_weights(self: Any, scaler: LossScaler) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    new_model, new_master, acc_model, acc_master = [], [], [], []
    for model_p, master_p in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        if model_p.grad is None:
            continue
        if master_p.grad is None:
            master_p.grad = torch.empty_like(master_p)
            new_model.append(model_p.grad)
            new_master.append(master_p.grad)
        else:
            acc_model.append(model_p.grad)
            acc_master.append(master_p.grad)
    with torch.no_grad():
        if new_model:
            scaler.unscale(new_model, new_master, scaler.loss_scale(), models_are_masters=False)
        if acc_model:
            scaler.unscale_with_stashed(acc_model, acc_master, acc_master)
    post_backward_models_are_masters(scaler, stash.all_fp32_from_fp32_params, stash.all_fp32_from_fp32_grad_stash)


def prepare_backward_no_master_weights(self: Any) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    for params, grad_stash in ((stash.all_fp16_params, stash.all_fp16_grad_stash),
                               (stash.all_fp32_params, stash.all_fp32_grad_stash)):
        for i, param in enumerate(params):
            grad_stash[i] = param.grad
            param.grad = None


def post_backward_no_master_weights(self: Any, scaler: LossScaler) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    for params, grad_stash in ((stash.all_fp16_params, stash.all_fp16_grad_stash),
                               (stash.all_fp32_params, stash.all_fp32_grad_stash)):
        post_backward_models_are_masters(scaler, params, grad_stash)


# --------------------------------------------------------------------------------- patching


def _process_optimizer(optimizer: Any, properties: Any) -> Any:
    """Attach the amp stash and methods to ``optimizer`` (in place) and return it."""
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    for name in ("_lazy_init_maybe_master_weights", "_master_params_to_model_params", "_prepare_amp_backward",
                 "_post_amp_backward", "_amp_lazy_init"):
        if hasattr(optimizer, name):
            raise RuntimeError(f"Incoming optimizer already has {name} defined.")
    stash = optimizer._amp_stash = AmpOptimizerState()
    stash.lazy_init_called = False
    stash.already_patched = False
    stash.params_have_scaled_gradients = False
    stash.skip_reasons = []  # (loss_id, new scale) of overflows that make the next step a no-op
    stash.pending_checks = []  # (loss_id, scaler) whose overflow check waits for step()
    stash.found_infs = []  # device overflow flags the next step hands to a fused optimizer
    stash.master_weights = bool(properties.master_weights)
    stash.disable_casts_in_step = bool(properties.patch_torch_functions)
    stash.orig_load_state_dict = optimizer.load_state_dict
    stash.orig_state_dict = optimizer.state_dict
    bind = types.MethodType

    if stash.master_weights:
        optimizer._lazy_init_maybe_master_weights = bind(lazy_init_with_master_weights, optimizer)
        optimizer._master_params_to_model_params = bind(_master_params_to_model_params, optimizer)
        optimizer._prepare_amp_backward = bind(prepare_backward_with_master_weights, optimizer)
        optimizer._post_amp_backward = bind(post_backward_with_master_weights, optimizer)

        def new_zero_grad(self: Any, set_to_none: bool | None = None) -> None:
            st = self._amp_stash
            self._amp_lazy_init()
            for param in (*st.all_fp16_params, *st.all_fp32_from_fp32_params):
                if param.grad is not None:
                    if set_to_none:
                        param.grad = None
                    else:
                        _zero_(param.grad)
            for param in st.all_fp32_from_fp16_params:
                param.grad = None  # master grads are rebuilt from the model grads every backward

        optimizer.zero_grad = bind(new_zero_grad, optimizer)
    else:
        optimizer._lazy_init_maybe_master_weights = bind(lazy_init_no_master_weights, optimizer)
        optimizer._prepare_amp_backward = bind(prepare_backward_no_master_weights, optimizer)
        optimizer._post_amp_backward = bind(post_backward_no_master_weights, optimizer)
    optimizer._amp_lazy_init = bind(_amp_lazy_init, optimizer)

    old_step = optimizer.step

    def new_step(self: Any, closure: Any = None, *args: Any, **kwargs: Any) -> Any:
        st = self._amp_stash
        for loss_id, scaler in st.pending_checks:
            if scaler.update_scale():
                st.skip_reasons.append((loss_id, scaler.loss_scale()))
        st.pending_checks.clear()
        if st.skip_reasons:
            if closure is not None:
                raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
            for loss_id, scale in st.skip_reasons:
                maybe_print(f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to {scale}")
            st.skip_reasons.clear()
            st.found_infs.clear()
            if st.master_weights:
                for param in st.all_fp32_from_fp16_params:
                    param.grad = None
            return None
        if st.master_weights and closure is not None:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
        self._amp_lazy_init()
        found_infs = st.found_infs
        if found_infs:
            # torch's GradScaler protocol: the fused kernel reads found_inf and changes nothing when set.
            self.found_inf = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum()
        try:
            if st.disable_casts_in_step:  # the step updates fp32 (master) params: never cast (as in Apex)
                with disable_casts():
                    retval = old_step(closure, *args, **kwargs) if closure is not None else old_step(*args, **kwargs)
            else:
                retval = old_step(closure, *args, **kwargs) if closure is not None else old_step(*args, **kwargs)
        finally:
            if found_infs:
                found_infs.clear()
                del self.found_inf
        if st.master_weights:
            self._master_params_to_model_params()
            for param in st.all_fp32_from_fp16_params:
                param.grad = None
        return retval

    optimizer.step = bind(new_step, optimizer)

    def new_load_state_dict(self: Any, state_dict: dict) -> None:
        self._amp_lazy_init()  # load the fp32 state into the fp32 masters, not the 16-bit params
        self._amp_stash.orig_load_state_dict(state_dict)

    def new_state_dict(self: Any) -> dict:
        self._amp_lazy_init()
        return self._amp_stash.orig_state_dict()

    optimizer.load_state_dict = bind(new_load_state_dict, optimizer)
    optimizer.state_dict = bind(new_state_dict, optimizer)

    old_add_param_group = optimizer.add_param_group

    def new_add_param_group(self: Any, new_group: dict) -> None:
        st = self._amp_stash
        self._amp_lazy_init()
        if not isinstance(new_group, dict):
            raise TypeError("param group must be a dict")
        params = new_group["params"]
        if isinstance(params, Tensor):
            new_group["params"] = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering "
                            "of tensors in sets will change between runs. Please use a list instead.")
        else:
            new_group["params"] = list(params)
        if st.master_weights:
            fp16_this, masters_this, fp32_this = _add_master_group(st, new_group["params"], self.state)
            st.all_fp16_params += fp16_this
            st.all_fp32_from_fp16_params += masters_this
            st.all_fp32_from_fp32_params += fp32_this
            st.all_fp16_grad_stash += [None] * len(fp16_this)
            st.all_fp32_from_fp32_grad_stash += [None] * len(fp32_this)
        else:
            for param in new_group["params"]:
                _check_dtype(param)
                if param.dtype in LOW_DTYPES:
                    st.all_fp16_params.append(param)
                    st.all_fp16_grad_stash.append(None)
                else:
                    st.all_fp32_params.append(param)
                    st.all_fp32_grad_stash.append(None)
        old_add_param_group(new_group)

    optimizer.add_param_group = bind(new_add_param_group, optimizer)
    return optimizer
