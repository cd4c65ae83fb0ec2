"""apex.contrib.nccl_allocator: ``init``'s environment, the ``nccl_mem`` protocol (pool active inside, the
communicator's registration around it, errors propagate), clear errors where NCCL memory is unavailable,
and on 2 GPUs a real NCCL pool serving an all-reduce (GPU-marked)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

import culmen.contrib.nccl_allocator.nccl_allocator as na  # noqa: E402
from culmen.contrib.nccl_allocator import create_nccl_mem_pool, init, nccl_mem  # noqa: E402


def test_init_sets_nccl_environment(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "1")
    init()
    import os

    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
    assert os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] == "0"


def test_disabled_is_a_no_op():
    with nccl_mem(None, enabled=False) as ctx:
        t = torch.ones(5)
    assert ctx.group is None and ctx.device is None
    assert torch.equal(t, torch.ones(5))


class _FakePool:
    pass


class _FakeBackend:
    def __init__(self, log, fail_deregister):
        self.log, self.fail = log, fail_deregister

    def deregister_mem_pool(self, pool):
        self.log.append(("deregister", pool))
        if self.fail:
            raise RuntimeError("pool was never registered")

    def register_mem_pool(self, pool):
        self.log.append(("register", pool))


class _FakeGroup:
    def __init__(self, log, fail_deregister=False):
        self.log, self.fail = log, fail_deregister

    def _get_backend(self, device):
        self.log.append(("backend", str(device)))
        return _FakeBackend(self.log, self.fail)


@pytest.fixture
def fake_cuda_pool(monkeypatch):
    """Stand-ins for torch.cuda.MemPool / use_mem_pool that record what nccl_mem does, on any machine."""
    log = []

    @contextmanager
    def use_mem_pool(pool, device=None):
        log.append(("pool_on", pool, str(device)))
        try:
            yield
        finally:
            log.append(("pool_off", pool))

    monkeypatch.setattr(torch.cuda, "MemPool", _FakePool)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    return log


def test_nccl_mem_protocol(fake_cuda_pool):
    log = fake_cuda_pool
    pool = _FakePool()
    with nccl_mem(pool, device=1, group=_FakeGroup(log, fail_deregister=True)) as ctx:
        log.append("body")
    assert ctx.device == torch.device("cuda", 1)
    assert log == [("pool_on", pool, "cuda:1"), ("backend", "cuda:1"), ("deregister", pool), "body",
                   ("backend", "cuda:1"), ("register", pool), ("pool_off", pool)]
    # An error in the body still registers the pool and leaves it, then propagates.
    log.clear()
    with pytest.raises(KeyError):
        with nccl_mem(pool, device="cuda:0", group=_FakeGroup(log)):
            raise KeyError("boom")
    assert log[-2:] == [("register", pool), ("pool_off", pool)]


def test_nccl_mem_bad_arguments(fake_cuda_pool):
    with pytest.raises(ValueError, match="device"):
        nccl_mem(_FakePool(), device="cpu", group=_FakeGroup([]))
    with pytest.raises(TypeError, match="device"):
        nccl_mem(_FakePool(), device=1.0, group=_FakeGroup([]))
    with pytest.raises(TypeError, match="pool"):
        nccl_mem(object(), device=0, group=_FakeGroup([]))
    with pytest.raises(TypeError, match="symmetric"):
        create_nccl_mem_pool(symmetric="yes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_clear_error_without_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        create_nccl_mem_pool()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        na.get_nccl_allocator()


def test_clear_error_without_nccl_group(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="init_process_group"):
        create_nccl_mem_pool()


def _gloo_worker(rank, world):
    # A gloo group has no NCCL backend for CUDA: the error says so instead of failing inside torch.
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    try:
        create_nccl_mem_pool()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_clear_error_with_gloo_group():
    out = run_group(_gloo_worker, 2, timeout=60)
    assert all("NCCL" in msg for msg in out), out


def test_alias_import():
    code = textwrap.dedent("""
        import culmen.compat as compat
        compat.install()
        import apex.contrib.nccl_allocator as nccl_allocator
        from apex.contrib.nccl_allocator import init, nccl_mem, create_nccl_mem_pool
        import culmen.contrib.nccl_allocator.nccl_allocator as impl
        import culmen.contrib.nccl_allocator._apex_nccl_allocator as ext
        assert nccl_allocator.nccl_mem is impl.nccl_mem and create_nccl_mem_pool is impl.create_nccl_mem_pool
        assert ext.get_nccl_allocator is impl.get_nccl_allocator and init is impl.init
        print("OK")
    """)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert out.stdout.strip() == "OK", out.stderr


def _in_pool(pool, t):
    ptr = t.data_ptr()
    return any(s["address"] <= ptr < s["address"] + s["total_size"] for s in pool.snapshot())


def _nccl_worker(rank, world):
    import torch.distributed as dist

    failures = []
    pool = create_nccl_mem_pool()
    n = 1024 * 1024 * 2 + 37
    with nccl_mem(pool):
        a = torch.full((n,), float(rank + 1), device="cuda")
        b = torch.arange(n, device="cuda", dtype=torch.float32)
    outside = torch.ones(n, device="cuda")
    if not (_in_pool(pool, a) and _in_pool(pool, b)):
        failures.append("tensors allocated inside nccl_mem are not in the NCCL pool")
    if _in_pool(pool, outside):
        failures.append("a tensor allocated after nccl_mem came from the NCCL pool")
    dist.all_reduce(a)
    dist.all_reduce(b)
    if not torch.equal(a, torch.full_like(a, world * (world + 1) / 2)):
        failures.append("all_reduce on NCCL memory gave wrong sums")
    if not torch.equal(b, torch.arange(n, device="cuda", dtype=torch.float32) * world):
        failures.append("all_reduce of arange on NCCL memory is wrong")
    # Entering again (pool registered) and the default pool form work too.
    with nccl_mem(pool):
        c = torch.ones(4096, device="cuda")
    with nccl_mem():
        d = torch.ones(4096, device="cuda")
    dist.all_reduce(c)
    dist.all_reduce(d)
    if c.sum().item() != 4096 * world or d.sum().item() != 4096 * world:
        failures.append("second pool use failed")
    try:
        create_nccl_mem_pool(symmetric=True)
    except ValueError as e:
        if "symmetric" not in str(e):
            failures.append(f"symmetric error text: {e}")
    torch.cuda.synchronize()
    return failures


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_pool_two_gpus():
    results = run_group(_nccl_worker, 2, backend="nccl", timeout=180,
                        env={"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "0"})
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
