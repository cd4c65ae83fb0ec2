"""culmen.amp + culmen.parallel.DistributedDataParallel: after amp.initialize, DDP over 2 gloo ranks
gives the same fp32 master parameters as one process training on the whole batch with the same amp
set-up (bf16 on CPU: O4 = O1-style autocast, O5 = O2-style master weights)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_group

STEPS, BATCH = 3, 8


def _train(rank: int, world: int, level: str, use_ddp: bool) -> list[list]:
    import torch.nn as nn
    import torch.nn.functional as F

    from culmen import amp
    from culmen.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level, loss_scale=128.0, verbosity=0)
    net = DistributedDataParallel(model, allreduce_always_fp32=True) if use_ddp else model
    g = torch.Generator().manual_seed(1)
    per = BATCH // world
    for _ in range(STEPS):
        x = torch.randn(BATCH, 16, generator=g)
        y = torch.randn(BATCH, 4, generator=g)
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad()
        loss = F.mse_loss(net(xs).float(), ys)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    # Plain lists: tensors sent through the result queue would need the (exited) worker's shared memory.
    return [p.detach().float().tolist() for p in amp.master_params(opt)]


@pytest.mark.parametrize("level", ["O4", "O5"])
def test_amp_ddp_matches_single_process_full_batch(level):
    ranks = run_group(_train, 2, level, True)
    (single,) = run_group(_train, 1, level, False)
    assert ranks[0] == ranks[1], "ranks disagree after DDP steps"
    for got, want in zip(ranks[0], single):
        got, want = torch.tensor(got), torch.tensor(want)
        # bf16 gradients of half batches, reduced in fp32, vs bf16 gradients of the whole batch.
        torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-3)
