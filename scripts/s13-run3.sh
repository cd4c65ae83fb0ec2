#!/usr/bin/env bash
# Session 13, third call: where the Gluon backward's extra host time sits (the whole autograd node timed, the
# Triton backward before and after), then the opaque Gluon ops under torch.compile at d128 (LLaMA 1b).
set -u
export PYTHONPATH=$PWD
timeout 80 python3 scripts/host_ws_bwd.py --phases > $OUT/host-phases.log 2>&1; echo "phases rc=$?"; cat $OUT/host-phases.log
timeout 420 python3 scripts/ab_train_step.py 1b --rounds 4 --steps 6 --variants torch-compile,culmen-compile,culmen-compile-ws > $OUT/ab-1b-compile-ws.log 2>&1; echo "ab rc=$?"; grep -v Warning $OUT/ab-1b-compile-ws.log | tail -6
