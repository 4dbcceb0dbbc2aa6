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


@pytest.fixture
def assert_close():
    """Compare arrays with a dtype-appropriate tolerance.

    float64 results must match to ~1e-12 relative; float32 ones to ~1e-5
    (plus an absolute slack of 1e-14 / 1e-6 times the largest expected value).
    ``what`` names the compared quantity in the failure message.
    """

    def check(actual, expected, dtype, what=""):
        actual = np.asarray(actual)
        expected = np.asarray(expected, dtype=np.float64)
        if np.dtype(dtype) == np.float64:
            rtol, atol_rel = 1e-12, 1e-14
        else:
            rtol, atol_rel = 1e-5, 1e-6
        # absolute slack scaled to the array's magnitude, so that small-valued
        # state (Adadelta's accumulators ~1e-6) is still checked to ~rtol
        atol = atol_rel * float(np.max(np.abs(expected))) if expected.size else 0.0
        np.testing.assert_allclose(
            actual.astype(np.float64), expected, rtol=rtol, atol=atol, err_msg=what
        )

    return check
