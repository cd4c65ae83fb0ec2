"""``culmen.transformer.pipeline_parallel.p2p_communication`` on 2 spawned gloo ranks (2 pipeline stages).

Every send/receive pair must deliver the sender's values (distinct per rank and per direction, so a
swapped or misrouted message shows) into a fresh leaf of ``tensor_shape`` / ``dtype`` that requires
grad; the first/last-stage short cuts return ``None``; the asynchronous (``FutureTensor``), unbatched and
overlapped (request handles) forms agree with the plain one; with 2 stages each rank is both the other's
previous and next stage, so an activation and a gradient travel between the same ranks in one exchange.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

SHAPE = (3, 2, 5)


def _val(rank: int, what: str, dtype=torch.float32) -> torch.Tensor:
    # Distinct payloads per (sender, kind) with non-integer values along every axis.
    base = {"act": 1.0, "grad": -2.0}[what] + 10.0 * rank
    return (base + torch.arange(30, dtype=torch.float64).reshape(SHAPE) / 7.0).to(dtype)


def worker(rank, world):
    from culmen.transformer import parallel_state as ps
    from culmen.transformer.pipeline_parallel import p2p_communication as p2p

    ps.initialize_model_parallel(1, 2)
    other = 1 - rank
    failures: list[str] = []

    def check(name, got, want, dtype=torch.float32):
        if isinstance(got, p2p.FutureTensor):
            got = got.get()
        if want is None:
            if got is not None:
                failures.append(f"{name}: expected None, got {type(got).__name__}")
            return
        if not isinstance(got, torch.Tensor):
            failures.append(f"{name}: expected a tensor, got {got!r}")
            return
        if tuple(got.shape) != SHAPE or got.dtype != dtype or not got.requires_grad or not got.is_leaf:
            failures.append(f"{name}: shape {tuple(got.shape)} dtype {got.dtype} requires_grad {got.requires_grad} "
                            f"leaf {got.is_leaf}")
        elif not torch.equal(got.detach(), want):
            failures.append(f"{name}: wrong values (first {got.flatten()[0].item()} vs {want.flatten()[0].item()})")

    def case(name, fn):
        try:
            fn()
        except Exception:
            failures.append(f"{name}: {traceback.format_exc()}")

    first = rank == 0

    def one_way():
        # Stage 0 -> stage 1 activation; stage 1 -> stage 0 gradient; the other side returns None.
        for kwargs in ({}, {"async_comm": True}, {"batch_p2p_comm": False}):
            if first:
                p2p.send_forward(_val(rank, "act"), tensor_shape=SHAPE, **kwargs)
                check(f"recv_backward {kwargs}", p2p.recv_backward(SHAPE, **kwargs), _val(other, "grad"))
                check("recv_forward on the first stage", p2p.recv_forward(SHAPE, **kwargs), None)
            else:
                check(f"recv_forward {kwargs}", p2p.recv_forward(SHAPE, **kwargs), _val(other, "act"))
                p2p.send_backward(_val(rank, "grad"), SHAPE, **kwargs)
                check("recv_backward on the last stage", p2p.recv_backward(SHAPE, **kwargs), None)
                p2p.send_forward(_val(rank, "act"), tensor_shape=SHAPE)  # last stage: no-op

    def combined():
        for kwargs in ({}, {"async_comm": True}, {"batch_p2p_comm": False}, {"dtype": torch.float64}):
            dt = kwargs.get("dtype", torch.float32)
            if first:
                got = p2p.send_forward_recv_backward(_val(rank, "act", dt), SHAPE, **kwargs)
                check(f"send_forward_recv_backward {kwargs}", got, _val(other, "grad", dt), dt)
                check("send_backward_recv_forward on the first stage",
                      p2p.send_backward_recv_forward(_val(rank, "grad", dt), SHAPE, **kwargs), None)
            else:
                got = p2p.send_backward_recv_forward(_val(rank, "grad", dt), SHAPE, **kwargs)
                check(f"send_backward_recv_forward {kwargs}", got, _val(other, "act", dt), dt)
                check("send_forward_recv_backward on the last stage",
                      p2p.send_forward_recv_backward(_val(rank, "act", dt), SHAPE, **kwargs), None)

    def ring():
        # Both ranks send forward to their next (= the other) and receive from their previous (= the other).
        for kwargs in ({}, {"async_comm": True}, {"batch_p2p_comm": False}):
            got = p2p.send_forward_recv_forward(_val(rank, "act"), recv_prev=True, tensor_shape=SHAPE, **kwargs)
            check(f"send_forward_recv_forward {kwargs}", got, _val(other, "act"))
            got = p2p.send_backward_recv_backward(_val(rank, "grad"), recv_next=True, tensor_shape=SHAPE, **kwargs)
            check(f"send_backward_recv_backward {kwargs}", got, _val(other, "grad"))
        # One side only sends; the receiver gets, the sender's receive slot is None.
        got = p2p.send_forward_recv_forward(_val(rank, "act") if first else None, recv_prev=not first,
                                            tensor_shape=SHAPE)
        check("send_forward_recv_forward one-sided", got, None if first else _val(other, "act"))

    def both_directions():
        # An activation and a gradient between the same two ranks in one exchange, each way.
        for kwargs in ({}, {"async_comm": True}, {"batch_p2p_comm": False}, {"dtype": torch.bfloat16}):
            dt = kwargs.get("dtype", torch.float32)
            inp, grad = p2p.send_forward_backward_recv_forward_backward(
                _val(rank, "act", dt), _val(rank, "grad", dt), recv_prev=True, recv_next=True,
                tensor_shape=SHAPE, **kwargs)
            check(f"both directions: activation {kwargs}", inp, _val(other, "act", dt), dt)
            check(f"both directions: gradient {kwargs}", grad, _val(other, "grad", dt), dt)

    def overlapped():
        inp, handles = p2p.send_forward_recv_forward(_val(rank, "act"), recv_prev=True, tensor_shape=SHAPE,
                                                     overlap_p2p_comm=True)
        grad, handles2 = p2p.send_backward_recv_backward(_val(rank, "grad"), recv_next=True, tensor_shape=SHAPE,
                                                         overlap_p2p_comm=True)
        if not handles or not handles2:
            failures.append(f"overlap_p2p_comm returned no handles: {handles!r} {handles2!r}")
        for h in handles + handles2:
            h.wait()
        check("overlapped activation", inp, _val(other, "act"))
        check("overlapped gradient", grad, _val(other, "grad"))
        inp, grad, handles = p2p.send_forward_backward_recv_forward_backward(
            _val(rank, "act"), _val(rank, "grad"), recv_prev=True, recv_next=True, tensor_shape=SHAPE,
            overlap_p2p_comm=True)
        for h in handles:
            h.wait()
        check("overlapped both: activation", inp, _val(other, "act"))
        check("overlapped both: gradient", grad, _val(other, "grad"))

    def future_tensor():
        # The async receive is a FutureTensor whose first get() waits; later gets return the same tensor.
        if first:
            p2p.send_forward(_val(rank, "act"), tensor_shape=SHAPE, async_comm=True)
        else:
            fut = p2p.recv_forward(SHAPE, async_comm=True)
            if not isinstance(fut, p2p.FutureTensor):
                failures.append(f"async recv_forward returned {type(fut).__name__}")
                return
            a = fut.get()
            if fut.get() is not a:
                failures.append("FutureTensor.get() returned a different tensor the second time")
            check("FutureTensor", a, _val(other, "act"))

    def bad_arguments():
        from culmen.transformer.pipeline_parallel.p2p_communication import _communicate

        for call, exc, words in (
            (lambda: _communicate(None, None, True, False, None), RuntimeError, "tensor_shape"),
            (lambda: _communicate(torch.zeros(4), None, False, False, SHAPE), ValueError, "tensor_shape"),
        ):
            try:
                call()
                failures.append(f"no {exc.__name__} for a bad call ({words})")
            except exc as e:
                if words not in str(e):
                    failures.append(f"error does not name {words}: {e}")

    for name, fn in (("one_way", one_way), ("combined", combined), ("ring", ring),
                     ("both_directions", both_directions), ("overlapped", overlapped),
                     ("future_tensor", future_tensor), ("bad_arguments", bad_arguments)):
        case(name, fn)
    torch.distributed.barrier()
    return failures


def test_p2p_2_stages():
    results = run_group(worker, 2, timeout=90)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)


def test_future_tensor_without_wait():
    from culmen.transformer.pipeline_parallel.p2p_communication import FutureTensor

    t = torch.randn(3)
    assert FutureTensor(t, None).get() is t
    replaced = torch.randn(3)
    calls = []
    fut = FutureTensor(t, lambda: calls.append(1) or replaced)
    assert fut.get() is replaced and fut.get() is replaced and calls == [1]


@pytest.mark.gpu
def test_p2p_nccl_2_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = run_group(_gpu_worker, 2, backend="nccl", timeout=120)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)


def _gpu_worker(rank, world):
    from culmen.transformer import parallel_state as ps
    from culmen.transformer.pipeline_parallel import p2p_communication as p2p

    ps.initialize_model_parallel(1, 2)
    other = 1 - rank
    failures = []
    dev = torch.device("cuda", rank)
    for kwargs in ({}, {"async_comm": True}, {"batch_p2p_comm": False}):
        inp, grad = p2p.send_forward_backward_recv_forward_backward(
            _val(rank, "act").to(dev), _val(rank, "grad").to(dev), recv_prev=True, recv_next=True,
            tensor_shape=SHAPE, **kwargs)
        inp = inp.get() if isinstance(inp, p2p.FutureTensor) else inp
        grad = grad.get() if isinstance(grad, p2p.FutureTensor) else grad
        if inp.device != dev or not torch.equal(inp.detach().cpu(), _val(other, "act")):
            failures.append(f"nccl activation wrong {kwargs}")
        if not torch.equal(grad.detach().cpu(), _val(other, "grad")):
            failures.append(f"nccl gradient wrong {kwargs}")
    return failures
