#!/usr/bin/env bash
# session 11, GPU call 2: FP8 Gluon tiles with the transpose kernel; FP8 GPU tests
set -u
export PYTHONPATH=$PWD
timeout 120 python3 -m pytest -q -m gpu tests/ops/test_attention_ws.py tests/flash_attn_3 -k "fp8 or transposed" > $OUT/fp8-test.log 2>&1; echo "fp8 test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/fp8-test.log | tail -12
timeout 420 python3 scripts/tune_attention_ws.py --fp8 --d 128 --seqlen 8192 --tiles "128,3,3,0 64,4,3,0 64,6,3,0 128,3,2,1 256,2,2,0 256,2,2,1 128,3,3,1" > $OUT/fp8-tune.log 2>&1; echo "fp8 tune rc=$?"; cat $OUT/fp8-tune.log
