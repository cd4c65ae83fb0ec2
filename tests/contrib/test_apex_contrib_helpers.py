"""Behaviour of the small Apex names added by the issue-18 API check: the sparsity permutation helpers
(grouping, distance, swap maps, stripe maps), bottleneck's drelu_dscale*, groupbn's bn_*_NHWC_impl,
jit_dropout_add, get_func_args, schedule_triton_mha and permutation_lib's FX name helpers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from culmen.contrib.bottleneck import bottleneck as bn_mod
from culmen.contrib.groupbn.batch_norm import bn_addrelu_NHWC_impl, bn_NHWC_impl
from culmen.contrib.multihead_attn.encdec_multihead_attn import jit_dropout_add as jda_encdec
from culmen.contrib.multihead_attn.self_multihead_attn import jit_dropout_add
from culmen.contrib.nccl_allocator.nccl_allocator import get_func_args
from culmen.contrib.openfold_triton.mha import schedule_triton_mha
from culmen.contrib.sparsity import permutation_lib as plib
from culmen.contrib.sparsity.permutation_search_kernels import channel_swap as cs
from culmen.contrib.sparsity.permutation_search_kernels import exhaustive_search as ex
from culmen.contrib.sparsity.permutation_search_kernels import permutation_utilities as pu
from culmen.testing.tolerance import assert_close_tolerance


def _score(m, perm=None):
    m = np.abs(np.asarray(m, dtype=np.float64))
    if perm is not None:
        m = m[:, list(perm)]
    return float(np.sort(m.reshape(m.shape[0], -1, 4), axis=-1)[..., 2:].sum())


def test_grouping_helpers():
    A, B = [3, 0, 2, 1, 7, 4, 6, 5, 8, 9, 10, 11], [0, 1, 2, 4, 3, 5, 6, 7, 11, 10, 9, 8]
    assert [g.tolist() for g in pu.make_grouped(A)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [g.tolist() for g in pu.common_groups(A, B)] == [[8, 9, 10, 11]]
    assert pu.remove_common_groups(A, B) == ([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 4, 3, 5, 6, 7])
    diffs = pu.group_differences(A, B)
    assert diffs == [(4, 0, 1), (3, 1, 0)]
    assert pu.dictify(diffs) == {(0, 1): [4], (1, 0): [3]}
    p = [5, 1, 2, 3, 4, 0, 6, 7]
    assert pu.swap_and_correct(p, 0, 5) == [0, 1, 2, 3, 4, 5, 6, 7] and p[0] == 0
    assert pu.efficacy(1.0, 3.0, 2.0) == 0.5 and pu.efficacy(2.0, 2.0, 5.0) == 1.0
    with pytest.raises(ValueError, match="multiple of 4"):
        pu.make_grouped([0, 1, 2])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_permutation_distance_reaches_target(seed):
    rng = np.random.default_rng(seed)
    A, B = rng.permutation(16).tolist(), rng.permutation(16).tolist()
    moved = pu.move_groups_to_match(B, A)
    assert sorted(moved) == list(range(16))
    assert {tuple(sorted(g)) for g in pu.make_grouped(moved)} == {tuple(sorted(g)) for g in pu.make_grouped(B)}
    step = pu.move_permutation_towards(B, A)
    wrong_before = len(pu.group_differences(A, pu.move_groups_to_match(B, A)))
    assert len(pu.group_differences(A, pu.move_groups_to_match(step, A))) < max(wrong_before, 1)
    m = rng.standard_normal((5, 16))
    swaps, results = pu.permutation_distance(A, B, matrix=m, magnitude_targets=[0.0, 1e9])
    assert 0 < swaps <= 16
    mags = [r[0] for r in results]
    assert mags[0] <= mags[1]  # the lowest and the highest magnitude on the path
    for mag, perm in results:
        assert mag == pytest.approx(_score(m, perm))
    assert pu.permutation_distance(A, A)[0] == 0


def test_pruning_statistics():
    rng = np.random.default_rng(3)
    m = rng.standard_normal((6, 8))
    assert pu.magnitude_after_pruning_rows(m, 0.5) == pytest.approx(np.sort(np.abs(m), 1)[:, 4:].sum())
    pruned = pu.unstructured_prune(np.abs(m), 0.25)
    assert (pruned == 0).sum() == 12 and pruned.max() == np.abs(m).max()
    assert m.min() < 0  # input untouched
    perms = [rng.permutation(8).tolist() for _ in range(6)]
    gain, best = pu.try_permutations_on_matrix(m, perms)
    want = max(_score(m, p) for p in perms) - _score(m)
    assert gain == pytest.approx(max(want, 0.0), abs=1e-4)
    if want > 0:
        assert _score(m, best) == pytest.approx(max(_score(m, p) for p in perms), abs=1e-4)


def test_channel_swap_steps():
    rng = np.random.default_rng(4)
    for idx in range(16):
        c0, c1 = cs.stripes_and_swap_idx_to_columns(1, 3, idx)
        assert cs.columns_to_stripes_and_swap_idx(c0, c1) == (1, 3, idx)
    assert cs.stripes_and_swap_idx_to_columns(0, 1, 16) is None
    m = rng.standard_normal((7, 12))
    assert cs.build_stripe_pairs(m, [2]).tolist() == [[0, 2], [1, 2]]
    gains = cs.compute_swap_map(m, [0, 1, 2])
    for (c0, c1), g in list(gains.items())[::7]:
        want = 0.0 if c0 // 4 == c1 // 4 else pu.try_swap(m, c1, c0)[1]
        assert g == pytest.approx(want, abs=1e-4)
    work, perm = m.copy(), list(range(12))
    swap_map, swap_ids, used = [], [], []
    start = _score(m)
    for _ in range(20):
        swap_map, swap_ids = cs.build_swap_map(work, swap_map, swap_ids, used, 0)
        assert len(swap_ids) == 48  # every cross-stripe pair of 12 columns in 3 stripes
        work, swaps, swap_map, swap_ids, used, imp, _, perm = cs.use_swap_map(work, swap_map, swap_ids, 1e-5, 0,
                                                                               0, perm, 0)
        if not swaps:
            break
    np.testing.assert_array_equal(work, m[:, perm])
    assert _score(work) >= start - 1e-9


def test_exhaustive_steps():
    for c in (8, 12):
        found = []
        ex.generate_unique_combinations([0], list(range(1, c)), found, 4)
        assert len(found) == ex.predict_unique_combinations(c, 4)
        assert all(ex.is_canonical(list(p[:4]), int(p[4])) for p in found)
    assert ex.generate_stripe_groups(4, 2) == set(itertools.combinations(range(4), 2))
    rng = np.random.default_rng(5)
    m = rng.standard_normal((6, 16))
    np.testing.assert_array_equal(ex.collect_stripes(m, [3, 1], 4), np.concatenate([m[:, 12:16], m[:, 4:8]], 1))
    assert ex.apply_stripe_group_permutation([4, 5, 6, 7, 0, 1, 2, 3], [0, 2], 4, list(range(16)))[:4] == [8, 9, 10, 11]
    work, perm = m.copy(), list(range(16))
    smap, sids, pmap = ex.build_stripe_map(work, 4, 8, [], [], [], [])
    assert len(smap) == 6 and all(g >= 0 for g in smap)
    before = _score(work)
    work, n, smap, sids, used, imp, perm = ex.use_stripe_map(work, 4, smap, sids, pmap, perm)
    np.testing.assert_array_equal(work, m[:, perm])
    assert _score(work) - before == pytest.approx(imp, abs=1e-3)
    assert (n > 0) == (max(smap) > 1e-12) and set(used) <= set(range(4))


def test_bottleneck_drelu_and_functions():
    g, out = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    s1, s2 = torch.randn(1, 3, 1, 1), torch.randn(1, 3, 1, 1)
    a, d = bn_mod.drelu_dscale1(g, out, s1)
    torch.testing.assert_close(d, torch.where(out > 0, g, torch.zeros_like(g)))
    torch.testing.assert_close(a, d * s1)
    a2, b2 = bn_mod.drelu_dscale2(g, out, s1, s2)
    torch.testing.assert_close((a2, b2), (d * s1, d * s2))
    assert bn_mod.BottleneckFunction.apply is bn_mod.bottleneck_function
    assert bn_mod.SpatialBottleneckFunction.apply is bn_mod.spatial_bottleneck_function


@pytest.mark.parametrize("addrelu", [False, True])
def test_groupbn_impl_functions(addrelu):
    torch.manual_seed(6)
    x = torch.randn(3, 2, 5, 4, requires_grad=True)
    z = torch.randn(3, 2, 5, 4, requires_grad=True)
    s, b = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    rm, rv = torch.zeros(4), torch.ones(4)
    rest = [None] * 10
    if addrelu:
        y = bn_addrelu_NHWC_impl.apply(x, z, s, b, rm, rv, None, None, 1, None, 0.1, 1e-5, True, 1, *rest)
    else:
        y = bn_NHWC_impl.apply(x, s, b, rm, rv, None, None, None, 0.1, 1e-5, True, True, 1, *rest)
    x64, z64, s64, b64 = (t.detach().double().requires_grad_() for t in (x, z, s, b))
    rm64, rv64 = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    ref = F.batch_norm(x64.permute(0, 3, 1, 2), rm64, rv64, s64, b64, True, 0.1, 1e-5).permute(0, 2, 3, 1)
    ref = torch.relu(ref + z64 if addrelu else ref)
    assert_close_tolerance(y, ref, None, name="y")
    torch.testing.assert_close(rm.double(), rm64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rv.double(), rv64, rtol=1e-5, atol=1e-6)
    gy = torch.randn_like(y)
    y.backward(gy)
    ref.backward(gy.double())
    for name, got, want in (("dx", x.grad, x64.grad), ("ds", s.grad, s64.grad), ("db", b.grad, b64.grad)):
        assert_close_tolerance(got, want, None, name=name)
    if addrelu:
        assert_close_tolerance(z.grad, z64.grad, None, name="dz")
    with pytest.raises(ValueError, match="bn_group"):
        bn_NHWC_impl.apply(x, s, b, rm, rv, None, None, None, 0.1, 1e-5, False, True, 2, *rest)


def test_small_helpers():
    x, r = torch.randn(4, 5), torch.randn(4, 5)
    torch.testing.assert_close(jit_dropout_add(x, r, 0.0, True), x + r)
    torch.testing.assert_close(jit_dropout_add(x, r, 1.0, False), r)  # dropout applies whatever is_training says
    assert jda_encdec is jit_dropout_add
    assert get_func_args(lambda a, b=1, *c, d, **e: None) == ["a", "b", "c", "d", "e"]
    fwd, bwd = schedule_triton_mha([1, 64, 4, 256, 16]), schedule_triton_mha([64, 4, 256, 16], fwd=False)
    assert len(fwd) == 4 and len(bwd) == 4 and all(isinstance(v, int) and v >= 0 for v in fwd + bwd)
    assert schedule_triton_mha([8, 200])[0] <= schedule_triton_mha([8, 16])[0]  # wide heads: shorter row tiles
    with pytest.raises(ValueError, match="head dim"):
        schedule_triton_mha([4, 0])
    assert plib.convert_fx_node_name("layer1_0_conv1") == "layer1.0.conv1"

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin_a = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.lin_a(x)) + x

    gm = torch.fx.symbolic_trace(M())
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    parents, children = plib.get_node_parent_children(node)
    assert parents == ["x"] and children == ["relu"]
