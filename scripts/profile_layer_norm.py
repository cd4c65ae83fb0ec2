"""Where does a layer_norm fwd+bwd call spend its time? GPU kernel times vs host overhead."""

import cProfile
import os
import pstats
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from culmen.bench.tuning import host_us  # noqa: E402
from culmen.ops.layer_norm import launch, layer_norm  # noqa: E402


def wall(fn, n=50):
    """Milliseconds per call."""
    return host_us(fn, n, warmup=1) / 1e3


def main():
    M, N = int(sys.argv[1]), int(sys.argv[2])
    dtype = torch.bfloat16
    x = torch.randn(M, N, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(N, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=dtype)
    layer_norm(x, w, b)
    x2 = x.detach()
    y, _, mean, rstd, *_ = launch.layer_norm_fwd(x2, w.detach(), b.detach(), None, None, None, None, None, None,
                                                 1e-5, 0.0, False, False, dtype, dtype, False, False)

    def fwd_launch():
        launch.layer_norm_fwd(x2, w.detach(), b.detach(), None, None, None, None, None, None, 1e-5, 0.0, False,
                              False, dtype, dtype, False, False)

    def bwd_launch():
        launch.layer_norm_bwd(dy, None, None, x2, w.detach(), b.detach(), None, None, None, None, mean, rstd, 1e-5,
                              0.0, False, False, False, False, False, dtype, dtype, dtype, False)

    def fwd_op():
        with torch.no_grad():
            layer_norm(x, w, b)

    def fwdbwd():
        o = layer_norm(x, w, b)
        torch.autograd.grad(o.y, [x, w, b], dy)

    def torch_fwdbwd():
        y = F.layer_norm(x, (N,), w, b)
        torch.autograd.grad(y, [x, w, b], dy)

    # The fast launch path (second call onwards) must give the results of Triton's normal path.
    def grads():
        o = layer_norm(x, w, b, residual=x.detach() * 0.5, return_residual=True)
        return [o.y, o.residual_out, *torch.autograd.grad((o.y.float() * dy).sum(), [x, w, b])]
    os.environ["CULMEN_FAST_LAUNCH"] = "0"
    slow = grads()
    os.environ["CULMEN_FAST_LAUNCH"] = "1"
    grads()
    fast = grads()
    print("fast-launch max diff", max((a.float() - b.float()).abs().max().item() for a, b in zip(slow, fast)))
    for name, fn in [("fwd_launch", fwd_launch), ("bwd_launch", bwd_launch), ("fwd_op", fwd_op),
                     ("fwdbwd", fwdbwd), ("torch_fwdbwd", torch_fwdbwd)]:
        print(f"{M}x{N} {name:14s} wall {wall(fn):.3f} ms")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fwdbwd()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
    if os.environ.get("NO_CPROFILE"):
        return
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        fwdbwd()
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
