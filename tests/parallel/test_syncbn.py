"""``culmen.parallel.SyncBatchNorm`` across gloo ranks against ``BatchNorm`` on the concatenated batch.

Each rank holds a slice of one batch (uneven slices, one of them empty in a 3-rank case); the float64
oracle (``F.batch_norm`` on the whole batch) gives the output and input gradient of every slice, the
weight/bias gradients (the sum of the ranks' shares) and the running statistics after two steps.
Cases run on the reference path and on the Triton kernels under the interpreter (selected per case
with ``culmen.ops.backend.set_backend``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from dist_harness import run_group

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
TOL = {F32: 5e-5, F16: 1e-2, BF16: 5e-2, F64: 1e-9}


def _cmp(failures, name, got, expect, dtype):
    got = got.cpu()
    tol = TOL[dtype] * max(1.0, expect.abs().max().item() if expect.numel() else 1.0)
    err = (got.double() - expect).abs().max().item() if got.numel() else 0.0
    if not (got.shape == expect.shape and err <= tol):
        failures.append(f"{name}: shape {tuple(got.shape)} vs {tuple(expect.shape)}, max err {err:.3g} > {tol:.3g}")


def _syncbn_worker(rank, world, cases):
    from culmen.ops.backend import set_backend
    from culmen.ops.batch_norm import launch as bn_launch
    from culmen.ops.batch_norm import sync_batch_norm_ref
    from culmen.parallel import SyncBatchNorm, create_syncbn_process_group

    failures = []
    dev = torch.device("cuda", rank) if cases and cases[0].get("device") == "cuda" else torch.device("cpu")
    default_tuning = dict(bn_launch.TUNING)
    for c in cases:
        set_backend(c["backend"])
        bn_launch.TUNING.update(default_tuning, **c.get("tuning", {}))
        name = f"{c['name']}[{c['backend']}]"
        sizes, rest, dtype, layout = c["sizes"], c["rest"], c.get("dtype", F32), c.get("layout", "nchw")
        relu, use_z = c.get("relu", False), c.get("z", False)
        C = rest[-1] if layout == "flag" else rest[0]
        group = create_syncbn_process_group(c["group_size"]) if "group_size" in c else None
        members = list(range(world))
        if group is not None:
            g0 = (rank // c["group_size"]) * c["group_size"]
            members = list(range(g0, g0 + c["group_size"]))
        gen = torch.Generator().manual_seed(7)
        offs = torch.linspace(-2, 2, C)
        bn = SyncBatchNorm(C, momentum=c.get("momentum", 0.1), process_group=group, channel_last=(layout == "flag"),
                           fuse_relu=relu).to(dev)
        with torch.no_grad():
            bn.weight.copy_(torch.rand(C, generator=gen) + 0.5)
            bn.bias.copy_(torch.randn(C, generator=gen))
        ref_rm, ref_rv = bn.running_mean.double().cpu().clone(), bn.running_var.double().cpu().clone()
        for it in range(2):
            full = torch.randn(sum(sizes), *rest, generator=gen) * 2
            full = full + (offs if layout == "flag" else offs.view(-1, *([1] * (len(rest) - 1))))
            zfull = torch.randn(sum(sizes), *rest, generator=gen)
            dyfull = torch.randn(sum(sizes), *rest, generator=gen)
            lo = sum(sizes[:rank])
            sl = slice(lo, lo + sizes[rank])
            x = full[sl].to(dev, dtype)
            if layout == "fmt":
                x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
            x.requires_grad_()
            z = zfull[sl].to(dev, dtype).requires_grad_() if use_z else None
            y = bn(x, z) if use_z else bn(x)
            y.backward(dyfull[sl].to(dev, dtype))
            if layout == "fmt" and sizes[rank] > 1:
                assert_fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
                if not y.is_contiguous(memory_format=assert_fmt):
                    failures.append(f"{name}: output lost the channels_last layout")
            # Oracle on the concatenation of the group's slices.
            glo = sum(sizes[:members[0]])
            gsl = slice(glo, glo + sum(sizes[m] for m in members))
            xr = full[gsl].to(dtype).double().requires_grad_()
            zr = zfull[gsl].to(dtype).double().requires_grad_() if use_z else None
            wr = bn.weight.detach().double().cpu().requires_grad_()
            br = bn.bias.detach().double().cpu().requires_grad_()
            mom = c.get("momentum", 0.1)
            mom = 1.0 / (it + 1) if mom is None else mom  # None: cumulative average
            yr = sync_batch_norm_ref(xr, wr, br, ref_rm, ref_rv, True, mom, bn.eps, z=zr,
                                     channel_last=(layout == "flag"), fuse_relu=relu)
            yr.backward(dyfull[gsl].double())
            part = slice(lo - glo, lo - glo + sizes[rank])
            _cmp(failures, f"{name} it{it} y", y.detach(), yr.detach()[part], dtype)
            _cmp(failures, f"{name} it{it} dx", x.grad, xr.grad[part], dtype)
            if use_z:
                _cmp(failures, f"{name} it{it} dz", z.grad, zr.grad[part], dtype)
            dw, db = bn.weight.grad.clone(), bn.bias.grad.clone()
            dist.all_reduce(dw, group=group)
            dist.all_reduce(db, group=group)
            _cmp(failures, f"{name} it{it} dweight", dw, wr.grad, dtype)
            _cmp(failures, f"{name} it{it} dbias", db, br.grad, dtype)
            _cmp(failures, f"{name} it{it} running_mean", bn.running_mean, ref_rm, dtype)
            _cmp(failures, f"{name} it{it} running_var", bn.running_var, ref_rv, dtype)
            bn.zero_grad()
        # Eval: the running statistics, no communication.
        bn.eval()
        xe = full[sl].to(dev, dtype)
        ye = bn(xe)
        yre = sync_batch_norm_ref(xe.double().cpu(), bn.weight.double().cpu(), bn.bias.double().cpu(), ref_rm,
                                  ref_rv, False, 0.0,
                                  bn.eps, channel_last=(layout == "flag"), fuse_relu=relu)
        _cmp(failures, f"{name} eval y", ye.detach(), yre.detach(), dtype)
        if int(bn.num_batches_tracked) != 2:
            failures.append(f"{name}: num_batches_tracked {int(bn.num_batches_tracked)}")
    return failures


def _run(world, cases):
    results = run_group(_syncbn_worker, world, cases, env={"TRITON_INTERPRET": "1"})
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:30])


def test_syncbn_2_ranks():
    T, R = "triton", "reference"
    _run(2, [
        dict(name="nchw-uneven", backend=T, sizes=(3, 5), rest=(3, 4, 5)),
        dict(name="nchw-uneven", backend=R, sizes=(3, 5), rest=(3, 4, 5)),
        dict(name="fmt-bf16-relu-z", backend=T, sizes=(4, 2), rest=(5, 3, 3), dtype=BF16, layout="fmt", relu=True,
             z=True),
        dict(name="flag-fp16", backend=T, sizes=(2, 3), rest=(3, 3, 6), dtype=F16, layout="flag"),
        dict(name="2d-momentum-none", backend=T, sizes=(7, 1), rest=(6,), momentum=None),
        dict(name="3d-bf16-relu", backend=R, sizes=(2, 6), rest=(4, 9), dtype=BF16, relu=True),
        dict(name="5d-fmt", backend=T, sizes=(2, 1), rest=(3, 2, 3, 2), layout="fmt"),
        dict(name="groups-of-1", backend=T, sizes=(3, 4), rest=(2, 5), group_size=1),
        # Each rank merges its split statistics into one row before the all-gather.
        dict(name="merged-rows", backend=T, sizes=(4, 3), rest=(3, 5, 4), layout="fmt", relu=True, z=True,
             tuning={"max_gather_bytes": 0, "reduce_tile": 16}),
    ])


def test_syncbn_3_ranks():
    T, R = "triton", "reference"
    _run(3, [
        dict(name="nchw-uneven-with-empty", backend=T, sizes=(4, 0, 3), rest=(3, 5)),
        dict(name="nchw-uneven-with-empty", backend=R, sizes=(4, 0, 3), rest=(3, 5)),
        dict(name="flag-relu-z", backend=T, sizes=(1, 2, 4), rest=(3, 4), layout="flag", relu=True, z=True),
        dict(name="fmt-f16", backend=R, sizes=(2, 3, 2), rest=(4, 2, 3), dtype=F16, layout="fmt"),
        dict(name="groups-of-3", backend=T, sizes=(2, 2, 3), rest=(2, 3), group_size=3),
    ])


# ---------------------------------------------------------------------------------------------
# SyncBatchNorm inside DDP, convert_syncbn_model
# ---------------------------------------------------------------------------------------------


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        h = self.inorm(h)
        return self.head(h.mean((2, 3)))


def _ddp_syncbn_worker(rank, world):
    from culmen.ops.backend import set_backend
    from culmen.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model

    set_backend("triton")
    torch.manual_seed(0)
    ref = ConvNet().double()
    torch.manual_seed(0)
    net = convert_syncbn_model(ConvNet(), channel_last=False)
    out = {"converted": isinstance(net.bn, SyncBatchNorm), "inorm_kept": type(net.inorm) is nn.InstanceNorm2d,
           "weights_copied": torch.equal(net.bn.weight.double(), ref.bn.weight)}
    ddp = DistributedDataParallel(net, message_size=10)
    gen = torch.Generator().manual_seed(3)
    errs = []
    for _ in range(2):
        x = torch.randn(world * 3, 3, 5, 5, generator=gen)
        net.zero_grad()
        ddp(x[rank * 3:(rank + 1) * 3].contiguous(memory_format=torch.channels_last)).square().mean().backward()
        ref.zero_grad()
        ref(x.double()).square().mean().backward()
        for (n, p), q in zip(net.named_parameters(), ref.parameters()):
            errs.append((n, (p.grad.double() - q.grad).abs().max().item()))
    out["max_err"] = max(e for _, e in errs)
    out["worst"] = max(errs, key=lambda t: t[1])
    out["running_err"] = (net.bn.running_var.double() - ref.bn.running_var).abs().max().item()
    return out


def test_syncbn_in_ddp_equals_single_process():
    for out in run_group(_ddp_syncbn_worker, 2, env={"TRITON_INTERPRET": "1"}):
        assert out["converted"] and out["inorm_kept"] and out["weights_copied"]
        assert out["max_err"] < 1e-4, out["worst"]
        assert out["running_err"] < 1e-5


def test_convert_syncbn_model_single_process():
    from culmen.parallel import SyncBatchNorm, convert_syncbn_model

    bn = nn.BatchNorm1d(5, momentum=0.3, eps=1e-3)
    bn.weight.requires_grad_(False)
    bn.running_mean.fill_(0.5)
    bn.eval()
    s = convert_syncbn_model(bn, channel_last=True)
    assert isinstance(s, SyncBatchNorm) and s.channel_last and not s.training
    assert s.eps == 1e-3 and s.momentum == 0.3 and not s.weight.requires_grad
    assert s.running_mean is bn.running_mean
    seq = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5))
    conv = convert_syncbn_model(seq)
    assert isinstance(conv[1], SyncBatchNorm) and isinstance(conv[0], nn.Linear)
    # Without torch.distributed it is a plain (single-process) batch norm.
    x = torch.randn(6, 5)
    torch.testing.assert_close(conv[1](x), nn.functional.batch_norm(x, None, None, conv[1].weight, conv[1].bias,
                                                                    True), rtol=1e-5, atol=1e-5)
