"""Host-path guard of the attention family: a cached call makes a fixed, small number of calls (DESIGN.md).

The kernels are faked (``culmen.testing.hostcost.fake_kernels``), so this runs on CPU exactly the code a
GPU call runs after its first call. On the GPU test machine a torch call (allocation, view, method)
costs 2-11 us and a Python call 0.2 us: the C-call budget is what keeps a call near SDPA's cost (30 us
forward, 199 us forward + backward at 1x128x8x64 bf16).

Before the plans (count_calls, same shapes; interpreted kernel frames left out): the no-grad forward
made ~53 Python and 43 C calls (three allocations: out, lse and a placeholder), the forward + backward
~95 and 96 (plus FastLauncher's per-launch specialization key on GPUs).
"""

import pytest
import torch

from culmen.testing.hostcost import assert_host_budget, fake_kernels

BF16 = torch.bfloat16
SHAPE = (1, 128, 8, 64)


@pytest.fixture
def fake():
    with fake_kernels() as launched:
        yield launched


def _leaves(*shapes):
    return [torch.randn(s, dtype=BF16, requires_grad=True) for s in shapes]


def _allocs(n) -> int:
    return n.c_names["_VariableFunctionsClass.empty"] + n.c_names["_VariableFunctionsClass.empty_like"]


def _no_torch_reshuffles(n) -> None:
    for name in ("Tensor.contiguous", "Tensor.to", "Tensor.reshape", "Tensor.view", "Tensor.zero_", "Tensor.fill_",
                 "_VariableFunctionsClass.zeros", "_VariableFunctionsClass.randint"):
        assert n.c_names[name] == 0, f"{name} on the cached path: {n}"


def test_flash_attn_func_forward_no_grad(fake):
    from culmen.flash_attn import flash_attn_func

    q, k, v = _leaves(SHAPE, SHAPE, SHAPE)

    def call():
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=True)

    n = assert_host_budget(call, python=6, c=10)
    assert _allocs(n) == 1  # only out: no lse without autograd (or return_attn_probs)
    _no_torch_reshuffles(n)
    assert fake, "the fake kernels were not launched"


def test_flash_attn_func_forward_backward(fake):
    from culmen.flash_attn import flash_attn_func

    q, k, v = _leaves(SHAPE, SHAPE, SHAPE)
    g = torch.randn(SHAPE, dtype=BF16)

    def call():
        for t in (q, k, v):
            t.grad = None
        flash_attn_func(q, k, v, causal=True).backward(g)

    n = assert_host_budget(call, python=14, c=23)
    # out + lse; dq, dk, dv + delta: no placeholders, no copies, no fills in PyTorch.
    assert _allocs(n) == 6
    _no_torch_reshuffles(n)
    assert len(fake) >= 4  # fwd, preprocess, dK/dV, dQ


def test_dropout_costs_one_rng_draw(fake):
    from culmen.flash_attn import flash_attn_func

    q, k, v = _leaves(SHAPE, SHAPE, SHAPE)

    def call():
        with torch.no_grad():
            flash_attn_func(q, k, v, dropout_p=0.1, causal=True)

    n = assert_host_budget(call, python=7, c=11)
    assert n.c_names["_VariableFunctionsClass.randint"] == 1 and _allocs(n) == 1


def test_qkvpacked_and_return_lse(fake):
    from culmen.flash_attn import flash_attn_qkvpacked_func

    (qkv,) = _leaves((1, 128, 3, 8, 64))

    def call():
        with torch.no_grad():
            flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=False)

    n = assert_host_budget(call, python=7, c=13)
    assert n.c_names["Tensor.unbind"] == 1 and _allocs(n) == 1


def test_varlen_forward_backward(fake):
    from culmen.flash_attn import flash_attn_varlen_func

    q, k, v = _leaves((128, 8, 64), (128, 8, 64), (128, 8, 64))
    cu = torch.tensor([0, 50, 128], dtype=torch.int32)
    g = torch.randn(128, 8, 64, dtype=BF16)

    def call():
        for t in (q, k, v):
            t.grad = None
        flash_attn_varlen_func(q, k, v, cu, cu, 78, 78, causal=True).backward(g)

    # cu_seqlens are value-checked on CPU (tolist, min, max x2): on GPUs only under set_check_values.
    n = assert_host_budget(call, python=21, c=35)
    assert _allocs(n) == 6
    _no_torch_reshuffles(n)


def test_kvcache_decode(fake):
    from culmen.flash_attn import flash_attn_with_kvcache

    kc, vc = torch.randn(2, 256, 8, 64, dtype=BF16), torch.randn(2, 256, 8, 64, dtype=BF16)
    q, kn = torch.randn(2, 1, 8, 64, dtype=BF16), torch.randn(2, 1, 8, 64, dtype=BF16)
    seqlens = torch.tensor([10, 20], dtype=torch.int32)

    def call():
        flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=seqlens, causal=True)

    # The append (two index_put writes, positions from arange) stays in PyTorch; the key range is computed
    # by the kernel (no cache_seqlens + seqlen_new on the host).
    n = assert_host_budget(call, python=23, c=20)
    assert _allocs(n) == 1


@pytest.mark.parametrize("splits,python,c,allocs", [(1, 24, 19, 1), (4, 26, 21, 2)])
def test_kvcache_decode_pack_gqa(fake, splits, python, c, allocs):
    """One-token GQA decoding (4 query heads per KV head, pack-GQA): q is read through its own strides (no
    packed view made) and the output written straight into the (B, 1, h, d) result the plan allocates (no
    view or copy back); split-KV adds one fp32 workspace (partial outputs, their lse and the merge's lse) and
    one planned merge launch (no flash_attn_combine checks per call)."""
    from culmen.flash_attn import flash_attn_with_kvcache

    kc, vc = torch.randn(1, 512, 2, 64, dtype=BF16), torch.randn(1, 512, 2, 64, dtype=BF16)
    q, kn = torch.randn(1, 1, 8, 64, dtype=BF16), torch.randn(1, 1, 2, 64, dtype=BF16)
    seqlens = torch.tensor([300], dtype=torch.int32)

    def call():
        flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=seqlens, causal=True, num_splits=splits)

    n = assert_host_budget(call, python=python, c=c)
    assert _allocs(n) + n.c_names["_VariableFunctionsClass.empty_strided"] == allocs
    for name in ("Tensor.reshape", "Tensor.contiguous", "Tensor.as_strided", "Tensor.transpose", "Tensor.view"):
        assert n.c_names[name] == 0, f"{name} on the cached path: {n}"


@pytest.mark.parametrize("fused,python", [(True, 23), (False, 24)], ids=["fused_merge", "two_launch"])
def test_kvcache_split_merge_launches(fake, fused, python):
    """Split-KV decoding (no new tokens, 4 splits): with TUNING["fused_merge"] the split kernel merges its own
    partials, one launch a call; its counters are zeroed once per plan and stream, not per call (no torch.zeros on
    the cached path). The two-launch merge (off) adds the planned merge launch."""
    from culmen.flash_attn import flash_attn_with_kvcache
    from culmen.ops.attention import launch

    saved = launch.TUNING["fused_merge"]
    launch.TUNING["fused_merge"] = fused
    try:
        kc, vc = torch.randn(1, 512, 2, 64, dtype=BF16), torch.randn(1, 512, 2, 64, dtype=BF16)
        q = torch.randn(1, 1, 8, 64, dtype=BF16)
        seqlens = torch.tensor([300], dtype=torch.int32)

        def call():
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=4)

        n = assert_host_budget(call, python=python, c=17)
        before = len(fake)
        call()
        assert len(fake) - before == (1 if fused else 2)
        assert n.c_names["_VariableFunctionsClass.zeros"] == 0
        assert _allocs(n) + n.c_names["_VariableFunctionsClass.empty_strided"] == 2  # partials, out
    finally:
        launch.TUNING["fused_merge"] = saved
