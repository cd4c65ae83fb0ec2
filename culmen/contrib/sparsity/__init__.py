"""``apex.contrib.sparsity``: Automatic SParsity (2:4 / m:n structured pruning).

- ``ASP`` (``asp.py``): add masks to a model, keep them applied through optimizer steps, compute them
  (after an optional channel permutation), restore dense weights.
- ``create_mask`` (``sparse_masklib.py``): the m:n mask calculators (``m4n2_1d``, ``m4n2_2d_greedy``,
  ``m4n2_2d_best`` and the generic ``m<M>n<N>_*``).
- ``permutation_lib.Permutation`` and ``permutation_search_kernels``: the channel-permutation pass and
  its exhaustive / channel-swap searches, in PyTorch (no compiled extension).
- ``semi_structured`` (culmen addition): pruned ``Linear`` layers on PyTorch's semi-structured sparse
  tensors on SM80+ GPUs (``ASP.init_model_for_pruning(..., semi_structured=True)``).
"""

from culmen.contrib.sparsity.asp import ASP
from culmen.contrib.sparsity.sparse_masklib import create_mask

__all__ = ["ASP", "create_mask"]
