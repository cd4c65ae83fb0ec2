"""Loggers of ``culmen.transformer`` (Apex's ``apex.transformer.log_util``).

Records from ``culmen.transformer.*`` loggers go to stderr through one handler whose format carries
the (data, tensor, pipeline, virtual pipeline) parallel ranks of the process, as Apex's ``apex``
logger does; they do not propagate to the root logger (Apex's behaviour), so they are not printed twice.
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["get_transformer_logger", "set_logging_level", "RankInfoFormatter"]

_ROOT_NAME = "culmen.transformer"
_lock = threading.Lock()
_handler: logging.Handler | None = None


class RankInfoFormatter(logging.Formatter):
    """A formatter that fills ``%(rank_info)s`` with ``parallel_state.get_rank_info()``."""

    def format(self, record: logging.LogRecord) -> str:
        # Imported here: parallel_state imports this module.
        from culmen.transformer.parallel_state import get_rank_info

        record.rank_info = get_rank_info()
        return super().format(record)


def _configure_root() -> None:
    global _handler
    with _lock:
        if _handler is not None:
            return
        handler = logging.StreamHandler()
        handler.setFormatter(RankInfoFormatter(
            "%(asctime)s - PID:%(process)d - rank:%(rank_info)s - %(filename)s:%(lineno)d - "
            "%(levelname)s - %(message)s", "%y-%m-%d %H:%M:%S"))
        root = logging.getLogger(_ROOT_NAME)
        root.addHandler(handler)
        root.propagate = False
        _handler = handler


def get_transformer_logger(name: str) -> logging.Logger:
    """The logger called ``name`` with any file extension removed (``"x/y.py"`` -> ``"x/y"``)."""
    _configure_root()
    return logging.getLogger(os.path.splitext(name)[0])


def set_logging_level(verbosity: int | str) -> None:
    """Set the level of culmen's library logger (``"culmen"``; Apex set ``"apex"``), e.g. ``logging.WARNING``."""
    logging.getLogger("culmen").setLevel(verbosity)
    logging.getLogger(_ROOT_NAME).setLevel(verbosity)
