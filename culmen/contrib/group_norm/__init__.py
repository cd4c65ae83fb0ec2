"""``apex.contrib.group_norm``: GroupNorm with fused SiLU for NHWC (channels-last) and NCHW inputs."""

from culmen.contrib.group_norm.group_norm import GroupNorm

__all__ = ["GroupNorm"]
