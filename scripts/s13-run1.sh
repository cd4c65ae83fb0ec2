#!/usr/bin/env bash
# Prepared in session 12 for the next session's first GPU call (see bench/notes/attention.md v13, "Next"):
# the suspect d64 cell, the host phases of the Gluon backward, the compiled LLaMA's rotary form, and the compile
# switch at d128 (LLaMA 1b, whose attention takes the Gluon kernels)
set -u
export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -m gpu tests/ops/test_attention_ws.py -k "q_double" > $OUT/gpu-tests-qdouble.log 2>&1; echo "q_double tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu-tests-qdouble.log | tail -6
for qd in "" "--q-double"; do timeout 100 python3 scripts/tune_attention_ws.py --d 128,64 --seqlen 2048,8192 --tiles "64,3,3,1 128,3,2,1 128,2,2,1 128,3,3,0" --persistent-only $qd > $OUT/tune-q$qd.log 2>&1; echo "tune $qd rc=$?"; grep -vE "^ *$" $OUT/tune-q$qd.log | tail -40; done
timeout 120 python3 scripts/ws_threshold.py > $OUT/ws-threshold.log 2>&1; echo "threshold rc=$?"; cat $OUT/ws-threshold.log
timeout 60 python3 scripts/host_ws_bwd.py --phases > $OUT/host-phases.log 2>&1; echo "phases rc=$?"; cat $OUT/host-phases.log
[ -n "${S13_AB:-}" ] && timeout 240 python3 scripts/ab_train_step.py d768 --variants torch-compile,culmen-compile,culmen-compile-splitrot > $OUT/ab-rotary.log 2>&1; echo "ab rc=$?"; grep -v Warning $OUT/ab-rotary.log | tail -5
