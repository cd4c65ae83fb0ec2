#!/usr/bin/env bash
# session 14, last H100 call: the q_double GPU test on its pinned tile, the long-key tile switch's correctness
# (GPU tests at d128), then `culmen bench flash_attn` with the final defaults (d128 causal 64x3x3p from 12k keys).
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 -m pytest -v -m gpu -n 4 -p no:cacheprovider tests/ops/test_attention_ws.py -k "q_double or flash_attn_rule or backward_matches" > $OUT/gpu-tests.log 2>&1; echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" $OUT/gpu-tests.log | tail -8
timeout 300 python3 -m culmen bench flash_attn --json $OUT/bench-attn.json > $OUT/bench-attn.log 2>&1; echo "attn rc=$?"; grep -E "^d.*(culmen) " $OUT/bench-attn.log; sed -n '/^== summary/,$p' $OUT/bench-attn.log
