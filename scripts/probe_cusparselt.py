"""Which cuSPARSELt / semi-structured call fails on this GPU? Each step runs in a fresh process (a sticky CUDA
error would poison the rest) with CUDA_LAUNCH_BLOCKING=1, and prints OK or the first line of its error.

    python3 scripts/probe_cusparselt.py
"""

from __future__ import annotations

import os
import subprocess
import sys

PRELUDE = """
import torch, torch.nn.functional as F
torch.manual_seed(0)
dt = torch.float16
W = torch.randn(3072, 768, device="cuda", dtype=dt)
m = torch.zeros_like(W, dtype=torch.bool).view(-1, 4)
m[:, :2] = True
W = (W.view(-1, 4) * m).view(3072, 768)
x = torch.randn(128, 768, device="cuda", dtype=dt)
b = torch.randn(3072, device="cuda", dtype=dt)
ref = F.linear(x.float(), W.float(), b.float())
def check(y):
    err = (y.float() - ref).abs().max().item()
    assert err < 0.5, err
    torch.cuda.synchronize()
"""

STEPS = {
    "versions": "print(torch.__version__, torch.version.cuda, torch.backends.cusparselt.is_available(), "
                "torch.backends.cusparselt.version(), torch.cuda.get_device_name())",
    "torch_subclass_fp16": "from torch.sparse import to_sparse_semi_structured as s\n"
                           "check(F.linear(x, s(W), b))",
    "torch_subclass_bf16": "from torch.sparse import to_sparse_semi_structured as s\n"
                           "check(F.linear(x.bfloat16(), s(W.bfloat16()), b.bfloat16()))",
    "compress": "c = torch._cslt_compress(W); torch.cuda.synchronize(); print(c.shape, c.dtype)",
    "mm_alg0_plain": "c = torch._cslt_compress(W)\n"
                     "check(torch._cslt_sparse_mm(c, x.t(), None).t() + b)",
    "mm_alg0_bias_T": "c = torch._cslt_compress(W)\n"
                      "check(torch._cslt_sparse_mm(c, x.t(), bias=b, transpose_result=True, alg_id=0))",
    "mm_search": "c = torch._cslt_compress(W)\n"
                 "print(torch._cslt_sparse_mm_search(c, x.t(), bias=b, transpose_result=True))\n"
                 "torch.cuda.synchronize()",
    "mm_each_alg": "c = torch._cslt_compress(W)\n"
                   "n = torch.backends.cusparselt.get_max_alg_id() if hasattr(torch.backends.cusparselt, "
                   "'get_max_alg_id') else 4\n"
                   "for a in range(n):\n"
                   "    try:\n"
                   "        check(torch._cslt_sparse_mm(c, x.t(), bias=b, transpose_result=True, alg_id=a)); "
                   "print('alg', a, 'ok')\n"
                   "    except Exception as e:\n"
                   "        print('alg', a, type(e).__name__, str(e).splitlines()[0]); break",
    "graph_capture": "c = torch._cslt_compress(W)\n"
                     "torch._cslt_sparse_mm(c, x.t(), bias=b, transpose_result=True)\n"
                     "g = torch.cuda.CUDAGraph()\n"
                     "with torch.cuda.graph(g):\n"
                     "    y = torch._cslt_sparse_mm(c, x.t(), bias=b, transpose_result=True)\n"
                     "g.replay(); check(y)",
}
for backend in ("cusparselt-graph", "cusparselt", "torch"):
    STEPS[f"culmen_{backend}"] = (
        "from culmen.contrib.sparsity import semi_structured as ss\n"
        "lin = torch.nn.Linear(768, 3072, device='cuda', dtype=dt)\n"
        "with torch.no_grad(): lin.weight.copy_(W); lin.bias.copy_(b)\n"
        f"print(ss.enable_semi_structured(lin, backend={backend!r}), ss.semi_structured_status(lin))\n"
        "check(lin(x)); check(lin(x))")


def main() -> int:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for name, body in STEPS.items():
        r = subprocess.run([sys.executable, "-c", PRELUDE + body], env=env, capture_output=True, text=True,
                           timeout=120)
        out = (r.stdout.strip() + " " + (r.stderr.strip().splitlines() or [""])[-1]).strip()
        print(f"{name:24s} rc={r.returncode} {out[:600]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
