"""``torch.library`` custom ops for the multi-tensor kernels, used while ``torch.compile`` traces.

Eager calls go straight to the launchers (``torch.library`` dispatch costs host time per call that a
step over hundreds of tensors does not need); under ``torch.compile`` each amp_C entry point calls
the op registered here instead, so Dynamo sees one opaque, correctly-mutating node and never
traces the table building (``data_ptr`` and numpy, which would break the graph).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.multi_tensor import adam, elementwise, l2norm, sgd

_NS = "culmen"


@torch.library.custom_op(f"{_NS}::multi_tensor_scale", mutates_args=("outputs", "noop_flag"))
def scale_op(inputs: list[Tensor], outputs: list[Tensor], noop_flag: Tensor, scale: float) -> None:
    elementwise.multi_tensor_scale(1, noop_flag, [inputs, outputs], scale)


@scale_op.register_fake
def _(inputs, outputs, noop_flag, scale):
    return None


@torch.library.custom_op(f"{_NS}::multi_tensor_axpby", mutates_args=("outs", "noop_flag"))
def axpby_op(xs: list[Tensor], ys: list[Tensor], outs: list[Tensor], noop_flag: Tensor, a: float, b: float,
             arg_to_check: int) -> None:
    elementwise.multi_tensor_axpby(1, noop_flag, [xs, ys, outs], a, b, arg_to_check)


@axpby_op.register_fake
def _(xs, ys, outs, noop_flag, a, b, arg_to_check):
    return None


@torch.library.custom_op(f"{_NS}::multi_tensor_l2norm", mutates_args=("outs", "noop_flag"))
def l2norm_op(xs: list[Tensor], outs: list[Tensor], noop_flag: Tensor, per_tensor: bool, norm_mode: int, scale: float,
              inv_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    lists = [xs, outs] if norm_mode == l2norm._SCALE_OUT else [xs]
    s = inv_scale if norm_mode == l2norm._UNSCALE else scale
    total, per = l2norm._l2norm("multi_tensor_l2norm", 1, noop_flag, lists, per_tensor, norm_mode, s, len(lists))
    return total.clone(), per.clone()


@l2norm_op.register_fake
def _(xs, outs, noop_flag, per_tensor, norm_mode, scale, inv_scale):
    dev = noop_flag.device
    return (torch.empty(1, dtype=torch.float32, device=dev),
            torch.empty(len(xs) if per_tensor else 0, dtype=torch.float32, device=dev))


# ``grads``: the unscaled gradients are written back when an inverse scale is given.
@torch.library.custom_op(f"{_NS}::adam_update",
                         mutates_args=("grads", "params", "exp_avgs", "exp_avg_sqs", "masters"))
def adam_op(grads: list[Tensor], params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
            masters: list[Tensor], noop_flag: Tensor, lr: float, lr_t: Tensor | None, beta1: float, beta2: float,
            eps: float, step: int, step_t: Tensor | None, adam_mode: int, bias_correction: bool, weight_decay: float,
            inv_scale: float, inv_scale_t: Tensor | None, has_inv_scale: bool, unscale_skipped: bool = False) -> None:
    lists = [grads, params, exp_avgs, exp_avg_sqs] + ([masters] if masters else [])
    inv = inv_scale_t if inv_scale_t is not None else (inv_scale if has_inv_scale else None)
    adam.adam_update(lists, lr=lr_t if lr_t is not None else lr, beta1=beta1, beta2=beta2, eps=eps,
                     step=step_t if step_t is not None else step, mode=adam_mode, bias_correction=bias_correction,
                     weight_decay=weight_decay, noop_flag=noop_flag, inv_scale=inv, unscale_skipped=unscale_skipped)


@adam_op.register_fake
def _(*args):
    return None


@torch.library.custom_op(f"{_NS}::multi_tensor_sgd", mutates_args=("params", "momentum_buffers", "copies"))
def sgd_op(grads: list[Tensor], params: list[Tensor], momentum_buffers: list[Tensor], copies: list[Tensor],
           noop_flag: Tensor, wd: float, momentum: float, dampening: float, lr: float, nesterov: bool,
           first_run: bool, wd_after_momentum: bool, scale: float) -> None:
    lists = [grads, params, momentum_buffers] + ([copies] if copies else [])
    sgd.multi_tensor_sgd(1, noop_flag, lists, wd, momentum, dampening, lr, nesterov, first_run, wd_after_momentum,
                         scale)


@sgd_op.register_fake
def _(*args):
    return None


def adam_via_op(tensor_lists, *, lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay, noop_flag,
                inv_scale, unscale_skipped: bool = False) -> None:
    """``adam_update`` through the custom op (the arguments split into number / tensor forms)."""
    masters = list(tensor_lists[4]) if len(tensor_lists) == 5 else []
    lr_t = lr if isinstance(lr, Tensor) else None
    step_t = step if isinstance(step, Tensor) else None
    inv_t = inv_scale if isinstance(inv_scale, Tensor) else None
    adam_op(list(tensor_lists[0]), list(tensor_lists[1]), list(tensor_lists[2]), list(tensor_lists[3]), masters,
            noop_flag, 0.0 if lr_t is not None else float(lr), lr_t, float(beta1), float(beta2), float(eps),
            0 if step_t is not None else int(step), step_t, int(mode), bool(bias_correction), float(weight_decay),
            float(inv_scale) if (inv_scale is not None and inv_t is None) else 1.0, inv_t, inv_scale is not None,
            bool(unscale_skipped))


# The layer-wise optimizer ops share one generic op: their scalar arguments are encoded as a kinds
# string ("T" tensor, "f" float, "i" int, "b" bool, "n" None) over a float list and a tensor list.
# Every tensor is declared mutated, which is always correct (functionalization copies back).
@torch.library.custom_op(f"{_NS}::amp_c_update", mutates_args=("tensors", "noop_flag", "tensor_args"))
def amp_c_update_op(name: str, tensors: list[Tensor], list_sizes: list[int], noop_flag: Tensor,
                    tensor_args: list[Tensor], kinds: str, numbers: list[float]) -> None:
    from culmen.multi_tensor_apply import amp_C

    lists, start = [], 0
    for n in list_sizes:
        lists.append(tensors[start:start + n])
        start += n
    targs = iter(tensor_args)
    decode = {"T": lambda x: next(targs), "f": float, "i": lambda x: int(x), "b": bool, "n": lambda x: None}
    args = [decode[k](x) for k, x in zip(kinds, numbers)]
    getattr(amp_C, name)(1, noop_flag, lists, *args)


@amp_c_update_op.register_fake
def _(*args):
    return None


def amp_c_update(name: str, noop_flag: Tensor, tensor_lists, args: tuple) -> None:
    """Call the amp_C op ``name`` through ``culmen::amp_c_update`` (used while compiling)."""
    kinds, numbers, tensor_args = [], [], []
    for a in args:
        if isinstance(a, Tensor):
            kinds.append("T")
            numbers.append(0.0)
            tensor_args.append(a)
        elif a is None:
            kinds.append("n")
            numbers.append(0.0)
        elif isinstance(a, bool):
            kinds.append("b")
            numbers.append(float(a))
        elif isinstance(a, int):
            kinds.append("i")
            numbers.append(float(a))
        else:
            kinds.append("f")
            numbers.append(float(a))
    flat = [t for lst in tensor_lists for t in lst]
    amp_c_update_op(name, flat, [len(lst) for lst in tensor_lists], noop_flag, tensor_args, "".join(kinds), numbers)


@torch.library.custom_op(f"{_NS}::update_scale_hysteresis",
                         mutates_args=("current_scale", "growth_tracker", "hysteresis_tracker"))
def hysteresis_op(current_scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor, found_inf: Tensor,
                  growth_factor: float, backoff_factor: float, growth_interval: int, hysteresis: int) -> None:
    from culmen.ops.multi_tensor.scaler import update_scale_hysteresis

    update_scale_hysteresis(current_scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                            backoff_factor, growth_interval, hysteresis)


@hysteresis_op.register_fake
def _(*args):
    return None
