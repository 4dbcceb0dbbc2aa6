"""The fast paths of ``lasagne_accum.mode()`` compute what the plain graph computes.

References are numpy re-derivations in float64 (``b * z + a * x @ y``); the
compiled graphs are inspected for the in-place ``Gemm`` that replaces
``acc + dot`` in the Numba backend and for the lazy step of the
single-function form. Plain PyTensor modes are the other side of each
comparison: they must not see any of it.
"""

import tracemalloc

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.tensor.blas import Gemm, gemm_no_inplace

import lasagne_accum as la
from lasagne_accum._pytensor.lazy_step import LazyStep

DTYPES = ["float32", "float64"]
MODES = ["NUMBA", "CVM"]
TOL = {"float32": 2e-6, "float64": 1e-14}
#: PyTensor's own conditional ops: ``IfElse``, and from 3.3 on the ``LazyIfElse``
#: its rewrites make of one (each branch an inner function).
IFELSE = {"IfElse", "LazyIfElse"}


def _close(got, want, dtype, tol=None, what=""):
    """Relative to the array's scale (float32 sums of 20 products round at ~1e-7)."""
    tol = tol or TOL[dtype]
    want = np.asarray(want, dtype=np.float64)
    scale = float(np.max(np.abs(want))) or 1.0
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=tol,
                               atol=tol * scale, err_msg=what)


def _gemm_nodes(fn):
    return [n for n in fn.maker.fgraph.toposort() if isinstance(n.op, Gemm)]


def _gemm(node):
    """``Gemm{inplace}``: PyTensor's C op, or our Numba one (``NumbaGemm``) alike."""
    return str(node.op).removeprefix("Numba")


def _destroyed_inputs(fn):
    """Names of the shared variables that some node of `fn` writes in place."""
    fg = fn.maker.fgraph
    names = {fg.inputs[k]: i.variable.name for k, i in enumerate(fn.maker.inputs)}
    out = set()
    for node in fg.toposort():
        for destroyed in getattr(node.op, "destroy_map", {}).values():
            out.update(names.get(node.inputs[j]) for j in destroyed)
    return out - {None}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_is_an_inplace_gemm_and_exact(dtype, mode):
    rng = np.random.default_rng(0)
    x = pt.matrix("x", dtype=dtype)
    d = pt.matrix("d", dtype=dtype)
    acc0 = rng.standard_normal((7, 5)).astype(dtype)
    acc = pytensor.shared(acc0.copy(), name="acc")
    f = pytensor.function([x, d], [], updates={acc: acc + x.T @ d}, mode=la.mode(mode))
    gemms = _gemm_nodes(f)
    assert [_gemm(n) for n in gemms] == ["Gemm{inplace}"]
    assert _destroyed_inputs(f) == {"acc"}
    want = acc0.astype(np.float64)
    address = acc.get_value(borrow=True).ctypes.data
    for _ in range(3):
        xv = rng.standard_normal((20, 7)).astype(dtype)
        dv = rng.standard_normal((20, 5)).astype(dtype)
        f(xv, dv)
        want = want + xv.astype(np.float64).T @ dv.astype(np.float64)
    got = acc.get_value(borrow=True)
    assert got.dtype == dtype
    assert got.ctypes.data == address  # written into the same buffer every call
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_accumulation_forms_become_gemm(dtype):
    """``keep * acc + w * dot`` (the lazy reset, a weighted batch) folds into one Gemm."""
    rng = np.random.default_rng(1)
    x = pt.matrix("x", dtype=dtype)
    d = pt.matrix("d", dtype=dtype)
    keep = pt.scalar("keep", dtype=dtype)
    w = pt.scalar("w", dtype=dtype)
    acc0 = rng.standard_normal((6, 4)).astype(dtype)
    acc = pytensor.shared(acc0.copy(), name="acc")
    f = pytensor.function([x, d, keep, w], [], updates={acc: keep * acc + w * (x @ d)},
                          mode=la.mode("NUMBA"))
    assert [_gemm(n) for n in _gemm_nodes(f)] == ["Gemm{inplace}"]
    want = acc0.astype(np.float64)
    for k, wt in ((1.0, 0.5), (0.0, 2.0), (1.0, -3.0), (0.25, 1.0)):
        xv = rng.standard_normal((6, 9)).astype(dtype)
        dv = rng.standard_normal((9, 4)).astype(dtype)
        f(xv, dv, k, wt)
        want = k * want + wt * (xv.astype(np.float64) @ dv.astype(np.float64))
        _close(acc.get_value(), want, dtype)


def _layouts(a):
    """`a` (2-d) as C-contiguous, Fortran, transposed-view and strided-view arrays."""
    big = np.zeros((a.shape[0] * 2, a.shape[1] * 3), a.dtype)
    big[::2, ::3] = a
    return {"C": np.ascontiguousarray(a), "F": np.asfortranarray(a),
            "T": np.ascontiguousarray(a.T).T, "strided": big[::2, ::3]}


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_gemm_every_layout_and_scale(dtype):
    """The Numba Gemm against numpy for each input layout and alpha/beta; with beta = 0
    it does not read z (NaN and inf there), in every layout of z (the contract of
    ``test_gemm_with_beta_zero_does_not_read_z``, here with the layouts this test compiles
    for: each layout combination is a Numba compile of its own)."""
    rng = np.random.default_rng(2)
    z, x, y = (pt.matrix(n, dtype=dtype) for n in "zxy")
    a, b = pt.scalar("a", dtype=dtype), pt.scalar("b", dtype=dtype)
    f = pytensor.function([z, a, x, y, b], gemm_no_inplace(z, a, x, y, b),
                          mode=la.mode("NUMBA"))
    assert [type(n.op).__name__ for n in _gemm_nodes(f)] == ["NumbaGemm"]
    zv = rng.standard_normal((5, 3)).astype(dtype)
    xv = rng.standard_normal((5, 4)).astype(dtype)
    yv = rng.standard_normal((4, 3)).astype(dtype)
    for (lz, zl), (lx, xl), (ly, yl) in zip(_layouts(zv).items(), _layouts(xv).items(),
                                            list(_layouts(yv).items())[::-1]):
        for alpha, beta in ((1.0, 1.0), (-0.5, 0.0), (2.0, 0.75)):
            before = zl.copy()
            got = f(zl, alpha, xl, yl, beta)
            want = beta * zv.astype(np.float64) + alpha * (xv.astype(np.float64)
                                                           @ yv.astype(np.float64))
            assert got.dtype == dtype, (lz, lx, ly)
            _close(got, want, dtype)
            assert np.array_equal(zl, before)  # the non-inplace Gemm leaves z alone
        bad = np.full(zv.shape, np.nan, dtype)
        bad[1, 2] = np.inf
        got = f(_layouts(bad)[lz], -1.5, xl, yl, 0.0)
        assert np.isfinite(got).all(), lz
        _close(got, -1.5 * (xv.astype(np.float64) @ yv.astype(np.float64)), dtype, what=lz)


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_matrix_product_through_blas_for_every_layout(dtype):
    """A plain matrix product in a Numba mode is one BLAS gemm (``NumbaDot22``), exact
    against numpy for each layout (a transposed operand is passed as transposed), empty
    and zero inner dimensions included; plain Numba keeps PyTensor's ``Dot``."""
    rng = np.random.default_rng(3)
    x, y = pt.matrix("x", dtype=dtype), pt.matrix("y", dtype=dtype)
    f = pytensor.function([x, y], x @ y, mode=la.mode("NUMBA"))
    ops = [type(n.op).__name__ for n in f.maker.fgraph.toposort()]
    assert ops == ["NumbaDot22"]
    plain = pytensor.function([x, y], x @ y, mode="NUMBA")
    assert "NumbaDot22" not in [type(n.op).__name__ for n in plain.maker.fgraph.toposort()]
    xv = rng.standard_normal((5, 4)).astype(dtype)
    yv = rng.standard_normal((4, 3)).astype(dtype)
    for (lx, xl), (ly, yl) in zip(_layouts(xv).items(), list(_layouts(yv).items())[::-1]):
        got = f(xl, yl)
        assert got.dtype == dtype and got.shape == (5, 3), (lx, ly)
        _close(got, xv.astype(np.float64) @ yv.astype(np.float64), dtype, what=f"{lx} {ly}")
    assert np.array_equal(f(np.ones((3, 0), dtype), np.ones((0, 2), dtype)),
                          np.zeros((3, 2)))
    assert f(np.ones((0, 4), dtype), yv).shape == (0, 3)
    with pytest.raises(ValueError, match="inner dimensions"):
        f(xv, xv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_accumulate_step_matches_c_and_plain_numba(dtype):
    """The library's accumulate step: NUMBA with Gemm == NUMBA without it == C."""
    rng = np.random.default_rng(3)
    data = [(rng.standard_normal((8, 6)).astype(dtype), rng.integers(0, 3, 8))
            for _ in range(3)]
    results = {}
    for name, mode in (("numba", la.mode("NUMBA")), ("plain", "NUMBA"), ("c", la.mode("CVM"))):
        W = pytensor.shared(np.linspace(-1, 1, 18).reshape(6, 3).astype(dtype), name="W")
        x = pt.matrix("x", dtype=dtype)
        y = pt.vector("y", dtype="int64")
        logits = pt.tanh(x @ W)
        loss = -(logits - pt.logsumexp(logits, axis=1, keepdims=True))[
            pt.arange(y.shape[0]), y].mean()
        accu = la.accumulate_gradients(loss, [W])
        f = pytensor.function([x, y], loss, updates=accu.accumulate, mode=mode)
        if name != "plain":
            assert "W.grad_accu" in _destroyed_inputs(f)
            assert any(_gemm(n) == "Gemm{inplace}" for n in _gemm_nodes(f)), name
        else:
            assert not _gemm_nodes(f)
        for xv, yv in data:
            f(xv, yv)
        results[name] = accu.accumulators[0].get_value()
    # numpy reference of the summed gradient
    want = np.zeros((6, 3))
    Wv = np.linspace(-1, 1, 18).reshape(6, 3).astype(dtype).astype(np.float64)
    for xv, yv in data:
        xv = xv.astype(np.float64)
        t = np.tanh(xv @ Wv)
        p = np.exp(t - t.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(yv)), yv] -= 1
        want += xv.T @ (p / len(yv) * (1 - t ** 2))
    for name, got in results.items():
        assert got.dtype == dtype, name
        # float32: the model's own float32 arithmetic (tanh, softmax) differs from
        # the float64 reference by ~1e-6; the backends agree with each other closer
        _close(got, want, dtype, tol=1e-5 if dtype == "float32" else None, what=name)
        _close(got, results["c"], dtype, what=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_accumulate_allocates_no_buffer_sized_array(dtype):
    """tracemalloc sees numpy's and Numba's allocations: the Gemm call makes none
    of the accumulator's size; the plain Numba graph (product, then add) does."""
    rng = np.random.default_rng(4)
    xv = rng.standard_normal((16, 400)).astype(dtype)
    dv = rng.standard_normal((16, 300)).astype(dtype)
    peaks = {}
    for name, mode in (("gemm", la.mode("NUMBA")), ("plain", "NUMBA")):
        acc = pytensor.shared(np.zeros((400, 300), dtype), name="acc")
        x = pt.matrix("x", dtype=dtype)
        d = pt.matrix("d", dtype=dtype)
        f = pytensor.function([x, d], [], updates={acc: acc + x.T @ d}, mode=mode)
        f(xv, dv)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            f(xv, dv)
            peaks[name] = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        _close(acc.get_value(), 2 * xv.astype(np.float64).T @ dv.astype(np.float64), dtype)
    nbytes = 400 * 300 * np.dtype(dtype).itemsize
    assert peaks["plain"] >= nbytes  # the measurement sees the product's temporary
    assert peaks["gemm"] < nbytes // 10


@pytest.mark.parametrize("mode", ["CVM", "PY"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_with_beta_zero_does_not_read_z(dtype, mode):
    """The contract the reset rewrite relies on: beta = 0 drops z, NaN and inf included
    (BLAS's "C need not be set on input"), in every layout, in C and Python (Numba's
    Gemm: :func:`test_numba_gemm_every_layout_and_scale`)."""
    from pytensor.compile.mode import Mode

    rng = np.random.default_rng(8)
    z, x, y = (pt.matrix(n, dtype=dtype) for n in "zxy")
    a, b = pt.scalar("a", dtype=dtype), pt.scalar("b", dtype=dtype)
    m = Mode(linker="py", optimizer=None) if mode == "PY" else la.mode(mode)
    f = pytensor.function([z, a, x, y, b], gemm_no_inplace(z, a, x, y, b), mode=m)
    assert _gemm_nodes(f)
    xv = rng.standard_normal((5, 4)).astype(dtype)
    yv = rng.standard_normal((4, 3)).astype(dtype)
    want = -1.5 * (xv.astype(np.float64) @ yv.astype(np.float64))
    bad = np.full((5, 3), np.nan, dtype)
    bad[1, 2] = np.inf
    for lz, zl in _layouts(bad).items():
        got = f(zl, -1.5, xv, yv, 0.0)
        assert np.isfinite(got).all(), lz
        _close(got, want, dtype, what=lz)


def _select_reset_fn(dtype, mode, flipped=False):
    x = pt.matrix("x", dtype=dtype)
    d = pt.matrix("d", dtype=dtype)
    fresh = pt.scalar("fresh", dtype="bool")
    acc = pytensor.shared(np.full((7, 5), np.nan, dtype), name="acc")
    zero = np.zeros((), dtype)
    kept = pt.switch(pt.invert(fresh), acc, zero) if flipped else pt.switch(fresh, zero, acc)
    f = pytensor.function([x, d, fresh], [], updates={acc: kept + x.T @ d}, mode=mode)
    return acc, f


@pytest.mark.parametrize("flipped", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_select_reset_folds_into_an_inplace_gemm(dtype, mode, flipped):
    """``switch(fresh, 0, acc) + x.T @ d`` (the single-function form's lazy reset) is one
    in-place Gemm on the buffer, no matrix-sized select, and a reset drops a NaN."""
    mode = la.mode(mode)
    from pytensor.scalar.basic import Switch
    from pytensor.tensor.elemwise import Elemwise

    acc, f = _select_reset_fn(dtype, mode, flipped)
    assert [_gemm(n) for n in _gemm_nodes(f)] == ["Gemm{inplace}"]
    assert _destroyed_inputs(f) == {"acc"}
    assert not [n for n in f.maker.fgraph.toposort() if isinstance(n.op, Elemwise)
                and isinstance(n.op.scalar_op, Switch) and n.outputs[0].type.ndim == 2]
    rng = np.random.default_rng(9)
    address = acc.get_value(borrow=True).ctypes.data
    want = np.full((7, 5), np.nan)
    for fresh in (True, False, False, True, False):
        xv = rng.standard_normal((20, 7)).astype(dtype)
        dv = rng.standard_normal((20, 5)).astype(dtype)
        f(xv, dv, fresh)
        want = (0 if fresh else want) + xv.astype(np.float64).T @ dv.astype(np.float64)
        got = acc.get_value(borrow=True)
        assert got.ctypes.data == address and got.dtype == dtype
        _close(got, want, dtype)


@pytest.mark.parametrize("mode", [la.mode("CVM").excluding("lasagne_accum_gemm_reset"), "CVM"])
def test_select_reset_rewrite_can_be_left_out(mode):
    """Excluded by name, or in plain PyTensor, the select stays (what
    ``benchmarks/single_function.py`` compares)."""
    acc, f = _select_reset_fn("float64", mode)
    assert [n.inputs[0].owner is not None for n in _gemm_nodes(f)] == [True]
    f(np.ones((2, 7)), np.ones((2, 5)), True)
    np.testing.assert_array_equal(acc.get_value(), np.full((7, 5), 2.0))


def test_gemm_rewrite_is_numba_only():
    """Our Numba Gemm (the rewrite and its op) is for Numba modes: C keeps PyTensor's
    own Gemm, and JAX gets none."""
    x = pt.matrix("x")
    acc = pytensor.shared(np.zeros((3, 3)), name="acc")
    kinds = {}
    for name in ("NUMBA", "CVM", "JAX"):
        f = pytensor.function([x], [], updates={acc: acc + x @ x}, mode=la.mode(name))
        kinds[name] = [type(n.op).__name__ for n in _gemm_nodes(f)]
    assert kinds == {"NUMBA": ["NumbaGemm"], "CVM": ["Gemm"], "JAX": []}


# --------------------------------------------------------------------------
# LazyStep: the single-function form's rule runs in place, on stepping calls only
# --------------------------------------------------------------------------


def _adam_reference(W0, batches, every, lr, b1=0.9, b2=0.999, eps=1e-8):
    """numpy: mean gradient of `every` calls of 0.5 * ||x W - y||^2, then Lasagne's adam."""
    W, m, v, t, window = W0.astype(np.float64), 0.0, 0.0, 0, []
    trace = []
    for x, y in batches:
        x, y = x.astype(np.float64), y.astype(np.float64)
        window.append(x.T @ (x @ W - y))
        if len(window) == every:
            g = sum(window) / every
            window = []
            t += 1
            a = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g ** 2
            W = W - a * m / (np.sqrt(v) + eps)
        trace.append(W)
    return trace


def _lazy_model(dtype, mode, ours=True):
    W = pytensor.shared(np.linspace(-1, 1, 12).reshape(4, 3).astype(dtype), name="W")
    x = pt.matrix("x", dtype=dtype)
    y = pt.matrix("y", dtype=dtype)
    loss = 0.5 * ((x @ W - y) ** 2).sum()
    upd = la.adam(loss, [W], learning_rate=0.05, average=3)
    return W, pytensor.function([x, y], loss, updates=upd, mode=la.mode(mode) if ours else mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lazy_step_replaces_ifelse_and_is_exact(dtype, mode):
    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((5, 4)).astype(dtype),
                rng.standard_normal((5, 3)).astype(dtype)) for _ in range(7)]
    W, f = _lazy_model(dtype, mode)
    ops = {type(n.op).__name__ for n in f.maker.fgraph.toposort()}
    assert "LazyStep" in ops and not ops & IFELSE
    (lazy,) = [n.op for n in f.maker.fgraph.toposort() if type(n.op).__name__ == "LazyStep"]
    assert len(lazy.zeros) == 1  # W's gradient buffer, zeroed by the stepping call
    W_plain, f_plain = _lazy_model(dtype, mode, ours=False)
    assert {type(n.op).__name__ for n in f_plain.maker.fgraph.toposort()} & IFELSE
    want = _adam_reference(W.get_value(), batches, 3, 0.05)
    address = W.get_value(borrow=True).ctypes.data
    for i, (xb, yb) in enumerate(batches):
        before = W.get_value()
        f(xb, yb)
        f_plain(xb, yb)
        got = W.get_value(borrow=True)
        assert got.dtype == dtype
        assert got.ctypes.data == address  # stepping calls write into W's own buffer
        if (i + 1) % 3:
            assert np.array_equal(got, before)  # no step: nothing changed
        _close(got, want[i], dtype, tol=1e-5 if dtype == "float32" else 1e-12)
        _close(got, W_plain.get_value(), dtype)  # the same as PyTensor's IfElse


def test_lazy_step_holds_the_whole_rule():
    """Nothing of the rule runs outside the op: the optimizer's states (moments,
    step count) are read by ``LazyStep`` alone, and the rule's bias-correction
    factor is not computed on every call (fused into the loop that accumulates a
    bias's gradient, a bias's Adam update would run on every call)."""
    W = pytensor.shared(np.linspace(-1, 1, 12).reshape(4, 3), name="W")
    b = pytensor.shared(np.zeros(3), name="b")
    x, y = pt.matrix("x"), pt.matrix("y")
    loss = 0.5 * ((pt.maximum(x @ W + b, 0) - y) ** 2).sum()
    upd = la.adam(loss, [W, b], learning_rate=0.05, average=3)
    f = pytensor.function([x, y], loss, updates=upd, mode=la.mode("CVM"))
    fg = f.maker.fgraph
    shared = {i.variable.name: fg.inputs[k] for k, i in enumerate(f.maker.inputs)}
    rule_states = [n for n in shared if n.endswith((".adam_m", ".adam_v")) or n == "adam.t"]
    assert len(rule_states) == 5
    for name in rule_states:
        readers = {type(node.op).__name__ for node, _ in fg.clients[shared[name]]}
        assert readers == {"LazyStep"}, (name, readers)


def _halve_minus_g(dtype="float64", inplace=True):
    """A one-state LazyStep whose inner graph is ``s * 0.5 - g``."""
    from pytensor.graph.fg import FunctionGraph

    s_in, g_in = pt.vector(dtype=dtype), pt.vector(dtype=dtype)
    return LazyStep(FunctionGraph([s_in, g_in], [s_in * 0.5 - g_in], clone=False), 1,
                    inplace=inplace)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lazy_step_op_on_its_own(dtype):
    """LazyStep in place, in C and in Numba, against numpy, both branches: the
    state's own buffer is written on a step."""
    op = _halve_minus_g(dtype)
    for mode in MODES:
        state = pytensor.shared(np.arange(4.0).astype(dtype), name="s")
        cond = pt.scalar("c", dtype="bool")
        g = pt.vector("g", dtype=dtype)
        f = pytensor.function([cond, g], [], updates={state: op(cond, state, g)},
                              mode=la.mode(mode), accept_inplace=True)
        gv = np.full(4, 0.25, dtype)
        buf = state.get_value(borrow=True)
        f(False, gv)
        np.testing.assert_array_equal(state.get_value(), np.arange(4.0))
        f(True, gv)
        _close(state.get_value(), np.arange(4.0) * 0.5 - 0.25, dtype, what=mode)
        assert state.get_value(borrow=True) is buf or mode == "NUMBA"
        assert np.array_equal(buf, state.get_value(borrow=True))


def test_lazy_step_not_in_place_returns_new_arrays():
    """Before the in-place pass (and where it is refused) the op is a view of its
    states on calls that do not step and computes new arrays on a step."""
    op = _halve_minus_g(inplace=False)
    assert op.view_map == {0: [1]} and not op.destroy_map
    cond, s, g = pt.scalar("c", dtype="bool"), pt.vector("s"), pt.vector("g")
    f = pytensor.function([cond, s, g], op(cond, s, g), mode="FAST_COMPILE")
    sv = np.arange(4.0)
    np.testing.assert_array_equal(f(False, sv, np.ones(4)), sv)
    np.testing.assert_allclose(f(True, sv, np.full(4, 0.25)), sv * 0.5 - 0.25, rtol=0,
                               atol=1e-15)
    np.testing.assert_array_equal(sv, np.arange(4.0))   # the input is left alone


def test_lazy_step_error_in_a_stepping_call_reaches_the_caller():
    """An exception raised by the rule (here a shape mismatch) comes out of the
    call with its own type, the state untouched; the function works after it."""
    op = _halve_minus_g()
    state = pytensor.shared(np.arange(4.0), name="s")
    cond, g = pt.scalar("c", dtype="bool"), pt.vector("g")
    f = pytensor.function([cond, g], [], updates={state: op(cond, state, g)},
                          mode=la.mode("CVM"), accept_inplace=True)
    f(False, np.ones(3))  # nothing runs: no error
    with pytest.raises(ValueError):
        f(True, np.ones(3))
    np.testing.assert_array_equal(state.get_value(), np.arange(4.0))
    f(True, np.full(4, 0.25))
    np.testing.assert_allclose(state.get_value(), np.arange(4.0) * 0.5 - 0.25, rtol=0,
                               atol=1e-15)


@pytest.mark.parametrize("dtype", ["float64"])  # the fill is the same code in either dtype
def test_lazy_step_zeroes_its_zero_states_after_reading_them(dtype):
    """A state in ``zeros`` is read by the inner graph, then filled with zeros
    (what the single-function form's buffers get on a stepping call); not on
    a call that does not step. Both code paths, against numpy."""
    from pytensor.graph.fg import FunctionGraph

    s_in, a_in = pt.vector(dtype=dtype), pt.vector(dtype=dtype)
    op = LazyStep(FunctionGraph([s_in, a_in], [s_in - a_in * 0.5], clone=False), 2, zeros=(1,),
                  inplace=True)
    assert op.computed == (0,) and "1 zeroed" in str(op)
    for mode in MODES:
        state = pytensor.shared(np.arange(4.0).astype(dtype), name="s")
        buf = pytensor.shared(np.full(4, 2.0, dtype), name="buf")
        cond = pt.scalar("c", dtype="bool")
        s_out, buf_out = op(cond, state, buf)
        f = pytensor.function([cond], [], updates={state: s_out, buf: buf_out},
                              mode=la.mode(mode), accept_inplace=True)
        f(False)
        np.testing.assert_array_equal(state.get_value(), np.arange(4.0))
        np.testing.assert_array_equal(buf.get_value(), np.full(4, 2.0))
        f(True)
        _close(state.get_value(), np.arange(4.0) - 1.0, dtype, what=mode)
        np.testing.assert_array_equal(buf.get_value(), np.zeros(4))


@pytest.mark.parametrize("mode", ["CVM", "NUMBA", "JAX", "PYTORCH"])
def test_plain_modes_and_jax_pytorch_get_the_plain_ifelse(mode):
    """Compiled with PyTensor's own modes the single-function form is PyTensor's
    ``IfElse`` (its one node inlined), and so it is under JAX and PyTorch with ours.
    (PyTensor's own PyTorch mode cannot compile Adam: ``tests/test_upstream_pytorch.py``.)"""
    if mode in ("JAX", "PYTORCH"):
        pytest.importorskip(mode.lower() if mode == "JAX" else "torch")
    W, _ = _lazy_model("float64", "CVM")
    x = pt.matrix("x")
    y = pt.matrix("y")
    loss = 0.5 * ((x @ W - y) ** 2).sum()
    modes = {"CVM": lambda: ["CVM"], "NUMBA": lambda: ["NUMBA"],
             "JAX": lambda: ["JAX", la.mode("JAX")],
             "PYTORCH": lambda: [la.mode("PYTORCH")]}[mode]()   # built only for its own case
    for m in modes:
        f = pytensor.function([x, y], loss, updates=la.adam(loss, [W], 0.05, average=3),
                              mode=m)
        # our JAX linker converts some nodes through a Fixed wrapper: name the op inside
        ops = {type(getattr(n.op, "op", n.op)).__name__ for n in f.maker.fgraph.toposort()}
        assert ops & IFELSE and not ops & {"LazyStep", "WindowStep"}, (m, ops)


def _views_rule(grads, params, learning_rate):
    """A rule whose new ``a`` is a reversed view of ``b``'s old value and whose new ``b``
    is computed from ``b``: in place, ``b``'s buffer must not be written before ``a``."""
    a, b = params
    return {b: b * 2 + learning_rate * grads[1], a: b[::-1]}


@pytest.mark.parametrize("mode", MODES)
def test_lazy_step_in_place_with_a_new_value_that_views_another_state(mode):
    """numpy: after one window a = reversed old b, b = 2 b + 0.1 mean(grad of b)."""
    x = pt.vector("x")
    results = {}
    for name, m in (("ours", la.mode(mode)), ("plain", mode)):
        a = pytensor.shared(np.zeros(4), name="a")
        b = pytensor.shared(np.arange(4.0) * 10, name="b")
        loss = (a * x).sum() + (b * x).sum()
        upd = la.with_accumulated_gradients(loss, [a, b], 2, _views_rule, learning_rate=0.1)
        f = pytensor.function([x], [], updates=upd, mode=m)
        f(np.ones(4))
        f(np.full(4, 3.0))
        results[name] = a.get_value().copy(), b.get_value().copy()
    want_a = (np.arange(4.0) * 10)[::-1]
    want_b = np.arange(4.0) * 20 + 0.1 * 2.0
    for name, (a_val, b_val) in results.items():
        np.testing.assert_allclose(a_val, want_a, rtol=0, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(b_val, want_b, rtol=0, atol=1e-12, err_msg=name)


def test_float16_single_function_form_compiles_in_c():
    """Numba compiles no float16: the lazy step's rule then runs in C, with the numbers of
    PyTensor's own C mode."""
    got = {}
    for name, m in (("ours", la.mode("CVM")), ("plain", "CVM")):
        W = pytensor.shared(np.linspace(-1, 1, 6).astype("float16"), name="W")
        g = pt.vector("g", dtype="float16")
        f = pytensor.function([g], [], updates=la.adam([g], [W], 0.01, average=2), mode=m)
        for k in range(4):
            f(np.full(6, k + 1, "float16"))
        got[name] = W.get_value()
    assert got["ours"].dtype == np.float16
    np.testing.assert_array_equal(got["ours"], got["plain"])


# ------------------------------------------------------------------ sums of squares


def _sum_squares_nodes(fn):
    from lasagne_accum._pytensor.sum_squares import SumSquares

    return [n for n in fn.maker.fgraph.toposort() if isinstance(n.op, SumSquares)]


def _reference_sum_squares(x, square):
    """Each square rounded to `square`'s precision (numpy, elementwise), summed exactly in
    float64 with math.fsum."""
    import math

    squares = np.square(np.asarray(x, dtype=square), dtype=square)
    return math.fsum(float(v) for v in squares.ravel())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype, dtype_sum", [("float32", "float32"), ("float32", "float64"),
                                              ("float64", "float64")])
def test_sum_of_squares_is_one_vectorized_op_and_exact(mode, dtype, dtype_sum):
    """The tagged sum becomes SumSquares in our modes, on every layout and length (the
    remainder loop included), equal to an exact float64 sum of the same squares; NaN and
    infinity propagate; PyTensor's own mode keeps its reduction and the same value."""
    from lasagne_accum._graph import sum_of_squares

    rng = np.random.default_rng(3)
    base = rng.standard_normal((37, 29)).astype(dtype) * 3
    x = pt.matrix("x", dtype=dtype)
    expr = sum_of_squares(x, dtype_sum)
    fn = pytensor.function([x], expr, mode=la.mode(mode))
    plain = pytensor.function([x], sum_of_squares(x, dtype_sum), mode=mode)
    assert len(_sum_squares_nodes(fn)) == 1 and not _sum_squares_nodes(plain)
    # a float32 array summed as float32 squares the elements in float32; cast to float64
    # first, in float64
    square = "float32" if dtype == "float32" and dtype_sum == "float32" else "float64"
    # a float64 sum of n <= 1073 terms in any order: within n * 2**-53 of the exact sum;
    # a float32 result: its own rounding
    tol = 1.2e-13 if dtype_sum == "float64" else 6e-8
    for case in (base, base.T, base[::2, 3:], base[:0], base[:1, :7]):
        want = _reference_sum_squares(case, square)
        got = float(fn(case))
        assert got == pytest.approx(want, rel=tol, abs=1e-300), case.shape
        assert float(plain(case)) == pytest.approx(want, rel=tol, abs=1e-300)
    for bad, want in ((np.nan, np.isnan), (np.inf, np.isposinf)):
        spoiled = base.copy()
        spoiled[5, 7] = bad
        assert want(float(fn(spoiled)))


def test_only_tagged_sums_become_sum_squares():
    """A user's own ``(x ** 2).sum()`` keeps PyTensor's reduction, in our modes too."""
    x = pt.vector("x")
    for mode in MODES:
        fn = pytensor.function([x], pt.sqr(x).sum(), mode=la.mode(mode))
        assert not _sum_squares_nodes(fn)


def test_sum_squares_op_python_and_compiled_agree():
    """perform() (the Python fallback), the C code and the Numba code on one array."""
    from lasagne_accum._pytensor.sum_squares import SumSquares

    x = pt.tensor3("x", dtype="float32")
    value = np.random.default_rng(4).standard_normal((3, 5, 7)).astype("float32")
    want = {sq: _reference_sum_squares(value, sq) for sq in ("float32", "float64")}
    for square in ("float32", "float64"):
        node = SumSquares(square)(x).owner
        out = [[None]]
        node.op.perform(node, [value], out)
        assert float(out[0][0]) == pytest.approx(want[square], rel=2e-14)
        for mode in ("CVM", "NUMBA"):
            fn = pytensor.function([x], SumSquares(square)(x), mode=la.mode(mode))
            assert float(fn(value)) == pytest.approx(want[square], rel=2e-14)
    with pytest.raises(TypeError, match="float32 or float64"):
        SumSquares()(pt.ivector())
    with pytest.raises(TypeError, match="takes float32"):
        SumSquares("float32")(pt.dvector())


# --------------------------------------------------------------- GemmSquares


def _gemm_squares_cases(dtype):
    """(z, alpha, x, y, beta) on both sides of use_gram's line, in several layouts."""
    from lasagne_accum._pytensor.gemm_squares import BLOCK, use_gram

    rng = np.random.default_rng(11)

    def matrix(shape, layout):
        if layout == "strided":   # every other column of a wider array
            return rng.standard_normal((shape[0], 2 * shape[1]))[:, ::2].astype(dtype)
        a = rng.standard_normal(shape).astype(dtype)
        return np.asfortranarray(a) if layout == "F" else a

    cases = []
    for m, k, n in ((40, 3, 30), (40, 30, 30)):     # Gram matrices, then the product's pass
        for (xl, yl, zl), beta in zip((("C", "C", "C"), ("F", "F", "C"), ("strided", "C", "C"),
                                       ("C", "strided", "F")), (1.0, 0.5, 0.0, 1.0)):
            z = matrix((m, n), zl)
            if beta == 0:
                z[0, 0] = np.nan   # not read with beta = 0 (as BLAS)
            cases.append((z, 0.3, matrix((m, k), xl), matrix((k, n), yl), beta))
        assert use_gram(m, n, 3) and not use_gram(m, n, 30)
    # an empty batch; and a product of more than BLOCK elements (several row blocks)
    cases.append((matrix((6, 5), "C"), 0.3, matrix((6, 0), "C"), matrix((0, 5), "C"), 0.5))
    assert not use_gram(6, 5, 0)   # the empty batch takes the product's way
    m, k, n = BLOCK // 16 + 37, 16, 16
    assert m * n > BLOCK and not use_gram(m, n, k)
    cases.append((matrix((m, n), "C"), 0.3, matrix((m, k), "F"), matrix((k, n), "C"), 1.0))
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES + ["py"])
def test_gemm_squares_equals_numpy_on_every_layout_and_both_ways(dtype, mode):
    """z := beta z + alpha x @ y and sum((x @ y)^2) against numpy in float64, for batches
    that take the Gram matrices and batches that square the product, in C, Numba and
    the Python implementation."""
    from lasagne_accum._pytensor import gemm_squares

    gemm_squares.register_numba()
    z, x, y = (pt.matrix(v, dtype=dtype) for v in "zxy")
    alpha, beta = pt.scalar("alpha", dtype=dtype), pt.scalar("beta", dtype=dtype)
    out = gemm_squares.GemmSquares()(z, alpha, x, y, beta)
    compiled = (pytensor.compile.mode.Mode(linker="py", optimizer=None) if mode == "py"
                else la.mode(mode))
    f = pytensor.function([z, alpha, x, y, beta], out, mode=compiled)
    assert any(isinstance(n.op, gemm_squares.GemmSquares) for n in f.maker.fgraph.toposort())
    for zv, a, xv, yv, b in _gemm_squares_cases(dtype):
        product = xv.astype(np.float64) @ yv.astype(np.float64)
        want = a * product + (b * zv.astype(np.float64) if b else 0)
        before = zv.copy()
        got_z, got_sq = f(zv, np.asarray(a, dtype), xv, yv, np.asarray(b, dtype))
        assert got_z.dtype == dtype and got_sq.dtype == np.float64
        _close(got_z, want, dtype, tol=1e-5 if dtype == "float32" else None)
        np.testing.assert_allclose(got_sq, np.sum(product ** 2),
                                   rtol=1e-5 if dtype == "float32" else 1e-12)
        np.testing.assert_array_equal(zv, before)   # not in place: z is left as it was
    with pytest.raises(ValueError):
        f(np.zeros((4, 5), dtype), np.asarray(1, dtype), np.zeros((4, 3), dtype),
          np.zeros((2, 5), dtype), np.asarray(1, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_gemm_squares_in_place_into_a_strided_z(dtype, mode):
    """Made in place by our rewrite (z a mutable input), into a z that BLAS cannot write
    (every other column of a wider array): the values arrive in z itself, both ways, and
    with beta = 0 its NaN is not read."""
    from lasagne_accum._pytensor import gemm_squares

    gemm_squares.register_numba()
    z, x, y = (pt.matrix(v, dtype=dtype) for v in "zxy")
    alpha, beta = pt.scalar("alpha", dtype=dtype), pt.scalar("beta", dtype=dtype)
    out = gemm_squares.GemmSquares()(z, alpha, x, y, beta)
    f = pytensor.function([pytensor.In(z, mutable=True), alpha, x, y, beta], out[1],
                          mode=la.mode(mode))
    ops = [n.op for n in f.maker.fgraph.toposort() if isinstance(n.op, gemm_squares.GemmSquares)]
    assert [op.inplace for op in ops] == [True]
    rng = np.random.default_rng(5)
    for k, b in ((3, 0.0), (30, 1.0)):   # the Gram matrices, then the product's pass
        wide = rng.standard_normal((40, 60)).astype(dtype)
        wide[0, 0] = np.nan
        zv = wide[:, ::2]
        before = zv.astype(np.float64)
        xv, yv = (rng.standard_normal(s).astype(dtype) for s in ((40, k), (k, 30)))
        product = xv.astype(np.float64) @ yv.astype(np.float64)
        want = 0.5 * product + (b * before if b else 0)   # NaN at [0, 0] only with beta = 1
        sq = f(zv, np.asarray(0.5, dtype), xv, yv, np.asarray(b, dtype))
        assert np.isnan(zv[0, 0]) == (b == 1.0)
        _close(np.nan_to_num(zv), np.nan_to_num(want), dtype,
               tol=1e-5 if dtype == "float32" else None)
        np.testing.assert_allclose(sq, np.sum(product ** 2),
                                   rtol=1e-5 if dtype == "float32" else 1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_noise_scale_accumulate_is_one_inplace_gemm_squares_and_plain_modes_keep_the_gram(mode):
    """With noise_scale, the large weight's gemm and its squares are one in-place op in our
    modes; PyTensor's own FAST_RUN keeps the Gram sum."""
    from lasagne_accum._pytensor.gemm_squares import GemmSquares, ProductSquares

    def accumulate_fn(compile_mode):
        W = pytensor.shared(np.zeros((130, 129)), name="W")
        x, t = pt.matrix("x"), pt.matrix("t")
        loss = ((x @ W - t) ** 2).sum(axis=1).mean() / 2
        accu = la.accumulate_gradients(loss, [W], weight=x.shape[0], noise_scale=True)
        return pytensor.function([x, t], [], updates=accu.accumulate, mode=compile_mode)

    f = accumulate_fn(la.mode(mode))
    ours = [n.op for n in f.maker.fgraph.toposort()]
    assert [op.inplace for op in ours if isinstance(op, GemmSquares)] == [True], ours
    assert not any(isinstance(op, ProductSquares) for op in ours), ours
    assert "W.grad_accu" in _destroyed_inputs(f)
    plain = [n.op for n in accumulate_fn("FAST_RUN").maker.fgraph.toposort()]
    assert not any(isinstance(op, (GemmSquares, ProductSquares)) for op in plain), plain


@pytest.mark.parametrize("mode", MODES)
def test_a_float32_weight_among_float64_params_keeps_the_gram_sum(mode):
    """The squared norms add up in float64 there, so the Gram sum's factors are cast and
    no Gemm shares them: the placeholder becomes the Gram sum again, with its numbers."""
    from lasagne_accum._pytensor.gemm_squares import GemmSquares, ProductSquares

    rng = np.random.default_rng(3)
    X, T = rng.normal(size=(9, 130)), rng.normal(size=(9, 129))
    W = pytensor.shared((0.01 * rng.normal(size=(130, 129))).astype("float32"), name="W")
    c = pytensor.shared(np.zeros(129), name="c")
    x, t = pt.matrix("x"), pt.matrix("t")
    loss = ((pt.cast(x, "float32") @ W + c - t) ** 2).sum(axis=1).mean() / 2
    accu = la.accumulate_gradients(loss, [W, c], weight=x.shape[0], noise_scale=True)
    f = pytensor.function([x, t], [], updates=accu.accumulate, mode=la.mode(mode))
    assert not any(isinstance(n.op, (GemmSquares, ProductSquares))
                   for n in f.maker.fgraph.toposort())
    f(X, T)
    r = (X.astype(np.float32) @ W.get_value() + c.get_value() - T) / 9
    want = 9 * (np.sum((X.astype(np.float32).astype(np.float64).T @ r) ** 2)
                + np.sum(r.sum(axis=0) ** 2))
    np.testing.assert_allclose(accu.grad_sq.get_value(), want, rtol=1e-5)
