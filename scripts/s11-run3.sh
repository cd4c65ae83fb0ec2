#!/usr/bin/env bash
# session 11, GPU call 3: polynomial exp2 (FMA pipe) in the Gluon forward: tests, FP8 and bf16 sweeps, FP8 d64
set -u
export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -m gpu tests/ops/test_attention_ws.py -k "fp8 or polynomial" > $OUT/poly-test.log 2>&1; echo "test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/poly-test.log | tail -12
timeout 200 python3 scripts/tune_attention_ws.py --fp8 --d 128 --seqlen 8192 --tiles "128,3,3,0 128,3,2,1" --exp-poly 0,1,2,-1 --persistent-only > $OUT/fp8-poly.log 2>&1; echo "fp8 rc=$?"; grep -v "^d128 s8192 .*V transpose" $OUT/fp8-poly.log
timeout 120 python3 scripts/tune_attention_ws.py --fp8 --d 64 --seqlen 8192 --tiles "128,3,3,0 128,3,2,1" --exp-poly 0,1 --persistent-only > $OUT/fp8-d64.log 2>&1; echo "fp8 d64 rc=$?"; cat $OUT/fp8-d64.log
timeout 200 python3 scripts/tune_attention_ws.py --d 128 --seqlen 8192 --tiles "128,3,2,1 64,3,3,1" --exp-poly 0,1,2 --persistent-only > $OUT/bf16-poly.log 2>&1; echo "bf16 rc=$?"; grep -E "^check|^d128" $OUT/bf16-poly.log
