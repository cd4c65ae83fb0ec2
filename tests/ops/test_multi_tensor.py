"""amp_C elementwise / l2norm / adam / sgd ops: Triton kernels (interpreter on CPU) and references
against float64 math, noop-flag rules, mixed dtypes, odd sizes, non-contiguous tensors, errors."""

from __future__ import annotations

import pytest
import torch

from culmen.multi_tensor_apply import amp_C, multi_tensor_applier
from culmen.ops.backend import set_backend
from culmen.ops.multi_tensor import adam, common
from culmen.testing import assert_close_tolerance, make_strided_lastdim

SIZES = [3, 8192 + 5, 1, 0, 100]  # a chunk is 8192 elements: one tensor spans two chunks


def lists_of(*dtypes, device, sizes=SIZES, positive=()):
    out = []
    for i, dt in enumerate(dtypes):
        lst = [torch.randn(n, device=device).to(dt) for n in sizes]
        if i in positive:
            lst = [x.abs() for x in lst]
        out.append(lst)
    return out


def flag(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


@pytest.fixture(params=["triton", "reference"])
def backend(request, monkeypatch):
    set_backend(request.param)
    return request.param


def test_applier_and_compat_names():
    assert multi_tensor_applier.available and multi_tensor_applier.chunk_size == 2048 * 32
    for name in ("multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_l2norm_mp",
                 "multi_tensor_l2norm_scale", "multi_tensor_unscale_l2norm", "multi_tensor_adam",
                 "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master", "multi_tensor_sgd"):
        assert callable(getattr(amp_C, name)), name
    from culmen import compat

    compat.install()
    try:
        import amp_C as aliased

        assert aliased is amp_C
    finally:
        compat.uninstall()


@pytest.mark.parametrize("src_dt,dst_dt", [(torch.float16, torch.float32), (torch.float32, torch.bfloat16),
                                           (torch.float32, torch.float32)])
def test_scale(backend, device, src_dt, dst_dt):
    src, dst = lists_of(src_dt, dst_dt, device=device)
    f = flag(device)
    multi_tensor_applier(amp_C.multi_tensor_scale, f, [src, dst], 0.37)
    for x, y in zip(src, dst):
        hi = x.double() * 0.37
        assert_close_tolerance(y, hi, (x.float() * 0.37).to(dst_dt), name="scale")
    assert f.item() == 0


def test_scale_flags_overflow_and_still_writes(backend, device):
    src, dst = lists_of(torch.float32, torch.float32, device=device)
    src[1][8190] = float("inf")
    src[4][5] = float("nan")
    f = flag(device)
    multi_tensor_applier(amp_C.multi_tensor_scale, f, [src, dst], 2.0)
    assert f.item() == 1
    assert torch.isinf(dst[1][8190]) and torch.isnan(dst[4][5])
    torch.testing.assert_close(dst[0], src[0] * 2.0)
    # A set flag does not stop the scale (Apex propagates infs), and a clean call does not clear it.
    src2, dst2 = lists_of(torch.float32, torch.float32, device=device)
    multi_tensor_applier(amp_C.multi_tensor_scale, f, [src2, dst2], 3.0)
    torch.testing.assert_close(dst2[1], src2[1] * 3.0)
    assert f.item() == 1


@pytest.mark.parametrize("arg_to_check", [-1, 0, 1])
def test_axpby(backend, device, arg_to_check):
    x, y, out = lists_of(torch.float32, torch.float16, torch.float32, device=device)
    y[1][3] = float("inf")
    f = flag(device)
    multi_tensor_applier(amp_C.multi_tensor_axpby, f, [x, y, out], 0.5, -1.5, arg_to_check)
    assert f.item() == (0 if arg_to_check == 0 else 1)
    for a, b, o in zip(x, y, out):
        hi = 0.5 * a.double() - 1.5 * b.double()
        assert_close_tolerance(o, hi, None, name="axpby")


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_tensor", [True, False])
def test_l2norm(backend, device, dt, per_tensor):
    (xs,) = lists_of(dt, device=device)
    norm, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag(device), [xs], per_tensor)
    hi = torch.stack([x.double().norm() for x in xs])
    assert norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), hi.norm().reshape(1), rtol=1e-5, atol=1e-6)
    if per_tensor:
        torch.testing.assert_close(per.double(), hi, rtol=1e-5, atol=1e-6)
    else:
        assert per.numel() == 0


def test_l2norm_mixed_dtypes_make_groups(backend, device):
    xs = [torch.randn(n, device=device) for n in (5, 9000, 7)]
    xs[1] = xs[1].half()
    norm, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag(device), [xs], True)
    hi = torch.stack([x.double().norm() for x in xs])
    torch.testing.assert_close(per.double(), hi, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.double(), hi.norm().reshape(1), rtol=1e-5, atol=1e-6)


def test_l2norm_variants(backend, device):
    xs, outs = lists_of(torch.float32, torch.float16, device=device)
    f = flag(device)
    norm, per = multi_tensor_applier(amp_C.multi_tensor_l2norm_scale, f, [xs, outs], 0.5, True)
    hi = torch.stack([x.double().norm() for x in xs])
    torch.testing.assert_close(per.double(), hi, rtol=1e-5, atol=1e-6)
    for x, o in zip(xs, outs):
        torch.testing.assert_close(o, (x * 0.5).half())
    inv = torch.tensor([0.25], device=device)
    norm, per = multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, f, [xs], inv, True)
    torch.testing.assert_close(per.double(), hi * 0.25, rtol=1e-5, atol=1e-6)
    assert f.item() == 0
    norm, per = multi_tensor_applier(amp_C.multi_tensor_l2norm_mp, flag(device, 1), [xs], True)
    assert norm.item() == 0 and per.abs().sum().item() == 0


def _adam_hi(g, p, m, v, *, lr, b1, b2, eps, step, mode, wd, inv=1.0):
    g, p, m, v = (t.double() for t in (g, p, m, v))
    g = g * inv
    if mode == 0:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    upd = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
    if mode == 1:
        upd = upd + wd * p
    return p - lr * upd, m, v


@pytest.mark.parametrize("mode", [0, 1])
def test_adam_against_float64(backend, device, mode):
    g, p, m, v = lists_of(*[torch.float32] * 4, device=device, positive=(3,))
    before = [[t.clone() for t in lst] for lst in (g, p, m, v)]
    multi_tensor_applier(amp_C.multi_tensor_adam, flag(device), [g, p, m, v], 1e-2, 0.9, 0.999, 1e-8, 5, mode, 1,
                         0.1)
    for i in range(len(SIZES)):
        hp, hm, hv = _adam_hi(*(lst[i] for lst in before), lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, step=5, mode=mode,
                              wd=0.1)
        for got, want in ((p[i], hp), (m[i], hm), (v[i], hv)):
            assert_close_tolerance(got, want, None, atol=2e-6, name="adam")


def test_adam_matches_torch_adamw(backend, device):
    params = [torch.randn(n, device=device) for n in (17, 8200, 5)]
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(1, 8):
        grads = [torch.randn_like(p) for p in params]
        for r, gr in zip(ref, grads):
            r.grad = gr.clone()
        opt.step()
        adam.adam_update([grads, params, m, v], lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, step=step, mode=1,
                         bias_correction=True, weight_decay=0.05, noop_flag=flag(device))
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=2e-5, atol=2e-6)


def test_adam_noop_skips_everything(backend, device):
    lists = lists_of(*[torch.float32] * 4, device=device, positive=(3,))
    before = [[t.clone() for t in lst] for lst in lists]
    multi_tensor_applier(amp_C.multi_tensor_adam, flag(device, 1), lists, 1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    for lst, old in zip(lists, before):
        for a, b in zip(lst, old):
            assert torch.equal(a, b)
    # GradScaler's found_inf is a float tensor: accepted as the noop flag too.
    adam.adam_update(lists, lr=1.0, beta1=0.9, beta2=0.99, eps=1e-8, step=1, mode=1, bias_correction=True,
                     weight_decay=0.0, noop_flag=torch.ones(1, device=device), inv_scale=torch.ones(1, device=device))
    for lst, old in zip(lists, before):
        for a, b in zip(lst, old):
            assert torch.equal(a, b)


def test_adam_capturable_master(backend, device):
    g, pm, m, v = lists_of(torch.float16, torch.float32, torch.float32, torch.float32, device=device, positive=(3,))
    p = [x.half() for x in pm]
    before = [[t.clone() for t in lst] for lst in (g, pm, m, v)]
    lr = torch.tensor([1e-2], device=device)
    step = torch.tensor([3], dtype=torch.int32, device=device)
    inv = torch.tensor([0.5], device=device)
    multi_tensor_applier(amp_C.multi_tensor_adam_capturable_master, flag(device), [g, p, m, v, pm], lr, 0.9, 0.999,
                         1e-8, step, 1, 1, 0.01, inv)
    for i in range(len(SIZES)):
        hp, hm, hv = _adam_hi(*(lst[i] for lst in before), lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, step=3, mode=1,
                              wd=0.01, inv=0.5)
        assert_close_tolerance(pm[i], hp, None, atol=2e-6, name="master")
        assert_close_tolerance(m[i], hm, None, atol=2e-6, name="m")
        assert torch.equal(p[i], pm[i].half())


def test_adam_bf16_param_remainders(backend, device):
    """An int16 fifth list: the master is the bf16 param's bits plus the remainder, rebuilt and split again."""
    g, pm, m, v = lists_of(*[torch.float32] * 4, device=device, positive=(3,))
    pm = [x * 3 + 0.1 for x in pm]
    p, rem = map(list, zip(*(adam.rem_split(x) for x in pm)))
    for x, hi, r in zip(pm, p, rem):
        assert torch.equal(adam.rem_master(hi, r), x)  # the pair is exact
        assert torch.equal(hi, x.to(torch.bfloat16))  # and the bf16 half is round-to-nearest
    before = [[t.clone() for t in lst] for lst in (g, pm, m, v)]
    inv = torch.tensor([0.25], device=device)
    adam.adam_update([g, p, m, v, rem], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=4, mode=1,
                     bias_correction=True, weight_decay=0.01, noop_flag=flag(device), inv_scale=inv)
    for i in range(len(SIZES)):
        hp, hm, hv = _adam_hi(*(lst[i] for lst in before), lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, step=4, mode=1,
                              wd=0.01, inv=0.25)
        assert_close_tolerance(adam.rem_master(p[i], rem[i]), hp, None, atol=2e-6, name="master")
        assert_close_tolerance(m[i], hm, None, atol=2e-6, name="m")
        assert torch.equal(p[i], adam.rem_master(p[i], rem[i]).to(torch.bfloat16))
    skipped = [[t.clone() for t in lst] for lst in (p, rem)]
    adam.adam_update([g, p, m, v, rem], lr=1.0, beta1=0.9, beta2=0.999, eps=1e-8, step=5, mode=1,
                     bias_correction=True, weight_decay=0.0, noop_flag=flag(device, 1))
    for lst, old in zip((p, rem), skipped):
        for a, b in zip(lst, old):
            assert torch.equal(a, b)


@pytest.mark.parametrize("nesterov,first_run,wd_after", [(False, True, False), (True, False, False),
                                                         (False, False, True)])
def test_sgd_matches_torch(backend, device, nesterov, first_run, wd_after):
    g, p, buf = lists_of(*[torch.float32] * 3, device=device)
    copies = [torch.empty_like(x, dtype=torch.float16) for x in p]
    ref_p = [x.double() for x in p]
    ref_b = [x.double() for x in buf]
    wd, mom, damp, lr, scale = 0.01, 0.9, 0.0 if nesterov else 0.1, 0.1, 0.5
    multi_tensor_applier(amp_C.multi_tensor_sgd, flag(device), [g, p, buf, copies], wd, mom, damp, lr, nesterov,
                         first_run, wd_after, scale)
    for i in range(len(SIZES)):
        d = g[i].double() * scale
        if not wd_after:
            d = d + wd * ref_p[i]
        b = d if first_run else mom * ref_b[i] + (1 - damp) * d
        d = d + mom * b if nesterov else b
        if wd_after:
            d = d + wd * ref_p[i]
        want = ref_p[i] - lr * d
        assert_close_tolerance(p[i], want, None, name="p")
        assert_close_tolerance(buf[i], b, None, name="buf")
        assert torch.equal(copies[i], p[i].half())


def test_sgd_without_momentum_and_noop(backend, device):
    g, p, buf = lists_of(*[torch.float32] * 3, device=device)
    old_p, old_b = [x.clone() for x in p], [x.clone() for x in buf]
    multi_tensor_applier(amp_C.multi_tensor_sgd, flag(device, 1), [g, p, buf], 0.0, 0.9, 0.0, 0.1, False, False,
                         False, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(p, old_p))
    multi_tensor_applier(amp_C.multi_tensor_sgd, flag(device), [g, p, buf], 0.0, 0.0, 0.0, 0.1, False, False, False,
                         1.0)
    for a, b, gr in zip(p, old_p, g):
        torch.testing.assert_close(a, b - 0.1 * gr)
    assert all(torch.equal(a, b) for a, b in zip(buf, old_b))  # no momentum: buffer untouched


def test_noncontiguous_outputs_are_written_back(backend, device):
    src = [torch.randn(7, device=device), torch.randn(9000, device=device)]
    dst = [make_strided_lastdim(torch.zeros(7, device=device)), make_strided_lastdim(torch.zeros(9000, device=device))]
    multi_tensor_applier(amp_C.multi_tensor_scale, flag(device), [src, dst], 3.0)
    for s, d in zip(src, dst):
        assert not d.is_contiguous()
        torch.testing.assert_close(d, s * 3.0)


def test_table_cache_reuse_is_correct(triton_backend, device):
    """A repeated signature reuses its plan and, for the same tensors, its address table; new tensors of the
    same sizes (gradients re-allocated every step) reuse the plan with a new address table."""
    common.clear_cache()
    src, dst = lists_of(torch.float32, torch.float32, device=device)
    f = flag(device)
    multi_tensor_applier(amp_C.multi_tensor_scale, f, [src, dst], 2.0)
    assert len(common.PLANS) == 1
    plan = next(iter(common.PLANS.values()))
    assert len(plan.tables._ptrs) == 1
    for x in src:
        x.mul_(-1)
    multi_tensor_applier(amp_C.multi_tensor_scale, f, [src, dst], 2.0)
    assert len(common.PLANS) == 1 and len(plan.tables._ptrs) == 1  # same tensors: the tables were reused
    for x, y in zip(src, dst):
        torch.testing.assert_close(y, x * 2.0)
    dst2 = [torch.full_like(y, float("nan")) for y in dst]
    multi_tensor_applier(amp_C.multi_tensor_scale, f, [src, dst2], 3.0)
    assert len(common.PLANS) == 1 and len(plan.tables._ptrs) == 2
    for x, y, z in zip(src, dst, dst2):
        torch.testing.assert_close(z, x * 3.0)
        torch.testing.assert_close(y, x * 2.0)  # the old outputs were not touched


def test_empty_lists(backend, device):
    f = flag(device)
    multi_tensor_applier(amp_C.multi_tensor_scale, f, [[], []], 2.0)
    norm, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, f, [[]], True)
    assert norm.item() == 0 and per.numel() == 0


def test_bad_input_errors(device):
    f = flag(device)
    a = [torch.randn(4, device=device)]
    with pytest.raises(ValueError, match="expected 2 tensor lists"):
        amp_C.multi_tensor_scale(2048, f, [a], 1.0)
    with pytest.raises(ValueError, match=r"tensor_lists\[1\]\[0\] has 5 elements"):
        amp_C.multi_tensor_scale(2048, f, [a, [torch.randn(5, device=device)]], 1.0)
    with pytest.raises(ValueError, match="has 2 tensors"):
        amp_C.multi_tensor_scale(2048, f, [a, a * 2], 1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        amp_C.multi_tensor_scale(0, f, [a, a], 1.0)
    with pytest.raises(ValueError, match="arg_to_check"):
        amp_C.multi_tensor_axpby(2048, f, [a, a, a], 1.0, 1.0, 2)
    with pytest.raises(TypeError, match="noop_flag"):
        amp_C.multi_tensor_scale(2048, 0, [a, a], 1.0)
    with pytest.raises(ValueError, match="mode"):
        amp_C.multi_tensor_adam(2048, f, [a, a, a, a], 1e-3, 0.9, 0.99, 1e-8, 1, 2, 1, 0.0)


@pytest.mark.gpu
def test_more_than_2_31_elements_gpu():
    n = 2**31 + 1000
    x = torch.ones(n, dtype=torch.float16, device="cuda")
    x[-1] = 3.0
    f = flag("cuda")
    multi_tensor_applier(amp_C.multi_tensor_scale, f, [[x], [x]], 2.0)
    assert x[-1].item() == 6.0 and x[2**31 + 5].item() == 2.0 and x[0].item() == 2.0
    norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, f, [[x]], False)
    expected = ((n - 1) * 4.0 + 36.0) ** 0.5
    assert abs(norm.item() - expected) / expected < 1e-3


@pytest.mark.gpu
def test_cuda_graph_capture_replays_adam():
    dev = torch.device("cuda")
    g, p, m, v = lists_of(*[torch.float32] * 4, device=dev, positive=(3,))
    lr = torch.tensor([1e-2], device=dev)
    step = torch.tensor([1], dtype=torch.int32, device=dev)
    inv = torch.ones(1, device=dev)
    f = flag(dev)

    def fn():
        amp_C.multi_tensor_adam_capturable(2048, f, [g, p, m, v], lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.0, inv)

    fn()  # warm-up: compiles and caches the table
    expect_p = [x.clone() for x in p]
    exp_m, exp_v = [x.clone() for x in m], [x.clone() for x in v]
    adam.adam_update([g, expect_p, exp_m, exp_v], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=1, mode=1,
                     bias_correction=True, weight_decay=0.0, noop_flag=flag(dev))
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(p, expect_p):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_compile_fullgraph_traces_the_custom_ops(device):
    """Under torch.compile the amp_C entry points become custom-op nodes: no graph break, same results."""
    torch._dynamo.reset()
    g, p, m, v = lists_of(*[torch.float32] * 4, device=device, sizes=[5, 33], positive=(3,))
    src, dst = lists_of(torch.float32, torch.float32, device=device, sizes=[5, 33])
    f = flag(device)

    def step(g, p, m, v, src, dst, f):
        amp_C.multi_tensor_scale(2048, f, [src, dst], 0.5)
        amp_C.multi_tensor_axpby(2048, f, [src, dst, dst], 1.0, 2.0, -1)
        norm, per = amp_C.multi_tensor_l2norm(2048, f, [dst], True)
        adam.adam_update([g, p, m, v], lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, step=2, mode=1,
                         bias_correction=True, weight_decay=0.0, noop_flag=f)
        amp_C.multi_tensor_sgd(2048, f, [g, p, m], 0.0, 0.9, 0.0, 0.1, False, False, False, 1.0)
        return norm, per

    eager = [[t.clone() for t in lst] for lst in (g, p, m, v, src, dst)]
    want = step(*eager, flag(device))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(g, p, m, v, src, dst, f)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    for lst, ref in zip((p, m, dst), (eager[1], eager[2], eager[5])):
        for a, b in zip(lst, ref):
            torch.testing.assert_close(a, b)
