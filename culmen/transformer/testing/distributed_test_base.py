"""``apex.transformer.testing.distributed_test_base``: the bases of :mod:`culmen.distributed_testing`
under the module path Apex's older tests import them from."""

from culmen.distributed_testing.distributed_test_base import (
    HAS_UCC,
    DistributedTestBase,
    NcclDistributedTestBase,
    UccDistributedTestBase,
)

__all__ = ["HAS_UCC", "DistributedTestBase", "NcclDistributedTestBase", "UccDistributedTestBase"]
