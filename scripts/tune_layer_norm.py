"""Sweep the launch settings of the layer_norm kernels over the registered benchmark cases.

Usage (GPU machine): ``python3 scripts/tune_layer_norm.py [--timer graph|wall] [NAME ...]``.
Times only culmen's provider of each ``layer_norm`` / ``rms_norm`` case (``culmen bench`` has the
peers) under each setting of ``culmen.ops.layer_norm.launch.TUNING`` below, and prints the best few.
Results feed ``bench/notes/layer_norm.md``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from culmen.bench.tuning import sweep_main  # noqa: E402
from culmen.ops.layer_norm import launch  # noqa: E402

GRID = {
    "elems_per_thread": [8, 16, 32],
    "fwd_elems": [2048, 4096, 8192],
    "bwd_elems": [2048, 4096, 8192],
    "bwd_programs_per_sm": [1, 2, 4, 8],
    "fwd_max_resident": [8192, 16384, 65536],
    "bwd_max_resident": [4096, 8192, 16384],
    "chunk": [2048, 4096, 8192],
}


def main() -> None:
    sweep_main(launch.TUNING, GRID, ["layer_norm", "rms_norm"])


if __name__ == "__main__":
    main()
