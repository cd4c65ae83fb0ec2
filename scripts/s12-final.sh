#!/usr/bin/env bash
# session 12, last call: the Gluon backward's new dQ accumulator layout against the Triton backward (GPU tests),
# where each Launch spends host time, then `culmen bench flash_attn` (eager wall, no graph column) and train_step
set -u
export PYTHONPATH=$PWD
timeout 100 python3 -m pytest -q -m gpu tests/ops/test_attention_ws.py -k "backward_matches or deterministic or small_calls" > $OUT/gpu-tests.log 2>&1; echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu-tests.log | tail -6
timeout 30 python3 scripts/host_ws_bwd.py --launches > $OUT/launches.log 2>&1; echo "launches rc=$?"; cat $OUT/launches.log | head -40
timeout 170 python3 -m culmen bench flash_attn --no-graph --json $OUT/bench-attn.json > $OUT/bench-attn.log 2>&1; echo "attn rc=$?"; sed -n '/^== summary/,$p' $OUT/bench-attn.log
timeout 70 python3 -m culmen bench train_step --models llama --sizes d768 --modes eager --json $OUT/ts-d768.json > $OUT/ts-d768.log 2>&1; echo "train d768 rc=$?"; grep -E "^model|^llama" $OUT/ts-d768.log
