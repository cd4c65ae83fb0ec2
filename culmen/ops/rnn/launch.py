"""Call plans of the fused RNN cells: one ``CellPlan`` per (cell, batch, hidden size, dtypes, device).

A sequence runs the same cell shape hundreds of times, so everything a launch needs is fixed once: the
backend (Triton kernel or reference), the tile, the grid and a bound ``Launch`` per kernel variant. A step
then costs one call of the compiled kernel's C launcher with the step's tensors. Every tensor handed to a
plan is one contiguous ``(B, nH)`` time step; the plan never checks this (its callers build the steps).

The step loops (``loops.py``) call ``plan.fwd`` / ``plan.bwd[flag]`` directly, one call per step with one
signature on every backend: ``(stream, aligned, *tensors, B, H)``; on the reference backend these are small
adapters around ``reference.py`` (so the loops have no per-step backend branch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from culmen.ops.backend import choose_backend
from culmen.ops.common.launch import Launch, next_pow2, stream_getter
from culmen.ops.common.plans import PlanCache
from culmen.ops.rnn import reference as ref

PLANS = PlanCache("rnn_cell")

# Elements of one (B, H) step per program: small steps (B = 64, H = 1024 is 64 Ki elements) must still
# spread over every SM, and the kernels are latency-bound, not bandwidth-bound.
_TILE_ELEMS = 512


class CellPlan:
    """Launches of one cell kind (``"lstm"`` / ``"gru"``) for steps of ``B`` rows and ``H`` hidden units.

    ``dtype`` is the storage dtype of the gates, states and their gradients; ``carry_dtype`` the dtype of
    the LSTM cell-gradient carry ``dc`` (fp32 in the sequence op, ``dtype`` in the one-step op).
    """

    def __init__(self, kind: str, B: int, H: int, dtype: torch.dtype, carry_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.kind = kind
        self.B, self.H = B, H
        self.backend = choose_backend(device)
        self.stream = stream_getter(device)
        if self.backend != "triton":
            self.fwd = _lstm_fwd_ref if kind == "lstm" else _gru_fwd_ref
            bwd = _lstm_bwd_ref if kind == "lstm" else _gru_bwd_ref
            self.bwd = {False: bwd, True: bwd}
            return
        from culmen.ops.rnn import kernels as k

        bh = min(128, next_pow2(H))
        bb = max(1, min(next_pow2(B), _TILE_ELEMS // bh))
        grid = (-(-H // bh), -(-B // bb))
        warps = 4 if bb * bh >= 512 else (2 if bb * bh >= 128 else 1)
        tiles = {"BLOCK_B": bb, "BLOCK_H": bh}
        if kind == "lstm":
            self._fwd = Launch(k._lstm_fwd_kernel, grid, tiles, warps, device=device)
            self._bwd = {flag: Launch(k._lstm_bwd_kernel, grid, {"HAS_DCX": flag, **tiles}, warps, device=device)
                         for flag in (False, True)}
        else:
            self._fwd = Launch(k._gru_fwd_kernel, grid, tiles, warps, device=device)
            self._bwd = {flag: Launch(k._gru_bwd_kernel, grid, {"HAS_DY_PREV": flag, **tiles}, warps, device=device)
                         for flag in (False, True)}
        self.fwd, self.bwd = self._fwd, self._bwd

    def warm(self, *launches) -> bool:
        """Whether every one of ``launches`` (entries of ``fwd`` / ``bwd``) runs without compiling or binding:
        a reference adapter always does, a ``Launch`` once its first call bound the compiled kernel. A CUDA
        graph may only capture warm launches (Triton cannot compile inside a stream capture)."""
        return all(not isinstance(f, Launch) or f._run is not None for f in launches)

    # The stream is fetched once per sequence by the caller and passed in (``stream=self.stream()``).

    def lstm_fwd(self, stream, aligned: bool, g: Tensor, ws: Tensor, c_prev: Tensor, h: Tensor, c: Tensor) -> None:
        """Activated gates of ``g`` into ``ws`` (may be ``g``); the step's ``h`` and ``c``."""
        if self.backend == "triton":
            self._fwd(stream, aligned, g, ws, c_prev, h, c, self.B, self.H)
        else:
            ref.lstm_fwd_ref(g, ws, c_prev, h, c)

    def lstm_bwd(self, stream, aligned: bool, ws: Tensor, c_prev: Tensor, c: Tensor, dh: Tensor, dc: Tensor,
                 dcx: Tensor | None, dg: Tensor, dc_prev: Tensor) -> None:
        """Gate gradients into ``dg`` and the cell-state gradient of the previous step into ``dc_prev``."""
        if self.backend == "triton":
            self._bwd[dcx is not None](stream, aligned, ws, c_prev, c, dh, dc, dc if dcx is None else dcx, dg,
                                       dc_prev, self.B, self.H)
        else:
            ref.lstm_bwd_ref(ws, c_prev, c, dh, dc, dcx, dg, dc_prev)

    def gru_fwd(self, stream, aligned: bool, xg: Tensor, hg: Tensor, h_prev: Tensor, ws: Tensor, h: Tensor) -> None:
        """``r, z, n`` into ``ws`` (may be ``xg``); the step's ``h``."""
        if self.backend == "triton":
            self._fwd(stream, aligned, xg, hg, h_prev, ws, h, self.B, self.H)
        else:
            ref.gru_fwd_ref(xg, hg, h_prev, ws, h)

    def gru_bwd(self, stream, aligned: bool, ws: Tensor, hg: Tensor, h_prev: Tensor, dh: Tensor,
                dy_prev: Tensor | None, dxg: Tensor, dhg: Tensor, dhd: Tensor) -> None:
        """Gradients of the step's input and hidden gates, and the direct part of the previous ``h``'s."""
        if self.backend == "triton":
            self._bwd[dy_prev is not None](stream, aligned, ws, hg, h_prev, dh, dh if dy_prev is None else dy_prev,
                                           dxg, dhg, dhd, self.B, self.H)
        else:
            ref.gru_bwd_ref(ws, hg, h_prev, dh, dy_prev, dxg, dhg, dhd)


def cell_plan(kind: str, B: int, H: int, dtype: torch.dtype, carry_dtype: torch.dtype,
              device: torch.device) -> CellPlan:
    """The cached ``CellPlan`` of this signature (built on first use)."""
    key = (kind, B, H, dtype, carry_dtype, device)
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.put(key, CellPlan(kind, B, H, dtype, carry_dtype, device))
    return plan


# Reference adapters with the launches' signature ``(stream, aligned, *tensors, B, H)``; the ``dcx`` /
# ``dy_prev`` slot holds a placeholder when the caller has none (``bwd[False]``), exactly as for the kernels.


def _lstm_fwd_ref(stream, aligned, g, ws, c_prev, h, c, B, H) -> None:
    ref.lstm_fwd_ref(g, ws, c_prev, h, c)


def _lstm_bwd_ref(stream, aligned, ws, c_prev, c, dh, dc, dcx, dg, dc_prev, B, H) -> None:
    ref.lstm_bwd_ref(ws, c_prev, c, dh, dc, None if dcx is dc else dcx, dg, dc_prev)


def _gru_fwd_ref(stream, aligned, xg, hg, h_prev, ws, h, B, H) -> None:
    ref.gru_fwd_ref(xg, hg, h_prev, ws, h)


def _gru_bwd_ref(stream, aligned, ws, hg, h_prev, dh, dy_prev, dxg, dhg, dhd, B, H) -> None:
    ref.gru_bwd_ref(ws, hg, h_prev, dh, None if dy_prev is dh else dy_prev, dxg, dhg, dhd)
