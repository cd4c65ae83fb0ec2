"""The torchsched ``torch.compile`` backend: AOTAutograd graphs run with their independent branches on
several CUDA streams.

Apex patches Inductor's code generator so Inductor's kernels are issued on several streams. culmen
schedules one level up: the forward and backward ATen graphs from AOTAutograd are planned by
``culmen.contrib.torchsched.scheduler`` and their ops issued as ATen kernels on the planned streams (no
Inductor fusion: the backend pays off where a graph is dominated by large independent GEMMs /
convolutions, such as parallel branches, multi-head projections or dgrad beside wgrad). On CPU, or with
``config.num_streams == 1``, a graph runs as AOTAutograd traced it, so results equal eager PyTorch.

Apex's convolution-backward decompositions are kept: ``scheme="dwb"`` splits ``convolution_backward``
into data-grad, weight-grad and bias-grad ops (``"wbd"``: weight, bias, data), which the scheduler can
then place on different streams.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

import culmen.contrib.torchsched.config as config
from culmen.contrib.torchsched.scheduler import CudaStreamRuntime, build_scheduled_module, describe, plan_streams

__all__ = ["get_backend"]

aten = torch.ops.aten
log = logging.getLogger("culmen.contrib.torchsched")

_GRAPH_IDS = itertools.count()


def _conv_bwd_parts(grad_output: Tensor, input: Tensor, weight: Tensor, bias_sizes, stride, padding, dilation,
                    transposed: bool, output_padding, groups: int, output_mask, order: str):
    # Only worth splitting on CUDA, where the parts can overlap; the bias grad is a plain reduction.
    if not output_mask[2] or grad_output.device.type != "cuda":
        return NotImplemented
    common = (bias_sizes, stride, padding, dilation, transposed, output_padding, groups)
    parts: dict[str, Tensor | None] = {}
    for part in order:
        if part == "d":
            parts[part] = aten.convolution_backward(grad_output, input, weight, *common,
                                                    [output_mask[0], False, False])[0]
        elif part == "w":
            parts[part] = aten.convolution_backward(grad_output, input, weight, *common,
                                                    [False, output_mask[1], False])[1]
        else:
            parts[part] = aten.sum(grad_output, [0, *range(2, grad_output.dim())])
    return parts["d"], parts["w"], parts["b"]


def convolution_backward_decomp_dwb(grad_output: Tensor, input: Tensor, weight: Tensor, bias_sizes: list[int],
                                    stride: list[int], padding: list[int], dilation: list[int], transposed: bool,
                                    output_padding: list[int], groups: int, output_mask: list[bool]):
    """``aten.convolution_backward`` as data-grad, then weight-grad, then bias-grad ops (CUDA, with a bias
    gradient; ``NotImplemented`` otherwise, which keeps the fused op)."""
    return _conv_bwd_parts(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                           output_padding, groups, output_mask, "dwb")


def convolution_backward_decomp_wbd(grad_output: Tensor, input: Tensor, weight: Tensor, bias_sizes: list[int],
                                    stride: list[int], padding: list[int], dilation: list[int], transposed: bool,
                                    output_padding: list[int], groups: int, output_mask: list[bool]):
    """As ``convolution_backward_decomp_dwb``, issued weight-grad, bias-grad, data-grad."""
    return _conv_bwd_parts(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                           output_padding, groups, output_mask, "wbd")


def _cuda_device(gm: fx.GraphModule, example_inputs: list[Any]) -> torch.device | None:
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"] + list(example_inputs)
    for v in vals:
        if isinstance(v, Tensor) and v.device.type == "cuda":
            return v.device
    return None


def _settings() -> dict[str, Any]:
    """The config values a compilation uses, read once when dynamo calls the backend (AOTAutograd compiles
    the backward graph later, at the first backward, possibly outside a ``config.patch``)."""
    return {k: getattr(config, k) for k in ("num_streams", "reuse_cuda_event", "skip_post_grad_graph_ids",
                                            "debug", "dump_code_dir")}


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any], settings: dict[str, Any] | None = None) -> Callable:
    """AOTAutograd's forward / backward compiler: the graph with its ops planned onto CUDA streams.

    Returns ``gm.forward`` unchanged on CPU graphs, with ``num_streams <= 1``, for graph ids in
    ``skip_post_grad_graph_ids`` and when the plan uses no side stream. ``settings``: config values
    (default: the current ``config``).
    """
    from torch._functorch.aot_autograd import make_boxed_func

    cfg = settings if settings is not None else _settings()
    graph_id = next(_GRAPH_IDS)
    device = _cuda_device(gm, example_inputs)
    if device is None or cfg["num_streams"] <= 1 or graph_id in cfg["skip_post_grad_graph_ids"]:
        return make_boxed_func(gm.forward)
    plan = plan_streams(gm.graph, cfg["num_streams"], cfg["reuse_cuda_event"])
    if cfg["debug"]:
        log.info("torchsched graph %d: %s", graph_id, describe(plan))
    if not plan.side_streams:
        return make_boxed_func(gm.forward)
    runtime = CudaStreamRuntime(device, plan.side_streams, plan.num_events)
    scheduled = build_scheduled_module(gm, plan, runtime)
    if cfg["dump_code_dir"]:
        os.makedirs(cfg["dump_code_dir"], exist_ok=True)
        with open(os.path.join(cfg["dump_code_dir"], f"torchsched_graph_{graph_id}.py"), "w") as f:
            f.write(scheduled.code)
    forward = scheduled.forward
    begin, end = runtime.begin, runtime.end

    def run(*args: Any) -> Any:
        begin()
        try:
            return forward(*args)
        finally:
            end()

    boxed = make_boxed_func(run)
    boxed.plan = plan  # type: ignore[attr-defined]
    boxed.runtime = runtime  # type: ignore[attr-defined]
    return boxed


class DecompositionsWrapper:
    """The torchsched backend object: ``(graph_module, example_inputs) -> compiled callable``.

    Args (Apex's order):
        mode: ``torch.compile``'s mode string (Apex passes ``"default"``); kept as ``self.mode``. The backend
            does not use Inductor, so modes do not change what it does.
        options: Inductor options (Apex: ``{"allow_buffer_reuse": False, "inplace_buffers": False}``); kept
            as ``self.options``, unused for the same reason (culmen's runtime allocates like eager PyTorch, so
            streams never share a buffer).
        dynamic: kept as ``self.dynamic`` (dynamo decides dynamic shapes before the backend is called).
        decompositions: extra ATen decompositions applied while AOTAutograd traces (on top of none: the
            ops stay as coarse as eager PyTorch's, so each one is one kernel to place on a stream).

    ``DecompositionsWrapper(decompositions_dict)`` (one positional dict, culmen's earlier form) still works.
    """

    def __init__(self, mode: str | dict = "default", options: dict | None = None, dynamic: bool = False,
                 decompositions: dict | None = None) -> None:
        if isinstance(mode, dict) and decompositions is None:
            mode, decompositions = "default", mode
        if not isinstance(mode, str):
            raise TypeError(f"mode must be a str, got {mode!r}")
        self.mode = mode
        self.options = dict(options or {})
        self.dynamic = bool(dynamic)
        self.decompositions = dict(decompositions or {})

    def __eq__(self, rhs: object) -> bool:
        return isinstance(rhs, DecompositionsWrapper) and rhs.decompositions == self.decompositions

    def __hash__(self) -> int:
        return hash(tuple(sorted(map(str, self.decompositions))))

    def __call__(self, model_: fx.GraphModule, inputs_: list, *args: object, **kwargs: object) -> Callable:
        from torch._dynamo.backends.common import aot_autograd

        if config.enable_pre_grad_pass:
            from culmen.contrib.torchsched.passes import pre_grad_custom_pass

            pre_grad_custom_pass(model_.graph)
        compiler = functools.partial(compile_graph, settings=_settings())
        backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, inference_compiler=compiler,
                               decompositions=self.decompositions)
        return backend(model_, inputs_)


def get_backend(backend: str = "torch", scheme: str = "dwb") -> Callable | DecompositionsWrapper:
    """The compile backend: ``"torch"`` gives Inductor, ``"torchsched"`` the multi-stream backend.

    Args:
        backend: ``"torch"`` or ``"torchsched"``.
        scheme: the convolution-backward split, ``"dwb"`` or ``"wbd"`` (see the module docstring).
    """
    if backend not in ("torch", "torchsched"):
        raise ValueError(f"Unknown compilation backend={backend!r}, use 'torch' or 'torchsched'")
    if scheme not in ("dwb", "wbd"):
        raise ValueError(f"Invalid scheme={scheme!r}, use scheme=dwb or wbd instead")
    if backend == "torch":
        from torch._dynamo import lookup_backend

        return lookup_backend("inductor")
    decomp = convolution_backward_decomp_dwb if scheme == "dwb" else convolution_backward_decomp_wbd
    return DecompositionsWrapper(mode="default", options={"allow_buffer_reuse": False, "inplace_buffers": False},
                                 dynamic=False, decompositions={aten.convolution_backward.default: decomp})


def enable_multi_stream_scheduling(compile_fn: Callable) -> Callable:
    """Apex: wrap an Inductor inner-compile function so its code generator issues kernels on several streams.

    culmen schedules streams on the AOTAutograd graph instead of inside Inductor (see the module docstring),
    so there is no Inductor code generator to patch: this raises ``NotImplementedError`` naming what to use,
    ``torch.compile(model, backend="torchsched")`` or ``get_backend("torchsched")``.
    """
    if not callable(compile_fn):
        raise TypeError(f"compile_fn must be callable, got {compile_fn!r}")
    raise NotImplementedError(
        "culmen's torchsched does not patch Inductor's code generator (it plans streams on the AOTAutograd "
        "graph); use torch.compile(model, backend='torchsched') or "
        "culmen.contrib.torchsched.backend.get_backend('torchsched') instead of enable_multi_stream_scheduling")
