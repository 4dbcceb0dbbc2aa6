"""Reproducers of docs/backends on PyTensor's own PyTorch backend, without lasagne_accum's fixes.

Every test runs one minimal reproducer on plain PyTensor (its own mode,
nothing of ours) and asserts the bug is still there, and that the same graph
is right in ``lasagne_accum.mode()``. When one of them fails on the plain
side, PyTensor has fixed the bug upstream: the message names our fix (in
``lasagne_accum/_pytensor/pytorch_linker.py``), which can then be dropped
(and the reproducer with it).

The other backends' reproducers: ``test_upstream_jax.py``,
``test_upstream_c.py``.
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


def _jax_then(mode):
    """A shared variable updated by a function of ``lasagne_accum.mode("JAX")``, then of `mode`."""
    w = pytensor.shared(np.ones(3), name="w")
    pytensor.function([], [], updates={w: w * 2}, mode=la.mode("JAX"))()
    pytensor.function([], [], updates={w: w + 1}, mode=mode)()
    return np.asarray(la._graph.as_host_array(w.get_value()))


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


@needs_torch
def test_pytorch_has_no_argmax_and_returns_state_through_the_host():
    """``pt.argmax`` has no PyTorch conversion; and every updated shared value comes back
    from the device as a numpy array (``.cpu().numpy()``), so each call moves all state
    to the device and back."""
    import torch

    x = pt.matrix("x")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NotImplementedError, match="Argmax"):
            pytensor.function([x], pt.argmax(x, axis=1), mode="PYTORCH")
        w = pytensor.shared(np.zeros(3), name="w")
        pytensor.function([], [], updates={w: w + 1}, mode="PYTORCH")()
    assert isinstance(w.get_value(borrow=True), np.ndarray), _fixed_upstream(
        "TorchCall in lasagne_accum/_pytensor/pytorch_linker.py")
    xv = np.array([[1.0, 5.0, 2.0], [7.0, 0.0, 3.0]])
    got = pytensor.function([x], pt.argmax(x, axis=1), mode=la.mode("PYTORCH", device="cpu"))
    np.testing.assert_array_equal(got(xv), [1, 0])
    pytensor.function([], [], updates={w: w + 1}, mode=la.mode("PYTORCH", device="cpu"))()
    assert isinstance(w.get_value(borrow=True), torch.Tensor)


@needs_jax
@needs_torch
def test_a_jax_value_cannot_be_read_by_pytorch():
    """A shared variable updated by a JAX function holds a JAX array, which PyTensor's
    PyTorch backend cannot read."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NotImplementedError, match="pytorch_typify is not implemented"):
            _jax_then("PYTORCH")
    np.testing.assert_array_equal(_jax_then(la.mode("PYTORCH", device="cpu")), [3.0] * 3)
