"""flash_attn 2.8's ``flash_attn.modules.block`` on culmen: the transformer ``Block`` and ``ParallelBlock``
(GPT-J / GPT-NeoX / PaLM-style attention and MLP side by side), with flash_attn's parameter names
(``mixer``, ``mlp``, ``norm1``, ``norm2``; ``dropout*`` / ``drop_path*`` hold no parameters).

The pre-norm ``Block`` runs flash_attn's reordered layer: ``dropout -> add -> norm -> mixer -> dropout ->
add -> norm -> mlp``, taking and returning ``(hidden_states, residual)``, so that each
``dropout + add + norm`` is one fused kernel (``fused_dropout_add_ln=True``: culmen's ``layer_norm_fn``,
RMSNorm included) and the residual stream can stay in fp32 (``residual_in_fp32``). The first block
gets ``residual=None``. The post-norm ``Block`` (``prenorm=False``) is the classic
``mixer -> dropout -> add -> norm -> mlp -> dropout -> add -> norm``.

``StochasticDepth`` is culmen's own row-wise drop path with torchvision's semantics (flash_attn imports
torchvision's): in training each sample (row of dim 0) of its input is zeroed with probability ``p`` and
the survivors are scaled by ``1 / (1 - p)``. In the fused path the same per-sample factors reach the
kernel as ``rowscale``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from culmen.flash_attn.modules.mha import MHA
from culmen.flash_attn.modules.mlp import Mlp
from culmen.flash_attn.ops.rms_norm import RMSNorm as _LegacyRMSNorm
from culmen.flash_attn.ops.triton.layer_norm import RMSNorm, layer_norm_fn

__all__ = ["Block", "ParallelBlock", "StochasticDepth", "stochastic_depth"]

# Norm modules the fused path accepts, and which of them normalise by the root mean square.
_RMS_NORMS = (RMSNorm, _LegacyRMSNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
_FUSABLE_NORMS = (nn.LayerNorm, *_RMS_NORMS)


def stochastic_depth(input: Tensor, p: float, mode: str, training: bool = True) -> Tensor:  # noqa: A002
    """Drop path: zero whole samples (``mode="row"``: each index of dim 0) or the whole batch
    (``mode="batch"``) with probability ``p`` and scale what survives by ``1 / (1 - p)``; identity when
    not ``training`` or ``p == 0``. Returns a tensor of ``input``'s shape and dtype."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"drop probability p must be in [0, 1], got {p!r}")
    if mode not in ("row", "batch"):
        raise ValueError(f"mode must be 'row' or 'batch', got {mode!r}")
    if not training or p == 0.0:
        return input
    keep = 1.0 - p
    shape = (input.shape[0],) + (1,) * (input.dim() - 1) if mode == "row" else (1,) * input.dim()
    noise = torch.empty(shape, dtype=input.dtype, device=input.device).bernoulli_(keep)
    if keep > 0.0:
        noise.div_(keep)
    return input * noise


class StochasticDepth(nn.Module):
    """``stochastic_depth`` as a module (torchvision's ``StochasticDepth(p, mode)`` semantics)."""

    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"drop probability p must be in [0, 1], got {p!r}")
        if mode not in ("row", "batch"):
            raise ValueError(f"mode must be 'row' or 'batch', got {mode!r}")
        self.p = p
        self.mode = mode

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return stochastic_depth(input, self.p, self.mode, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, mode={self.mode}"


def _check_fusable(norm: nn.Module, dropout: nn.Module) -> None:
    if not isinstance(norm, _FUSABLE_NORMS):
        raise ValueError(f"fused_dropout_add_ln=True needs norm_cls to make nn.LayerNorm or RMSNorm, got "
                         f"{type(norm).__name__}")
    if not isinstance(dropout, nn.Dropout):
        raise ValueError(f"fused_dropout_add_ln=True needs dropout_cls to make nn.Dropout, got "
                         f"{type(dropout).__name__}")


def _eps(norm: nn.Module, dtype: torch.dtype) -> float:
    eps = norm.eps
    return torch.finfo(dtype).eps if eps is None else eps  # nn.RMSNorm's eps=None


def _mark(modules: list[nn.Module], flag: str) -> None:
    for m in modules:
        for p in m.parameters():
            setattr(p, flag, True)


class Block(nn.Module):
    """A transformer layer: mixer (attention) and MLP, each with residual dropout, drop path and a norm.

    Args:
        dim: model width. mixer_cls: ``mixer_cls(dim)`` builds the mixer (default ``MHA`` with
            ``dim // 64`` heads). mlp_cls: ``mlp_cls(dim)`` builds the MLP (default ``Mlp`` with ``4 * dim``
            hidden units); an ``nn.Identity`` MLP skips the second half (no ``norm2`` / ``dropout2``).
        norm_cls: ``norm_cls(dim)`` builds each norm (default ``nn.LayerNorm``).
        dropout_cls: ``dropout_cls(p)`` builds the residual dropouts (default ``nn.Dropout``).
        prenorm: flash_attn's pre-norm ordering (see the module docstring) or the post-norm layer.
        resid_dropout1, resid_dropout2: residual dropout after the mixer / the MLP.
        drop_path1, drop_path2: row-wise stochastic-depth probabilities after the mixer / the MLP.
        fused_dropout_add_ln: run dropout + drop path + add + norm as one ``layer_norm_fn`` call (needs
            an ``nn.LayerNorm`` / RMSNorm norm and ``nn.Dropout``).
        return_residual: post-norm only: the mixer and the MLP return ``(out, input)`` (their
            ``return_residual=True``), and the returned input is the residual.
        residual_in_fp32: pre-norm only: the residual stream is kept in fp32.
        sequence_parallel: mark the norms' parameters ``_sequence_parallel`` (their gradients are summed
            over the tensor-parallel group by ``allreduce_sequence_parallel_grad``).
        mark_shared_params: mark the norms' parameters ``_shared_params`` (``sync_shared_params``).
    """

    def __init__(self, dim: int, mixer_cls: Callable | None = None, mlp_cls: Callable | None = None,
                 norm_cls: Callable = nn.LayerNorm, dropout_cls: Callable = nn.Dropout, prenorm: bool = True,
                 resid_dropout1: float = 0.0, resid_dropout2: float = 0.0, drop_path1: float = 0.0,
                 drop_path2: float = 0.0, fused_dropout_add_ln: bool = False, return_residual: bool = False,
                 residual_in_fp32: bool = False, sequence_parallel: bool = False,
                 mark_shared_params: bool = False) -> None:
        super().__init__()
        self.prenorm = prenorm
        self.fused_dropout_add_ln = fused_dropout_add_ln
        self.return_residual = return_residual
        self.residual_in_fp32 = residual_in_fp32
        if residual_in_fp32 and not prenorm:
            raise ValueError("residual_in_fp32=True is only compatible with prenorm=True")
        if mixer_cls is None:
            mixer_cls = partial(MHA, num_heads=dim // 64)
        if mlp_cls is None:
            mlp_cls = partial(Mlp, hidden_features=4 * dim)
        self.mixer = mixer_cls(dim)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.drop_path1 = StochasticDepth(drop_path1, mode="row")
        self.norm1 = norm_cls(dim)
        self.mlp = mlp_cls(dim)
        self._has_mlp = not isinstance(self.mlp, nn.Identity)
        if self._has_mlp:
            self.dropout2 = dropout_cls(resid_dropout2)
            self.drop_path2 = StochasticDepth(drop_path2, mode="row")
            self.norm2 = norm_cls(dim)
        if fused_dropout_add_ln:
            _check_fusable(self.norm1, self.dropout1)
        self._rms = isinstance(self.norm1, _RMS_NORMS)
        norms = [self.norm1] + ([self.norm2] if self._has_mlp else [])
        if sequence_parallel:
            _mark(norms, "_sequence_parallel")
        if mark_shared_params:
            _mark(norms, "_shared_params")

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype: torch.dtype | None = None, **kwargs):
        """The mixer's kv cache (see ``MHA.allocate_inference_cache``)."""
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def _add_norm(self, x: Tensor, residual: Tensor | None, norm: nn.Module, dropout: nn.Module,
                  drop_path: StochasticDepth, prenorm: bool):
        """``norm(drop_path(dropout(x)) + residual)``; with ``prenorm`` also the sum (the new residual)."""
        if not self.fused_dropout_add_ln:
            summed = drop_path(dropout(x))
            if residual is not None:
                summed = summed + residual
            w = norm.weight
            out = norm(summed.to(dtype=w.dtype) if w is not None else summed)
            if not prenorm:
                return out
            return out, summed.to(torch.float32) if self.residual_in_fp32 else summed
        rowscale = None
        if self.training and drop_path.p > 0.0:
            rowscale = drop_path(torch.ones(x.shape[:-1], device=x.device, dtype=x.dtype))
        return layer_norm_fn(x, norm.weight, getattr(norm, "bias", None), residual=residual,
                             eps=_eps(norm, x.dtype), dropout_p=dropout.p if self.training else 0.0,
                             rowscale=rowscale, prenorm=prenorm, residual_in_fp32=self.residual_in_fp32 and prenorm,
                             is_rms_norm=self._rms)

    def forward(self, hidden_states: Tensor, residual: Tensor | None = None, mixer_subset=None,
                mixer_kwargs: dict | None = None):
        """Run the layer.

        Args:
            hidden_states: ``(B, S, dim)`` (or ``(tokens, dim)``): pre-norm: the previous layer's MLP
                output (or the embeddings); post-norm: the layer input.
            residual: pre-norm: the residual stream (``None`` for the first block); post-norm: must be None.
            mixer_subset: passed to the mixer (cross-attention queries for a subset of positions); the
                residual is sliced alike (``residual[:, mixer_subset]``).
            mixer_kwargs: extra keyword arguments of the mixer (``inference_params``, ``cu_seqlens`` ...).

        Returns pre-norm: ``(hidden_states, residual)``; post-norm: ``hidden_states``.
        """
        if self.prenorm:
            hidden_states, residual = self._add_norm(hidden_states, residual, self.norm1, self.dropout1,
                                                     self.drop_path1, True)
            if mixer_subset is not None:
                mixer_kwargs = {**(mixer_kwargs or {}), "mixer_subset": mixer_subset}
            hidden_states = self.mixer(hidden_states, **(mixer_kwargs or {}))
            if mixer_subset is not None:
                residual = residual[:, mixer_subset]
            if self._has_mlp:
                hidden_states, residual = self._add_norm(hidden_states, residual, self.norm2, self.dropout2,
                                                         self.drop_path2, True)
                hidden_states = self.mlp(hidden_states)
            return hidden_states, residual
        if residual is not None:
            raise ValueError("a post-norm Block (prenorm=False) takes no residual")
        mixer_out = self.mixer(hidden_states, **(mixer_kwargs or {}))
        if self.return_residual:  # the mixer returned (out, its input)
            mixer_out, hidden_states = mixer_out
        hidden_states = self._add_norm(mixer_out, hidden_states, self.norm1, self.dropout1, self.drop_path1, False)
        if self._has_mlp:
            mlp_out = self.mlp(hidden_states)
            if self.return_residual:
                mlp_out, hidden_states = mlp_out
            hidden_states = self._add_norm(mlp_out, hidden_states, self.norm2, self.dropout2, self.drop_path2, False)
        return hidden_states


class ParallelBlock(nn.Module):
    """Attention and MLP side by side on the same normalised input (GPT-J, GPT-NeoX, PaLM), pre-norm with
    flash_attn's reordering: ``residual += dropout1(h1) + dropout2(h2)``, ``h1 = mixer(norm1(residual))``,
    ``h2 = mlp(norm2(residual))`` (``norm1`` for both with ``tied_norm``).

    Args: as ``Block``, plus tied_norm (one norm for both branches; no ``norm2``). No drop path, always
    pre-norm.
    """

    def __init__(self, dim: int, mixer_cls: Callable | None = None, mlp_cls: Callable | None = None,
                 norm_cls: Callable = nn.LayerNorm, dropout_cls: Callable = nn.Dropout, resid_dropout1: float = 0.0,
                 resid_dropout2: float = 0.0, tied_norm: bool = False, fused_dropout_add_ln: bool = False,
                 residual_in_fp32: bool = False, sequence_parallel: bool = False,
                 mark_shared_params: bool = False) -> None:
        super().__init__()
        self.tied_norm = tied_norm
        self.fused_dropout_add_ln = fused_dropout_add_ln
        self.residual_in_fp32 = residual_in_fp32
        if mixer_cls is None:
            mixer_cls = partial(MHA, num_heads=dim // 64)
        if mlp_cls is None:
            mlp_cls = partial(Mlp, hidden_features=4 * dim)
        self.mixer = mixer_cls(dim)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.norm1 = norm_cls(dim)
        self.mlp = mlp_cls(dim)
        self.dropout2 = dropout_cls(resid_dropout2)
        if not tied_norm:
            self.norm2 = norm_cls(dim)
        if fused_dropout_add_ln:
            _check_fusable(self.norm1, self.dropout1)
            if not tied_norm and getattr(self.norm2, "weight", None) is None:
                raise ValueError("fused_dropout_add_ln=True with an untied norm2 needs norm2 to have a weight")
        self._rms = isinstance(self.norm1, _RMS_NORMS)
        norms = [self.norm1] + ([] if tied_norm else [self.norm2])
        if sequence_parallel:
            _mark(norms, "_sequence_parallel")
        if mark_shared_params:
            _mark(norms, "_shared_params")

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype: torch.dtype | None = None, **kwargs):
        """The mixer's kv cache (see ``MHA.allocate_inference_cache``)."""
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def forward(self, hidden_states1: Tensor, hidden_states2: Tensor | None = None, residual: Tensor | None = None,
                mixer_kwargs: dict | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``hidden_states1``: the previous mixer output (or the embeddings); ``hidden_states2``: the
        previous MLP output (``None`` for the first block: only one dropout then); ``residual``: the
        residual stream (``None`` first). All ``(B, S, dim)``. Returns ``(mixer_out, mlp_out, residual)``."""
        if not self.fused_dropout_add_ln:
            summed = self.dropout1(hidden_states1)
            if hidden_states2 is not None:
                summed = summed + self.dropout2(hidden_states2)
            if residual is not None:
                summed = residual + summed
            residual = summed
            w1 = self.norm1.weight
            hidden_states1 = self.norm1(residual.to(dtype=w1.dtype) if w1 is not None else residual)
            if self.tied_norm:
                hidden_states2 = hidden_states1
            else:
                w2 = self.norm2.weight
                hidden_states2 = self.norm2(residual.to(dtype=w2.dtype) if w2 is not None else residual)
            if self.residual_in_fp32:
                residual = residual.to(torch.float32)
        else:
            # One kernel: dropout of both inputs, the add, and both norms of the sum (x1 / weight1).
            norm2 = None if self.tied_norm else self.norm2
            outs = layer_norm_fn(
                hidden_states1, self.norm1.weight, getattr(self.norm1, "bias", None), residual=residual,
                x1=hidden_states2, weight1=None if norm2 is None else norm2.weight,
                bias1=None if norm2 is None else getattr(norm2, "bias", None),
                eps=_eps(self.norm1, hidden_states1.dtype), dropout_p=self.dropout1.p if self.training else 0.0,
                prenorm=True, residual_in_fp32=self.residual_in_fp32, is_rms_norm=self._rms)
            if self.tied_norm:
                hidden_states1, residual = outs
                hidden_states2 = hidden_states1
            else:
                hidden_states1, hidden_states2, residual = outs
        hidden_states1 = self.mixer(hidden_states1, **(mixer_kwargs or {}))
        hidden_states2 = self.mlp(hidden_states2)
        return hidden_states1, hidden_states2, residual
