"""flash_attn's legacy ``flash_attn.ops.layer_norm`` (the ``dropout_layer_norm`` CUDA extension API).

``dropout_add_layer_norm`` computes ``LN(dropout(x0 * rowscale * layerscale) + residual)``; the
``_subset`` variant adds stochastic-depth row selection (``x0_subset`` / ``out_subset``), and the
``_parallel_residual`` variant adds a second input ``x1`` and a second affine output. All of them call
:func:`culmen.ops.layer_norm.layer_norm`; the extra features of the legacy API are exact PyTorch around
that op (see ``_scaled_x0`` and the subset gather/scatter).

Conventions kept from flash_attn: the output has the input dtype; the residual stream has
``residual.dtype``, else fp32 with ``residual_in_fp32``, else the input dtype; dropout masks are
``uint8`` and all ones when ``dropout_p == 0``. Differences: any hidden size (not only multiples of 8 up
to 8192), CPU support, and ``x0_subset`` / ``out_subset`` may be given independently.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import init

from culmen.ops.layer_norm import layer_norm as _fused_norm

__all__ = [
    "layer_norm",
    "dropout_add_layer_norm",
    "dropout_add_layer_norm_subset",
    "dropout_add_layer_norm_parallel_residual",
    "DropoutAddLayerNorm",
]

LegacyReturn = Tensor | tuple[Tensor | None, ...]


def _uint8_mask(mask: Tensor | None, dropout_p: float, shape: torch.Size, device: torch.device) -> Tensor:
    if dropout_p > 0.0 and mask is not None:
        return mask.to(torch.uint8)
    return torch.ones(shape, dtype=torch.uint8, device=device)


def _scaled_x0(x0: Tensor, layerscale: Tensor | None, residual: Tensor | None, residual_in_fp32: bool):
    """Apply the per-column ``layerscale`` in fp32 (as the CUDA kernel does) before the fused op.

    The product is fp32, so without a ``residual`` the op would keep an fp32 residual stream; a zero
    residual of ``x0.dtype`` pins the stream to the dtype flash_attn uses (adding 0 is exact).
    Returns ``(x, residual)`` for the op.
    """
    if layerscale is None:
        return x0, residual
    x = x0.float() * layerscale.float()
    if residual is None and not residual_in_fp32 and x0.dtype != torch.float32:
        residual = torch.zeros_like(x0)
    return x, residual


def _dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                      residual_in_fp32, return_dropout_mask, is_rms_norm) -> LegacyReturn:
    x, res = _scaled_x0(x0, layerscale, residual, residual_in_fp32)
    out = _fused_norm(x, weight, bias, residual=res, eps=epsilon, dropout_p=dropout_p, rowscale=rowscale,
                      is_rms_norm=is_rms_norm, residual_in_fp32=residual_in_fp32, out_dtype=x0.dtype,
                      return_residual=prenorm, return_dropout_mask=return_dropout_mask)
    ret: list[Tensor | None] = [out.y]
    if prenorm:
        ret.append(out.residual_out)
    if return_dropout_mask:
        ret.append(_uint8_mask(out.dropout_mask, dropout_p, x0.shape, x0.device))
    return ret[0] if len(ret) == 1 else tuple(ret)


def _dropout_add_norm_subset(x0, residual, weight, bias, dropout_p, epsilon, layerscale, x0_subset, out_subset,
                             rowscale_const, out_numrows, prenorm, residual_in_fp32, return_dropout_mask,
                             is_rms_norm) -> LegacyReturn:
    hidden_size = weight.numel()
    x0mat = x0.reshape(-1, hidden_size)
    x, _ = _scaled_x0(x0mat, layerscale, None, True)
    rowscale = None
    if x0_subset is not None:
        # Row i of the full batch reads x0 row x0_subset[i] - 1; 0 means the row was dropped (zeros).
        # A zero row in front turns that into one index_select, differentiable for x0.
        idx = x0_subset.reshape(-1).long()
        x = torch.cat([x.new_zeros(1, hidden_size), x]).index_select(0, idx)
        # The drop-path scale applies to the kept rows; dropped rows are zero whatever the scale.
        rowscale = torch.full((idx.numel(),), float(rowscale_const), device=x.device, dtype=torch.float32)
    num_rows = x.shape[0]
    res = residual.reshape(num_rows, hidden_size) if residual is not None else None
    if layerscale is not None and res is None and not residual_in_fp32 and x0.dtype != torch.float32:
        res = torch.zeros(num_rows, hidden_size, device=x.device, dtype=x0.dtype)
    out = _fused_norm(x, weight, bias, residual=res, eps=epsilon, dropout_p=dropout_p, rowscale=rowscale,
                      is_rms_norm=is_rms_norm, residual_in_fp32=residual_in_fp32, out_dtype=x0.dtype,
                      return_residual=prenorm, return_dropout_mask=return_dropout_mask)
    z = out.y
    if out_subset is not None:
        # Output row out_subset[i] - 1 takes full row i; rows with 0 land in a spare row 0 that is cut off.
        oidx = out_subset.reshape(-1).long()
        z = torch.index_copy(z.new_zeros(int(out_numrows) + 1, hidden_size), 0, oidx, z)[1:]
    row_shape = (-1, *x0.shape[1:])
    ret: list[Tensor | None] = [z.reshape(row_shape)]
    if prenorm:
        ret.append(out.residual_out.reshape(row_shape))
    if return_dropout_mask:
        mask = out.dropout_mask
        if mask is not None and x0_subset is not None:
            mask = torch.index_copy(mask.new_zeros(x0mat.shape[0] + 1, hidden_size), 0, idx, mask)[1:]
        ret.append(_uint8_mask(mask, dropout_p, x0mat.shape, x0.device).reshape(x0.shape))
    return ret[0] if len(ret) == 1 else tuple(ret)


def _dropout_add_norm_parallel(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                               residual_in_fp32, return_dropout_mask, is_rms_norm) -> LegacyReturn:
    out = _fused_norm(x0, weight0, bias0, residual=residual, x1=x1, weight1=weight1, bias1=bias1, eps=epsilon,
                      dropout_p=dropout_p, is_rms_norm=is_rms_norm, residual_in_fp32=residual_in_fp32,
                      out_dtype=x0.dtype, return_residual=prenorm, return_dropout_mask=return_dropout_mask)
    ret: list[Tensor | None] = [out.y, out.y1]
    if prenorm:
        ret.append(out.residual_out)
    if return_dropout_mask:
        ret.append(_uint8_mask(out.dropout_mask, dropout_p, x0.shape, x0.device))
        ret.append(_uint8_mask(out.dropout_mask1, dropout_p if x1 is not None else 0.0, x0.shape, x0.device))
    return tuple(ret)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, epsilon: float) -> Tensor:
    """Plain LayerNorm over the last dim: ``x`` ``(..., N)``, ``weight``/``bias`` ``(N,)``; dtype of ``x``."""
    return dropout_add_layer_norm(x, None, weight, bias, 0.0, epsilon)


def dropout_add_layer_norm(
    x0: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    dropout_p: float,
    epsilon: float,
    rowscale: Tensor | None = None,
    layerscale: Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    return_dropout_mask: bool = False,
) -> LegacyReturn:
    """``LN(dropout(x0 * rowscale * layerscale) + residual)`` over the last dim.

    Args:
        x0: ``(..., N)`` fp16/bf16/fp32. residual: like ``x0`` (any float dtype) or ``None``.
        weight, bias: ``(N,)``. dropout_p: in ``[0, 1)``. epsilon: added to the variance.
        rowscale: ``x0.shape[:-1]``. layerscale: ``(N,)``, per-column scale of ``x0``.
        residual_in_fp32: only used without ``residual``: keep the pre-norm sum in fp32.

    Returns ``out`` (dtype of ``x0``), then the pre-norm sum if ``prenorm``, then the ``uint8`` dropout
    mask (shape of ``x0``) if ``return_dropout_mask``; a tuple when more than one.
    """
    return _dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                             residual_in_fp32, return_dropout_mask, False)


def dropout_add_layer_norm_subset(
    x0: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    dropout_p: float,
    epsilon: float,
    layerscale: Tensor | None = None,
    x0_subset: Tensor | None = None,
    out_subset: Tensor | None = None,
    rowscale_const: float = 1.0,
    out_numrows: int = 0,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    return_dropout_mask: bool = False,
) -> LegacyReturn:
    """:func:`dropout_add_layer_norm` with stochastic-depth row subsets.

    Args:
        x0: ``(x0_numrows, ..., N)``: only the kept rows. residual: ``(M, ..., N)``, all ``M`` rows.
        x0_subset: ``M`` ints (e.g. ``(batch, seqlen)``); row ``i`` reads ``x0`` row ``x0_subset[i] - 1``
            scaled by ``rowscale_const``, or zeros where ``x0_subset[i] == 0``.
        out_subset: ``M`` ints; full row ``i`` is written to output row ``out_subset[i] - 1`` (skipped
            where 0); the output has ``out_numrows`` rows. ``None``: all ``M`` rows are returned.

    Returns ``out`` ``(-1, *x0.shape[1:])``, then the full pre-norm sum ``(M, ...)`` if ``prenorm``, then
    the ``uint8`` dropout mask (shape of ``x0``) if ``return_dropout_mask``.
    """
    return _dropout_add_norm_subset(x0, residual, weight, bias, dropout_p, epsilon, layerscale, x0_subset,
                                    out_subset, rowscale_const, out_numrows, prenorm, residual_in_fp32,
                                    return_dropout_mask, False)


def dropout_add_layer_norm_parallel_residual(
    x0: Tensor,
    x1: Tensor | None,
    residual: Tensor | None,
    weight0: Tensor,
    bias0: Tensor | None,
    weight1: Tensor | None,
    bias1: Tensor | None,
    dropout_p: float,
    epsilon: float,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    return_dropout_mask: bool = False,
) -> LegacyReturn:
    """``h = dropout(x0) + dropout(x1) + residual``; ``out0 = LN(h; weight0, bias0)``, ``out1 = LN(h;
    weight1, bias1)`` (``None`` without ``weight1``). All tensors ``(..., N)`` / ``(N,)``.

    Returns ``(out0, out1)``, then ``h`` if ``prenorm``, then the ``uint8`` masks of ``x0`` and ``x1``
    (all ones where there is no dropout or no ``x1``) if ``return_dropout_mask``.
    """
    return _dropout_add_norm_parallel(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                                      residual_in_fp32, return_dropout_mask, False)


class DropoutAddLayerNorm(torch.nn.Module):
    """``LN(dropout(x0) + residual)`` with learnable ``weight`` (ones) and ``bias`` (zeros).

    Args:
        hidden_size: size of the last dim. prenorm: also return the pre-norm sum.
        p: dropout probability (only in training mode). eps: added to the variance (``self.epsilon``;
            ``self.eps`` is an alias). residual_in_fp32: fp32 residual stream when ``residual`` is None.
        device, dtype: factory kwargs for the parameters.

    ``forward(x0, residual=None)``: ``(..., hidden_size)`` tensors; returns ``out`` or ``(out, residual)``.
    """

    def __init__(self, hidden_size: int, prenorm: bool = False, p: float = 0.0, eps: float = 1e-5,
                 residual_in_fp32: bool = False, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.prenorm = prenorm
        self.p = p
        self.epsilon = eps
        self.residual_in_fp32 = residual_in_fp32
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    @property
    def eps(self) -> float:
        # flash_attn's own tests read ``model.eps``; the module stores ``epsilon``.
        return self.epsilon

    def reset_parameters(self) -> None:
        init.ones_(self.weight)
        init.zeros_(self.bias)

    def forward(self, x0: Tensor, residual: Tensor | None = None) -> LegacyReturn:
        return dropout_add_layer_norm(x0, residual, self.weight, self.bias, self.p if self.training else 0.0,
                                      self.epsilon, prenorm=self.prenorm, residual_in_fp32=self.residual_in_fp32)
