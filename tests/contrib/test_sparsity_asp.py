"""contrib.sparsity.ASP: masks exactly 2:4 along the input channels, optimizer steps keep pruned
weights at zero, dense weights restorable, layer selection, checkpoints, permutation preserving the
model, bad arguments, and the apex alias."""

import textwrap

import pytest
import torch
from fresh_python import run_python
from torch import nn

from culmen.contrib.sparsity import ASP
from culmen.contrib.sparsity.permutation_lib import Permutation


@pytest.fixture(autouse=True)
def _fresh_asp():
    ASP.reset()
    yield
    ASP.reset()
    Permutation.set_permutation_search_options(None)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 16),
                         nn.Linear(16, 24))  # the last: 24 rows is fine, 16 inputs is fine


def _conv_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 16, 1),
                         nn.Flatten(), nn.Linear(16 * 25, 12))


def _assert_2to4(mask, weight):
    rc = mask if mask.dim() == 2 else mask.permute(*range(2, mask.dim()), 0, 1).reshape(-1, mask.shape[1])
    assert bool((rc.reshape(rc.shape[0], -1, 4).sum(-1) == 2).all())
    assert bool((weight[~mask] == 0).all())


def test_masks_are_2to4_buffers_and_weights_are_pruned():
    model = _model()
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    ASP.init_model_for_pruning(model, "m4n2_1d", verbosity=0, whitelist=[nn.Linear], allow_permutation=False)
    assert ASP.already_init_asp_model()
    assert not ASP.is_sparsity_enabled()
    assert "0.__weight_mma_mask" in model.state_dict()
    ASP.compute_sparse_masks()
    assert ASP.is_sparsity_enabled()
    for name, module, _, p, mask, pruned in ASP.sparse_parameters():
        assert mask is getattr(module, "__weight_mma_mask") and mask.dtype == torch.bool
        _assert_2to4(mask, p)
        # kept values untouched, and the kept ones are the two largest of each group
        torch.testing.assert_close(p[mask], dense[f"{name}.weight"][mask], rtol=0, atol=0)
        groups = dense[f"{name}.weight"].abs().reshape(-1, 4)
        assert torch.equal(mask.reshape(-1, 4).sum(1), torch.full((groups.shape[0],), 2))
        kept_min = torch.where(mask.reshape(-1, 4), groups, torch.inf).min(1).values
        dropped_max = torch.where(mask.reshape(-1, 4), -torch.inf, groups).max(1).values
        assert bool((kept_min >= dropped_max).all())
        assert pruned is None
    assert len(ASP.sparse_parameters()) == 4


def test_conv_masks_run_along_input_channels_and_small_layers_are_skipped(capsys):
    model = _conv_model()
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=False)
    out = capsys.readouterr().out
    assert "Auto skipping pruning 5::weight" in out  # 12 output rows: not a multiple of 8
    ASP.compute_sparse_masks()
    names = [n for n, *_ in ASP.sparse_parameters()]
    assert names == ["0", "3"]
    for _, _, _, p, mask, _ in ASP.sparse_parameters():
        _assert_2to4(mask, p)


def test_optimizer_step_keeps_pruned_weights_at_zero():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ASP.init_model_for_pruning(model, verbosity=0, whitelist=[nn.Linear], allow_permutation=False)
    ASP.init_optimizer_for_pruning(opt)
    ASP.compute_sparse_masks()
    x = torch.randn(9, 32)
    for _ in range(4):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        for *_, p, mask, _ in ASP.sparse_parameters():
            assert bool((p[~mask] == 0).all())
            assert bool((p.grad[~mask] == 0).all())  # gradients were masked before the step
            assert bool((p[mask] != 0).any())
    with pytest.raises(RuntimeError, match="optimizer already"):
        ASP.init_optimizer_for_pruning(opt)


def test_restore_pruned_weights_and_recompute_masks():
    model = _model()
    dense = {k: v.clone() for k, v in model.state_dict().items() if "mma" not in k}
    ASP.init_model_for_pruning(model, verbosity=0, whitelist=[nn.Linear], allow_recompute_mask=True,
                               allow_permutation=False)
    assert "0.__weight_mma_pruned_p" in model.state_dict()
    ASP.compute_sparse_masks()
    assert ASP.is_sparsity_enabled()
    for name, _, _, _, mask, pruned in ASP.sparse_parameters():
        assert pruned.device.type == "cpu" and bool((pruned[mask] == 0).all())
        assert torch.equal(pruned[~mask], dense[f"{name}.weight"][~mask])
    ASP.compute_sparse_masks()  # recomputing restores the dense weights first: same masks again
    ASP.restore_pruned_weights()
    assert not ASP.is_sparsity_enabled()
    for k, v in model.state_dict().items():
        if "mma" not in k:
            assert torch.equal(v, dense[k]), k


def test_recomputing_without_recompute_mask_raises():
    model = _model()
    ASP.init_model_for_pruning(model, verbosity=0, whitelist=[nn.Linear], allow_permutation=False)
    ASP.compute_sparse_masks()
    with pytest.raises(RuntimeError, match="allow_recompute_mask"):
        ASP.compute_sparse_masks()
    with pytest.raises(RuntimeError, match="allow_recompute_mask"):
        ASP.restore_pruned_weights()


def test_allowed_and_disallowed_layer_names():
    model = _model()
    ASP.init_model_for_pruning(model, verbosity=0, whitelist=[nn.Linear], allowed_layer_names=["0", "2", "4"],
                               disallowed_layer_names=["2"], allow_permutation=False)
    assert [n for n, *_ in ASP.sparse_parameters()] == ["0", "4"]
    ASP.compute_sparse_masks()
    assert bool((model[2].weight != 0).all()) and not hasattr(model[2], "__weight_mma_mask")
    assert (model[0].weight == 0).float().mean() == 0.5


def test_custom_layer_dict_and_callable_mask_calculator():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.kernel = nn.Parameter(torch.randn(16, 32))
            self.other = nn.Parameter(torch.randn(16, 32))

        def forward(self, x):
            return x @ self.kernel.t() + x @ self.other.t()

    model = nn.Sequential(Custom(), nn.Linear(16, 16))
    calls = []

    def every_other(param):
        calls.append(tuple(param.shape))
        mask = torch.zeros_like(param, dtype=torch.bool)
        mask[:, ::2] = True
        return mask

    ASP.init_model_for_pruning(model, every_other, verbosity=0, whitelist=[nn.Linear],
                               custom_layer_dict={Custom: ["kernel"]}, allow_permutation=False)
    ASP.compute_sparse_masks()
    assert calls == [(16, 32), (16, 16)]
    assert bool((model[0].kernel[:, 1::2] == 0).all()) and bool((model[0].other != 0).all())


def test_checkpoint_round_trip_keeps_masks():
    model = _model()
    ASP.init_model_for_pruning(model, verbosity=0, whitelist=[nn.Linear], allow_permutation=False)
    ASP.compute_sparse_masks()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ASP.reset()
    fresh = _model(seed=5)
    ASP.init_model_for_pruning(fresh, verbosity=0, whitelist=[nn.Linear], allow_permutation=False)
    assert not ASP.is_sparsity_enabled()
    fresh.load_state_dict(state)
    assert ASP.is_sparsity_enabled()
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    ASP.init_optimizer_for_pruning(opt)
    fresh(torch.randn(3, 32)).sum().backward()
    opt.step()
    for *_, p, mask, _ in ASP.sparse_parameters():
        assert bool((p[~mask] == 0).all())


def test_inconsistent_sparsity_is_an_error():
    model = _model()
    ASP.init_model_for_pruning(model, verbosity=0, whitelist=[nn.Linear], allow_permutation=False)
    ASP.compute_sparse_masks()
    ASP.sparse_parameters()[0][4].fill_(True)
    with pytest.raises(RuntimeError, match="Inconsistent"):
        ASP.is_sparsity_enabled()


def test_bad_arguments_and_misuse():
    model = _model()
    with pytest.raises(RuntimeError, match="init_model_for_pruning"):
        ASP.init_optimizer_for_pruning(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="pattern"):
        ASP.init_model_for_pruning(model, "m4n2_9d", verbosity=0)
    with pytest.raises(ValueError, match="whitelist"):
        ASP.init_model_for_pruning(model, verbosity=0, whitelist=[nn.Linear, nn.LSTM])
    with pytest.raises(TypeError, match="mask_calculator"):
        ASP.init_model_for_pruning(model, 3, verbosity=0)
    with pytest.raises(TypeError, match="model"):
        ASP.init_model_for_pruning("model", verbosity=0)
    with pytest.raises(TypeError, match="disallowed_layer_names"):
        ASP.init_model_for_pruning(model, verbosity=0, disallowed_layer_names="0")
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=False)
    with pytest.raises(RuntimeError, match="initialized already"):
        ASP.init_model_for_pruning(model, verbosity=0)


def test_permutation_keeps_the_dense_function_and_keeps_more_magnitude():
    model = _model().double()
    with torch.no_grad():  # heavy-tailed input channels, as in trained weights
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.mul_(torch.rand(m.weight.shape[1], dtype=torch.float64).pow(4).mul(4).add(0.1))
    x = torch.randn(7, 32, dtype=torch.float64)
    y_dense = model(x)
    plain = _model().double()
    plain.load_state_dict(model.state_dict())
    Permutation.set_permutation_search_options({"strategy": "exhaustive", "stripe_group_size": 8, "escape_attempts": 2})
    opt = torch.optim.Adam(model.parameters(), lr=0.0)
    model(x).sum().backward()
    opt.step()  # optimizer state exists before the permutation
    exp_avg_before = opt.state[model[2].weight]["exp_avg"].clone()
    ASP.init_model_for_pruning(model, verbosity=0, whitelist=[nn.Linear], allow_recompute_mask=True)
    ASP.init_optimizer_for_pruning(opt)
    ASP.compute_sparse_masks()
    permuted_c, _, _ = Permutation.get_permutation_stats()
    assert "2.weight" in permuted_c and "4.weight" in permuted_c
    expected = exp_avg_before
    for t, dim, order in Permutation.applied_permutations():  # 2.weight moves along C and along K
        if t is model[2].weight:
            expected = expected.index_select(dim, torch.tensor(order))
    assert not torch.equal(expected, exp_avg_before)
    torch.testing.assert_close(opt.state[model[2].weight]["exp_avg"], expected, rtol=0, atol=0)
    kept_perm = sum(float(p.detach().abs().sum()) for *_, p, _, _ in ASP.sparse_parameters())
    ASP.restore_pruned_weights()
    torch.testing.assert_close(model(x), y_dense, rtol=1e-12, atol=1e-12)  # permutation kept the function
    ASP.reset()
    ASP.init_model_for_pruning(plain, verbosity=0, whitelist=[nn.Linear], allow_permutation=False)
    ASP.compute_sparse_masks()
    kept_plain = sum(float(p.detach().abs().sum()) for *_, p, _, _ in ASP.sparse_parameters())
    assert kept_perm > kept_plain


def test_prune_trained_model_and_permutation_saving(tmp_path, capsys, monkeypatch):
    # The graphs go to permutation_output_dir only: nothing may land in the working directory (a relative
    # default once wrote model_offline_permutation_graph.json into the repo root).
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out_dir = tmp_path / "out"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ASP.set_permutation_saving_params(allow_permutation=True, save_permutation_graph=True,
                                      permutation_output_dir=str(out_dir))
    Permutation.set_permutation_search_options({"strategy": "channel swap"})
    ASP.prune_trained_model(model, opt)
    assert ASP.is_sparsity_enabled()
    assert "Enabled 50.00% sparsity for 0::weight" in capsys.readouterr().out
    assert (out_dir / "model_offline_permutation_graph.json").exists()
    assert (out_dir / "model_permutation_graph.json").exists()
    assert list(cwd.iterdir()) == []
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    for *_, p, mask, _ in ASP.sparse_parameters():
        assert bool((p[~mask] == 0).all())


def test_alias_import_paths():
    code = textwrap.dedent("""
        import culmen.compat as compat
        compat.install()
        from apex.contrib.sparsity import ASP, create_mask
        from apex.contrib.sparsity.asp import ASP as ASP2
        from apex.contrib.sparsity.sparse_masklib import m4n2_1d, m4n2_2d_best, m4n2_2d_greedy
        from apex.contrib.sparsity.permutation_lib import Permutation
        from apex.contrib.sparsity.permutation_search_kernels import accelerated_search_for_good_permutation
        from apex.contrib.sparsity.permutation_search_kernels import sum_after_2_to_4
        from apex.contrib.sparsity.permutation_search_kernels.exhaustive_search import Exhaustive_Search
        from apex.contrib.sparsity.permutation_search_kernels.channel_swap import Channel_Swap
        import culmen.contrib.sparsity as real
        assert ASP is ASP2 is real.ASP and create_mask is real.create_mask
        print("OK")
    """)
    assert run_python(code).endswith("OK")
