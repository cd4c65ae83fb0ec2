#!/usr/bin/env bash
# session 11, final call on the H100: the Gluon forward at d256 (check against float64, timing vs Triton and
# cuDNN, and the flash_attn-rule GPU tests), then the attention benches (FP8 Gluon on) and train_step
set -u
export PYTHONPATH=$PWD
timeout 75 python3 scripts/tune_attention_ws.py --d 256 --seqlen 4096 --tiles "64,2,2,1 32,4,2,1" --persistent-only > $OUT/d256.log 2>&1; echo "d256 rc=$?"; grep -E "BAD|^check|^d256 s" $OUT/d256.log
timeout 70 python3 -m pytest -q -m gpu tests/ops/test_attention_ws.py -k "flash_attn_rule and 256" > $OUT/gpu-tests-d256.log 2>&1; echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu-tests-d256.log | tail -6
timeout 210 python3 -m culmen bench flash_attn flash_attn_fp8 --json $OUT/bench-attn.json > $OUT/bench-attn.log 2>&1; echo "attn rc=$?"; grep -E "^d|^ +(culmen|sdpa|torch)" $OUT/bench-attn.log | head -5; sed -n '/^== summary/,$p' $OUT/bench-attn.log
timeout 110 python3 -m culmen bench train_step --models llama --sizes d768 --json $OUT/train_step-d768.json > $OUT/train_step-d768.log 2>&1; echo "train d768 rc=$?"; grep -E "^model|^llama" $OUT/train_step-d768.log
timeout 110 python3 -m culmen bench train_step --models llama --sizes 1b --modes eager --json $OUT/train_step-1b.json > $OUT/train_step-1b.log 2>&1; echo "train 1b rc=$?"; grep -E "^model|^llama" $OUT/train_step-1b.log
