#!/usr/bin/env bash
# Two processes on one machine (GPUs when present, else the CPU with gloo).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
NPROC=${NPROC:-2}
DEVICE=$(python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
exec torchrun --standalone --nproc_per_node "$NPROC" distributed_data_parallel.py --device "$DEVICE" "$@"
