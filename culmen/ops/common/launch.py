"""Low-overhead Triton launches: the ``Launch`` every op plan binds, and small host helpers.

``kernel[grid](*args, **constexprs)`` re-binds and re-specializes every argument on every call (about
12 µs of host time on the GPU test machine, more than a memory-bound kernel takes on the GPU). A plan
fixes everything Triton specializes on, so after the first call a ``Launch`` calls the compiled kernel's
C launcher directly (~3 µs). Triton's own dispatch still runs the first call, calls under the CPU
interpreter, calls while another device is current, calls with misaligned pointers, while a profiler's
launch hooks are installed (at bind time), and everything after ``set_fast_launch(False)`` (starting
value: ``CULMEN_FAST_LAUNCH``, read once).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

_I32 = 2**31


# ------------------------------------------------------------------------------------------ Launch
#
# ``Launch`` is the one way culmen's op plans launch a kernel. A plan fixes everything Triton
# specializes a kernel on (argument dtypes, integer values seen through ``== 1`` / ``% 16``, constexprs,
# warps, stages) except the 16-byte alignment of pointers, which the caller checks per call; so after
# the first call a ``Launch`` calls the compiled kernel's C launcher directly, with no per-call key,
# binding or dict. Integer arguments that change per call (row counts, offsets) must be listed in the
# kernel's ``do_not_specialize``.

_FAST = os.environ.get("CULMEN_FAST_LAUNCH", "1") != "0"
_FAKE_RUN = None  # culmen.testing.hostcost installs a recorder here (CPU host-cost tests)
# Triton versions whose launcher's C entry point culmen calls directly (its argument order is
# checked against these); other versions go through ``CompiledKernel.run``, one Python frame more.
_DIRECT_VERSIONS = ("3.5.", "3.6.")


def set_fast_launch(flag: bool) -> None:
    """Turn the direct launches off (``False``: every launch goes through Triton's own dispatch, the
    slow but always-valid path; for bisecting a suspected launch bug). Starts from ``CULMEN_FAST_LAUNCH``."""
    global _FAST
    _FAST = bool(flag)
    from culmen.ops.common.plans import clear_plans

    clear_plans()


def _no_hooks_installed() -> bool:
    enter, leave = _launch_hooks()
    return _no_hooks(enter, leave)


def _triton_version() -> str:
    import triton

    return triton.__version__


class Launch:
    """One configuration of one Triton kernel: grid, constexprs, warps and stages, fixed by a plan.

    ``launch(stream, aligned, *args)`` runs it with the kernel's non-constexpr arguments in signature
    order on the raw CUDA ``stream`` (``None`` off CUDA or when another device is current: then Triton's
    own dispatch runs it, under the interpreter on CPU). ``aligned`` says every pointer argument is
    16-byte aligned; only then may the bound kernel run (Triton compiled it for aligned pointers).
    ``traced(*args)`` is the same launch inside a ``torch.library.triton_op`` (``torch.compile``).
    ``options``: Triton compile options besides warps and stages (e.g. ``enable_fp_fusion=False`` for
    kernels that must round every multiply and add separately); not constexprs.
    """

    __slots__ = ("fn", "grid", "meta", "num_warps", "num_stages", "device", "consts", "_run", "_mid", "error",
                 "options", "_eager_options")

    def __init__(self, fn, grid: tuple, meta: dict, num_warps: int, num_stages: int = 3,
                 device: torch.device | None = None, options: dict | None = None) -> None:
        self.fn = fn
        self.grid = (*grid, 1, 1)[:3]
        self.meta = meta
        self.options = options or {}
        # fma contraction stated, not left to Triton's default (on through 3.9, off from 3.10): the kernels'
        # speed and their tests' error budgets assume it. Not for traced launches (Inductor takes no such
        # option; it compiles with its own settings).
        self._eager_options = {"enable_fp_fusion": True, **self.options}
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.device = device
        self.consts: tuple = ()
        self._run = None
        self._mid: tuple = ()
        self.error: str | None = None  # why the direct path was given up, for diagnosis

    def __call__(self, stream, aligned: bool, *args) -> None:
        run = self._run
        if run is not None and aligned:
            g = self.grid
            run(g[0], g[1], g[2], stream, *self._mid, *args, *self.consts)
            return
        self._launch_slow(stream, aligned, args)

    def _launch_slow(self, stream, aligned: bool, args: tuple) -> None:
        if stream is not None and _FAKE_RUN is not None:
            self._run, self._mid = _FAKE_RUN, ()
            _FAKE_RUN(*self.grid, stream, *args)
            return
        if stream is None or not _FAST:
            with _guard(self.device):
                self.fn[self.grid](*args, **self.meta, num_warps=self.num_warps, num_stages=self.num_stages,
                                   **self._eager_options)
            return
        compiled = self.fn[self.grid](*args, **self.meta, num_warps=self.num_warps, num_stages=self.num_stages,
                                      **self._eager_options)
        if aligned and compiled is not None and _no_hooks_installed():
            self._bind(compiled, len(args))

    def _bind(self, compiled, n_args: int) -> None:
        names = self.fn.arg_names[n_args:]
        if set(names) != set(self.meta):
            self.error = f"constexprs {names} are not the plan's {list(self.meta)}"
            return
        self.consts = tuple(self.meta[n] for n in names)
        launcher = compiled.run
        direct = getattr(launcher, "launch", None)
        no_scratch = not (getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1))
        if direct is not None and no_scratch and _triton_version().startswith(_DIRECT_VERSIONS):
            # CudaLauncher.__call__ only allocates scratch (none here) and forwards to its C ``launch``.
            self._mid = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                         compiled.packed_metadata, None, None, None)
            self._run = direct
        else:
            self._mid = (compiled.function, compiled.packed_metadata, None, None, None)
            self._run = launcher

    def traced(self, *args) -> None:
        """Launch inside a ``torch.library.triton_op`` body: Inductor sees (and launches) the kernel."""
        from torch.library import wrap_triton

        wrap_triton(self.fn)[self.grid](*args, **self.meta, num_warps=self.num_warps, num_stages=self.num_stages,
                                        **self.options)


def traceable_kernels() -> bool:
    """Whether ``Launch.traced`` can put kernels into a ``torch.compile`` graph: not under Triton's CPU
    interpreter, whose kernels run eagerly (plans then trace their reference path instead)."""
    from culmen.ops.backend import interpreter_enabled

    return not interpreter_enabled()


def _guard(device: torch.device | None):
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def stream_getter(device: torch.device):
    """A function returning the raw current stream of ``device`` for ``Launch``, or ``None`` (Triton's own
    dispatch) when another CUDA device is current or the tensors are not on CUDA."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        get_dev = torch._C._cuda_getDevice
        if raw is None:  # pragma: no cover - older torch
            return lambda: torch.cuda.current_stream(index).cuda_stream if get_dev() == index else None

        def stream():
            return raw(index) if get_dev() == index else None

        return stream
    if _FAKE_RUN is not None:
        return _zero
    return _none


def _none():
    return None


def _zero():
    return 0



@functools.cache
def _hook_holder():
    try:
        from triton import knobs

        return knobs.runtime
    except ImportError:  # older Triton keeps the hooks on CompiledKernel
        from triton.compiler.compiler import CompiledKernel

        return CompiledKernel


def _launch_hooks():
    """Triton's current launch hooks (profilers such as proton install them), passed on like Triton does."""
    rt = _hook_holder()
    return getattr(rt, "launch_enter_hook", None), getattr(rt, "launch_exit_hook", None)


def _no_hooks(enter, leave) -> bool:
    """Whether no launch hook is installed. Recent Triton keeps its hooks in ``HookChain`` objects that
    are never ``None`` (empty ``calls`` when unused); older Triton uses ``None``."""
    return not getattr(enter, "calls", enter) and not getattr(leave, "calls", leave)


class PlanTuning(dict):
    """A ``TUNING`` dict whose every change runs ``on_change`` (dropping the plans built from the old
    settings), so cached plan keys need not carry the settings. Sweeps and tests set entries at run time."""

    def __init__(self, values: dict, on_change):
        super().__init__(values)
        self._on_change = on_change

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._on_change()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._on_change()

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self._on_change()

    def clear(self):
        super().clear()
        self._on_change()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (``triton.cdiv`` is a constexpr function: several times slower
    on the host, and these run on every launch)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``), like ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def warps_for(elems: int, elems_per_thread: int, max_warps: int) -> int:
    """Warps for a program of ``elems`` elements: one more warp per ``32 * elems_per_thread`` elements,
    a power of two in ``[1, max_warps]``."""
    return max(1, min(max_warps, next_pow2(elems // (32 * elems_per_thread))))


def aligned_16(*ts: torch.Tensor | None) -> bool:
    """Whether every given tensor's data pointer is 16-byte aligned (``None`` entries are skipped): the
    ``aligned`` argument of ``Launch`` (Triton compiled the bound kernel for aligned pointers)."""
    bits = 0
    for t in ts:
        if t is not None:
            bits |= t.data_ptr()
    return bits & 15 == 0


def row_stride(t: torch.Tensor) -> int | None:
    """The stride between consecutive rows when ``t (..., N)`` can be addressed as ``(M, N)`` rows with a
    unit column stride and one row stride, else ``None`` (the caller then makes a contiguous copy)."""
    shape, strides = t.shape, t.stride()
    if not shape:
        return 1
    n = shape[-1]
    if n != 1 and strides[-1] != 1:
        return None
    rs = expected = None
    for size, st in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if rs is None:
            rs, expected = st, st * size
        elif st != expected:
            return None
        else:
            expected = st * size
    return max(n, 1) if rs is None else rs


def size_hint(n, fallback: int = 64) -> int:
    """A concrete value of a size that may be symbolic (``torch.compile``), without adding a guard: for
    choosing block or chunk sizes only, never for anything a result depends on."""
    if isinstance(n, int):
        return n
    from torch.fx.experimental import symbolic_shapes as ss

    fn = getattr(ss, "optimization_hint", None) or getattr(ss, "hint_int", None)
    try:
        return int(fn(n, fallback=fallback))
    except Exception:  # no hint (unbacked size): any positive value is correct
        return fallback
