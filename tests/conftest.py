"""Test-session set-up: on a machine without a GPU, Triton kernels run under the CPU interpreter.

``TRITON_INTERPRET`` must be set before triton is imported, so this runs before any culmen import.
GPU-marked tests are skipped where no GPU exists (CI); ``scripts/gpu-check`` runs them on the GPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU (run scripts/gpu-check on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield


@pytest.fixture
def triton_backend(monkeypatch):
    """Run culmen ops through their Triton kernels (the interpreter on CPU)."""
    monkeypatch.setenv("CULMEN_BACKEND", "triton")
    yield


@pytest.fixture
def reference_backend(monkeypatch):
    """Force the pure-PyTorch reference path."""
    monkeypatch.setenv("CULMEN_BACKEND", "reference")
    yield


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_GPU else "cpu")
