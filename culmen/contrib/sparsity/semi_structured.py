"""Run 2:4-pruned ``nn.Linear`` layers on the sparse tensor cores of SM80+ GPUs (culmen addition).

``enable_semi_structured(linear)`` makes a pruned layer's forward matmul run on a compressed copy of
its 2:4-sparse fp16 / bf16 weight, while the dense ``weight`` stays the parameter that optimizers,
``state_dict`` and ASP's masks see:

- forward: ``y = x @ W_c^T + b`` on the compressed weight ``W_c`` (re-compressed lazily, without a
  host sync, whenever the dense weight changed: an optimizer step, a load, ASP re-masking);
- backward: ``dx = dy @ W`` and ``dW = dy^T x`` dense (the transposed weight is not 2:4 along the
  contracted dimension, so the input gradient cannot use the sparse kernel), ``db = sum(dy)``.

Backends (``culmen.contrib.sparsity._semi_backends`` says how each works and why):
``"cusparselt-graph"`` (cuSPARSELt captured per token count in a CUDA graph: no per-call plan
build), ``"cusparselt"`` (``torch._cslt_sparse_mm`` directly), ``"cutlass"`` (PyTorch's CUTLASS
kernels, SM8x only), ``"torch"`` (``torch.sparse.to_sparse_semi_structured``) and ``"dense"``.
``backend="auto"`` tries ``cutlass`` first on SM8x (no plan to build, tuned for SM80) and
``cusparselt-graph`` first elsewhere, then the others in the order above. A backend is kept only if
it builds and a probe matmul matches the dense result; one that raises later (an op missing, a shape
refused) hands over to the next in the order for good, and the reason is recorded.

Where no sparse backend can run (no CUDA, compute capability below 8.0, a dtype other than fp16 /
bf16, a shape the sparse kernels reject, a weight that is not 2:4 along its input dim), the layer
stays dense and the reason is recorded (``semi_structured_status(linear)``); an input whose dtype
differs from the weight's (autocast) takes the dense path for that call.

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

from culmen.contrib.sparsity._semi_backends import BACKENDS, make_backend

__all__ = [
    "BACKENDS",
    "SemiStructuredState",
    "backend_order",
    "disable_semi_structured",
    "enable_semi_structured",
    "is_semi_structured",
    "semi_structured_linear",
    "semi_structured_status",
    "semi_structured_supported",
]

_ATTR = "_culmen_semi_structured"
_DTYPES = (torch.float16, torch.bfloat16)
# what a sparse backend may raise when its op is missing or refuses the operands
_BACKEND_ERRORS = (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError, AssertionError)


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


def backend_order(backend: str = "auto", device: torch.device | str | None = None) -> tuple[str, ...]:
    """The backends ``enable_semi_structured`` tries, in order, for ``backend`` on ``device``
    (``"dense"`` always last). ``"auto"``: ``cutlass`` first on compute capability 8.x, else
    ``cusparselt-graph``; a named backend is tried first, then the ``auto`` order."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    major = 0
    dev = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
        major = torch.cuda.get_device_capability(dev)[0]
    # CUTLASS's 2:4 kernels are SM80 code (an illegal instruction on SM90 kills the CUDA context): 8.x only
    auto = (("cutlass", "cusparselt-graph", "cusparselt", "torch", "dense") if major == 8
            else ("cusparselt-graph", "cusparselt", "torch", "dense"))
    if backend == "auto":
        return auto
    return (backend,) + tuple(b for b in auto if b != backend)


def _is_2to4_along_input(weight: Tensor) -> bool:
    if weight.dim() != 2 or weight.shape[1] % 4:
        return False
    return bool(((weight.detach() != 0).reshape(-1, 4).sum(1) <= 2).all())


def _probe(impl: Any, weight: Tensor, bias: Tensor | None) -> str:
    """Run ``impl`` once on a small random input against ``F.linear``: '' if it agrees, else why not.
    (Catches a backend whose compressed layout and kernel disagree, which would be silently wrong.)"""
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(64, weight.shape[1], device=weight.device, dtype=weight.dtype, generator=gen)
    with torch.no_grad():
        ref = F.linear(x, weight, bias).float()
        y = getattr(impl, "direct_mm", impl.mm)(x, weight, bias).float()
    if y.shape != ref.shape:
        return f"probe output shape {tuple(y.shape)} != {tuple(ref.shape)}"
    err = float((y - ref).abs().max())
    # fp16/bf16 rounding of differently ordered sums stays far below this; a wrong layout does not
    if not err <= 0.05 * float(ref.abs().max()) + 1e-2:
        return f"probe mismatch vs dense (max |diff| {err:.3g})"
    return ""


class SemiStructuredState:
    """What ``enable_semi_structured`` keeps on a layer: the backends still to try, the active one
    (``impl``, holding the compressed weight) and why the earlier ones were dropped."""

    __slots__ = ("impl", "order", "opts", "active", "reason", "mm")

    def __init__(self) -> None:
        self.impl: Any = None
        self.order: list[str] = []
        self.opts: dict[str, Any] = {}
        self.active = False
        self.reason = ""
        self.mm: Any = None

    @property
    def backend(self) -> str:
        """The active backend's name (``"dense"`` when none is active)."""
        return self.impl.name if self.active and self.impl is not None else "dense"

    def select(self, weight: Tensor, bias: Tensor | None) -> bool:
        """Build the first backend of ``order`` that works (dropping the ones that don't); True when a
        sparse one is active."""
        reasons = [self.reason] if self.reason else []
        while self.order:
            name = self.order.pop(0)
            if name == "dense":
                break
            try:
                impl = make_backend(name, weight, self.opts)
                why = _probe(impl, weight, bias)
            except Exception as exc:  # any failure to build or probe only rules this backend out
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            if not why:
                self.impl, self.mm, self.active = impl, impl.mm, True
                self.reason = "; ".join(reasons)
                return True
            reasons.append(f"{name}: {why}")
        self.impl, self.mm, self.active = None, None, False
        self.reason = "; ".join(reasons) or "no sparse backend"
        return False


class _SemiStructuredLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x2: Tensor, weight: Tensor, bias: Tensor | None, mm: Any) -> Tensor:
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return mm(x2, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: Tensor):
        x2, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = dy.t() @ x2 if ctx.needs_input_grad[1] else None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def semi_structured_linear(x: Tensor, weight: Tensor, bias: Tensor | None,
                           state: SemiStructuredState | Tensor) -> Tensor:
    """``F.linear(x, weight, bias)`` with the forward matmul on ``state``'s active backend.

    Args:
        x: ``(..., in)``, the weight's dtype.
        weight: dense ``(out, in)`` 2:4-sparse along ``in`` (the parameter; it receives the gradient).
        bias: ``(out,)`` or None.
        state: an active ``SemiStructuredState`` (or, for testing, a dense tensor standing for the
            compressed weight).
    Returns:
        ``(..., out)`` in ``x``'s dtype.
    """
    if isinstance(state, Tensor):
        stand_in = state

        def mm(x2: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            return F.linear(x2, stand_in, b)
    else:
        mm = state.mm
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled():
        y = _SemiStructuredLinearFn.apply(x2, weight, bias, mm)
    else:  # inference: no autograd node to build
        y = mm(x2, weight, bias)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def _forward(self: nn.Linear, input: Tensor) -> Tensor:
    state: SemiStructuredState = self._culmen_semi_structured
    while state.active and input.dtype == self.weight.dtype:
        try:
            return semi_structured_linear(input, self.weight, self.bias, state)
        except _BACKEND_ERRORS as exc:
            if input.shape[-1] != self.weight.shape[1] or input.device != self.weight.device:
                raise  # the caller's mistake, not the backend's: keep the backend
            # the backend failed at run time (an op missing, a shape refused): hand over to the next
            state.reason = f"{state.backend} failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
            state.select(self.weight, self.bias)
    return F.linear(input, self.weight, self.bias)


def enable_semi_structured(module: nn.Linear, backend: str = "auto", *, search_alg: bool = False,
                           max_graphs: int = 4) -> bool:
    """Make a 2:4-pruned ``nn.Linear`` run its forward on a semi-structured sparse weight.

    Args:
        module: the ``nn.Linear`` (fp16 / bf16 weight on an SM80+ GPU, 2:4-sparse along its input dim).
        backend: ``"auto"`` or one of ``BACKENDS`` (tried first; the rest of ``backend_order`` follows).
        search_alg: cuSPARSELt backends search the fastest algorithm id once per token count
            (``torch._cslt_sparse_mm_search``); False (the default) keeps algorithm 0, PyTorch's own
            choice. Off by default: on an H200 with torch 2.11 / cuSPARSELt 0.8.0 the search fails with
            "internal error" and leaves cuSPARSELt broken for the process (every later plan fails, then an
            illegal instruction poisons the CUDA context); ``scripts/probe_cusparselt.py`` shows it.
        max_graphs: ``cusparselt-graph`` captures at most this many token counts per layer (each holds
            a static input and output); other token counts run the dense weight (``F.linear``): the
            uncaptured cuSPARSELt op builds a plan per call, 1-200 ms on an H200.

    Speed (H200, torch 2.11, cuSPARSELt 0.8.0, 768 -> 3072 at 4k-16k tokens): even the captured sparse
    GEMM replayed alone runs at 0.72-0.93x of dense cuBLAS, and the layer (input copy, output clone) at
    0.52-0.61x; PyTorch's own ``to_sparse_semi_structured`` path at 0.03-0.12x. On this GPU the sparse
    layers save no time; they are here for Apex parity and for GPUs / cuSPARSELt releases where the sparse
    GEMM is faster (``bench/notes/contrib.md``).
    Returns:
        True when a sparse backend is active; False when the layer stays dense (the reason is in
        ``semi_structured_status(module)``). Calling it again re-checks (e.g. after ``.to("cuda")``).
    """
    if not isinstance(module, nn.Linear):
        raise TypeError(f"module must be an nn.Linear, got {type(module).__name__}")
    order = list(backend_order(backend, module.weight.device))
    if not isinstance(max_graphs, int) or max_graphs < 0:
        raise ValueError(f"max_graphs must be an int >= 0, got {max_graphs!r}")
    state = SemiStructuredState()
    setattr(module, _ATTR, state)
    state.opts = {"search_alg": bool(search_alg), "max_graphs": max_graphs}
    w = module.weight
    ok, reason = semi_structured_supported(w.device, w.dtype)
    if ok and not _is_2to4_along_input(w):
        ok, reason = False, "weight is not 2:4 sparse along its input dimension"
    if ok:
        state.order = order
        ok = state.select(w, module.bias)
    else:
        state.reason = reason
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
    """``"active (<backend>)"``, ``"not enabled"`` or ``"dense: <reason>"`` for a layer."""
    state = getattr(module, _ATTR, None)
    if not isinstance(state, SemiStructuredState):
        return "not enabled"
    return f"active ({state.backend})" if state.active else f"dense: {state.reason}"
