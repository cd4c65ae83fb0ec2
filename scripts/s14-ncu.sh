#!/usr/bin/env bash
# session 14, last call: where the transposed Gluon backward's time goes against cuDNN's backward (d128 s2k, the
# widest gap), hardware counters by ncu without clock control (the device README: leave the clocks alone).
set -u
export PYTHONPATH=$PWD
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
nvidia-smi --query-gpu=name --format=csv,noheader
for c in "" "--causal"; do
  timeout 150 $NCU --clock-control none -k 'regex:attn_bwd_ws|bprop' -s 4 -c 2 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section Occupancy \
      --metrics 'regex:sm__pipe_tensor.*cycles_active.avg.pct_of_peak_sustained_active' \
      python3 scripts/ncu_attn_bwd_ws.py --d 128 --seqlen 2048 $c > $OUT/ncu-bwd-d128-s2k$c.log 2>&1
  echo "ncu $c rc=$?"
  grep -E '^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Thr|Memory Thr|SM Busy|Issue Slots Busy|Executed Ipc A|Shared|L1/TEX Hit|pipe_tensor|Registers Per|Achieved Occ|Stall|Warp Cycles Per Issued' $OUT/ncu-bwd-d128-s2k$c.log | head -60
done
