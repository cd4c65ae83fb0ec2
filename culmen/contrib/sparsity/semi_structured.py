"""Run 2:4-pruned ``nn.Linear`` layers on PyTorch's semi-structured sparse tensors (culmen addition).

``torch.sparse.to_sparse_semi_structured`` compresses a 2:4-sparse fp16 / bf16 weight for the sparse
tensor cores of SM80+ GPUs (cuSPARSELt or CUTLASS). ``enable_semi_structured(linear)`` makes a pruned
layer's forward use the compressed copy, while the dense ``weight`` stays the parameter that optimizers,
``state_dict`` and ASP's masks see:

- forward: ``y = x @ W_c^T + b`` on the compressed weight ``W_c`` (re-compressed lazily whenever the
  dense weight changed: an optimizer step, a load, ASP re-masking);
- backward: ``dx = dy @ W`` and ``dW = dy^T x`` dense (the transposed weight is not 2:4 along the
  contracted dimension, so the input gradient cannot use the sparse kernel), ``db = sum(dy)``.

Where it cannot run (no CUDA, compute capability below 8.0, a dtype other than fp16 / bf16, a shape the
sparse kernels reject, a weight that is not 2:4 along its input dim, or a PyTorch without
``to_sparse_semi_structured``), the layer stays dense and the reason is recorded
(``semi_structured_status(linear)``); an input whose dtype differs from the weight's (autocast) takes
the dense path for that call.

ASP turns this on with ``ASP.init_model_for_pruning(..., semi_structured=True)`` (or
``ASP.prune_trained_model(..., semi_structured=True)``): ``compute_sparse_masks`` enables every pruned
``Linear`` with a 2:4 mask along its input dim, ``restore_pruned_weights`` disables them.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "SemiStructuredState",
    "disable_semi_structured",
    "enable_semi_structured",
    "is_semi_structured",
    "semi_structured_linear",
    "semi_structured_status",
    "semi_structured_supported",
]

_ATTR = "_culmen_semi_structured"
_DTYPES = (torch.float16, torch.bfloat16)


def semi_structured_supported(device: torch.device | str | None = None,
                              dtype: torch.dtype = torch.float16) -> tuple[bool, str]:
    """Whether semi-structured 2:4 matmuls can run on ``device`` (default: the current CUDA device)
    for ``dtype``. Returns ``(supported, reason)``; ``reason`` says why not (empty when supported)."""
    if not hasattr(torch.sparse, "to_sparse_semi_structured"):
        return False, "this PyTorch has no torch.sparse.to_sparse_semi_structured"
    if dtype not in _DTYPES:
        return False, f"dtype {dtype} (semi-structured sparsity is used for float16 / bfloat16 only)"
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False, f"device {dev} (needs a CUDA GPU with compute capability >= 8.0)"
    if torch.version.hip is not None:
        return False, "ROCm build (semi-structured sparse kernels are CUDA-only)"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 8:
        return False, f"compute capability {major}.{minor} < 8.0"
    return True, ""


def _is_2to4_along_input(weight: Tensor) -> bool:
    if weight.dim() != 2 or weight.shape[1] % 4:
        return False
    return bool(((weight.detach() != 0).reshape(-1, 4).sum(1) <= 2).all())


class SemiStructuredState:
    """What ``enable_semi_structured`` keeps on a layer: the compressed weight and the dense weight's
    identity and version it was made from (so a changed weight is re-compressed before use)."""

    __slots__ = ("compressed", "key", "active", "reason")

    def __init__(self) -> None:
        self.compressed: Tensor | None = None
        self.key: tuple[int, int, torch.dtype] | None = None
        self.active = False
        self.reason = ""

    def refresh(self, weight: Tensor) -> Tensor:
        """The compressed copy of ``weight``, re-compressing if it changed since the last call."""
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if key != self.key or self.compressed is None:
            with torch.no_grad():
                self.compressed = torch.sparse.to_sparse_semi_structured(weight.detach())
            self.key = key
        return self.compressed


class _SemiStructuredLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x2: Tensor, weight: Tensor, bias: Tensor | None, state: Any) -> Tensor:
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return F.linear(x2, state.refresh(weight) if isinstance(state, SemiStructuredState) else state, bias)

    @staticmethod
    def backward(ctx: Any, dy: Tensor):
        x2, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = dy.t() @ x2 if ctx.needs_input_grad[1] else None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def semi_structured_linear(x: Tensor, weight: Tensor, bias: Tensor | None,
                           state: SemiStructuredState | Tensor) -> Tensor:
    """``F.linear(x, weight, bias)`` with the forward matmul on ``state``'s compressed copy of ``weight``.

    Args:
        x: ``(..., in)``, the weight's dtype.
        weight: dense ``(out, in)`` 2:4-sparse along ``in`` (the parameter; it receives the gradient).
        bias: ``(out,)`` or None.
        state: a ``SemiStructuredState`` (or, for testing, any tensor standing for the compressed weight).
    Returns:
        ``(..., out)`` in ``x``'s dtype.
    """
    lead = x.shape[:-1]
    y = _SemiStructuredLinearFn.apply(x.reshape(-1, x.shape[-1]), weight, bias, state)
    return y.reshape(*lead, y.shape[-1])


def _forward(self: nn.Linear, input: Tensor) -> Tensor:
    state: SemiStructuredState = getattr(self, _ATTR)
    if state.active and input.dtype == self.weight.dtype and input.device == self.weight.device:
        return semi_structured_linear(input, self.weight, self.bias, state)
    return F.linear(input, self.weight, self.bias)


def enable_semi_structured(module: nn.Linear) -> bool:
    """Make a 2:4-pruned ``nn.Linear`` run its forward on a semi-structured sparse weight.

    Returns True when the sparse path is active; False when the layer stays dense (the reason is in
    ``semi_structured_status(module)``). Calling it again re-checks (e.g. after ``.to("cuda")``)."""
    if not isinstance(module, nn.Linear):
        raise TypeError(f"module must be an nn.Linear, got {type(module).__name__}")
    state = getattr(module, _ATTR, None)
    if not isinstance(state, SemiStructuredState):
        state = SemiStructuredState()
        setattr(module, _ATTR, state)
    state.active, state.compressed, state.key = False, None, None
    w = module.weight
    ok, reason = semi_structured_supported(w.device, w.dtype)
    if ok and not _is_2to4_along_input(w):
        ok, reason = False, "weight is not 2:4 sparse along its input dimension"
    if ok:
        try:
            state.refresh(w)
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            ok, reason = False, f"to_sparse_semi_structured rejected the weight {tuple(w.shape)}: {exc}"
    state.active, state.reason = ok, reason
    # An instance attribute: hooks and nn.Module.__call__ keep working, the class is untouched.
    module.forward = types.MethodType(_forward, module)
    return ok


def disable_semi_structured(module: nn.Module) -> None:
    """Return a layer to the dense forward and drop its compressed weight (no-op if never enabled)."""
    if hasattr(module, _ATTR):
        delattr(module, _ATTR)
    if "forward" in module.__dict__:
        del module.__dict__["forward"]


def is_semi_structured(module: nn.Module) -> bool:
    """Whether ``module``'s forward currently runs on a semi-structured sparse weight."""
    state = getattr(module, _ATTR, None)
    return isinstance(state, SemiStructuredState) and state.active


def semi_structured_status(module: nn.Module) -> str:
    """``"active"``, ``"not enabled"`` or ``"dense: <reason>"`` for a layer."""
    state = getattr(module, _ATTR, None)
    if not isinstance(state, SemiStructuredState):
        return "not enabled"
    return "active" if state.active else f"dense: {state.reason}"
