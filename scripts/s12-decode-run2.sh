#!/usr/bin/env bash
# session 12, GPU call 2 (decode): the final settings (fused merge on, paged block loads on, paged splits capped at
# one merge chunk) on the bench's batch-1 and paged cases, the paged-vs-dense GPU test with its bf16 tolerance, and
# the fused merge off on two cases for a same-card comparison.
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
CULMEN_BENCH_FUSED_MERGE=1 CULMEN_BENCH_DECODE_SHAPES="1,4096,0 1,32768,0 1,131072,0 1,32768,256 8,8192,256 8,8192,16" \
  timeout 55 python3 -m culmen bench kvcache_decode --no-graph --json $OUT/decode-final.json > $OUT/decode-final.log 2>&1
echo "bench final rc=$?"; grep -E "^B|culmen  |torch  |culmen-auto|note: culmen-auto|roofline|kvcache_decode  " $OUT/decode-final.log
timeout 20 python3 -m pytest -q -m gpu tests/flash_attn/test_kvcache_gpu.py -k paged_equals > $OUT/gpu-tests2.log 2>&1
echo "test rc=$?"; tail -3 $OUT/gpu-tests2.log
CULMEN_BENCH_FUSED_MERGE=0 CULMEN_BENCH_DECODE_SHAPES="1,4096,0 1,32768,256" \
  timeout 25 python3 -m culmen bench kvcache_decode --no-graph --json $OUT/decode-fused0.json > $OUT/decode-fused0.log 2>&1
echo "bench fused=0 rc=$?"; grep -E "^B|culmen  |torch  " $OUT/decode-fused0.log
