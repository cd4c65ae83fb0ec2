"""The rotary kernel's tile sizes are powers of two for every head count / rotary width / copied tail
(``tl.arange`` rejects anything else; a partial rotary width made the tail odd-sized)."""

from __future__ import annotations

import itertools

from culmen.ops.rotary.launch import rotary_blocks


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def test_rotary_blocks_are_powers_of_two():
    for seqlen, nheads, half, rest in itertools.product((1, 7, 67, 4096), (1, 3, 12, 40), (1, 3, 8, 33, 64),
                                                        (0, 5, 26, 100)):
        blocks = rotary_blocks(seqlen, nheads, half, rest)
        assert all(_pow2(b) for b in blocks[:4]), (seqlen, nheads, half, rest, blocks)
