"""contrib.sparsity permutation searches and the model permutation pass: every search returns a true
permutation that never keeps less 2:4 magnitude than the identity (exhaustive search checked against
brute force), and permuting a model never changes what it computes."""

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from culmen.contrib.sparsity.permutation_lib import Permutation, replicate_sequence
from culmen.contrib.sparsity.permutation_search_kernels import (
    Channel_Swap,
    Exhaustive_Search,
    accelerated_search_for_good_permutation,
    apply_2_to_4,
    progressive_channel_swap,
    sum_after_2_to_4,
)
from culmen.contrib.sparsity.permutation_search_kernels.exhaustive_search import (
    generate_all_unique_combinations,
    predict_unique_combinations,
    search_matrix,
)
from culmen.contrib.sparsity.permutation_search_kernels.permutation_utilities import find_permutation, try_swap


def _kept(m):
    """float64 reference: per row and group of 4, the two largest |x|."""
    a = np.abs(np.asarray(m, dtype=np.float64)).reshape(-1, 4)
    return float(np.sort(a, axis=1)[:, 2:].sum())


def _heavy_tailed(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    # A few large channels make permutations matter (as in trained weights).
    scale = torch.rand(cols, generator=g) ** 4 * 4 + 0.1
    return torch.randn(rows, cols, generator=g) * scale


def test_sum_after_2_to_4_and_apply_2_to_4_match_float64():
    m = _heavy_tailed(6, 16, 0).numpy()
    assert sum_after_2_to_4(m) == pytest.approx(_kept(m), rel=1e-12)
    pruned = apply_2_to_4(m.copy())
    assert ((pruned != 0).reshape(-1, 4).sum(1) <= 2).all()
    assert np.abs(pruned).sum() == pytest.approx(_kept(m), rel=1e-6)
    t = torch.from_numpy(m.copy())
    new_sum, gain = try_swap(t, 9, 2)
    swapped = m.copy()
    swapped[:, [2, 9]] = swapped[:, [9, 2]]
    assert gain == pytest.approx(_kept(swapped) - _kept(m), abs=1e-9)
    assert torch.equal(t, torch.from_numpy(m))  # unchanged
    assert find_permutation(swapped, m)[:3] == [0, 1, 9]


def test_unique_combinations_count_and_canonical_form():
    assert predict_unique_combinations(8, 4) == 35 and predict_unique_combinations(12, 4) == 5775
    combos = generate_all_unique_combinations(8, 4)
    assert len(combos) == 35 and combos[0] == list(range(8))
    keys = {tuple(sorted((tuple(c[:4]), tuple(c[4:])))) for c in combos}
    assert len(keys) == 35  # no two are the same partition


def test_whole_matrix_search_equals_brute_force_over_all_orders():
    m = _heavy_tailed(5, 8, 1).double().numpy()
    perms = np.array(list(itertools.permutations(range(8))))
    scores = np.sort(np.abs(m)[:, perms].reshape(5, len(perms), 2, 4), axis=-1)[..., 2:].sum((0, 2, 3))
    result, _, order, gain = search_matrix(m, 4)
    assert sorted(order) == list(range(8))
    assert _kept(m[:, order]) == pytest.approx(scores.max(), rel=1e-6)
    assert gain == pytest.approx(scores.max() - _kept(m), rel=1e-4, abs=1e-5)
    np.testing.assert_array_equal(result, m[:, order])


@pytest.mark.parametrize("search", ["exhaustive8", "exhaustive12", "channel_swap", "progressive"])
@pytest.mark.parametrize("shape", [(7, 32), (16, 20)])
def test_searches_return_permutations_never_worse_than_identity(search, shape):
    m = _heavy_tailed(*shape, seed=shape[1])
    if search == "exhaustive8":
        result, _, order = Exhaustive_Search(m.numpy(), stripe_group_size=8, escape_attempts=5)
    elif search == "exhaustive12":
        result, _, order = Exhaustive_Search(m, stripe_group_size=12, escape_attempts=2)
    elif search == "channel_swap":
        result, _, order = Channel_Swap(m, escape_attempts=3)
    else:
        result, _, order = progressive_channel_swap(m, time_limit=2.0, batch_pairs=16)
    assert sorted(order) == list(range(shape[1]))
    np.testing.assert_array_equal(np.asarray(result), m.numpy()[:, order])
    assert _kept(m.numpy()[:, order]) >= _kept(m.numpy()) - 1e-9
    # these heavy-tailed matrices always have something to gain
    assert _kept(m.numpy()[:, order]) > _kept(m.numpy()) + 1e-6


def test_search_keeps_the_identity_when_nothing_can_be_gained():
    # every group already holds exactly two equal nonzeros: 2:4 keeps everything
    m = torch.zeros(4, 16)
    m[:, 0::4] = 1.0
    m[:, 1::4] = 1.0
    for strategy in ["exhaustive", "channel swap", "progressive channel swap"]:
        order = accelerated_search_for_good_permutation(m, {"strategy": strategy, "progressive_search_time_limit": 1})
        assert _kept(m.numpy()[:, order]) == _kept(m.numpy())


def test_search_continues_from_a_given_permutation():
    m = _heavy_tailed(6, 16, 5)
    start = [4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]
    _, _, order = Exhaustive_Search(m[:, start], stripe_group_size=8, escape_attempts=0, permutation=start)
    assert sorted(order) == list(range(16))
    assert _kept(m.numpy()[:, order]) >= _kept(m.numpy()[:, start]) - 1e-9


def test_accelerated_search_options_and_errors():
    m = _heavy_tailed(8, 24, 7)
    opts = {}
    order = accelerated_search_for_good_permutation(m, opts)
    assert opts == {"strategy": "exhaustive", "stripe_group_size": 8, "escape_attempts": 100}  # filled in place
    assert sorted(order) == list(range(24)) and _kept(m.numpy()[:, order]) > _kept(m.numpy())
    assert accelerated_search_for_good_permutation(m, {"strategy": "user defined"}) == list(range(24))
    with pytest.raises(ValueError, match="strategy"):
        accelerated_search_for_good_permutation(m, {"strategy": "annealing"})
    with pytest.raises(ValueError, match="not a multiple of 4"):
        accelerated_search_for_good_permutation(torch.randn(4, 10))
    with pytest.raises(ValueError, match="stripe_group_size"):
        Exhaustive_Search(m, stripe_group_size=6)
    assert replicate_sequence([1, 0], 2) == [1, 0, 3, 2]


# -- the model pass --------------------------------------------------------------------------------

class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = h + self.fc2(h)  # fc2's output meets fc1's: both groups are blocked
        return self.fc3(h)


def _models():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 48), nn.LayerNorm(48), nn.GELU(),
                        nn.Dropout(0.0), nn.Linear(48, 16))
    conv = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 32, 1),
                         nn.BatchNorm2d(32), nn.SiLU(), nn.Conv2d(32, 8, 3))
    for mod in conv.modules():
        if isinstance(mod, nn.BatchNorm2d):  # non-trivial running statistics and affine parameters
            mod.running_mean.uniform_(-1, 1)
            mod.running_var.uniform_(0.5, 2)
            nn.init.uniform_(mod.weight, 0.5, 2)
            nn.init.uniform_(mod.bias, -1, 1)
    for mod in [*mlp.modules(), *conv.modules()]:
        if isinstance(mod, (nn.Linear, nn.Conv2d)):  # heavy-tailed input channels
            with torch.no_grad():
                scale = torch.rand(mod.weight.shape[1]).pow(4).mul(4).add(0.1)
                mod.weight.mul_(scale.view(1, -1, *[1] * (mod.weight.dim() - 2)))
    return {"mlp": (mlp.double().eval(), torch.randn(5, 16, dtype=torch.float64)),
            "conv": (conv.double().eval(), torch.randn(2, 8, 6, 6, dtype=torch.float64)),
            "residual": (_Residual().double().eval(), torch.randn(5, 16, dtype=torch.float64))}


def _sparse_entries(model):
    return [(n, m, "weight", m.weight, None, None) for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Conv2d))]


def _kept_of(module):
    w = module.weight.detach()
    rc = w if w.dim() == 2 else w.permute(2, 3, 0, 1).reshape(-1, w.shape[1])
    return _kept(rc.numpy())


@pytest.mark.parametrize("name", ["mlp", "conv", "residual"])
def test_permute_model_keeps_the_function_and_never_loses_magnitude(name):
    model, x = _models()[name]
    y0 = model(x)
    entries = _sparse_entries(model)
    before = {n: _kept_of(m) for n, m, *_ in entries}
    Permutation.set_permutation_params_from_asp(model, entries, [], verbosity=0)
    Permutation.set_identical_seed(1)
    Permutation.set_permutation_search_options({"strategy": "exhaustive", "stripe_group_size": 8, "escape_attempts": 3})
    try:
        assert Permutation.permute_model(model)
    finally:
        Permutation.set_permutation_search_options(None)
    torch.testing.assert_close(model(x), y0, rtol=1e-12, atol=1e-12)
    after = {n: _kept_of(m) for n, m, *_ in entries}
    permuted_c, permuted_k, blocked = Permutation.get_permutation_stats()
    if name == "mlp":
        assert permuted_c == ["2.weight", "6.weight"]
        assert set(permuted_k) >= {"0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"}
        assert after["2"] > before["2"] and after["6"] > before["6"]
    elif name == "conv":
        assert permuted_c == ["3.weight", "6.weight"]
        assert {"1.running_mean", "1.running_var", "4.running_mean", "4.weight"} <= set(permuted_k)
    else:
        assert permuted_c == [] and "fc2_C" in blocked and "fc3_C" in blocked
    for n in before:
        assert after[n] >= before[n] - 1e-9


def test_permute_model_gives_up_cleanly_on_untraceable_models():
    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
                return self.b(self.a(x))
            return self.b(x)

    model = Untraceable()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    Permutation.set_permutation_params_from_asp(model, _sparse_entries(model), [], verbosity=0)
    assert Permutation.permute_model(model) is False
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k])


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["exhaustive", "channel swap", "progressive channel swap"])
def test_gpu_searches_on_a_layer_sized_matrix(strategy):
    m = _heavy_tailed(256, 512, 11).cuda()
    opts = {"strategy": strategy, "escape_attempts": 5, "progressive_search_time_limit": 10}
    order = accelerated_search_for_good_permutation(m, opts)
    assert sorted(order) == list(range(512))
    base, new = _kept(m.cpu().numpy()), _kept(m.cpu().numpy()[:, order])
    assert new > base * 1.001
