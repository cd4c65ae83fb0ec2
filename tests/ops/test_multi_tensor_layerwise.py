"""amp_C's layer-wise ops: update_scale_hysteresis, adagrad, novograd, lamb (+ mp, stage1/2), lars.

Each op runs through its Triton kernel (the interpreter on CPU) and its reference and is compared
with an independent float64 computation written here, on odd-sized tensor lists (1, 3, 8192+5 so a
tensor spans two chunks, 100, and an empty tensor).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from culmen.multi_tensor_apply import amp_C
from culmen.testing import assert_close_tolerance, make_strided_lastdim, poison_

BACKENDS = ["triton_backend", "reference_backend"]
CHUNK = 2048 * 32


@pytest.fixture(params=BACKENDS)
def backend(request):
    request.getfixturevalue(request.param)
    return request.param


# --------------------------------------------------------------------------------------------------
# update_scale_hysteresis


def _hysteresis_rule(s, gt, ht, f, gf, bf, gi, h):
    """The rule, written as plain Python on numbers (float64, rounded to fp32 like the kernel)."""
    def f32(x):
        y = float(torch.tensor(x, dtype=torch.float32))
        return 0.0 if abs(y) < torch.finfo(torch.float32).tiny else y  # Apex's fast-math build flushes to zero

    if f > 0:
        ht -= 1
        if ht > 0:
            return s, 0, ht
    if f != 0:
        s, gt = f32(s * bf), 0
    else:
        if gt + 1 == gi:
            grown = f32(s * gf)
            if math.isfinite(grown):
                s = grown
            gt = 0
        else:
            gt += 1
    if f <= 0:
        ht = h
    return s, gt, ht


def _scaler_state(scale, h):
    return (torch.tensor([scale], dtype=torch.float32), torch.zeros(1, dtype=torch.int32),
            torch.full((1,), h, dtype=torch.int32))


@pytest.mark.parametrize("growth_interval,hysteresis", [(3, 2), (1, 1), (2, 4)])
def test_update_scale_hysteresis_sequence(backend, growth_interval, hysteresis):
    gen = torch.Generator().manual_seed(growth_interval * 10 + hysteresis)
    values = [0.0, 0.0, 0.0, 1.0, float("nan")]
    scale, gt, ht = _scaler_state(1024.0, hysteresis)
    state = (1024.0, 0, hysteresis)
    seen_backoff = seen_growth = False
    for i in range(30):
        f = values[int(torch.randint(len(values), (1,), generator=gen))]
        out = amp_C.update_scale_hysteresis(scale, gt, ht, torch.tensor([f]), 2.0, 0.5, growth_interval,
                                            hysteresis)
        assert out is scale
        new = _hysteresis_rule(*state, f, 2.0, 0.5, growth_interval, hysteresis)
        seen_backoff |= new[0] < state[0]
        seen_growth |= new[0] > state[0]
        state = new
        assert (scale.item(), gt.item(), ht.item()) == state, f"step {i}, found_inf={f}"
    assert seen_backoff and seen_growth


def test_update_scale_hysteresis_rules(backend):
    # Two overflows needed before the first backoff; none while a clean step separates them.
    scale, gt, ht = _scaler_state(8.0, 2)
    inf, ok = torch.ones(1), torch.zeros(1)
    amp_C.update_scale_hysteresis(scale, gt, ht, inf, 2.0, 0.5, 100, 2)
    assert (scale.item(), ht.item()) == (8.0, 1)
    amp_C.update_scale_hysteresis(scale, gt, ht, ok, 2.0, 0.5, 100, 2)
    assert (scale.item(), gt.item(), ht.item()) == (8.0, 1, 2)
    amp_C.update_scale_hysteresis(scale, gt, ht, inf, 2.0, 0.5, 100, 2)
    amp_C.update_scale_hysteresis(scale, gt, ht, inf, 2.0, 0.5, 100, 2)
    assert (scale.item(), gt.item(), ht.item()) == (4.0, 0, 0)
    amp_C.update_scale_hysteresis(scale, gt, ht, inf, 2.0, 0.5, 100, 2)  # tracker not restored: backs off again
    assert scale.item() == 2.0
    # Growth never reaches inf; a non-power-of-two factor is applied in float64 then rounded.
    big, gt, ht = _scaler_state(3e38, 1)
    amp_C.update_scale_hysteresis(big, gt, ht, ok, 2.0, 0.5, 1, 1)
    assert big.item() == pytest.approx(3e38) and gt.item() == 0
    s, gt, ht = _scaler_state(3.0, 1)
    amp_C.update_scale_hysteresis(s, gt, ht, ok, 1.1, 0.5, 1, 1)
    assert s.item() == float(torch.tensor(3.0 * 1.1, dtype=torch.float32))
    # Backing off below the smallest normal fp32 gives 0 (Apex's kernel flushes subnormals), and 0 stays 0.
    tiny = torch.finfo(torch.float32).tiny
    s, gt, ht = _scaler_state(tiny * 2, 1)
    amp_C.update_scale_hysteresis(s, gt, ht, inf, 2.0, 0.5, 100, 1)
    assert s.item() == tiny
    amp_C.update_scale_hysteresis(s, gt, ht, inf, 2.0, 0.5, 100, 1)
    assert s.item() == 0.0
    amp_C.update_scale_hysteresis(s, gt, ht, ok, 2.0, 0.5, 1, 1)
    assert s.item() == 0.0


def test_update_scale_hysteresis_errors():
    scale, gt, ht = _scaler_state(1.0, 1)
    with pytest.raises(TypeError):
        amp_C.update_scale_hysteresis(scale, gt.float(), ht, torch.zeros(1), 2.0, 0.5, 10, 1)
    with pytest.raises(TypeError):
        amp_C.update_scale_hysteresis(scale.double(), gt, ht, torch.zeros(1), 2.0, 0.5, 10, 1)
    with pytest.raises(ValueError):
        amp_C.update_scale_hysteresis(scale, gt, ht, torch.zeros(2), 2.0, 0.5, 10, 1)


@pytest.fixture(autouse=True)
def _quiet_interpreter():
    # The interpreter evaluates both sides of tl.where, so an fp32 overflow it then discards warns.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=RuntimeWarning)
        yield


# --------------------------------------------------------------------------------------------------
# shared input builders and float64 oracles

SIZES = [1, 3, 8192 + 5, 100, 0]  # 8192+5 spans two chunks; the empty tensor owns no chunk
STRIDED = 3  # this position is a non-contiguous (stride-2) view in every list
DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _dtypes(case: str, n: int = len(SIZES)) -> list[torch.dtype]:
    if case == "mixed":  # two launch groups: per-tensor arrays are then indexed through a position table
        return [torch.float32 if i % 2 == 0 else torch.bfloat16 for i in range(n)]
    return [DT[case]] * n


def _make(dtypes, kind: str = "any", strided: bool = True, sizes=SIZES, device="cpu") -> list[torch.Tensor]:
    out = []
    for i, (n, dt) in enumerate(zip(sizes, dtypes)):
        x = torch.randn(n, device=device)
        if kind == "pos":
            x = x.abs() + 0.05
        x = x.to(dt)
        if strided and i == STRIDED:
            x = make_strided_lastdim(x)
        out.append(x)
    return out


def _snap(lists):
    return [[x.clone() for x in lst] for lst in lists]


def _R(x: torch.Tensor, dtype: torch.dtype, rnd: bool) -> torch.Tensor:
    """``x`` rounded to a storage dtype (what a kernel writing ``dtype`` keeps), kept in x's dtype."""
    return x.to(dtype).to(x.dtype) if rnd else x


def _check_all(actual_lists, snap, oracle, names, which):
    """Compare the lists ``which`` with the float64 oracle, PyTorch's fp32 run as the baseline."""
    hi = oracle(torch.float64, False)
    lo = oracle(torch.float32, True)
    for k in which:
        for t, a in enumerate(actual_lists[k]):
            assert_close_tolerance(a, hi[k][t], lo[k][t], name=f"{names[k]}[{t}] ({a.dtype})")
    changed = any(not torch.equal(a, s) for a, s in zip(actual_lists[which[0]], snap[which[0]]) if a.numel())
    assert changed, "the op did not update anything"


def _as(lst, dt):
    return [x.to(dt) for x in lst]


def _flag(v=0):
    return torch.full((1,), v, dtype=torch.int32)


def _assert_unchanged(lists, snap):
    for lst, s in zip(lists, snap):
        for a, b in zip(lst, s):
            assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num())


# --------------------------------------------------------------------------------------------------
# adagrad


def _adagrad_oracle(snap, lr, eps, mode, wd):
    def run(dt, rnd):
        ps, hs = [], []
        for g, p, h in zip(*(_as(s, dt) for s in snap)):
            if mode == 0:
                g = g + wd * p
            h = h + g * g
            upd = g / (torch.sqrt(h) + eps)
            if mode == 1:
                upd = upd + wd * p
            p = p - lr * upd
            ps.append(p)
            hs.append(h)
        return [None, [_R(p, s.dtype, rnd) for p, s in zip(ps, snap[1])], [_R(h, s.dtype, rnd) for h, s in
                                                                          zip(hs, snap[2])]]
    return run


@pytest.mark.parametrize("case,mode,wd", [("fp32", 0, 0.1), ("fp16", 1, 0.05), ("mixed", 0, 0.0)])
def test_adagrad(backend, case, mode, wd):
    dts = _dtypes(case)
    lists = [_make(dts), _make(dts), _make(dts, "pos")]
    snap = _snap(lists)
    amp_C.multi_tensor_adagrad(CHUNK, _flag(), lists, 0.1, 1e-8, mode, wd)
    _check_all(lists, snap, _adagrad_oracle(snap, 0.1, 1e-8, mode, wd), ["g", "p", "h"], [1, 2])


# --------------------------------------------------------------------------------------------------
# novograd


def _novograd_oracle(snap, norms0, lr, b1, b2, eps, step, bc, wd, avg, mode, norm_type):
    def run(dt, rnd):
        bc1 = 1 - b1 ** step if bc else 1.0
        bc2 = math.sqrt(1 - b2 ** step) if bc else 1.0
        b3 = 1 - b1 if avg else 1.0
        ps, ms, ns = [], [], []
        for i, (g, p, m) in enumerate(zip(*(_as(s, dt) for s in snap))):
            old = norms0[i].to(dt)
            if norm_type == 0:
                cur = g.abs().max() if g.numel() else torch.zeros((), dtype=dt)
                gn = b2 * old + (1 - b2) * cur
            else:
                gn = torch.sqrt(b2 * old * old + (1 - b2) * (g * g).sum())
            denom = gn / bc2 + eps
            if mode == 0:
                g = g / denom + wd * p
                m = b1 * m + b3 * g
                p = p - lr * (m / bc1)
            else:
                m = b1 * m + b3 * g
                p = p - lr * ((m / bc1) / denom + wd * p)
            ps.append(_R(p, snap[1][i].dtype, rnd))
            ms.append(_R(m, snap[2][i].dtype, rnd))
            ns.append(gn)
        return [None, ps, ms, [torch.stack(ns)]]
    return run


@pytest.mark.parametrize("case,mode,norm_type,bc,avg", [
    ("fp32", 0, 2, 1, 1), ("fp16", 1, 2, 1, 0), ("bf16", 0, 0, 0, 1), ("mixed", 1, 0, 1, 1)])
def test_novograd(backend, case, mode, norm_type, bc, avg):
    dts = _dtypes(case)
    lists = [_make(dts), _make(dts), _make(dts)]
    norms = torch.rand(len(SIZES)) + 0.5
    snap, norms0 = _snap(lists), norms.clone()
    args = dict(lr=0.05, b1=0.95, b2=0.98, eps=1e-8, step=3, bc=bc, wd=0.01, avg=avg, mode=mode,
                norm_type=norm_type)
    amp_C.multi_tensor_novograd(CHUNK, _flag(), lists, norms, 0.05, 0.95, 0.98, 1e-8, 3, bc, 0.01, avg, mode,
                                norm_type)
    oracle = _novograd_oracle(snap, norms0, **args)
    _check_all(lists + [[norms]], snap + [[norms0]], oracle, ["g", "p", "m", "grad_norms"], [1, 2, 3])


# --------------------------------------------------------------------------------------------------
# lamb


def _lamb_oracle(snap, *, lr, b1, b2, eps, step, bc, wd, avg, mode, ggn, maxn, nvlamb, inv=1.0):
    """Returns [u (over g), p, m, v, p_model]; with five lists p are the masters."""
    def run(dt, rnd):
        bc1 = 1 - b1 ** step if bc else 1.0
        bc2 = 1 - b2 ** step if bc else 1.0
        b3 = 1 - b1 if avg else 1.0
        clip = ggn / maxn if ggn > maxn else 1.0
        out = [[], [], [], [], []]
        for i, (g, p, m, v) in enumerate(zip(*(_as(s, dt) for s in snap[:4]))):
            g = g * inv / clip
            if mode == 0:
                g = g + wd * p
            m = m * b1 + b3 * g
            v = v * b2 + (1 - b2) * g * g
            u = (m / bc1) / (torch.sqrt(v / bc2) + eps)
            if mode == 1:
                u = u + wd * p
            u = _R(u, snap[0][i].dtype, rnd)
            ratio = lr
            pn, un = torch.linalg.vector_norm(p), torch.linalg.vector_norm(u)
            if (nvlamb or wd != 0) and pn != 0 and un != 0:
                ratio = lr * (pn / un)
            p = p - ratio * u
            for k, x in enumerate((u, p, m, v)):
                out[k].append(_R(x, snap[k][i].dtype, rnd))
            if len(snap) == 5:
                out[4].append(_R(p, snap[4][i].dtype, rnd))
        return out
    return run


@pytest.mark.parametrize("case,mode,wd,nvlamb,ggn", [
    ("fp32", 1, 0.01, False, 5.0), ("fp16", 0, 0.01, False, 0.5), ("bf16", 1, 0.0, True, 2.0),
    ("mixed", 1, 0.0, False, 3.0)])
def test_lamb(backend, case, mode, wd, nvlamb, ggn):
    dts = _dtypes(case)
    lists = [_make(dts), _make(dts), _make(dts), _make(dts, "pos")]
    snap = _snap(lists)
    amp_C.multi_tensor_lamb(CHUNK, _flag(), lists, 0.01, 0.9, 0.999, 1e-6, 4, 1, wd, 1, mode,
                            torch.tensor([ggn]), 1.0, nvlamb)
    oracle = _lamb_oracle(snap, lr=0.01, b1=0.9, b2=0.999, eps=1e-6, step=4, bc=1, wd=wd, avg=1, mode=mode,
                          ggn=ggn, maxn=1.0, nvlamb=nvlamb)
    _check_all(lists, snap, oracle, ["update", "p", "m", "v"], [1, 0, 2, 3])


@pytest.mark.parametrize("master", [False, True])
def test_lamb_mp(backend, master):
    n = len(SIZES)
    if master:  # bf16 grads and model params, fp32 masters and moments
        lists = [_make([torch.bfloat16] * n), _make([torch.float32] * n), _make([torch.float32] * n),
                 _make([torch.float32] * n, "pos")]
        lists.append([x.to(torch.bfloat16) for x in lists[1]])
        lists[4][STRIDED] = make_strided_lastdim(lists[4][STRIDED])
    else:
        lists = [_make([torch.float32] * n), _make([torch.float32] * n), _make([torch.float32] * n),
                 _make([torch.float32] * n, "pos")]
    snap = _snap(lists)
    scale = 1024.0
    for x in lists[0]:
        x.mul_(scale)  # scaled gradients (exact: power of two)
    snap[0] = [x.clone() for x in lists[0]]
    amp_C.multi_tensor_lamb_mp(CHUNK, _flag(), lists, torch.tensor([0.02]), 0.9, 0.99, 1e-6,
                               torch.tensor([5], dtype=torch.int32), 1, 0.01, 1, 1, torch.tensor([3.0 * scale]),
                               torch.tensor([1.0 * scale]), False, torch.zeros(1), torch.tensor([1.0 / scale]))
    oracle = _lamb_oracle(snap, lr=0.02, b1=0.9, b2=0.99, eps=1e-6, step=5, bc=1, wd=0.01, avg=1, mode=1,
                          ggn=3.0 * scale, maxn=1.0 * scale, nvlamb=False, inv=1.0 / scale)
    which = [1, 2, 3, 4] if master else [1, 2, 3]
    _check_all(lists, snap, oracle, ["update", "p", "m", "v", "p_model"], which)


def test_lamb_mp_found_inf_skips(backend):
    dts = _dtypes("fp32")
    lists = [_make(dts), _make(dts), _make(dts), _make(dts, "pos")]
    snap = _snap(lists)
    amp_C.multi_tensor_lamb_mp(CHUNK, _flag(), lists, torch.tensor([0.02]), 0.9, 0.99, 1e-6,
                               torch.tensor([5], dtype=torch.int32), 1, 0.01, 1, 1, torch.tensor([3.0]),
                               torch.tensor([1.0]), True, torch.ones(1), torch.tensor([1.0]))
    _assert_unchanged(lists, snap)


def _stage1_oracle(snap, decay, step, b1, b2, eps, ggn, maxn):
    def run(dt, rnd):
        bc1, bc2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
        clip = ggn / maxn if ggn > maxn else 1.0
        out = [None, None, [], [], []]
        for i, (g, p, m, v) in enumerate(zip(*(_as(s, dt) for s in snap[:4]))):
            g = g / clip
            m = m * b1 + (1 - b1) * g
            v = v * b2 + (1 - b2) * g * g
            u = (m / bc1) / (torch.sqrt(v / bc2) + eps) + float(decay[i]) * p
            for k, x in ((2, m), (3, v), (4, u)):
                out[k].append(_R(x, snap[k][i].dtype, rnd))
        return out
    return run


@pytest.mark.parametrize("case", ["fp32", "mixed"])
def test_lamb_stage1(backend, case):
    dts = _dtypes(case)
    lists = [_make(dts), _make(dts), _make(dts), _make(dts, "pos"), [poison_(x) for x in _make(dts)]]
    decay = torch.tensor([0.01, 0.0, 0.02, 0.01, 0.0])
    snap = _snap(lists)
    amp_C.multi_tensor_lamb_stage1_cuda(CHUNK, _flag(), lists, decay, 2, 0.9, 0.999, 1e-6, torch.tensor([4.0]), 2.0)
    _check_all(lists, snap, _stage1_oracle(snap, decay, 2, 0.9, 0.999, 1e-6, 4.0, 2.0),
               ["g", "p", "m", "v", "update"], [4, 2, 3])


def _stage2_oracle(snap, pn, un, lr, wd, nvlamb):
    def run(dt, rnd):
        out = [[], None]
        for i, (p, u) in enumerate(zip(*(_as(s, dt) for s in snap))):
            ratio = lr
            if (nvlamb or wd != 0) and pn[i] != 0 and un[i] != 0:
                ratio = lr * (float(pn[i]) / float(un[i]))
            out[0].append(_R(p - ratio * u, snap[0][i].dtype, rnd))
        return out
    return run


@pytest.mark.parametrize("case,wd,nvlamb", [("fp16", 0.01, False), ("mixed", 0.0, True)])
def test_lamb_stage2(backend, case, wd, nvlamb):
    dts = _dtypes(case)
    lists = [_make(dts), _make(dts)]
    pn = torch.tensor([1.5, 0.0, 2.0, 0.7, 1.0])  # a zero norm falls back to the plain lr
    un = torch.tensor([0.5, 1.0, 3.0, 0.9, 0.0])
    snap = _snap(lists)
    amp_C.multi_tensor_lamb_stage2_cuda(CHUNK, _flag(), lists, pn, un, 0.1, wd, nvlamb)
    _check_all(lists, snap, _stage2_oracle(snap, pn, un, 0.1, wd, nvlamb), ["p", "update"], [0])


# --------------------------------------------------------------------------------------------------
# lars


def _lars_oracle(snap, gn, pn, *, lr, tc, eps, wd, momentum, dampening, nesterov, first_run, wd_after, scale,
                 skipped):
    def run(dt, rnd):
        out = [None, [], [], []]
        for i, (g, p, b) in enumerate(zip(*(_as(s, dt) for s in snap[:3]))):
            lr_t = lr
            if not skipped and gn[i] > 0 and pn[i] > 0:
                lr_t = lr * tc * float(pn[i]) / (float(gn[i]) + float(pn[i]) * wd + eps)
            g = g * scale
            if not wd_after:
                g = g + wd * p
            if momentum != 0:
                b = -lr_t * g if first_run else momentum * b - (1 - dampening) * lr_t * g
                d = momentum * b - lr_t * g if nesterov else b
            else:
                d = -lr_t * g
            if wd_after:
                d = d - lr_t * wd * p
            p = p + d
            out[1].append(_R(p, snap[1][i].dtype, rnd))
            out[2].append(_R(b, snap[2][i].dtype, rnd))
            if len(snap) == 4:
                out[3].append(_R(p, snap[3][i].dtype, rnd))
        return out
    return run


@pytest.mark.parametrize("case,opts", [
    ("fp32", dict(momentum=0.9, dampening=0.0, nesterov=False, first_run=False, wd_after=False, skipped=False)),
    ("fp16", dict(momentum=0.9, dampening=0.1, nesterov=True, first_run=False, wd_after=True, skipped=False)),
    ("mixed", dict(momentum=0.8, dampening=0.0, nesterov=False, first_run=True, wd_after=False, skipped=False)),
    ("copy", dict(momentum=0.0, dampening=0.0, nesterov=False, first_run=False, wd_after=False, skipped=True)),
])
def test_lars(backend, case, opts):
    if case == "copy":  # fp16 grads, fp32 master params and momenta, fp16 model copies
        n = len(SIZES)
        lists = [_make([torch.float16] * n), _make([torch.float32] * n), _make([torch.float32] * n)]
        lists.append([x.to(torch.float16) for x in lists[1]])
    else:
        dts = _dtypes(case)
        lists = [_make(dts), _make(dts), _make(dts)]
    gn = torch.tensor([0.5, 2.0, 0.0, 1.2, 0.3])
    pn = torch.tensor([1.0, 0.7, 3.0, 2.2, 0.0])
    snap = _snap(lists)
    kw = dict(lr=0.5, tc=0.02, eps=1e-6, wd=0.01, scale=0.5, **opts)
    amp_C.multi_tensor_lars(CHUNK, _flag(), lists, gn, pn, 0.5, 0.02, 1e-6, 0.01, opts["momentum"],
                            opts["dampening"], opts["nesterov"], opts["first_run"], opts["wd_after"], 0.5,
                            opts["skipped"])
    which = [1, 3] if case == "copy" else [1, 2]
    _check_all(lists, snap, _lars_oracle(snap, gn, pn, **kw), ["g", "p", "momentum", "p_copy"], which)


# --------------------------------------------------------------------------------------------------
# noop flag, bad input


def _fp32_lists(k, pos=()):
    return [_make([torch.float32] * len(SIZES), "pos" if i in pos else "any") for i in range(k)]


def _calls(per=None):
    n = len(SIZES)
    per = torch.rand(n) + 0.1 if per is None else per
    return {
        "adagrad": (lambda f, ls: amp_C.multi_tensor_adagrad(CHUNK, f, ls, 0.1, 1e-8, 0, 0.1), 3, (2,)),
        "novograd": (lambda f, ls: amp_C.multi_tensor_novograd(CHUNK, f, ls, per, 0.1, 0.9, 0.99, 1e-8, 1, 1, 0.1,
                                                               1, 0, 2), 3, ()),
        "lamb": (lambda f, ls: amp_C.multi_tensor_lamb(CHUNK, f, ls, 0.1, 0.9, 0.99, 1e-6, 1, 1, 0.1, 1, 1,
                                                       torch.ones(1), 1.0, True), 4, (3,)),
        "lamb_mp": (lambda f, ls: amp_C.multi_tensor_lamb_mp(CHUNK, f, ls, torch.tensor([0.1]), 0.9, 0.99, 1e-6,
                                                             torch.ones(1, dtype=torch.int32), 1, 0.1, 1, 1,
                                                             torch.ones(1), torch.ones(1), True, torch.zeros(1),
                                                             torch.ones(1)), 4, (3,)),
        "stage1": (lambda f, ls: amp_C.multi_tensor_lamb_stage1_cuda(CHUNK, f, ls, per, 1, 0.9, 0.99, 1e-6,
                                                                     torch.ones(1), 1.0), 5, (3,)),
        "stage2": (lambda f, ls: amp_C.multi_tensor_lamb_stage2_cuda(CHUNK, f, ls, per, per, 0.1, 0.1, True), 2,
                   ()),
        "lars": (lambda f, ls: amp_C.multi_tensor_lars(CHUNK, f, ls, per, per, 0.1, 0.01, 0.0, 0.1, 0.9, 0.0, False,
                                                       False, False, 1.0, False), 3, ()),
    }


@pytest.mark.parametrize("name", ["adagrad", "novograd", "lamb", "lamb_mp", "stage1", "stage2", "lars"])
def test_noop_flag_skips(backend, name):
    per = torch.rand(len(SIZES)) + 0.1  # novograd's moving norms are state too
    call, k, pos = _calls(per)[name]
    lists = _fp32_lists(k, pos)
    snap, per0 = _snap(lists), per.clone()
    flag = _flag(1)
    call(flag, lists)
    _assert_unchanged(lists + [[per]], snap + [[per0]])
    assert flag.item() == 1
    call(_flag(0), lists)  # and the same call without the flag does change the params
    assert any(not torch.equal(a, b) for lst, s in zip(lists, snap) for a, b in zip(lst, s) if a.numel())


@pytest.mark.parametrize("name", ["adagrad", "novograd", "lamb", "lamb_mp", "stage1", "stage2", "lars"])
def test_bad_input(name):
    call, k, pos = _calls()[name]
    with pytest.raises(ValueError, match="tensor lists"):
        call(_flag(), _fp32_lists(k + 2))
    lists = _fp32_lists(k, pos)
    lists[-1][2] = torch.randn(7)
    with pytest.raises(ValueError, match="elements"):
        call(_flag(), lists)
    lists = _fp32_lists(k, pos)
    lists[0] = lists[0][:-1]
    with pytest.raises(ValueError):
        call(_flag(), lists)


def test_per_tensor_argument_errors():
    lists = _fp32_lists(3)
    with pytest.raises(ValueError, match="grad_norms"):
        amp_C.multi_tensor_novograd(CHUNK, _flag(), lists, torch.ones(2), 0.1, 0.9, 0.99, 1e-8, 1, 1, 0.0, 1, 0, 2)
    with pytest.raises(ValueError, match="norm_type"):
        amp_C.multi_tensor_novograd(CHUNK, _flag(), lists, torch.ones(5), 0.1, 0.9, 0.99, 1e-8, 1, 1, 0.0, 1, 0, 1)
    with pytest.raises(ValueError, match="param_norms"):
        amp_C.multi_tensor_lars(CHUNK, _flag(), lists, torch.ones(5), torch.ones(4), 0.1, 0.01, 0.0, 0.0, 0.9, 0.0,
                                False, False, False, 1.0, False)
    with pytest.raises(ValueError, match="mode"):
        amp_C.multi_tensor_adagrad(CHUNK, _flag(), lists, 0.1, 1e-8, 2, 0.0)


# --------------------------------------------------------------------------------------------------
# GPU: the compiled kernels at larger sizes (many chunks per tensor, several groups), CUDA graphs

GPU_SIZES = [1, 3, 8192 + 5, 100, 0, 300_001, 3 * 65536 + 7]


def _gpu_lists(case, kinds):
    dts = _dtypes(case, len(GPU_SIZES))
    return [_make(dts, k, sizes=GPU_SIZES, device="cuda") for k in kinds]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adagrad", "novograd", "lamb", "lamb_mixed", "lamb_mp", "stage1", "stage2",
                                  "lars"])
def test_layerwise_ops_gpu(name):
    n = len(GPU_SIZES)
    f = torch.zeros(1, dtype=torch.int32, device="cuda")
    per = torch.rand(n, device="cuda") + 0.2
    if name == "adagrad":
        lists = _gpu_lists("fp32", ["any", "any", "pos"])
        snap = _snap(lists)
        amp_C.multi_tensor_adagrad(CHUNK, f, lists, 0.1, 1e-8, 1, 0.05)
        _check_all(lists, snap, _adagrad_oracle(snap, 0.1, 1e-8, 1, 0.05), ["g", "p", "h"], [1, 2])
    elif name == "novograd":
        lists = _gpu_lists("bf16", ["any", "any", "any"])
        snap, per0 = _snap(lists), per.clone()
        amp_C.multi_tensor_novograd(CHUNK, f, lists, per, 0.05, 0.95, 0.98, 1e-8, 3, 1, 0.01, 1, 0, 2)
        oracle = _novograd_oracle(snap, per0, lr=0.05, b1=0.95, b2=0.98, eps=1e-8, step=3, bc=1, wd=0.01, avg=1,
                                  mode=0, norm_type=2)
        _check_all(lists + [[per]], snap + [[per0]], oracle, ["g", "p", "m", "grad_norms"], [1, 2, 3])
    elif name in ("lamb", "lamb_mixed"):
        lists = _gpu_lists("fp32" if name == "lamb" else "mixed", ["any", "any", "any", "pos"])
        snap = _snap(lists)
        amp_C.multi_tensor_lamb(CHUNK, f, lists, 0.01, 0.9, 0.999, 1e-6, 4, 1, 0.01, 1, 1,
                                torch.tensor([5.0], device="cuda"), 1.0, name == "lamb_mixed")
        oracle = _lamb_oracle(snap, lr=0.01, b1=0.9, b2=0.999, eps=1e-6, step=4, bc=1, wd=0.01, avg=1, mode=1,
                              ggn=5.0, maxn=1.0, nvlamb=name == "lamb_mixed")
        _check_all(lists, snap, oracle, ["update", "p", "m", "v"], [1, 0, 2, 3])
    elif name == "lamb_mp":
        lists = _gpu_lists("bf16", ["any"]) + _gpu_lists("fp32", ["any", "any", "pos"])
        lists.append([x.to(torch.bfloat16) for x in lists[1]])
        snap = _snap(lists)
        c = lambda v: torch.tensor([v], device="cuda")  # noqa: E731
        amp_C.multi_tensor_lamb_mp(CHUNK, f, lists, c(0.02), 0.9, 0.99, 1e-6,
                                   torch.tensor([5], dtype=torch.int32, device="cuda"), 1, 0.01, 1, 0, c(2.0), c(1.0),
                                   False, c(0.0), c(0.5))
        oracle = _lamb_oracle(snap, lr=0.02, b1=0.9, b2=0.99, eps=1e-6, step=5, bc=1, wd=0.01, avg=1, mode=0,
                              ggn=2.0, maxn=1.0, nvlamb=False, inv=0.5)
        _check_all(lists, snap, oracle, ["update", "p", "m", "v", "p_model"], [1, 2, 3, 4])
    elif name == "stage1":
        lists = _gpu_lists("fp32", ["any", "any", "any", "pos", "any"])
        snap = _snap(lists)
        amp_C.multi_tensor_lamb_stage1_cuda(CHUNK, f, lists, per, 2, 0.9, 0.999, 1e-6,
                                            torch.tensor([4.0], device="cuda"), 2.0)
        oracle = _stage1_oracle(snap, per.cpu(), 2, 0.9, 0.999, 1e-6, 4.0, 2.0)
        _check_all(lists, snap, oracle, ["g", "p", "m", "v", "update"], [4, 2, 3])
    elif name == "stage2":
        lists = _gpu_lists("mixed", ["any", "any"])
        un = torch.rand(n, device="cuda") + 0.2
        snap = _snap(lists)
        amp_C.multi_tensor_lamb_stage2_cuda(CHUNK, f, lists, per, un, 0.1, 0.01, False)
        _check_all(lists, snap, _stage2_oracle(snap, per.cpu(), un.cpu(), 0.1, 0.01, False), ["p", "update"], [0])
    else:
        lists = _gpu_lists("fp16", ["any"]) + _gpu_lists("fp32", ["any", "any"])
        lists.append([x.to(torch.float16) for x in lists[1]])
        gn = torch.rand(n, device="cuda") + 0.2
        snap = _snap(lists)
        amp_C.multi_tensor_lars(CHUNK, f, lists, gn, per, 0.5, 0.02, 1e-6, 0.01, 0.9, 0.0, False, False, False, 0.5,
                                False)
        oracle = _lars_oracle(snap, gn.cpu(), per.cpu(), lr=0.5, tc=0.02, eps=1e-6, wd=0.01, momentum=0.9,
                              dampening=0.0, nesterov=False, first_run=False, wd_after=False, scale=0.5, skipped=False)
        _check_all(lists, snap, oracle, ["g", "p", "momentum", "p_copy"], [1, 2, 3])
    assert f.item() == 0


@pytest.mark.gpu
def test_lamb_mp_and_scaler_cuda_graph_gpu():
    """lamb_mp + update_scale_hysteresis have no host sync: they capture into a CUDA graph and replay."""
    dev = torch.device("cuda")
    lists = _gpu_lists("fp32", ["any", "any", "any", "pos"])
    f = torch.zeros(1, dtype=torch.int32, device=dev)
    lr, step = torch.tensor([0.01], device=dev), torch.tensor([1], dtype=torch.int32, device=dev)
    gnorm, maxn, found, inv = (torch.tensor([v], device=dev) for v in (2.0, 1.0, 0.0, 1.0))
    scale = torch.tensor([4.0], device=dev)
    gt, ht = torch.zeros(1, dtype=torch.int32, device=dev), torch.ones(1, dtype=torch.int32, device=dev)

    def fn():
        amp_C.multi_tensor_lamb_mp(CHUNK, f, lists, lr, 0.9, 0.99, 1e-6, step, 1, 0.01, 1, 1, gnorm, maxn, False,
                                   found, inv)
        step.add_(1)
        amp_C.update_scale_hysteresis(scale, gt, ht, found, 2.0, 0.5, 1, 1)

    fn()  # warm-up: compiles the kernels and caches the tables
    expect = _snap(lists)
    lamb_ref = __import__("culmen.ops.multi_tensor.lamb", fromlist=["lamb_ref"]).lamb_ref
    lamb_ref(expect, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-6, step=2, bias_correction=True, weight_decay=0.01,
             grad_averaging=True, mode=1, global_grad_norm=gnorm, max_grad_norm=maxn, use_nvlamb=False,
             noop_flag=torch.zeros(1, dtype=torch.int32, device=dev), found_inf=found, inv_scale=inv)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph.replay()
    torch.cuda.synchronize()
    assert step.item() == 3 and scale.item() == 16.0  # eager step, then the replayed one (capture runs nothing)
    for k in (1, 2, 3):
        for a, b in zip(lists[k], expect[k]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_layerwise_ops_compile_fullgraph(device):
    """Under torch.compile the layer-wise amp_C ops are custom-op nodes: no graph break, eager results."""
    torch._dynamo.reset()
    sizes = [5, 33]

    def make():
        torch.manual_seed(3)
        g = [torch.randn(n, device=device) for n in sizes]
        p = [torch.randn(n, device=device) for n in sizes]
        m = [torch.randn(n, device=device) for n in sizes]
        v = [torch.rand(n, device=device) for n in sizes]
        h = [torch.rand(n, device=device) for n in sizes]
        scale = torch.full((1,), 1024.0, device=device)
        trackers = (torch.zeros(1, dtype=torch.int32, device=device), torch.full((1,), 2, dtype=torch.int32,
                                                                                   device=device))
        return g, p, m, v, h, scale, trackers

    def step(g, p, m, v, h, scale, trackers):
        f = torch.zeros(1, dtype=torch.int32, device=device)
        amp_C.multi_tensor_adagrad(2048, f, [g, p, h], 0.1, 1e-10, 0, 0.01)
        gnorm = torch.ones(1, device=device) * 3.0
        amp_C.multi_tensor_lamb(2048, f, [g, p, m, v], 1e-2, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, gnorm, 1.0, False)
        amp_C.update_scale_hysteresis(scale, trackers[0], trackers[1], torch.ones(1, device=device), 2.0, 0.5,
                                      100, 2)
        return p[0] * 1.0

    eager = make()
    want = step(*eager)
    comp = make()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*comp)
    torch.testing.assert_close(got, want)
    for a, b in zip(comp[1] + comp[2] + comp[4], eager[1] + eager[2] + eager[4]):
        torch.testing.assert_close(a, b)
    assert comp[5].item() == eager[5].item() and comp[6][1].item() == eager[6][1].item()
