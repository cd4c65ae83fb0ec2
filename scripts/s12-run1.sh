#!/usr/bin/env bash
# session 12, first call: the prepared-but-unrun GPU tests (Gluon under torch.compile, FP8 edge shapes, the V
# transpose's flat grid), the Gluon backward's host time, and train_step compiled with / without the opaque ops
set -u
export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -m gpu tests/ops/test_attention_compile_ws.py tests/ops/test_attention_ws.py -k "compile or edge or fp8" > $OUT/gpu-tests.log 2>&1; echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu-tests.log | tail -8
timeout 60 python3 scripts/tune_attention_ws.py --fp8 --d 128 --seqlen 8192 --tiles "128,3,3,0" --persistent-only > $OUT/fp8.log 2>&1; echo "fp8 rc=$?"; cat $OUT/fp8.log | head -20
timeout 100 python3 scripts/host_ws_bwd.py > $OUT/host-ws-bwd.log 2>&1; echo "host rc=$?"; grep -E "^d128" $OUT/host-ws-bwd.log
timeout 110 python3 -m culmen bench train_step --models llama --sizes d768 --modes compile --json $OUT/ts-compile.json > $OUT/ts-compile.log 2>&1; echo "ts rc=$?"; grep -E "^model|^llama" $OUT/ts-compile.log
CULMEN_WS_COMPILE=1 timeout 110 python3 -m culmen bench train_step --models llama --sizes d768 --modes compile --json $OUT/ts-compile-ws.json > $OUT/ts-compile-ws.log 2>&1; echo "ts ws rc=$?"; grep -E "^model|^llama" $OUT/ts-compile-ws.log; tail -5 $OUT/ts-compile-ws.log
