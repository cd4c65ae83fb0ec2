"""``culmen.flash_attn.modules.mlp`` (``Mlp``, ``GatedMlp``: GLU, fused SwiGLU, other activations,
``multiple_of`` rounding) and ``modules.block`` (``Block`` pre-norm with flash_attn's reordering, fused and
unfused dropout-add-norm, RMSNorm, ``residual_in_fp32``, drop path, post-norm with ``return_residual``,
``mixer_subset``; ``ParallelBlock`` tied and untied; ``StochasticDepth``) against float64 formulas."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from culmen.flash_attn.modules.block import Block, ParallelBlock, StochasticDepth
from culmen.flash_attn.modules.mha import MHA, SelfAttention
from culmen.flash_attn.modules.mlp import GatedMlp, Mlp
from culmen.flash_attn.ops.triton.layer_norm import RMSNorm
from culmen.testing import assert_close_tolerance, make_noncontiguous, randn

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
E = 16


def _compare(module, x, ref, dtype, name, extra_inputs=()):
    """``module(x, *extra)`` (first output) and the gradients of ``x`` and every parameter against
    ``ref(params_dict, x, dtype)`` in float64 (oracle) and ``dtype`` (baseline)."""
    out = module(x, *extra_inputs)
    outs = out if isinstance(out, tuple) else (out,)
    gs = [randn(o.shape, o.dtype, device=o.device) for o in outs]
    got = (*outs, *torch.autograd.grad(outs, [x, *module.parameters()], gs))
    refs = []
    for rdt in (F64, dtype):
        cp = {n: t.detach().to(rdt).requires_grad_() for n, t in module.named_parameters()}
        xr = x.detach().to(rdt).requires_grad_()
        r = ref(cp, xr, rdt)
        rs = r if isinstance(r, tuple) else (r,)
        refs.append((*rs, *torch.autograd.grad(rs, [xr, *cp.values()], [g.to(rdt) for g in gs])))
    labels = [f"out{i}" for i in range(len(outs))] + ["dx"] + [f"d_{n}" for n, _ in module.named_parameters()]
    for a, hi, lo, lab in zip(got, *refs, labels):
        assert_close_tolerance(a, hi, lo, name=f"{name} {lab}")


# ----------------------------------------------------------------------------- MLPs


@pytest.mark.parametrize("dtype,bias", [(F32, True), (BF16, False)])
def test_mlp(dtype, bias):
    m = Mlp(E, 24, 10, bias1=bias, bias2=bias, dtype=dtype)
    x = make_noncontiguous(randn((3, 5, E), dtype)).requires_grad_()

    def ref(p, t, dt):
        return F.linear(F.gelu(F.linear(t, p["fc1.weight"], p.get("fc1.bias"))), p["fc2.weight"], p.get("fc2.bias"))

    _compare(m, x, ref, dtype, "Mlp")
    d = Mlp(E, return_residual=True, activation=F.relu)
    assert d.fc1.weight.shape == (4 * E, E) and d.fc2.weight.shape == (E, 4 * E)
    y, res = d(x.float())
    assert res is not None and torch.equal(res, x.float())


ACT = {"glu": F.sigmoid, "swiglu": F.silu, "geglu": F.gelu}


@pytest.mark.parametrize("act,dtype", [("glu", F32), ("swiglu", BF16), ("swiglu", F32), ("geglu", BF16)])
def test_gated_mlp(act, dtype):
    m = GatedMlp(E, hidden_features=20, multiple_of=8, activation=ACT[act], dtype=dtype)
    assert m.fc1.weight.shape == (48, E) and m.fc2.weight.shape == (E, 24)  # 20 rounded up to 24
    x = randn((2, 7, E), dtype, requires_grad=True)

    def ref(p, t, dt):
        y, gate = F.linear(t, p["fc1.weight"], p["fc1.bias"]).chunk(2, -1)
        return F.linear(y * ACT[act](gate), p["fc2.weight"], p["fc2.bias"])

    _compare(m, x, ref, dtype, f"GatedMlp[{act}]")


def test_gated_mlp_sizes_and_residual():
    assert GatedMlp(12).fc2.weight.shape == (12, 128)  # int(8 * 12 / 3) = 32, rounded up to 128
    assert GatedMlp(12, multiple_of=1).fc2.weight.shape == (12, 32)
    assert GatedMlp(12, hidden_features=33, out_features=5, multiple_of=16).fc1.weight.shape == (96, 12)
    m = GatedMlp(E, multiple_of=4, return_residual=True, activation=F.silu)
    x = randn((3, E))
    out, res = m(x)
    assert res is x and out.shape == (3, E)
    with pytest.raises(ValueError, match="multiple_of must be a positive int"):
        GatedMlp(E, multiple_of=0)


# ----------------------------------------------------------------------------- StochasticDepth


def test_stochastic_depth():
    x = randn((64, 3, 5))
    sd = StochasticDepth(0.25, "row")
    assert torch.equal(sd.eval()(x), x) and torch.equal(StochasticDepth(0.0, "row").train()(x), x)
    y = sd.train()(x)
    scale = y / x
    kept = scale[:, 0, 0]
    # Each row is either dropped or scaled by 1 / (1 - p), whole.
    torch.testing.assert_close(scale, scale[:, :1, :1].expand_as(scale))
    assert torch.all((kept == 0) | torch.isclose(kept, torch.tensor(4 / 3))) and 0 < int((kept == 0).sum()) < 64
    assert torch.count_nonzero(StochasticDepth(1.0, "row").train()(x)) == 0
    b = StochasticDepth(0.5, "batch").train()(x)
    assert torch.equal(b, 0 * x) or torch.equal(b, 2 * x)
    with pytest.raises(ValueError, match="p must be in \\[0, 1\\], got 1.5"):
        StochasticDepth(1.5, "row")
    with pytest.raises(ValueError, match="mode must be 'row' or 'batch'"):
        StochasticDepth(0.1, "col")


# ----------------------------------------------------------------------------- Block


def _mixer(dim):
    return MHA(dim, 2, causal=True)


def _mlp(dim):
    return Mlp(dim, 24)


def _norm(t, w, b, eps, rms):
    if rms:
        return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + eps) * w
    return F.layer_norm(t, t.shape[-1:], w, b, eps)


def _sub(block, dt, p, prefix):
    """A copy of ``block.<prefix>`` in ``dt`` whose parameters are the leaves ``p[prefix.*]`` (so the
    reference's gradients land on them)."""
    m = copy.deepcopy(getattr(block, prefix)).to(dt)
    for n, _ in list(m.named_parameters()):
        *path, leaf = n.split(".")
        owner = m
        for part in path:
            owner = getattr(owner, part)
        delattr(owner, leaf)
        setattr(owner, leaf, p[f"{prefix}.{n}"])
    return m


def prenorm_ref(block, rms, residual_in=None):
    """flash_attn's pre-norm layer written out: add, norm, mixer, add, norm, mlp."""
    def ref(p, x, dt):
        mixer, mlp = _sub(block, dt, p, "mixer"), _sub(block, dt, p, "mlp")
        res = x if residual_in is None else x + residual_in.to(dt)
        h = mixer(_norm(res, p["norm1.weight"], p.get("norm1.bias"), block.norm1.eps, rms))
        res = h + res
        return mlp(_norm(res, p["norm2.weight"], p.get("norm2.bias"), block.norm2.eps, rms)), res
    return ref


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype,rms,first", [(F32, False, True), (BF16, False, False), (F32, True, False)])
def test_block_prenorm(fused, dtype, rms, first):
    norm_cls = partial(RMSNorm, eps=1e-5) if rms else nn.LayerNorm
    blk = Block(E, _mixer, _mlp, norm_cls=norm_cls, fused_dropout_add_ln=fused).to(dtype)
    with torch.no_grad():  # non-trivial norm weights
        for n in (blk.norm1, blk.norm2):
            n.weight.add_(randn(n.weight.shape, dtype, scale=0.3))
    x = randn((2, 5, E), dtype, requires_grad=True)
    residual = None if first else randn((2, 5, E), dtype)
    _compare(blk, x, prenorm_ref(blk, rms, residual), dtype, f"Block[fused={fused}, rms={rms}]",
             extra_inputs=(residual,))


@pytest.mark.parametrize("fused", [False, True])
def test_block_residual_in_fp32(fused):
    blk = Block(E, _mixer, _mlp, fused_dropout_add_ln=fused, residual_in_fp32=True).to(BF16)
    x = randn((2, 5, E), BF16)
    h, res = blk(x)
    assert h.dtype == BF16 and res.dtype == F32
    h2, res2 = blk(h, res)
    assert res2.dtype == F32
    ref = Block(E, _mixer, _mlp).to(BF16)
    ref.load_state_dict(blk.state_dict())
    # The fp32 stream is at least as close to the float64 value as the bf16 one.
    hi = copy.deepcopy(ref).double()
    _, r64 = hi(*hi(x.double()))
    _, r16 = ref(*ref(x))
    assert (res2.double() - r64).abs().max() <= (r16.double() - r64).abs().max() + 1e-6


def test_block_drop_path_fused_matches_unfused():
    blocks = [Block(E, _mixer, _mlp, drop_path1=0.5, drop_path2=0.5, fused_dropout_add_ln=f).train() for f in (0, 1)]
    blocks[1].load_state_dict(blocks[0].state_dict())
    x, res = randn((8, 3, E)), randn((8, 3, E))
    outs = []
    for b in blocks:
        torch.manual_seed(7)
        outs.append(b(x, res))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
    # Some samples were dropped: their residual after the mixer is the input residual + 0.
    assert not torch.allclose(outs[0][1], blocks[0].eval()(x, res)[1])


def test_block_dropout_training_only():
    blk = Block(E, _mixer, _mlp, resid_dropout1=0.3, resid_dropout2=0.3, fused_dropout_add_ln=True)
    x, res = randn((2, 5, E)), randn((2, 5, E))
    ev = blk.eval()(x, res)
    ref = Block(E, _mixer, _mlp)
    ref.load_state_dict(blk.state_dict())
    for a, b in zip(ev, ref(x, res)):
        torch.testing.assert_close(a, b)
    assert not torch.allclose(blk.train()(x, res)[1], ev[1])


@pytest.mark.parametrize("fused,return_residual", [(False, False), (True, True)])
def test_block_postnorm(fused, return_residual):
    blk = Block(E, partial(MHA, num_heads=2, return_residual=return_residual),
                partial(Mlp, hidden_features=24, return_residual=return_residual), prenorm=False,
                fused_dropout_add_ln=fused, return_residual=return_residual)
    x = randn((2, 5, E), requires_grad=True)

    def ref(p, t, dt):
        def strip(y):
            return y[0] if return_residual else y
        mixer, mlp = _sub(blk, dt, p, "mixer"), _sub(blk, dt, p, "mlp")
        h = F.layer_norm(strip(mixer(t)) + t, (E,), p["norm1.weight"], p["norm1.bias"], blk.norm1.eps)
        return F.layer_norm(strip(mlp(h)) + h, (E,), p["norm2.weight"], p["norm2.bias"], blk.norm2.eps)

    _compare(blk, x, ref, F32, f"postnorm[fused={fused}]")
    with pytest.raises(ValueError, match="takes no residual"):
        blk(x, x)


def test_block_mixer_subset_identity_mlp_and_marks():
    blk = Block(E, partial(MHA, num_heads=2, cross_attn=True), nn.Identity, sequence_parallel=True,
                mark_shared_params=True)
    assert not hasattr(blk, "norm2") and not hasattr(blk, "dropout2")
    assert all(p._sequence_parallel and p._shared_params for p in blk.norm1.parameters())
    assert not hasattr(blk.mixer.Wq.weight, "_sequence_parallel")
    x = randn((2, 5, E))
    h, res = blk(x, mixer_subset=slice(0, 1))
    assert h.shape == (2, 1, E)
    torch.testing.assert_close(res, x[:, :1])
    full_h, _ = blk(x)
    torch.testing.assert_close(h, full_h[:, :1])  # cross-attention over all of x, queries for position 0
    # default mixer / mlp: MHA with dim // 64 heads, Mlp with 4 * dim hidden units
    d = Block(128)
    assert d.mixer.num_heads == 2 and d.mlp.fc1.weight.shape == (512, 128)
    assert d.allocate_inference_cache(3, 7).shape == (3, 7, 2, 2, 64)


def test_block_bad_arguments():
    with pytest.raises(ValueError, match="residual_in_fp32=True is only compatible with prenorm=True"):
        Block(E, _mixer, _mlp, prenorm=False, residual_in_fp32=True)
    with pytest.raises(ValueError, match="needs norm_cls to make nn.LayerNorm or RMSNorm, got BatchNorm1d"):
        Block(E, _mixer, _mlp, norm_cls=nn.BatchNorm1d, fused_dropout_add_ln=True)
    with pytest.raises(ValueError, match="needs dropout_cls to make nn.Dropout, got Identity"):
        Block(E, _mixer, _mlp, dropout_cls=lambda p: nn.Identity(), fused_dropout_add_ln=True)


# ----------------------------------------------------------------------------- ParallelBlock


@pytest.mark.parametrize("fused,tied,dtype", [(False, False, F32), (True, False, BF16), (True, True, F32),
                                              (False, True, BF16)])
def test_parallel_block(fused, tied, dtype):
    blk = ParallelBlock(E, _mixer, _mlp, tied_norm=tied, fused_dropout_add_ln=fused).to(dtype)
    assert hasattr(blk, "norm2") != tied
    x1, x2 = randn((2, 5, E), dtype, requires_grad=True), randn((2, 5, E), dtype)
    residual = randn((2, 5, E), dtype)

    def ref(p, t, dt):
        mixer, mlp = _sub(blk, dt, p, "mixer"), _sub(blk, dt, p, "mlp")
        res = t + x2.to(dt) + residual.to(dt)
        n2 = "norm1" if tied else "norm2"
        return (mixer(F.layer_norm(res, (E,), p["norm1.weight"], p["norm1.bias"], blk.norm1.eps)),
                mlp(F.layer_norm(res, (E,), p[f"{n2}.weight"], p[f"{n2}.bias"], blk.norm1.eps)), res)

    _compare(blk, x1, ref, dtype, f"ParallelBlock[fused={fused}, tied={tied}]", extra_inputs=(x2, residual))
    # First block: no second input, no residual; the residual is the input itself.
    h1, h2, r = blk(x1.detach())
    torch.testing.assert_close(r, x1.detach())
    if tied:
        torch.testing.assert_close(h2, blk.mlp(F.layer_norm(x1.detach(), (E,), blk.norm1.weight, blk.norm1.bias,
                                                            blk.norm1.eps)))


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True])
def test_block_prenorm_fused_gpu_bf16(rms):
    norm_cls = partial(RMSNorm, eps=1e-5) if rms else nn.LayerNorm
    blk = Block(E, partial(MHA, num_heads=2, causal=True, use_flash_attn=True), partial(GatedMlp, activation=F.silu,
                                                                                       multiple_of=8),
                norm_cls=norm_cls, fused_dropout_add_ln=True).to("cuda", BF16)
    x = randn((2, 37, E), BF16, device="cuda", requires_grad=True)
    residual = randn((2, 37, E), BF16, device="cuda")

    def ref(p, t, dt):
        mixer, mlp = _sub(blk, dt, p, "mixer"), _sub(blk, dt, p, "mlp")
        mixer.inner_attn = SelfAttention(causal=True)  # the float64 oracle runs plain PyTorch attention
        res = t + residual.to(dt)
        h = mixer(_norm(res, p["norm1.weight"], p.get("norm1.bias"), blk.norm1.eps, rms))
        res = h + res
        return mlp(_norm(res, p["norm2.weight"], p.get("norm2.bias"), blk.norm2.eps, rms)), res

    _compare(blk, x, ref, BF16, f"Block gpu[rms={rms}]", extra_inputs=(residual,))
