"""O1's casting engine: ``torch.autocast`` switched on for the process's thread, plus Apex's lists.

Apex's O1 monkey-patched hundreds of ``torch`` / ``torch.nn.functional`` / ``torch.Tensor``
functions in Python. culmen uses PyTorch's own per-op casting instead (``torch.autocast``, which
runs in C++ at the dispatcher) and adds only what differs in Apex:

1. While O1 is active, autocast is *enabled* (not entered as a context) for the device types of the
   initialized models, with the O1 dtype (fp16, or bf16 for O4 / ``patch_torch_functions_type``).
   Like Apex's patches it covers everything the thread runs: the model, the loss, user code.
2. Apex's list entries that ``torch.autocast`` leaves alone on a device (``std``/``var`` everywhere;
   ``softmax``, ``layer_norm``, ``exp``, ``sum`` ... on CPU, where torch's CPU lists are short) get
   small Python kernels at the ``AutocastCPU`` / ``AutocastCUDA`` dispatch keys, registered with
   ``torch.library`` for as long as O1 is active. Whether torch already has a kernel is asked from
   the dispatcher, so the gaps follow the installed PyTorch version.
3. ``binary_cross_entropy`` follows Apex (``NotImplementedError`` on 16-bit inputs unless
   ``allow_banned``, then fp32), so do the in-place forms of the fp32 functions (``Tensor.exp_`` on a
   16-bit tensor raises ``NotImplementedError``), ``grid_sampler`` runs in fp32 (torch promotes on CUDA), and
   ``Tensor.cpu()`` of a 16-bit accelerator tensor returns fp32.
4. User registrations (``register_half_function`` ...) and Apex's fp32 functions that are Python
   compositions without an ATen op (``F.softmin``, ``F.normalize`` ...) are patched in Python.
5. Backward passes run without casts (``torch.autograd.backward`` / ``grad`` are wrapped), as under
   Apex, whose patches autograd never called: autocast's thread-local state would otherwise reach
   the backward ops.

Differences from Apex: autocast state is thread-local, so casting applies to the thread that called
``amp.initialize`` (and to threads that inherit it, such as DataParallel's workers); Apex's patches
were process-wide. The cast cache lives for one forward of an initialized model (Apex kept it until
the end of ``scale_loss``); outside a model's forward nothing is cached.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from culmen.amp import lists

__all__ = ["CastEngine", "USER_CAST_REGISTRY", "cast_args", "make_cast_wrapper"]

LOW_DTYPES = (torch.float16, torch.bfloat16)
_DISPATCH_KEY = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

USER_CAST_REGISTRY: list[tuple[Any, str, str]] = []
"""``(module, name, policy)`` registered by ``register_*_function``; applied while O1 is active."""


# ------------------------------------------------------------------------------------ helpers


def _map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        mapped = [_map_tensors(o, fn) for o in obj]
        return type(obj)(mapped) if not hasattr(obj, "_fields") else type(obj)(*mapped)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _iter_tensors(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _iter_tensors(o)


def _widest(dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
    found = set(dtypes)
    if not found:
        return None
    if len(found) == 1:
        return found.pop()
    if torch.float64 in found:
        return torch.float64
    return torch.float32  # any mix of fp32 / fp16 / bf16


def cast_args(policy: str, args: tuple, kwargs: dict, low_dtype: torch.dtype,
              eligible: Callable[[Tensor], bool]) -> tuple[tuple, dict]:
    """Cast the floating tensors of ``args`` / ``kwargs`` (recursively) for ``policy``.

    ``"half"`` / ``"bfloat16"``: fp32 tensors go to ``low_dtype``. ``"float"``: fp16/bf16 go to fp32.
    ``"promote"``: every floating tensor goes to the widest floating dtype present. Only tensors for
    which ``eligible(t)`` holds are touched (the devices where casting is active).
    """
    if policy == "promote":
        target = _widest(t.dtype for t in _iter_tensors((args, kwargs)) if t.is_floating_point() and eligible(t))

        def fn(t: Tensor) -> Tensor:
            return t.to(target) if t.is_floating_point() and t.dtype != target and eligible(t) else t
    elif policy == "float":
        def fn(t: Tensor) -> Tensor:
            return t.float() if t.dtype in LOW_DTYPES and eligible(t) else t
    else:
        def fn(t: Tensor) -> Tensor:
            return t.to(low_dtype) if t.dtype == torch.float32 and eligible(t) else t
    return _map_tensors(args, fn), _map_tensors(kwargs, fn)


def make_cast_wrapper(orig: Callable, policy: str) -> Callable:
    """Wrap ``orig`` so its floating tensor arguments are cast by ``policy`` while O1 casting is active.

    ``policy``: ``"half"`` (the O1 dtype: fp16, or bf16 under O4), ``"bfloat16"``, ``"float"`` or
    ``"promote"``. Outside O1, inside ``amp.disable_casts()`` or on a device where casting is off, the
    call passes through unchanged.
    """
    from culmen.amp._amp_state import _amp_state

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        engine = _amp_state.cast_engine
        if engine is None or not engine.active:
            return orig(*args, **kwargs)
        low = torch.bfloat16 if policy == "bfloat16" else engine.dtype
        args, kwargs = cast_args(policy, args, kwargs, low, engine.casts_active_for)
        return orig(*args, **kwargs)

    wrapper.__culmen_amp_wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


def _banned_message(name: str) -> str:
    for banned, msg in lists.FUNCTIONAL_BANNED_FUNCS:
        if banned == name:
            return msg
    return f"amp O1 refuses {name} on 16-bit inputs (pass allow_banned=True to run it in fp32)."


# ------------------------------------------------------------------------- dispatcher kernels


def _overloads(name: str) -> list[torch._ops.OpOverload]:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return []
    found = []
    for ov in packet.overloads():
        if ov == "out" or ov.endswith("_out"):
            continue
        try:
            op = getattr(packet, ov)
        except (AttributeError, RuntimeError):
            continue
        if not any("Tensor" in str(a.type) for a in op._schema.arguments):
            continue
        found.append(op)
    return found


def _qualified(op: torch._ops.OpOverload) -> str:
    """``aten::name`` or ``aten::name.overload`` (the dispatcher's name)."""
    name = op._schema.name
    return name if not op._schema.overload_name else f"{name}.{op._schema.overload_name}"


def _has_kernel(op: torch._ops.OpOverload, key: str) -> bool:
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(_qualified(op), key))
    except RuntimeError:
        return True  # unknown to the dispatcher: leave it alone


def _make_kernel(op: torch._ops.OpOverload, policy: str, key: str, device_type: str, allow_banned: bool) -> Callable:
    exclude = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    schema_args = op._schema.arguments
    dtype_pos = next((i for i, a in enumerate(schema_args) if a.name == "dtype" and not a.kwarg_only), None)
    dtype_kw = any(a.name == "dtype" and a.kwarg_only for a in schema_args)
    set_opt_dtype = policy == "float" and (dtype_pos is not None or dtype_kw)
    op_name = op._schema.name.split("::")[-1]

    def eligible(t: Tensor) -> bool:
        return t.device.type == device_type

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if policy == "inplace_error":
            if any(t.dtype in LOW_DTYPES and eligible(t) for t in _iter_tensors((args, kwargs))):
                dt = next(t.dtype for t in _iter_tensors((args, kwargs)) if t.dtype in LOW_DTYPES)
                raise NotImplementedError(f"Cannot call in-place function {op_name} with {dt} arguments under amp "
                                          f"O1 (Apex runs {op_name.rstrip('_')} in fp32).")
        elif policy == "banned":
            if any(t.dtype in LOW_DTYPES and eligible(t) for t in _iter_tensors((args, kwargs))):
                if not allow_banned:
                    raise NotImplementedError(_banned_message(op_name))
                args, kwargs = cast_args("float", args, kwargs, torch.float32, eligible)
        elif set_opt_dtype:
            # Like torch's fp32_set_opt_dtype: run in fp32 through the op's dtype argument (no input copy).
            first = next(_iter_tensors(args), None)
            if first is not None and first.dtype in LOW_DTYPES and eligible(first):
                if dtype_kw and kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                elif dtype_pos is not None:
                    if dtype_pos < len(args):
                        if args[dtype_pos] is None:
                            args = (*args[:dtype_pos], torch.float32, *args[dtype_pos + 1:])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
        else:
            low = torch.get_autocast_dtype(device_type)
            args, kwargs = cast_args(policy, args, kwargs, low, eligible)
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            return op(*args, **kwargs)

    return kernel


def _register_apex_lists(lib: torch.library.Library, device_type: str, allow_banned: bool) -> list[str]:
    """Register culmen's Python kernels for ``device_type``'s autocast key; return the ops covered."""
    key = _DISPATCH_KEY[device_type]
    skip = set(lists.ATEN_SKIP.get(device_type, ()))
    plan: list[tuple[str, str, bool]] = []  # (aten name, policy, override torch's kernel)
    plan += [(n, "half", False) for n in lists.ATEN_LOWP]
    plan += [(n, "float", False) for n in lists.ATEN_FP32]
    plan += [(n, "float", True) for n in lists.ATEN_FP32_OVERRIDE]
    plan += [(n, "promote", False) for n in lists.ATEN_PROMOTE]
    plan += [(n, "banned", True) for n in lists.ATEN_BANNED]
    plan += [(n, "inplace_error", False) for n in lists.ATEN_INPLACE_ERROR]
    covered: list[str] = []
    with warnings.catch_warnings():
        # Replacing torch's own kernel (banned / grid_sampler) warns once; that is intended here.
        warnings.simplefilter("ignore")
        for name, policy, override in plan:
            if name in skip:
                continue
            for op in _overloads(name):
                if not override and _has_kernel(op, key):
                    continue
                if any(a.name == "out_dtype" for a in op._schema.arguments):
                    continue  # explicit output-dtype variants (mm.dtype ...): the caller chose the dtype
                qual = _qualified(op).split("::", 1)[1]
                lib.impl(qual, _make_kernel(op, policy, key, device_type, allow_banned), key)
                covered.append(qual)
    return covered


def _without_casts(fn: Callable, engine: CastEngine) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not engine.active:
            return fn(*args, **kwargs)
        with engine.disabled():
            return fn(*args, **kwargs)

    return wrapper


# ---------------------------------------------------------------------------------- the engine


class CastEngine:
    """O1 casting for a set of device types (see the module docstring).

    Args:
        device_types: ``"cuda"`` and/or ``"cpu"`` (other device types get torch.autocast only).
        dtype: the 16-bit dtype of O1 (``torch.float16`` or ``torch.bfloat16``).
        allow_banned: run banned functions in fp32 instead of raising.
        enable_caching: cache casts of parameters within one model forward.
        verbose: print the casts Apex's verbose mode printed (culmen: the ops it registered).
    """

    def __init__(self, device_types: Iterable[str], dtype: torch.dtype = torch.float16, allow_banned: bool = False,
                 enable_caching: bool = True, verbose: bool = False) -> None:
        if dtype not in LOW_DTYPES:
            raise ValueError(f"O1 casts to torch.float16 or torch.bfloat16, got {dtype}")
        self.device_types: tuple[str, ...] = tuple(dict.fromkeys(device_types))
        if not self.device_types:
            raise ValueError("CastEngine needs at least one device type")
        self.dtype = dtype
        self.allow_banned = allow_banned
        self.enable_caching = enable_caching
        self.verbose = verbose
        self.active = False
        self.covered: dict[str, list[str]] = {}
        self._saved: list[tuple[str, bool, torch.dtype]] = []
        self._saved_cache: bool = True
        self._lib: torch.library.Library | None = None
        self._patches: list[tuple[Any, str, bool, Any]] = []

    # ----------------------------------------------------------------------------- switching

    def activate(self) -> None:
        """Enable autocast for this engine's device types and install the Apex-list additions."""
        if self.active:
            return
        self._saved = [(dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in self.device_types]
        self._saved_cache = torch.is_autocast_cache_enabled()
        for dt in self.device_types:
            torch.set_autocast_enabled(dt, True)
            torch.set_autocast_dtype(dt, self.dtype)
        # Outside an initialized model's forward nothing is cached (see the module docstring).
        torch.set_autocast_cache_enabled(False)
        self._lib = torch.library.Library("aten", "IMPL")
        for dt in self.device_types:
            if dt in _DISPATCH_KEY:
                self.covered[dt] = _register_apex_lists(self._lib, dt, self.allow_banned)
                if self.verbose:
                    print(f"amp O1 ({dt}): Apex-list kernels for {', '.join(self.covered[dt])}")
        self._patch_python()
        self.active = True

    def deactivate(self) -> None:
        """Undo :meth:`activate`: restore autocast's previous state, remove kernels and patches."""
        if not self.active:
            return
        self.active = False
        for owner, name, had_own, old in reversed(self._patches):
            if had_own:
                setattr(owner, name, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
        self._patches = []
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None
        for dt, enabled, dtype in self._saved:
            torch.set_autocast_enabled(dt, enabled)
            torch.set_autocast_dtype(dt, dtype)
        torch.set_autocast_cache_enabled(self._saved_cache)

    # ------------------------------------------------------------------------------ queries

    def casts_active_for(self, t: Tensor) -> bool:
        """True when O1 casts ``t`` now: engine on, ``t``'s device type covered, casts not disabled."""
        dt = t.device.type
        return self.active and dt in self.device_types and torch.is_autocast_enabled(dt)

    def is_active(self) -> bool:
        """True when the engine is on and casting is not disabled for its first device type."""
        return self.active and torch.is_autocast_enabled(self.device_types[0])

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Turn casting off inside the block (``amp.disable_casts``)."""
        with contextlib.ExitStack() as stack:
            for dt in self.device_types:
                stack.enter_context(torch.autocast(dt, enabled=False))
            yield

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Context for an initialized model's forward: autocast entered, so its cast cache lives for
        one forward and is cleared on exit (torch.autocast's caching rule)."""
        if not self.active:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for dt in self.device_types:
            if torch.is_autocast_enabled(dt):
                stack.enter_context(torch.autocast(dt, dtype=torch.get_autocast_dtype(dt),
                                                   cache_enabled=self.enable_caching))
        return stack

    # ------------------------------------------------------------------------- Python patches

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        had_own = name in vars(owner)
        old = vars(owner)[name] if had_own else None
        setattr(owner, name, new)
        self._patches.append((owner, name, had_own, old))

    def apply_registration(self, module: Any, name: str, policy: str) -> None:
        """Patch ``module.name`` with a cast wrapper (user registrations made while O1 is active)."""
        orig = getattr(module, name)
        self._patch(module, name, make_cast_wrapper(orig, policy))

    def _patch_python(self) -> None:
        for modname, name in lists.PYTHON_FP32:
            mod = importlib.import_module(modname)
            if hasattr(mod, name):
                self.apply_registration(mod, name, "float")
        for module, name, policy in USER_CAST_REGISTRY:
            self.apply_registration(module, name, policy)
        # Backward passes never cast (as with Apex's Python patches, which autograd never called):
        # autocast state would otherwise reach the backward ops through autograd's thread-local state.
        for name in ("backward", "grad"):
            self._patch(torch.autograd, name, _without_casts(getattr(torch.autograd, name), self))
        orig_cpu = torch.Tensor.cpu
        engine = self

        @functools.wraps(orig_cpu)
        def cpu(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            # As in Apex: a 16-bit tensor on an accelerator is cast to fp32 before the transfer.
            if self.dtype in LOW_DTYPES and self.device.type != "cpu" and engine.casts_active_for(self):
                return orig_cpu(self.float(), *args, **kwargs)
            return orig_cpu(self, *args, **kwargs)

        self._patch(torch.Tensor, "cpu", cpu)
