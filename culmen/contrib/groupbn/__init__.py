"""``apex.contrib.groupbn``: ``BatchNorm2d_NHWC``, NHWC batch norm with fused ReLU / add-ReLU, synchronized over
groups of ``bn_group`` ranks (see ``batch_norm.py`` for what differs from Apex)."""

from culmen.contrib.groupbn.batch_norm import BatchNorm2d_NHWC

__all__ = ["BatchNorm2d_NHWC"]
