"""Unittest bases that run every test method on ``world_size`` spawned ranks of a process group.

Each test method of a subclass runs in ``world_size`` processes started with the ``spawn`` method
(torch's ``MultiProcessTestCase``); every process joins a process group of ``DISTRIBUTED_BACKEND`` through
a shared file, sets ``self.rank`` and ``self.world_size``, meets the others at a barrier, runs the method
and meets them again. A rank that raises fails the test and the parent stops the other ranks at once; a
rank that dies without raising makes its peers' next collective fail after ``PG_TIMEOUT`` seconds, so no
test hangs.

- :class:`NcclDistributedTestBase`: NCCL, ``min(torch.cuda.device_count(), 4)`` ranks, one GPU each.
  Skipped without a GPU (Apex failed instead).
- :class:`UccDistributedTestBase`: UCC over TCP (``MASTER_ADDR``/``MASTER_PORT``, ``UCX_TLS=tcp,cuda``
  unless set); skipped unless torch has UCC and a GPU is present.
- :class:`DistributedTestBase`: the common base. A culmen extension: used directly it runs on gloo with 2
  CPU ranks (Apex's base had no backend of its own), which is how culmen's CPU tests use it.

Override ``world_size`` (a property) for another number of ranks.
"""

from __future__ import annotations

import datetime
import os
import sys
import unittest

import torch
from torch import distributed as dist

try:
    from torch.testing._internal import common_distributed, common_utils
except ModuleNotFoundError as exc:  # torch's test helpers import the 'expecttest' package
    raise ModuleNotFoundError(
        f"culmen.distributed_testing (like Apex's) builds on PyTorch's multi-process test helpers, which need "
        f"the {exc.name!r} package: pip install {exc.name}", name=exc.name) from exc

__all__ = ["DistributedTestBase", "NcclDistributedTestBase", "UccDistributedTestBase", "HAS_UCC"]

HAS_UCC: bool = bool(dist.is_available() and getattr(dist, "is_ucc_available", lambda: False)())


class DistributedTestBase(common_distributed.MultiProcessTestCase):
    """Run each test method on ``world_size`` spawned ranks of a ``DISTRIBUTED_BACKEND`` process group.

    Inside a test: ``self.rank`` (this process's global rank), ``self.world_size``,
    ``self.DISTRIBUTED_BACKEND``; the default process group is initialized. For GPU backends the current
    CUDA device is ``rank % device_count``.
    """

    DISTRIBUTED_BACKEND: str = "gloo"
    #: seconds a collective waits for a missing peer before failing.
    PG_TIMEOUT: float = 60.0

    def setUp(self) -> None:
        super().setUp()
        self._setup_pre_spawn()
        self._spawn_processes()

    def tearDown(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        super().tearDown()

    @property
    def world_size(self) -> int:
        if self.DISTRIBUTED_BACKEND in ("nccl", "ucc"):
            return min(torch.cuda.device_count(), 4)
        return 2

    @property
    def init_method(self) -> str:
        return f"{common_utils.FILE_SCHEMA}{self.file_name}"

    @property
    def destroy_pg_upon_exit(self) -> bool:
        # _run destroys the group itself, after the closing barrier.
        return False

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe, **kwargs) -> None:
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        uses_gpu = self.DISTRIBUTED_BACKEND in ("nccl", "ucc")
        if uses_gpu and not torch.cuda.is_available():
            raise RuntimeError(f"{cls.__name__}: backend {self.DISTRIBUTED_BACKEND!r} needs a CUDA device")
        try:
            dist.init_process_group(init_method=self.init_method, backend=self.DISTRIBUTED_BACKEND,
                                    world_size=int(self.world_size), rank=self.rank,
                                    timeout=datetime.timedelta(seconds=self.PG_TIMEOUT))
        except RuntimeError as e:
            if e.args and "recompile" in str(e.args[0]):  # backend not built into this torch
                print(f"Backend {self.DISTRIBUTED_BACKEND} not available", file=sys.stderr)
                sys.exit(0)
            raise
        if uses_gpu:
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
        dist.barrier()
        self.run_test(test_name, pipe)
        dist.barrier()
        dist.destroy_process_group()
        sys.exit(0)

    def _setup_pre_spawn(self) -> None:
        """Hook run in the parent before the ranks are spawned (environment set-up)."""


@unittest.skipUnless(torch.cuda.is_available(), "NcclDistributedTestBase needs a CUDA device")
class NcclDistributedTestBase(DistributedTestBase):
    """:class:`DistributedTestBase` on NCCL, one GPU per rank (up to 4 ranks)."""

    DISTRIBUTED_BACKEND = "nccl"


@unittest.skipUnless(HAS_UCC, "needs a torch build with UCC enabled")
@unittest.skipUnless(torch.cuda.is_available(), "UccDistributedTestBase needs a CUDA device")
class UccDistributedTestBase(DistributedTestBase):
    """:class:`DistributedTestBase` on UCC over TCP (``tcp://localhost:$MASTER_PORT``)."""

    DISTRIBUTED_BACKEND = "ucc"

    def _setup_pre_spawn(self) -> None:
        self.master_addr = "localhost"
        os.environ["MASTER_ADDR"] = "localhost"
        self._has_master_port = "MASTER_PORT" in os.environ
        if self._has_master_port:
            self.master_port = os.environ["MASTER_PORT"]
        else:
            self.master_port = str(common_utils.find_free_port())
            os.environ["MASTER_PORT"] = self.master_port
        self._has_ucx_tls = "UCX_TLS" in os.environ
        if not self._has_ucx_tls:
            os.environ["UCX_TLS"] = "tcp,cuda"

    def tearDown(self) -> None:
        super().tearDown()
        if not self._has_master_port:
            os.environ.pop("MASTER_PORT", None)
        if not self._has_ucx_tls:
            os.environ.pop("UCX_TLS", None)

    @property
    def init_method(self) -> str:
        return "tcp://localhost:" + os.environ["MASTER_PORT"]
