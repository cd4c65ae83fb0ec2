"""The forward-matmul backends of ``semi_structured`` (culmen addition): ``y2 = x2 @ W^T + b`` on a
2:4-sparse weight ``W`` (``(out, in)``, 2:4 along ``in``) for ``x2`` of shape ``(tokens, in)``.

Why several: PyTorch's ``SparseSemiStructuredTensor`` costs about 1 ms of host time per matmul on
SM90 (torch 2.11): ``torch._cslt_sparse_mm`` builds and destroys its cuSPARSELt descriptors and
matmul plan on every call (the plan init dominates; the Python subclass dispatch is ~20 us). The
CUTLASS kernels (``torch._sparse_semi_structured_mm/addmm``) have no plan but are SM80 code: on SM90
they do not refuse, they hit an illegal instruction (seen on an H200), so culmen never runs them outside
compute capability 8.x. So:

- ``cusparselt-graph``: ``torch._cslt_sparse_mm`` captured once per token count in a CUDA graph
  (the plan is built at capture only); a call copies ``x2`` into the graph's static input, replays
  and clones the static output (an output kept by autograd must not be overwritten by the next
  replay). The compressed weight lives in one static buffer that a changed weight is re-compressed
  into, so the graphs stay valid across optimizer steps. Inside someone else's capture it runs the
  op directly (graphs don't nest);
- ``cusparselt``: ``torch._cslt_sparse_mm`` directly (plan per call), the fused bias, alg id cached;
- ``cutlass``: ``torch._sparse_semi_structured_addmm`` / ``_mm`` (SM8x only), no per-call plan;
- ``torch``: ``F.linear`` on ``torch.sparse.to_sparse_semi_structured(W)`` (PyTorch's own path);
- ``dense``: ``F.linear`` on the dense (pruned) weight.

Every backend re-compresses lazily when the dense weight changed (its ``data_ptr`` or ``_version``),
without a host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["BACKENDS", "make_backend"]

BACKENDS = ("cusparselt-graph", "cusparselt", "cutlass", "torch", "dense")

# cuSPARSELt / CUTLASS want the dense operand's dims to be multiples of 8 (fp16 / bf16): token counts
# that are not are zero-padded, the extra output rows dropped.
_TOKEN_ALIGN = 8


def _pad_tokens(x2: Tensor) -> tuple[Tensor, int]:
    n = x2.shape[0]
    pad = (-n) % _TOKEN_ALIGN
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))
    elif not x2.is_contiguous():
        x2 = x2.contiguous()
    elif x2.data_ptr() % 16:  # a row-offset view: the kernels want 16-byte aligned operands
        x2 = x2.clone()
    return x2, n


def _capture(fn: Callable[[], Tensor]) -> tuple[Callable[[], Any], Tensor]:
    """Capture ``fn()`` in a CUDA graph: ``(replay, static_output)`` (a test seam: CPU tests fake it)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph.replay, out


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


class _Dense:
    name = "dense"

    def __init__(self, weight: Tensor, opts: dict[str, Any]) -> None:
        pass

    def mm(self, x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return F.linear(x2, weight, bias)


class _Compressed:
    """Shared part of the sparse backends: the compressed weight, re-made when the weight changed."""

    name = ""

    def __init__(self, weight: Tensor, opts: dict[str, Any]) -> None:
        self.key: tuple[int, int] | None = None
        self.opts = opts
        self.refresh(weight)

    def compress(self, weight: Tensor) -> None:
        raise NotImplementedError

    def refresh(self, weight: Tensor) -> None:
        key = (weight.data_ptr(), weight._version)
        if key != self.key:
            with torch.no_grad():
                self.compress(weight.detach())
            self.key = key


class _TorchSubclass(_Compressed):
    name = "torch"

    def compress(self, weight: Tensor) -> None:
        self.compressed = torch.sparse.to_sparse_semi_structured(weight)

    def mm(self, x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if (weight.data_ptr(), weight._version) != self.key:
            self.refresh(weight)
        return F.linear(x2, self.compressed, bias)


class _Cutlass(_Compressed):
    name = "cutlass"

    def compress(self, weight: Tensor) -> None:
        from torch.sparse import SparseSemiStructuredTensorCUTLASS

        major, minor = torch.cuda.get_device_capability(weight.device)
        if major != 8:
            # Its kernels are SM80 code: on an H200 (9.0) they ran into an illegal instruction, which
            # poisons the whole CUDA context, so they are never tried outside 8.x.
            raise RuntimeError(f"cutlass: PyTorch's CUTLASS 2:4 kernels need compute capability 8.x, "
                               f"got {major}.{minor}")
        t = SparseSemiStructuredTensorCUTLASS.from_dense(weight)  # validates dtype / shape / device
        self.packed, self.meta = t.packed, t.meta
        self.op_mm, self.op_addmm = torch._sparse_semi_structured_mm, torch._sparse_semi_structured_addmm

    def mm(self, x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if (weight.data_ptr(), weight._version) != self.key:
            self.refresh(weight)
        xp, n = _pad_tokens(x2)
        # (out, tokens) row-major; its transpose is the (tokens, out) result (column-major, no copy)
        y = (self.op_mm(self.packed, self.meta, xp.t()) if bias is None
             else self.op_addmm(bias, self.packed, self.meta, xp.t()))
        return y.t() if n == xp.shape[0] else y.t()[:n]


class _Cusparselt(_Compressed):
    """``torch._cslt_sparse_mm(W_c, x2^T, bias, transpose_result=True)``: ``W_c`` is ``(out, in)``, the
    dense operand the transposed view of the row-major ``x2``, the result row-major ``(tokens, out)``."""

    name = "cusparselt"

    def __init__(self, weight: Tensor, opts: dict[str, Any]) -> None:
        self.op = torch._cslt_sparse_mm
        self.compress_op = torch._cslt_compress
        self.search = opts.get("search_alg", False)  # see enable_semi_structured
        self.algs: dict[int, int] = {}
        self.compressed: Tensor | None = None
        super().__init__(weight, opts)

    def compress(self, weight: Tensor) -> None:
        self.compressed = self.compress_op(weight)

    def alg_for(self, xp: Tensor, bias: Tensor | None) -> int:
        """The cuSPARSELt algorithm id for this token count: searched once (``search_alg``), else 0."""
        n = xp.shape[0]
        alg = self.algs.get(n)
        if alg is None:
            alg = 0
            # never inside someone's capture: the search times kernels (it would break the capture)
            if self.search and hasattr(torch, "_cslt_sparse_mm_search") and not _capturing():
                try:
                    found = torch._cslt_sparse_mm_search(self.compressed, xp.t(), bias=bias, transpose_result=True)
                    alg = int(found[0] if isinstance(found, (tuple, list)) else found)
                    if alg:  # keep it only if it runs and agrees with the default algorithm
                        y0 = self.op(self.compressed, xp.t(), bias=bias, transpose_result=True, alg_id=0)
                        y1 = self.op(self.compressed, xp.t(), bias=bias, transpose_result=True, alg_id=alg)
                        if not bool(((y1.float() - y0.float()).abs().max()
                                     <= 0.02 * y0.float().abs().max() + 1e-2).item()):
                            alg = 0
                except (RuntimeError, TypeError, ValueError):
                    alg = 0  # a build whose search is missing or refuses: the default algorithm
            self.algs[n] = alg
        return alg

    def mm(self, x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if (weight.data_ptr(), weight._version) != self.key:
            self.refresh(weight)
        xp, n = _pad_tokens(x2)
        y = self.op(self.compressed, xp.t(), bias=bias, transpose_result=True, alg_id=self.alg_for(xp, bias))
        return y if n == xp.shape[0] else y[:n]


class _CusparseltGraph(_Cusparselt):
    name = "cusparselt-graph"

    def __init__(self, weight: Tensor, opts: dict[str, Any]) -> None:
        self.max_graphs = int(opts.get("max_graphs", 4))
        # token count -> (replay, static input, static output); the bias pointer the graphs baked in
        self.graphs: dict[int, tuple[Callable[[], Any], Tensor, Tensor]] = {}
        self.bias_ptr = 0
        super().__init__(weight, opts)

    def compress(self, weight: Tensor) -> None:
        fresh = self.compress_op(weight)
        if self.compressed is not None and self.compressed.shape == fresh.shape and \
                self.compressed.dtype == fresh.dtype and self.compressed.device == fresh.device:
            self.compressed.copy_(fresh)  # same address: the captured graphs read the new weight
        else:
            self.compressed = fresh
            self.graphs.clear()

    def mm(self, x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if (weight.data_ptr(), weight._version) != self.key:
            self.refresh(weight)
        if _capturing():  # inside someone's capture: graphs neither nest nor replay there, run the op itself
            return super().mm(x2, weight, bias)
        n = x2.shape[0]
        entry = self.graphs.get(n)
        bias_ptr = 0 if bias is None else bias.data_ptr()
        if entry is None or bias_ptr != self.bias_ptr:
            if bias_ptr != self.bias_ptr:
                self.graphs.clear()
                self.bias_ptr = bias_ptr
            if len(self.graphs) >= self.max_graphs:
                # new shapes past the cap: the dense weight (the direct op builds a cuSPARSELt plan per call,
                # 1-200 ms on an H200, against well under 1 ms dense)
                return F.linear(x2, weight, bias)
            entry = self.graphs[n] = self._build(x2, bias)
        replay, x_static, y_static = entry
        if x_static.shape[0] == n:
            x_static.copy_(x2)
            replay()
            return y_static.clone()
        x_static[:n].copy_(x2)  # padded token count: the rows past n stay zero
        replay()
        return y_static[:n].clone()

    def direct_mm(self, x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """The uncaptured op (what ``semi_structured``'s enable-time probe runs: no graph for it)."""
        return _Cusparselt.mm(self, x2, weight, bias)

    def _build(self, x2: Tensor, bias: Tensor | None) -> tuple[Callable[[], Any], Tensor, Tensor]:
        xp, _ = _pad_tokens(x2)
        x_static = torch.zeros_like(xp, memory_format=torch.contiguous_format)  # padded rows stay 0
        x_static.copy_(xp)
        alg = self.alg_for(x_static, bias)
        compressed, op = self.compressed, self.op
        # one eager run first: cuSPARSELt's handle and PyTorch's lazy state are set up outside capture
        op(compressed, x_static.t(), bias=bias, transpose_result=True, alg_id=alg)
        replay, y_static = _capture(
            lambda: op(compressed, x_static.t(), bias=bias, transpose_result=True, alg_id=alg))
        return replay, x_static, y_static


_CLASSES = {c.name: c for c in (_CusparseltGraph, _Cusparselt, _Cutlass, _TorchSubclass, _Dense)}


def make_backend(name: str, weight: Tensor, opts: dict[str, Any]) -> Any:
    """Build backend ``name`` for ``weight`` (compressing it); raises whatever the backend's ops raise."""
    return _CLASSES[name](weight, opts)
