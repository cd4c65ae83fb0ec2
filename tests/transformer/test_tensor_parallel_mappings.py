"""``culmen.transformer.tensor_parallel.mappings`` on 2 and 4 gloo ranks (one tensor-parallel group).

Rank ``r`` feeds ``x * (r + 1)`` and back-propagates ``g * (r + 1)`` (``x``, ``g`` the same integer-valued
tensors on every rank, so results are exact),
so the expected forward values and gradients of every collective are written here from the definitions:
sums over ranks, concatenations in rank order and rank ``r``'s chunk. Odd per-rank sizes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402


def _mappings_worker(rank: int, world: int) -> list[str]:
    import torch

    from culmen.transformer import parallel_state as ps
    from culmen.transformer import tensor_parallel as tpl

    ps.initialize_model_parallel(world)
    failures: list[str] = []
    scales = [float(r + 1) for r in range(world)]
    me = scales[rank]
    total = sum(scales)

    def check(name, got, want):
        if got.shape != want.shape or not torch.equal(got, want):
            err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
            failures.append(f"rank {rank} {name}: got {tuple(got.shape)} want {tuple(want.shape)} err {err}")

    torch.manual_seed(7)
    s_local, b, h_local = 3, 2, 5  # odd chunk sizes
    s, h = s_local * world, h_local * world

    def rand(*shape):  # integer-valued: sums over ranks are exact in any order
        return torch.randint(-50, 50, shape).double()

    x = rand(s, b, h)
    g_full = rand(s, b, h)
    g_last = rand(s, b, h_local)  # gradient of a last-dim chunk
    g_first = rand(s_local, b, h)  # gradient of a first-dim chunk
    last = slice(rank * h_local, (rank + 1) * h_local)
    first = slice(rank * s_local, (rank + 1) * s_local)

    def run(fn, inp, grad, *args):
        leaf = inp.clone().requires_grad_()
        out = fn(leaf * 1.0, *args)  # a non-leaf: reduce_from all-reduces its input in place
        out.backward(grad)
        return out.detach(), leaf.grad

    # copy_to: identity; gradient summed over ranks.
    out, dx = run(tpl.copy_to_tensor_model_parallel_region, x * me, g_full * me)
    check("copy_to fwd", out, x * me)
    check("copy_to bwd", dx, g_full * total)

    # reduce_from: sum over ranks; gradient unchanged.
    out, dx = run(tpl.reduce_from_tensor_model_parallel_region, x * me, g_full * me)
    check("reduce_from fwd", out, x * total)
    check("reduce_from bwd", dx, g_full * me)

    # scatter_to (last dim): own chunk; gradient = every rank's chunk gradient concatenated.
    out, dx = run(tpl.scatter_to_tensor_model_parallel_region, x * me, g_last * me)
    check("scatter_to fwd", out, (x * me)[..., last])
    check("scatter_to bwd", dx, torch.cat([g_last * c for c in scales], dim=-1))

    # gather_from (last dim): concatenation of the ranks' tensors; gradient = own chunk.
    xl = x[..., :h_local]
    out, dx = run(tpl.gather_from_tensor_model_parallel_region, xl * me, g_full * me)
    check("gather_from fwd", out, torch.cat([xl * c for c in scales], dim=-1))
    check("gather_from bwd", dx, (g_full * me)[..., last])

    # scatter_to_sequence (first dim).
    out, dx = run(tpl.scatter_to_sequence_parallel_region, x * me, g_first * me)
    check("scatter_seq fwd", out, (x * me)[first])
    check("scatter_seq bwd", dx, torch.cat([g_first * c for c in scales], dim=0))

    # gather_from_sequence: forward concatenates along the sequence; backward reduce-scatters
    # (to_model_parallel=True) or keeps own rows (False).
    xs = x[:s_local]
    out, dx = run(tpl.gather_from_sequence_parallel_region, xs * me, g_full * me)
    check("gather_seq fwd", out, torch.cat([xs * c for c in scales], dim=0))
    check("gather_seq bwd", dx, (g_full * total)[first])
    out, dx = run(tpl.gather_from_sequence_parallel_region, xs * me, g_full * me, False)
    check("gather_seq(to_model_parallel=False) bwd", dx, (g_full * me)[first])

    # reduce_scatter_to_sequence: own rows of the sum; backward all-gathers.
    out, dx = run(tpl.reduce_scatter_to_sequence_parallel_region, x * me, g_first * me)
    check("reduce_scatter_seq fwd", out, (x * total)[first])
    check("reduce_scatter_seq bwd", dx, torch.cat([g_first * c for c in scales], dim=0))

    # copy_to's backward must not touch a gradient that autograd also hands to another branch.
    leaf = x.clone().requires_grad_()
    y = tpl.copy_to_tensor_model_parallel_region(leaf * 1.0)
    other = leaf * 1.0
    (y + other).backward(g_full)
    check("copy_to shared-gradient branch", leaf.grad, g_full * world + g_full)

    # Sizes that do not divide by the TP size: ValueError naming both numbers.
    for name, fn, bad in (("scatter_to", tpl.scatter_to_tensor_model_parallel_region, torch.zeros(2, h + 1)),
                          ("scatter_seq", tpl.scatter_to_sequence_parallel_region, torch.zeros(s + 1, 2)),
                          ("reduce_scatter_seq", tpl.reduce_scatter_to_sequence_parallel_region,
                           torch.zeros(s + 1, 2))):
        n = bad.shape[-1] if name == "scatter_to" else bad.shape[0]
        try:
            fn(bad)
            failures.append(f"rank {rank} {name}: no error for size {n}")
        except ValueError as e:
            if str(n) not in str(e) or str(world) not in str(e):
                failures.append(f"rank {rank} {name}: message lacks {n} / {world}: {e}")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_mappings_forward_backward(world):
    results = run_group(_mappings_worker, world)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)
