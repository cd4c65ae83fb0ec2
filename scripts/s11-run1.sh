#!/usr/bin/env bash
# session 11, GPU call 1: first run of the FP8 Gluon forward, then the decode grid.
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 150 python3 -m pytest -q -m gpu tests/ops/test_attention_ws.py -k fp8 -x > $OUT/fp8-test.log 2>&1; echo "fp8 test rc=$?"; tail -30 $OUT/fp8-test.log
timeout 200 python3 scripts/tune_attention_ws.py --fp8 --d 128 --seqlen 8192,2048 --tiles "128,3,2,1 128,4,2,1 128,3,3,0 128,2,2,1" > $OUT/fp8-tune.log 2>&1; echo "fp8 tune rc=$?"; cat $OUT/fp8-tune.log | tail -40
timeout 200 python3 -m culmen bench kvcache_decode --no-graph --json $OUT/decode.json > $OUT/decode.log 2>&1; echo "decode rc=$?"; grep -E "^B|culmen |torch |roofline" $OUT/decode.log | head -60
