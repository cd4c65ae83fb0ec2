# Attention tuning run on the GPU machine: D=128 bash scripts/attn_run.sh KIND... (writes $OUT/tune-*.json)
export PYTHONPATH=$PWD CULMEN_GIT_COMMIT=${CULMEN_GIT_COMMIT:-wip}
for spec in "$@"; do  # KIND or KIND:D
  k=${spec%%:*}; d=${spec#*:}; [[ $d == "$spec" ]] && d=${D:-128}
  python3 scripts/tune_attention.py --kind "$k" --d "$d" --json "$OUT/tune-$k-d$d.json" 2>&1 | grep -v Warning
done
