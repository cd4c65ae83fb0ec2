"""Pipeline schedules (``culmen.transformer.pipeline_parallel``) on spawned gloo ranks.

The model is a stack of ``tanh(Linear)`` layers split into (virtual) stages. Every rank also builds the
whole stack and runs the same microbatches in one process (float64), so each schedule must give the
same per-microbatch losses on the last stage and the same gradient of every parameter on every stage:
no pipelining (2 data-parallel ranks through ``build_model``'s DDP), 1F1B on 2 and 4 stages,
interleaved 1F1B with 2 virtual stages on 2 and 4 stages; forward-only mode, deallocated outputs,
asynchronous / unbatched / overlapped communication, a float32 run judged by the tolerance rule, the
gradient-sync hooks, and the divisibility error. Each spawned group runs many cases and returns the
failures.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from culmen.testing.tolerance import assert_close_tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_harness import run_group  # noqa: E402

F64, F32 = torch.float64, torch.float32
SEQ, MB, HID = 3, 2, 5  # activations are (SEQ, MB, HID); odd sizes so a transposed/reshaped message shows


class Stage(nn.Module):
    """Layers ``[first, first + n)`` of the stack; the first stage reads ``x`` (mb, seq, hid) from the batch."""

    def __init__(self, first: int, n: int, pre_process: bool, post_process: bool, dtype):
        super().__init__()
        self.first, self.pre_process, self.post_process = first, pre_process, post_process
        self.layers = nn.ModuleList(nn.Linear(HID, HID, dtype=dtype) for _ in range(n))
        self.input_tensor = None

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0]

    def forward(self, x):
        h = x.transpose(0, 1) if self.pre_process else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def full_stack(num_layers: int, dtype):
    g = torch.Generator().manual_seed(1234)
    layers = nn.ModuleList(nn.Linear(HID, HID, dtype=F64) for _ in range(num_layers))
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.randn(HID, HID, generator=g, dtype=F64) * 0.6)
            layer.bias.copy_(torch.randn(HID, generator=g, dtype=F64) * 0.3)
    return layers.to(dtype)


def make_batch(m: int, seed: int, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m * MB, SEQ, HID, generator=g, dtype=F64)
    y = torch.randn(m * MB, SEQ, HID, generator=g, dtype=F64)
    return [x.to(dtype), y.to(dtype)]


def loss_of(out, y):
    return ((out - y.transpose(0, 1)) ** 2).mean()


OUTPUTS: list = []  # every stage output of the current case (to check deallocation)


def forward_step_func(batch, model):
    x, y = batch
    out = model(x)
    OUTPUTS.append(out)

    def loss_func(o):
        loss = loss_of(o, y)
        return loss, {"loss": loss.detach()}

    return out, loss_func


def reference(num_layers, batches, dtype):
    """Losses and layer gradients of the whole stack in one process; gradients averaged over ``batches``
    (one per data-parallel rank), each the gradient of the mean microbatch loss."""
    layers = full_stack(num_layers, dtype)
    losses = []
    for batch in batches:
        x, y = batch
        m = x.shape[0] // MB
        for k in range(m):
            h = x[k * MB:(k + 1) * MB].transpose(0, 1)
            for layer in layers:
                h = torch.tanh(layer(h))
            loss = loss_of(h, y[k * MB:(k + 1) * MB])
            (loss / (m * len(batches))).backward()
            losses.append(loss.detach())
    return losses, [(layer.weight.grad, layer.bias.grad) for layer in layers]


def set_microbatches(m: int, dp: int):
    from culmen.transformer.pipeline_parallel import utils

    utils._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
    utils.setup_microbatch_calculator(0, None, m * MB * dp, MB, dp)


def run_case(rank, *, pp, vpp=None, m=4, dtype=F64, forward_only=False, wrap_with_ddp=False, **sched_kwargs):
    """Initialize pp x dp, build the chunks, run the schedule; return (failures, extra info)."""
    from culmen.transformer import parallel_state as ps
    from culmen.transformer.pipeline_parallel import build_model, get_forward_backward_func

    failures = []
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, pp, vpp)
    dp = ps.get_data_parallel_world_size()
    set_microbatches(m, dp)
    chunks_per_stage = vpp or 1
    n_virtual = pp * chunks_per_stage
    per_stage = 2
    num_layers = n_virtual * per_stage
    full = full_stack(num_layers, dtype)
    stage_rank = ps.get_pipeline_model_parallel_rank()

    def provider(pre_process, post_process):
        c = ps.get_virtual_pipeline_model_parallel_rank() or 0
        first = (c * pp + stage_rank) * per_stage
        stage = Stage(first, per_stage, pre_process, post_process, dtype)
        with torch.no_grad():
            for i, layer in enumerate(stage.layers):
                layer.weight.copy_(full[first + i].weight)
                layer.bias.copy_(full[first + i].bias)
        return stage

    with contextlib.redirect_stdout(None):
        model = build_model(provider, wrap_with_ddp, vpp)
    if vpp is None:
        ps.set_virtual_pipeline_model_parallel_rank(None)
    fn = get_forward_backward_func(vpp, pp)
    dp_rank = ps.get_data_parallel_rank()
    device = next(model[0].parameters()).device
    batches = [make_batch(m, 100 + r, dtype) for r in range(dp)]
    OUTPUTS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = fn(forward_step_func, [t.to(device) for t in batches[dp_rank]], model if vpp else model[0],
                    forward_only=forward_only, tensor_shape=(SEQ, MB, HID), dtype=dtype, **sched_kwargs)

    # With DDP the gradients are averaged over the data-parallel ranks' batches; without, each rank's own.
    used = batches if wrap_with_ddp else [batches[dp_rank]]
    first_loss = dp_rank * m if wrap_with_ddp else 0
    ref_hi_losses, ref_hi_grads = reference(num_layers, [[t.to(F64) for t in b] for b in used], F64)
    ref_lo_losses, ref_lo_grads = reference(num_layers, used, dtype) if dtype != F64 else (None, None)
    my_ref_losses = ref_hi_losses[first_loss:first_loss + m]
    tag = f"pp={pp} vpp={vpp} m={m} {dtype} fwd_only={forward_only} {sched_kwargs}"
    last = ps.get_pipeline_model_parallel_rank() == pp - 1
    if last:
        if len(losses) != m:
            failures.append(f"{tag}: {len(losses)} losses on the last stage, expected {m}")
        else:
            for k, (got, want) in enumerate(zip(losses, my_ref_losses)):
                lo = None if ref_lo_losses is None else ref_lo_losses[first_loss + k]
                try:
                    assert_close_tolerance(got["loss"].cpu(), want, lo, name=f"{tag} loss[{k}]")
                except AssertionError as e:
                    failures.append(str(e))
    elif losses:
        failures.append(f"{tag}: stage {stage_rank} returned {len(losses)} losses, expected none")
    if len(OUTPUTS) != m * chunks_per_stage:
        failures.append(f"{tag}: {len(OUTPUTS)} forward steps, expected {m * chunks_per_stage}")
    # Sent outputs are released (1 element left) exactly when deallocate_pipeline_outputs is set.
    freed = sched_kwargs.get("deallocate_pipeline_outputs", False) and not forward_only
    sizes = {o.numel() for o in OUTPUTS}
    if freed and not last and sizes != {1}:
        failures.append(f"{tag}: outputs not deallocated, sizes {sizes}")
    if not freed and sizes != {SEQ * MB * HID}:
        failures.append(f"{tag}: outputs lost their data, sizes {sizes}")

    for chunk in model:
        stage = chunk.module if wrap_with_ddp else chunk
        for i, layer in enumerate(stage.layers):
            idx = stage.first + i
            for name, p, hi, lo in (("weight", layer.weight, ref_hi_grads[idx][0],
                                     None if ref_lo_grads is None else ref_lo_grads[idx][0]),
                                    ("bias", layer.bias, ref_hi_grads[idx][1],
                                     None if ref_lo_grads is None else ref_lo_grads[idx][1])):
                if forward_only:
                    if p.grad is not None:
                        failures.append(f"{tag}: layer {idx} {name} has a gradient in forward-only mode")
                    continue
                if p.grad is None:
                    failures.append(f"{tag}: layer {idx} {name} has no gradient")
                    continue
                try:
                    assert_close_tolerance(p.grad.cpu(), hi, lo, name=f"{tag} d{name}[{idx}]")
                except AssertionError as e:
                    failures.append(str(e))
    return failures, model


def _guard(failures, fn, *args, **kwargs):
    try:
        out = fn(*args, **kwargs)
        if isinstance(out, tuple):
            failures.extend(out[0])
        return out
    except Exception:  # one broken case must not hide the others' results
        failures.append(traceback.format_exc())
        return None


def _sync_hook_checks(rank, failures):
    """Interleaved: the sync context is left once per chunk plus once at the end; the grad-sync and
    param-sync hooks are called once per chunk."""
    from culmen.transformer import parallel_state as ps

    events = {"enter": 0, "exit": 0}

    @contextlib.contextmanager
    def ctx():
        events["enter"] += 1
        yield
        events["exit"] += 1

    out = _guard(failures, run_case, rank, pp=2, vpp=2, m=4, custom_sync_context_handler=ctx)
    if out is not None and (events["enter"] != events["exit"] or events["exit"] != 3):
        failures.append(f"interleaved sync context: {events} (expected 3 enters and 3 exits)")

    seen_grad, seen_param = [], []
    out = _guard(failures, run_case, rank, pp=2, vpp=2, m=4,
                 custom_grad_sync_func=lambda params: seen_grad.append(id(next(iter(params)))),
                 custom_param_sync_func=lambda params: seen_param.append(id(next(iter(params)))))
    if out is not None:
        model = out[1]
        firsts = sorted(id(next(iter(c.parameters()))) for c in model)
        if sorted(seen_grad) != firsts:
            failures.append(f"custom_grad_sync_func called for {len(seen_grad)} chunks, expected each of 2 once")
        if sorted(seen_param) != firsts:
            failures.append(f"custom_param_sync_func called for {len(seen_param)} chunks, expected each of 2 once")

    # 1F1B: the custom grad sync runs on every stage but the first, after the schedule.
    calls = []
    _guard(failures, run_case, rank, pp=2, m=3, custom_grad_sync_func=lambda: calls.append(1))
    want = 0 if ps.get_pipeline_model_parallel_rank() == 0 else 1
    if len(calls) != want:
        failures.append(f"1F1B custom_grad_sync_func called {len(calls)} times on stage "
                        f"{ps.get_pipeline_model_parallel_rank()}, expected {want}")


def _divisibility_checks(rank, failures):
    from culmen.transformer import parallel_state as ps
    from culmen.transformer.pipeline_parallel import get_forward_backward_func
    from culmen.transformer.pipeline_parallel.schedules import (
        _forward_backward_pipelining_with_interleaving,
        forward_backward_no_pipelining,
        forward_backward_pipelining_without_interleaving,
    )

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 2, 2)
    set_microbatches(3, 1)
    for call in (lambda: get_forward_backward_func(2, 2),
                 lambda: _forward_backward_pipelining_with_interleaving(
                     forward_step_func, None, [nn.Linear(1, 1), nn.Linear(1, 1)], forward_only=True,
                     tensor_shape=(SEQ, MB, HID))):
        try:
            call()
            failures.append("3 microbatches on 2 interleaved stages did not raise")
        except ValueError as e:
            if "(3)" not in str(e) or "(2)" not in str(e) or not isinstance(e, RuntimeError):
                failures.append(f"divisibility error does not name both numbers: {e!r}")
    set_microbatches(4, 1)
    if get_forward_backward_func(2, 2) is not _forward_backward_pipelining_with_interleaving:
        failures.append("vpp=2 did not select the interleaved schedule")
    if get_forward_backward_func(None, 2) is not forward_backward_pipelining_without_interleaving:
        failures.append("vpp=None did not select 1F1B")
    try:
        _forward_backward_pipelining_with_interleaving(forward_step_func, None, nn.Linear(1, 1),
                                                       forward_only=True, tensor_shape=(SEQ, MB, HID))
        failures.append("interleaved schedule accepted a single module")
    except ValueError:
        pass
    try:
        forward_backward_pipelining_without_interleaving(forward_step_func, None, [nn.Linear(1, 1)] * 2,
                                                         forward_only=True, tensor_shape=(SEQ, MB, HID))
        failures.append("1F1B accepted two chunks")
    except ValueError:
        pass
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    if get_forward_backward_func(None, 1) is not forward_backward_no_pipelining:
        failures.append("one stage did not select forward_backward_no_pipelining")


def worker_2(rank, world):
    torch.manual_seed(0)
    failures: list[str] = []
    # no pipelining: 2 data-parallel ranks, DDP through build_model (no_sync until the last microbatch)
    _guard(failures, run_case, rank, pp=1, m=3, wrap_with_ddp=True)
    _guard(failures, run_case, rank, pp=1, m=2, forward_only=True)
    # 1F1B on 2 stages
    _guard(failures, run_case, rank, pp=2, m=4)
    _guard(failures, run_case, rank, pp=2, m=1)
    _guard(failures, run_case, rank, pp=2, m=5, forward_only=True)
    _guard(failures, run_case, rank, pp=2, m=4, deallocate_pipeline_outputs=True)
    _guard(failures, run_case, rank, pp=2, m=3, async_comm=True)
    _guard(failures, run_case, rank, pp=2, m=4, dtype=F32, wrap_with_ddp=True)
    # interleaved, 2 virtual stages on 2 stages
    _guard(failures, run_case, rank, pp=2, vpp=2, m=4)
    _guard(failures, run_case, rank, pp=2, vpp=2, m=2)  # m == pp: all forwards first
    _guard(failures, run_case, rank, pp=2, vpp=2, m=6, forward_only=True)
    _guard(failures, run_case, rank, pp=2, vpp=2, m=4, deallocate_pipeline_outputs=True)
    _guard(failures, run_case, rank, pp=2, vpp=2, m=6, overlap_p2p_comm=True)
    _guard(failures, run_case, rank, pp=2, vpp=2, m=4, batch_p2p_comm=False, async_comm=True)
    _guard(failures, run_case, rank, pp=2, vpp=2, m=4, dtype=F32)
    _sync_hook_checks(rank, failures)
    _guard(failures, _divisibility_checks, rank, failures)
    return failures


def worker_4(rank, world):
    torch.manual_seed(0)
    failures: list[str] = []
    _guard(failures, run_case, rank, pp=4, m=6)
    _guard(failures, run_case, rank, pp=4, m=2)  # fewer microbatches than stages
    _guard(failures, run_case, rank, pp=4, m=5, forward_only=True)
    _guard(failures, run_case, rank, pp=4, m=6, deallocate_pipeline_outputs=True, async_comm=True)
    _guard(failures, run_case, rank, pp=2, m=4)  # 2 stages x 2 data-parallel ranks (own batches)
    # DDP chunks on 2 data-parallel ranks: gradients averaged over both ranks' batches
    _guard(failures, run_case, rank, pp=2, m=4, wrap_with_ddp=True)
    _guard(failures, run_case, rank, pp=2, vpp=2, m=4, wrap_with_ddp=True, overlap_p2p_comm=True)
    _guard(failures, run_case, rank, pp=4, vpp=2, m=8)
    _guard(failures, run_case, rank, pp=4, vpp=2, m=4, overlap_p2p_comm=True)
    _guard(failures, run_case, rank, pp=4, vpp=2, m=8, forward_only=True)
    return failures


def _check(results):
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)


def test_schedules_2_ranks():
    _check(run_group(worker_2, 2, timeout=120))


def test_schedules_4_ranks():
    _check(run_group(worker_4, 4, timeout=120))


def _failing_worker(rank, world):
    from culmen.transformer import parallel_state as ps
    from culmen.transformer.pipeline_parallel import get_forward_backward_func

    ps.initialize_model_parallel(1, 2)
    set_microbatches(4, 1)
    stage = Stage(2 * rank, 2, rank == 0, rank == 1, F64)
    calls = []

    def step(batch, model):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise ValueError("injected failure on the last stage")
        return forward_step_func(batch, model)

    get_forward_backward_func(None, 2)(step, make_batch(4, 0, F64), stage, forward_only=False,
                                       tensor_shape=(SEQ, MB, HID), dtype=F64)
    return "finished"


def test_failing_stage_fails_its_peer():
    """A stage that raises mid-schedule makes the stage waiting on it fail too (within the process-group
    timeout), instead of hanging."""
    import time

    t0 = time.monotonic()
    results = run_group(_failing_worker, 2, timeout=60, pg_timeout=10, expect_errors=True)
    assert time.monotonic() - t0 < 45
    assert all(not isinstance(r, str) for r in results), results
    assert "injected failure" in str(results[1])


def _gpu_worker(rank, world):
    torch.cuda.set_device(rank)
    failures: list[str] = []
    _guard(failures, run_case, rank, pp=2, m=4)
    _guard(failures, run_case, rank, pp=2, m=4, dtype=F32, deallocate_pipeline_outputs=True)
    _guard(failures, run_case, rank, pp=2, vpp=2, m=4, async_comm=True)
    _guard(failures, run_case, rank, pp=2, vpp=2, m=4, overlap_p2p_comm=True)
    return failures


@pytest.mark.gpu
def test_schedules_nccl_2_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check(run_group(_gpu_worker, 2, backend="nccl", timeout=180))
