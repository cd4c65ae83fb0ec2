"""culmen's kernels: one module (or folder) per op family, below every API package.

Importing ``culmen.ops`` imports no op module (no compilation, no GPU work). ``load_all()`` imports
every op module, which registers its ops with ``culmen.ops.backend.register_op``; ``culmen info``
and ``culmen bench`` call it. Add each new op module to ``OP_MODULES``.
"""

from __future__ import annotations

import importlib

OP_MODULES: tuple[str, ...] = (
    "culmen.ops.layer_norm",
    "culmen.ops.batch_norm",
    "culmen.ops.multi_tensor",
    "culmen.ops.attention",
    "culmen.ops.rotary",
    "culmen.ops.softmax",
    "culmen.ops.cross_entropy",
    "culmen.ops.activations",
    "culmen.ops.focal_loss",
    "culmen.ops.index_mul_2d",
    "culmen.ops.group_norm",
    "culmen.ops.rnn",
    "culmen.ops.transducer",
    "culmen.ops.pair_attention",
    "culmen.ops.conv_epilogue",
)


def load_all() -> dict[str, str]:
    """Import every module of ``OP_MODULES``; return ``{module: error}`` for those that failed.

    A broken or not-yet-written op module must not take ``culmen info`` down with it, so import
    errors are collected instead of raised.
    """
    failed: dict[str, str] = {}
    for name in OP_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # reported to the caller, never swallowed silently
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed
