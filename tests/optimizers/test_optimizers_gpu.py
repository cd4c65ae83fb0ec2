"""GPU tests of the fused optimizers at real sizes: torch / reference parity, GradScaler with autocast,
capturable steps in CUDA graphs, fp32 master weights, launch counts, clip_grad_norm_ and LARC."""

from __future__ import annotations

import pytest
import torch

from culmen.contrib.clip_grad import clip_grad_norm_
from culmen.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedLARS,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)
from culmen.optimizers.reference import RefLAMB, RefLARS, RefMixedPrecisionLamb, RefNovoGrad
from culmen.parallel.LARC import LARC

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
# A small transformer-like set: embeddings, 4 layers of weights/biases/norms (~9.6M params, 52 tensors),
# plus odd sizes and a tensor of more than one 8192-element chunk per program.
SHAPES = [(5003, 512), (1024, 512)] + [s for _ in range(4) for s in
                                         [(512,), (512,), (512, 1536), (1536,), (512, 512), (512,), (512,), (512,),
                                          (512, 2048), (2048,), (2048, 512), (512,)]] + [(1,), (4097,), (3, 77)]


def params(dtype=torch.float32, shapes=SHAPES, scale=0.02):
    return [(torch.randn(s, device=DEV) * scale).to(dtype).requires_grad_() for s in shapes]


def copies(ps, dtype=None):
    return [p.detach().to(dtype or p.dtype, copy=True).requires_grad_() for p in ps]


def set_grads(ps, gs):
    for p, g in zip(ps, gs):
        p.grad = None if g is None else g.to(p.dtype, copy=True)


def grads(ps, scale=1e-2):
    return [torch.randn(p.shape, device=DEV) * scale for p in ps]


def close(xs, ys, rtol=1e-5, atol=1e-6):
    for i, (x, y) in enumerate(zip(xs, ys)):
        torch.testing.assert_close(x.detach().double(), y.detach().double(), rtol=rtol, atol=atol,
                                   msg=lambda m, i=i: f"tensor {i}: {m}")


def lockstep(ours, ref, a, b, steps=7):
    for _ in range(steps):
        gs = grads(a)
        set_grads(a, gs)
        set_grads(b, gs)
        ours.step()
        ref.step()


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_vs_torch_fused(adam_w_mode):
    a = params()
    b = copies(a)
    ours = FusedAdam(a, lr=1e-3, weight_decay=0.1, adam_w_mode=adam_w_mode)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = cls(b, lr=1e-3, weight_decay=0.1, fused=True)
    lockstep(ours, ref, a, b)
    # |step| <= lr = 1e-3; where g + wd p nearly cancels (Adam's L2 mode) sqrt(v) ~ eps and the last-bit
    # differences of the two kernels show as up to ~1% of one step
    close(a, b, atol=1e-5)
    close([ours.state[p]["exp_avg_sq"] for p in a], [ref.state[p]["exp_avg_sq"] for p in b], atol=1e-9)


def test_sgd_adagrad_vs_torch_fused():
    for make, make_ref in (
        (lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
         lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4, fused=True)),
        (lambda ps: FusedAdagrad(ps, lr=0.05, weight_decay=1e-4),  # torch 2.11 has no fused CUDA Adagrad
         lambda ps: torch.optim.Adagrad(ps, lr=0.05, weight_decay=1e-4, foreach=True)),
    ):
        a = params()
        b = copies(a)
        lockstep(make(a), make_ref(b), a, b)
        close(a, b)


@pytest.mark.parametrize("name", ["lamb", "mp_lamb", "novograd", "lars"])
def test_layerwise_vs_reference(name):
    a = params()
    b = copies(a, torch.float64)
    makers = {
        "lamb": (lambda ps: FusedLAMB(ps, lr=1e-3, weight_decay=0.01),
                 lambda ps: RefLAMB(ps, lr=1e-3, weight_decay=0.01)),
        "mp_lamb": (lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-3, weight_decay=0.01),
                    lambda ps: RefMixedPrecisionLamb(ps, lr=1e-3, weight_decay=0.01)),
        "novograd": (lambda ps: FusedNovoGrad(ps, lr=1e-3, weight_decay=0.01, norm_type=0),
                     lambda ps: RefNovoGrad(ps, lr=1e-3, weight_decay=0.01, norm_type=0)),
        "lars": (lambda ps: FusedLARS(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.02),
                 lambda ps: RefLARS(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.02)),
    }
    ours, ref = makers[name][0](a), makers[name][1](b)
    lockstep(ours, ref, a, b)
    close(a, b, rtol=2e-5, atol=2e-6)


def test_master_weights_bf16_vs_fp32_adamw():
    a = params(torch.bfloat16)
    b = copies(a, torch.float32)
    ours = FusedAdam(a, lr=1e-3, weight_decay=0.1, master_weights=True)
    ref = torch.optim.AdamW(b, lr=1e-3, weight_decay=0.1, fused=True)
    for _ in range(7):
        gs = [g.to(torch.bfloat16) for g in grads(a)]  # both see the same (bf16) gradients
        set_grads(a, gs)
        set_grads(b, gs)
        ours.step()
        ref.step()
    masters = [ours.state[p]["master_param"] for p in a]
    close(masters, b)
    for p, q in zip(a, masters):
        assert torch.equal(p.detach(), q.to(torch.bfloat16))  # the GPU rounds to nearest


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(DEV)


def test_grad_scaler_autocast_fp16():
    """Mixed-precision training with GradScaler: culmen's in-kernel unscale/skip vs torch's fused AdamW."""
    m_ours, m_ref = _mlp(), _mlp()
    ours = FusedAdam(m_ours.parameters(), lr=1e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    s_ours = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
    s_ref = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
    for it in range(10):
        x = torch.randn(64, 256, device=DEV)
        with torch.no_grad():  # same weights before every step: the comparison is of one step each time
            for p, q in zip(m_ours.parameters(), m_ref.parameters()):
                q.copy_(p)
        for model, opt, sc in ((m_ours, ours, s_ours), (m_ref, ref, s_ref)):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            sc.scale(loss).backward()
            if it == 4:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            sc.step(opt)
            sc.update()
        assert s_ours.get_scale() == s_ref.get_scale()
        close(list(m_ours.parameters()), list(m_ref.parameters()), rtol=1e-5, atol=1e-5)
    close([ours.state[p]["exp_avg"] for p in m_ours.parameters()],
          [ref.state[p]["exp_avg"] for p in m_ref.parameters()], rtol=1e-5, atol=1e-8)
    assert int(ours.param_groups[0]["step"]) == 9


@pytest.mark.parametrize("master_weights", [False, True])
def test_capturable_cuda_graph(master_weights):
    """A captured FusedAdam(capturable=True) step replays exactly like eager steps (lr changed in place)."""
    dtype = torch.bfloat16 if master_weights else torch.float32
    init = params(dtype)
    gs = [grads(init) for _ in range(6)]
    eager = copies(init)
    o_eager = FusedAdam(eager, lr=1e-3, weight_decay=0.1, capturable=True, master_weights=master_weights)
    for s in range(6):
        if s == 4:
            o_eager.param_groups[0]["lr"].fill_(5e-4)
        set_grads(eager, gs[s])
        o_eager.step()

    graphed = copies(init)
    o_g = FusedAdam(graphed, lr=1e-3, weight_decay=0.1, capturable=True, master_weights=master_weights)
    static = [torch.zeros_like(p) for p in graphed]
    for p, g in zip(graphed, static):
        p.grad = g
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up step (builds launch tables, compiles) outside the capture
        for g, src in zip(static, gs[0]):
            g.copy_(src)
        o_g.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g.step()
    for s in range(1, 6):
        if s == 4:
            o_g.param_groups[0]["lr"].fill_(5e-4)
        for g, src in zip(static, gs[s]):
            g.copy_(src)
        graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(graphed, eager):
        assert torch.equal(x.detach(), y.detach())
    assert int(o_g.param_groups[0]["step"]) == 6


def test_mixed_precision_lamb_cuda_graph():
    init = params(torch.bfloat16)
    gs = [grads(init) for _ in range(4)]
    make = lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-3, reduced_precision_dtype=torch.bfloat16)
    eager = copies(init)
    o_e = make(eager)
    for s in range(4):
        set_grads(eager, gs[s])
        o_e.step()
    graphed = copies(init)
    o_g = make(graphed)
    static = [torch.zeros_like(p) for p in graphed]
    for p, g in zip(graphed, static):
        p.grad = g

    def load(s):  # LAMB overwrites the gradients with its updates: reload them every step
        for g, src in zip(static, gs[s]):
            g.copy_(src)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        load(0)
        o_g.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g.step()
    for s in range(1, 4):
        load(s)
        graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(graphed, eager):
        assert torch.equal(x.detach(), y.detach())


def _kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.lower().startswith(("memcpy", "memset")))


def test_launches_do_not_grow_with_tensor_count():
    counts = {}
    for n in (8, 400):
        ps = params(shapes=[(1000 + i,) for i in range(n)])
        set_grads(ps, grads(ps))
        opts = {"adam": FusedAdam(ps), "sgd": FusedSGD(ps, lr=0.1, momentum=0.9), "lamb": FusedLAMB(ps),
                "lars": FusedLARS(ps, lr=0.1, momentum=0.9), "novograd": FusedNovoGrad(ps),
                "adagrad": FusedAdagrad(ps)}
        for name, opt in opts.items():
            opt.step()  # first step: state allocation and first-run paths
            opt.step()
            set_grads(ps, grads(ps))
            counts[(name, n)] = _kernels(opt.step)
    for name in ("adam", "sgd", "lamb", "lars", "novograd", "adagrad"):
        assert counts[(name, 8)] == counts[(name, 400)], (name, counts)
    assert counts[("adam", 400)] == 1 and counts[("sgd", 400)] == 1 and counts[("adagrad", 400)] == 1


def test_clip_grad_norm_and_larc():
    a = params()
    b = copies(a)
    gs = grads(a, scale=1.0)
    set_grads(a, gs)
    set_grads(b, gs)
    got = clip_grad_norm_(a, 1.0)
    want = torch.nn.utils.clip_grad_norm_(b, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    close([p.grad for p in a], [p.grad for p in b])

    a = params()
    b = copies(a)
    larc = LARC(FusedSGD(a, lr=0.1, momentum=0.9, weight_decay=1e-4))
    ref = torch.optim.SGD(b, lr=0.1, momentum=0.9)
    for _ in range(3):
        gs = grads(a)
        set_grads(a, gs)
        set_grads(b, gs)
        larc.step()
        with torch.no_grad():
            for p in b:
                pn, gn = p.norm(), p.grad.norm()
                rate = torch.clamp(0.02 * pn / (gn + pn * 1e-4 + 1e-8) / 0.1, max=1.0)
                p.grad.add_(p, alpha=1e-4).mul_(rate)
        ref.step()
    close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_params_on_two_devices():
    a = params(shapes=[(1000,), (77, 3)]) + [(torch.randn(4097, device="cuda:1") * 0.02).requires_grad_()]
    b = copies(a)
    ours = FusedAdam(a, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        gs = [torch.randn_like(p) for p in a]
        set_grads(a, gs)
        set_grads(b, gs)
        ours.step()
        ref.step()
    close(a, b)


def _launches(*opts):
    """Every bound ``Launch`` of the multi-tensor plans: amp_C signature plans and the optimizers' own."""
    from culmen.ops.multi_tensor.common import PLANS

    plans = list(PLANS.values())
    for opt in opts:
        for gp in opt._plans.values():
            for variant in gp.variants.values():
                plans.extend(variant)
    return [la for p in plans for la in p._la.values()]


def test_fast_launch_bitwise():
    """The direct C launches of the cached plans (second step on) give exactly what Triton's own launch gives:
    FusedAdam (plain; capturable + masters + GradScaler attributes, in-kernel step counter), FusedSGD, FusedLAMB,
    and the amp_C scale / l2norm entries."""
    from culmen.multi_tensor_apply import amp_C, multi_tensor_applier
    from culmen.ops.common.launch import set_fast_launch

    init = params(shapes=SHAPES[:12] + [(1,), (4097,), (3, 77)])
    low = params(torch.bfloat16, shapes=[(513,), (64, 65), (8193,)])
    gs = [grads(init) for _ in range(3)]
    gl = [grads(low) for _ in range(3)]
    results = {}
    try:
        for fast in (False, True):
            set_fast_launch(fast)
            a, b, c, d = copies(init), copies(init), copies(init), copies(low)
            opts = [FusedAdam(a, lr=1e-3, weight_decay=0.1), FusedSGD(b, lr=0.05, momentum=0.9),
                    FusedLAMB(c, lr=1e-3), FusedAdam(d, lr=1e-3, capturable=True, master_weights=True)]
            opts[3].grad_scale = torch.full((1,), 256.0, device=DEV)
            opts[3].found_inf = torch.zeros(1, device=DEV)
            flag = torch.zeros(1, dtype=torch.int32, device=DEV)
            outs = [torch.empty_like(p) for p in init]
            norms = []
            for s in range(3):
                for ps, g in ((a, gs[s]), (b, gs[s]), (c, gs[s]), (d, [x * 256 for x in gl[s]])):
                    set_grads(ps, g)
                for opt in opts:
                    opt.step()
                multi_tensor_applier(amp_C.multi_tensor_scale, flag, [gs[s], outs], 0.5)
                norms.append(multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [outs], True))
            results[fast] = [t.detach().clone() for t in a + b + c + d + outs] + [n for pair in norms for n in pair]
            results[fast].append(opts[3].param_groups[0]["step"].clone())
            launches = _launches(*opts)
            assert launches
            for la in launches:
                if fast:
                    assert la._run is not None, f"{la.fn.fn.__name__} never took the direct path: {la.error}"
                else:
                    assert la._run is None
    finally:
        set_fast_launch(True)
    assert int(results[True][-1]) == 3
    for x, y in zip(results[False], results[True]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_inductor(dynamic):
    """amp_C ops inside a compiled function (Inductor, fullgraph): the custom ops run the same kernels, results
    equal eager's, and with dynamic shapes new tensor sizes do not recompile."""
    from culmen.multi_tensor_apply import amp_C

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def fn(g, p, m, v, out, flag, lr, step):
        amp_C.multi_tensor_scale(2048, flag, [g, out], 0.5)
        norm, per = amp_C.multi_tensor_l2norm(2048, flag, [out], True)
        amp_C.multi_tensor_adam_capturable(2048, flag, [g, p, m, v], lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.01,
                                           torch.ones(1, device=DEV))
        amp_C.multi_tensor_sgd(2048, flag, [out, p, m], 0.0, 0.9, 0.0, 0.1, False, False, False, 1.0)
        return norm, per

    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)
    for sizes in ((1000, 77, 4097), (1200, 93, 9000), (3000, 130, 8193)):
        base = [[torch.randn(n, device=DEV) for n in sizes] for _ in range(5)]
        base[3] = [x.abs() for x in base[3]]
        runs = []
        for f in (fn, compiled):
            lists = [[x.clone() for x in lst] for lst in base]
            flag = torch.zeros(1, dtype=torch.int32, device=DEV)
            lr = torch.full((1,), 1e-3, device=DEV)
            step = torch.full((1,), 3, dtype=torch.int32, device=DEV)
            norm, per = f(*lists, flag, lr, step)
            runs.append([norm, per, *lists[1], *lists[2], *lists[3], *lists[4]])
        for e, c in zip(*runs):
            assert torch.equal(e, c)
    if dynamic:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sgd_16bit_exact_like_apex_gpu(dtype):
    """Apex's TestFusedSGD.test_half settings (278011 elements, lr 0.25, momentum 0.125, 7 steps): with the
    step rounded to the param dtype before the add (Apex's formula) culmen equals torch.optim.SGD exactly."""
    gen = torch.Generator(device=DEV).manual_seed(9876)
    init = torch.rand(278011, generator=gen, device=DEV).to(dtype)
    p = torch.nn.Parameter(init.clone())
    q = torch.nn.Parameter(init.clone())
    ours = FusedSGD([p], lr=0.25, momentum=0.125)
    ref = torch.optim.SGD([q], lr=0.25, momentum=0.125)
    for _ in range(7):
        g = torch.rand(278011, generator=gen, device=DEV).to(dtype)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        assert (p.detach().float() - q.detach().float()).abs().max().item() <= 1e-3  # Apex's bound
    assert torch.equal(p, q)


@pytest.mark.parametrize("make", [
    lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01),
    lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01, capturable=True),
    lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01, capturable=True, master_weights=True),
    lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
    lambda ps: FusedAdagrad(ps, lr=1e-2),
], ids=["adam", "adam_capturable", "adam_capturable_masters", "sgd", "adagrad"])
def test_grad_scaler_leaves_grads_unscaled_gpu(make):
    """After ``scaler.step(opt)`` every ``.grad`` is what torch's optimizers leave (GradScaler.unscale_'s
    result), on taken and skipped (inf) steps alike, at real sizes with autocast."""
    m_ours, m_ref = _mlp(), _mlp()
    ours = make(list(m_ours.parameters()))
    ref = torch.optim.SGD(m_ref.parameters(), lr=0.0)  # torch's path: GradScaler unscales the grads itself
    s_ours = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
    s_ref = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
    for it in range(6):
        x = torch.randn(64, 256, device=DEV)
        with torch.no_grad():
            for p, q in zip(m_ours.parameters(), m_ref.parameters()):
                q.copy_(p)
        for model, opt, sc in ((m_ours, ours, s_ours), (m_ref, ref, s_ref)):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            sc.scale(loss).backward()
            if it == 3:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            sc.step(opt)
            sc.update()
        for p, q in zip(m_ours.parameters(), m_ref.parameters()):
            assert torch.equal(p.grad, q.grad), f"iteration {it}"
