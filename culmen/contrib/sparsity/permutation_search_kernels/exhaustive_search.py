"""Exhaustive channel-permutation search (``Exhaustive_Search``), batched in PyTorch.

Only the partition of the columns into stripes of 4 matters for the 2:4 score (not the order of the
stripes, nor the order inside one), so a search over ``W`` columns tries every *canonical* partition:
``W! / (4!^(W/4) (W/4)!)`` of them (35 for 8 columns, 5775 for 12). Wide matrices are searched by
windows: every combination of ``stripe_group_size / 4`` stripes is one window; each window's best
partition and its gain are kept in a table, the best non-overlapping windows are applied, the windows
touching changed stripes are re-scored, and this repeats until no window gains. ``escape_attempts``
random perturbations are tried once it converges; the best order seen is returned, so the result never
keeps less magnitude than the input order.

A partition's score is the sum of its stripes' scores, so each window scores all ``C(W, 4)`` column
subsets once and every partition is a sum of table entries: one gather + top-2 per subset, on the GPU
when there is one.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import torch
from torch import Tensor

from culmen.contrib.sparsity.permutation_search_kernels.permutation_utilities import (
    GROUP_WIDTH,
    as_search_tensor,
    stripe_scores,
    top2_of_4,
)

__all__ = [
    "Exhaustive_Search",
    "apply_stripe_group_permutation",
    "build_stripe_map",
    "collect_stripes",
    "generate_all_unique_combinations",
    "generate_stripe_groups",
    "generate_unique_combinations",
    "is_canonical",
    "predict_unique_combinations",
    "search_matrix",
    "use_stripe_map",
]

_ELEMENT_BUDGET = 1 << 24  # elements of one batched gather (bounds the search's scratch memory)
_MAX_WHOLE_MATRIX_PARTITIONS = 100_000
_unique_cache: dict[tuple[int, int], list[list[int]]] = {}
_table_cache: dict[tuple[int, str], _WindowTable] = {}


def predict_unique_combinations(C: int, M: int) -> int:
    """Number of canonical partitions of ``C`` columns into groups of ``M``: ``C! / (M!^G G!)``."""
    if C % M:
        raise ValueError(f"C={C} is not a multiple of M={M}")
    g = C // M
    return math.factorial(C) // (math.factorial(M) ** g * math.factorial(g))


def _partitions(columns: list[int], m: int):
    if not columns:
        yield []
        return
    first, rest = columns[0], columns[1:]
    for others in itertools.combinations(rest, m - 1):
        remaining = [c for c in rest if c not in others]
        for tail in _partitions(remaining, m):
            yield [first, *others, *tail]


def generate_all_unique_combinations(C: int, M: int, must_use_all_groups: bool = False) -> list[list[int]]:
    """All canonical column orders of ``C`` columns in groups of ``M`` (sorted inside each group, groups
    sorted by their first column); the identity comes first. Cached per ``(C, M)`` in memory."""
    if (C, M) not in _unique_cache:
        if predict_unique_combinations(C, M) > 10 * _MAX_WHOLE_MATRIX_PARTITIONS:
            raise ValueError(f"{predict_unique_combinations(C, M)} partitions of C={C} columns: too many to list")
        _unique_cache[(C, M)] = list(_partitions(list(range(C)), M))
    return _unique_cache[(C, M)]


class _WindowTable:
    """Index tables for scoring every canonical partition of a ``width``-column window."""

    def __init__(self, width: int, device: torch.device) -> None:
        parts = generate_all_unique_combinations(width, GROUP_WIDTH)
        subsets = list(itertools.combinations(range(width), GROUP_WIDTH))
        where = {s: i for i, s in enumerate(subsets)}
        groups = [[where[tuple(p[k:k + GROUP_WIDTH])] for k in range(0, width, GROUP_WIDTH)] for p in parts]
        self.width = width
        self.subsets = torch.tensor(subsets, dtype=torch.long, device=device)  # (S, 4)
        self.part_groups = torch.tensor(groups, dtype=torch.long, device=device)  # (P, width/4)
        self.partitions = torch.tensor(parts, dtype=torch.long, device=device)  # (P, width)

    def best(self, windows: Tensor) -> tuple[Tensor, Tensor]:
        """``windows`` ``(B, rows, width)`` nonnegative -> (gain of the best partition over the
        identity, index of that partition), each ``(B,)``."""
        b, rows, _ = windows.shape
        s = self.subsets.shape[0]
        chunk = max(1, _ELEMENT_BUDGET // max(1, rows * s * GROUP_WIDTH))
        gains, idx = [], []
        for i in range(0, b, chunk):
            w = windows[i:i + chunk]
            subset_scores = top2_of_4(w[:, :, self.subsets]).sum(1)  # (b, S)
            scores = subset_scores[:, self.part_groups].sum(-1)  # (b, P)
            top, arg = scores.max(1)
            gains.append(top - scores[:, 0])
            idx.append(arg)
        return torch.cat(gains), torch.cat(idx)


def _table(width: int, device: torch.device) -> _WindowTable:
    key = (width, str(device))
    if key not in _table_cache:
        _table_cache[key] = _WindowTable(width, device)
    return _table_cache[key]


def _restore_type(original, absmat_like: Tensor, perm: list[int]):
    """``original[:, perm]`` in ``original``'s own type (numpy in, numpy out)."""
    if isinstance(original, np.ndarray):
        return original[:, perm]
    return torch.as_tensor(original)[:, perm]


def search_matrix(matrix, group_width: int = GROUP_WIDTH):
    """Try every canonical partition of all of ``matrix``'s columns (small matrices only).

    Returns ``(matrix[:, best], seconds, best_permutation, best_improvement)``."""
    if group_width != GROUP_WIDTH:
        raise ValueError(f"group_width={group_width}: only groups of {GROUP_WIDTH} are supported")
    start = time.perf_counter()
    absmat = as_search_tensor(matrix)
    c = absmat.shape[1]
    identity = list(range(c))
    if c % GROUP_WIDTH or predict_unique_combinations(c, GROUP_WIDTH) > _MAX_WHOLE_MATRIX_PARTITIONS:
        return _restore_type(matrix, absmat, identity), time.perf_counter() - start, identity, 0.0
    table = _table(c, absmat.device)
    gain, arg = table.best(absmat[None])
    best = table.partitions[int(arg[0])].tolist() if float(gain[0]) > 0 else identity
    return _restore_type(matrix, absmat, best), time.perf_counter() - start, best, max(float(gain[0]), 0.0)


def _window_columns(groups: Tensor) -> Tensor:
    """Stripe ids ``(B, k)`` -> their column ids ``(B, 4k)``."""
    offs = torch.arange(GROUP_WIDTH, device=groups.device)
    return (groups[:, :, None] * GROUP_WIDTH + offs).reshape(groups.shape[0], -1)


def _windowed_search(absmat: Tensor, window_stripes: int, escape_attempts: int, perm: Tensor,
                     rng: np.random.Generator, threshold: float) -> Tensor:
    """Greedy window search on ``absmat`` (already in the order ``perm``); returns the best order seen."""
    device = absmat.device
    nst = absmat.shape[1] // GROUP_WIDTH
    table = _table(window_stripes * GROUP_WIDTH, device)
    groups = torch.tensor(list(itertools.combinations(range(nst), window_stripes)), dtype=torch.long, device=device)
    gains = torch.zeros(groups.shape[0], device=device)
    best_part = torch.zeros(groups.shape[0], dtype=torch.long, device=device)
    need = torch.ones(groups.shape[0], dtype=torch.bool, device=device)
    cur = absmat.clone()
    best_total = float(stripe_scores(cur).double().sum())
    best_perm = perm.clone()
    escapes = 0
    while True:
        todo = need.nonzero().flatten()
        if todo.numel():
            cols = _window_columns(groups[todo])  # (B, W)
            g, a = table.best(cur[:, cols].permute(1, 0, 2))
            gains[todo], best_part[todo] = g, a
        order = torch.argsort(gains, descending=True)
        positive = order[gains[order] > threshold].tolist()
        groups_cpu = groups.tolist()
        used: set[int] = set()
        applied = 0
        for gi in positive:
            stripes = groups_cpu[gi]
            if used.intersection(stripes):
                continue
            cols = _window_columns(groups[gi:gi + 1])[0]
            new = cols[table.partitions[best_part[gi]]]
            cur[:, cols] = cur[:, new]
            perm[cols] = perm[new]
            used.update(stripes)
            applied += 1
        if not applied:
            if escapes >= escape_attempts:
                break
            # Converged: swap one column between the two halves of a random window to escape.
            escapes += 1
            gi = int(rng.integers(groups.shape[0]))
            cols = _window_columns(groups[gi:gi + 1])[0]
            half = cols.numel() // 2
            src, dst = int(cols[rng.integers(half)]), int(cols[half + rng.integers(half)])
            cur[:, [src, dst]] = cur[:, [dst, src]]
            perm[[src, dst]] = perm[[dst, src]]
            used.update(groups_cpu[gi])
        total = float(stripe_scores(cur).double().sum())
        if total > best_total:
            best_total, best_perm = total, perm.clone()
        used_t = torch.zeros(nst, dtype=torch.bool, device=device)
        used_t[list(used)] = True
        need = used_t[groups].any(1)
    return best_perm


def Exhaustive_Search(matrix, stripe_group_size: int = -1, escape_attempts: int = 0, permutation=None,
                      seed: int | None = None):
    """Search a column order of ``matrix`` ``(rows, C)`` (``C`` a multiple of 4) that keeps more 2:4
    magnitude.

    Args:
        matrix: numpy array or tensor (magnitudes are what count).
        stripe_group_size: columns per search window (8 or 12; wider windows are searched as 12);
            ``-1`` searches the whole matrix at once when it has at most 12 columns, else windows of 8.
        escape_attempts: random perturbations tried after convergence.
        permutation: the order ``matrix`` is already in (list of original column ids); identity if None.
        seed: seed of the perturbations' generator (culmen addition; Apex used the global RNG).

    Returns:
        ``(matrix[:, order], seconds, order)`` where ``order`` maps each new column to its original
        column through ``permutation``.
    """
    start = time.perf_counter()
    absmat = as_search_tensor(matrix)
    c = absmat.shape[1]
    if c % GROUP_WIDTH:
        raise ValueError(f"matrix has {c} channels (dim 1), not a multiple of {GROUP_WIDTH}")
    if stripe_group_size != -1 and (stripe_group_size < 2 * GROUP_WIDTH or stripe_group_size % GROUP_WIDTH):
        raise ValueError(f"stripe_group_size={stripe_group_size} must be -1 or a multiple of "
                         f"{GROUP_WIDTH} that is at least {2 * GROUP_WIDTH}")
    base = list(range(c)) if permutation is None else [int(p) for p in permutation]
    if len(base) != c:
        raise ValueError(f"permutation has {len(base)} entries for {c} columns")
    nst = c // GROUP_WIDTH
    rng = np.random.default_rng(0 if seed is None else seed)
    # Windows wider than 12 columns would need millions of partitions per window: cap them at 12.
    if stripe_group_size == -1:
        window = nst if c <= 3 * GROUP_WIDTH else 2
    else:
        window = min(stripe_group_size // GROUP_WIDTH, 3)
    local = torch.arange(c, device=absmat.device)
    if nst >= 2 and window >= nst:
        _, _, best, _ = search_matrix(absmat, GROUP_WIDTH)
        local = torch.tensor(best, device=absmat.device)
    elif nst >= 2:
        # A zero-gain threshold relative to the matrix scale: float32 noise is not an improvement.
        threshold = 1e-6 * float(stripe_scores(absmat).double().sum()) / nst
        local = _windowed_search(absmat, window, escape_attempts, local, rng, threshold)
    local_list = local.tolist()
    order = [base[i] for i in local_list]
    return _restore_type(matrix, absmat, local_list), time.perf_counter() - start, order


# ---- Apex's step-level helpers of the windowed exhaustive search (``Exhaustive_Search`` above runs the batched
# search; these expose its pieces on numpy matrices). A window ("stripe group") is a sorted tuple of stripes.

def is_canonical(perm: list[int], col: int) -> bool:
    """Whether appending ``col`` to ``perm`` (already canonical: sorted groups of 4, groups ordered by their
    first entry) keeps it canonical."""
    if len(perm) % GROUP_WIDTH == 0:
        # A new group starts with the smallest column not used yet.
        return all(v in perm for v in range(col)) and (not perm or col > perm[-GROUP_WIDTH])
    return col > perm[-1]


def generate_unique_combinations(built_permutation: list[int], remaining_columns: list[int],
                                 full_permutation_list: list, group_width: int) -> None:
    """Append to ``full_permutation_list`` (as numpy arrays) every canonical completion of
    ``built_permutation`` with ``remaining_columns``; both lists are restored on return."""
    if group_width != GROUP_WIDTH:
        raise ValueError(f"group_width={group_width}: only groups of {GROUP_WIDTH} are supported")
    if not remaining_columns:
        full_permutation_list.append(np.array(built_permutation))
        return
    for i in range(len(remaining_columns)):
        col = remaining_columns[i]
        if is_canonical(built_permutation, col):
            built_permutation.append(remaining_columns.pop(i))
            generate_unique_combinations(built_permutation, remaining_columns, full_permutation_list, group_width)
            remaining_columns.insert(i, built_permutation.pop())


def collect_stripes(matrix, stripes, group_width: int) -> np.ndarray:
    """The columns of ``stripes`` (each ``group_width`` wide) of ``matrix`` side by side: float64
    ``(rows, len(stripes) * group_width)``."""
    m = np.asarray(matrix)
    cols = [s * group_width + c for s in stripes for c in range(group_width)]
    return m[:, cols].astype(np.float64)


def apply_stripe_group_permutation(sgp, stripes, group_width: int, permutation: list[int]) -> list[int]:
    """``permutation`` after applying ``sgp`` (a column order of the window ``collect_stripes(..., stripes)``)
    to that window's columns. Returns a new list."""
    out = list(permutation)
    for dst, src in enumerate(sgp):
        d = stripes[dst // group_width] * group_width + dst % group_width
        s = stripes[int(src) // group_width] * group_width + int(src) % group_width
        out[d] = permutation[s]
    return out


def generate_stripe_groups(num_stripes: int, window_size: int) -> set[tuple[int, ...]]:
    """Every window of ``window_size`` distinct stripes out of ``num_stripes``, as sorted tuples."""
    return set(itertools.combinations(range(num_stripes), window_size))


def build_stripe_map(matrix, group_width: int, window_size: int, stripe_map: list, stripe_ids: list, perm_map: list,
                     used_stripes) -> tuple[list, list, list]:
    """Fill or refresh the table of windows (``window_size`` columns each) with their best partition's gain
    (``stripe_map``), stripes (``stripe_ids``) and column order (``perm_map``): new windows are searched, and
    windows touching ``used_stripes`` re-searched. Returns the three lists, updated."""
    if group_width != GROUP_WIDTH:
        raise ValueError(f"group_width={group_width}: only groups of {GROUP_WIDTH} are supported")
    stripes_per_window = window_size // group_width
    num_stripes = matrix.shape[1] // group_width
    if num_stripes * group_width != matrix.shape[1] or stripes_per_window < 1:
        raise ValueError(f"matrix width {matrix.shape[1]} / window {window_size} do not fit stripes of {group_width}")
    used = {int(s) for s in used_stripes}
    for i, window in enumerate(sorted(generate_stripe_groups(num_stripes, stripes_per_window))):
        new = i >= len(stripe_map)
        if new:
            stripe_ids.append(list(window))
            stripe_map.append(0.0)
            perm_map.append(list(range(window_size)))
        if new or used.intersection(window):
            _, _, perm, gain = search_matrix(collect_stripes(matrix, window, group_width), group_width)
            stripe_map[i], perm_map[i] = gain, list(perm)
    return stripe_map, stripe_ids, perm_map


def use_stripe_map(matrix, group_width: int, stripe_map: list, stripe_ids: list, perm_map: list,
                   permutation: list[int]):
    """Apply the windows' best partitions, largest gain first, skipping windows that share a stripe with one
    already applied, while the gain is positive. ``matrix`` (numpy) is updated in place.

    Returns ``(matrix, stripe_groups_optimized, stripe_map, stripe_ids, used_stripes, improvement, permutation)``;
    ``used_stripes`` lists the stripes whose contents changed."""
    used_stripes: list[int] = []
    touched: set[int] = set()
    optimized, improvement = 0, 0.0
    for k in np.argsort(stripe_map, kind="stable")[::-1]:
        if stripe_map[k] <= 1e-12:
            break
        window = stripe_ids[k]
        if touched.intersection(window):
            continue
        perm = [int(p) for p in perm_map[k]]
        sub = collect_stripes(matrix, window, group_width)[:, perm]
        permutation = apply_stripe_group_permutation(perm, window, group_width, permutation)
        for s, stripe in enumerate(window):
            group = perm[s * group_width:(s + 1) * group_width]
            if group != list(range(group[0], group[0] + group_width)) or group[0] % group_width:
                used_stripes.append(stripe)
            matrix[:, stripe * group_width:(stripe + 1) * group_width] = sub[:, s * group_width:(s + 1) * group_width]
        touched.update(window)
        improvement += stripe_map[k]
        optimized += 1
    return matrix, optimized, stripe_map, stripe_ids, used_stripes, improvement, permutation
