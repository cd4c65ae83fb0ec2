#!/usr/bin/env bash
# session 14, final calls on an H100 with the s14 defaults (transposed Gluon backward, d64 backward from s1k, d128
# causal forward 128x3x2p). Part 1: the attention GPU tests and `culmen bench flash_attn` (eager wall, graph device
# time and host us beside it). Part 2: the FP8 bench and train_step (eager LLaMA d768 and 1b).
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${1:-1}" = 1 ]; then
  timeout 260 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/ops/test_attention_*.py tests/flash_attn tests/flash_attn_3 > $OUT/gpu-tests.log 2>&1; echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu-tests.log | tail -12
  timeout 300 python3 -m culmen bench flash_attn --json $OUT/bench-attn.json > $OUT/bench-attn.log 2>&1; echo "attn rc=$?"; sed -n '/^== summary/,$p' $OUT/bench-attn.log
else
  timeout 150 python3 -m culmen bench flash_attn_fp8 --json $OUT/bench-fp8.json > $OUT/bench-fp8.log 2>&1; echo "fp8 rc=$?"; sed -n '/^== summary/,$p' $OUT/bench-fp8.log
  timeout 100 python3 -m culmen bench train_step --models llama --sizes d768 --modes eager --json $OUT/ts-d768.json > $OUT/ts-d768.log 2>&1; echo "train d768 rc=$?"; grep -E "^model|^llama" $OUT/ts-d768.log
  timeout 120 python3 -m culmen bench train_step --models llama --sizes 1b --modes eager --json $OUT/ts-1b.json > $OUT/ts-1b.log 2>&1; echo "train 1b rc=$?"; grep -E "^model|^llama" $OUT/ts-1b.log
fi
