"""Helpers shared by culmen's tests and benchmarks: the tolerance rule and adversarial inputs.

See DESIGN.md (Numerics): compare against a float64 reference with an error budget measured from
PyTorch's own low-precision error, poison outputs, use odd shapes, non-contiguous inputs and fresh
random data.
"""

from culmen.testing.tensors import (
    make_noncontiguous,
    make_strided_lastdim,
    odd_shapes,
    poison_,
    poisoned_allocations,
    randn,
)
from culmen.testing.tolerance import DEFAULT_ATOL, ToleranceResult, assert_close_tolerance, default_atol

__all__ = [
    "DEFAULT_ATOL",
    "ToleranceResult",
    "assert_close_tolerance",
    "default_atol",
    "make_noncontiguous",
    "make_strided_lastdim",
    "odd_shapes",
    "poison_",
    "poisoned_allocations",
    "randn",
]
