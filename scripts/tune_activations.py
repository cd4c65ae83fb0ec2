"""Sweep the launch settings of the activation kernels over the registered benchmark cases.

Usage (GPU machine): ``python3 scripts/tune_activations.py [--timer graph|wall] [NAME ...]``
(default: ``bias_gelu relu swiglu``). Times only culmen's provider of each case (``culmen bench`` has
the peers) under one-at-a-time changes of ``culmen.ops.activations.launch.TUNING`` and prints the
default time, its GB/s and the best few settings.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from culmen.bench.tuning import sweep_main  # noqa: E402
from culmen.ops.activations import launch  # noqa: E402

GRID = {
    "block_elems": [1024, 2048, 8192, 16384],
    "warps": [2, 8, 16],
    "max_block_n": [256, 512, 2048],
    "dbias_block_m": [8, 16, 64],
    "dbias_block_n": [64, 256, 512],
    "dbias_warps": [2, 8],
    "dbias_programs_per_sm": [2, 4, 16],
}


def main() -> None:
    sweep_main(launch.TUNING, GRID, ["bias_gelu", "relu", "swiglu"])


if __name__ == "__main__":
    main()
