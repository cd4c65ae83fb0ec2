"""How many microbatches a global batch holds, constant or ramping up (Apex's ``apex.transformer.microbatches``).

``global_batch_size = num_microbatches * micro_batch_size * data_parallel_size``. The ramp-up calculator
grows the global batch from ``start_batch_size`` to ``global_batch_size`` in steps of
``batch_size_increment``, one step every ``ramup_samples / num_increments`` consumed samples.

Bad sizes raise :class:`~culmen.transformer.utils.DivisibilityError` (a ``ValueError`` that is also an
``AssertionError``, as Apex asserted) naming the numbers. Unlike Apex, a ramp-up whose start equals the
final size is allowed (constant from the start; Apex divided by zero).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from culmen.transformer.log_util import get_transformer_logger
from culmen.transformer.utils import DivisibilityError

__all__ = ["build_num_microbatches_calculator", "NumMicroBatchesCalculator", "ConstantNumMicroBatches",
           "RampupBatchsizeNumMicroBatches"]

_logger = get_transformer_logger(__name__)


def _positive(name: str, value, *, zero_ok: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero_ok else 1):
        raise DivisibilityError(f"{name} must be a {'non-negative' if zero_ok else 'positive'} int, got {value!r}")


def build_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: list[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> NumMicroBatchesCalculator:
    """A :class:`ConstantNumMicroBatches`, or with ``rampup_batch_size = [start, increment, ramp-up samples]``
    a :class:`RampupBatchsizeNumMicroBatches`; rank 0 logs the choice."""
    if rampup_batch_size is None:
        calculator: NumMicroBatchesCalculator = ConstantNumMicroBatches(
            global_batch_size, micro_batch_size, data_parallel_size)
        if rank == 0:
            _logger.info("setting number of micro-batches to constant %d", calculator.get())
        return calculator
    if len(rampup_batch_size) != 3:
        raise DivisibilityError(
            "rampup_batch_size must be [start batch size, batch size increment, ramp-up samples], "
            f"got {rampup_batch_size!r}")
    start, increment, samples = (int(v) for v in rampup_batch_size)
    if rank == 0:
        _logger.info("will use batch size rampup starting from global batch size %d to global batch size %d "
                     "with batch size increments %d over %d samples.", start, global_batch_size, increment, samples)
    return RampupBatchsizeNumMicroBatches(start, increment, samples, global_batch_size, micro_batch_size,
                                          data_parallel_size)


class NumMicroBatchesCalculator(ABC):
    """Holds ``num_micro_batches`` and ``current_global_batch_size``; ``update`` moves them on."""

    def __init__(self) -> None:
        self.num_micro_batches: int | None = None
        self.current_global_batch_size: int | None = None

    def get(self) -> int | None:
        """The current number of microbatches per global batch (per data-parallel rank)."""
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int | None:
        """The current global batch size (samples over all data-parallel ranks)."""
        return self.current_global_batch_size

    @abstractmethod
    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        """Recompute the sizes after ``consumed_samples`` samples were trained on."""


class ConstantNumMicroBatches(NumMicroBatchesCalculator):
    """``global_batch_size // (micro_batch_size * data_parallel_size)`` microbatches, always."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> None:
        super().__init__()
        _positive("global_batch_size", global_batch_size)
        _positive("micro_batch_size", micro_batch_size)
        _positive("data_parallel_size", data_parallel_size)
        per_step = micro_batch_size * data_parallel_size
        if global_batch_size % per_step != 0:
            raise DivisibilityError(
                f"global batch size ({global_batch_size}) is not divisible by micro batch size "
                f"({micro_batch_size}) times data parallel size ({data_parallel_size})")
        self.num_micro_batches = global_batch_size // per_step
        self.current_global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        """Nothing changes."""


class RampupBatchsizeNumMicroBatches(NumMicroBatchesCalculator):
    """Global batch ramp-up from ``start_batch_size`` to ``global_batch_size``.

    After ``consumed_samples`` samples the global batch is
    ``start_batch_size + floor(consumed_samples / (ramup_samples / num_increments)) * batch_size_increment``
    (``global_batch_size`` once ``consumed_samples > ramup_samples``), with
    ``num_increments = (global_batch_size - start_batch_size) / batch_size_increment``.
    """

    def __init__(self, start_batch_size: int, batch_size_increment: int, ramup_samples: int,
                 global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> None:
        super().__init__()
        _positive("start_batch_size", start_batch_size)
        _positive("batch_size_increment", batch_size_increment)
        _positive("ramup_samples", ramup_samples, zero_ok=True)
        _positive("global_batch_size", global_batch_size)
        _positive("micro_batch_size", micro_batch_size)
        _positive("data_parallel_size", data_parallel_size)
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.start_batch_size = start_batch_size
        self.global_batch_size = global_batch_size
        diff = global_batch_size - start_batch_size
        if diff < 0:
            raise DivisibilityError(
                f"start batch size ({start_batch_size}) exceeds the global batch size ({global_batch_size})")
        if diff % batch_size_increment != 0:
            raise DivisibilityError(
                f"expected global batch size interval ({diff}) to be divisible by global batch size "
                f"increment ({batch_size_increment})")
        self.batch_size_increment = batch_size_increment
        num_increments = diff // batch_size_increment
        self.ramup_samples = ramup_samples
        # No increments: the batch is already final (Apex divided by zero here).
        self.rampup_samples_per_increment = ramup_samples / num_increments if num_increments else float("inf")
        self.update(0, False)

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        """Set the global batch for ``consumed_samples``; with ``consistency_check``, require it to divide
        evenly into microbatches."""
        if consumed_samples > self.ramup_samples or self.rampup_samples_per_increment == 0:
            self.current_global_batch_size = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            self.current_global_batch_size = min(self.start_batch_size + steps * self.batch_size_increment,
                                                 self.global_batch_size)
        if consistency_check and self.current_global_batch_size % self.micro_batch_times_data_parallel_size:
            raise DivisibilityError(
                f"current global batch size ({self.current_global_batch_size}) is not divisible by "
                f"micro-batch-size ({self.micro_batch_size}) times data parallel size ({self.data_parallel_size})")
        self.num_micro_batches = self.current_global_batch_size // self.micro_batch_times_data_parallel_size
