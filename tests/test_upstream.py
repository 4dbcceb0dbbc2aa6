"""PyTensor's own backends, without lasagne_accum's fixes: each reproducer of docs/backends.

Every test runs one minimal reproducer on plain PyTensor (its own mode,
nothing of ours) and asserts the bug is still there, and that the same graph
is right in ``lasagne_accum.mode()``. When one of them fails on the plain
side, PyTensor has fixed the bug upstream: the message names our fix, which
can then be dropped (and the reproducer with it).
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
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch not installed")


def _fixed_upstream(fix):
    return (f"PyTensor {pytensor.__version__} no longer shows this bug: drop {fix} "
            "and this reproducer (docs/backends.rst says which)")


def test_c_writes_float32_constants_as_inexact_double_literals():
    """``1 - float32(0.999) ** t`` in a fused C loop: PyTensor writes the constant
    as the double ``0.999``, not the float32 0.99900001287..., and the result drifts
    from Numba's and from the float32 computation (2e-5 relative)."""
    t = pt.vector("t", dtype="float32")
    tv = np.float32([1, 2, 3, 10, 100])
    exact = 1 - np.float64(np.float32(0.999)) ** tv.astype(np.float64)

    def error(mode):
        f = pytensor.function([t], 1 - np.float32(0.999) ** t, mode=mode)
        return float(np.max(np.abs(f(tv) / exact - 1)))

    assert error("CVM") > 1e-5, _fixed_upstream("lasagne_accum/_pytensor/literals.py")
    assert error(la.mode("CVM")) < 1e-5
    f_c = pytensor.function([t], 1 - np.float32(0.999) ** t, mode=la.mode("CVM"))
    f_numba = pytensor.function([t], 1 - np.float32(0.999) ** t, mode="NUMBA")
    np.testing.assert_array_equal(f_c(tv), f_numba(tv))


@needs_jax
@pytest.mark.parametrize("case", ["sum", "alloc", "deepcopy"])
def test_jax_returns_float64_for_float32_graphs(case):
    """A float32 reduction returns its accumulator's dtype; ``Alloc`` and
    ``DeepCopyOp`` of a 0-d float32 constant return float64 (the constant is
    handed to JAX as a Python number)."""
    x = pt.vector("x", dtype="float32")
    build = {"sum": ([x], x.sum()),
             "alloc": ([x], pt.alloc(np.float32(0), x.shape[0])),
             "deepcopy": ([], pt.constant(np.float32(1.5)))}[case]
    args = [np.ones(3, "float32")] if build[0] else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = pytensor.function(*build, mode="JAX")(*args)
        ours = pytensor.function(*build, mode=la.mode("JAX"))(*args)
    assert np.asarray(plain).dtype == np.float64, _fixed_upstream(
        "the JAX output-dtype fix in lasagne_accum/_pytensor/linkers.py")
    assert np.asarray(ours).dtype == np.float32


@needs_jax
def test_jax_arange_refuses_a_stop_of_128_or_more():
    """``p[pt.arange(y.shape[0]), y]``, the usual loss indexing, on a batch of 200:
    the constant bounds 0 and 1 reach ``jnp.arange`` as int8 scalars."""
    p, y = pt.matrix("p"), pt.ivector("y")
    picked = p[pt.arange(y.shape[0]), y]
    pv, yv = np.arange(600.0).reshape(200, 3), np.arange(200, dtype="int32") % 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OverflowError, match="int8"):
            pytensor.function([p, y], picked, mode="JAX")(pv, yv)
        got = pytensor.function([p, y], picked, mode=la.mode("JAX"))(pv, yv)
    np.testing.assert_array_equal(np.asarray(got), pv[np.arange(200), yv])


@needs_torch
@pytest.mark.parametrize("case", ["pow", "mod", "eq"])
def test_pytorch_maps_pow_mod_and_eq_to_the_wrong_torch_functions(case):
    """``**`` and ``%`` map to ``torch.power`` and ``torch.mod`` (which do not
    exist), ``==`` to ``torch.equal`` (one bool for whole tensors)."""
    x, y = pt.vector("x", dtype="float32"), pt.vector("y", dtype="float32")
    out = {"pow": x ** y, "mod": x % y, "eq": pt.eq(x, y)}[case]
    xv, yv = np.float32([2, 5, -1]), np.float32([3, 3, 3])
    want = {"pow": xv ** yv, "mod": np.mod(xv, yv), "eq": xv == yv}[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(AttributeError):
            pytensor.function([x, y], out, mode="PYTORCH")(xv, yv)
        got = pytensor.function([x, y], out, mode=la.mode("PYTORCH"))(xv, yv)
    np.testing.assert_array_equal(np.asarray(got), want)
