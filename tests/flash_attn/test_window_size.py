"""``window_size`` as flash_attn takes it: any two-element sequence of integers (tuple, list, 1-D integer
tensor or numpy array, a sequence of numpy integers or 0-d integer tensors), in every function and module
that takes it; other lengths, floats, bools and non-sequences raise ``ValueError`` naming ``window_size``
and the value. A plain tuple of ints costs no normalization call on the cached path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import culmen.flash_attn as fa
from culmen.flash_attn import flash_attn_interface as fi
from culmen.flash_attn.modules.mha import FlashCrossAttention, FlashSelfAttention
from culmen.ops.attention import op as attn_op
from culmen.testing.hostcost import count_calls

F64 = torch.float64
WINDOW = (3, 1)

FORMS = {
    "tuple": lambda w: tuple(w),
    "list": lambda w: list(w),
    "tensor_int64": lambda w: torch.tensor(w),
    "tensor_int32": lambda w: torch.tensor(w, dtype=torch.int32),
    "numpy_int64": lambda w: np.array(w),
    "numpy_int32": lambda w: np.array(w, dtype=np.int32),
    "tuple_of_numpy_ints": lambda w: (np.int64(w[0]), np.int32(w[1])),
    "list_of_0d_tensors": lambda w: [torch.tensor(w[0]), torch.tensor(w[1])],
}

BAD = {
    "one": (1,),
    "three": (1, 2, 3),
    "empty": (),
    "float": (1.0, 2),
    "float_tensor": torch.tensor([1.0, 2.0]),
    "float_numpy": np.array([1.5, 2.0]),
    "tensor_2d": torch.tensor([[1, 2]]),
    "tensor_0d": torch.tensor(3),
    "string": "ab",
    "int": 3,
    "none": None,
    "bool": (True, 1),
    "bool_tensor": torch.tensor([True, False]),
}


def _window_ref(q, k, v, left, right):
    """Sliding-window attention in float64 (bottom-right aligned, as flash_attn): query i sees keys
    ``[i + sk - sq - left, i + sk - sq + right]``; K/V heads repeated for GQA."""
    sq, sk, g = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * q.shape[-1] ** -0.5
    rel = torch.arange(sk)[None, :] - (torch.arange(sq)[:, None] + sk - sq)  # key - diagonal
    mask = torch.zeros(sq, sk, dtype=torch.bool)
    if left >= 0:
        mask |= rel < -left
    if right >= 0:
        mask |= rel > right
    p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _dense(B=2, sq=7, sk=9, h=4, hk=2, d=8, grad=False):
    return tuple(torch.randn(B, s, n, d, dtype=F64, requires_grad=grad) for s, n in ((sq, h), (sk, hk), (sk, hk)))


def _calls():
    """One call of every function and module that takes ``window_size``, as ``name -> fn(window)``."""
    q, k, v = _dense()
    qkv = torch.randn(2, 7, 3, 4, 8, dtype=F64)
    kv = torch.stack((k, v), dim=2)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)
    pq, pk, pv = torch.randn(7, 4, 8, dtype=F64), torch.randn(9, 2, 8, dtype=F64), torch.randn(9, 2, 8, dtype=F64)
    pqkv = torch.randn(7, 3, 4, 8, dtype=F64)
    kc, vc = torch.randn(2, 12, 2, 8, dtype=F64), torch.randn(2, 12, 2, 8, dtype=F64)
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    return {
        "flash_attn_func": lambda w: fa.flash_attn_func(q, k, v, window_size=w),
        "flash_attn_kvpacked_func": lambda w: fa.flash_attn_kvpacked_func(q, kv, window_size=w),
        "flash_attn_qkvpacked_func": lambda w: fa.flash_attn_qkvpacked_func(qkv, window_size=w),
        "flash_attn_varlen_func": lambda w: fa.flash_attn_varlen_func(pq, pk, pv, cu_q, cu_k, 4, 5, window_size=w),
        "flash_attn_varlen_kvpacked_func": lambda w: fa.flash_attn_varlen_kvpacked_func(
            pq, torch.stack((pk, pv), 1), cu_q, cu_k, 4, 5, window_size=w),
        "flash_attn_varlen_qkvpacked_func": lambda w: fa.flash_attn_varlen_qkvpacked_func(
            pqkv, cu_q, 4, window_size=w),
        "flash_attn_with_kvcache": lambda w: fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                                        window_size=w),
        "FlashSelfAttention": lambda w: FlashSelfAttention(window_size=w)(qkv),
        "FlashCrossAttention": lambda w: FlashCrossAttention(window_size=w)(q, kv),
        "FlashAttnFunc.apply": lambda w: fi.FlashAttnFunc.apply(q, k, v, 0.0, None, False, w, 0.0, None, False,
                                                                 False, False),
        "FlashAttnVarlenFunc.apply": lambda w: fi.FlashAttnVarlenFunc.apply(
            pq, pk, pv, cu_q, cu_k, 4, 5, 0.0, None, False, w, 0.0, None, False, False, None, False),
    }


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("name", sorted(_calls()))
def test_every_form_equals_the_tuple(name, form):
    call = _calls()[name]
    want = call(WINDOW)
    got = call(FORMS[form](WINDOW))
    assert torch.equal(got, want), (name, form)


def test_window_matches_float64_reference_for_each_form():
    q, k, v = _dense()
    for left, right in ((3, 1), (-1, 0), (0, -1), (2, 2)):
        ref = _window_ref(q, k, v, left, right)
        for form, make in FORMS.items():
            out = fa.flash_attn_func(q, k, v, window_size=make((left, right)))
            torch.testing.assert_close(out, ref, msg=f"{form} {(left, right)}")


def test_gradients_with_a_tensor_window():
    q, k, v = _dense(grad=True)
    out = fa.flash_attn_func(q, k, v, window_size=torch.tensor([2, 0]))
    ref = _window_ref(q, k, v, 2, 0)
    dout = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("name", sorted(_calls()))
def test_bad_window_raises_value_error_naming_it(name, bad):
    value = BAD[bad]
    with pytest.raises(ValueError, match="window_size") as err:
        _calls()[name](value)
    assert repr(value) in str(err.value)


def test_non_tuple_forms_share_the_cached_plan():
    """A list / tensor window becomes the same hashable tuple: the second call builds no new plan."""
    q, k, v = _dense()
    attn_op.PLANS.clear()
    fa.flash_attn_func(q, k, v, window_size=(2, 1))
    n = len(attn_op.PLANS)
    for w in ([2, 1], torch.tensor([2, 1]), np.array([2, 1])):
        fa.flash_attn_func(q, k, v, window_size=w)
    assert len(attn_op.PLANS) == n == 1


def test_plain_tuple_makes_no_normalization_call():
    """A tuple of two ints passes as it is (no call); every other form costs one ``_window_pair``."""
    q, k, v = _dense()
    fa.flash_attn_func(q, k, v, window_size=(2, 1))
    tup = count_calls(lambda: fa.flash_attn_func(q, k, v, window_size=(2, 1)))
    assert "_window_pair" not in tup.py_names
    for w in ([2, 1], torch.tensor([2, 1]), (np.int64(2), 1)):
        other = count_calls(lambda: fa.flash_attn_func(q, k, v, window_size=w))  # noqa: B023
        assert other.py_names["_window_pair"] == 1 and other.python == tup.python + 1, w


def test_module_stores_a_tuple_of_ints():
    m = FlashSelfAttention(window_size=torch.tensor([4, 0]))
    assert m.window_size == (4, 0) and all(type(w) is int for w in m.window_size)
    c = FlashCrossAttention(window_size=np.array([-1, 3]))
    assert c.window_size == (-1, 3) and all(type(w) is int for w in c.window_size)
    with pytest.raises(ValueError, match="window_size"):
        FlashSelfAttention(window_size=(1, 2, 3))


def test_negative_entries_below_minus_one_still_rejected():
    q, k, v = _dense()
    with pytest.raises(ValueError, match="window_size"):
        fa.flash_attn_func(q, k, v, window_size=torch.tensor([-2, 0]))


@pytest.mark.gpu
def test_cuda_tensor_window_on_gpu():
    """A window held in a CUDA tensor (one host read) gives the tuple's result on the GPU kernels."""
    dev = torch.device("cuda")
    q, k, v = (t.to(dev, torch.bfloat16) for t in _dense(sq=130, sk=257))
    want = fa.flash_attn_func(q, k, v, window_size=(17, 3))
    got = fa.flash_attn_func(q, k, v, window_size=torch.tensor([17, 3], device=dev))
    assert torch.equal(got, want)


def test_list_window_under_torch_compile_fullgraph():
    """The normalization traces: a list window under ``torch.compile(fullgraph=True)`` gives eager's result."""
    q, k, v = _dense()
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: fa.flash_attn_func(q, k, v, window_size=[3, 1]), fullgraph=True,
                      backend="aot_eager")
    torch.testing.assert_close(f(q, k, v), fa.flash_attn_func(q, k, v, window_size=(3, 1)))
