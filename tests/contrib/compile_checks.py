"""Shared by the contrib compile tests (test_conv_bias_relu_compile.py, test_transducer_compile.py): a
``torch.compile`` that keeps the code of every Dynamo graph, so a test can check which ops were traced."""

from __future__ import annotations

import torch
from torch._dynamo.backends.registry import lookup_backend


def compile_keeping_graphs(fn, graphs: list):
    """``fn`` compiled with ``fullgraph=True`` through aot_eager (fake impls, functionalization, the registered
    autograd), appending the code of every Dynamo graph to ``graphs``."""
    aot = lookup_backend("aot_eager")

    def backend(gm, inputs):
        graphs.append(gm.code)
        return aot(gm, inputs)

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)
