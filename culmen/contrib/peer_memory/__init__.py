"""``apex.contrib.peer_memory``: a pool of memory the ranks of a peer group address directly
(``PeerMemoryPool``) and the in-place halo exchange of spatially split activations built on it
(``PeerHaloExchanger1d``), on ``torch.distributed`` symmetric memory (CUDA), shared memory (CPU) or
point-to-point send/recv."""

from culmen.contrib.peer_memory.peer_halo_exchanger_1d import PeerHaloExchanger1d
from culmen.contrib.peer_memory.peer_memory import PeerMemoryPool

__all__ = ["PeerHaloExchanger1d", "PeerMemoryPool"]
