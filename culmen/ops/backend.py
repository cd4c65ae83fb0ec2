"""Where an op runs: the one dispatch decision of culmen, and the process-wide switches.

* CUDA / ROCm tensors run the Triton kernel.
* CPU tensors run the pure-PyTorch reference, unless the backend is ``"triton"``, which runs the
  Triton kernel on CPU (this needs ``TRITON_INTERPRET=1`` set before triton is imported).
* The backend ``"reference"`` forces the reference everywhere.

The backend starts from the environment variable ``CULMEN_BACKEND`` (read once, at import) and is
changed with ``set_backend`` / ``use_backend``. Ops decide their backend when they build a cached call
plan, never per call, so every setter here drops the cached plans (``culmen.ops.common.plans``).
Nothing here compiles, autotunes or touches the GPU at import.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_VALID = ("auto", "triton", "reference")


_TRITON_STATE: bool | None = None


def triton_available() -> bool:
    """True when ``import triton`` works in this process (checked once)."""
    global _TRITON_STATE
    if _TRITON_STATE is None:
        try:
            import triton  # noqa: F401

            _TRITON_STATE = True
        except Exception:  # pragma: no cover - depends on the platform
            _TRITON_STATE = False
    return _TRITON_STATE


def interpreter_enabled() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``). Read at plan-building
    time only: Triton itself reads the variable once, when it is imported."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def parse_backend(value: str | None) -> str:
    """Validate a backend name (``None`` / empty means ``auto``); raises ``ValueError`` naming the choices."""
    mode = (value or "auto").strip().lower() or "auto"
    if mode not in _VALID:
        raise ValueError(f"CULMEN_BACKEND must be one of {_VALID}, got {value!r}")
    return mode


def _initial_mode() -> str | None:
    """The backend named by ``CULMEN_BACKEND`` at import; ``None`` (an error at the first op) when invalid,
    so a bad variable never breaks ``import culmen`` itself."""
    try:
        return parse_backend(os.environ.get("CULMEN_BACKEND"))
    except ValueError:
        return None


_MODE: str | None = _initial_mode()


def backend_mode() -> str:
    """The current backend: ``auto``, ``triton`` or ``reference``."""
    if _MODE is None:
        return parse_backend(os.environ.get("CULMEN_BACKEND"))  # raises with the bad value
    return _MODE


def set_backend(mode: str) -> None:
    """Choose where culmen's ops run from now on: ``"auto"`` (CUDA/ROCm tensors on the Triton kernels,
    CPU tensors on the reference), ``"triton"`` (the kernels everywhere; CPU needs ``TRITON_INTERPRET=1``)
    or ``"reference"`` (the pure-PyTorch path everywhere). Drops every cached call plan."""
    global _MODE
    _MODE = parse_backend(mode)
    _plans_changed()


@contextlib.contextmanager
def use_backend(mode: str) -> Iterator[None]:
    """``set_backend(mode)`` for the duration of a ``with`` block, then the previous backend again."""
    prev = _MODE
    set_backend(mode)
    try:
        yield
    finally:
        globals()["_MODE"] = prev
        _plans_changed()


def _plans_changed() -> None:
    from culmen.ops.common.plans import clear_plans

    clear_plans()


def choose_backend(device: torch.device | str) -> str:
    """Return ``"triton"`` or ``"reference"`` for an op whose tensors live on ``device``."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    mode = backend_mode()
    if mode == "reference":
        return "reference"
    if device.type == "cuda":
        if not triton_available():
            raise RuntimeError("culmen needs triton to run on CUDA/ROCm tensors; pip install triton")
        return "triton"
    if mode == "triton":
        if device.type != "cpu":
            raise RuntimeError(f"CULMEN_BACKEND=triton cannot run on device type {device.type!r}")
        if not interpreter_enabled():
            raise RuntimeError(
                "CULMEN_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported"
            )
        return "triton"
    return "reference"


_CHECK_VALUES = os.environ.get("CULMEN_CHECK_VALUES", os.environ.get("CULMEN_CHECK_LABELS", "0")) not in ("", "0")


def set_check_values(flag: bool) -> None:
    """Check the *values* of index-like inputs (labels, ``cu_seqlens``, page tables, indices) on GPUs
    too, at the cost of a device-to-host sync per call (CPU tensors are always checked). Starts from
    ``CULMEN_CHECK_VALUES=1`` (``CULMEN_CHECK_LABELS`` is its old name). Kernels stay memory-safe on bad
    values either way; the check turns silent garbage into a clear error."""
    global _CHECK_VALUES
    if not isinstance(flag, bool):
        raise TypeError(f"set_check_values expects a bool, got {type(flag).__name__}")
    _CHECK_VALUES = flag
    _plans_changed()


def check_values_on() -> bool:
    """The value-checking switch (see ``set_check_values``)."""
    return _CHECK_VALUES


_DETERMINISTIC = False


def set_deterministic(flag: bool) -> None:
    """Make every culmen backward bitwise reproducible (``True``) or let ops pick their fastest
    reduction (``False``, the default). ``torch.use_deterministic_algorithms(True)`` has the same effect.

    Ops with a non-reproducible fast path (fp32 atomics): index_mul_2d's gradient of ``in1`` and the
    attention backward's optional atomic dQ. A per-call ``deterministic=True`` (flash_attn) also wins.
    """
    global _DETERMINISTIC
    if not isinstance(flag, bool):
        raise TypeError(f"set_deterministic expects a bool, got {type(flag).__name__}")
    _DETERMINISTIC = flag


def deterministic_enabled() -> bool:
    """Whether backward passes must be bitwise reproducible (``set_deterministic`` or torch's switch)."""
    return _DETERMINISTIC or torch.are_deterministic_algorithms_enabled()


_COMPILE_FUSION = os.environ.get("CULMEN_COMPILE_FUSION", "1") not in ("", "0")


def set_compile_fusion(flag: bool) -> None:
    """Under ``torch.compile``, trace the ops Inductor generates as well as culmen's kernels as their plain
    PyTorch formulas (``True``, the default), or keep every op a ``triton_op`` (``False``).

    The ops concerned are pointwise or one-row reductions: LayerNorm / RMSNorm without dropout (with the
    fused residual add), rotary embeddings of dense ``(batch, seqlen, ...)`` inputs, and the activations
    (``bias_act``, the gated ones). Their kernels match Inductor's on the GPU, but an opaque op stops
    Inductor from fusing across it, and an in-place rotary of a packed ``qkv`` cost copies of the whole
    tensor around the op (H200, LLaMA-1B step: ~6 ms of copy kernels). Attention, the fused losses and
    everything with RNG-dependent masks stay culmen's kernels. Eager calls never read this switch;
    starts from ``CULMEN_COMPILE_FUSION`` (``0`` turns it off)."""
    global _COMPILE_FUSION
    if not isinstance(flag, bool):
        raise TypeError(f"set_compile_fusion expects a bool, got {type(flag).__name__}")
    _COMPILE_FUSION = flag


def compile_fusion_enabled() -> bool:
    """The switch of ``set_compile_fusion`` (read only while ``torch.compile`` traces)."""
    return _COMPILE_FUSION


_NULL_GUARD = contextlib.nullcontext()


def device_guard(device: torch.device):
    """Make ``device`` current while a Triton kernel launches (Triton launches on the current device).

    Free when ``device`` already is current (the usual case): switching devices costs host time on
    every launch.
    """
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _NULL_GUARD


def num_programs_hint(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device; a small number under the CPU interpreter."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


_SM_CACHE: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SM_CACHE:
        _SM_CACHE[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_CACHE[index]


@dataclass(frozen=True)
class OpInfo:
    """An entry of the op registry that ``culmen info`` prints."""

    name: str
    family: str
    description: str


_REGISTRY: dict[str, OpInfo] = {}


def register_op(name: str, family: str, description: str) -> None:
    """Record an op (a ``culmen::`` custom op) so ``culmen info`` can list it and its backend."""
    _REGISTRY[name] = OpInfo(name, family, description)


def registered_ops() -> list[OpInfo]:
    """All registered ops, sorted by family then name. Importing ``culmen.ops`` fills the registry."""
    return sorted(_REGISTRY.values(), key=lambda o: (o.family, o.name))
