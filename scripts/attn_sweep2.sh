# Second sweep of this session: deterministic backward kernels at d128/d64, everything at d256.
export PYTHONPATH=$PWD
CONFIGS="64,128,8,3 64,128,8,2 32,128,8,3 64,64,4,3 32,64,4,3 64,128,4,3" bash scripts/attn_run.sh dkdv:128 dkdv:64
CONFIGS="128,64,8,3 128,64,8,2 128,32,4,3 64,64,4,3 128,128,8,3 64,64,4,2" bash scripts/attn_run.sh dq:128 dq:64
CONFIGS="64,64,4,2 64,64,8,2 128,64,8,2 64,32,4,2 128,32,8,2 64,64,4,3" bash scripts/attn_run.sh fwd:256 dq:256
CONFIGS="32,64,4,2 32,64,8,2 64,64,8,2 32,32,4,2 64,32,4,2 16,64,4,2" bash scripts/attn_run.sh dkdv:256
