"""Where the host time of a cached culmen LayerNorm fwd+bwd goes, by difference: the same call with its
kernel launches stubbed out, then also its allocations served from a cache, against PyTorch's.

Run on the GPU machine: ``python scripts/host_breakdown.py``. Prints µs per call (median of 7 runs of
300 back-to-back calls at a tiny shape, where the GPU never limits the host).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "scripts")
from host_probe import fwd_bwd, host_us, ln_inputs  # noqa: E402

from culmen.ops.common import launch as launch_mod  # noqa: E402
from culmen.ops.layer_norm import launch as ln_launch  # noqa: E402
from culmen.ops.layer_norm import layer_norm  # noqa: E402


def main() -> None:
    N = 1024
    x, w, b, g = ln_inputs(64, N)
    rows = []
    fb_torch = fwd_bwd(lambda: F.layer_norm(x, (N,), w, b), [x, w, b], g)
    fb_culmen = fwd_bwd(lambda: layer_norm(x, w, b).y, [x, w, b], g)

    def fwd_grad_culmen():
        return layer_norm(x, w, b).y

    def fwd_nograd_culmen():
        with torch.no_grad():
            return layer_norm(x, w, b).y

    def fwd_nograd_torch():
        with torch.no_grad():
            return F.layer_norm(x, (N,), w, b)

    for name, fn in (("torch fwd no-grad", fwd_nograd_torch), ("culmen fwd no-grad", fwd_nograd_culmen),
                     ("torch fwd grad", lambda: F.layer_norm(x, (N,), w, b)), ("culmen fwd grad", fwd_grad_culmen),
                     ("torch fwd+bwd", fb_torch), ("culmen fwd+bwd", fb_culmen)):
        rows.append((name, host_us(fn)))

    real_call = launch_mod.Launch.__call__
    launch_mod.Launch.__call__ = lambda self, stream, aligned, *args: None
    try:
        rows.append(("culmen fwd no-grad, launches stubbed", host_us(fwd_nograd_culmen)))
        rows.append(("culmen fwd grad, launches stubbed", host_us(fwd_grad_culmen)))
        rows.append(("culmen fwd+bwd, launches stubbed", host_us(fb_culmen)))
        cache: dict = {}
        real_empty = torch.empty

        def cached_empty(shape, dtype=None, device=None):
            key = (tuple(shape), dtype)
            t = cache.get(key)
            if t is None:
                t = cache[key] = real_empty(shape, dtype=dtype, device=device)
            return t

        def cached_empty_like(t):
            return cached_empty(t.shape, dtype=t.dtype, device=t.device)

        ln_launch.torch = type("T", (), {"empty": staticmethod(cached_empty), "float32": torch.float32,
                                         "empty_like": staticmethod(cached_empty_like), "bool": torch.bool})
        try:
            rows.append(("culmen fwd no-grad, launches+allocs stubbed", host_us(fwd_nograd_culmen)))
            rows.append(("culmen fwd grad, launches+allocs stubbed", host_us(fwd_grad_culmen)))
            rows.append(("culmen fwd+bwd, launches+allocs stubbed", host_us(fb_culmen)))
        finally:
            ln_launch.torch = torch
    finally:
        launch_mod.Launch.__call__ = real_call
    for name, us in rows:
        print(f"{name:48s} {us:9.2f}")


if __name__ == "__main__":
    main()
