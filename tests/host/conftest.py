"""The host-path guards run culmen's plans on CPU tensors with fake kernels; building a Triton plan for
CPU tensors needs Triton's interpreter switched on (tests/conftest.py does so where there is no GPU)."""

import pytest

from culmen.ops.backend import interpreter_enabled


def pytest_collection_modifyitems(config, items):
    if interpreter_enabled():
        return
    skip = pytest.mark.skip(reason="host-path guards need TRITON_INTERPRET=1 (they run in CPU CI)")
    for item in items:
        if "tests/host/" in str(item.fspath):
            item.add_marker(skip)
