"""Channel-permutation searches for 2:4 sparsity (``apex.contrib.sparsity.permutation_search_kernels``),
in batched PyTorch: ``Exhaustive_Search`` (windows of stripes, every canonical partition),
``Channel_Swap`` (greedy swaps), ``progressive_channel_swap`` (random swaps under a time limit), and
``accelerated_search_for_good_permutation``, the entry point that picks one by ``options["strategy"]``."""

from culmen.contrib.sparsity.permutation_search_kernels.call_permutation_search_kernels import (
    accelerated_search_for_good_permutation,
)
from culmen.contrib.sparsity.permutation_search_kernels.channel_swap import Channel_Swap, progressive_channel_swap
from culmen.contrib.sparsity.permutation_search_kernels.exhaustive_search import Exhaustive_Search
from culmen.contrib.sparsity.permutation_search_kernels.permutation_utilities import (
    apply_2_to_4,
    sum_after_2_to_4,
)

__all__ = [
    "Channel_Swap",
    "Exhaustive_Search",
    "accelerated_search_for_good_permutation",
    "apply_2_to_4",
    "progressive_channel_swap",
    "sum_after_2_to_4",
]
