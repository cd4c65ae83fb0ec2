"""Data-parallel benchmark (culmen DDP / SyncBatchNorm vs PyTorch's); launch with torchrun.

    torchrun --standalone --nproc_per_node 2 scripts/bench_parallel.py --out DIR [--quick]

See ``culmen/bench/parallel.py`` for what is measured.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from culmen.bench.parallel import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
