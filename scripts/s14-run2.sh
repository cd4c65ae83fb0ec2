#!/usr/bin/env bash
# session 14, second call, on an H100 (the card): the transposed backward against the other form (d128 and
# d64, and d64 at s1k where the Triton backward ships below min_sk), and the d128 causal forward tile that the H200
# prefers (128x3x2p vs the shipped 64x3x3p).
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 scripts/tune_attention_ws_bwd.py --d 128,64 --seqlen 2048,8192 --check-d "" --tiles "64,2,1 64,2,1,1" > $OUT/tune-bwd-st.log 2>&1; echo "bwd sweep rc=$?"; grep -E "^d" $OUT/tune-bwd-st.log | grep -v flash
timeout 60 python3 scripts/tune_attention_ws_bwd.py --d 64 --seqlen 1024,4096 --check-d "" --tiles "64,2,1,1" > $OUT/tune-bwd-d64.log 2>&1; echo "bwd d64 rc=$?"; grep -E "^d" $OUT/tune-bwd-d64.log | grep -v flash
timeout 120 python3 scripts/tune_attention_ws.py --d 128 --seqlen 2048,4096,8192 --tiles "128,3,2,1 64,3,3,1" --persistent-only > $OUT/tune-fwd-causal-tile.log 2>&1; echo "fwd sweep rc=$?"; grep -E "BAD|causal g" $OUT/tune-fwd-causal-tile.log | grep -v flash
