"""Megatron-style batch samplers that shard a dataset over data-parallel ranks and resume mid-epoch.

Both are ``batch_sampler`` objects for ``torch.utils.data.DataLoader``: each iteration step yields this
rank's *local minibatch* (a list of ``local_minibatch_size`` dataset indices; ``local_minibatch_size =
global_batch_size / data_parallel_size``). ``consumed_samples`` counts samples over all data-parallel
ranks, so a run that saved it resumes exactly where it stopped.

Differences from Apex, on purpose:

- :class:`MegatronPretrainingSampler` with ``data_parallel_size > 1`` gives each rank its own slice of
  every global batch (Apex grouped only ``local_minibatch_size`` indices per step, so ranks > 0
  received empty batches; with one data-parallel rank the two agree).
- Bad arguments raise :class:`SamplerArgumentError`, a ``ValueError`` that is also a ``RuntimeError``
  (Apex's sequential sampler raised ``RuntimeError``, its random sampler ``ValueError``).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

import torch

__all__ = ["MegatronPretrainingSampler", "MegatronPretrainingRandomSampler", "SamplerArgumentError"]


class SamplerArgumentError(ValueError, RuntimeError):
    """A sampler argument is out of range (a ``ValueError``; also a ``RuntimeError`` as in Apex)."""


def _check(total_samples: int, consumed_samples: int, local_minibatch_size: int, data_parallel_rank: int,
           data_parallel_size: int) -> None:
    if total_samples <= 0:
        raise SamplerArgumentError(f"no sample to consume: total_samples={total_samples}")
    if consumed_samples < 0:
        raise SamplerArgumentError(f"consumed_samples must be >= 0, got {consumed_samples}")
    if local_minibatch_size <= 0:
        raise SamplerArgumentError(f"local_minibatch_size must be greater than 0, got {local_minibatch_size}")
    if data_parallel_size <= 0:
        raise SamplerArgumentError(f"data_parallel_size must be greater than 0, got {data_parallel_size}")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise SamplerArgumentError(
            f"data_parallel_rank ({data_parallel_rank}) must be in [0, data_parallel_size={data_parallel_size})")


class _Base(abc.ABC):
    """A Megatron-style batch sampler: ``__iter__`` yields local minibatches of dataset indices."""

    data_parallel_size: int

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __iter__(self) -> Iterator[list[int]]: ...

    @property
    def local_minibatch_size(self) -> int:
        """Indices per yielded batch; setting it (batch-size ramp-up) also updates the global step size."""
        return self._local_minibatch_size

    @local_minibatch_size.setter
    def local_minibatch_size(self, new_local_minibatch_size: int) -> None:
        if new_local_minibatch_size <= 0:
            raise SamplerArgumentError(f"local_minibatch_size must be greater than 0, got {new_local_minibatch_size}")
        self._local_minibatch_size = new_local_minibatch_size
        self.local_minibatch_times_data_parallel_size = new_local_minibatch_size * self.data_parallel_size


class MegatronPretrainingSampler(_Base):
    """Sequential sampler: global batches of consecutive indices from ``consumed_samples`` on, each rank
    taking its contiguous ``local_minibatch_size`` slice.

    Args:
        total_samples: ``len(dataset)``.
        consumed_samples: samples (over all DP ranks) already trained on; iteration starts there.
        local_minibatch_size: indices per yielded batch on this rank.
        data_parallel_rank: this rank's index in its data-parallel group.
        data_parallel_size: number of data-parallel ranks.
        drop_last: drop a final incomplete global batch; otherwise each rank gets its slice of it
            (possibly shorter, or empty for the last ranks).
    """

    def __init__(self, total_samples: int, consumed_samples: int, local_minibatch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True) -> None:
        _check(total_samples, consumed_samples, local_minibatch_size, data_parallel_rank, data_parallel_size)
        if consumed_samples >= total_samples:
            raise SamplerArgumentError(
                f"no samples left to consume: consumed_samples={consumed_samples}, total_samples={total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self._local_minibatch_size = local_minibatch_size
        self.local_minibatch_times_data_parallel_size = local_minibatch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self) -> tuple[int, int]:
        """This rank's ``[start, end)`` inside a global batch."""
        start = self.data_parallel_rank * self.local_minibatch_size
        return start, start + self.local_minibatch_size

    def __iter__(self) -> Iterator[list[int]]:
        # Sizes are read at every step: a ramp-up may change local_minibatch_size between batches.
        first = self.consumed_samples
        while first < self.total_samples:
            step = self.local_minibatch_times_data_parallel_size
            last = min(first + step, self.total_samples)
            if last - first < step and self.drop_last:
                return
            start, end = self.get_start_end_idx()
            yield list(range(first + start, min(first + end, last)))
            first = last


class MegatronPretrainingRandomSampler(_Base):
    """Random sampler: each rank owns a contiguous bucket of the dataset and walks a permutation of it
    seeded by the epoch; ``consumed_samples`` advances by a global batch per yielded batch.

    The epoch is ``consumed_samples // (total_samples - total_samples % (local_minibatch_size * dp))``;
    the permutation of epoch ``e`` is ``torch.randperm(bucket_size, generator=manual_seed(e))``, so a
    sampler rebuilt with a saved ``consumed_samples`` yields the remaining batches of the same epoch.
    An incomplete last batch is dropped. One ``__iter__`` covers (the rest of) one epoch.

    Args:
        total_samples: ``len(dataset)``.
        consumed_samples: samples (over all DP ranks) already trained on.
        local_minibatch_size: indices per yielded batch on this rank.
        data_parallel_rank: this rank's index in its data-parallel group.
        data_parallel_size: number of data-parallel ranks.
    """

    def __init__(self, total_samples: int, consumed_samples: int, local_minibatch_size: int,
                 data_parallel_rank: int, data_parallel_size: int) -> None:
        _check(total_samples, consumed_samples, local_minibatch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self._local_minibatch_size = local_minibatch_size
        self.local_minibatch_times_data_parallel_size = local_minibatch_size * data_parallel_size
        self.last_batch_size = total_samples % self.local_minibatch_times_data_parallel_size
        if total_samples - self.last_batch_size <= 0:
            raise SamplerArgumentError(
                f"total_samples ({total_samples}) is smaller than one global batch "
                f"(local_minibatch_size {local_minibatch_size} x data_parallel_size {data_parallel_size})")
        self.epoch = 0

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        epoch_samples = self.consumed_samples % active_total_samples
        bucket_size = (self.total_samples // self.local_minibatch_times_data_parallel_size) * self.local_minibatch_size
        bucket_offset = epoch_samples // self.data_parallel_size
        start = self.data_parallel_rank * bucket_size

        g = torch.Generator()
        g.manual_seed(self.epoch)
        order = torch.randperm(bucket_size, generator=g)[bucket_offset:]
        order = (order + start).tolist()
        # Sizes are read at every step: a ramp-up may change local_minibatch_size between batches.
        i = 0
        while i + self.local_minibatch_size <= len(order):
            batch = order[i:i + self.local_minibatch_size]
            i += self.local_minibatch_size
            self.consumed_samples += self.local_minibatch_times_data_parallel_size
            yield batch
