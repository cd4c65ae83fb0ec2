"""``apex.contrib.cudnn_gbn``: ``GroupBatchNorm2d``, batch norm synchronized over groups of ``group_size`` ranks
(see ``batch_norm.py`` for what differs from Apex's cuDNN version)."""

from culmen.contrib.cudnn_gbn.batch_norm import GroupBatchNorm2d

__all__ = ["GroupBatchNorm2d"]
