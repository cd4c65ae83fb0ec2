#!/usr/bin/env bash
# session 11, GPU call 4: the Gluon forward at d256 (check against float64 + timing vs Triton and cuDNN); the
# attention GPU tests with the FP8 Gluon forward on
set -u
export PYTHONPATH=$PWD
timeout 200 python3 scripts/tune_attention_ws.py --d 256 --seqlen 4096,8192 --tiles "64,2,2,1 64,2,2,0 32,4,2,1" --persistent-only > $OUT/d256.log 2>&1; echo "d256 rc=$?"; grep -E "BAD|^check|^d256 s" $OUT/d256.log
timeout 330 python3 -m pytest -q -m gpu -x tests/ops/test_attention_ws.py tests/ops/test_attention_gpu.py tests/ops/test_attention_safety.py tests/ops/test_attention_compile.py tests/flash_attn_3 tests/flash_attn/test_interface_internals.py tests/flash_attn/test_window_size.py > $OUT/gpu-tests-attn.log 2>&1; echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu-tests-attn.log | tail -15
