"""``culmen.contrib.transducer.TransducerJoint`` (Apex's ``apex.contrib.transducer``): the joint against a
float64 broadcast-add oracle, dense and packed, ReLU and dropout (masks probed and replayed in the
backward), both backends (reference, Triton kernels under the interpreter), gradients of ``f`` and ``g``,
bad arguments, and the Apex import path through the alias."""

from __future__ import annotations

import textwrap

import pytest
import torch
from fresh_python import run_python

from culmen.contrib.transducer import TransducerJoint
from culmen.ops.backend import use_backend
from culmen.testing import assert_close_tolerance, poisoned_allocations, randn

BACKENDS = ["reference", "triton"]


def _inputs(dtype=torch.float32, B=3, T=5, U=4, H=37, device="cpu"):
    f = randn((B, T, H), dtype, device, requires_grad=True)
    g = randn((B, U, H), dtype, device, requires_grad=True)
    f_len = torch.tensor([T, 2, 4][:B], dtype=torch.int32, device=device)
    g_len = torch.tensor([3, U, 1][:B], dtype=torch.int32, device=device)
    return f, g, f_len, g_len


def _pack(h: torch.Tensor, f_len, g_len) -> torch.Tensor:
    return torch.cat([h[b, :int(f_len[b]), :int(g_len[b])].reshape(-1, h.shape[-1]) for b in range(h.shape[0])])


def _unpack_mask(m: torch.Tensor, f_len, g_len, T, U) -> torch.Tensor:
    out = torch.zeros((len(f_len), T, U, m.shape[-1]), dtype=m.dtype)
    row = 0
    for b in range(len(f_len)):
        n = int(f_len[b]) * int(g_len[b])
        out[b, :int(f_len[b]), :int(g_len[b])] = m[row:row + n].view(int(f_len[b]), int(g_len[b]), -1)
        row += n
    return out


def _oracle(f, g, f_len, g_len, pack, relu, keep, scale, dh, dtype):
    """The joint computed in ``dtype`` by plain broadcasting (autograd gives df, dg)."""
    fr = f.detach().to(dtype).requires_grad_(True)
    gr = g.detach().to(dtype).requires_grad_(True)
    h = fr.unsqueeze(2) + gr.unsqueeze(1)
    if relu:
        h = torch.relu(h)
    if keep is not None:
        h = h * keep.to(dtype) * scale
    T, U = f.shape[1], g.shape[1]
    valid = (torch.arange(T).view(1, T, 1) < f_len.view(-1, 1, 1)) & \
        (torch.arange(U).view(1, 1, U) < g_len.view(-1, 1, 1))
    if pack:
        out = _pack(h, f_len, g_len)
    else:
        out = torch.where(valid.unsqueeze(-1), h, torch.full_like(h, -1.0))
    df, dg = torch.autograd.grad(out, (fr, gr), dh.to(dtype))
    return out, df, dg


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pack,relu,dtype", [(False, False, torch.float32), (True, False, torch.float16),
                                             (False, True, torch.bfloat16), (True, True, torch.float32)])
def test_joint_matches_oracle(backend, pack, relu, dtype):
    f, g, f_len, g_len = _inputs(dtype)
    boff = torch.cumsum(f_len * g_len, 0)
    joint = TransducerJoint(pack_output=pack, relu=relu)
    with use_backend(backend), poisoned_allocations():
        h = joint(f, g, f_len, g_len, boff, int(boff[-1])) if pack else joint(f, g, f_len, g_len)
    dh = randn(h.shape, dtype)
    df, dg = torch.autograd.grad(h, (f, g), dh)
    hi = _oracle(f, g, f_len, g_len, pack, relu, None, 1.0, dh, torch.float64)
    lo = _oracle(f, g, f_len, g_len, pack, relu, None, 1.0, dh, dtype)
    assert h.dtype == dtype and df.dtype == dtype and dg.dtype == dtype
    assert h.shape == ((int(boff[-1]), 37) if pack else (3, 5, 4, 37))
    for name, a, r_hi, r_lo in zip(("h", "df", "dg"), (h, df, dg), hi, lo):
        assert_close_tolerance(a, r_hi, r_lo, name=name)
    # the gradient rows outside the lengths are exactly zero
    assert df[1, 2:].abs().max() == 0 and dg[2, 1:].abs().max() == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pack", [False, True])
def test_dropout_mask_probe_and_replay(backend, pack):
    torch.manual_seed(3)
    f, g, f_len, g_len = _inputs(torch.float32, H=64)
    boff = torch.cumsum(f_len * g_len, 0)
    p = 0.4
    joint = TransducerJoint(pack_output=pack, relu=True, dropout=True, dropout_prob=p, probe_mask=True)
    args = (f, g, f_len, g_len, boff, int(boff[-1])) if pack else (f, g, f_len, g_len)
    with use_backend(backend):
        h = joint(*args)
        h2 = joint(*args)
    assert len(joint.mask_probe) == 2 and joint.mask_probe[0].dtype == torch.uint8
    assert joint.mask_probe[0].shape == h.shape
    assert not torch.equal(h, h2)  # a fresh mask per call
    m = joint.mask_probe[0]
    dense = _unpack_mask(m, f_len, g_len, 5, 4) if pack else m
    pre = f.detach().unsqueeze(2) + g.detach().unsqueeze(1)
    valid = torch.zeros_like(dense, dtype=torch.bool)
    for b in range(3):
        valid[b, :int(f_len[b]), :int(g_len[b])] = True
    # the mask keeps only positive sums, and drops about p of them
    assert not bool((dense.bool() & (pre <= 0)).any())
    pos = (pre > 0) & valid
    kept = dense.bool()[pos].float().mean().item()
    assert abs(kept - (1 - p)) < 0.08, kept
    dh = randn(h.shape)
    df, dg = torch.autograd.grad(h, (f, g), dh)
    hi = _oracle(f, g, f_len, g_len, pack, True, dense, 1 / (1 - p), dh, torch.float64)
    for name, a, r in zip(("h", "df", "dg"), (h, df, dg), hi):
        assert_close_tolerance(a, r, None, name=name)


def test_dropout_kernel_and_reference_draw_the_same_mask():
    f, g, f_len, g_len = _inputs(torch.float32, H=20)
    outs = {}
    for backend in BACKENDS:
        joint = TransducerJoint(dropout=True, dropout_prob=0.5, probe_mask=True)
        torch.manual_seed(11)
        with use_backend(backend):
            outs[backend] = (joint(f, g, f_len, g_len), joint.mask_probe[0])
    assert torch.equal(outs["reference"][1], outs["triton"][1])
    torch.testing.assert_close(outs["reference"][0], outs["triton"][0], rtol=0, atol=0)


def test_eval_mode_has_no_dropout_and_packed_tail_rows_are_zero(triton_backend):
    f, g, f_len, g_len = _inputs(torch.float32)
    boff = torch.cumsum(f_len * g_len, 0)
    joint = TransducerJoint(pack_output=True, dropout=True, dropout_prob=0.9, probe_mask=True).eval()
    with poisoned_allocations():
        h = joint(f, g, f_len, g_len, boff, int(boff[-1]) + 3)
    assert joint.mask_probe == []  # not masked in eval mode: nothing probed
    n = int(boff[-1])
    assert h[n:].abs().max() == 0
    ref = _pack(f.detach().unsqueeze(2) + g.detach().unsqueeze(1), f_len, g_len)
    torch.testing.assert_close(h[:n], ref)


def test_bad_arguments():
    f, g, f_len, g_len = _inputs(torch.float32)
    joint = TransducerJoint()
    with pytest.raises(ValueError, match="f_len"):
        joint(f, g, torch.tensor([6, 2, 4]), g_len)
    with pytest.raises(ValueError, match="g_len"):
        joint(f, g, f_len, torch.tensor([1, 5, 1]))
    with pytest.raises(ValueError, match="f_len must have shape"):
        joint(f, g, f_len[:2], g_len)
    with pytest.raises(TypeError, match="g must have f's dtype"):
        joint(f, g.double(), f_len, g_len)
    with pytest.raises(ValueError, match="g must have shape"):
        joint(f, g[..., :5], f_len, g_len)
    with pytest.raises(TypeError, match="f_len must be an integer tensor"):
        joint(f, g, f_len.float(), g_len)
    packed = TransducerJoint(pack_output=True)
    with pytest.raises(ValueError, match="batch_offset and packed_batch"):
        packed(f, g, f_len, g_len)
    boff = torch.cumsum(f_len * g_len, 0)
    with pytest.raises(ValueError, match="batch_offset must be cumsum"):
        packed(f, g, f_len, g_len, boff + 1, 40)
    with pytest.raises(ValueError, match="packed_batch=5 is smaller"):
        packed(f, g, f_len, g_len, boff, 5)
    with pytest.raises(NotImplementedError, match="opt=1"):
        TransducerJoint(relu=True, opt=0)
    with pytest.raises(ValueError, match="fwd_tile_size"):
        TransducerJoint(fwd_tile_size=3)
    with pytest.raises(ValueError, match="dropout_prob"):
        TransducerJoint(dropout=True, dropout_prob=1.5)


def test_apex_import_path_through_the_alias():
    code = textwrap.dedent("""
        import culmen.compat as compat
        compat.install()
        from apex.contrib.transducer import TransducerJoint, TransducerLoss
        import apex.contrib.transducer.transducer as t
        import culmen.contrib.transducer as ct
        assert TransducerJoint is ct.TransducerJoint and TransducerLoss is ct.TransducerLoss
        assert t.TransducerJointFunc and t.TransducerLossFunc
        from apex.contrib.transducer import _transducer_ref
        from apex.contrib.transducer._transducer_ref import transducer_joint_reference, transducer_loss_reference
        assert _transducer_ref.transducer_joint_reference is transducer_joint_reference
        print("OK")
    """)
    assert run_python(code) == "OK"


def test_apex_function_stand_in_and_non_contiguous_inputs(triton_backend):
    from culmen.contrib.transducer.transducer import TransducerJointFunc

    f, g, f_len, g_len = _inputs(torch.float32)
    wide = randn((3, 4, 74))
    wide[..., ::2] = g.detach()
    probe: list = []
    h = TransducerJointFunc.apply(f, wide[..., ::2], f_len, g_len, False, True, False, None, 0, 1, 4, 0.0, probe)
    assert len(probe) == 1 and probe[0].shape == h.shape
    ref = _oracle(f, g, f_len, g_len, False, True, None, 1.0, torch.ones(h.shape), torch.float64)[0]
    assert_close_tolerance(h, ref, None, name="h")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pack,relu", [(False, False), (True, True)])
def test_joint_gpu(dtype, pack, relu):
    dev = "cuda"
    B, T, U, H = 4, 101, 25, 509
    f = randn((B, T, H), dtype, dev, requires_grad=True)
    g = randn((B, U, H), dtype, dev, requires_grad=True)
    f_len = torch.tensor([T, 51, 77, 60], dtype=torch.int32, device=dev)
    g_len = torch.tensor([12, U, 19, 13], dtype=torch.int32, device=dev)
    boff = torch.cumsum(f_len * g_len, 0)
    joint = TransducerJoint(pack_output=pack, relu=relu)
    h = joint(f, g, f_len, g_len, boff, int(boff[-1])) if pack else joint(f, g, f_len, g_len)
    dh = randn(h.shape, dtype, dev)
    df, dg = torch.autograd.grad(h, (f, g), dh)
    cpu = [t.cpu() for t in (f, g, f_len, g_len, dh)]
    hi = _oracle(*cpu[:4], pack, relu, None, 1.0, cpu[4], torch.float64)
    lo = _oracle(*cpu[:4], pack, relu, None, 1.0, cpu[4], torch.float32)
    for name, a, r_hi, r_lo in zip(("h", "df", "dg"), (h, df, dg), hi, lo):
        assert_close_tolerance(a.cpu(), r_hi, r_lo.to(dtype), name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("pack", [False, True])
def test_joint_dropout_gpu(pack):
    dev = "cuda"
    f, g, f_len, g_len = _inputs(torch.float16, B=3, T=33, U=9, H=130, device=dev)
    f_len = torch.tensor([33, 20, 7], dtype=torch.int32, device=dev)
    g_len = torch.tensor([9, 4, 1], dtype=torch.int32, device=dev)
    boff = torch.cumsum(f_len * g_len, 0)
    p = 0.25
    joint = TransducerJoint(pack_output=pack, relu=True, dropout=True, dropout_prob=p, probe_mask=True)
    h = joint(f, g, f_len, g_len, boff, int(boff[-1])) if pack else joint(f, g, f_len, g_len)
    dh = randn(h.shape, torch.float16, dev)
    df, dg = torch.autograd.grad(h, (f, g), dh)
    cpu = [t.cpu() for t in (f, g, f_len, g_len)]
    m = joint.mask_probe[0].cpu()
    dense = _unpack_mask(m, cpu[2], cpu[3], 33, 9) if pack else m
    hi = _oracle(*cpu, pack, True, dense, 1 / (1 - p), dh.cpu(), torch.float64)
    for name, a, r in zip(("h", "df", "dg"), (h, df, dg), hi):
        assert_close_tolerance(a.cpu(), r, None, name=name)
    # the same mask drawn by the reference (Philox replayed on the host) from the same generator state
    from culmen.ops.backend import use_backend as ub

    torch.manual_seed(5)
    joint2 = TransducerJoint(dropout=True, dropout_prob=p, probe_mask=True)
    joint2(f, g, f_len, g_len)
    torch.manual_seed(5)
    with ub("reference"):
        joint2(f.double(), g.double(), f_len, g_len)
    assert torch.equal(joint2.mask_probe[0], joint2.mask_probe[1])


@pytest.mark.parametrize("pack,relu,dropout", [(False, False, False), (True, True, True)])
def test_apex_joint_reference(pack, relu, dropout):
    """``_transducer_ref.transducer_joint_reference`` (Apex's test oracle): ``h`` as the element-wise formula,
    ``-1`` or packed outside the lengths, gradients over the whole grid (as Apex's: ``h_grad`` is not masked)."""
    from culmen.contrib.transducer._transducer_ref import transducer_joint_reference

    f, g, f_len, g_len = _inputs(torch.float64)
    B, T, H = f.shape
    U = g.shape[1]
    dh = torch.randn(B, T, U, H, dtype=torch.float64)
    mask = (torch.rand(B, T, U, H) > 0.4).to(torch.uint8) if dropout else None
    h, df, dg = transducer_joint_reference(f, g, dh, f_len, g_len, pack, relu, dropout, 0.4, mask)
    assert f.grad is None and g.grad is None
    # Element-wise, with the chain rule written out (no autograd): keep = relu gate * dropout mask / (1 - p).
    s = f.detach()[:, :, None] + g.detach()[:, None]
    keep = torch.ones_like(s)
    if relu:
        keep = keep * (s > 0)
    if dropout:
        keep = keep * mask / 0.6
    full = s * keep
    want = _pack(full, f_len, g_len) if pack else full.clone()
    if not pack:
        for b in range(B):
            want[b, int(f_len[b]):] = -1
            want[b, :, int(g_len[b]):] = -1
    torch.testing.assert_close(h, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(df, (dh * keep).sum(2), rtol=0, atol=1e-12)
    torch.testing.assert_close(dg, (dh * keep).sum(1), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="mask"):
        transducer_joint_reference(f, g, dh, f_len, g_len, pack, relu, True, 0.4, None)
