#!/usr/bin/env bash
# Prepared in session 13 for the next GPU call (bench/notes/attention.md v14, "Prepared"): the transposed Gluon
# backward (WS_BWD_TUNING["st"]: tests, then a sweep against the shipped form, with 2 and 3 Q/dO stages), and the
# d128 causal forward tile (128x3x2p vs the shipped 64x3x3p), which flipped between an H100 (v10) and an H200 (v14).
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu -n 4 tests/ops/test_attention_ws.py -k "transposed or backward_matches" > $OUT/gpu-tests-st.log 2>&1; echo "st tests rc=$?"; grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/gpu-tests-st.log | head -12
timeout 200 python3 scripts/tune_attention_ws_bwd.py --d 128,64 --seqlen 2048,8192 --tiles "64,2,1 64,2,1,1 64,3,1,1" > $OUT/tune-bwd-st.log 2>&1; echo "bwd sweep rc=$?"; grep -vE "^ *$" $OUT/tune-bwd-st.log | tail -40
timeout 150 python3 scripts/tune_attention_ws.py --d 128 --seqlen 2048,4096,8192 --tiles "128,3,2,1 64,3,3,1" --persistent-only > $OUT/tune-fwd-causal-tile.log 2>&1; echo "fwd sweep rc=$?"; grep -E "causal" $OUT/tune-fwd-causal-tile.log | tail -16
