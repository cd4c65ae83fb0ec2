"""Low-overhead Triton launches.

``kernel[grid](*args, **constexprs)`` re-binds and re-specializes every argument on every call; with
the 40-50 arguments of a fused kernel that costs tens of microseconds of host time, which on a slow
host is more than a memory-bound kernel takes on the GPU. ``FastLauncher`` keeps the compiled kernel
of each specialization and calls it directly.

The cache key is a superset of what Triton specializes on (argument dtypes, 16-byte alignment of
pointers, integers equal to 1 / divisible by 16 / fitting in 32 bits, which pointers are ``None``,
constexpr values, warps, stages) plus the current device, so a cached kernel is only reused for
arguments it was compiled for. Launch hooks (profilers) are passed on as Triton passes them. The
first call of each key, the interpreter and any error take Triton's normal path;
``CULMEN_FAST_LAUNCH=0`` turns the fast path off.
"""

from __future__ import annotations

import functools
import os

import torch

_I32 = 2**31


def _spec(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, -_I32 <= a < _I32)
    return type(a)


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


class FastLauncher:
    """Launch ``kernel`` with its non-constexpr ``args`` (signature order) and constexpr ``meta``."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.cache: dict = {}
        self.disabled = False
        self.error: str | None = None  # why the fast path was turned off, for diagnosis

    def _fast_ok(self) -> bool:
        if self.disabled or os.environ.get("CULMEN_FAST_LAUNCH", "1") == "0":
            return False
        return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

    def __call__(self, grid, args: tuple, meta: dict, num_warps: int, num_stages: int = 3) -> None:
        if not self._fast_ok():
            self.kernel[grid](*args, **meta, num_warps=num_warps, num_stages=num_stages)
            return
        # A compiled kernel's function handle belongs to one device's context.
        key = (torch.cuda.current_device(), tuple(meta.values()), num_warps, num_stages, *map(_spec, args))
        entry = self.cache.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **meta, num_warps=num_warps, num_stages=num_stages)
            names = self.kernel.arg_names[len(args):]
            if compiled is not None and set(names) == set(meta):
                self.cache[key] = (compiled, tuple(meta[n] for n in names))
            else:
                self.error = f"cannot map constexprs {names} to {list(meta)}"
            return
        compiled, const_vals = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch.cuda.current_stream().cuda_stream
        try:
            enter, leave = _launch_hooks()
            metadata = compiled.launch_metadata(grid, stream, *args, *const_vals) if enter is not None else None
            compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave,
                         *args, *const_vals)
        except Exception as e:
            # An API change in Triton: fall back for good rather than guess.
            self.disabled = True
            self.error = f"{type(e).__name__}: {e}"
            self.kernel[grid](*args, **meta, num_warps=num_warps, num_stages=num_stages)
