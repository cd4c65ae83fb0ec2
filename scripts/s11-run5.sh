#!/usr/bin/env bash
# session 11, last GPU call: the FP8 Gluon forward (now on by default) on edge shapes and through FA3's GPU tests
set -u
export PYTHONPATH=$PWD
timeout 135 python3 -m pytest -q -m gpu tests/ops/test_attention_ws.py tests/flash_attn_3 -k "edge or fp8" > $OUT/fp8-edge-tests.log 2>&1; echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|Error" $OUT/fp8-edge-tests.log | tail -20
