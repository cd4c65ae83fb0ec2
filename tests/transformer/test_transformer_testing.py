"""``apex.transformer.testing.distributed_test_base`` serves the bases of ``culmen.distributed_testing``."""

from __future__ import annotations

import culmen.distributed_testing as dt
import culmen.transformer as transformer


def test_distributed_test_base_reexports_the_bases():
    from culmen.transformer.testing import distributed_test_base as dtb

    for name in ("DistributedTestBase", "NcclDistributedTestBase", "UccDistributedTestBase"):
        assert getattr(dtb, name) is getattr(dt, name)
    assert isinstance(dtb.HAS_UCC, bool)
    assert transformer.testing.__name__ == "culmen.transformer.testing"  # lazy submodule
