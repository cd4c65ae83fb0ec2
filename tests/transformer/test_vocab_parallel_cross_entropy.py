"""``vocab_parallel_cross_entropy`` on 2 gloo ranks against PyTorch's dense cross-entropy in float64.

Apex's smoothing gives the target ``1 - alpha`` and every other class ``alpha / (K - 1)``, which is
``F.cross_entropy(label_smoothing=alpha * K / (K - 1))``; that is the oracle. Every rank builds the same
full ``(s, b, K)`` logits and keeps its vocab columns; loss and the logits-shard gradient must match, on
both CPU paths of culmen's cross-entropy op (reference and the Triton interpreter), fp32 and bf16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from culmen.transformer import parallel_state as ps
from culmen.transformer import tensor_parallel as tpl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402


def _dense(logits, target, alpha):
    k = logits.shape[-1]
    smoothing = alpha * k / (k - 1) if alpha > 0 else 0.0
    logits = logits.clone().requires_grad_()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, k), target.reshape(-1), reduction="none",
                                             label_smoothing=smoothing).view(target.shape)
    return loss, logits


def _ce_worker(rank: int, world: int) -> list[str]:
    import torch

    from culmen.ops.backend import set_backend
    from culmen.testing.tolerance import assert_close_tolerance
    from culmen.transformer import parallel_state as ps
    from culmen.transformer import tensor_parallel as tpl

    ps.initialize_model_parallel(world)
    failures: list[str] = []
    s, b, v_local = 5, 3, 13
    k = v_local * world
    cols = slice(rank * v_local, (rank + 1) * v_local)

    def close(name, got, hi, lo):
        try:
            assert_close_tolerance(got, hi, lo, name=f"rank {rank} {name}")
        except AssertionError as e:
            failures.append(str(e))

    cases = [("reference", torch.float32, 0.0), ("reference", torch.float32, 0.1),
             ("reference", torch.bfloat16, 0.05), ("triton", torch.float32, 0.1)]
    for backend, dtype, alpha in cases:
        set_backend(backend)
        tag = f"{backend} {dtype} alpha={alpha}"
        torch.manual_seed(17)
        full = (torch.randn(s, b, k) * 3).to(dtype)
        target = torch.randint(0, k, (s, b))
        target[0, 0], target[0, 1] = 0, k - 1  # both ends of the vocabulary
        dy = torch.rand(s, b) + 0.5
        ref, ref_in = _dense(full.double(), target, alpha)
        ref.backward(dy.double())
        lo, lo_in = _dense(full, target, alpha)
        lo.backward(dy.to(dtype))

        shard = full[..., cols].clone().requires_grad_()
        loss = tpl.vocab_parallel_cross_entropy(shard, target, alpha)
        if loss.dtype != dtype or loss.shape != target.shape:
            failures.append(f"rank {rank} {tag}: loss {loss.dtype} {tuple(loss.shape)}")
        loss.backward(dy.to(dtype))
        close(f"{tag} loss", loss, ref.detach(), lo.detach())
        close(f"{tag} dlogits", shard.grad, ref_in.grad[..., cols], lo_in.grad[..., cols])
    set_backend("reference")

    for bad in (1.0, -0.1):
        try:
            tpl.vocab_parallel_cross_entropy(torch.zeros(2, v_local), torch.zeros(2, dtype=torch.long), bad)
            failures.append(f"rank {rank}: label_smoothing={bad} did not raise")
        except ValueError as e:
            if "label_smoothing" not in str(e):
                failures.append(f"rank {rank}: unclear error {e}")
    return failures


def test_vocab_parallel_cross_entropy_matches_dense():
    results = run_group(_ce_worker, 2, timeout=180)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)


def test_single_rank_matches_dense_and_checks_shapes():
    ps.set_tensor_model_parallel_world_size(1)
    ps.set_tensor_model_parallel_rank(0)
    try:
        logits = torch.randn(4, 3, 9, dtype=torch.float64)
        target = torch.randint(0, 9, (4, 3))
        for alpha in (0.0, 0.2):
            x = logits.clone().requires_grad_()
            loss = tpl.vocab_parallel_cross_entropy(x, target, label_smoothing=alpha)
            loss.sum().backward()
            ref, ref_in = _dense(logits, target, alpha)
            ref.sum().backward()
            torch.testing.assert_close(loss, ref.detach())
            torch.testing.assert_close(x.grad, ref_in.grad)
        with pytest.raises(ValueError, match="target shape"):
            tpl.vocab_parallel_cross_entropy(logits, target[:, :2])
    finally:
        ps.set_tensor_model_parallel_world_size(None)
        ps.set_tensor_model_parallel_rank(None)
