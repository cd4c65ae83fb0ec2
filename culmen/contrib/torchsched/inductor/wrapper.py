"""``apex.contrib.torchsched.inductor.wrapper``: Apex's Inductor wrapper-code lines and code generator.

They only make sense inside Inductor's Python wrapper code generation, which culmen's torchsched does not use;
constructing any of them raises ``NotImplementedError`` naming what to use (the scheduled graph of
``culmen.contrib.torchsched.scheduler.build_scheduled_module`` holds culmen's stream switches and event
records/waits).
"""

from __future__ import annotations

from typing import Any

from culmen.contrib.torchsched.inductor._common import USE_INSTEAD

__all__ = ["EnterCudaStreamContextLine", "EnterDeviceContextManagerWithStreamInfoLine", "ExitCudaStreamContextLine",
           "ExitDeviceContextManagerWithStreamInfoLine", "MultiStreamWrapperCodegen", "RecordBuffFromSideStreams"]


def _unavailable(name: str):
    raise NotImplementedError(f"{name} (Inductor wrapper code generation): {USE_INSTEAD}")


class EnterDeviceContextManagerWithStreamInfoLine:
    """Apex: the device-guard line that also creates the side streams. Raises ``NotImplementedError``."""

    def __init__(self, device_idx: int, last_seen_device_guard_index: int | None = None) -> None:
        _unavailable(type(self).__name__)


class ExitDeviceContextManagerWithStreamInfoLine:
    """Apex: the matching device-guard exit line. Raises ``NotImplementedError``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _unavailable(type(self).__name__)


class EnterCudaStreamContextLine:
    """Apex: ``with torch.cuda.stream(...)`` plus the event waits before a node. Raises ``NotImplementedError``."""

    def __init__(self, wrapper: Any, stream_idx: int, upstream_events: set, buffers_from_other_streams: set[str],
                 buffers_requiring_device_check: set[str]) -> None:
        _unavailable(type(self).__name__)


class ExitCudaStreamContextLine:
    """Apex: the end of a stream context. Raises ``NotImplementedError``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _unavailable(type(self).__name__)


class RecordBuffFromSideStreams:
    """Apex: ``record_stream`` of returned side-stream buffers on the default stream. Raises
    ``NotImplementedError``."""

    def __init__(self, buffers: set[str], buffers_requiring_device_check: set[str]) -> None:
        _unavailable(type(self).__name__)


class MultiStreamWrapperCodegen:
    """Apex: Inductor's ``PythonWrapperCodegen`` with stream contexts. Raises ``NotImplementedError``."""

    def __init__(self) -> None:
        _unavailable(type(self).__name__)
