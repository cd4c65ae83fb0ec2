"""Shared text of the errors raised by the Inductor-level names culmen does not implement."""

USE_INSTEAD = (
    "culmen's torchsched plans CUDA streams on the AOTAutograd graph, not inside Inductor's code generator; "
    "use torch.compile(model, backend='torchsched') (culmen.contrib.torchsched), or "
    "culmen.contrib.torchsched.scheduler.plan_streams / build_scheduled_module for a graph of your own")

DEFAULT_STREAM_IDX = 0
ENTRANCE_EVENT = "event0"
EVENT_NAME_TEMPLATE = "event{event_idx}"
STREAM_NAME_TEMPLATE = "stream{stream_idx}"
DEFAULT_STREAM = STREAM_NAME_TEMPLATE.format(stream_idx=DEFAULT_STREAM_IDX)


def get_stream_name(stream_idx: int) -> str:
    """Name of the stream variable ``stream_idx`` in generated code."""
    if not isinstance(stream_idx, int) or stream_idx < 0:
        raise ValueError(f"stream_idx must be a non-negative int, got {stream_idx!r}")
    return STREAM_NAME_TEMPLATE.format(stream_idx=stream_idx)
