"""``culmen.transformer.pipeline_parallel.utils`` and ``_timers``: the microbatch calculator, microbatch
slicing, GPT masks and position ids against a direct definition, model unwrapping, printing helpers,
timers; and on 2 spawned gloo ranks ``calc_params_l2_norm`` (tensor-parallel and shared parameters),
``average_losses_across_data_parallel_group`` and ``build_model``."""

from __future__ import annotations

import contextlib
import io
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from culmen.transformer.enums import ModelType
from culmen.transformer.pipeline_parallel import utils
from culmen.transformer.pipeline_parallel._timers import _Timers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_calculator():
    saved = utils._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    utils._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
    yield
    utils._GLOBAL_NUM_MICROBATCHES_CALCULATOR = saved


def test_microbatch_calculator_constant_and_rampup():
    with pytest.raises(RuntimeError, match="setup_microbatch_calculator"):
        utils.get_num_microbatches()
    utils.setup_microbatch_calculator(0, None, 24, 3, 2)
    assert (utils.get_num_microbatches(), utils.get_micro_batch_size(), utils.get_current_global_batch_size()) == \
        (4, 3, 24)
    with pytest.raises(RuntimeError, match="already initialized"):
        utils.setup_microbatch_calculator(0, None, 24, 3, 2)
    # ramp-up 8 -> 24 in steps of 8 over 100 samples: 8, then 16 after 50 samples, 24 after 100
    utils._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
    utils.setup_microbatch_calculator(1, [8, 8, 100], 24, 2, 2)
    assert (utils.get_current_global_batch_size(), utils.get_num_microbatches()) == (8, 2)
    utils.update_num_microbatches(60)
    assert (utils.get_current_global_batch_size(), utils.get_num_microbatches()) == (16, 4)
    utils.update_num_microbatches(101, consistency_check=False)
    assert (utils.get_current_global_batch_size(), utils.get_num_microbatches()) == (24, 6)
    utils._reconfigure_microbatch_calculator(0, None, 10, 5, 1)
    assert utils.get_num_microbatches() == 2


def test_get_kth_microbatch_and_split():
    utils.setup_microbatch_calculator(0, None, 12, 3, 1)
    x = torch.randn(12, 5)
    y = torch.arange(12)
    for k in range(4):
        mx, my = utils.get_kth_microbatch([x, y], k)
        assert torch.equal(mx, x[3 * k:3 * k + 3]) and torch.equal(my, y[3 * k:3 * k + 3])
        assert mx.data_ptr() == x[3 * k].data_ptr()  # a view, no copy
    assert utils.get_kth_microbatch(None, 1) is None
    assert utils.get_kth_microbatch(x, 1) is x  # not a list: unchanged, as Apex
    with pytest.raises(ValueError, match=r"microbatch 4 needs samples \[12, 15\).*batch\[0\] has only 12"):
        utils.get_kth_microbatch([x], 4)
    parts = list(utils._split_batch_into_microbatch([x, y]))
    assert len(parts) == 4 and all(torch.equal(p[1], y[3 * i:3 * i + 3]) for i, p in enumerate(parts))


def _ltor_reference(data, eod, reset_pos, reset_mask, eod_mask_loss):
    """Direct definition: document id of a token = number of EODs strictly before it."""
    b, s = data.shape
    is_eod = data == eod
    doc = torch.cumsum(is_eod.long(), 1) - is_eod.long()
    q = torch.arange(s).view(s, 1)
    k = torch.arange(s).view(1, s)
    allowed = (k <= q).expand(b, s, s).clone()
    if reset_mask:
        allowed &= doc.unsqueeze(2) == doc.unsqueeze(1)
    else:
        allowed = allowed[:1]
    pos = torch.arange(s).expand(b, s).clone()
    if reset_pos:
        for r in range(b):
            for j in range(s):
                starts = [i + 1 for i in range(j) if is_eod[r, i]]
                pos[r, j] = j - (starts[-1] if starts else 0)
    loss_mask = torch.ones(b, s)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    return ~allowed.unsqueeze(1), loss_mask, pos


@pytest.mark.parametrize("reset_pos,reset_mask,eod_mask_loss",
                         [(False, False, False), (True, False, True), (False, True, False), (True, True, True)])
def test_get_ltor_masks_and_position_ids(reset_pos, reset_mask, eod_mask_loss):
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 4, (3, 11), generator=g)  # token 0 is the EOD: several per row
    data[0, -1] = 0
    data[2] = 1  # a row without any EOD
    mask, loss_mask, pos = utils.get_ltor_masks_and_position_ids(data, 0, reset_pos, reset_mask, eod_mask_loss)
    ref_mask, ref_loss, ref_pos = _ltor_reference(data, 0, reset_pos, reset_mask, eod_mask_loss)
    assert mask.dtype == torch.bool and mask.shape == ref_mask.shape
    assert torch.equal(mask, ref_mask)
    assert loss_mask.dtype == torch.float32 and torch.equal(loss_mask, ref_loss)
    assert pos.dtype == torch.long and torch.equal(pos, ref_pos)
    with pytest.raises(ValueError, match="2-D"):
        utils.get_ltor_masks_and_position_ids(data[0], 0, reset_pos, reset_mask, eod_mask_loss)


class _Wrapper(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_model_helpers():
    inner = nn.Linear(2, 2)
    assert utils.listify_model(inner) == [inner]
    lst = [inner]
    assert utils.listify_model(lst) is lst
    wrapped = _Wrapper(_Wrapper(inner))
    assert utils.unwrap_model(wrapped, (_Wrapper,)) is inner
    assert utils.unwrap_model([wrapped, inner], (_Wrapper,)) == [inner, inner]
    assert utils.unwrap_model(wrapped) is wrapped  # only torch DDP by default
    assert utils.get_model_type(inner) == ModelType.encoder_or_decoder
    inner.model_type = ModelType.encoder_and_decoder
    assert utils.get_model_type(inner) == ModelType.encoder_and_decoder
    p = nn.Parameter(torch.zeros(1))
    assert utils.param_is_not_shared(p)
    p.shared = True
    assert not utils.param_is_not_shared(p)


def test_printing_and_timers(capsys):
    utils.print_rank_0("hello-0")
    utils.print_rank_last("hello-last")
    utils.report_memory("step")
    out = capsys.readouterr().out
    assert "hello-0" in out and "hello-last" in out and "step memory (MB)" in out

    timers = _Timers()
    t = timers("fwd")
    assert timers("fwd") is t
    t.start()
    with pytest.raises(RuntimeError, match="already been started"):
        t.start()
    sum(range(20000))
    t.stop()
    with pytest.raises(RuntimeError, match="not started"):
        t.stop()
    e = t.elapsed(reset=False)
    assert e > 0 and t.elapsed(reset=True) == e and t.elapsed() == 0.0
    timers.log(["fwd"])
    assert "time (ms) | fwd:" in capsys.readouterr().out

    class Writer:
        def __init__(self):
            self.rows = []

        def add_scalar(self, *args):
            self.rows.append(args)

    w = Writer()
    timers.write(["fwd"], w, 7)
    assert w.rows == [("fwd-time", 0.0, 7)]
    with pytest.raises(ValueError, match="normalizer"):
        timers.log(["fwd"], normalizer=0.0)
    with pytest.raises(RuntimeError, match="timers is not initialized"):
        utils.get_timers()


def _dist_worker(rank, world):
    from culmen.transformer import parallel_state as ps
    from culmen.transformer.pipeline_parallel import build_model
    from culmen.transformer.pipeline_parallel.utils import (
        average_losses_across_data_parallel_group,
        calc_params_l2_norm,
    )

    failures = []
    try:
        # TP = 2: a tensor-parallel weight holds different shards on the two ranks (both count); a replicated
        # bias counts once; a shared parameter not at all.
        ps.initialize_model_parallel(2, 1)
        g = torch.Generator().manual_seed(5)
        shards = [torch.randn(3, 4, generator=g) for _ in range(2)]
        bias = torch.randn(4, generator=g)
        shared = torch.randn(6, generator=g)
        m = nn.Module()
        m.w = nn.Parameter(shards[rank].clone())
        m.w.tensor_model_parallel = True
        m.b = nn.Parameter(bias.clone())
        m.s = nn.Parameter(shared.clone())
        m.s.shared = True
        want = torch.sqrt(shards[0].double().square().sum() + shards[1].double().square().sum()
                          + bias.double().square().sum()).item()
        for bf16 in (False, True):
            got = calc_params_l2_norm([m], bf16)
            if not isinstance(got, float) or abs(got - want) > 1e-5 * want:
                failures.append(f"calc_params_l2_norm(bf16={bf16}) = {got}, expected {want}")
        ps.destroy_model_parallel()

        # DP = 2: each loss averaged over the two ranks.
        ps.initialize_model_parallel(1, 1)
        losses = [torch.tensor(1.5 + rank, requires_grad=True), torch.tensor(-2.0 * (rank + 1))]
        avg = average_losses_across_data_parallel_group(losses)
        if avg.requires_grad or not torch.allclose(avg, torch.tensor([2.0, -3.0])):
            failures.append(f"average_losses_across_data_parallel_group gave {avg}")

        # build_model on one stage: pre/post_process flags, TP attributes, DDP over the data-parallel group.
        seen = []

        def provider(pre_process, post_process, width=3):
            seen.append((pre_process, post_process, width))
            return nn.Linear(width, 2)

        with contextlib.redirect_stdout(io.StringIO()) as out:
            model = build_model(provider, True, None, ModelType.encoder_or_decoder, width=5)
        if seen != [(True, True, 5)]:
            failures.append(f"build_model called the provider with {seen}")
        if (rank == 0) != ("number of parameters" in out.getvalue()):
            failures.append(f"rank {rank} parameter-count print: {out.getvalue()!r}")
        if len(model) != 1 or not isinstance(model[0], torch.nn.parallel.DistributedDataParallel):
            failures.append(f"build_model returned {model}")
        elif not all(p.tensor_model_parallel is False and p.partition_dim == -1 for p in model[0].parameters()):
            failures.append("build_model did not set the default tensor-parallel attributes")
        ps.destroy_model_parallel()

        # 2 stages, 2 virtual chunks each: pre_process only on (stage 0, chunk 0), post_process on (1, 1).
        ps.initialize_model_parallel(1, 2, 2)
        seen.clear()
        model = build_model(provider, False, 2)
        want_flags = [(rank == 0 and c == 0, rank == 1 and c == 1, 3) for c in range(2)]
        if seen != want_flags or len(model) != 2:
            failures.append(f"virtual build_model flags {seen}, expected {want_flags}")
    except Exception:
        failures.append(traceback.format_exc())
    return failures


def test_utils_on_2_ranks():
    results = run_group(_dist_worker, 2, timeout=90)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
