"""Switches of the torchsched backend (Apex's names and environment variables).

Change them as module attributes or temporarily with ``config.patch(num_streams=4)`` (also
``patch("num_streams", 4)``, ``patch({"num_streams": 4})``, and as a decorator); ``get_config_copy()``
returns them as a dict. They are read when dynamo hands a graph to the backend, never on the call path of
a compiled graph. (Apex installs torch's config-module class here; a plain module keeps the ``apex``
import alias working.)
"""

import contextlib
import copy
import os
import re
import sys

# Log each scheduled graph's stream assignment (the ``culmen.contrib.torchsched`` logger, INFO level).
debug = os.getenv("TORCH_SCHED_DEBUG", "0") == "1"

# Run the pre-grad pattern passes named in ``pre_grad_pass_options`` on the captured graph.
enable_pre_grad_pass = False

# Pre-grad passes: "cudnn_layer_norm" (Apex: cuDNN frontend LayerNorm; culmen: its fused Triton LayerNorm).
pre_grad_pass_options: list[str] = ["cudnn_layer_norm"]

# CUDA streams per graph: the caller's stream runs the critical path, off-critical branches go to the
# other ``num_streams - 1`` streams round-robin. 1 disables multi-stream scheduling.
num_streams = int(os.getenv("TORCH_SCHED_NUM_STREAMS", "8"))


def _parse_ids(spec: str | None) -> set[int]:
    """``"1,2,3-5"`` -> ``{1, 2, 3, 4, 5}`` (SLURM-like ranges)."""
    out: set[int] = set()
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = map(int, part.split("-"))
            out.update(range(lo, hi + 1))
        else:
            out.add(int(part))
    return out


# Ids (in compilation order, from 0) of post-autograd graphs left on one stream, e.g.
# TORCH_SCHED_SKIP_GRAPH_IDS=1,2,3-5,7-10.
skip_post_grad_graph_ids: set[int] = _parse_ids(os.getenv("TORCH_SCHED_SKIP_GRAPH_IDS"))

# Record an event only where another stream waits on it, and reuse event objects once their last
# waiter has been issued (fewer events per graph).
reuse_cuda_event: bool = os.getenv("TORCH_SCHED_REUSE_CUDA_EVENT", "1") == "1"


def _dump_spec(spec: str | None) -> tuple[list[str], str | None]:
    backends, directory = ["torchsched"], None
    match = re.match(r"(?:\+(?P<backend>\w+),)?(?P<dir>[\w/.\-]+)", spec or "")
    if spec and match:
        if match.group("backend"):
            backends.append(match.group("backend"))
        directory = os.path.abspath(match.group("dir"))
    return backends, directory


# TORCH_SCHED_DUMP_CODE='+inductor,/dir/to/save/code' writes each scheduled graph's Python code to the
# directory ('+inductor' in Apex also dumps Inductor's code; culmen's graphs do not go through Inductor).
dump_code_backends, dump_code_dir = _dump_spec(os.getenv("TORCH_SCHED_DUMP_CODE"))

_NAMES = ("debug", "enable_pre_grad_pass", "pre_grad_pass_options", "num_streams", "skip_post_grad_graph_ids",
          "reuse_cuda_event", "dump_code_backends", "dump_code_dir")


def get_config_copy() -> dict:
    """The current switches, as a dict of copies."""
    module = sys.modules[__name__]
    return {name: copy.copy(getattr(module, name)) for name in _NAMES}


class patch(contextlib.ContextDecorator):  # noqa: N801 (torch's config-module name)
    """Set switches for the duration of a ``with`` block (or a decorated function), then restore them."""

    def __init__(self, arg1: "str | dict | None" = None, arg2: object = None, **changes: object) -> None:
        if isinstance(arg1, str):
            changes[arg1] = arg2
        elif isinstance(arg1, dict):
            changes.update(arg1)
        elif arg1 is not None:
            raise TypeError(f"patch takes a name and a value, a dict or keywords, got {type(arg1).__name__}")
        unknown = sorted(set(changes) - set(_NAMES))
        if unknown:
            raise ValueError(f"unknown torchsched config options {unknown}; known: {list(_NAMES)}")
        self.changes = changes
        self.saved: list[dict] = []

    def __enter__(self) -> "patch":
        module = sys.modules[__name__]
        self.saved.append({name: getattr(module, name) for name in self.changes})
        for name, value in self.changes.items():
            setattr(module, name, value)
        return self

    def __exit__(self, *exc: object) -> None:
        module = sys.modules[__name__]
        for name, value in self.saved.pop().items():
            setattr(module, name, value)
