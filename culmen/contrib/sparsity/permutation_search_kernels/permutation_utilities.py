"""Shared pieces of the channel-permutation searches: the 2:4 kept-magnitude score and its batched
forms, in PyTorch (on the GPU when there is one, so no compiled extension is needed).

A permutation reorders the input channels (columns) of a weight matrix ``(rows, C)``; the score of an
order is the magnitude a 2:4 mask keeps, i.e. per row and per group ("stripe") of 4 consecutive
columns, the two largest ``|w|``. The searches only move columns between stripes, since the order
inside a stripe does not change its score.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "apply_2_to_4",
    "as_search_tensor",
    "common_groups",
    "dictify",
    "efficacy",
    "find_permutation",
    "group_differences",
    "magnitude_after_pruning_rows",
    "make_grouped",
    "move_groups_to_match",
    "move_permutation_towards",
    "permutation_distance",
    "remove_common_groups",
    "swap_and_correct",
    "try_permutations_on_matrix",
    "unstructured_prune",
    "stripe_scores",
    "sum_after_2_to_4",
    "top2_of_4",
    "try_swap",
    "use_gpu",
]

GROUP_WIDTH = 4  # the searches target N:4 sparsity, as Apex's do


def use_gpu(initial_override: bool = True) -> bool:
    """Whether the searches run on the GPU (CUDA available and not overridden off)."""
    return bool(initial_override) and torch.cuda.is_available()


def search_device() -> torch.device:
    return torch.device("cuda") if use_gpu() else torch.device("cpu")


def as_search_tensor(matrix: Tensor | np.ndarray, device: torch.device | None = None) -> Tensor:
    """``|matrix|`` as a float32 tensor on the search device (magnitudes are all the searches need)."""
    t = torch.as_tensor(matrix).detach()
    if t.dim() != 2:
        raise ValueError(f"matrix must be 2-D (rows, channels), got shape {tuple(t.shape)}")
    return t.to(device or search_device(), torch.float32).abs()


def top2_of_4(x: Tensor) -> Tensor:
    """Sum of the two largest of the last dimension (size 4) of ``x``."""
    # A sorting network on the 4 lanes: cheaper than topk for this tiny fixed width.
    a, b, c, d = x.unbind(-1)
    hi1, lo1 = torch.maximum(a, b), torch.minimum(a, b)
    hi2, lo2 = torch.maximum(c, d), torch.minimum(c, d)
    return torch.maximum(hi1, hi2) + torch.maximum(torch.minimum(hi1, hi2), torch.maximum(lo1, lo2))


def stripe_scores(absmat: Tensor) -> Tensor:
    """Per-stripe kept magnitude of a nonnegative ``(rows, C)`` matrix: float32 ``(C // 4,)``."""
    rows, c = absmat.shape
    return top2_of_4(absmat.reshape(rows, c // GROUP_WIDTH, GROUP_WIDTH)).sum(0)


def _check_width(matrix: Tensor | np.ndarray) -> None:
    if matrix.shape[1] % GROUP_WIDTH:
        raise ValueError(f"matrix has {matrix.shape[1]} channels (dim 1), not a multiple of {GROUP_WIDTH}")


def sum_after_2_to_4(matrix: Tensor | np.ndarray) -> float:
    """Magnitude kept by a 2:4 mask of ``matrix`` ``(rows, C)``, ``C`` a multiple of 4 (float64 sum)."""
    _check_width(matrix)
    t = torch.as_tensor(matrix).detach()
    groups = t.reshape(-1, GROUP_WIDTH).abs().to(torch.float64)
    return float(top2_of_4(groups).sum())


def apply_2_to_4(matrix: Tensor | np.ndarray) -> Tensor | np.ndarray:
    """Zero the two smallest magnitudes of every group of 4 columns of ``matrix`` in place; returns it."""
    _check_width(matrix)
    t = torch.as_tensor(matrix)  # shares memory with a numpy array
    groups = t.view(-1, GROUP_WIDTH) if t.is_contiguous() else t.reshape(-1, GROUP_WIDTH)
    drop = torch.topk(groups.abs(), 2, dim=1, largest=False).indices
    groups.scatter_(1, drop, 0)
    if not t.is_contiguous():
        t.copy_(groups.view(t.shape))
    return matrix


def try_swap(matrix: Tensor | np.ndarray, dst: int, src: int) -> tuple[float, float]:
    """Score change of swapping columns ``src`` and ``dst``: returns ``(new score of the two stripes,
    improvement)``. ``matrix`` is left unchanged."""
    t = torch.as_tensor(matrix).detach()
    s0, s1 = src // GROUP_WIDTH, dst // GROUP_WIDTH
    cols = sorted({s0, s1})
    before = sum(sum_after_2_to_4(t[:, s * GROUP_WIDTH:(s + 1) * GROUP_WIDTH]) for s in cols)
    swapped = t.clone()
    swapped[:, [src, dst]] = swapped[:, [dst, src]]
    after = sum(sum_after_2_to_4(swapped[:, s * GROUP_WIDTH:(s + 1) * GROUP_WIDTH]) for s in cols)
    return after, after - before


def find_permutation(A: Tensor | np.ndarray, B: Tensor | np.ndarray) -> list[int]:
    """The column order ``p`` with ``A[:, j] == B[:, p[j]]`` (first match for repeated columns)."""
    a, b = torch.as_tensor(A), torch.as_tensor(B)
    eq = (a.t()[:, None, :] == b.t()[None, :, :]).all(-1)  # (colsA, colsB)
    if not bool(eq.any(1).all()):
        raise ValueError("A and B do not hold the same columns")
    return [int(i) for i in eq.to(torch.int8).argmax(1)]


def permutation_gain(matrix: Tensor | np.ndarray, permutation: list[int]) -> float:
    """Kept 2:4 magnitude of ``matrix[:, permutation]`` minus that of ``matrix`` (float64)."""
    t = torch.as_tensor(matrix).detach()
    return sum_after_2_to_4(t[:, list(permutation)]) - sum_after_2_to_4(t)


# ---- Apex's analysis helpers (pruning statistics, permutation distance). Permutations here are flat lists of
# column indices read in groups of 4 (one group per stripe); two permutations with the same set of groups prune
# the same way.

def unstructured_prune(matrix: np.ndarray, sparsity: float) -> np.ndarray:
    """A copy of ``matrix`` with its ``int(numel * sparsity)`` smallest entries set to 0 (by value, as Apex's;
    the searches pass magnitudes, so this is magnitude pruning there)."""
    if not 0.0 <= float(sparsity) <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity!r}")
    flat = np.array(matrix, copy=True).reshape(-1)
    flat[np.argsort(flat, kind="stable")[: int(flat.size * sparsity)]] = 0
    return flat.reshape(np.shape(matrix))


def efficacy(optimal_lost_magnitude: float, base_lost_magnitude: float, cur_lost_magnitude: float) -> float:
    """How much of the possible gain a permutation achieved: ``(base - cur) / (base - optimal)`` of the lost
    magnitudes (1.0 when the base order is already optimal)."""
    if base_lost_magnitude == optimal_lost_magnitude:
        return 1.0
    return (base_lost_magnitude - cur_lost_magnitude) / (base_lost_magnitude - optimal_lost_magnitude)


def magnitude_after_pruning_rows(matrix, rate: float = 0.5) -> float:
    """Magnitude kept if each row of ``matrix`` ``(rows, C)`` dropped its ``int(C * rate)`` smallest ``|w|``
    without structure (the upper bound any N:M pattern can reach)."""
    a = np.sort(np.abs(np.asarray(matrix, dtype=np.float64)), axis=1)
    return float(a[:, int(a.shape[1] * rate):].sum())


def try_permutations_on_matrix(matrix, permutations) -> tuple[float, list[int]]:
    """The best of ``permutations`` (column orders of ``matrix`` ``(rows, C)``) by kept 2:4 magnitude:
    ``(improvement over the given order, that permutation)`` (``(0.0, first permutation)`` when none gains).
    Batched on the search device (Apex: a CUDA kernel)."""
    perms = [list(map(int, p)) for p in permutations]
    if not perms:
        raise ValueError("permutations must not be empty")
    absmat = as_search_tensor(matrix)
    base = float(stripe_scores(absmat).double().sum())
    idx = torch.as_tensor(perms, device=absmat.device)
    scores = torch.stack([stripe_scores(absmat[:, p]).double().sum() for p in idx])
    best = int(torch.argmax(scores))
    gain = float(scores[best]) - base
    return (gain, perms[best]) if gain > 0 else (0.0, perms[0])


def make_grouped(A) -> list[np.ndarray]:
    """``A`` split into consecutive groups of 4, each sorted (a permutation's stripes, in canonical form)."""
    a = np.asarray(A)
    if a.size % GROUP_WIDTH:
        raise ValueError(f"permutation length {a.size} is not a multiple of {GROUP_WIDTH}")
    return [np.sort(a[i:i + GROUP_WIDTH]) for i in range(0, a.size, GROUP_WIDTH)]


def _group_set(A) -> set[tuple[int, ...]]:
    return {tuple(int(v) for v in g) for g in make_grouped(A)}


def _flatten(groups) -> list[int]:
    return [int(v) for g in groups for v in g]


def common_groups(A, B) -> list[np.ndarray]:
    """The groups (stripes) ``A`` and ``B`` share, sorted, in ``make_grouped`` form."""
    return make_grouped(_flatten(sorted(_group_set(A) & _group_set(B))))


def remove_common_groups(A, B) -> tuple[list[int], list[int]]:
    """``A`` and ``B`` without their shared groups, each as a flat list of its remaining groups (sorted)."""
    ga, gb = _group_set(A), _group_set(B)
    return _flatten(sorted(ga - gb)), _flatten(sorted(gb - ga))


def group_differences(A, B) -> list[tuple[int, int, int]]:
    """Entries of ``B`` in the wrong group relative to ``A``: ``(value, group of B, group of A holding it)``
    for every value of ``B``'s group ``g`` that ``A``'s group ``g`` lacks."""
    ga, gb = make_grouped(A), make_grouped(B)
    where = {int(v): i for i, g in enumerate(ga) for v in g}
    return [(int(v), g, where[int(v)]) for g, grp in enumerate(gb) for v in grp if where[int(v)] != g]


def dictify(wrong_entries) -> dict[tuple[int, int], list[int]]:
    """``group_differences``' entries keyed by ``(current group, desired group)`` -> values."""
    out: dict[tuple[int, int], list[int]] = {}
    for val, cur, want in wrong_entries:
        out.setdefault((cur, want), []).append(val)
    return out


def move_groups_to_match(B, A, debug: bool = False) -> list[int]:
    """``B`` with its groups reordered (contents unchanged) so each sits in the slot of the ``A`` group it
    overlaps most (greedy, largest overlaps first; leftovers fill free slots in order). Flat list."""
    ga, gb = make_grouped(A), make_grouped(B)
    if len(ga) != len(gb):
        raise ValueError(f"A and B have different lengths ({4 * len(ga)} vs {4 * len(gb)})")
    overlap = sorted(((len(set(b.tolist()) & set(a.tolist())), -i, -j) for i, b in enumerate(gb)
                      for j, a in enumerate(ga)), reverse=True)
    slot: dict[int, int] = {}
    taken: set[int] = set()
    for n, mi, mj in overlap:
        i, j = -mi, -mj
        if n and i not in slot and j not in taken:
            slot[i] = j
            taken.add(j)
    free = iter(j for j in range(len(ga)) if j not in taken)
    for i in range(len(gb)):
        if i not in slot:
            slot[i] = next(free)
    out = [None] * len(gb)
    for i, j in slot.items():
        out[j] = gb[i]
    if debug:
        print(f"move_groups_to_match: B group -> slot {slot}")
    return _flatten(out)


def swap_and_correct(permutation, src: int, tgt: int) -> list[int]:
    """Swap entries ``src`` and ``tgt`` of ``permutation`` (in place, as Apex's) and return it in canonical
    grouped form (each group sorted)."""
    permutation[src], permutation[tgt] = permutation[tgt], permutation[src]
    return _flatten(make_grouped(permutation))


def move_permutation_towards(B, A, debug: bool = False) -> list[int]:
    """One swap that brings ``B``'s grouping closer to ``A``'s: after ``move_groups_to_match``, a value in the
    wrong group trades places with a value of its desired group that does not belong there (at least one
    more entry in place; two when they complement each other, which is preferred). ``B`` unchanged (grouped)
    when the groupings already agree."""
    b = move_groups_to_match(B, A, debug)
    wrong = group_differences(A, b)
    if not wrong:
        return _flatten(make_grouped(b))
    pos = {v: i for i, v in enumerate(b)}
    for val, cur, want in wrong:  # a complementary pair fixes two entries with one swap
        for val2, cur2, want2 in wrong:
            if cur2 == want and want2 == cur:
                return swap_and_correct(b, pos[val], pos[val2])
    val, cur, want = wrong[0]
    val2 = next(v for v, c, _ in wrong if c == want)
    if debug:
        print(f"move_permutation_towards: swap {val} (group {cur}) with {val2} (group {want})")
    return swap_and_correct(b, pos[val], pos[val2])


def permutation_distance(A, B, matrix=None, magnitude_targets=None, debug: bool = False,
                         verbosity: int = 0) -> tuple[int, list | None]:
    """Number of ``move_permutation_towards`` swaps taking ``B``'s grouping to ``A``'s.

    With ``magnitude_targets`` (needs ``matrix`` ``(rows, C)``): for each target kept-magnitude, the
    ``(magnitude, permutation)`` on the path from ``A`` to ``B`` whose 2:4 magnitude is closest to it (Apex uses
    this to sample permutations between two others); otherwise ``None``. Returns ``(swaps, target_results)``.
    """
    if magnitude_targets is not None and matrix is None:
        raise ValueError("magnitude_targets needs matrix")
    a = _flatten(make_grouped(A))
    b = _flatten(make_grouped(B))
    path = [list(b)]
    swaps = 0
    while _group_set(a) != _group_set(b):
        b = move_permutation_towards(b, a, debug)
        swaps += 1
        path.append(list(b))
        if swaps > len(a):  # each swap puts at least one more entry in place
            raise RuntimeError("permutation_distance did not converge")
    results = None
    if magnitude_targets is not None:
        mags = [sum_after_2_to_4(np.asarray(matrix)[:, p]) for p in [a] + path]
        cands = list(zip(mags, [a] + path))
        results = [min(cands, key=lambda mp, t=t: abs(mp[0] - t)) for t in magnitude_targets]
        if verbosity > 0:
            for i, (m, _) in enumerate(cands):
                print(f"swap {i:>4} {m:>15.3f}")
    return swaps, results
