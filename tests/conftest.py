"""Shared, generic fixtures for the lasagne_accum test suite.

The compilation mode the tests (and the package's doctests) run in is set by
``conftest.py`` at the repository root: read it before adding a test that is
about one backend's generated code.
"""

import numpy as np
import pytest


@pytest.fixture
def rng():
    """A freshly seeded numpy Generator, so every test sees the same data."""
    return np.random.default_rng(20240611)
