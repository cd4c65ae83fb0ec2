"""A cheaper ``autograd.Function.apply`` for the eager call path.

``Function.apply`` is a Python classmethod that, before entering the C++ ``_FunctionBase.apply``,
inspects the forward's signature and walks every argument through functorch's dead-wrapper unwrapping:
about 2-3 µs per call on the GPU test machine, a third of the cost of the autograd node itself. Outside
functorch transforms (``torch.func.vmap``/``grad``...) that work does nothing for culmen's functions
(no default arguments, no functorch tensors), so ``raw_apply`` enters the C++ apply directly and keeps
``Function.apply``'s full path for calls made under a transform.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch


def raw_apply(cls: type[torch.autograd.Function]) -> Callable:
    """``cls.apply`` without its Python preamble when no functorch transform is active."""
    raw = torch._C._FunctionBase.__dict__["apply"].__get__(None, cls)
    full = cls.apply
    transforms_active = torch._C._are_functorch_transforms_active
    compiling = torch.compiler.is_compiling

    def apply(*args):
        if transforms_active() or compiling():  # dynamo traces only the public apply
            return full(*args)
        return raw(*args)

    apply.__doc__ = f"``{cls.__name__}.apply`` (see ``culmen.ops.common.function.raw_apply``)."
    return apply


# ---------------------------------------------------------------------------- gradients in saved memory
#
# A backward whose saved inputs die with it (an MLP's gate and up projections, saved only by the gated
# activation) may write its gradients into their memory: Liger-Kernel's SwiGLU does so unconditionally,
# which is what keeps its peak memory under a fresh-buffer backward. culmen does it only when nothing else
# can see the memory: no other tensor shares its storage, nothing but the saved slot and the backward's
# own names hold the tensor (C++ holders such as another node's saved slot count in ``_use_count``, Python
# names in the reference count), and the graph is not kept for another backward (``retain_graph`` /
# ``create_graph``). The counts that mean "free" depend on the interpreter and torch, so they are measured
# once on a probe whose backward takes the same path (``calibrate_saved_memory``); any other count keeps the
# fresh buffer.

_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
_storage_uses = torch._C._storage_Use_Count
_FREE: tuple | None = None
_CALIBRATING: list | None = None


def saved_memory_free(*ts: torch.Tensor) -> bool:
    """Whether a backward may overwrite each of ``ts`` (tensors it just unpacked from ``ctx.saved_tensors``,
    passed straight from its local names) with its gradients. Call it from the backward itself."""
    if _FREE is None:
        if _CALIBRATING is not None:  # the probe: the same frame layout as a real call below
            for t in ts:
                _CALIBRATING.append((sys.getrefcount(t), t._use_count(), _storage_uses(t.untyped_storage()._cdata)))
        return False
    if _keep_graph():
        return False
    refs, uses, storage_uses = _FREE
    for t in ts:  # cheapest first: a name held by the caller (the usual "no") costs one call
        if sys.getrefcount(t) != refs or t._use_count() != uses or _storage_uses(t.untyped_storage()._cdata) != \
                storage_uses:
            return False
    return True


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, u):
        ctx.save_for_backward(x, u)
        return x * u

    @staticmethod
    def backward(ctx, g):
        x, u = ctx.saved_tensors
        saved_memory_free(x, u)
        return g, g


def calibrate_saved_memory() -> None:
    """Measure the counts ``saved_memory_free`` sees for saved temporaries nothing else holds (a probe backward
    on CPU, once per process). Plans that reuse saved memory call it when they are built, never inside a backward:
    until it ran, ``saved_memory_free`` says no."""
    global _FREE, _CALIBRATING
    if _FREE is not None or _CALIBRATING is not None or _keep_graph is None or not hasattr(torch.Tensor, "_use_count"):
        return
    _CALIBRATING = []
    try:
        # Whatever the caller's state (no_grad, inference_mode, a CUDA default device): a plain CPU backward.
        with torch.inference_mode(False), torch.enable_grad():
            a = torch.ones(4, device="cpu", dtype=torch.float32, requires_grad=True)
            _Probe.apply(a * 2.0, a * 3.0).sum().backward()
        x_counts, u_counts = _CALIBRATING
    except Exception:  # never let the probe fail a user's call: then nothing is reused
        x_counts, u_counts = (-1, -1, -1), None
    finally:
        _CALIBRATING = None
    # Both temporaries must look alike; otherwise nothing is ever reused (an impossible count).
    _FREE = x_counts if x_counts == u_counts else (-1, -1, -1)
