"""``broadcast_data`` on 4 gloo ranks with TP=2: each TP group receives its own TP rank 0's batch.

The sources (global ranks 0 and 2) hold different batches (seeded by global rank) with keys of
different ranks, a 0-d tensor and an empty one; the other ranks pass ``None``. A wrong dtype on the
source raises ``TypeError`` on every rank of that group (nobody waits for data that never comes).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402


def _batch(src_global_rank):
    import torch

    g = torch.Generator().manual_seed(100 + src_global_rank)
    return {
        "text": torch.randint(0, 1000, (3, 7), generator=g),
        "mask": torch.randint(0, 2, (2, 3, 4, 1, 2), generator=g),
        "scalar": torch.tensor(5 + src_global_rank),
        "empty": torch.zeros(0, 4, dtype=torch.long),
        "unused": torch.zeros(2),  # not in keys: never sent
    }


def _data_worker(rank: int, world: int) -> list[str]:
    import torch

    from culmen.transformer import parallel_state as ps
    from culmen.transformer import tensor_parallel as tpl

    ps.initialize_model_parallel(2)
    failures: list[str] = []
    keys = ["text", "mask", "scalar", "empty"]
    src = ps.get_tensor_model_parallel_src_rank()
    mine = _batch(rank) if ps.get_tensor_model_parallel_rank() == 0 else None
    out = tpl.broadcast_data(keys, mine, torch.int64)
    want = _batch(src)
    if sorted(out) != sorted(keys):
        failures.append(f"rank {rank}: keys {sorted(out)}")
    for key in keys:
        got = out.get(key)
        if got is None or got.dtype != torch.int64 or got.shape != want[key].shape or not torch.equal(got, want[key]):
            failures.append(f"rank {rank} {key}: got {None if got is None else (got.dtype, tuple(got.shape))}")

    bad = {"text": torch.zeros(2, 2, dtype=torch.int32)} if ps.get_tensor_model_parallel_rank() == 0 else None
    try:
        tpl.broadcast_data(["text"], bad, torch.int64)
        failures.append(f"rank {rank}: a wrong dtype did not raise")
    except TypeError as e:
        if "'text'" not in str(e) or "int64" not in str(e):
            failures.append(f"rank {rank}: unclear dtype error {e}")
    # The group is still usable after the error.
    again = tpl.broadcast_data(["scalar"], mine, torch.int64)
    if not torch.equal(again["scalar"], want["scalar"]):
        failures.append(f"rank {rank}: broadcast after an error failed")
    return failures


def test_broadcast_data_within_tensor_parallel_groups():
    results = run_group(_data_worker, 4, timeout=180)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)
