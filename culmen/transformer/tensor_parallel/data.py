"""``broadcast_data``: send a batch from tensor-parallel rank 0 to the other ranks of its TP group."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from culmen.transformer import parallel_state

__all__ = ["broadcast_data"]

_MAX_DATA_DIM = 5

# Error codes rank 0 puts into the size broadcast, so that every rank raises instead of the others
# waiting for a data broadcast that never comes.
_OK, _BAD_DTYPE, _TOO_MANY_DIMS = 0, 1, 2


def _device_for(group) -> torch.device:
    """CPU for gloo (and other CPU backends), the current CUDA device for NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_data(keys: Sequence[str], data: dict[str, Tensor] | None, datatype: torch.dtype) -> dict[str, Tensor]:
    """Broadcast ``data[key]`` for every key from TP rank 0 to its tensor-parallel group.

    Args:
        keys: the keys to send, in the same order on every rank.
        data: on TP rank 0, a dict holding a tensor (at most 5-D, dtype ``datatype``, any device) for
            each key; ignored on the other ranks (may be ``None``).
        datatype: the dtype of every tensor.

    Returns:
        ``{key: tensor}`` on every rank, views of one flat buffer on the group's device (the current CUDA
        device for NCCL, the CPU for gloo). A dtype or rank error on TP rank 0 raises (``TypeError`` /
        ``ValueError``, naming the key) on every rank of the group.
    """
    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    is_src = parallel_state.get_tensor_model_parallel_rank() == 0
    device = _device_for(group)
    keys = list(keys)
    row = 1 + _MAX_DATA_DIM
    # [status, bad key index, then per key: ndim, size_0..size_4]
    meta = torch.zeros(2 + row * len(keys), dtype=torch.long)
    if is_src:
        for k, key in enumerate(keys):
            t = data[key]
            if t.dtype != datatype:
                meta[0], meta[1] = _BAD_DTYPE, k
                break
            if t.dim() > _MAX_DATA_DIM:
                meta[0], meta[1] = _TOO_MANY_DIMS, k
                break
            meta[2 + k * row] = t.dim()
            meta[3 + k * row:3 + k * row + t.dim()] = torch.tensor(t.shape, dtype=torch.long)
    meta_dev = meta.to(device)
    dist.broadcast(meta_dev, src, group=group)
    meta = meta_dev.cpu().tolist()
    if meta[0] != _OK:
        key = keys[meta[1]]
        if meta[0] == _BAD_DTYPE:
            what = f" ({data[key].dtype})" if is_src else ""
            raise TypeError(f"broadcast_data: {key!r} has a data type{what} different from datatype={datatype}")
        raise ValueError(f"broadcast_data: {key!r} has more than {_MAX_DATA_DIM} dimensions")

    shapes = []
    for k in range(len(keys)):
        ndim = meta[2 + k * row]
        shapes.append(tuple(meta[3 + k * row:3 + k * row + ndim]))
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if is_src:
        flat = torch.cat([data[key].reshape(-1).to(device) for key in keys]) if keys else \
            torch.empty(0, dtype=datatype, device=device)
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src, group=group)

    out: dict[str, Tensor] = {}
    offset = 0
    for key, shape, n in zip(keys, shapes, numels):
        out[key] = flat.narrow(0, offset, n).view(shape)
        offset += n
    return out
