"""Manual mixed-precision helpers (Apex's ``apex.fp16_utils.fp16util``).

Differences from Apex: every helper works on any device and with bf16 as well as fp16; parameters
whose dtype differs from the rest make ``prep_param_lists(flat_master=True)`` raise a ``TypeError``
naming them (Apex printed a hint and re-raised torch's error).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from culmen.amp._amp_state import warn_deprecated_once
from culmen.fp16_utils.loss_scaler import to_python_float

__all__ = [
    "BN_convert_float",
    "FP16Model",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]


class tofp16(nn.Module):  # noqa: N801 - Apex's name
    """Module whose forward is ``input.half()``."""

    def forward(self, input: Tensor) -> Tensor:
        """Return ``input`` in fp16."""
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802 - Apex's name
    """Convert the affine batch norms inside ``module`` back to fp32 (used by :func:`network_to_half`)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine is True:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """``network`` in fp16 with batch norms in fp32, behind a :class:`tofp16` input cast."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Convert ``module``'s own floating parameters (and their grads) and buffers to ``dtype`` in place.

    The ``Parameter`` objects are kept (their ``.data`` changes), so optimizers built on them stay valid.
    """
    for param in module.parameters(recurse=False):
        if param is not None and param.data.dtype.is_floating_point:
            param.data = param.data.to(dtype=dtype)
            if param._grad is not None and param._grad.data.dtype.is_floating_point:
                param._grad.data = param._grad.data.to(dtype=dtype)
    for buf in module.buffers(recurse=False):
        if buf is not None and buf.data.dtype.is_floating_point:
            buf.data = buf.data.to(dtype=dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Convert ``network`` to ``dtype`` except its affine batch norms, which stay fp32; returns it."""
    for module in network.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine is True:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """Wraps ``network`` converted to fp16 (batch norms fp32); casts floating inputs to fp16.

    Deprecated in Apex (a one-time ``FutureWarning``); ``amp.initialize(..., opt_level="O2")`` does the same.
    """

    def __init__(self, network: nn.Module) -> None:
        warn_deprecated_once("FP16Model", "culmen.fp16_utils.FP16Model is deprecated (as in Apex); use "
                                          "amp.initialize(..., opt_level='O2') or torch.autocast.")
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: Tensor) -> object:
        """Cast floating inputs to fp16 and run the network."""
        inputs = tuple(t.half() if isinstance(t, Tensor) and t.is_floating_point() else t for t in inputs)
        return self.network(*inputs)


def backwards_debug_hook(grad: Tensor) -> None:
    """Gradient hook that raises: master params must never receive a gradient from backward."""
    raise RuntimeError("master_params recieved a gradient in the backward pass!")


def prep_param_lists(model: nn.Module, flat_master: bool = False) -> tuple[list[Tensor], list[Tensor]]:
    """Return ``(model_params, master_params)``: the model's trainable params and fp32 copies of them.

    With ``flat_master=True`` the masters are one flat fp32 ``Parameter`` (with a ``.grad`` buffer);
    all model params must then share one dtype.
    """
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        dtypes = {p.dtype for p in model_params}
        if len(dtypes) > 1:
            raise TypeError("prep_param_lists(flat_master=True) needs parameters of a single dtype, found "
                            f"{sorted(str(d) for d in dtypes)}; use flat_master=False or FP16_Optimizer.")
        flat = _flatten_dense_tensors([p.data for p in model_params]).float()
        master = nn.Parameter(flat)
        master.grad = torch.empty_like(master)
        return model_params, [master]
    master_params = [p.detach().clone().float() for p in model_params]
    for p in master_params:
        p.requires_grad = True
    return model_params, master_params


def model_grads_to_master_grads(model_params: Sequence[Tensor], master_params: Sequence[Tensor],
                                flat_master: bool = False) -> None:
    """Copy the model params' grads into the master params' grads (allocating them when missing)."""
    if flat_master:
        master_params[0].grad.data.copy_(_flatten_dense_tensors([p.grad.data for p in model_params]))
        return
    for model, master in zip(model_params, master_params):
        if model.grad is not None:
            if master.grad is None:
                master.grad = torch.empty_like(master)
            master.grad.data.copy_(model.grad.data)
        else:
            master.grad = None


def master_params_to_model_params(model_params: Sequence[Tensor], master_params: Sequence[Tensor],
                                  flat_master: bool = False) -> None:
    """Copy the master params' values into the model params (rounding to the model dtype)."""
    if flat_master:
        for model, master in zip(model_params, _unflatten_dense_tensors(master_params[0].data, model_params)):
            model.data.copy_(master)
        return
    for model, master in zip(model_params, master_params):
        model.data.copy_(master.data)


clip_grad_norm = torch.nn.utils.clip_grad_norm_
"""``torch.nn.utils.clip_grad_norm_`` (Apex's alias)."""
