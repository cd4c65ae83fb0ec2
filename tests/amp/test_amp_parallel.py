"""amp with culmen.parallel: DistributedDataParallel applied after initialize (gloo, one process) and
LARC as the optimizer, as in Apex's run_amp tests."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from amp_testutils import MLP, clean_amp, fresh, make_data  # noqa: F401 - clean_amp is an autouse fixture

from culmen import amp
from culmen.amp._amp_state import _amp_state

parallel = pytest.importorskip("culmen.parallel")
# The class itself: once some test has imported the submodule culmen.parallel.LARC, the package
# attribute of that name is the module, not the class.
LARC = pytest.importorskip("culmen.parallel.LARC").LARC


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ddp_after_initialize(gloo, level):
    x, y = make_data(n=64)
    model, opt = fresh(bn=False)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    ddp = parallel.DistributedDataParallel(model)
    _amp_state.loss_scalers[0]._loss_scale = 256.0
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = F.mse_loss(ddp(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 2


def test_ddp_before_initialize_is_rejected(gloo):
    model, opt = fresh(bn=False)
    with pytest.raises(RuntimeError, match="AFTER"):
        amp.initialize(parallel.DistributedDataParallel(model), opt, verbosity=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_larc_optimizer(level):
    x, y = make_data(n=64)
    torch.manual_seed(0)
    model = MLP()
    opt = LARC(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert isinstance(opt, LARC)
    _amp_state.loss_scalers[0]._loss_scale = 256.0
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x).float(), y) * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
