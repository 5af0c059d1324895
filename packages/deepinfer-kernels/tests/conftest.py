"""Shared fixtures for the kernels helper's tests."""

from __future__ import annotations

import pytest
from deepinfer_kernels import REGISTRY


@pytest.fixture
def batch_invariant():
    """Run the test with DEEPINFER_BATCH_INVARIANT=1 semantics, restoring the settings after."""
    with REGISTRY.batch_invariant_mode():
        yield
