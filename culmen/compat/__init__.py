"""Opt-in import aliases: unmodified scripts that ``import apex`` / ``import flash_attn`` run on culmen.

``install()`` puts a finder at the front of ``sys.meta_path`` that maps module names by prefix:

* ``apex`` → ``culmen`` and ``apex.X.Y`` → ``culmen.X.Y``
* ``flash_attn`` → ``culmen.flash_attn`` and ``flash_attn.X`` → ``culmen.flash_attn.X``
* Apex's compiled extension names (``EXTENSION_MODULES``, e.g. ``amp_C``) → the culmen module
  providing the same functions.

The mapping is generic, so whatever culmen implements is reachable under the peer's name, and the
alias is the very same module object (``sys.modules["apex.normalization"] is culmen.normalization``).
A name culmen lacks fails as a normal ``ModuleNotFoundError``. A really installed ``apex`` or
``flash_attn`` is never shadowed unless ``install(force=True)``.

From the command line: ``python -m culmen.compat script.py ARGS...`` or
``python -m culmen.compat -m package.module ARGS...``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["ALIASES", "EXTENSION_MODULES", "child_args", "install", "installed", "uninstall"]

# Peer package prefix -> culmen prefix.
ALIASES: dict[str, str] = {
    "apex": "culmen",
    "flash_attn": "culmen.flash_attn",
    "flash_attn_interface": "culmen.flash_attn_3",
}

# Apex / flash_attn compiled extension modules that culmen provides in Python, e.g.
# "amp_C": "culmen.multi_tensor_apply.amp_C". Added as culmen implements them.
EXTENSION_MODULES: dict[str, str] = {
    "amp_C": "culmen.multi_tensor_apply.amp_C",
    "scaled_masked_softmax_cuda": "culmen.transformer.functional._ext.scaled_masked_softmax_cuda",
    "scaled_upper_triang_masked_softmax_cuda":
        "culmen.transformer.functional._ext.scaled_upper_triang_masked_softmax_cuda",
    "scaled_softmax_cuda": "culmen.transformer.functional._ext.scaled_softmax_cuda",
    "generic_scaled_masked_softmax_cuda": "culmen.transformer.functional._ext.generic_scaled_masked_softmax_cuda",
    "fused_rotary_positional_embedding": "culmen.transformer.functional._ext.fused_rotary_positional_embedding",
    "xentropy_cuda": "culmen.contrib.xentropy.xentropy_cuda",
    "mlp_cuda": "culmen.mlp.mlp_cuda",
    "fused_dense_cuda": "culmen.fused_dense.fused_dense_cuda",
    "fused_dense_lib": "culmen.fused_dense.fused_dense_cuda",
    "focal_loss_cuda": "culmen.contrib.focal_loss.focal_loss_cuda",
    "fused_index_mul_2d": "culmen.contrib.index_mul_2d.fused_index_mul_2d",
    "group_norm_cuda": "culmen.contrib.group_norm.group_norm_cuda",
    "group_norm_v2_cuda": "culmen.contrib.group_norm.group_norm_v2_cuda",
    "flash_attn_2_cuda": "culmen.flash_attn.flash_attn_2_cuda",
    "fast_layer_norm": "culmen.contrib.layer_norm.fast_layer_norm",
    "_apex_gpu_direct_storage": "culmen.contrib.gpu_direct_storage._apex_gpu_direct_storage",
    "_apex_nccl_allocator": "culmen.contrib.nccl_allocator._apex_nccl_allocator",
}


def _target(name: str, table: dict[str, str]) -> str | None:
    root, dot, rest = name.partition(".")
    prefix = table.get(root)
    if prefix is None:
        return None
    return prefix + dot + rest


class _AliasLoader(importlib.abc.InspectLoader):
    """Hands back the already-importable culmen module instead of creating a new one.

    It also answers ``get_code`` / ``get_source`` / ``is_package`` / ``get_filename`` for the peer name
    with the culmen module's, so ``runpy`` (``python -m apex.parallel.multiproc``, ``runpy.run_module``)
    runs culmen's code under the peer's name, as it runs any other module.
    """

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        # The import machinery overwrites __spec__ of whatever create_module returns; remember the
        # real one so exec_module can put it back and culmen's module keeps its identity.
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        if self._spec is not None:
            module.__spec__ = self._spec

    def _target_loader(self):
        spec = importlib.util.find_spec(self.target)
        if spec is None or spec.loader is None:
            raise ImportError(f"culmen.compat: {self.target!r} has no loader", name=self.target)
        return spec.loader

    def is_package(self, fullname: str) -> bool:
        return self._target_loader().is_package(self.target)

    def get_code(self, fullname: str):
        return self._target_loader().get_code(self.target)

    def get_source(self, fullname: str):
        return self._target_loader().get_source(self.target)

    def get_filename(self, fullname: str) -> str:
        return self._target_loader().get_filename(self.target)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Maps peer module names to culmen modules (see the module docstring)."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table = table

    def find_spec(self, fullname, path=None, target=None):
        culmen_name = _target(fullname, self.table)
        if culmen_name is None:
            return None
        try:
            found = importlib.util.find_spec(culmen_name)
        except (ImportError, ValueError):
            found = None
        if found is None:
            # Not provided by culmen (yet): let the import fail the ordinary way.
            return None
        spec = importlib.machinery.ModuleSpec(
            fullname,
            _AliasLoader(culmen_name),
            origin=found.origin,
            is_package=found.submodule_search_locations is not None,
        )
        spec.has_location = found.has_location  # runpy sets __file__ from origin only when True
        return spec


_FINDER: _AliasFinder | None = None
_FORCED = False  # the last install() was forced: children started through the alias are forced too


def installed() -> dict[str, str]:
    """The active alias table (peer prefix → culmen prefix); empty when not installed."""
    return dict(_FINDER.table) if _FINDER is not None else {}


def _is_alias_module(name: str) -> bool:
    mod = sys.modules.get(name)
    return mod is not None and getattr(mod, "__name__", "").startswith("culmen")


def _really_installed(root: str) -> bool:
    """True when ``root`` imports as something other than a culmen alias, with our finder out of the way."""
    if root in sys.modules:
        return not _is_alias_module(root)
    try:
        return importlib.util.find_spec(root) is not None
    except (ImportError, ValueError):
        return False


def install(force: bool = False) -> dict[str, str]:
    """Install the alias finder; return the table it maps (peer prefix → culmen prefix).

    Args:
        force: alias a peer name even when a real package of that name is installed. Modules the
            real package already put in ``sys.modules`` stay as they are either way.

    Peers found installed are left out with a ``UserWarning``. Calling ``install`` again re-checks.
    """
    global _FINDER, _FORCED
    uninstall(purge=False)
    _FORCED = bool(force)
    table: dict[str, str] = {}
    for peer, target in {**ALIASES, **EXTENSION_MODULES}.items():
        if not force and _really_installed(peer):
            warnings.warn(
                f"culmen.compat: a real {peer!r} is installed; not aliasing it to {target!r} "
                "(culmen.compat.install(force=True) overrides)",
                stacklevel=2,
            )
            continue
        table[peer] = target
    _FINDER = _AliasFinder(table)
    sys.meta_path.insert(0, _FINDER)
    return dict(table)


def child_args() -> list[str]:
    """Options of ``python -m culmen.compat`` that give a child process this process's alias (launchers
    such as ``culmen.parallel.multiproc`` start their workers with them): ``["--force"]`` after
    ``install(force=True)``, else ``[]``."""
    return ["--force"] if _FINDER is not None and _FORCED else []


def uninstall(purge: bool = True) -> None:
    """Remove the alias finder. With ``purge`` also drop aliased names from ``sys.modules``.

    The culmen modules themselves stay imported under their own names.
    """
    global _FINDER
    if _FINDER is None:
        return
    table = _FINDER.table
    sys.meta_path[:] = [f for f in sys.meta_path if f is not _FINDER]
    _FINDER = None
    if purge:
        for name in list(sys.modules):
            if name.partition(".")[0] in table and _is_alias_module(name):
                del sys.modules[name]
