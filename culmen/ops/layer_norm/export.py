"""``layer_norm`` while a model is exported to ONNX: the same math in plain PyTorch ops.

Neither ONNX exporter can translate culmen's kernels: the TorchScript exporter (``torch.onnx.export(...,
dynamo=False)``) traces the eager path, whose autograd function has no ONNX symbolic, and the
``torch.export`` based one (``dynamo=True``) meets the custom op ``culmen::layer_norm_fwd``, which
has no ONNX translation. While either exporter runs, ``layer_norm`` computes with ops both can
translate instead (``F.layer_norm`` becomes ONNX ``LayerNormalization``; RMSNorm becomes
``ReduceMean`` / ``Sqrt`` / ``Div``), with the op's numerics: statistics and the affine step in fp32 (fp64
for fp64 inputs), the output in ``out_dtype``.

``ONNX_TS`` exposes ``in_onnx_export``: whether the TorchScript exporter is tracing. It is read on
every eager call, so it is a plain attribute of torch's exporter state, not a function call. The
``torch.export`` based exporter runs ``layer_norm`` under ``torch.compiler.is_compiling()``, where
``torch.onnx.is_in_onnx_export()`` is checked (Dynamo folds it to a constant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ONNX_TS", "layer_norm_export"]


class _Fallback:
    """Stand-in for torch's exporter state where its module moved: asks ``torch.onnx`` (slower)."""

    @property
    def in_onnx_export(self) -> bool:
        return torch.onnx.is_in_onnx_export()


def _ts_state():
    try:  # torch >= 2.9
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
    except ImportError:
        try:
            from torch.onnx._globals import GLOBALS  # older torch
        except ImportError:
            return _Fallback()
    return GLOBALS if hasattr(GLOBALS, "in_onnx_export") else _Fallback()


ONNX_TS = _ts_state()


def _dropout(h: Tensor, p: float) -> tuple[Tensor, Tensor | None]:
    if p == 0.0:
        return h, None
    keep = torch.rand_like(h) >= p
    return torch.where(keep, h / (1.0 - p), torch.zeros_like(h)), keep


def _normalize(h: Tensor, w: Tensor | None, b: Tensor | None, eps: float, rms: bool, zero_centered: bool,
               out_dtype: torch.dtype) -> Tensor:
    # Parameters may keep a multi-dim normalized shape (Apex's modules fold it into the last dim of x).
    if w is not None:
        w = w.reshape(-1).to(h.dtype)
        if zero_centered:
            w = w + 1.0
    if b is not None:
        b = b.reshape(-1).to(h.dtype)
    if rms:
        y = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
    else:
        y = F.layer_norm(h, (h.shape[-1],), w, b, eps)
    return y.to(out_dtype)


def layer_norm_export(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, is_rms_norm,
                      zero_centered_weight, residual_in_fp32, out_dtype, return_residual, return_dropout_mask):
    """``layer_norm`` (same arguments and meaning) in exportable ops; returns the fields of its
    ``LayerNormOutput``: ``(y, y1, residual_out, dropout_mask, dropout_mask1)``.

    Dropout draws its masks with ``rand_like`` (export is for inference, where ``dropout_p`` is 0)."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    out_dtype = out_dtype or x.dtype
    residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    h = x.to(cdt)
    if rowscale is not None:
        h = h * rowscale.reshape(h.shape[:-1]).to(cdt)[..., None]
    h, keep = _dropout(h, dropout_p)
    keep1 = None
    if x1 is not None:
        h1, keep1 = _dropout(x1.to(cdt), dropout_p)
        h = h + h1
    if residual is not None:
        h = h + residual.to(cdt)
    # As the op: the pre-norm sum is rounded to the residual dtype, and normalized from there, when it
    # is a new tensor; otherwise it is x itself.
    stored = (residual is not None or residual_dtype != x.dtype or dropout_p > 0.0 or rowscale is not None
              or x1 is not None)
    res_out = h.to(residual_dtype) if stored else x
    h = res_out.to(cdt)
    y = _normalize(h, weight, bias, eps, is_rms_norm, zero_centered_weight, out_dtype)
    y1 = _normalize(h, weight1, bias1, eps, is_rms_norm, zero_centered_weight, out_dtype) \
        if weight1 is not None else None
    masks = return_dropout_mask and dropout_p > 0.0
    return (y, y1, res_out if return_residual else None, keep if masks else None,
            keep1 if masks and x1 is not None else None)
