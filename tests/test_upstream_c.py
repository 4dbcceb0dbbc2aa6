"""Reproducers of docs/backends on PyTensor's own C backend, without lasagne_accum's fixes.

Every test runs one minimal reproducer on plain PyTensor (its own mode,
nothing of ours) and asserts the bug is still there, and that the same graph
is right in ``lasagne_accum.mode()``. When one of them fails on the plain
side, PyTensor has fixed the bug upstream: the message names our fix (in
``lasagne_accum/_pytensor/literals.py`` or ``host_linker.py``), which can
then be dropped (and the reproducer with it).

The other backends' reproducers: ``test_upstream_jax.py``,
``test_upstream_pytorch.py``.
"""

import importlib.util
import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import lasagne_accum as la

pytestmark = pytest.mark.real_backend   # these are about the backends' generated code

needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                               reason="jax not installed")


def _fixed_upstream(fix):
    return (f"PyTensor {pytensor.__version__} no longer shows this bug: drop {fix} "
            "and this reproducer (docs/backends.rst says which)")


def _jax_then(mode):
    """A shared variable updated by a function of ``lasagne_accum.mode("JAX")``, then of `mode`."""
    w = pytensor.shared(np.ones(3), name="w")
    pytensor.function([], [], updates={w: w * 2}, mode=la.mode("JAX"))()
    pytensor.function([], [], updates={w: w + 1}, mode=mode)()
    return np.asarray(la._graph.as_host_array(w.get_value()))


def test_c_writes_float32_constants_as_inexact_double_literals():
    """``1 - float32(0.999) ** t`` in a fused C loop: PyTensor writes the constant
    as the double ``0.999``, not the float32 0.99900001287..., and the result drifts
    from Numba's and from the float32 computation (2e-5 relative)."""
    t = pt.vector("t", dtype="float32")
    tv = np.float32([1, 2, 3, 10, 100])
    exact = 1 - np.float64(np.float32(0.999)) ** tv.astype(np.float64)

    def compiled(mode):
        return pytensor.function([t], 1 - np.float32(0.999) ** t, mode=mode)

    def error(f):
        return float(np.max(np.abs(f(tv) / exact - 1)))

    f_c = compiled(la.mode("CVM"))
    assert error(compiled("CVM")) > 1e-5, _fixed_upstream("lasagne_accum/_pytensor/literals.py")
    assert error(f_c) < 1e-5
    f_numba = compiled("NUMBA")
    np.testing.assert_array_equal(f_c(tv), f_numba(tv))


@needs_jax
def test_a_jax_value_cannot_be_read_by_c():
    """A shared variable updated by a JAX function holds a JAX array, which PyTensor's
    C backend cannot read."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="expected an ndarray"):
            _jax_then("CVM")
    np.testing.assert_array_equal(_jax_then(la.mode("CVM")), [3.0] * 3)
