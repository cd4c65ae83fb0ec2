"""Host-path guard of the rotary family: a cached call makes a fixed, small number of calls (DESIGN.md).

The kernels are faked (``culmen.testing.hostcost.fake_kernels``), so this runs on CPU exactly the code a
GPU call runs after its first call. On the GPU test machine a torch call (allocation, view, method)
costs 3-11 us and a Python call 0.2 us: the C-call budget is what keeps a call near PyTorch's cost
(PyTorch's own rotate-half rotary costs 6 torch ops forward and as many autograd nodes).
"""

import pytest
import torch

from culmen.testing.hostcost import assert_host_budget, fake_kernels

BF16 = torch.bfloat16
B, S, H, D = 1, 128, 8, 64
EMPTY_LIKE = "_VariableFunctionsClass.empty_like"
EMPTY = "_VariableFunctionsClass.empty"


@pytest.fixture
def fake():
    with fake_kernels() as launched:
        yield launched


def _tables(rows=S, width=D // 2):
    return torch.randn(rows, width, dtype=BF16), torch.randn(rows, width, dtype=BF16)


def test_apply_rotary_emb_no_grad(fake):
    from culmen.flash_attn.layers.rotary import apply_rotary_emb

    x = torch.randn(B, S, H, D, dtype=BF16, requires_grad=True)
    cos, sin = _tables(S + 3)

    def call():
        with torch.no_grad():
            apply_rotary_emb(x, cos, sin, seqlen_offsets=3)

    n = assert_host_budget(call, python=8, c=10)
    assert n.c_names[EMPTY_LIKE] == 1 and n.c_names[EMPTY] == 0  # the output only: no table copies or casts
    assert fake, "the fake kernels were not launched"


def test_apply_rotary_emb_forward_backward(fake):
    from culmen.flash_attn.layers.rotary import apply_rotary_emb

    x = torch.randn(B, S, H, D, dtype=BF16, requires_grad=True)
    g = torch.randn(B, S, H, D, dtype=BF16)
    cos, sin = _tables()

    def call():
        x.grad = None
        apply_rotary_emb(x, cos, sin).backward(g)

    before = len(fake)
    n = assert_host_budget(call, python=13, c=16)
    assert n.c_names[EMPTY_LIKE] == 2  # y and dx: nothing else is allocated, copied or cast
    assert (len(fake) - before) % 2 == 0  # one launch forward, one backward


def test_qkv_inplace_is_one_launch(fake):
    """Q and K of a packed qkv (XPos: K has its own tables) rotate in one launch and one autograd node."""
    from culmen.flash_attn.layers.rotary import apply_rotary_emb_qkv_

    w = torch.randn(B, S, 3, H, D, dtype=BF16, requires_grad=True)
    g = torch.randn(B, S, 3, H, D, dtype=BF16)
    cos, sin = _tables()
    cos_k, sin_k = _tables()

    def call():
        w.grad = None
        qkv = w * 1.0
        apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k)
        qkv.backward(g)

    for _ in range(2):
        call()
    before = len(fake)
    call()
    assert len(fake) - before == 2  # forward + backward
    n = assert_host_budget(call, python=12, c=24)  # (10 of the C calls: data_ptr of 5 pointers, 2 launches)
    assert n.c_names[EMPTY_LIKE] == 1  # dq/dk only (the forward is in place)


def test_rotary_embedding_module_no_grad(fake):
    from culmen.flash_attn.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(D)
    qkv = torch.randn(B, S, 3, H, D, dtype=BF16)
    n = assert_host_budget(lambda: rope(qkv), python=9, c=13)
    assert n.c_names[EMPTY_LIKE] == 0 and n.c_names[EMPTY] == 0  # in place: no allocation at all


def test_apex_fused_rope_forward_backward(fake):
    """Apex's sbhd RoPE with angle tables: cos/sin of an unchanged ``freqs`` are not recomputed, the sbhd
    layout and Apex's [s, 1, 1, d2] tables are read as they are."""
    from culmen.transformer.functional import fused_apply_rotary_pos_emb

    t = torch.randn(S, B, H, D, dtype=BF16, requires_grad=True)
    g = torch.randn(S, B, H, D, dtype=BF16)
    freqs = torch.rand(S, 1, 1, D)

    def call():
        t.grad = None
        fused_apply_rotary_pos_emb(t, freqs).backward(g)

    n = assert_host_budget(call, python=14, c=15)
    assert n.c_names[EMPTY_LIKE] == 2 and n.c_names[EMPTY] == 0


def test_apex_fused_rope_transposed_output(fake):
    from culmen.transformer.functional import fused_apply_rotary_pos_emb

    t = torch.randn(S, B, H, D, dtype=BF16)
    freqs = torch.rand(S, 1, 1, D)
    n = assert_host_budget(lambda: fused_apply_rotary_pos_emb(t, freqs, True), python=8, c=8)
    assert n.c_names["_VariableFunctionsClass.empty_strided"] == 1  # one allocation in bshd memory order
