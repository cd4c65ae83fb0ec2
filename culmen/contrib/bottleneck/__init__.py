"""``apex.contrib.bottleneck``: the fused ResNet bottleneck block, its spatially parallel variant and the halo
exchangers (on ``torch.distributed``). See ``bottleneck.py`` and ``halo_exchangers.py`` for the differences
from Apex's cuDNN-frontend version."""

from culmen.contrib.bottleneck.bottleneck import Bottleneck, SpatialBottleneck
from culmen.contrib.bottleneck.halo_exchangers import (
    HaloExchangerAllGather,
    HaloExchangerNoComm,
    HaloExchangerPeer,
    HaloExchangerSendRecv,
)

__all__ = ["Bottleneck", "HaloExchangerAllGather", "HaloExchangerNoComm", "HaloExchangerPeer",
           "HaloExchangerSendRecv", "SpatialBottleneck"]
