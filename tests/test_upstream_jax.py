"""Reproducers of docs/backends on PyTensor's own JAX backend, without lasagne_accum's fixes.

Every test runs one minimal reproducer on plain PyTensor (its own mode,
nothing of ours) and asserts the bug is still there, and that the same graph
is right in ``lasagne_accum.mode()``. When one of them fails on the plain
side, PyTensor has fixed the bug upstream: the message names our fix (in
``lasagne_accum/_pytensor/jax_linker.py``), which can then be dropped (and
the reproducer with it).

The other backends' reproducers: ``test_upstream_pytorch.py``,
``test_upstream_c.py``.
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


def _fixed_upstream(fix):
    return (f"PyTensor {pytensor.__version__} no longer shows this bug: drop {fix} "
            "and this reproducer (docs/backends.rst says which)")


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
        "the JAX output-dtype fix in lasagne_accum/_pytensor/jax_linker.py")
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
        "_drop_shadowed_globals in lasagne_accum/_pytensor/jax_linker.py")
    assert live_after_a_call(la.mode("JAX")) == 1
