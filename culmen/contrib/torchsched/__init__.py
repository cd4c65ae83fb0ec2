"""``apex.contrib.torchsched``: a ``torch.compile`` backend that runs independent ops on several CUDA streams.

Usage (Apex's)::

    import culmen.contrib.torchsched  # registers the "torchsched" backend
    model = torch.compile(model, backend="torchsched")

    # or make it the default of torch.compile:
    from culmen.contrib.torchsched import set_default_backend
    set_default_backend("torchsched")
    model = torch.compile(model)

Switches live in ``culmen.contrib.torchsched.config`` (``num_streams``, ``reuse_cuda_event``,
``skip_post_grad_graph_ids``, ``debug``, ``dump_code_dir``, ``enable_pre_grad_pass``,
``pre_grad_pass_options``), with Apex's ``TORCH_SCHED_*`` environment variables. How graphs are planned:
``culmen.contrib.torchsched.scheduler``; what differs from Apex's Inductor-level scheduler:
``culmen.contrib.torchsched.backend``.

Unlike Apex, importing the package does not replace ``torch.compile``: ``set_default_backend`` installs
the wrapper (``torchsched_compile``) when the default becomes anything but ``"inductor"`` and restores
torch's function when it goes back, so ``torch.compile`` behaves the same in both cases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo import list_backends, register_backend
from torch._dynamo.backends.registry import _COMPILER_FNS

from culmen.contrib.torchsched.backend import get_backend

__all__ = ["get_backend", "set_default_backend"]


def torchsched(model_: torch.fx.GraphModule, example_inputs_: list[torch.Tensor], inner_compile: Any = None,
               config_patches: dict[str, Any] | None = None, decompositions: dict | None = None) -> Callable:
    """The ``"torchsched"`` backend (``compile_fx``'s signature, as Apex's).

    Args:
        model_, example_inputs_: what dynamo passes to a backend.
        inner_compile: accepted for Apex's signature; unused (graphs are not compiled by Inductor).
        config_patches: ``culmen.contrib.torchsched.config`` values for this compilation.
        decompositions: extra ATen decompositions, on top of the convolution-backward split.
    """
    from culmen.contrib.torchsched import config

    backend = get_backend(backend="torchsched", scheme="dwb")
    if decompositions:
        backend.decompositions.update(decompositions)
    patches = dict(config_patches or {})
    unknown = sorted(set(patches) - set(config.get_config_copy()))
    if unknown:
        raise ValueError(f"config_patches has unknown torchsched options {unknown}")
    with config.patch(patches):
        return backend(model_, example_inputs_)


if "torchsched" not in _COMPILER_FNS:
    register_backend(name="torchsched")(torchsched)

_DEFAULT_BACKEND = "inductor"
__torch_compile__ = torch.compile


def set_default_backend(backend: str) -> None:
    """Make ``backend`` (a registered ``torch.compile`` backend name) what ``torch.compile`` uses when it is
    called without ``backend=``."""
    global _DEFAULT_BACKEND
    supported = list_backends(exclude_tags=())
    if backend not in supported:
        raise ValueError(f"Unknown backend {backend!r}; registered backends: {supported}")
    _DEFAULT_BACKEND = backend
    torch.compile = __torch_compile__ if backend == "inductor" else torchsched_compile


def torchsched_compile(*args: object, backend: str | Callable | None = None, **kwargs: object) -> object:
    """``torch.compile`` with the default backend set by ``set_default_backend``."""
    if backend is None:
        backend = _DEFAULT_BACKEND
    return __torch_compile__(*args, backend=backend, **kwargs)
