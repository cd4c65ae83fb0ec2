"""O1 per-op casting on CPU (fp16 and bf16): Apex's 16-bit / fp32 / promote / banned lists,
user registrations, disable_casts, and that nothing leaks once amp is switched off."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from amp_testutils import LOW_DTYPES, MLP, clean_amp, fresh  # noqa: F401 - clean_amp is an autouse fixture
from torch import nn

from culmen import amp
from culmen.amp._amp_state import _amp_state

B, H = 6, 10


def _o1(dtype: torch.dtype) -> nn.Module:
    model, opt = fresh()
    level = "O4" if dtype == torch.bfloat16 else "O1"
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert _amp_state.cast_engine.dtype == dtype
    return model


def _x(dtype=torch.float32, shape=(B, H)):
    return torch.randn(*shape).to(dtype)


ALWAYS_LOW = {
    "F.linear": lambda x: F.linear(x, torch.randn(H, H)),
    "nn.Linear": lambda x: nn.Linear(H, H)(x),
    "matmul": lambda x: torch.matmul(x, torch.randn(H, H)),
    "@": lambda x: x @ torch.randn(H, H),
    "Tensor.matmul": lambda x: x.matmul(torch.randn(H, H)),
    "mm": lambda x: torch.mm(x, torch.randn(H, H)),
    "addmm": lambda x: torch.addmm(torch.randn(H), x, torch.randn(H, H)),
    "bmm": lambda x: torch.bmm(x.reshape(2, 3, H), torch.randn(2, H, 4)),
    "mv": lambda x: torch.mv(x, torch.randn(H)),
    "addmv": lambda x: torch.addmv(torch.randn(B), x, torch.randn(H)),
    "addr": lambda x: torch.addr(torch.randn(B, H), x[:, 0], torch.randn(H)),
    "conv1d": lambda x: F.conv1d(x.reshape(2, 3, H), torch.randn(4, 3, 3)),
    "conv2d": lambda x: nn.Conv2d(1, 2, 3)(x.reshape(1, 1, B, H)),
    "prelu": lambda x: F.prelu(x, torch.tensor([0.25])),
}

ALWAYS_FLOAT = {
    "softmax": lambda x: F.softmax(x, dim=1),
    "nn.Softmax": lambda x: nn.Softmax(dim=1)(x),
    "log_softmax": lambda x: torch.log_softmax(x, 1),
    "softmin": lambda x: F.softmin(x, dim=1),
    "layer_norm": lambda x: F.layer_norm(x, (H,)),
    "nn.GroupNorm": lambda x: nn.GroupNorm(2, H)(x),
    "exp": torch.exp,
    "log": lambda x: torch.log(x.abs() + 1),
    "pow": lambda x: torch.pow(x, 2),
    "**": lambda x: x ** 2.0,
    "sum": lambda x: x.sum(),
    "sum(dim)": lambda x: torch.sum(x, 1),
    "cumsum": lambda x: torch.cumsum(x, 0),
    "prod": lambda x: x.prod(1),
    "std": lambda x: x.std(),
    "var": lambda x: torch.var(x, 1),
    "norm": lambda x: x.norm(),
    "dist": lambda x: torch.dist(x, x.flip(0)),
    "softplus": F.softplus,
    "normalize": lambda x: F.normalize(x, dim=1),
    "cosine_similarity": lambda x: F.cosine_similarity(x, x.flip(0)),
    "mse_loss": lambda x: F.mse_loss(x, torch.zeros(B, H)),
    "l1_loss": lambda x: nn.L1Loss()(x, torch.zeros(B, H)),
    "cross_entropy": lambda x: F.cross_entropy(x, torch.arange(B) % H),
    "nll_loss": lambda x: F.nll_loss(x, torch.arange(B) % H),
    "kl_div": lambda x: F.kl_div(x, torch.rand(B, H), reduction="batchmean"),
    "bce_with_logits": lambda x: F.binary_cross_entropy_with_logits(x, torch.rand(B, H)),
    "smooth_l1_loss": lambda x: F.smooth_l1_loss(x, torch.zeros(B, H)),
    "interpolate": lambda x: F.interpolate(x.reshape(1, B, H), scale_factor=2.0, mode="linear"),
    "local_response_norm": lambda x: F.local_response_norm(x.reshape(1, B, H), 2),
}

MATCH_INPUT = {
    "relu": torch.relu,
    "nn.ReLU": nn.ReLU(),
    "tanh": torch.tanh,
    "batch_norm": lambda x: nn.BatchNorm1d(H)(x),
    "mean": lambda x: x.mean(),
    "add": lambda x: x + x,
}


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_always_low(dtype):
    _o1(dtype)
    for name, fn in ALWAYS_LOW.items():
        for in_dtype in (torch.float32, dtype):
            assert fn(_x(in_dtype)).dtype == dtype, f"{name} with {in_dtype} input"


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_always_float(dtype):
    _o1(dtype)
    for name, fn in ALWAYS_FLOAT.items():
        for in_dtype in (torch.float32, dtype):
            assert fn(_x(in_dtype)).dtype == torch.float32, f"{name} with {in_dtype} input"


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_match_input(dtype):
    _o1(dtype)
    for name, fn in MATCH_INPUT.items():
        for in_dtype in (torch.float32, dtype):
            assert fn(_x(in_dtype)).dtype == in_dtype, f"{name} with {in_dtype} input"


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_promotion(dtype):
    _o1(dtype)
    lo, hi = _x(dtype, (4, 3)), _x(torch.float32, (4, 3))
    assert torch.cat([lo, hi]).dtype == torch.float32
    assert torch.cat([lo, lo]).dtype == dtype
    assert torch.stack([hi, lo]).dtype == torch.float32
    assert torch.dot(lo[0], hi[0]).dtype == torch.float32  # a plain dot refuses mixed dtypes
    assert torch.dot(lo[0], lo[0]).dtype == dtype
    assert torch.addcmul(lo, hi, lo).dtype == torch.float32
    assert torch.atan2(lo, hi).dtype == torch.float32
    assert torch.cross(lo, hi, dim=1).dtype == torch.float32
    assert (lo * hi).dtype == torch.float32 and (lo + hi).dtype == torch.float32


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_values_follow_the_cast(dtype):
    """The casted op computes what the same op computes on explicitly casted inputs."""
    _o1(dtype)
    x, w = torch.randn(B, H), torch.randn(H, H)
    y = F.linear(x, w)
    with amp.disable_casts():
        ref = F.linear(x.to(dtype), w.to(dtype))
        ref_sm = F.softmax(x.to(dtype).float(), 1)
    assert torch.equal(y, ref)
    assert torch.equal(F.softmax(x.to(dtype), 1), ref_sm)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_model_forward_and_grads(dtype):
    model = _o1(dtype)
    x = torch.randn(B, 12)
    out = model(x)
    assert out.dtype == dtype
    loss = F.mse_loss(out, torch.zeros_like(out))
    assert loss.dtype == torch.float32
    loss.backward()
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()


def test_weight_used_twice_in_one_forward():
    """The cast cache (one forward) must not break tied weights or their gradient."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)

        def forward(self, x):
            return self.lin(torch.relu(self.lin(x)))

    torch.manual_seed(0)
    ref = Tied()
    model = Tied()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(B, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's cache shares one cast of the weight
        loss = ref(x).float().sum()
    loss.backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O4", verbosity=0)
    model(x).float().sum().backward()
    assert torch.equal(model.lin.weight.grad, ref.lin.weight.grad)
    assert torch.equal(model.lin.bias.grad, ref.lin.bias.grad)


def test_model_outputs_cast():
    model, opt = fresh()
    model, opt = amp.initialize(model, opt, opt_level="O1", cast_model_outputs=torch.float32, verbosity=0)
    assert model(torch.randn(B, 12)).dtype == torch.float32
    assert F.linear(torch.randn(2, 3), torch.randn(3, 3)).dtype == torch.float16


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_banned_bce(dtype):
    _o1(dtype)
    target = torch.rand(B, H)
    probs = torch.rand(B, H).to(dtype)
    for fn in (lambda p: F.binary_cross_entropy(p, target), lambda p: nn.BCELoss()(p, target)):
        with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
            fn(probs)
        assert fn(probs.float()).dtype == torch.float32  # fp32 inputs are fine, as in Apex


def test_allow_banned_runs_bce_in_fp32():
    with pytest.warns(FutureWarning, match="amp.init"):
        handle = amp.init(allow_banned=True)
    assert handle.is_active()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the old API casts on CUDA when there is a GPU
    probs = torch.rand(B, H, device=dev).half()
    out = F.binary_cross_entropy(probs, torch.rand(B, H, device=dev))
    assert out.dtype == torch.float32
    handle._deactivate()
    assert not torch.is_autocast_enabled(dev)


def test_disable_casts():
    _o1(torch.float16)
    x, w = torch.randn(B, H), torch.randn(H, H)
    with amp.disable_casts():
        assert F.linear(x, w).dtype == torch.float32
        assert F.softmax(x.half(), 1).dtype == torch.float16  # no fp32 cast either
    assert F.linear(x, w).dtype == torch.float16


def test_optimizer_step_runs_without_casts():
    model, opt = fresh()
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    seen = []

    class Probe(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(torch.is_autocast_enabled("cpu"))
            return super().step(closure)

    m2 = MLP()
    probe = Probe(m2.parameters(), lr=0.1)
    amp.deinitialize()
    m2, probe = amp.initialize(m2, probe, opt_level="O1", loss_scale=128, verbosity=0)
    with amp.scale_loss(m2(torch.randn(B, 12)).float().sum(), probe) as s:
        s.backward()
    probe.step()
    assert seen == [False] and torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("inside_scale_loss", [True, False])
def test_backward_runs_without_casts(inside_scale_loss):
    model, opt = fresh()
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    calls = []

    def hook(grad):
        calls.append(torch.is_autocast_enabled("cpu"))
        return grad

    out = model(torch.randn(B, 12))
    out.register_hook(hook)
    if inside_scale_loss:
        with amp.scale_loss(out.float().sum(), opt) as scaled:
            scaled.backward()
    else:
        torch.autograd.grad(out.float().sum(), [model.head.weight])
    assert calls == [False] and torch.is_autocast_enabled("cpu")


def _custom_ns():
    class NS:
        @staticmethod
        def add_one(x):
            return x + 1

        @staticmethod
        def mix(a, b):
            return a.float() * 0 + b.to(a.dtype) if a.dtype != b.dtype else a + b

    return NS


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_register_functions(dtype):
    ns_half, ns_float, ns_prom = _custom_ns(), _custom_ns(), _custom_ns()
    amp.register_half_function(ns_half, "add_one")
    amp.register_float_function(ns_float, "add_one")
    amp.register_promote_function(ns_prom, "mix")
    x = torch.randn(3)
    assert ns_half.add_one(x).dtype == torch.float32  # registrations act only while O1 is active
    _o1(dtype)
    assert ns_half.add_one(x).dtype == dtype
    assert ns_float.add_one(x.to(dtype)).dtype == torch.float32
    assert ns_prom.mix(x.to(dtype), x).dtype == torch.float32
    with amp.disable_casts():
        assert ns_half.add_one(x).dtype == torch.float32
    amp.deinitialize()
    assert ns_half.add_one(x).dtype == torch.float32
    assert not hasattr(ns_half.add_one, "__culmen_amp_wrapped__")  # the patch is undone


def test_register_while_active_and_bad_name():
    _o1(torch.float16)
    ns = _custom_ns()
    amp.register_half_function(ns, "add_one")
    assert ns.add_one(torch.randn(2)).dtype == torch.float16
    with pytest.raises(ValueError, match="No function named nope"):
        amp.register_float_function(ns, "nope")
    amp.register_bfloat16_function(ns, "mix")
    assert ns.mix(torch.randn(2), torch.randn(2)).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_decorators(dtype):
    @amp.half_function
    def h(x):
        return x

    @amp.float_function
    def f(x, scale=None):
        return x, scale

    @amp.promote_function
    def p(a, b):
        return a, b

    @amp.bfloat16_function
    def bf(x):
        return x

    x = torch.randn(3)
    assert h(x).dtype == torch.float32  # outside O1: pass-through
    _o1(dtype)
    assert h(x).dtype == dtype
    assert h(torch.arange(3)).dtype == torch.int64  # integer tensors are never cast
    xs, s = f(x.to(dtype), scale=x.to(dtype))
    assert xs.dtype == torch.float32 and s.dtype == torch.float32
    a, b = p(x.to(dtype), x)
    assert a.dtype == b.dtype == torch.float32
    a, b = p([x.to(dtype)], {"k": x})
    assert a[0].dtype == b["k"].dtype == torch.float32
    assert bf(x).dtype == torch.bfloat16
    assert h.__name__ == "h"


def test_nothing_leaks_after_deinitialize():
    _o1(torch.float16)
    assert torch.is_autocast_enabled("cpu")
    amp.deinitialize()
    assert not torch.is_autocast_enabled("cpu")
    x = torch.randn(B, H).half()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # torch's own CPU policy again: softmax / std are not forced to fp32 on CPU.
        assert F.softmax(x.bfloat16(), 1).dtype == torch.bfloat16
        assert x.bfloat16().std().dtype == torch.bfloat16
        assert F.binary_cross_entropy(torch.rand(3).bfloat16(), torch.rand(3)).dtype == torch.float32
    assert F.linear(torch.randn(2, 3), torch.randn(3, 3)).dtype == torch.float32


def test_engine_lists_follow_dispatcher():
    _o1(torch.float16)
    covered = set(_amp_state.cast_engine.covered["cpu"])
    # On CPU torch has no fp32 policy for softmax / std / layer_norm: culmen adds Apex's.
    assert {"softmax.int", "std", "layer_norm", "binary_cross_entropy"} <= covered
    # ... but torch's own CPU kernels (mm, mse_loss, nll_loss) are kept, not replaced.
    assert not {"mm", "mse_loss", "nll_loss"} & covered


def test_user_autocast_inside_o1_and_warning_free():
    _o1(torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert F.linear(torch.randn(2, 3), torch.randn(3, 3)).dtype == torch.bfloat16
        assert F.linear(torch.randn(2, 3), torch.randn(3, 3)).dtype == torch.float16
