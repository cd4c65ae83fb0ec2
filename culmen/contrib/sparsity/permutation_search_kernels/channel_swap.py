"""Channel-swap permutation searches (``Channel_Swap`` and the progressive random variant), batched
in PyTorch.

For a pair of stripes (groups of 4 columns) there are 16 single-column swaps between them; the gain of
each is the change of the two stripes' 2:4 scores. ``Channel_Swap`` scores every swap of every stripe
pair, applies the best non-overlapping ones (each stripe at most once per round), re-scores the pairs
that touch changed stripes and repeats until no swap gains; ``escape_attempts`` random swaps are tried
after convergence. ``progressive_channel_swap`` scores random batches of stripe pairs until a time limit
(or until it has seen every pair without a gain). Both return the best order seen, so they never keep
less magnitude than the input order.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor

from culmen.contrib.sparsity.permutation_search_kernels.permutation_utilities import (
    GROUP_WIDTH,
    as_search_tensor,
    stripe_scores,
    top2_of_4,
    try_swap,
)

__all__ = ["Channel_Swap", "build_stripe_pairs", "build_swap_map", "columns_to_stripes_and_swap_idx",
           "compute_swap_map", "progressive_channel_swap", "stripes_and_swap_idx_to_columns", "swap_gains", "try_swap",
           "use_swap_map"]

_ELEMENT_BUDGET = 1 << 24


def swap_gains(absmat: Tensor, pairs: Tensor, base: Tensor) -> Tensor:
    """Gain of each of the 16 column swaps between stripes ``pairs[:, 0]`` and ``pairs[:, 1]``.

    Args:
        absmat: nonnegative ``(rows, C)``.
        pairs: int64 ``(P, 2)`` stripe ids.
        base: per-stripe scores ``(C // 4,)`` of ``absmat``.
    Returns:
        ``(P, 4, 4)``: entry ``[p, i, j]`` is the gain of swapping column ``i`` of the first stripe with
        column ``j`` of the second.
    """
    rows = absmat.shape[0]
    stripes = absmat.reshape(rows, -1, GROUP_WIDTH)
    ii = torch.arange(GROUP_WIDTH, device=absmat.device)[:, None].expand(GROUP_WIDTH, GROUP_WIDTH)
    jj = ii.t()
    chunk = max(1, _ELEMENT_BUDGET // max(1, rows * GROUP_WIDTH ** 3))
    out = []
    for k in range(0, pairs.shape[0], chunk):
        pr = pairs[k:k + chunk]
        a = stripes[:, pr[:, 0]].permute(1, 0, 2)  # (p, rows, 4)
        b = stripes[:, pr[:, 1]].permute(1, 0, 2)
        shape = (a.shape[0], rows, GROUP_WIDTH, GROUP_WIDTH, GROUP_WIDTH)
        a_new = a[:, :, None, None, :].expand(shape).clone()
        b_new = b[:, :, None, None, :].expand(shape).clone()
        # swap (i, j): a's column i takes b's column j, and b's column j takes a's column i.
        a_new[:, :, ii, jj, ii] = b[:, :, jj]
        b_new[:, :, ii, jj, jj] = a[:, :, ii]
        gain = top2_of_4(a_new).sum(1) + top2_of_4(b_new).sum(1)
        out.append(gain - (base[pr[:, 0]] + base[pr[:, 1]])[:, None, None])
    return torch.cat(out) if out else absmat.new_zeros(0, GROUP_WIDTH, GROUP_WIDTH)


def _apply_best(cur: Tensor, perm: Tensor, pairs_cpu: list[list[int]], gains: Tensor, threshold: float,
                used: set[int]) -> int:
    """Apply the best swap of each pair, best pairs first, each stripe at most once. Returns the count."""
    flat = gains.reshape(gains.shape[0], -1)
    best, arg = flat.max(1)
    order = torch.argsort(best, descending=True)
    keep = order[best[order] > threshold].tolist()
    args = arg.tolist()
    applied = 0
    for p in keep:
        s0, s1 = pairs_cpu[p]
        if s0 in used or s1 in used:
            continue
        i, j = divmod(args[p], GROUP_WIDTH)
        src, dst = s0 * GROUP_WIDTH + i, s1 * GROUP_WIDTH + j
        cur[:, [src, dst]] = cur[:, [dst, src]]
        perm[[src, dst]] = perm[[dst, src]]
        used.update((s0, s1))
        applied += 1
    return applied


def _finish(matrix, local: Tensor, base: list[int], start: float):
    local_list = local.tolist()
    result = matrix[:, local_list] if isinstance(matrix, np.ndarray) else torch.as_tensor(matrix)[:, local_list]
    return result, time.perf_counter() - start, [base[i] for i in local_list]


def _prepare(matrix, permutation) -> tuple[Tensor, list[int], int, Tensor]:
    absmat = as_search_tensor(matrix)
    c = absmat.shape[1]
    if c % GROUP_WIDTH:
        raise ValueError(f"matrix has {c} channels (dim 1), not a multiple of {GROUP_WIDTH}")
    base = list(range(c)) if permutation is None else [int(p) for p in permutation]
    if len(base) != c:
        raise ValueError(f"permutation has {len(base)} entries for {c} columns")
    # The searches' state: stripes of GROUP_WIDTH columns, and the order found so far (identity to start).
    return absmat, base, c // GROUP_WIDTH, torch.arange(c, device=absmat.device)


def Channel_Swap(matrix, escape_attempts: int = 0, verbosity: int = 0, permutation=None, seed: int | None = None):
    """Greedy channel-swap search on ``matrix`` ``(rows, C)``.

    Returns ``(matrix[:, order], seconds, order)`` with ``order`` in terms of ``permutation`` (the order
    ``matrix`` is already in; identity if None). ``seed`` seeds the escape swaps (culmen addition)."""
    start = time.perf_counter()
    absmat, base, nst, local = _prepare(matrix, permutation)
    if nst < 2:
        return _finish(matrix, local, base, start)
    rng = np.random.default_rng(0 if seed is None else seed)
    cur = absmat.clone()
    pairs = torch.triu_indices(nst, nst, 1, device=absmat.device).t().contiguous()
    pairs_cpu = pairs.tolist()
    gains = torch.zeros(pairs.shape[0], GROUP_WIDTH, GROUP_WIDTH, device=absmat.device)
    need = torch.ones(pairs.shape[0], dtype=torch.bool, device=absmat.device)
    threshold = 1e-6 * float(stripe_scores(absmat).double().sum()) / nst
    best_total, best_local = float(stripe_scores(cur).double().sum()), local.clone()
    escapes, rounds = 0, 0
    while True:
        todo = need.nonzero().flatten()
        if todo.numel():
            gains[todo] = swap_gains(cur, pairs[todo], stripe_scores(cur))
        used: set[int] = set()
        applied = _apply_best(cur, local, pairs_cpu, gains, threshold, used)
        rounds += 1
        if not applied:
            if escapes >= escape_attempts:
                break
            escapes += 1
            s0, s1 = pairs_cpu[int(rng.integers(len(pairs_cpu)))]
            src = s0 * GROUP_WIDTH + int(rng.integers(GROUP_WIDTH))
            dst = s1 * GROUP_WIDTH + int(rng.integers(GROUP_WIDTH))
            cur[:, [src, dst]] = cur[:, [dst, src]]
            local[[src, dst]] = local[[dst, src]]
            used.update((s0, s1))
        total = float(stripe_scores(cur).double().sum())
        if total > best_total:
            best_total, best_local = total, local.clone()
        if verbosity > 10:
            print(f"[Channel_Swap] round {rounds}: {applied} swaps, kept magnitude {total:.4f}")
        used_t = torch.zeros(nst, dtype=torch.bool, device=absmat.device)
        used_t[list(used)] = True
        need = used_t[pairs].any(1)
    return _finish(matrix, best_local, base, start)


def progressive_channel_swap(matrix, time_limit: float = 60.0, improvement_threshold: float = 1e-9,
                             permutation=None, seed: int | None = None, batch_pairs: int = 4096):
    """Random channel swaps until ``time_limit`` seconds pass: each round scores ``batch_pairs`` random
    stripe pairs and applies their best non-overlapping swaps that gain more than
    ``improvement_threshold`` (at least a millionth of the mean stripe score). Stops early once it has
    scored about twice the number of stripe pairs in a row without a gain.
    Returns ``(matrix[:, order], seconds, order)``."""
    start = time.perf_counter()
    absmat, base, nst, local = _prepare(matrix, permutation)
    if nst < 2:
        return _finish(matrix, local, base, start)
    gen = torch.Generator(device="cpu").manual_seed(0 if seed is None else seed)
    cur = absmat.clone()
    npairs = nst * (nst - 1) // 2
    batch = min(batch_pairs, npairs)
    all_pairs = torch.triu_indices(nst, nst, 1).t().contiguous() if npairs <= batch_pairs else None
    best_total, best_local = float(stripe_scores(cur).double().sum()), local.clone()
    # float32 scoring noise must not count as a gain, or swaps could cycle until the time limit.
    threshold = max(float(improvement_threshold), 1e-6 * best_total / nst)
    fruitless = 0
    while time.perf_counter() - start < time_limit and fruitless < 2 * npairs:
        if all_pairs is not None:
            pairs = all_pairs
        else:
            a = torch.randint(0, nst, (batch,), generator=gen)
            b = (a + torch.randint(1, nst, (batch,), generator=gen)) % nst  # never the same stripe
            pairs = torch.stack([torch.minimum(a, b), torch.maximum(a, b)], 1)
        gains = swap_gains(cur, pairs.to(absmat.device), stripe_scores(cur))
        applied = _apply_best(cur, local, pairs.tolist(), gains, threshold, set())
        if applied:
            total = float(stripe_scores(cur).double().sum())
            if total > best_total:
                best_total, best_local = total, local.clone()
            fruitless = 0
        else:
            fruitless += pairs.shape[0]
    return _finish(matrix, best_local, base, start)


# ---- Apex's step-level helpers of the greedy channel swap (``Channel_Swap`` above runs the batched search;
# these expose its steps on numpy matrices, one swap map at a time).

def stripes_and_swap_idx_to_columns(stripe0: int, stripe1: int, idx: int) -> tuple[int, int] | None:
    """Swap ``idx`` (0..15: column ``idx // 4`` of ``stripe0`` with column ``idx % 4`` of ``stripe1``) as the
    two matrix columns; ``None`` for an ``idx`` outside 0..15."""
    if not 0 <= idx < GROUP_WIDTH * GROUP_WIDTH:
        return None
    return stripe0 * GROUP_WIDTH + idx // GROUP_WIDTH, stripe1 * GROUP_WIDTH + idx % GROUP_WIDTH


def columns_to_stripes_and_swap_idx(col0: int, col1: int) -> tuple[int, int, int]:
    """Inverse of ``stripes_and_swap_idx_to_columns``: ``(stripe0, stripe1, idx)`` of swapping ``col0`` and
    ``col1``."""
    return col0 // GROUP_WIDTH, col1 // GROUP_WIDTH, (col0 % GROUP_WIDTH) * GROUP_WIDTH + col1 % GROUP_WIDTH


def build_stripe_pairs(matrix, used_stripes) -> np.ndarray:
    """``[stripe0, stripe1]`` rows (``stripe0 <= stripe1``, ``stripe0`` below the last stripe) of the pairs that
    involve a stripe of ``used_stripes``: those whose swap gains must be recomputed. int64 ``(pairs, 2)``."""
    n = matrix.shape[1] // GROUP_WIDTH
    used = {int(s) for s in used_stripes}
    pairs = [[s0, s1] for s0 in range(n - 1) for s1 in range(s0, n) if s0 in used or s1 in used]
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)


def compute_swap_map(matrix, used_stripes) -> dict[tuple[int, int], float]:
    """Gain of each of the 16 swaps of every pair from ``build_stripe_pairs``: ``{(col0, col1): gain}`` (the
    change of the two stripes' kept 2:4 magnitude; 0 inside one stripe). Batched on the search device."""
    pairs = build_stripe_pairs(matrix, used_stripes)
    out: dict[tuple[int, int], float] = {}
    if not len(pairs):
        return out
    absmat = as_search_tensor(matrix)
    rows = absmat.shape[0]
    stripes = absmat.reshape(rows, -1, GROUP_WIDTH)
    for s0, s1 in pairs.tolist():
        a, b = stripes[:, s0], stripes[:, s1]
        base = top2_of_4(a).sum() + top2_of_4(b).sum()
        for idx in range(GROUP_WIDTH * GROUP_WIDTH):
            c0, c1 = stripes_and_swap_idx_to_columns(s0, s1, idx)
            if s0 == s1:
                out[(c0, c1)] = 0.0
                continue
            i, j = idx // GROUP_WIDTH, idx % GROUP_WIDTH
            a2, b2 = a.clone(), b.clone()
            a2[:, i], b2[:, j] = b[:, j], a[:, i]
            out[(c0, c1)] = float(top2_of_4(a2).sum() + top2_of_4(b2).sum() - base)
    return out


def build_swap_map(matrix, swap_map: list, swap_ids: list, used_stripes, verbosity: int) -> tuple[list, list]:
    """Fill or refresh the list of all cross-stripe swaps ``(src, dst)`` (``src < dst``, Apex's order) and their
    gains: new entries are appended, entries touching ``used_stripes`` recomputed. Returns
    ``(swap_map, swap_ids)`` (the same lists, updated)."""
    fresh = len(swap_map) == 0
    gains = compute_swap_map(matrix, range(matrix.shape[1] // GROUP_WIDTH) if fresh else used_stripes)
    used = {int(s) for s in used_stripes}
    idx = updates = 0
    for src in range(matrix.shape[1] - 1):
        for dst in range(src + 1, matrix.shape[1]):
            s, d = src // GROUP_WIDTH, dst // GROUP_WIDTH
            if s == d:
                continue
            if idx >= len(swap_map) or s in used or d in used:
                gain = gains[(src, dst)]
                if idx >= len(swap_map):
                    swap_map.append(gain)
                    swap_ids.append((src, dst))
                else:
                    swap_map[idx], swap_ids[idx] = gain, (src, dst)
                updates += 1
            idx += 1
    if verbosity > 15:
        print(f"\tupdated {updates} map entries")
    return swap_map, swap_ids


def use_swap_map(matrix, swap_map: list, swap_ids: list, threshold: float, used_escape_attempts: int,
                 escape_attempts: int, permutation: list, verbosity: int):
    """Apply the best swaps of the map, largest gain first, each stripe at most once, down to
    ``threshold`` times the best gain (clamped to [1e-4, 1]); when nothing gains and escape attempts remain,
    one random swap is applied instead. ``matrix`` (numpy) and ``permutation`` are updated in place.

    Returns ``(matrix, swaps, swap_map, swap_ids, used_stripes, improvement, used_escape_attempts,
    permutation)``."""
    used_stripes: list[int] = []
    swaps, improvement = 0, 0.0
    if not swap_map:
        return matrix, 0, swap_map, swap_ids, used_stripes, 0.0, used_escape_attempts, permutation
    order = np.argsort(swap_map, kind="stable")[::-1]
    cut = min(max(swap_map[order[0]] * threshold, 1e-4), 1.0)
    for k in order:
        gain = swap_map[k]
        if gain < cut:
            if used_stripes or used_escape_attempts >= escape_attempts:
                break
            k = order[np.random.randint(len(order))]
            gain = swap_map[k]
            used_escape_attempts += 1
        src, dst = swap_ids[k]
        if src // GROUP_WIDTH in used_stripes or dst // GROUP_WIDTH in used_stripes:
            continue
        used_stripes += [src // GROUP_WIDTH, dst // GROUP_WIDTH]
        if verbosity > 20:
            print(f"\t{src},{dst}  {gain:.4f}")
        matrix[..., [src, dst]] = matrix[..., [dst, src]]
        permutation[src], permutation[dst] = permutation[dst], permutation[src]
        improvement += gain
        swaps += 1
    return matrix, swaps, swap_map, swap_ids, used_stripes, improvement, used_escape_attempts, permutation
