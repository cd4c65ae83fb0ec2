#!/usr/bin/env bash
# session 12, GPU call 1 (decode): the split-KV merge inside the split kernel (TUNING["fused_merge"]) and the paged
# cache's one-table-load-per-key-block (TUNING["paged_block"]): GPU tests, a sweep, and `culmen bench
# kvcache_decode` with the fused merge on and off in the same call.
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 120 python3 -m pytest -q -m gpu tests/flash_attn/test_kvcache_fused_merge.py tests/flash_attn_3/test_fa3_splitkv.py \
  tests/flash_attn/test_kvcache_splitkv.py tests/flash_attn/test_kvcache_gpu.py -k "kvcache or decode or split or paged" \
  > $OUT/gpu-tests.log 2>&1; echo "tests rc=$?"; tail -15 $OUT/gpu-tests.log
timeout 45 python3 scripts/tune_decode.py --shapes "1,4096,0 1,32768,0" --configs "16,64,4,3" --fused on off \
  --splits auto --profile "1,4096,0" > $OUT/sweep-dense.log 2>&1; echo "dense sweep rc=$?"; cat $OUT/sweep-dense.log
timeout 60 python3 scripts/tune_decode.py --shapes "8,8192,256 8,8192,16 1,32768,256" --configs "16,128,4,3 16,64,4,3" \
  --fused on --paged-block on off --split-sets "8:auto,2,8 1:auto,16" > $OUT/sweep-paged.log 2>&1
echo "paged sweep rc=$?"; cat $OUT/sweep-paged.log
SH="1,4096,0 1,32768,0 1,131072,0 16,4096,0 64,4096,0 8,8192,256 8,8192,16"
for f in 1 0; do
  CULMEN_BENCH_FUSED_MERGE=$f CULMEN_BENCH_DECODE_SHAPES="$SH" timeout 70 python3 -m culmen bench kvcache_decode --no-graph \
    --json $OUT/decode-fused$f.json > $OUT/decode-fused$f.log 2>&1; echo "bench fused=$f rc=$?"
  grep -E "^B|culmen  |torch  |roofline|summary|kvcache_decode  " $OUT/decode-fused$f.log | head -40
done
