# Attention tuning run on the GPU machine: D=128 bash scripts/attn_run.sh KIND[:D[:TMA]]... (writes $OUT/tune-*.json)
export PYTHONPATH=$PWD CULMEN_GIT_COMMIT=${CULMEN_GIT_COMMIT:-wip}
for spec in "$@"; do
  IFS=: read -r k d tma <<<"$spec"
  d=${d:-${D:-128}}; tma=${tma:-0}
  CULMEN_ATTN_TMA=$tma python3 scripts/tune_attention.py --kind "$k" --d "$d" ${CONFIGS:+--configs "$CONFIGS"} \
    --json "$OUT/tune-$k-d$d-tma$tma.json" 2>&1 | grep -v Warning
done
