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
from lasagne_accum._pytensor import fixed_upstream

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
    want = pv[np.arange(200), yv]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if fixed_upstream("jax_arange"):   # our fix is left out there: PyTensor's own is right
            plain = pytensor.function([p, y], picked, mode="JAX")(pv, yv)
            np.testing.assert_array_equal(np.asarray(plain), want)
        else:
            with pytest.raises(OverflowError, match="int8"):
                pytensor.function([p, y], picked, mode="JAX")(pv, yv)
        got = pytensor.function([p, y], picked, mode=la.mode("JAX"))(pv, yv)
    np.testing.assert_array_equal(np.asarray(got), want)


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


@needs_jax
def test_jax_reshape_to_a_shape_computed_from_the_batch_fails():
    """``x.reshape((x.shape[0] * 4, 2))`` beside an update that counts examples
    (``total + x.shape[0]``, as an accumulation weighted by batch size does): fusion
    puts both products of the shape into one node, computed in ``jax.numpy`` (a traced
    value), which ``jnp.reshape`` refuses. The im2col convolution of
    ``examples/models.py`` trained with ``weight=x.shape[0]`` fails so."""
    x = pt.matrix("x")
    W = pytensor.shared(np.ones((2, 3)), name="W")
    total = pytensor.shared(np.float64(0), name="total")
    loss = (x.reshape((x.shape[0] * 4, 2)) @ W).mean()
    xv = np.arange(24.0).reshape(3, 8)

    def run(mode):
        total.set_value(np.float64(0))
        f = pytensor.function([x], loss, updates={total: total + x.shape[0]}, mode=mode)
        return float(f(xv)), float(total.get_value())

    want = (float((xv.reshape(12, 2) @ np.ones((2, 3))).mean()), 3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run(la.mode("JAX"))
        assert got == want
        try:
            plain = run("JAX")
        except TypeError as error:
            assert "Shapes must be 1D sequences of concrete values" in str(error)
        else:   # the fix stays: the im2col convolution's JAX run still needs it there
            assert plain == want
            pytest.skip(f"PyTensor {pytensor.__version__} computes this reshape right; "
                        "examples/digits_cnn.py under plain JAX still fails "
                        "(tests/test_examples.py runs it in lasagne_accum.mode('JAX'))")


@needs_jax
def test_jax_lazy_ifelse_branches_disagree_in_dtype_on_a_float32_graph():
    """PyTensor 3.3 turns ``ifelse`` into a ``LazyIfElse`` whose branches are inner
    graphs; ``pt.zeros(shape, dtype="float32")`` there comes back float64 (the
    ``Alloc`` bug above, where our outer-graph fix cannot reach) and
    ``jax.lax.cond`` refuses the pair: the single-function form's reset of a
    float32 buffer is this graph."""
    from lasagne_accum._pytensor.compat import ifelse

    a, c = pt.matrix("a", dtype="float32"), pt.scalar("c", dtype="bool")
    out = ifelse(c, a, pt.zeros(a.shape, dtype="float32"))
    av = np.ones((2, 3), "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = pytensor.function([c, a], out, mode="JAX")
        lazy = {type(n.op).__name__ for n in plain.maker.fgraph.apply_nodes} & {"LazyIfElse"}
        if lazy:
            with pytest.raises(TypeError, match="cond branches must have equal output types"):
                plain(False, av)
        ours = pytensor.function([c, a], out, mode=la.mode("JAX"))
        for cond, want in ((True, av), (False, np.zeros_like(av))):
            got = np.asarray(ours(cond, av))
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, want)


@needs_jax
def test_jax_keeps_a_stale_copy_of_every_shared_value():
    """PyTensor's code generator converts each shared value when the function is built
    and keeps it in the generated function's globals: two copies of the state on the
    device for as long as the function lives."""
    import gc

    import jax

    def live_after_a_call(mode):
        w = pytensor.shared(np.zeros((256, 256)), name="w")
        f = pytensor.function([], [], updates={w: w + 1}, mode=mode)
        f()
        gc.collect()
        state = w.get_value(borrow=True).nbytes
        live = sum(a.nbytes for a in jax.live_arrays() if a.shape == (256, 256))
        del f, w
        gc.collect()
        return live / state

    assert live_after_a_call("JAX") == 2, _fixed_upstream(
        "_drop_shadowed_globals in lasagne_accum/_pytensor/linkers.py")
    assert live_after_a_call(la.mode("JAX")) == 1


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
        "TorchCall in lasagne_accum/_pytensor/linkers.py")
    xv = np.array([[1.0, 5.0, 2.0], [7.0, 0.0, 3.0]])
    got = pytensor.function([x], pt.argmax(x, axis=1), mode=la.mode("PYTORCH", device="cpu"))
    np.testing.assert_array_equal(got(xv), [1, 0])
    pytensor.function([], [], updates={w: w + 1}, mode=la.mode("PYTORCH", device="cpu"))()
    assert isinstance(w.get_value(borrow=True), torch.Tensor)


@needs_jax
@needs_torch
def test_a_jax_value_cannot_be_read_by_pytorch_or_c():
    """A shared variable updated by a JAX function holds a JAX array, which PyTensor's
    PyTorch and C backends cannot read."""
    def jax_then(mode):
        w = pytensor.shared(np.ones(3), name="w")
        pytensor.function([], [], updates={w: w * 2}, mode=la.mode("JAX"))()
        pytensor.function([], [], updates={w: w + 1}, mode=mode)()
        return np.asarray(la._graph.as_host_array(w.get_value()))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NotImplementedError, match="pytorch_typify is not implemented"):
            jax_then("PYTORCH")
        with pytest.raises(ValueError, match="expected an ndarray"):
            jax_then("CVM")
    np.testing.assert_array_equal(jax_then(la.mode("PYTORCH", device="cpu")), [3.0] * 3)
    np.testing.assert_array_equal(jax_then(la.mode("CVM")), [3.0] * 3)
