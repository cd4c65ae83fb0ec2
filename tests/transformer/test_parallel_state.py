"""``culmen.transformer.parallel_state``: group layout, ranks, predicates and errors.

The expected layout comes from a coordinate decomposition written here independently of the library:
global rank = ``pp_rank * (tp * dp) + dp_rank * tp + tp_rank``; the TP group of a rank is the ranks
sharing its (pp, dp) coordinates, the PP group those sharing (dp, tp), the DP group those sharing
(pp, tp), the model-parallel group those sharing dp. Layouts for 8 and 16 ranks are checked in-process
against a recording stand-in for ``torch.distributed``; real gloo groups on 2 and 4 spawned ranks are
checked by membership and by an all-reduce over each group.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from culmen.transformer import parallel_state as ps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402


def _coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    return rank // (tp * dp), (rank // tp) % dp, rank % tp  # (pp, dp, tp)


def _expected(rank: int, world: int, tp: int, pp: int) -> dict[str, list[int]]:
    dp = world // (tp * pp)
    me = _coords(rank, tp, dp)
    everyone = [(r, _coords(r, tp, dp)) for r in range(world)]
    return {
        "tp": [r for r, c in everyone if c[0] == me[0] and c[1] == me[1]],
        "pp": [r for r, c in everyone if c[1] == me[1] and c[2] == me[2]],
        "dp": [r for r, c in everyone if c[0] == me[0] and c[2] == me[2]],
        "mp": [r for r, c in everyone if c[1] == me[1]],
        "amax": [r for r, c in everyone if c[0] == me[0]],
    }


class _FakeGroup:
    def __init__(self, ranks):
        self.ranks = list(ranks)


def _fake_dist(world: int, rank: int, created: list) -> types.SimpleNamespace:
    def new_group(ranks=None, backend=None):
        g = _FakeGroup(ranks if ranks is not None else range(world))
        created.append((g.ranks, backend))
        return g

    return types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                 get_world_size=lambda group=None: world, get_rank=lambda group=None: rank,
                                 get_backend=lambda group=None: "gloo", new_group=new_group)


@pytest.fixture
def clean_state():
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


@pytest.mark.parametrize("world,tp,pp", [(8, 2, 2), (16, 2, 4), (8, 1, 4), (8, 4, 1), (16, 4, 2), (6, 3, 2)])
def test_layout_matches_coordinates(monkeypatch, clean_state, world, tp, pp):
    calls_per_rank = []
    for rank in range(world):
        created: list = []
        monkeypatch.setattr(ps, "dist", _fake_dist(world, rank, created))
        ps.initialize_model_parallel(tp, pp, use_fp8_=True, default_backend="gloo", p2p_backend="gloo")
        exp = _expected(rank, world, tp, pp)
        assert ps.get_tensor_model_parallel_group().ranks == exp["tp"]
        assert ps.get_pipeline_model_parallel_group().ranks == exp["pp"]
        assert ps.get_data_parallel_group().ranks == exp["dp"]
        assert ps.get_model_parallel_group().ranks == exp["mp"]
        assert ps.get_amax_reduction_group().ranks == exp["amax"]
        assert ps.get_tensor_model_parallel_rank() == exp["tp"].index(rank)
        assert ps.get_pipeline_model_parallel_rank() == exp["pp"].index(rank)
        assert ps.get_data_parallel_rank() == exp["dp"].index(rank)
        assert (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_data_parallel_world_size()) == (tp, pp, world // (tp * pp))
        assert ps.get_tensor_model_parallel_src_rank() == exp["tp"][0]
        assert ps.get_data_parallel_src_rank() == exp["dp"][0]
        assert ps.get_pipeline_model_parallel_first_rank() == exp["pp"][0]
        assert ps.get_pipeline_model_parallel_last_rank() == exp["pp"][-1]
        i = exp["pp"].index(rank)
        assert ps.get_pipeline_model_parallel_next_rank() == exp["pp"][(i + 1) % pp]
        assert ps.get_pipeline_model_parallel_prev_rank() == exp["pp"][(i - 1) % pp]
        emb_ranks = [exp["pp"][0], exp["pp"][-1]] if pp > 1 else exp["pp"]
        if rank in emb_ranks:
            assert ps.get_embedding_group().ranks == emb_ranks
        else:  # ranks without an embedding copy have no embedding group (as in Apex)
            with pytest.raises(ps.ModelParallelNotInitializedError):
                ps.get_embedding_group()
        assert ps.is_rank_in_embedding_group() == (i in (0, pp - 1))
        assert ps.is_rank_in_position_embedding_group() == (i == 0)
        # Every rank must create the same groups in the same order (torch.distributed's contract).
        calls_per_rank.append([r for r, _ in created])
        assert all(b == "gloo" for _, b in created)
        ps.destroy_model_parallel()
        assert not ps.model_parallel_is_initialized()
    assert all(c == calls_per_rank[0] for c in calls_per_rank)


def test_docstring_example_16_ranks(monkeypatch, clean_state):
    # Apex's documented example: 16 ranks, tp=2, pp=4.
    groups = {}
    for rank in range(16):
        monkeypatch.setattr(ps, "dist", _fake_dist(16, rank, []))
        ps.initialize_model_parallel(2, 4)
        for kind, g in (("dp", ps.get_data_parallel_group()), ("tp", ps.get_tensor_model_parallel_group()),
                        ("pp", ps.get_pipeline_model_parallel_group())):
            groups.setdefault(kind, set()).add(tuple(g.ranks))
        ps.destroy_model_parallel()
    assert groups["dp"] == {(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)}
    assert groups["tp"] == {(2 * i, 2 * i + 1) for i in range(8)}
    assert groups["pp"] == {(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)}


def test_split_rank_and_virtual_pipeline(monkeypatch, clean_state):
    # 4 stages, split at 2: the decoder's first stage joins the embedding / position-embedding groups.
    for rank in range(4):
        monkeypatch.setattr(ps, "dist", _fake_dist(4, rank, []))
        ps.initialize_model_parallel(1, 4, 2, 2)
        if rank != 1:
            assert ps.get_embedding_group().ranks == [0, 2, 3]
        if rank in (0, 2):
            assert ps.get_position_embedding_group().ranks == [0, 2]
        assert ps.is_rank_in_encoder_relative_position_embedding_group() == (rank < 2)
        assert ps.is_rank_in_decoder_relative_position_embedding_group() == (rank >= 2)
        assert ps.get_pipeline_model_parallel_split_rank() == 2
        assert ps.is_pipeline_stage_before_split() == (rank < 2)
        assert ps.is_pipeline_stage_after_split() == (rank >= 2)
        assert ps.is_pipeline_stage_at_split() == (rank == 1)
        assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
        assert ps.get_virtual_pipeline_model_parallel_rank() == 0
        # Virtual chunk 0 of stage 0 is the first stage; its chunk 1 is not. Mirror for the last stage.
        assert ps.is_pipeline_first_stage() == (rank == 0)
        assert not ps.is_pipeline_last_stage()
        assert ps.is_pipeline_last_stage(ignore_virtual=True) == (rank == 3)
        assert ps.is_rank_in_embedding_group() == (rank in (0, 2))
        assert ps.is_rank_in_embedding_group(ignore_virtual=True) == (rank in (0, 2, 3))
        ps.set_virtual_pipeline_model_parallel_rank(1)
        assert not ps.is_pipeline_first_stage()
        assert ps.is_pipeline_first_stage(ignore_virtual=True) == (rank == 0)
        assert ps.is_pipeline_last_stage() == (rank == 3)
        assert ps.is_rank_in_embedding_group() == (rank in (2, 3))
        assert ps.get_rank_info() == (0, 0, rank, 1)
        ps.set_pipeline_model_parallel_split_rank(3)
        assert ps.is_pipeline_stage_at_split() == (rank == 2)
        ps.destroy_model_parallel()
        assert ps.get_virtual_pipeline_model_parallel_rank() is None
        assert ps.get_pipeline_model_parallel_split_rank() is None


def test_setters_override_getters(monkeypatch, clean_state):
    monkeypatch.setattr(ps, "dist", _fake_dist(4, 3, []))
    ps.initialize_model_parallel(2, 2)
    ps.set_tensor_model_parallel_world_size(7)
    ps.set_tensor_model_parallel_rank(5)
    ps.set_pipeline_model_parallel_world_size(3)
    ps.set_pipeline_model_parallel_rank(2)
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()) == (7, 5)
    assert (ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()) == (3, 2)
    assert ps.is_pipeline_last_stage()
    ps.set_tensor_model_parallel_world_size(None)
    assert ps.get_tensor_model_parallel_world_size() == 2
    ps.destroy_model_parallel()
    with pytest.raises(ps.ModelParallelNotInitializedError):
        ps.get_tensor_model_parallel_world_size()


def test_bad_sizes_and_uninitialized(monkeypatch, clean_state):
    getters = [ps.get_tensor_model_parallel_group, ps.get_pipeline_model_parallel_group, ps.get_data_parallel_group,
               ps.get_model_parallel_group, ps.get_embedding_group, ps.get_position_embedding_group,
               ps.get_amax_reduction_group, ps.get_tensor_model_parallel_rank, ps.get_pipeline_model_parallel_rank,
               ps.get_data_parallel_rank, ps.get_data_parallel_world_size, ps.get_tensor_model_parallel_world_size,
               ps.get_pipeline_model_parallel_first_rank, ps.get_pipeline_model_parallel_next_rank,
               ps.is_rank_in_embedding_group, ps.get_data_parallel_src_rank,
               ps.get_encoder_relative_position_embedding_group]
    for fn in getters:
        with pytest.raises(AssertionError, match="not initialized.*initialize_model_parallel"):
            fn()
        with pytest.raises(RuntimeError):
            fn()
    assert ps.get_rank_info() == (0, 0, 0, 0)
    assert ps.is_unitialized()

    monkeypatch.setattr(ps, "dist", _fake_dist(6, 0, []))
    with pytest.raises(ValueError, match=r"world_size \(6\).*tensor_model_parallel_size \(2\).*"
                                         r"pipeline_model_parallel_size \(2\)"):
        ps.initialize_model_parallel(2, 2)
    with pytest.raises(RuntimeError):  # Apex raised RuntimeError; both catch it
        ps.initialize_model_parallel(4, 1)
    with pytest.raises(ValueError, match="tensor_model_parallel_size_ must be a positive int, got 0"):
        ps.initialize_model_parallel(0, 1)
    with pytest.raises(ValueError, match="pipeline_model_parallel_split_rank_ .* got 3"):
        ps.initialize_model_parallel(1, 3, None, 3)
    with pytest.raises(ValueError, match="needs pipeline_model_parallel_size_ >= 2, got 1"):
        ps.initialize_model_parallel(2, 1, 2)
    with pytest.raises(ValueError, match="default_backend"):
        ps.initialize_model_parallel(default_backend="tcp")
    assert not ps.model_parallel_is_initialized()  # nothing half-built after the errors
    ps.initialize_model_parallel(2, 3)
    with pytest.raises(RuntimeError, match="already initialized"):
        ps.initialize_model_parallel(2, 3)


def test_uninitialized_torch_distributed(clean_state):
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ps.initialize_model_parallel()


# ---------------------------------------------------------------- real gloo groups


def _group_sum(rank: int, group) -> int:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    return int(t.item())


def _check_1d_split(rank, tp, tp_rank, failures):
    from culmen.transformer.utils import DivisibilityError, gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

    # Same full tensor on every rank of the TP group: its chunk, then the gather, must give it back.
    full = torch.arange(6 * tp, dtype=torch.float64).view(3, 2 * tp) * (1 + rank // tp)
    chunk = split_tensor_into_1d_equal_chunks(full)
    if not torch.equal(chunk, full.view(-1)[tp_rank * 6:(tp_rank + 1) * 6]) or chunk.data_ptr() != \
            full.view(-1)[tp_rank * 6:].data_ptr():
        failures.append(f"split chunk of tp rank {tp_rank}: {chunk}")
    back = gather_split_1d_tensor(chunk.clone())
    if back.dtype != torch.float64 or not torch.equal(back, full.view(-1)):
        failures.append(f"gather_split_1d_tensor: {back}")
    try:
        split_tensor_into_1d_equal_chunks(torch.ones(2 * tp + 1))
        failures.append("no error for a numel not divisible by tp")
    except DivisibilityError:
        pass


def _real_worker(rank: int, world: int, configs):
    from culmen.transformer import parallel_state as ps

    failures = []
    for tp, pp, vpp, split in configs:
        ps.initialize_model_parallel(tp, pp, vpp, split, use_fp8_=(pp > 1))
        exp = _expected(rank, world, tp, pp)
        got = {"tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
               "dp": ps.get_data_parallel_group(), "mp": ps.get_model_parallel_group()}
        if pp > 1:
            got["amax"] = ps.get_amax_reduction_group()
        for kind, group in got.items():
            members = dist.get_process_group_ranks(group)
            if members != exp[kind]:
                failures.append(f"{(tp, pp)} {kind}: {members} != {exp[kind]}")
            # The group really communicates among exactly those ranks.
            s = _group_sum(rank, group)
            if s != sum(r + 1 for r in exp[kind]):
                failures.append(f"{(tp, pp)} {kind}: all_reduce gave {s}")
        emb = dist.get_process_group_ranks(ps.get_embedding_group()) if ps.is_rank_in_embedding_group(True) else None
        if emb is not None and _group_sum(rank, ps.get_embedding_group()) != sum(r + 1 for r in emb):
            failures.append(f"{(tp, pp)} embedding all_reduce")
        if tp > 1:
            _check_1d_split(rank, tp, exp["tp"].index(rank), failures)
        info = ps.get_rank_info()
        want = (exp["dp"].index(rank), exp["tp"].index(rank), exp["pp"].index(rank), 0 if vpp else None)
        if info != want:
            failures.append(f"{(tp, pp)} rank info {info} != {want}")
        ps.destroy_model_parallel()
    # A bad size fails the same way on every rank, before any group is created.
    try:
        ps.initialize_model_parallel(3 if world == 4 else 2, 2 if world == 4 else 3)
        failures.append("no error for a world size not divisible by tp*pp")
    except ValueError as e:
        if f"({world})" not in str(e):
            failures.append(f"message lacks the world size: {e}")
    return failures


def test_gloo_two_ranks():
    out = run_group(_real_worker, 2, [(1, 1, None, None), (2, 1, None, None), (1, 2, None, None)])
    assert out == [[], []]


def test_gloo_four_ranks():
    out = run_group(_real_worker, 4, [(2, 2, None, None), (1, 2, None, None), (1, 4, 2, 2), (4, 1, None, None)])
    assert out == [[], [], [], []]
