"""m:n structured-sparsity masks (``apex.contrib.sparsity.sparse_masklib``).

A mask keeps ``n`` of every ``m`` consecutive weights along the input-channel dimension (dim 1 of a
``Linear`` weight ``(out, in)`` or of a convolution weight ``(K, C, *kernel)``); ``m4n2`` is NVIDIA's
2:4 pattern that sparse tensor cores (and ``torch.sparse.to_sparse_semi_structured``) accelerate.

Pattern names (``create_mask(tensor, pattern)``):

- ``"m4n2_1d"`` / ``"m<M>n<N>_1d"``: in each group of ``M`` consecutive input channels keep the ``N``
  largest magnitudes (this is also the best 1-D mask: it maximises the kept magnitude).
- ``"m4n2_2d_best"`` / ``"m<M>n<N>_2d_best"``: in every ``M x M`` block, each row and each column keeps
  exactly ``N`` entries; the pattern keeping the largest magnitude is chosen exhaustively, so the
  transposed weight (used by the input gradient) is also ``N:M`` sparse.
- ``"m4n2_2d_greedy"`` / ``"m<M>n<N>_2d_greedy"``: the same constraint filled greedily from the
  largest magnitude down (cheaper; a row or column may end with fewer than ``N`` entries).

Apex's generic names only exist for 4:2; culmen parses any ``m<M>n<N>`` (``N <= M``). Differences from
Apex: masks are computed on the tensor's own device (Apex moves some to ``cuda``), channel counts that
``M`` does not divide raise ``ValueError`` instead of failing inside a reshape, 5-D (``Conv3d``) weights
are supported, and ``density`` is accepted but, as in Apex, implied by the pattern.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "compute_valid_1d_patterns",
    "compute_valid_2d_patterns",
    "create_mask",
    "fill",
    "kept_magnitude",
    "m4n2_1d",
    "m4n2_2d_best",
    "m4n2_2d_greedy",
    "mn_1d_best",
    "mn_2d_best",
    "mn_2d_greedy",
    "mask_is_valid",
    "parse_pattern",
    "reshape_1d",
    "reshape_2d",
    "reshape_2d_inv",
]

_PATTERN_RE = re.compile(r"^m(\d+)n(\d+)_(1d|2d_greedy|2d_best)$")
_PATTERN_CACHE: dict[tuple[str, int, int], Tensor] = {}
# 2-D patterns are enumerated as M-tuples of 1-D row patterns; beyond this many the table is useless.
_MAX_2D_CANDIDATES = 2_000_000


def fill(x: Tensor) -> float:
    """Density of ``x``: the fraction of its elements that are nonzero (a Python float in [0, 1])."""
    return float(torch.count_nonzero(x)) / max(x.numel(), 1)


def parse_pattern(pattern: str) -> tuple[int, int, str]:
    """``"m4n2_1d"`` -> ``(4, 2, "1d")``; the kind is ``"1d"``, ``"2d_greedy"`` or ``"2d_best"``.

    Raises ``ValueError`` naming ``pattern`` for anything else, or when ``n > m`` or ``m < 1``."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a string such as 'm4n2_1d', got {type(pattern).__name__}")
    match = _PATTERN_RE.match(pattern)
    if match is None:
        raise ValueError(f"pattern={pattern!r} is not a sparsity pattern: expected 'm<M>n<N>_1d', "
                         "'m<M>n<N>_2d_greedy' or 'm<M>n<N>_2d_best' (e.g. 'm4n2_1d')")
    m, n, kind = int(match.group(1)), int(match.group(2)), match.group(3)
    if m < 1 or n > m:
        raise ValueError(f"pattern={pattern!r}: need 1 <= M and N <= M, got M={m}, N={n}")
    return m, n, kind


def reshape_1d(matrix: Tensor, m: int) -> tuple[Tensor, torch.Size]:
    """``(h, w)`` -> ``(h * w' / m, m)`` groups of ``m`` consecutive columns, zero-padding ``w`` up to a
    multiple ``w'`` of ``m``. Returns the groups and the padded ``(h, w')`` shape."""
    h, w = matrix.shape
    if w % m:
        padded = matrix.new_zeros(h, w + m - w % m)
        padded[:, :w] = matrix
        return padded.view(-1, m), padded.shape
    return matrix.reshape(-1, m), matrix.shape


def reshape_2d(matrix: Tensor, m: int, n: int) -> Tensor:
    """``(h, w)`` -> ``(h' / m, w' / n, m * n)``: the ``m x n`` blocks of ``matrix``, each flattened
    row-major, after zero-padding ``h`` and ``w`` up to multiples ``h'``, ``w'`` of ``m`` and ``n``."""
    h, w = matrix.shape
    hp, wp = -(-h // m) * m, -(-w // n) * n
    if (hp, wp) != (h, w):
        padded = matrix.new_zeros(hp, wp)
        padded[:h, :w] = matrix
        matrix = padded
    return matrix.reshape(hp // m, m, wp // n, n).permute(0, 2, 1, 3).reshape(hp // m, wp // n, m * n)


def reshape_2d_inv(blocks: Tensor) -> Tensor:
    """Inverse of ``reshape_2d`` for a ``(a, b, m, n)`` block tensor: returns ``(a * m, b * n)``."""
    a, b, m, n = blocks.shape
    return blocks.permute(0, 2, 1, 3).reshape(a * m, b * n)


def compute_valid_1d_patterns(m: int, n: int) -> Tensor:
    """All ``C(m, n)`` 0/1 vectors of length ``m`` with exactly ``n`` ones: float32 ``(C(m, n), m)``."""
    key = ("1d", m, n)
    if key not in _PATTERN_CACHE:
        rows = [[1.0 if i in keep else 0.0 for i in range(m)] for keep in itertools.combinations(range(m), n)]
        _PATTERN_CACHE[key] = torch.tensor(rows, dtype=torch.float32)
    return _PATTERN_CACHE[key]


def compute_valid_2d_patterns(m: int, n: int) -> Tensor:
    """All ``m x m`` 0/1 blocks whose every row and every column holds exactly ``n`` ones:
    float32 ``(P, m, m)`` (90 blocks for 4:2)."""
    key = ("2d", m, n)
    if key not in _PATTERN_CACHE:
        rows = compute_valid_1d_patterns(m, n)
        if rows.shape[0] ** m > _MAX_2D_CANDIDATES:
            raise ValueError(f"the 2-D pattern table for m={m}, n={n} has {rows.shape[0]}^{m} candidates; "
                             "use a '_2d_greedy' pattern for blocks this large")
        ids = torch.arange(rows.shape[0])
        idx = torch.cartesian_prod(*[ids] * m) if m > 1 else ids[:, None]
        blocks = rows[idx]  # (cand, m, m)
        ok = (blocks.sum(dim=1) == n).all(dim=1)
        _PATTERN_CACHE[key] = blocks[ok].contiguous()
    return _PATTERN_CACHE[key]


def _check_divisible(matrix: Tensor, m: int, *, rows: bool, name: str = "tensor") -> None:
    if matrix.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, channels) here, got shape {tuple(matrix.shape)}")
    if matrix.shape[1] % m:
        raise ValueError(f"{name}: the channel dimension has {matrix.shape[1]} entries, not a multiple of "
                         f"m={m}; an m:n mask needs whole groups of m channels")
    if rows and matrix.shape[0] % m:
        raise ValueError(f"{name}: a 2-D m:n mask needs the row count ({matrix.shape[0]}) to be a multiple of "
                         f"m={m} as well")


def mn_1d_best(matrix: Tensor, m: int, n: int) -> Tensor:
    """Keep the ``n`` largest magnitudes in each group of ``m`` consecutive columns of a 2-D ``matrix``.

    Returns an int32 mask of ``matrix``'s shape, on its device. Keeping the top-``n`` entries is the
    pattern of largest kept magnitude, i.e. the argmax over ``compute_valid_1d_patterns(m, n)``."""
    _check_divisible(matrix, m, rows=False)
    groups = matrix.detach().reshape(-1, m).abs()
    mask = torch.zeros(groups.shape, dtype=torch.int32, device=matrix.device)
    if n:
        mask.scatter_(1, torch.topk(groups, n, dim=1).indices, 1)
    return mask.view(matrix.shape)


def m4n2_1d(mat: Tensor, density: float = 0.5) -> Tensor:
    """2:4 along the columns of a 2-D ``mat`` (``density`` is implied by the pattern)."""
    return mn_1d_best(mat, 4, 2)


def mn_2d_greedy(matrix: Tensor, m: int, n: int) -> Tensor:
    """Greedy 2-D ``n:m`` mask: in each ``m x m`` block take entries from the largest magnitude down,
    skipping one whose row or column already holds ``n``. int32, ``matrix``'s shape and device.

    Every row and column of every block ends with at most ``n`` kept entries."""
    _check_divisible(matrix, m, rows=True)
    blocks = reshape_2d(matrix.detach().float().abs(), m, m)
    a, b, _ = blocks.shape
    flat = blocks.reshape(a * b, m * m)
    order = torch.argsort(flat, dim=1, descending=True)
    nb = flat.shape[0]
    keep = torch.zeros(nb, m * m, dtype=torch.int32, device=matrix.device)
    row_count = torch.zeros(nb, m, dtype=torch.int32, device=matrix.device)
    col_count = torch.zeros(nb, m, dtype=torch.int32, device=matrix.device)
    arange = torch.arange(nb, device=matrix.device)
    # One vectorised step per block position: m*m steps whatever the matrix size.
    for step in range(m * m):
        pos = order[:, step]
        r, c = pos // m, pos % m
        take = (row_count[arange, r] < n) & (col_count[arange, c] < n)
        t = take.to(torch.int32)
        keep[arange, pos] = t
        row_count[arange, r] += t
        col_count[arange, c] += t
    return reshape_2d_inv(keep.view(a, b, m, m)).contiguous()


def m4n2_2d_greedy(mat: Tensor, density: float = 0.5) -> Tensor:
    """Greedy 2:4 in both directions of 4x4 blocks (``density`` is implied by the pattern)."""
    return mn_2d_greedy(mat, 4, 2)


def mn_2d_best(matrix: Tensor, m: int, n: int) -> Tensor:
    """Best 2-D ``n:m`` mask: each ``m x m`` block takes the valid 2-D pattern (exactly ``n`` per row and
    per column) of largest kept magnitude. int32, ``matrix``'s shape and device."""
    _check_divisible(matrix, m, rows=True)
    patterns = compute_valid_2d_patterns(m, n).to(matrix.device)
    flat_patterns = patterns.reshape(patterns.shape[0], m * m)
    blocks = reshape_2d(matrix.detach().float().abs(), m, m)
    best = torch.argmax(blocks @ flat_patterns.t(), dim=2)
    chosen = patterns[best].to(torch.int32)  # (a, b, m, m)
    return reshape_2d_inv(chosen).contiguous()


def m4n2_2d_best(mat: Tensor, density: float = 0.5) -> Tensor:
    """Best 2:4 in both directions of 4x4 blocks (``density`` is implied by the pattern)."""
    return mn_2d_best(mat, 4, 2)


_KIND_FUNCS: dict[str, Callable[[Tensor, int, int], Tensor]] = {
    "1d": mn_1d_best, "2d_greedy": mn_2d_greedy, "2d_best": mn_2d_best,
}


def _mask_function(pattern: str) -> Callable[[Tensor, float], Tensor]:
    m, n, kind = parse_pattern(pattern)
    impl = _KIND_FUNCS[kind]
    return lambda t, density: impl(t, m, n)


def _to_rows_channels(t: Tensor) -> Tensor:
    """Weight layout -> ``(rows, C)`` with the input channels last, as the masks see it."""
    shape = t.shape
    if t.dim() == 1:
        return t.view(1, shape[0])
    if t.dim() == 2:
        return t
    # (K, C, *kernel) -> (*kernel, K, C): groups run along C for every output channel and tap.
    order = (*range(2, t.dim()), 0, 1)
    return t.permute(order).reshape(-1, shape[1])


def _from_rows_channels(mask: Tensor, shape: torch.Size) -> Tensor:
    if len(shape) <= 2:
        return mask.reshape(shape)
    kernel = tuple(shape[2:])
    nd = len(shape)
    inverse = (nd - 2, nd - 1, *range(nd - 2))
    return mask.reshape(*kernel, shape[0], shape[1]).permute(inverse).contiguous()


def create_mask(tensor: Tensor, pattern: str = "m4n2_1d", density: float = 0.5) -> Tensor:
    """The m:n mask of a weight ``tensor``, as a tensor of ``tensor``'s shape, dtype and device (1 keep,
    0 prune).

    Args:
        tensor: 1-D ``(C,)``, ``Linear`` ``(K, C)``, or convolution ``(K, C, *kernel)`` (1 to 3 kernel
            dims). Groups of ``m`` run along ``C`` (dim 1; dim 0 of a 1-D tensor); for convolutions,
            separately for every output channel and kernel tap.
        pattern: ``"m4n2_1d"`` (default), ``"m4n2_2d_greedy"``, ``"m4n2_2d_best"`` or the generic
            ``"m<M>n<N>_1d|2d_greedy|2d_best"``.
        density: accepted for Apex compatibility; the pattern fixes the density (``N / M``).

    Raises:
        ValueError: unknown ``pattern``, or a channel count (or, for 2-D patterns, row count) that ``M``
            does not divide.
        TypeError: ``tensor`` is not a floating-point tensor.
    """
    if not isinstance(tensor, Tensor) or not (tensor.is_floating_point() or tensor.dtype == torch.bool):
        raise TypeError(f"tensor must be a floating-point torch.Tensor, got "
                        f"{type(tensor).__name__ if not isinstance(tensor, Tensor) else tensor.dtype}")
    if tensor.dim() < 1 or tensor.dim() > 5:
        raise ValueError(f"tensor must have 1 to 5 dimensions, got shape {tuple(tensor.shape)}")
    func = _mask_function(pattern)
    shape = tensor.shape
    t = _to_rows_channels(tensor.detach().float())
    try:
        mask = func(t, density)
    except ValueError as exc:
        raise ValueError(f"create_mask(pattern={pattern!r}) on tensor of shape {tuple(shape)}: {exc}") from None
    return _from_rows_channels(mask, shape).to(tensor.dtype)


def mask_is_valid(mask: Tensor, pattern: str = "m4n2_1d") -> bool:
    """Whether a 0/1 ``mask`` of a weight satisfies ``pattern`` (at most ``N`` kept per group of ``M``
    channels; for 2-D patterns also per group of ``M`` rows of every ``M x M`` block)."""
    m, n, kind = parse_pattern(pattern)
    rc = _to_rows_channels(mask.detach() != 0).to(torch.int32)
    if rc.shape[1] % m:
        return False
    if (rc.reshape(-1, m).sum(1) > n).any():
        return False
    if kind != "1d":
        if rc.shape[0] % m:
            return False
        blocks = reshape_2d(rc, m, m).reshape(rc.shape[0] // m, rc.shape[1] // m, m, m)
        if (blocks.sum(2) > n).any():
            return False
    return True


def kept_magnitude(matrix: Tensor | np.ndarray, m: int = 4, n: int = 2) -> float:
    """Sum of ``|x|`` kept by the best 1-D ``n:m`` mask of a 2-D ``matrix`` (float64 accumulation)."""
    t = torch.as_tensor(matrix).detach()
    groups = t.reshape(-1, m).abs().to(torch.float64)
    return float(torch.topk(groups, n, dim=1).values.sum()) if n else 0.0
