"""Load a Hugging Face checkpoint's state dict without building its model (flash_attn.utils.pretrained).

Differences from flash_attn 2.8, each a fix: safetensors files are preferred over ``pytorch_model.bin``
when a folder has both (same weights, no pickle; transformers prefers them too); hub names find
safetensors checkpoints as well (flash_attn looked only for ``.bin`` files on the hub); ``dtype``
converts floating-point tensors only (integer or boolean buffers keep their dtype); errors are
``OSError`` naming what was tried.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["state_dict_from_pretrained"]

WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# Looked for in this order; the first one present wins.
_CANDIDATES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)


class _HubUnavailable(OSError):
    """The name is not a hub repository we can reach (no huggingface_hub, bad id, no network, no repo)."""


class _NotCached(OSError):
    """The hub cannot be asked (offline or unreachable) and the file is not in the local cache."""


def _hub_file(repo_id: str, filename: str) -> str | None:
    """The local path of ``filename`` of hub repository ``repo_id`` (downloaded or cached), or None
    when the repository has no such file. Raises ``_HubUnavailable`` when the repository cannot be
    reached at all, and ``_NotCached`` when the hub is offline or unreachable and the file is not in
    the local cache."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError as exc:
        raise _HubUnavailable("huggingface_hub is not installed") from exc
    try:
        return hf_hub_download(repo_id, filename)
    except LocalEntryNotFoundError as exc:
        raise _NotCached(str(exc)) from exc
    except EntryNotFoundError:
        return None
    except (HFValidationError, RepositoryNotFoundError) as exc:
        raise _HubUnavailable(str(exc)) from exc
    except Exception as exc:  # connection errors, HTTP errors, gated repositories
        raise _HubUnavailable(f"{type(exc).__name__}: {exc}") from exc


def _resolve(model_name: str) -> tuple[str, Callable[[str], str]]:
    """``(first checkpoint file found, function resolving a sibling file name to a path)``."""
    if os.path.isdir(model_name):
        for name in _CANDIDATES:
            path = os.path.join(model_name, name)
            if os.path.isfile(path):
                return path, lambda sibling: os.path.join(model_name, sibling)
        raise OSError(f"model_name: directory {model_name!r} has none of {', '.join(_CANDIDATES)}")
    try:
        not_cached = None
        for name in _CANDIDATES:
            try:
                path = _hub_file(model_name, name)
            except _NotCached as exc:
                not_cached, path = exc, None
            if path is not None:
                break
        else:
            if not_cached is not None:
                raise _HubUnavailable(f"offline or unreachable, and not in the local cache: {not_cached}")
            raise OSError(f"model_name: hub repository {model_name!r} has none of {', '.join(_CANDIDATES)}")
    except _HubUnavailable as exc:
        raise OSError(
            f"model_name: {model_name!r} is not a local directory and was not found on the Hugging Face hub ({exc})"
        ) from exc

    def sibling(name: str) -> str:
        found = _hub_file(model_name, name)
        if found is None:
            raise OSError(f"model_name: hub repository {model_name!r} lists shard {name!r} but does not have it")
        return found

    return path, sibling


def _load_file(path: str, device: str) -> dict[str, Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device=device)
    return torch.load(path, map_location=device, weights_only=True)


def state_dict_from_pretrained(
    model_name: str | os.PathLike, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """The state dict of a Hugging Face checkpoint, as saved (no key remapping).

    Args:
        model_name: a local directory holding ``model.safetensors``, ``model.safetensors.index.json``
            (sharded), ``pytorch_model.bin`` or ``pytorch_model.bin.index.json`` (looked for in that
            order), or a hub repository id, resolved through ``huggingface_hub`` (its cache, or a
            download when the hub is reachable).
        device: where the tensors end up (default: the CPU).
        dtype: if given, floating-point tensors are converted to it. When it is not float32 they are
            converted on the CPU before moving to ``device``, so a large fp32 checkpoint is never
            materialised in fp32 on the GPU.

    Returns:
        ``{name: tensor}`` over every shard.

    Raises:
        TypeError: ``model_name`` is not a string or path, or ``dtype`` is not a torch.dtype.
        OSError: nothing loadable was found (the message lists what was tried).
    """
    if not isinstance(model_name, (str, os.PathLike)):
        raise TypeError(f"model_name must be a str or os.PathLike, got {type(model_name).__name__}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    model_name = os.fspath(model_name)
    # Straight onto an accelerator only when no conversion follows; anything else (including the
    # meta device, which the file readers cannot target) is read on the CPU first.
    target = torch.device(device) if device is not None else None
    direct = target is not None and target.type not in ("cpu", "meta") and dtype in (None, torch.float32)
    load_device = str(target) if direct else "cpu"

    path, sibling = _resolve(model_name)
    if path.endswith(".index.json"):
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        state_dict: dict[str, Tensor] = {}
        # dict.fromkeys keeps the index's shard order and visits each shard once
        for shard in dict.fromkeys(weight_map.values()):
            state_dict.update(_load_file(sibling(shard), load_device))
    else:
        state_dict = _load_file(path, load_device)

    if dtype is not None:
        state_dict = {k: v.to(dtype=dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    if target is not None:
        state_dict = {k: v.to(device=target) for k, v in state_dict.items()}
    return state_dict
