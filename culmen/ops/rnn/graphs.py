"""CUDA graphs of whole-layer recurrences: the time loop of a layer replayed as one graph launch.

An eager layer costs the host a GEMM call and a kernel launch per time step (about 35 us on the H200
test machine, against about 7 us of GPU time), so a long sequence is host-bound. Here the loop of
``loops.py`` is captured once per layer signature on static buffers and replayed: the host then pays
one ``cudaGraphLaunch`` per layer and direction, whatever the sequence length.

How a call uses it (``culmen.ops.rnn.op``):

* A signature (cell kind, ``T``, ``B``, ``H``, dtype, device, direction, bias) owns up to ``MAX_SETS``
  buffer sets. A set holds everything its graphs read and write: the gate buffer (the input projection
  is written straight into it, so the big ``(T, B, nH)`` tensor is never copied), the outputs, and copies
  of ``h0`` / ``c0`` / ``W_hh`` (/ ``b_hh``) made each call. The backward buffers (``dY``, ``dG``, ...)
  are shared by the signature's sets: they are consumed within the backward call.
* Outputs are handed out as aliases of the set's buffers (no copy). A set is reused only once nothing
  outside this module references any of its output storages (outputs, their views, autograd's saved
  tensors, hidden states kept by a cell); otherwise another set is used, and with all ``MAX_SETS`` busy
  the call runs the plain eager loop on fresh tensors. So results are never overwritten by a later call.
* The first call of a signature runs eagerly (no persistent buffers for one-off shapes; it also compiles
  the kernels). A later call captures when every launch of the loop is bound (compiled) and replays;
  until then it runs the same loop eagerly on the set's buffers.
* Capture is skipped, and the eager loop runs, where a graph cannot or should not be used: tensors not on
  CUDA, the reference backend, inside an outer stream capture or ``torch.compile`` tracing, after
  ``set_cuda_graphs(False)`` (starting value: ``CULMEN_RNN_CUDA_GRAPHS``, read once; ``0`` turns graphs
  off) or with the ops' ``cuda_graph=False`` argument; and, for a signature, after its capture failed once.

Memory: a set of an LSTM layer is ``T B (4H + 2H)`` elements plus ``(4H, H)`` (384 MiB at T 512, B 64,
H 1024 in bf16), what the eager layer allocates per call anyway; a signature makes a new set only while
all its sets are in use (at most ``MAX_SETS``), and at most ``GRAPHS.maxsize`` signatures are kept
(``clear_cuda_graphs`` drops them all).
A replay runs on the caller's current stream; a set last used on another stream waits for it first.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import torch
from torch import Tensor

from culmen.ops.common.plans import PlanCache

# Sets a signature may own. The layers of a stack share a signature (the input size is not part of it), and
# a training loop still holds the previous call's output while the next forward runs: an L-layer stack
# needs L + 1 sets in steady state. Sets are only made while all others are in use, so the memory kept is
# the peak a program really held at once (as the caching allocator would keep it).
MAX_SETS = 8
GRAPHS = PlanCache("rnn_graphs", maxsize=8)
STATS: Counter = Counter()
"""Counts of what calls did (``capture``, ``replay``, ``set_eager``: loop run eagerly on a set's buffers,
``eager``: no set; each with ``_fwd`` / ``_bwd``), for tests and the sweep."""

_ENABLED = os.environ.get("CULMEN_RNN_CUDA_GRAPHS", "1").strip().lower() not in ("0", "false", "off", "no")
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
# Tests install a graph stand-in (``capture(fn, warmup)`` / ``replay()``) here; it also lets CPU tensors
# take the graph path, so the buffer-set logic runs in CPU CI.
_GRAPH_FACTORY: Callable | None = None
_SIDE_STREAMS: dict = {}


def set_cuda_graphs(enabled: bool) -> None:
    """Turn the CUDA-graph replay of ``culmen.RNN`` / ``lstm_sequence`` / ``gru_sequence`` layers on or off
    process-wide (off: every call runs the eager step loop). Turning it off frees every cached graph and
    buffer set."""
    global _ENABLED
    if not isinstance(enabled, bool):
        raise TypeError(f"set_cuda_graphs: enabled must be a bool, got {enabled!r}")
    _ENABLED = enabled
    if not enabled:
        clear_cuda_graphs()


def cuda_graphs_enabled() -> bool:
    """Whether layers may replay CUDA graphs (``set_cuda_graphs``)."""
    return _ENABLED


def clear_cuda_graphs() -> None:
    """Drop every cached graph and buffer set (outputs handed out earlier stay valid)."""
    GRAPHS.clear()


def graphs_allowed(device: torch.device, override: bool | None) -> bool:
    """Whether a layer call on ``device`` may use the graph path; ``override`` is the op's ``cuda_graph``
    argument (``None``: the process-wide switch)."""
    if not (_ENABLED if override is None else override) or _USE_COUNT is None:
        return False
    if torch.compiler.is_compiling():
        return False
    if device.type == "cuda":
        return not torch.cuda.is_current_stream_capturing()
    return _GRAPH_FACTORY is not None


def _use_count(t: Tensor) -> int:
    return _USE_COUNT(t.untyped_storage()._cdata)


class BufferSet:
    """The static tensors of one set (attributes named as in the ops) and its captured graphs."""

    def __init__(self, tensors: dict[str, Tensor | None], tracked: tuple[str, ...]) -> None:
        for name, t in tensors.items():
            setattr(self, name, t)
        self.graphs: dict = {}
        self._tracked = tuple(tensors[n] for n in tracked)
        self._base = tuple(_use_count(t) for t in self._tracked)

    def free(self) -> bool:
        """Whether no storage of an output is referenced outside this set (the set may be overwritten)."""
        for t, base in zip(self._tracked, self._base):
            if _use_count(t) != base:
                return False
        return True


class LayerGraphs:
    """Buffer sets, shared backward buffers and graphs of one layer signature."""

    def __init__(self, kind: str, T: int, B: int, H: int, dtype: torch.dtype, device: torch.device,
                 bias: bool) -> None:
        self.kind, self.T, self.B, self.H, self.dtype, self.device, self.bias = kind, T, B, H, dtype, device, bias
        self.calls = 0
        self.sets: list[BufferSet] = []
        self.bwd: BufferSet | None = None
        self.error: str | None = None  # why capturing failed: the signature runs eagerly from then on
        self._stream = None

    def _empty(self, *shape, dtype: torch.dtype | None = None) -> Tensor:
        return torch.empty(*shape, dtype=self.dtype if dtype is None else dtype, device=self.device)

    def _new_set(self) -> BufferSet:
        T, B, H, e = self.T, self.B, self.H, self._empty
        if self.kind == "lstm":
            t = {"G": e(T, B, 4 * H), "Y": e(T, B, H), "CS": e(T, B, H), "h0": e(B, H), "c0": e(B, H),
                 "w_hh": e(4 * H, H)}
            return BufferSet(t, ("G", "Y", "CS"))
        t = {"XG": e(T, B, 3 * H), "HG": e(T, B, 3 * H), "Y": e(T, B, H), "h0": e(B, H), "w_hh": e(3 * H, H),
             "b_hh": e(3 * H) if self.bias else None}
        return BufferSet(t, ("XG", "HG", "Y"))

    def sync_stream(self) -> None:
        """Order this call after the signature's previous one when the current stream changed."""
        if self.device.type != "cuda":
            return
        cur = torch.cuda.current_stream(self.device)
        prev = self._stream
        if prev is not None and prev != cur:
            cur.wait_stream(prev)
        self._stream = cur

    def acquire(self) -> BufferSet | None:
        """A free buffer set for this forward call, or ``None`` (run the plain eager loop): on the first call
        of the signature, after a failed capture, or with every set in use and ``MAX_SETS`` reached."""
        self.calls += 1
        if self.calls == 1 or self.error is not None:
            return None
        for s in self.sets:
            if s.free():
                self.sync_stream()
                return s
        if len(self.sets) >= MAX_SETS:
            return None
        s = self._new_set()
        self.sets.append(s)
        self.sync_stream()
        return s

    def bwd_buffers(self, has_dcx: bool) -> BufferSet:
        """The backward buffers shared by this signature's sets (``dCS`` made on first need)."""
        self.sync_stream()
        T, B, H, e = self.T, self.B, self.H, self._empty
        if self.bwd is None:
            if self.kind == "lstm":
                carry = torch.float64 if self.dtype == torch.float64 else torch.float32
                t = {"dY": e(T, B, H), "dCS": None, "dG": e(T, B, 4 * H), "dc": e(B, H, dtype=carry),
                     "dh_buf": e(B, H), "dh0": e(B, H)}
            else:
                t = {"dY": e(T, B, H), "dXG": e(T, B, 3 * H), "dHG": e(T, B, 3 * H), "dhd": e(B, H),
                     "dh_buf": e(B, H)}
            self.bwd = BufferSet(t, ())
        if has_dcx and self.bwd.dCS is None:
            self.bwd.dCS = e(T, B, H)
        return self.bwd

    def run(self, s: BufferSet, slot, loop: Callable[[], object], warm: bool) -> None:
        """Run ``loop`` (a closure over ``s``'s and the shared buffers) through ``s``'s graph for ``slot``:
        replay it, capture it first when ``warm`` (every launch compiled), or else run it eagerly."""
        direction = "_bwd" if slot != "fwd" else "_fwd"
        g = s.graphs.get(slot)
        if g is None and warm and self.error is None:
            g = self._capture(loop, s)
            if g is not None:
                s.graphs[slot] = g
                STATS["capture" + direction] += 1
        if g is not None:
            g.replay()
            STATS["replay" + direction] += 1
        else:
            loop()
            STATS["set_eager" + direction] += 1

    def _capture(self, loop: Callable[[], object], s: BufferSet):
        def warmup():
            # cuBLAS binds a workspace per stream on first use; make that happen outside the capture, for
            # both GEMM forms the loops use (plain, and with a bias vector: cuBLASLt).
            torch.mm(s.h0, s.w_hh.t())
            if getattr(s, "b_hh", None) is not None:
                torch.addmm(s.b_hh, s.h0, s.w_hh.t())

        graph = _GRAPH_FACTORY() if _GRAPH_FACTORY is not None else _CudaGraph(self.device)
        try:
            graph.capture(loop, warmup)
        except Exception as exc:  # a capture-unsafe call somewhere: this signature stays eager
            self.error = f"{type(exc).__name__}: {exc}"
            return None
        return graph


class _CudaGraph:
    """One ``torch.cuda.CUDAGraph`` captured on a per-device side stream (as ``torch.cuda.graph`` does,
    without its cache flush: nothing in the loop allocates)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, loop: Callable[[], object], warmup: Callable[[], object]) -> None:
        dev = self.device
        with torch.cuda.device(dev):
            idx = torch.cuda.current_device()
            side = _SIDE_STREAMS.get(idx)
            if side is None:
                side = _SIDE_STREAMS[idx] = torch.cuda.Stream()
            cur = torch.cuda.current_stream()
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                warmup()
                self.graph.capture_begin(capture_error_mode="thread_local")
                try:
                    loop()
                finally:
                    self.graph.capture_end()
            cur.wait_stream(side)

    def replay(self) -> None:
        self.graph.replay()


def layer_graphs(kind: str, T: int, B: int, H: int, dtype: torch.dtype, device: torch.device, reverse: bool,
                 bias: bool) -> LayerGraphs:
    """The ``LayerGraphs`` of this signature (made on first use)."""
    key = (kind, T, B, H, dtype, device, reverse, bias)
    lg = GRAPHS.get(key)
    if lg is None:
        lg = GRAPHS.put(key, LayerGraphs(kind, T, B, H, dtype, device, bias))
    return lg
