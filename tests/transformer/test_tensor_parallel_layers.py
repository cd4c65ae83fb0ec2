"""Tensor-parallel layers on gloo ranks against the unsharded layer computed in one process.

Every rank builds the same full weight (``use_cpu_initialization`` + ``keep_master_weight_for_test``
under one seed), the same full input and the same upstream gradient; the sharded layer's output,
input gradient, weight-shard gradient and bias gradient must match the dense float64 computation
(tolerance rule: twice PyTorch's own fp32 error plus rounding atol). Cases: column layer with and
without ``gather_output``, ``skip_bias_add``, the synchronous ``copy_to`` path, sequence
parallelism; row layer with scattered and parallel input, ``skip_bias_add``, sequence parallelism;
a column -> GELU -> row MLP with sequence parallelism; ``gradient_accumulation_fusion`` into fp32
``main_grad`` (fp32 and bf16 parameters); ``VocabParallelEmbedding``; strided initialization.
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


def _layers_worker(rank: int, world: int, full: bool) -> list[str]:
    import torch
    import torch.nn.functional as F

    from culmen.testing.tolerance import assert_close_tolerance
    from culmen.transformer import parallel_state as ps
    from culmen.transformer import tensor_parallel as tpl

    ps.initialize_model_parallel(world)
    tpl.model_parallel_cuda_manual_seed(1234)
    failures: list[str] = []
    s_local, b, d_in, d_out_local = 3, 2, 7, 5
    s, d_out = s_local * world, d_out_local * world
    rows = slice(rank * s_local, (rank + 1) * s_local)
    outs = slice(rank * d_out_local, (rank + 1) * d_out_local)

    def close(name, got, hi, lo):
        try:
            assert_close_tolerance(got, hi, lo, name=f"rank {rank} {name}")
        except AssertionError as e:
            failures.append(str(e))

    def dense(x, w, bias, dy):
        """(out, dx, dw, db) of x @ w.T + bias against upstream gradient dy, in x's dtype."""
        x = x.clone().requires_grad_()
        w = w.clone().requires_grad_()
        bias = bias.clone().requires_grad_()
        out = F.linear(x, w, bias)
        out.backward(dy)
        return out.detach(), x.grad, w.grad, bias.grad

    def make(cls, *args, **kw):
        torch.manual_seed(99)  # the same master weight on every rank
        layer = cls(*args, use_cpu_initialization=True, keep_master_weight_for_test=True, **kw)
        torch.manual_seed(5)
        with torch.no_grad():
            full_bias = torch.randn(layer.output_size)
            if isinstance(layer, tpl.ColumnParallelLinear):
                layer.bias.copy_(full_bias[outs])
            else:
                layer.bias.copy_(full_bias)
        return layer, layer.master_weight, full_bias

    # ----------------------------------------------------------------- ColumnParallelLinear
    column_cases = [
        dict(gather_output=True),
        dict(gather_output=False, skip_bias_add=True),
        dict(gather_output=False, no_async_tensor_model_parallel_allreduce=True),
        dict(gather_output=False, no_async_tensor_model_parallel_allreduce=True, sequence_parallel_enabled=True),
    ]
    if not full:
        column_cases = column_cases[::3]
    for kw in column_cases:
        tag = "column " + ",".join(f"{k}={v}" for k, v in kw.items())
        layer, w, bias = make(tpl.ColumnParallelLinear, d_in, d_out, **kw)
        if not torch.equal(layer.weight.detach(), w[outs]):
            failures.append(f"rank {rank} {tag}: weight shard is not rows {outs} of the master weight")
        torch.manual_seed(11)
        x = torch.randn(s, b, d_in)
        dy = torch.randn(s, b, d_out)
        hi = dense(x.double(), w.double(), bias.double(), dy.double())
        lo = dense(x, w, bias, dy)
        sp = kw.get("sequence_parallel_enabled", False)
        xin = (x[rows] if sp else x).clone().requires_grad_()
        out, out_bias = layer(xin)
        if kw.get("skip_bias_add"):
            if out_bias is not layer.bias:
                failures.append(f"rank {rank} {tag}: skip_bias_add must return the bias")
            out = out + out_bias
        elif out_bias is not None:
            failures.append(f"rank {rank} {tag}: output_bias must be None")
        gathered = kw["gather_output"]
        out.backward(dy if gathered else dy[..., outs])
        sel = (lambda t: t) if gathered else (lambda t: t[..., outs])
        close(f"{tag} out", out, sel(hi[0]), sel(lo[0]))
        xsel = (lambda t: t[rows]) if sp else (lambda t: t)
        close(f"{tag} dx", xin.grad, xsel(hi[1]), xsel(lo[1]))
        close(f"{tag} dw", layer.weight.grad, hi[2][outs], lo[2][outs])
        if kw.get("skip_bias_add"):
            close(f"{tag} db", layer.bias.grad, dy[..., outs].double().sum((0, 1)), dy[..., outs].sum((0, 1)))
        else:
            close(f"{tag} db", layer.bias.grad, hi[3][outs], lo[3][outs])

    # ----------------------------------------------------------------- RowParallelLinear
    d_in_local, d_out_row = 3, 6
    d_in_row = d_in_local * world
    cols = slice(rank * d_in_local, (rank + 1) * d_in_local)
    row_cases = [
        dict(input_is_parallel=False),
        dict(input_is_parallel=True, skip_bias_add=True),
        dict(input_is_parallel=True, sequence_parallel_enabled=True),
    ]
    if not full:
        row_cases = row_cases[::2]
    for kw in row_cases:
        tag = "row " + ",".join(f"{k}={v}" for k, v in kw.items())
        layer, w, bias = make(tpl.RowParallelLinear, d_in_row, d_out_row, **kw)
        if not torch.equal(layer.weight.detach(), w[:, cols]):
            failures.append(f"rank {rank} {tag}: weight shard is not columns {cols} of the master weight")
        torch.manual_seed(12)
        x = torch.randn(s, b, d_in_row)
        dy = torch.randn(s, b, d_out_row)
        hi = dense(x.double(), w.double(), bias.double(), dy.double())
        lo = dense(x, w, bias, dy)
        sp = kw.get("sequence_parallel_enabled", False)
        xin = (x[..., cols] if kw["input_is_parallel"] else x).clone().requires_grad_()
        out, out_bias = layer(xin)
        if kw.get("skip_bias_add"):
            out = out + out_bias
        out.backward(dy[rows] if sp else dy)
        osel = (lambda t: t[rows]) if sp else (lambda t: t)
        close(f"{tag} out", out, osel(hi[0]), osel(lo[0]))
        xsel = (lambda t: t[..., cols]) if kw["input_is_parallel"] else (lambda t: t)
        close(f"{tag} dx", xin.grad, xsel(hi[1]), xsel(lo[1]))
        close(f"{tag} dw", layer.weight.grad, hi[2][:, cols], lo[2][:, cols])
        db = layer.bias.grad.clone()
        if sp:  # each rank holds the bias gradient of its rows; the sum is the dense one
            if not layer.bias.sequence_parallel_enabled:
                failures.append(f"rank {rank} {tag}: bias not marked sequence_parallel_enabled")
            torch.distributed.all_reduce(db)
        close(f"{tag} db", db, hi[3], lo[3])

    # ----------------------------------------------------------------- column -> gelu -> row, sequence parallel
    if full:
        d_h = 4 * world
        torch.manual_seed(21)
        fc1 = tpl.ColumnParallelLinear(d_in, d_h, gather_output=False, use_cpu_initialization=True,
                                       keep_master_weight_for_test=True, sequence_parallel_enabled=True,
                                       no_async_tensor_model_parallel_allreduce=True)
        fc2 = tpl.RowParallelLinear(d_h, d_in, input_is_parallel=True, use_cpu_initialization=True,
                                    keep_master_weight_for_test=True, sequence_parallel_enabled=True)
        w1, w2 = fc1.master_weight, fc2.master_weight
        x = torch.randn(s, b, d_in)
        dy = torch.randn(s, b, d_in)

        def mlp(x, w1, w2):
            x = x.clone().requires_grad_()
            w1 = w1.clone().requires_grad_()
            w2 = w2.clone().requires_grad_()
            y = F.linear(F.gelu(F.linear(x, w1)), w2)
            y.backward(dy.to(x.dtype))
            return y.detach(), x.grad, w1.grad, w2.grad

        hi, lo = mlp(x.double(), w1.double(), w2.double()), mlp(x, w1, w2)
        xin = x[rows].clone().requires_grad_()
        y = fc2(F.gelu(fc1(xin)[0]))[0]
        y.backward(dy[rows])
        hcols = slice(rank * 4, (rank + 1) * 4)
        close("mlp sp out", y, hi[0][rows], lo[0][rows])
        close("mlp sp dx", xin.grad, hi[1][rows], lo[1][rows])
        close("mlp sp dw1", fc1.weight.grad, hi[2][hcols], lo[2][hcols])
        close("mlp sp dw2", fc2.weight.grad, hi[3][:, hcols], lo[3][:, hcols])

    # ----------------------------------------------------------------- gradient_accumulation_fusion
    for dtype in (torch.float32, torch.bfloat16) if full else (torch.float32,):
        for cls in (tpl.ColumnParallelLinear, tpl.RowParallelLinear):
            tag = f"fusion {cls.__name__} {dtype}"
            torch.manual_seed(31)
            if cls is tpl.ColumnParallelLinear:
                layer = cls(d_in, d_out, gather_output=False, use_cpu_initialization=True,
                            keep_master_weight_for_test=True, gradient_accumulation_fusion=True, params_dtype=dtype)
                x = torch.randn(s, b, d_in).to(dtype)
                dy = torch.randn(s, b, d_out_local).to(dtype)
                xin = x
            else:
                layer = cls(d_in_row, d_out_row, input_is_parallel=True, use_cpu_initialization=True,
                            keep_master_weight_for_test=True, gradient_accumulation_fusion=True, params_dtype=dtype)
                x = torch.randn(s, b, d_in_row).to(dtype)
                xin = x[..., cols]
                dy = torch.randn(s, b, d_out_row).to(dtype)
            start = torch.randn(layer.weight.shape)
            layer.weight.main_grad = start.clone()
            for _ in range(2):  # accumulates
                out, _ = layer(xin.clone().requires_grad_())
                out.backward(dy)
            if layer.weight.grad is not None:
                failures.append(f"rank {rank} {tag}: weight.grad must stay None")
            if layer.weight.main_grad.dtype != torch.float32:
                failures.append(f"rank {rank} {tag}: main_grad dtype changed")
            go, xi = dy.reshape(-1, dy.shape[-1]), xin.reshape(-1, xin.shape[-1])
            want_hi = start.double() + 2 * (go.double().t() @ xi.double())
            want_lo = start + 2 * (go.t() @ xi).float()
            close(tag, layer.weight.main_grad, want_hi, want_lo)
        layer = tpl.ColumnParallelLinear(d_in, d_out, gather_output=False, use_cpu_initialization=True,
                                         gradient_accumulation_fusion=True)
        try:
            layer(torch.randn(s, b, d_in))[0].sum().backward()
            failures.append(f"rank {rank}: fusion without main_grad did not raise")
        except RuntimeError as e:
            if "main_grad" not in str(e):
                failures.append(f"rank {rank}: fusion without main_grad: unclear error {e}")

    # ----------------------------------------------------------------- VocabParallelEmbedding
    v_local, dim = 7, 5
    vocab = v_local * world
    torch.manual_seed(41)
    master = torch.empty(vocab, dim)
    torch.nn.init.xavier_normal_(master)
    torch.manual_seed(41)
    emb = tpl.VocabParallelEmbedding(vocab, dim, use_cpu_initialization=True)
    vrows = slice(rank * v_local, (rank + 1) * v_local)
    if not torch.equal(emb.weight.detach(), master[vrows]):
        failures.append(f"rank {rank} embedding: cpu-initialized shard differs from the master rows")
    ids = torch.randint(0, vocab, (s, b))
    ids[0, 0], ids[-1, -1] = 0, vocab - 1
    dy = torch.randn(s, b, dim)
    out = emb(ids)
    out.backward(dy)
    m64 = master.double().requires_grad_()
    ref = F.embedding(ids, m64)
    ref.backward(dy.double())
    m32 = master.clone().requires_grad_()
    ref_lo = F.embedding(ids, m32)
    ref_lo.backward(dy)
    close("embedding out", out, ref.detach(), ref_lo.detach())
    close("embedding dweight", emb.weight.grad, m64.grad[vrows], m32.grad[vrows])

    # ----------------------------------------------------------------- initialization paths
    torch.manual_seed(51)
    stride = 2
    layer = tpl.ColumnParallelLinear(d_in, 4 * world, stride=stride, use_cpu_initialization=True,
                                     keep_master_weight_for_test=True)
    chunks = torch.split(layer.master_weight, 4 // stride, dim=0)
    want = torch.cat(chunks[rank::world], dim=0)
    if not torch.equal(layer.weight.detach(), want):
        failures.append(f"rank {rank} stride-2 init: wrong shard")
    state = torch.get_rng_state()
    device_layer = tpl.ColumnParallelLinear(d_in, d_out, gather_output=False)  # init under tracker fork
    if not torch.equal(torch.get_rng_state(), state):
        failures.append(f"rank {rank} device init: default RNG state changed (fork must restore it)")
    shards = [torch.empty_like(device_layer.weight) for _ in range(world)]
    torch.distributed.all_gather(shards, device_layer.weight.detach())
    if torch.equal(shards[0], shards[1]):
        failures.append(f"rank {rank} device init: TP ranks got identical shards")
    if not (device_layer.weight.tensor_model_parallel and device_layer.weight.partition_dim == 0):
        failures.append(f"rank {rank}: weight lacks the tensor-parallel attributes")
    if not tpl.param_is_not_tensor_parallel_duplicate(device_layer.weight):
        failures.append(f"rank {rank}: a sharded weight is never a duplicate")
    return failures


@pytest.mark.parametrize("world,full", [(2, True), (4, False)])
def test_layers_match_dense(world, full):
    results = run_group(_layers_worker, world, full, timeout=180)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)


@pytest.fixture
def tp_size_2():
    """A TP world size of 2 without process groups: enough for the constructors' size checks."""
    ps.set_tensor_model_parallel_world_size(2)
    ps.set_tensor_model_parallel_rank(0)
    yield
    ps.set_tensor_model_parallel_world_size(None)
    ps.set_tensor_model_parallel_rank(None)


def test_sizes_that_do_not_divide_raise(tp_size_2):
    for make, n in ((lambda: tpl.ColumnParallelLinear(4, 7, use_cpu_initialization=True), 7),
                    (lambda: tpl.RowParallelLinear(9, 4, use_cpu_initialization=True), 9),
                    (lambda: tpl.VocabParallelEmbedding(11, 4, use_cpu_initialization=True), 11)):
        with pytest.raises(ValueError, match=rf"\b{n}\b.*\b2\b"):
            make()
    with pytest.raises(ValueError, match="15.*2"):
        tpl.split_tensor_along_last_dim(torch.zeros(3, 15), 2)


def test_option_conflicts_raise(tp_size_2):
    # Apex raises RuntimeError for these; culmen's error is both a ValueError and a RuntimeError.
    with pytest.raises(ValueError, match="sequence_parallel_enabled"):
        tpl.ColumnParallelLinear(4, 6, gather_output=False, use_cpu_initialization=True,
                                 sequence_parallel_enabled=True)
    with pytest.raises(RuntimeError, match="input_is_parallel"):
        tpl.RowParallelLinear(4, 6, use_cpu_initialization=True, sequence_parallel_enabled=True)
    with pytest.raises(ValueError, match="gather_output"):
        tpl.ColumnParallelLinear(4, 6, use_cpu_initialization=True, sequence_parallel_enabled=True,
                                 no_async_tensor_model_parallel_allreduce=True)
    with pytest.raises(ValueError, match="output_size"):
        tpl.ColumnParallelLinear(4, 0, use_cpu_initialization=True)
    with pytest.warns(FutureWarning, match="accumulation_in_fp16"):
        tpl.ColumnParallelLinear(4, 6, use_cpu_initialization=True, accumulation_in_fp16=True)


def test_single_rank_layers_are_dense():
    """TP size 1 (no communication): the layers are plain linear layers; sequence parallelism warns and is off."""
    ps.set_tensor_model_parallel_world_size(1)
    ps.set_tensor_model_parallel_rank(0)
    try:
        torch.manual_seed(3)
        with pytest.warns(UserWarning, match="sequence_parallel_enabled"):
            col = tpl.ColumnParallelLinear(6, 5, use_cpu_initialization=True, keep_master_weight_for_test=True,
                                           sequence_parallel_enabled=True)
        assert not col.sequence_parallel_enabled
        row = tpl.RowParallelLinear(5, 4, input_is_parallel=True, use_cpu_initialization=True,
                                    keep_master_weight_for_test=True, sequence_parallel_enabled=True,
                                    skip_bias_add=True)
        x = torch.randn(3, 2, 6, dtype=torch.float32)
        y, _ = col(x)
        z, zb = row(y)
        ref = torch.nn.functional.linear(torch.nn.functional.linear(x, col.master_weight), row.master_weight)
        torch.testing.assert_close(z, ref)
        assert zb is row.bias
    finally:
        ps.set_tensor_model_parallel_world_size(None)
        ps.set_tensor_model_parallel_rank(None)


# ----------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_wgrad_accumulation_bf16_into_fp32_on_gpu():
    """The CUDA path of gradient_accumulation_fusion: bf16 operands accumulated by cuBLAS into fp32."""
    from culmen.testing.tolerance import assert_close_tolerance
    from culmen.transformer.tensor_parallel import layers

    torch.manual_seed(0)
    go = torch.randn(1000, 123, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1000, 257, device="cuda", dtype=torch.bfloat16)
    start = torch.randn(123, 257, device="cuda")
    main_grad = start.clone()
    layers._accumulate_wgrad(main_grad, go, x)
    hi = start.double() + go.double().t() @ x.double()
    lo = start + (go.t() @ x).float()
    assert_close_tolerance(main_grad, hi, lo, name="main_grad")


def _nccl_mlp_worker(rank: int, world: int) -> list[str]:
    import torch
    import torch.nn.functional as F

    from culmen.testing.tolerance import assert_close_tolerance
    from culmen.transformer import parallel_state as ps
    from culmen.transformer import tensor_parallel as tpl

    ps.initialize_model_parallel(world)
    tpl.model_parallel_cuda_manual_seed(3)
    failures: list[str] = []
    s, b, d, d_h = 64 * world, 3, 96, 256 * world
    rows = slice(rank * (s // world), (rank + 1) * (s // world))
    hcols = slice(rank * (d_h // world), (rank + 1) * (d_h // world))
    torch.manual_seed(8)
    kw = dict(use_cpu_initialization=True, keep_master_weight_for_test=True, sequence_parallel_enabled=True,
              gradient_accumulation_fusion=True, params_dtype=torch.bfloat16)
    fc1 = tpl.ColumnParallelLinear(d, d_h, gather_output=False, no_async_tensor_model_parallel_allreduce=True,
                                   **kw).cuda()
    fc2 = tpl.RowParallelLinear(d_h, d, input_is_parallel=True, **kw).cuda()
    for p in (fc1.weight, fc2.weight):
        p.main_grad = torch.zeros(p.shape, device="cuda", dtype=torch.float32)
    w1, w2 = fc1.master_weight.cuda(), fc2.master_weight.cuda()
    x = torch.randn(s, b, d, device="cuda").bfloat16()
    dy = torch.randn(s, b, d, device="cuda").bfloat16()

    def mlp(x, w1, w2):
        x, w1, w2 = (t.clone().requires_grad_() for t in (x, w1, w2))
        y = F.linear(F.gelu(F.linear(x, w1)), w2)
        y.backward(dy.to(x.dtype))
        return y.detach(), x.grad, w1.grad, w2.grad

    hi, lo = mlp(x.double(), w1.double(), w2.double()), mlp(x, w1, w2)
    xin = x[rows].clone().requires_grad_()
    y = fc2(F.gelu(fc1(xin)[0]))[0]
    y.backward(dy[rows])
    # out and dx are sums of per-rank bf16 partials, each rounded before the bf16 reduce-scatter (as in
    # Apex / Megatron): up to three roundings where the dense bf16 GEMM rounds once, hence factor 4.
    for name, got, h, lo_, f in (("out", y, hi[0][rows], lo[0][rows], 4.0),
                                 ("dx", xin.grad, hi[1][rows], lo[1][rows], 4.0),
                                 ("main_grad1", fc1.weight.main_grad, hi[2][hcols], lo[2][hcols], 2.0),
                                 ("main_grad2", fc2.weight.main_grad, hi[3][:, hcols], lo[3][:, hcols], 2.0)):
        try:
            assert_close_tolerance(got, h, lo_, factor=f, name=f"rank {rank} {name}")
        except AssertionError as e:
            failures.append(str(e))
    return failures


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL tensor parallelism")
def test_sequence_parallel_mlp_bf16_over_nccl():
    results = run_group(_nccl_mlp_worker, 2, backend="nccl", timeout=300)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)
