"""``apex.contrib.torchsched.inductor.graph``: Apex's ``GraphLowering`` patch (not needed by culmen)."""

from __future__ import annotations

from culmen.contrib.torchsched.inductor._common import USE_INSTEAD

__all__ = ["patch_graph_lowering"]


def patch_graph_lowering(patch: bool = True) -> None:
    """Apex: make Inductor's ``GraphLowering.codegen`` use the multi-stream scheduler (``patch=True``) or restore
    it (``patch=False``).

    culmen never patches Inductor, so ``patch=False`` (restore the default) does nothing and ``patch=True`` raises
    ``NotImplementedError`` naming the culmen backend to use.
    """
    if not isinstance(patch, bool):
        raise TypeError(f"patch must be a bool, got {patch!r}")
    if patch:
        raise NotImplementedError(f"patch_graph_lowering(True): {USE_INSTEAD}")
