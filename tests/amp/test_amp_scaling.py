"""Loss scaling: the LossScaler rules, overflow skipping (params and optimizer state untouched),
back-off and regrowth, hysteresis, clamps, amp.state_dict, and one host sync per step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from amp_testutils import MLP, clean_amp, fresh, make_data  # noqa: F401 - clean_amp is an autouse fixture

from culmen import amp
from culmen.amp import LossScaler
from culmen.amp._amp_state import _amp_state

# ----------------------------------------------------------------------------- LossScaler alone


def _flag(scaler: LossScaler, overflow: bool) -> bool:
    """One step of ``scaler`` whose (single) gradient does or does not hold an inf."""
    g = torch.tensor([1.0, float("inf") if overflow else 2.0])
    out = torch.empty_like(g)
    scaler.clear_overflow_state()
    scaler.unscale([g], [out], scaler.loss_scale())
    return scaler.update_scale()


def test_dynamic_defaults_and_window():
    s = LossScaler("dynamic")
    assert s.loss_scale() == 2.0**16 and s.dynamic and s._scale_seq_len == 2000
    for _ in range(1999):
        assert s.update_scale() is False
    assert s.loss_scale() == 2.0**16
    s.update_scale()
    assert s.loss_scale() == 2.0**17 and s._unskipped == 0


def test_backoff_regrowth_and_clamps():
    s = LossScaler("dynamic", init_scale=8.0, scale_window=3, min_loss_scale=2.0, max_loss_scale=16.0)
    assert _flag(s, True) is True and s.loss_scale() == 4.0
    assert _flag(s, True) is True and s.loss_scale() == 2.0
    assert _flag(s, True) is True and s.loss_scale() == 2.0  # floor
    for _ in range(2):
        assert _flag(s, False) is False
    assert s.loss_scale() == 2.0
    assert _flag(s, False) is False and s.loss_scale() == 4.0  # third clean step in a row
    for _ in range(9):
        _flag(s, False)
    assert s.loss_scale() == 16.0  # ceiling
    assert LossScaler("dynamic", init_scale=2.0**30).loss_scale() == 2.0**24  # init clamped to max


def test_overflow_resets_window():
    s = LossScaler("dynamic", init_scale=8.0, scale_window=3)
    _flag(s, False)
    _flag(s, False)
    _flag(s, True)
    assert s.loss_scale() == 4.0
    _flag(s, False)
    _flag(s, False)
    assert s.loss_scale() == 4.0
    _flag(s, False)
    assert s.loss_scale() == 8.0


def test_nan_counts_as_overflow():
    s = LossScaler("dynamic", init_scale=8.0)
    g = torch.tensor([float("nan"), 1.0]).half()
    s.clear_overflow_state()
    s.unscale([g], [torch.empty(2)], 8.0)
    assert s.update_scale() is True and s.loss_scale() == 4.0


def test_hysteresis_delays_backoff():
    s = LossScaler("dynamic", init_scale=64.0, scale_window=100, hysteresis=3)
    assert _flag(s, True) is True and s.loss_scale() == 64.0  # skipped, but not backed off yet
    assert _flag(s, True) is True and s.loss_scale() == 64.0
    assert _flag(s, True) is True and s.loss_scale() == 32.0  # third overflow in a row
    assert _flag(s, True) is True and s.loss_scale() == 16.0  # no clean step since: backs off again
    assert _flag(s, False) is False and s._hysteresis_tracker == 3
    assert _flag(s, True) is True and s.loss_scale() == 16.0  # tracker restored by the clean step


def test_hysteresis_matches_device_kernel():
    """culmen's host rule agrees with amp_C.update_scale_hysteresis step by step."""
    from culmen.multi_tensor_apply import amp_C

    pattern = [1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1]
    s = LossScaler("dynamic", init_scale=1024.0, scale_window=3, hysteresis=2)
    scale = torch.tensor([1024.0])
    growth, hyst = torch.tensor([0], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    for bad in pattern:
        _flag(s, bool(bad))
        amp_C.update_scale_hysteresis(scale, growth, hyst, torch.tensor([float(bad)]), 2.0, 0.5, 3, 2)
        assert s.loss_scale() == scale.item() and s._unskipped == growth.item()


def test_static_never_skips():
    s = LossScaler(128.0)
    assert not s.dynamic and s.loss_scale() == 128.0
    assert _flag(s, True) is False and s.loss_scale() == 128.0


@pytest.mark.parametrize("kwargs", [{"loss_scale": "dyn"}, {"loss_scale": -1.0}, {"loss_scale": float("inf")},
                                    {"loss_scale": "dynamic", "scale_factor": 1.0},
                                    {"loss_scale": "dynamic", "scale_window": 0},
                                    {"loss_scale": "dynamic", "hysteresis": 0},
                                    {"loss_scale": "dynamic", "min_loss_scale": 8.0, "max_loss_scale": 4.0}])
def test_scaler_bad_args(kwargs):
    with pytest.raises(ValueError):
        LossScaler(**kwargs)


def test_unscale_with_stashed_math():
    s = LossScaler("dynamic", init_scale=4.0)
    new, old, out = torch.tensor([8.0, -4.0]).half(), torch.tensor([1.0, 1.0]), torch.empty(2)
    s.clear_overflow_state()
    s.unscale_with_stashed([new], [old], [out])
    assert torch.equal(out, torch.tensor([3.0, 0.0]))
    assert s.update_scale() is False


# ----------------------------------------------------------------------- through amp.scale_loss


def _step(model, opt, x, y, poison: float | None = None, loss_id: int = 0):
    opt.zero_grad()
    out = model(x)
    loss = F.mse_loss(out.float(), y)
    if poison is not None:
        loss = loss * poison
    with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("level, dtype", [("O1", torch.float16), ("O2", torch.float16), ("O2", torch.bfloat16),
                                          ("O1", torch.bfloat16)])
@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_overflow_skips_step_and_backs_off(level, dtype, poison):
    x, y = make_data()
    model, opt = fresh()
    kw = {"cast_model_type": dtype} if level == "O2" else {"patch_torch_functions_type": dtype}
    model, opt = amp.initialize(model, opt, opt_level=level, loss_scale="dynamic", verbosity=0, **kw)
    scaler = _amp_state.loss_scalers[0]
    scaler._loss_scale = 256.0  # small enough that fp16 grads do not overflow by themselves
    _step(model, opt, x, y)
    _step(model, opt, x, y)
    params = copy.deepcopy(list(model.parameters()))
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    state = copy.deepcopy(opt.state_dict())
    _step(model, opt, x, y, poison=poison)
    assert scaler.loss_scale() == 128.0 and scaler._unskipped == 0
    for a, b in zip(params, model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(masters, amp.master_params(opt)):
        assert torch.equal(a, b)
    after = opt.state_dict()
    for k, v in state["state"].items():
        for name, t in v.items():
            assert torch.equal(t, after["state"][k][name]), name
    _step(model, opt, x, y)  # the next clean step is applied again
    assert any(not torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert scaler._unskipped == 1


def test_regrowth_after_window_through_scale_loss():
    x, y = make_data()
    model, opt = fresh(opt_cls=torch.optim.SGD, lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    scaler = _amp_state.loss_scalers[0]
    scaler._loss_scale, scaler._scale_seq_len = 256.0, 4
    _step(model, opt, x, y, poison=float("inf"))
    assert scaler.loss_scale() == 128.0
    for _ in range(3):
        _step(model, opt, x, y)
    assert scaler.loss_scale() == 128.0
    _step(model, opt, x, y)
    assert scaler.loss_scale() == 256.0


def test_hysteresis_through_initialize():
    x, y = make_data()
    model, opt = fresh()
    model, opt = amp.initialize(model, opt, opt_level="O2", hysteresis=2, verbosity=0)
    scaler = _amp_state.loss_scalers[0]
    scaler._loss_scale = 256.0
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, opt, x, y, poison=float("inf"))
    assert scaler.loss_scale() == 256.0  # held by the hysteresis, but the step was skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    _step(model, opt, x, y, poison=float("inf"))
    assert scaler.loss_scale() == 128.0
    sd = amp.state_dict()
    assert sd["loss_scaler0"] == {"loss_scale": 128.0, "unskipped": 0, "hysteresis_tracker": 0}


def test_min_max_loss_scale_through_initialize():
    x, y = make_data()
    model, opt = fresh()
    model, opt = amp.initialize(model, opt, opt_level="O2", min_loss_scale=64.0, max_loss_scale=2.0**10,
                                verbosity=0)
    scaler = _amp_state.loss_scalers[0]
    assert scaler.loss_scale() == 2.0**10
    for _ in range(6):
        _step(model, opt, x, y, poison=float("inf"))
    assert scaler.loss_scale() == 64.0


def test_delay_overflow_check_moves_check_to_step():
    x, y = make_data()
    model, opt = fresh()
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    scaler = _amp_state.loss_scalers[0]
    scaler._loss_scale = 256.0
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss = F.mse_loss(model(x).float(), y) * float("inf")
    with amp.scale_loss(loss, opt, delay_overflow_check=True) as scaled:
        scaled.backward()
    assert scaler.loss_scale() == 256.0  # not checked yet
    opt.step()
    assert scaler.loss_scale() == 128.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_one_host_sync_per_step(monkeypatch):
    x, y = make_data()
    model, opt = fresh()
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    _step(model, opt, x, y)
    calls = []
    orig_item = torch.Tensor.item

    def counting_item(self):
        calls.append(1)
        return orig_item(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    opt.zero_grad()
    loss = F.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert len(calls) == 1  # unscale + overflow check of every gradient: one read of the flag
    monkeypatch.undo()
    opt.step()


def test_amp_state_dict_round_trip():
    model, opt = fresh()
    amp.initialize(model, opt, opt_level="O1", num_losses=3, verbosity=0)
    for i, s in enumerate(_amp_state.loss_scalers):
        s._loss_scale, s._unskipped = 2.0 ** (10 + i), 7 * i
    sd = amp.state_dict()
    assert list(sd) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    assert sd["loss_scaler2"] == {"loss_scale": 2.0**12, "unskipped": 14}
    amp.deinitialize()
    model, opt = fresh()
    amp.initialize(model, opt, opt_level="O1", num_losses=3, verbosity=0)
    amp.load_state_dict(sd)
    assert [(s.loss_scale(), s._unskipped) for s in _amp_state.loss_scalers] == [(1024.0, 0), (2048.0, 7),
                                                                                  (4096.0, 14)]


def test_amp_load_state_dict_errors(capsys):
    model, opt = fresh()
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match='Unexpected key.*"bogus"'):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1}, "bogus": {}})
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1},
                         "loss_scaler1": {"loss_scale": 4.0, "unskipped": 2}})
    out = capsys.readouterr().out
    assert "2 entries, while 1 loss_scalers" in out and "Skipping loss_scaler[1]" in out
    assert _amp_state.loss_scalers[0].loss_scale() == 8.0


def test_static_scale_one_short_circuits_and_static_does_not_skip():
    x, y = make_data()
    model, opt = fresh()
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale=1.0, verbosity=0)
    loss = F.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.dtype == torch.float32 and torch.equal(scaled, loss)
        scaled.backward()
    amp.deinitialize()
    model, opt = fresh(opt_cls=torch.optim.SGD)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=4.0, verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, opt, x, y, poison=float("inf"))
    # Apex: a static scale is never checked, so the inf reaches the weights.
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---------------------------------------------------- sync-free path (optimizers taking found_inf)


def _fused(cls):
    return lambda params, lr: cls(params, lr=lr, fused=True)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_device_skip_leaves_params_and_state(monkeypatch, level, opt_cls):
    x, y = make_data()
    torch.manual_seed(0)
    model = MLP()
    opt = opt_cls(model.parameters(), lr=1e-2, fused=True)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    scaler = _amp_state.loss_scalers[0]
    scaler._loss_scale = 256.0
    _step(model, opt, x, y)
    _step(model, opt, x, y)
    params = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    state = copy.deepcopy(opt.state_dict())
    assert scaler.loss_scale() == 256.0  # applies the previous step's deferred update
    calls = []
    orig_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append(1) or orig_item(self))
    opt.zero_grad()
    loss = F.mse_loss(model(x).float(), y) * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert calls == []  # nothing read the flag on the host: the optimizer skipped on the device
    assert not hasattr(opt, "found_inf")
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(opt)))
    after = opt.state_dict()
    for k, v in state["state"].items():
        for name, t in v.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(after["state"][k][name])), name
    assert scaler.loss_scale() == 128.0 and scaler._unskipped == 0  # applied when read
    _step(model, opt, x, y)
    assert any(not torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 128.0, "unskipped": 1}


def test_device_skip_follows_the_same_scale_rule():
    """The deferred update reaches the same scales, skips and losses as the host-synced one."""
    x, y = make_data()
    poison_at = {2, 3, 9}
    runs = {}
    for fused in (False, True):
        amp.deinitialize()
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, fused=fused)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        scaler = _amp_state.loss_scalers[0]
        scaler._loss_scale, scaler._scale_seq_len = 256.0, 3
        trace = []
        for i in range(14):
            loss = _step(model, opt, x, y, poison=float("inf") if i in poison_at else None)
            trace.append((scaler.loss_scale(), scaler._unskipped, float(loss)))
        runs[fused] = trace
    assert runs[True] == runs[False]


def test_mixed_optimizers_fall_back_to_the_host_check():
    x, y = make_data()
    torch.manual_seed(0)
    a, b = MLP(), MLP()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)  # not fused: needs the host decision
    [a, b], [oa, ob] = amp.initialize([a, b], [oa, ob], opt_level="O2", verbosity=0)
    _amp_state.loss_scalers[0]._loss_scale = 256.0
    before = [p.detach().clone() for p in (*a.parameters(), *b.parameters())]
    loss = (F.mse_loss(a(x), y) + F.mse_loss(b(x), y)) * float("inf")
    with amp.scale_loss(loss, [oa, ob]) as scaled:
        scaled.backward()
    assert oa._amp_stash.skip_reasons and ob._amp_stash.skip_reasons and not oa._amp_stash.found_infs
    oa.step()
    ob.step()
    assert all(torch.equal(p, q) for p, q in zip(before, (*a.parameters(), *b.parameters())))
