"""``accelerated_search_for_good_permutation``: the entry point the ASP permutation pass calls.

Apex ships CUDA kernels for these searches (``permutation_search_cuda``); culmen runs the same searches
as batched PyTorch (on the GPU when there is one), so nothing needs compiling.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from culmen.contrib.sparsity.permutation_search_kernels.channel_swap import Channel_Swap, progressive_channel_swap
from culmen.contrib.sparsity.permutation_search_kernels.exhaustive_search import Exhaustive_Search
from culmen.contrib.sparsity.permutation_search_kernels.permutation_utilities import GROUP_WIDTH, sum_after_2_to_4

__all__ = ["STRATEGY_DEFAULTS", "accelerated_search_for_good_permutation"]

STRATEGY_DEFAULTS: dict[str, dict[str, Any]] = {
    "exhaustive": {"stripe_group_size": 8, "escape_attempts": 100},
    "progressive channel swap": {"progressive_search_time_limit": 60, "improvement_threshold": 1e-9},
    "channel swap": {"escape_attempts": 0},
    "user defined": {},
}


def accelerated_search_for_good_permutation(matrix_group, options: dict | None = None, verbosity: int = 0) -> list[int]:
    """Find an input-channel order of ``matrix_group`` ``(rows, C)`` that keeps more magnitude under 2:4.

    Args:
        matrix_group: tensor or numpy array; ``C`` must be a multiple of 4. Several layers that share
            one permutation are searched together by concatenating their weights along dim 0.
        options: ``{"strategy": ...}`` plus the strategy's settings (defaults filled in place, as Apex
            does): ``"exhaustive"`` (``stripe_group_size=8``, ``escape_attempts=100``; the default),
            ``"progressive channel swap"`` (``progressive_search_time_limit=60`` seconds,
            ``improvement_threshold=1e-9``), ``"channel swap"`` (greedy swaps to convergence,
            ``escape_attempts=0``) or ``"user defined"`` (identity: plug your own search in instead).
            ``"seed"`` (culmen addition) seeds the random parts; default 1.
        verbosity: > 1 prints the strategy and timing.

    Returns:
        ``order`` (list of ``C`` ints): column ``j`` of the permuted matrix is column ``order[j]`` of the
        input. The result never keeps less 2:4 magnitude than the identity (checked in float64).

    Raises:
        ValueError: unknown strategy, or ``C`` not a multiple of 4.
    """
    t = torch.as_tensor(matrix_group).detach()
    if t.dim() != 2:
        raise ValueError(f"matrix_group must be 2-D (rows, channels), got shape {tuple(t.shape)}")
    if t.shape[1] % GROUP_WIDTH:
        raise ValueError(f"matrix_group has {t.shape[1]} channels (dim 1), not a multiple of {GROUP_WIDTH}")
    if options is None:
        options = {}
    strategy = options.setdefault("strategy", "exhaustive")
    if strategy not in STRATEGY_DEFAULTS:
        raise ValueError(f"options['strategy']={strategy!r} is not one of {sorted(STRATEGY_DEFAULTS)}")
    for key, value in STRATEGY_DEFAULTS[strategy].items():
        options.setdefault(key, value)
    seed = int(options.get("seed", 1))
    start = time.perf_counter()
    identity = list(range(t.shape[1]))
    if strategy == "exhaustive":
        _, _, order = Exhaustive_Search(t, stripe_group_size=int(options["stripe_group_size"]),
                                        escape_attempts=int(options["escape_attempts"]), seed=seed)
    elif strategy == "progressive channel swap":
        _, _, order = progressive_channel_swap(t, time_limit=float(options["progressive_search_time_limit"]),
                                               improvement_threshold=float(options["improvement_threshold"]),
                                               seed=seed)
    elif strategy == "channel swap":
        _, _, order = Channel_Swap(t, escape_attempts=int(options["escape_attempts"]), verbosity=verbosity, seed=seed)
    else:
        order = identity
    # Guard in float64: float32 scoring noise must never make the result worse than doing nothing.
    if sum_after_2_to_4(t[:, order]) < sum_after_2_to_4(t):
        order = identity
    if verbosity > 1:
        print(f"[accelerated_search_for_good_permutation] strategy {strategy!r} on {tuple(t.shape)}: "
              f"{time.perf_counter() - start:.4f} s")
    return [int(c) for c in np.asarray(order)]
