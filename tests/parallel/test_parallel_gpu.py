"""culmen.parallel on two GPUs with NCCL (GPU-marked; skipped with fewer than two GPUs).

The same checks as the gloo tests, on CUDA tensors and the Triton kernels: DDP gradients against the
float64 single-process gradients over option cases and dtypes, the exact race test, and SyncBatchNorm
against BatchNorm on the concatenated batch (uneven batches, channels_last, fuse_relu).

A rank leaving early with NCCL: the survivor's pending collectives sit on the GPU. With
``TORCH_NCCL_BLOCKING_WAIT=1`` (the documented option, see ``culmen.parallel.distributed``) the
survivor's ``backward()`` waits for its reductions with the process-group timeout and raises; the test
asserts the survivor fails (a Python error, or its process ends with an error) within the timeout plus
a margin, and never hangs. (Without the option, torch 2.11's watchdog was seen to leave it blocked.)
"""

from __future__ import annotations

import time

import pytest
import torch
from dist_harness import RankError, run_group
from test_ddp import CASES_2, _check_group, _ddp_cases_worker, _race_worker
from test_parallel_faults import _early_exit_worker
from test_syncbn import _syncbn_worker

BF16, F16 = torch.bfloat16, torch.float16

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def test_nccl_ddp_option_cases():
    cases = [dict(c, device="cuda") for c in CASES_2]
    _check_group(run_group(_ddp_cases_worker, 2, cases, backend="nccl"), cases)


def test_nccl_ddp_race_exact():
    results = run_group(_race_worker, 2, 12, "cuda", backend="nccl")
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])


def test_nccl_syncbn():
    T = "triton"
    cases = [
        dict(name="nchw-uneven-bf16", backend=T, sizes=(16, 7), rest=(64, 14, 14), dtype=BF16),
        dict(name="fmt-uneven-relu-z", backend=T, sizes=(5, 12), rest=(96, 9, 11), layout="fmt", relu=True, z=True),
        dict(name="flag-f16", backend=T, sizes=(8, 8), rest=(7, 7, 160), dtype=F16, layout="flag"),
        dict(name="2d", backend=T, sizes=(33, 65), rest=(300,)),
        dict(name="5d-fmt-bf16", backend=T, sizes=(2, 3), rest=(32, 4, 6, 6), layout="fmt", dtype=BF16),
        dict(name="nchw-ref-path", backend="reference", sizes=(3, 4), rest=(8, 5, 5)),
    ]
    for c in cases:
        c["device"] = "cuda"
    results = run_group(_syncbn_worker, 2, cases, backend="nccl")
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:30])


def test_nccl_rank_leaving_early_fails_the_survivor():
    pg_timeout = 10.0
    t0 = time.monotonic()
    results = run_group(_early_exit_worker, 2, "return", backend="nccl", pg_timeout=pg_timeout,
                        timeout=pg_timeout + 60, expect_errors=True,
                        env={"TORCH_NCCL_BLOCKING_WAIT": "1"})
    took = time.monotonic() - t0
    assert results[1] == "left"
    survivor = results[0]
    failed = isinstance(survivor, RankError) or (isinstance(survivor, tuple) and survivor[0] == "error")
    assert failed, f"the survivor of a rank that left reported {survivor!r}"
    assert took < pg_timeout + 60
