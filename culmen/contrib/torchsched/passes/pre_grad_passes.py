"""Pre-grad passes: rewrites of the captured (dynamo) graph before AOTAutograd traces it.

``config.pre_grad_pass_options`` names the passes to run (``config.enable_pre_grad_pass`` turns them on):

* ``"cudnn_layer_norm"``: ``F.layer_norm`` over the last dimension, with a weight, becomes culmen's fused
  LayerNorm op (``culmen::layer_norm_fwd``, a Triton kernel on GPUs, with its fused backward). Apex's
  pass of this name swaps in a cuDNN-frontend LayerNorm; culmen keeps the name so configurations carry
  over, and uses its own kernel, which needs no cuDNN frontend package.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from culmen.contrib.torchsched import config

__all__ = ["pre_grad_custom_pass", "register_pass", "register_pattern", "run_pre_grad_pass"]

log = logging.getLogger("culmen.contrib.torchsched")

# pass name -> function(graph) -> number of rewrites
PRE_GRAD_PASSES: dict[str, Callable[[fx.Graph], int]] = {}


def register_pass(name: str, fn: Callable[[fx.Graph], int]) -> None:
    """Add a pre-grad pass under ``name`` (``fn(graph)`` rewrites in place, returns how many sites)."""
    if name in PRE_GRAD_PASSES:
        raise ValueError(f"pre-grad pass {name!r} is already registered")
    PRE_GRAD_PASSES[name] = fn


def culmen_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm of ``x`` (``(..., N)``) over its last dim with ``weight`` / ``bias`` (``(N,)``) by culmen's op."""
    from culmen.ops.layer_norm.op import _layer_norm_compiled

    return _layer_norm_compiled(x, weight, bias, None, None, None, None, eps, 0.0, None, False, False, False, None,
                                False, False, False).y


def _layer_norm_args(n: fx.Node):
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    args = dict(zip(names, n.args))
    args.update(n.kwargs)
    args.setdefault("weight", None)
    args.setdefault("bias", None)
    args.setdefault("eps", 1e-5)
    return args


def _replace_layer_norm(graph: fx.Graph) -> int:
    done = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in (F.layer_norm, torch.layer_norm):
            continue
        a = _layer_norm_args(n)
        shape = a["normalized_shape"]
        if not isinstance(shape, (tuple, list)) or len(shape) != 1 or not isinstance(a["weight"], fx.Node):
            continue  # culmen's op normalizes the last dim and takes a weight
        if not isinstance(a["eps"], (int, float)):
            continue
        with graph.inserting_before(n):
            new = graph.call_function(culmen_layer_norm, (a["input"], a["weight"], a["bias"], float(a["eps"])))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        done += 1
    return done


register_pass("cudnn_layer_norm", _replace_layer_norm)


def pre_grad_custom_pass(graph: fx.Graph) -> None:
    """Run the passes named in ``config.pre_grad_pass_options`` on ``graph`` (in place)."""
    for name in config.pre_grad_pass_options:
        if name not in PRE_GRAD_PASSES:
            raise ValueError(f"Unknown pre_grad pass {name!r} in config.pre_grad_pass_options; "
                             f"known: {sorted(PRE_GRAD_PASSES)}")
        count = PRE_GRAD_PASSES[name](graph)
        log.debug("pre-grad pass %s replaced %d sites", name, count)
    graph.lint()
    if graph.owning_module is not None:
        graph.owning_module.recompile()


def _layer_norm_any(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    eps: float) -> torch.Tensor:
    shape = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else (int(normalized_shape),)
    if len(shape) == 1 and weight is not None:
        return culmen_layer_norm(x, weight, bias, float(eps))
    return F.layer_norm(x, shape, weight, bias, eps)


# A leaf of FX tracing, so replace_pattern can trace replace_layer_norm with normalized_shape still symbolic.
fx.wrap("_layer_norm_any")


def replace_layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """The replacement side of the ``"cudnn_layer_norm"`` pattern: LayerNorm of ``x`` (``(..., *normalized_shape)``)
    with ``weight`` / ``bias`` (``normalized_shape``). One normalized dim: culmen's fused op; more: ``F.layer_norm``
    (culmen's kernel normalizes the last dim only). Returns ``x``'s shape and dtype. Traceable by FX (one
    call node), so it can serve as a ``replace_pattern`` replacement."""
    return _layer_norm_any(x, normalized_shape, weight, bias, eps)


def run_pre_grad_pass(name: str, graph: fx.Graph, pattern: Callable, replacement: Callable) -> int:
    """Rewrite every match of ``pattern`` in ``graph`` (which must belong to a ``GraphModule``) by
    ``replacement`` with ``torch.fx.replace_pattern``; returns the number of rewrites. ``pattern`` and
    ``replacement`` are traced with ``torch.fx.symbolic_trace`` and take the same arguments; a ``pattern`` that
    is itself a single call (such as ``F.layer_norm``) matches the call with all its arguments passed
    positionally (dynamo's graphs pass them so)."""
    if graph.owning_module is None:
        raise ValueError(f"pre-grad pass {name!r}: graph has no owning GraphModule")
    pattern_graph = fx.symbolic_trace(pattern).graph
    for node in pattern_graph.nodes:
        if node.op == "call_function" and node.kwargs:
            # symbolic_trace of a wrapper such as F.layer_norm passes its optional arguments by keyword;
            # dynamo passes them positionally, so match that form.
            node.args = tuple(node.args) + tuple(node.kwargs.values())
            node.kwargs = {}
    matches = fx.replace_pattern(graph.owning_module, pattern_graph, replacement)
    graph.owning_module.recompile()
    graph.lint()
    log.debug("pre-grad pass %s replaced %d sub-graphs", name, len(matches))
    return len(matches)


def register_pattern(name: str, pattern: Callable, replacement: Callable) -> None:
    """Register a pre-grad pass ``name`` that rewrites ``pattern`` into ``replacement`` (see
    ``run_pre_grad_pass``); enable it by adding ``name`` to ``config.pre_grad_pass_options``."""
    if not callable(pattern) or not callable(replacement):
        raise TypeError(f"pattern and replacement must be callable, got {pattern!r}, {replacement!r}")
    register_pass(name, functools.partial(run_pre_grad_pass, name, pattern=pattern, replacement=replacement))
