#!/usr/bin/env bash
# Session 13, second call: q_double (tests + tile sweep with and without), the compiled LLaMA's rotary A/B, and
# torch.profiler's host ops of the Gluon backward against the Triton one.
set -u
export PYTHONPATH=$PWD
timeout 100 python3 -m pytest -q -m gpu tests/ops/test_attention_ws.py -k "q_double" > $OUT/gpu-tests-qdouble.log 2>&1; echo "q_double tests rc=$?"; grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/gpu-tests-qdouble.log | head -12
for qd in "" "--q-double"; do timeout 110 python3 scripts/tune_attention_ws.py --d 128 --seqlen 2048,8192 --tiles "128,3,2,1 128,2,2,1 128,3,3,0" --persistent-only $qd > $OUT/tune-q$qd.log 2>&1; echo "tune $qd rc=$?"; grep -vE "^ *$|^ok " $OUT/tune-q$qd.log | tail -24; done
timeout 60 python3 scripts/host_ws_bwd.py --torch-profile > $OUT/host-torch-profile.log 2>&1; echo "profile rc=$?"; cat $OUT/host-torch-profile.log | cut -c1-150
timeout 200 python3 scripts/ab_train_step.py d768 --variants torch-compile,culmen-compile,culmen-compile-splitrot > $OUT/ab-rotary.log 2>&1; echo "ab rc=$?"; grep -v Warning $OUT/ab-rotary.log | tail -6
