"""``apex.contrib.openfold_triton``: OpenFold's fused LayerNorm, attention with a pair bias (MSA and
triangle attention) and fused Adam + SWA step, on culmen's Triton kernels.

Names as in Apex: ``LayerNormSmallShapeOptImpl``, ``AttnBiasJIT``, ``AttnNoBiasJIT``, ``AttnTri``,
``CanSchTriMHA`` (and the ``mha`` switches ``mha.enable()`` / ``mha.disable()`` / ``mha.is_enabled()``),
``sync_triton_auto_tune_cache_across_gpus``; ``FusedAdamSWA`` / ``AdamMathType`` live in
``fused_adam_swa`` (re-exported here for convenience).

Tuning caches. Apex autotunes its LayerNorm kernels per shape and keeps Triton ``Autotuner.cache``
dicts; ``sync_triton_auto_tune_cache_across_gpus`` copies rank 0's into every rank so all ranks run the
same configurations. culmen does not autotune at run time: each op family keeps its tile rules in a
``TUNING`` table (``culmen.ops.common.launch.PlanTuning``) from which plans derive every launch
configuration. ``_tuneable_triton_kernels`` maps a name to each table this package's kernels use (its
``.cache`` is the table), and the sync broadcasts rank 0's tables, so every rank launches identical
configurations (same numerics) even when a rank's tables were changed by a sweep.
"""

from __future__ import annotations

import json
import warnings
from collections import OrderedDict
from io import BytesIO
from typing import BinaryIO

import torch

from culmen.contrib.openfold_triton import mha
from culmen.contrib.openfold_triton.fused_adam_swa import AdamMathType, FusedAdamSWA
from culmen.contrib.openfold_triton.layer_norm import LayerNormSmallShapeOptImpl
from culmen.contrib.openfold_triton.mha import AttnBiasJIT, AttnNoBiasJIT, AttnTri, CanSchTriMHA

__all__ = (
    "LayerNormSmallShapeOptImpl",
    "sync_triton_auto_tune_cache_across_gpus",
    "CanSchTriMHA",
    "AttnTri",
    "AttnBiasJIT",
    "AttnNoBiasJIT",
    "AdamMathType",
    "FusedAdamSWA",
    "mha",
)


class _TuningTable:
    """A named ``TUNING`` table seen the way Apex's code sees an autotuned kernel: ``.cache`` is the dict."""

    def __init__(self, name: str, module: str) -> None:
        self.__name__ = name
        self._module = module

    @property
    def cache(self) -> dict:
        import importlib

        return importlib.import_module(self._module).TUNING


_tuneable_triton_kernels = OrderedDict(
    (name, _TuningTable(name, module)) for name, module in (
        ("layer_norm", "culmen.ops.layer_norm.launch"),
        ("pair_attention", "culmen.ops.pair_attention.launch"),
    )
)


def _save_triton_auto_tune_cache(strict: bool = True, verbose: bool = False) -> BytesIO:
    """The tables of ``_tuneable_triton_kernels`` as a JSON file in memory (``strict``: an empty table raises)."""
    caches = OrderedDict()
    for name, table in _tuneable_triton_kernels.items():
        values = dict(table.cache)
        if not values:
            msg = f"tuning table {name} is empty"
            if strict:
                raise ValueError(msg)
            warnings.warn(msg, stacklevel=2)
            continue
        caches[name] = values
    f = BytesIO(json.dumps(caches).encode("utf-8"))
    if verbose:
        print(f"culmen tuning tables written to {f}")
    return f


def _load_triton_auto_tune_cache(f: BinaryIO, strict: bool = True, verbose: bool = False) -> None:
    """Load tables saved by ``_save_triton_auto_tune_cache`` (``strict``: the names must match exactly)."""
    caches = json.load(f)
    names = set(_tuneable_triton_kernels)
    if strict and set(caches) != names:
        raise ValueError(f"tuning tables do not match the cache file {f}: missing {names - set(caches)}, "
                         f"unexpected {set(caches) - names}")
    for name, values in caches.items():
        if name not in _tuneable_triton_kernels:
            raise ValueError(f"{name} from {f} does not match any tuning table")
        table = _tuneable_triton_kernels[name].cache
        # JSON turns tuples into lists: restore the table's own types.
        new = {k: (tuple(v) if isinstance(table.get(k), tuple) and isinstance(v, list) else v)
               for k, v in values.items()}
        if any(table.get(k) != v for k, v in new.items()):
            table.update(new)  # drops the cached plans built from the old values
    if verbose:
        print(f"culmen tuning tables loaded from {f}")


def sync_triton_auto_tune_cache_across_gpus(strict: bool = True, verbose: bool = False) -> None:
    """Broadcast rank 0's tuning tables (see the module docstring) to every rank of the default process group.

    A no-op when ``torch.distributed`` is not initialized. Collective: every rank must call it.
    ``strict``: an empty table (rank 0) or a table name mismatch (other ranks) raises ``ValueError``;
    ``verbose`` prints what was written and loaded.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    rank = torch.distributed.get_rank()
    if rank == 0:
        payload = [_save_triton_auto_tune_cache(strict=strict, verbose=verbose).getvalue()]
    else:
        payload = [None]
    torch.distributed.broadcast_object_list(payload, src=0)
    if rank != 0:
        _load_triton_auto_tune_cache(BytesIO(payload[0]), strict=strict, verbose=verbose)
