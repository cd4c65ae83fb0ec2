# Attention tuning run on the GPU machine: bash scripts/attn_run.sh [kinds...] (writes $OUT/tune-*.json)
export PYTHONPATH=$PWD CULMEN_GIT_COMMIT=${CULMEN_GIT_COMMIT:-wip}
D=${D:-128}
for kind in "${@:-fwd dkdv dq}"; do
  for k in $kind; do
    python3 scripts/tune_attention.py --kind "$k" --d "$D" --json "$OUT/tune-$k-d$D.json" 2>&1 | grep -v Warning
  done
done
