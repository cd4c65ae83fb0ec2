"""Shared helpers of the culmen.amp tests (imported by the test modules of this folder)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from culmen import amp
from culmen.amp import _cast_engine
from culmen.amp._amp_state import _amp_state

LOW_DTYPES = (torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def clean_amp():
    """amp is global state: every test starts and ends with no amp and the default switches."""
    amp.deinitialize()
    registry = list(_cast_engine.USER_CAST_REGISTRY)
    # These models are tiny: one intra-op thread avoids oversubscribing CI's 2 cores (pytest -n 2),
    # which made CPU batch norm 30x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    amp.deinitialize()
    _cast_engine.USER_CAST_REGISTRY[:] = registry
    _amp_state.hard_override = False
    _amp_state.allow_incoming_model_not_fp32 = False
    _amp_state.verbosity = 1
    for dt in ("cpu", "cuda"):
        assert not torch.is_autocast_enabled(dt), "a test left autocast enabled"


class MLP(nn.Module):
    """Small regression / classification net with a batch norm (O2 keeps it fp32)."""

    def __init__(self, d_in: int = 12, d_hidden: int = 32, d_out: int = 5, bn: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.bn = nn.BatchNorm1d(d_hidden) if bn else nn.Identity()
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.fc1(x)))
        h = torch.tanh(self.fc2(h)) + h
        return self.head(h)


def make_data(n: int = 64, d_in: int = 12, d_out: int = 5, seed: int = 1, device: str = "cpu"):
    """A fixed regression problem ``y = tanh(x W) + noise``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / d_in**0.5
    y = torch.tanh(x @ w) + 0.01 * torch.randn(n, d_out, generator=g)
    return x.to(device), y.to(device)


def fresh(seed: int = 0, opt_cls=torch.optim.Adam, lr: float = 1e-2, device: str = "cpu", **kw):
    """A model and optimizer with deterministic initial weights."""
    torch.manual_seed(seed)
    model = MLP(**kw).to(device)
    return model, opt_cls(model.parameters(), lr=lr)
