"""``apex.transformer.testing.distributed_test_base``: the bases of :mod:`culmen.distributed_testing`
under the module path Apex's older tests import them from."""

from culmen.distributed_testing import DistributedTestBase, NcclDistributedTestBase, UccDistributedTestBase

__all__ = ["DistributedTestBase", "NcclDistributedTestBase", "UccDistributedTestBase"]
