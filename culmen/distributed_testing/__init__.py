"""Multi-process unittest bases (Apex's ``apex.distributed_testing``)."""

from culmen.distributed_testing.distributed_test_base import (
    DistributedTestBase,
    NcclDistributedTestBase,
    UccDistributedTestBase,
)

__all__ = ["DistributedTestBase", "NcclDistributedTestBase", "UccDistributedTestBase"]
