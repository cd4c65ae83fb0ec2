"""Apex's small public helpers of ``apex.parallel.distributed`` (``flatten``, ``unflatten``,
``apply_flat_dist_call``, ``split_by_type``, ``split_half_float_double``, ``import_flatten_impl``),
``apex.parallel.multiproc.docstring_hack`` and ``apex.amp.scaler``'s per-tensor fallbacks
(``scale_check_overflow_python``, ``axpby_check_overflow_python``)."""

from __future__ import annotations

import pytest
import torch

from culmen.amp.scaler import axpby_check_overflow_python, scale_check_overflow_python
from culmen.parallel import distributed as D
from culmen.parallel.multiproc import docstring_hack


def test_flatten_round_trip_and_splits():
    a, b = torch.randn(2, 3), torch.randn(4)
    flat = D.flatten([a, b])
    assert flat.shape == (10,) and torch.equal(flat[:6], a.flatten())
    back = D.unflatten(flat, [a, b])
    assert torch.equal(back[0], a) and torch.equal(back[1], b)
    mixed = [torch.zeros(1, dtype=torch.float64), torch.zeros(1), torch.zeros(1, dtype=torch.float64)]
    groups = D.split_by_type(mixed)
    assert list(groups) == ["torch.DoubleTensor", "torch.FloatTensor"] and len(groups["torch.DoubleTensor"]) == 2
    assert D.split_half_float_double(mixed) == []  # CUDA types only, as Apex
    assert D.import_flatten_impl() is None and docstring_hack() is None


def test_apply_flat_dist_call_copies_back():
    bucket = [torch.ones(2), torch.full((3,), 2.0)]

    def fake_broadcast(flat, src):
        assert src == 0
        flat.mul_(10)

    D.apply_flat_dist_call(bucket, fake_broadcast, (0,))
    assert torch.equal(bucket[0], torch.full((2,), 10.0)) and torch.equal(bucket[1], torch.full((3,), 20.0))


def test_scale_check_overflow_python():
    g = torch.tensor([1.0, -2.0], dtype=torch.float16)
    master = torch.zeros(2)
    assert scale_check_overflow_python(g, master, 0.5, check_overflow=True) is False
    assert torch.equal(master, torch.tensor([0.5, -1.0]))
    bad = torch.tensor([1.0, float("inf")])
    untouched = torch.full((2,), 7.0)
    assert scale_check_overflow_python(bad, untouched, 0.5, check_overflow=True) is True
    assert torch.equal(untouched, torch.full((2,), 7.0))
    same = torch.tensor([4.0])
    assert scale_check_overflow_python(same, same, 0.25) is False and same.item() == 1.0


def test_axpby_check_overflow_python():
    g = torch.tensor([2.0, 4.0], dtype=torch.float16)
    stashed = torch.tensor([1.0, 1.0])
    master = torch.zeros(2)
    assert axpby_check_overflow_python(g, stashed, master, 0.5, 3.0, check_overflow=True) is False
    assert torch.equal(master, torch.tensor([4.0, 5.0]))
    assert axpby_check_overflow_python(torch.tensor([float("nan")]), stashed[:1], master[:1], 1.0, 1.0,
                                       check_overflow=True) is True
    with pytest.raises(TypeError, match="stashed_grad"):
        axpby_check_overflow_python(g, stashed.double(), master, 1.0, 1.0)
