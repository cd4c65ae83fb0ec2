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


@pytest.fixture(autouse=True)
def _restore_backend():
    """Tests may call ``culmen.ops.backend.set_backend``; every test starts from the session's backend."""
    from culmen.ops import backend

    mode = backend._MODE
    yield
    if backend._MODE != mode:
        backend._MODE = mode
        backend._plans_changed()


@pytest.fixture
def triton_backend():
    """Run culmen ops through their Triton kernels (the interpreter on CPU)."""
    from culmen.ops.backend import use_backend

    with use_backend("triton"):
        yield


@pytest.fixture
def reference_backend():
    """Force the pure-PyTorch reference path."""
    from culmen.ops.backend import use_backend

    with use_backend("reference"):
        yield


@pytest.fixture(params=[True, False], ids=["fusion", "kernels"])
def compile_fusion(request):
    """Both ``torch.compile`` forms of the fusable ops: their PyTorch formulas (``True``, the default) and the
    ``triton_op``s (``culmen.set_compile_fusion(False)``)."""
    from culmen.ops import backend

    prev = backend.compile_fusion_enabled()
    backend.set_compile_fusion(request.param)
    torch._dynamo.reset()
    yield request.param
    backend.set_compile_fusion(prev)
    torch._dynamo.reset()


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_GPU else "cpu")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A GPU test that leaves a sticky CUDA error (illegal instruction, device-side assert) poisons the process's
    context, so every later test on this worker would fail at set-up. Surface it on the test that caused it and
    end the worker; pytest-xdist reports the crash against this test and starts a fresh worker."""
    yield
    if HAS_GPU and "gpu" in item.keywords:
        try:
            torch.cuda.synchronize()
            # a capture that failed half-way can leave the CUDA generator in capture mode
            torch.empty(1, device="cuda").normal_()
        except Exception as exc:  # torch.AcceleratorError on sticky errors
            import sys

            sys.stderr.write(f"\n{item.nodeid} left the CUDA context broken: {exc}\n")
            sys.stderr.flush()
            os._exit(3)
