"""``apex.transformer.testing.global_vars``: the process-wide Megatron-style state of Apex's model tests.

``set_global_variables`` parses the command line once (see :mod:`.arguments`) and creates the timers;
``get_args`` / ``get_timers`` hand them out; ``get_num_microbatches`` and friends read the microbatch
calculator, which (as in Apex) is built only on request through ``_build_num_microbatches_calculator``.
The getters raise ``RuntimeError`` (an ``AssertionError`` subclass too, as Apex asserted) naming the
missing variable when it was never set.

Beyond Apex: ``destroy_global_vars`` resets everything, so one process can set the variables again
(Apex's tests could not).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from culmen.transformer.microbatches import NumMicroBatchesCalculator, build_num_microbatches_calculator
from culmen.transformer.pipeline_parallel._timers import _Timers as Timers
from culmen.transformer.testing.arguments import parse_args

__all__ = [
    "GlobalVariableError",
    "Timers",
    "destroy_global_vars",
    "get_adlr_autoresume",
    "get_args",
    "get_current_global_batch_size",
    "get_num_microbatches",
    "get_tensorboard_writer",
    "get_timers",
    "set_global_variables",
    "update_num_microbatches",
]

_GLOBAL_ARGS: argparse.Namespace | None = None
_GLOBAL_NUM_MICROBATCHES_CALCULATOR: NumMicroBatchesCalculator | None = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_ADLR_AUTORESUME = None
_GLOBAL_TIMERS: Timers | None = None


class GlobalVariableError(RuntimeError, AssertionError):
    """A global variable read before it was set, or set twice (Apex asserted: also an ``AssertionError``)."""


def _ensure_var_is_initialized(var: Any, name: str) -> None:
    if var is None:
        raise GlobalVariableError(f"{name} is not initialized (call set_global_variables first)")


def _ensure_var_is_not_initialized(var: Any, name: str) -> None:
    if var is not None:
        raise GlobalVariableError(f"{name} is already initialized (call destroy_global_vars to reset)")


def get_args() -> argparse.Namespace:
    """The parsed arguments (a mutable ``argparse.Namespace``; tests edit fields such as
    ``padded_vocab_size`` in place)."""
    _ensure_var_is_initialized(_GLOBAL_ARGS, "args")
    return _GLOBAL_ARGS


def _calculator() -> NumMicroBatchesCalculator:
    _ensure_var_is_initialized(_GLOBAL_NUM_MICROBATCHES_CALCULATOR, "num microbatches calculator")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def get_num_microbatches() -> int:
    """Microbatches per global batch, from this module's calculator."""
    return _calculator().get()


def get_current_global_batch_size() -> int:
    """The current global batch size (grows during a batch-size ramp-up)."""
    return _calculator().get_current_global_batch_size()


def update_num_microbatches(consumed_samples: int, *, consistency_check: bool = True) -> None:
    """Advance a ramp-up calculator to ``consumed_samples``; a constant calculator ignores it.

    Args:
        consumed_samples: samples consumed so far (``iterations * global_batch_size``).
        consistency_check: check that the current global batch size divides by
            ``micro_batch_size * data_parallel_size``.
    """
    _calculator().update(consumed_samples, consistency_check)


def get_tensorboard_writer() -> Any:
    """The TensorBoard ``SummaryWriter``, or ``None`` (no ``--tensorboard-dir``, or not the last rank)."""
    return _GLOBAL_TENSORBOARD_WRITER


def get_adlr_autoresume() -> Any:
    """ADLR's auto-resume hook: always ``None`` (``--adlr-autoresume`` is refused, as in Apex)."""
    return _GLOBAL_ADLR_AUTORESUME


def get_timers() -> Timers:
    """The process-wide timers: ``get_timers()(name).start() / .stop() / .elapsed()``, ``.log(names)``."""
    _ensure_var_is_initialized(_GLOBAL_TIMERS, "timers")
    return _GLOBAL_TIMERS


def set_global_variables(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    args_defaults: dict[str, Any] | None = None,
    override_args: dict[str, Any] | None = None,
    ignore_unknown_args: bool = False,
    *,
    args: list[str] | None = None,
) -> None:
    """Parse the arguments and set the TensorBoard writer, auto-resume hook and timers (once).

    Args:
        extra_args_provider: adds arguments to the parser and returns it.
        args_defaults: values for arguments the command line left at ``None``.
        override_args: values set on the namespace whatever the command line says.
        ignore_unknown_args: ignore arguments the parser does not know (pytest's, a launcher's).
        args: parse this list instead of ``sys.argv[1:]`` (culmen addition).

    Raises:
        GlobalVariableError: the variables are already set.
    """
    parsed = _parse_args(extra_args_provider, args_defaults or {}, override_args or {}, ignore_unknown_args,
                         args)
    _set_tensorboard_writer(parsed)
    _set_adlr_autoresume(parsed)
    _set_timers()


def destroy_global_vars() -> None:
    """Forget the arguments, calculator, writer and timers so ``set_global_variables`` may run again."""
    global _GLOBAL_ARGS, _GLOBAL_NUM_MICROBATCHES_CALCULATOR, _GLOBAL_TOKENIZER
    global _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_ADLR_AUTORESUME, _GLOBAL_TIMERS
    _GLOBAL_ARGS = _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _GLOBAL_TOKENIZER = None
    _GLOBAL_TENSORBOARD_WRITER = _GLOBAL_ADLR_AUTORESUME = _GLOBAL_TIMERS = None


def _parse_args(extra_args_provider, defaults, override_args, ignore_unknown_args, args=None):
    global _GLOBAL_ARGS
    _ensure_var_is_not_initialized(_GLOBAL_ARGS, "args")
    _GLOBAL_ARGS = parse_args(extra_args_provider=extra_args_provider, defaults=defaults,
                              override_args=override_args, ignore_unknown_args=ignore_unknown_args, args=args)
    return _GLOBAL_ARGS


def _build_num_microbatches_calculator(args: argparse.Namespace) -> None:
    """Build this module's microbatch calculator from ``args`` (``rampup_batch_size``,
    ``global_batch_size``, ``micro_batch_size``, ``data_parallel_size``)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _ensure_var_is_not_initialized(_GLOBAL_NUM_MICROBATCHES_CALCULATOR, "num microbatches calculator")
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        args.rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size, args.data_parallel_size)


def _set_tensorboard_writer(args: argparse.Namespace) -> None:
    global _GLOBAL_TENSORBOARD_WRITER
    _ensure_var_is_not_initialized(_GLOBAL_TENSORBOARD_WRITER, "tensorboard writer")
    if getattr(args, "tensorboard_dir", None) and args.rank == args.world_size - 1:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ModuleNotFoundError:
            print("WARNING: TensorBoard writing requested but is not available (install tensorboard), "
                  "no TensorBoard logs will be written.", flush=True)
            return
        print("> setting tensorboard ...", flush=True)
        _GLOBAL_TENSORBOARD_WRITER = SummaryWriter(log_dir=args.tensorboard_dir,
                                                   max_queue=args.tensorboard_queue_size)


def _set_adlr_autoresume(args: argparse.Namespace) -> None:
    _ensure_var_is_not_initialized(_GLOBAL_ADLR_AUTORESUME, "adlr autoresume")
    if args.adlr_autoresume:
        # Apex asserted this off too: the hook lives in NVIDIA's internal cluster library.
        raise ValueError("adlr_autoresume=True is not supported (ADLR's auto-resume library is NVIDIA-internal)")


def _set_timers() -> None:
    global _GLOBAL_TIMERS
    _ensure_var_is_not_initialized(_GLOBAL_TIMERS, "timers")
    _GLOBAL_TIMERS = Timers()
