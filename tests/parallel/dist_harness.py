"""Run a function on every rank of a freshly spawned gloo group and collect what each returns.

Spawning processes is the slow part of a distributed test (each imports torch), so tests batch many
checks into one group: the worker returns a list of failures (or values), the test asserts on them.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


class RankError(Exception):
    """A worker raised: ``rank``, the exception's type name, its message and the formatted traceback."""

    def __init__(self, rank: int, kind: str, message: str, tb: str):
        super().__init__(f"rank {rank}: {kind}: {message}\n{tb}")
        self.rank, self.kind, self.message, self.tb = rank, kind, message, tb


def _child(fn, rank, world, init_file, backend, pg_timeout, env, args, q):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        out = fn(rank, world, *args)
        # As bytes, not as tensors: torch's queue pickling shares tensor storage through a file descriptor
        # that the parent must fetch from this process while it is alive, and a worker that exits first
        # makes the parent's get() fail (seen in CI: FileNotFoundError in resource_sharer).
        buf = io.BytesIO()
        torch.save(out, buf)
        q.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # reported to the parent
        q.put((rank, "err", (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _load(payload: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)


def run_group(fn: Callable, world: int, *args: Any, backend: str = "gloo", timeout: float = 120.0,
              pg_timeout: float = 30.0, env: dict[str, str] | None = None, expect_errors: bool = False) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; return the per-rank results.

    ``fn`` must be importable (a module-level function). When a rank raises, ``RankError`` is raised
    here (the first failing rank), unless ``expect_errors``: then a ``RankError`` stands in that rank's
    slot of the returned list. A rank that returns nothing within ``timeout`` seconds fails the test.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        procs = [ctx.Process(target=_child, args=(fn, r, world, init_file, backend, pg_timeout, child_env, args, q),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        results: list = [None] * world
        dead_since: dict[int, float] = {}
        got = 0
        deadline = time.monotonic() + timeout
        try:
            while got < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{world - got} rank(s) returned nothing within {timeout}s")
                try:
                    rank, status, payload = q.get(timeout=min(left, 0.5))
                except queue.Empty:
                    # A process that died without reporting (os._exit, a crash): note it once the queue
                    # has had time to deliver anything it sent.
                    for r, p in enumerate(procs):
                        if results[r] is None and not p.is_alive() and p.exitcode is not None:
                            dead_since.setdefault(r, time.monotonic())
                            if time.monotonic() - dead_since[r] > 2.0:
                                results[r] = RankError(r, "Exited", f"exit code {p.exitcode}", "")
                                got += 1
                    continue
                if results[rank] is not None:
                    continue
                results[rank] = _load(payload) if status == "ok" else RankError(rank, *payload)
                got += 1
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    if not expect_errors:
        errors = [r for r in results if isinstance(r, RankError)]
        if errors:
            # Every rank's error: the first one to fail is often not the cause (its peers' exit is).
            raise RankError(errors[0].rank, errors[0].kind, errors[0].message,
                            "\n".join(f"--- rank {e.rank}: {e.kind}: {e.message}\n{e.tb}" for e in errors))
    return results
