"""Tests of the two-function form: ``accumulate_gradients`` / ``reset`` / ``Accumulation``.

The independent reference is "one step of the same rule on the concatenated
large batch": the model's loss is a MEAN over the examples of the batch, so
accumulating N mini-batches with ``weight=batch_size`` and applying the rule
once must give exactly what one plain step on the concatenation gives.

Compilation dominates the cost, so every compiled function is cached in a
module-level dict and the shared variables are reset with ``set_value`` at the
start of each hypothesis example.
"""

import dataclasses
from collections import OrderedDict

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lasagne_accum as L
from lasagne_accum import Accumulation, accumulate_gradients, reset

from reference import (  # tests/reference.py: tests/ is on sys.path under pytest
    B0,
    N_IN,
    N_OUT,
    RULES,
    W0,
    Model,
    assert_close,
    assert_close_within,
    by_name,
    concat,
    float32_grad_error,
    make_batch,
    np_grads,
    step_with_grad_error,
    zero,
)

PROP = settings(max_examples=10, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------- helpers


def assert_same_values(actual, expected, dtype, what=""):
    """Compare two {name: shared} dicts of the same names value by value."""
    assert_close(actual, expected, dtype, what)


_CACHE = {}


def _step_setup(dtype, mode):
    """One accumulating model and per-batch function per (dtype, mode)."""
    key = ("step", dtype, mode)
    if key not in _CACHE:
        m = Model(dtype)
        # float32 model: an integer batch-size input; float64 model: a float one.
        n = pt.iscalar("n") if dtype == "float32" else pt.scalar("n", dtype="float64")
        acc = accumulate_gradients(m.loss, m.params, weight=n)
        step_fn = pytensor.function([m.X, m.Y, n], m.loss, updates=acc.accumulate, mode=mode)
        _CACHE[key] = (m, acc, step_fn)
    return _CACHE[key]


def build(rule, dtype="float64", mode=None):
    """Compiled two-function form and large-batch reference for one rule."""
    key = (rule, dtype, mode)
    if key in _CACHE:
        return _CACHE[key]
    fn = getattr(L, rule)
    hyper = RULES[rule]
    m, acc, step_fn = _step_setup(dtype, mode)
    rule_updates = fn(acc.grads, m.params, **hyper)
    acc_state = [v for v in rule_updates if v not in m.params]
    apply_updates = OrderedDict(rule_updates)
    apply_updates.update(acc.reset)
    apply_fn = pytensor.function([], [], updates=apply_updates, mode=mode)

    ref = Model(dtype)
    ref_updates = fn(ref.loss, ref.params, **hyper)
    ref_state = [v for v in ref_updates if v not in ref.params]
    ref_fn = pytensor.function([ref.X, ref.Y], [], updates=ref_updates, mode=mode)

    def reset_all():
        m.reset_params()
        ref.reset_params()
        zero(acc_state + ref_state + acc.accumulators + [acc.count, acc.total])

    setup = dict(model=m, acc=acc, step=step_fn, apply=apply_fn, acc_state=acc_state,
                 ref=ref, ref_fn=ref_fn, ref_state=ref_state, reset=reset_all)
    _CACHE[key] = setup
    return setup


def check_against_reference(s, dtype, what):
    assert_same_values(by_name(s["model"].params), by_name(s["ref"].params), dtype, what)
    assert_same_values(by_name(s["acc_state"]), by_name(s["ref_state"]), dtype, what)


def check_float32_against_float64_step(s, rule, batches, what):
    """Both float32 runs against the float64 numpy step, within float32 rounding.

    Two float32 runs that sum the same gradient in different orders differ by
    its rounding, and where the terms of a gradient element cancel, a rule
    like Adagrad (step ~ lr * g / sqrt(eps) for small g) multiplies that by
    lr / sqrt(eps), 100 here: comparing the two float32 runs with each other
    would be flaky. So each run is compared to the exact (float64) step, with a
    per-element slack that is the step's change under the gradient's float32
    error bound.
    """
    X, Y = concat(batches)
    W, b = W0.astype("float32"), B0.astype("float32")
    grads = dict(zip(("W", "b"), np_grads(W, b, X, Y)))
    errors = dict(zip(("W", "b"), float32_grad_error(W, b, X, Y, n_sums=len(batches))))
    expected, slack = step_with_grad_error(rule, {"W": W, "b": b}, grads, errors, **RULES[rule])
    for who, params, state in (("accumulated", s["model"].params, s["acc_state"]),
                               ("large batch", s["ref"].params, s["ref_state"])):
        assert_close_within(by_name(params + state), expected, slack, "float32",
                            f"{what} {who}")


def assert_buffers_zero(acc):
    for a in acc.accumulators:
        assert not np.any(a.get_value()), a.name
    assert int(acc.count.get_value()) == 0
    assert float(acc.total.get_value()) == 0.0


def run_window(s, batches):
    for X, Y in batches:
        s["step"](X, Y, len(X))
    assert int(s["acc"].count.get_value()) == len(batches)
    assert float(s["acc"].total.get_value()) == sum(len(X) for X, _ in batches)
    s["apply"]()
    s["ref_fn"](*concat(batches))


# -------------------------------------------- 1. property: N batches == one large batch


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("rule", list(RULES))
def test_accumulated_window_equals_large_batch_step(rule, dtype):
    s = build(rule, dtype)
    # every rule must have state to compare, except sgd
    assert (len(s["acc_state"]) == 0) == (rule == "sgd")

    @PROP
    @given(seed=st.integers(0, 2 ** 32 - 1),
           sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5))
    def prop(seed, sizes):
        s["reset"]()
        rng = np.random.default_rng(seed)
        batches = [make_batch(rng, k, dtype) for k in sizes]
        run_window(s, batches)
        what = f"{rule}/{dtype} sizes={sizes}"
        if dtype == "float32":
            check_float32_against_float64_step(s, rule, batches, what)
        else:
            check_against_reference(s, dtype, what)
        assert_buffers_zero(s["acc"])
        for p in s["model"].params:
            assert p.get_value().dtype == dtype

    prop()


# ----------------------------------- 2. several windows in a row, partial last window


@pytest.mark.parametrize("rule", list(RULES))
def test_consecutive_windows_and_short_flush(rule):
    s = build(rule, "float64")
    s["reset"]()
    rng = np.random.default_rng(7)
    # three full windows of 3 batches, then a short flush of 2 batches
    windows = [[3, 1, 2], [5, 5, 5], [2, 6, 4], [1, 3]]
    for i, sizes in enumerate(windows):
        run_window(s, [make_batch(rng, k) for k in sizes])
        check_against_reference(s, "float64", f"{rule} window {i}")
        assert_buffers_zero(s["acc"])
    # the parameters really moved over the 4 steps
    assert not np.allclose(s["model"].W.get_value(), W0)


# ----------------------------------------------- 3. average=False is the plain sum


def test_average_false_is_the_sum():
    m = Model()
    acc_sum = accumulate_gradients(m.loss, m.params, average=False, name="sum")
    acc_mean = accumulate_gradients(m.loss, m.params, name="mean")
    acc_wsum = accumulate_gradients(m.loss, m.params, average=False, weight=m.X.shape[0],
                                    name="wsum")
    updates = OrderedDict(acc_sum.accumulate)
    updates.update(acc_mean.accumulate)
    updates.update(acc_wsum.accumulate)
    step = pytensor.function([m.X, m.Y], [], updates=updates)
    grads = pytensor.function([], acc_sum.grads + acc_mean.grads + acc_wsum.grads)

    rng = np.random.default_rng(3)
    n_batches, size = 4, 3
    batches = [make_batch(rng, size) for _ in range(n_batches)]
    for X, Y in batches:
        step(X, Y)
    g_sum_W, g_sum_b, g_mean_W, g_mean_b, g_wsum_W, g_wsum_b = grads()
    per_batch = [np_grads(W0, B0, X, Y) for X, Y in batches]
    exp_W = sum(g[0] for g in per_batch)
    exp_b = sum(g[1] for g in per_batch)
    np.testing.assert_allclose(g_sum_W, exp_W, rtol=1e-12)
    np.testing.assert_allclose(g_sum_b, exp_b, rtol=1e-12)
    # equal batch sizes: the sum is N times the mean
    np.testing.assert_allclose(g_sum_W, n_batches * g_mean_W, rtol=1e-12)
    np.testing.assert_allclose(g_sum_b, n_batches * g_mean_b, rtol=1e-12)
    # weighted sum: sum_k n_k g_k
    np.testing.assert_allclose(g_wsum_W, size * exp_W, rtol=1e-12)
    np.testing.assert_allclose(g_wsum_b, size * exp_b, rtol=1e-12)
    assert int(acc_sum.count.get_value()) == n_batches
    assert float(acc_wsum.total.get_value()) == n_batches * size


# ---------------------------------------------------- 4. reset really zeroes


def test_apply_with_reset_zeroes_everything():
    s = build("adam", "float64")
    s["reset"]()
    rng = np.random.default_rng(4)
    acc = s["acc"]
    for k in (2, 5):
        s["step"](*make_batch(rng, k), k)
    assert all(np.any(a.get_value()) for a in acc.accumulators)
    assert int(acc.count.get_value()) == 2
    assert float(acc.total.get_value()) == 7.0
    s["apply"]()
    assert_buffers_zero(acc)
    # names follow the documented convention
    assert [a.name for a in acc.accumulators] == ["W.grad_accu", "b.grad_accu"]
    assert acc.count.name == "accumulate.count"
    assert set(acc.reset) == set(acc.accumulators) | {acc.count, acc.total}


def test_reset_function():
    a = pytensor.shared(np.arange(3.0), name="a")
    c = pytensor.shared(np.array([[1.0, 2.0]], dtype="float32"), name="c")
    k = pytensor.shared(np.int64(5), name="k")
    upd = reset([a, c, k])
    assert list(upd) == [a, c, k]
    pytensor.function([], [], updates=upd)()
    assert a.get_value().tolist() == [0.0, 0.0, 0.0]
    assert c.get_value().dtype == np.float32 and not c.get_value().any()
    assert c.get_value().shape == (1, 2)
    assert int(k.get_value()) == 0 and k.get_value().dtype == np.int64
    # a single shared variable and a dict (its keys) are accepted
    assert list(reset(a)) == [a]
    assert list(reset(OrderedDict([(a, a + 1), (k, k + 1)]))) == [a, k]
    with pytest.raises(TypeError, match="not a shared variable"):
        reset([a, pt.vector("v")])


# ------------------------------------------------------- 5. Accumulation API


def test_accumulation_api_and_count():
    m = Model()
    result = accumulate_gradients(m.loss, m.params)
    assert isinstance(result, Accumulation)
    assert len(result) == 2 and result[0] is result.accumulate and result[1] is result.reset
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.count = None   # frozen
    accu, rst = result
    assert accu is result.accumulate and rst is result.reset
    assert isinstance(accu, OrderedDict) and isinstance(rst, OrderedDict)
    assert accu.grads is result.grads and len(accu.grads) == 2
    assert accu.count is result.count
    assert accu.accumulation is result
    assert result.count.type.dtype == "int64" and result.count.type.ndim == 0
    # without weight the total is the count
    assert result.total is result.count
    assert result.skipped is None and result.norm is None
    assert result.params == m.params
    assert [g.type.dtype for g in result.grads] == ["float64", "float64"]

    step = pytensor.function([m.X, m.Y], [], updates=accu)
    rng = np.random.default_rng(5)
    batches = [make_batch(rng, 2) for _ in range(3)]
    for i, (X, Y) in enumerate(batches, 1):
        step(X, Y)
        assert int(result.count.get_value()) == i
    # unweighted mean of the 3 batch means
    gW, gb = pytensor.function([], result.grads)()
    per_batch = [np_grads(W0, B0, X, Y) for X, Y in batches]
    np.testing.assert_allclose(gW, sum(g[0] for g in per_batch) / 3, rtol=1e-12)
    np.testing.assert_allclose(gb, sum(g[1] for g in per_batch) / 3, rtol=1e-12)
    pytensor.function([], [], updates=rst)()
    assert int(result.count.get_value()) == 0


def _adam_first_step(p, g, lr=0.01, b1=0.9, b2=0.999, eps=1e-8):
    m = (1 - b1) * g
    v = (1 - b2) * g ** 2
    a = lr * np.sqrt(1 - b2) / (1 - b1)
    return p - a * m / (np.sqrt(v) + eps), m, v


def test_guard_makes_empty_apply_a_noop():
    m = Model()
    n = pt.scalar("n")
    acc = accumulate_gradients(m.loss, m.params, weight=n)
    rule = L.adam(acc.grads, m.params, learning_rate=0.01)
    state = by_name([v for v in rule if v not in m.params])
    apply = OrderedDict(rule)
    apply.update(acc.reset)
    guarded = acc.guard(apply)
    assert list(guarded) == list(apply)
    step = pytensor.function([m.X, m.Y, n], [], updates=acc.accumulate)
    apply_fn = pytensor.function([], [], updates=guarded)
    snapshot = lambda: {v.name: v.get_value().copy()  # noqa: E731
                        for v in m.params + list(state.values())}

    before = snapshot()
    for _ in range(2):  # empty window: nothing changes, no NaN, t stays 0
        apply_fn()
        after = snapshot()
        for name in before:
            assert np.all(np.isfinite(after[name])), name
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert float(state["adam.t"].get_value()) == 0.0

    # after a real accumulation it applies: one Adam step on the mean gradient
    rng = np.random.default_rng(6)
    batches = [make_batch(rng, 3), make_batch(rng, 2)]
    for X, Y in batches:
        step(X, Y, len(X))
    apply_fn()
    assert float(state["adam.t"].get_value()) == 1.0
    g = np_grads(W0, B0, *concat(batches))
    for p0, gi, p, name in zip((W0, B0), g, m.params, ("W", "b")):
        exp_p, exp_m, exp_v = _adam_first_step(p0, gi)
        np.testing.assert_allclose(p.get_value(), exp_p, rtol=1e-10)
        np.testing.assert_allclose(state[f"{name}.adam_m"].get_value(), exp_m, rtol=1e-10)
        np.testing.assert_allclose(state[f"{name}.adam_v"].get_value(), exp_v, rtol=1e-10)
    assert_buffers_zero(acc)
    # and the next empty flush is again a no-op
    before = snapshot()
    apply_fn()
    for name, value in snapshot().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_unguarded_empty_apply_changes_nothing():
    """0 / 0 on an empty window must not turn W NaN: a rule given accu.grads is guarded."""
    m = Model()
    acc = accumulate_gradients(m.loss, m.params, weight=m.X.shape[0])
    upd = L.sgd(acc.grads, m.params, learning_rate=0.1)
    pytensor.function([], [], updates=upd)()
    np.testing.assert_array_equal(m.W.get_value(), W0)
    np.testing.assert_array_equal(m.b.get_value(), B0)


# ------------------------------------------------------------ 6. max_norm


def test_max_norm_clips_the_accumulated_gradient_once():
    m = Model()
    n = pt.scalar("n")
    rng = np.random.default_rng(8)
    batches = [make_batch(rng, 3), make_batch(rng, 2)]
    g_mean = np_grads(W0, B0, *concat(batches))
    norm = np.sqrt(sum(np.sum(g ** 2) for g in g_mean))
    max_norm = 0.5 * norm
    acc = accumulate_gradients(m.loss, m.params, weight=n, max_norm=max_norm)
    assert acc.norm is not None
    step = pytensor.function([m.X, m.Y, n], [], updates=acc.accumulate)
    out = pytensor.function([], acc.grads + [acc.norm])
    for X, Y in batches:
        step(X, Y, len(X))
    gW, gb, got_norm = out()

    np.testing.assert_allclose(got_norm, norm, rtol=1e-12)
    scale = max_norm / (1e-7 + norm)
    np.testing.assert_allclose(gW, g_mean[0] * scale, rtol=1e-12)
    np.testing.assert_allclose(gb, g_mean[1] * scale, rtol=1e-12)
    np.testing.assert_allclose(np.sqrt(np.sum(gW ** 2) + np.sum(gb ** 2)), max_norm, rtol=1e-6)

    # clipping each micro-batch first, then averaging, is a different thing
    per_batch = []
    for X, Y in batches:
        g = np_grads(W0, B0, X, Y)
        nb = np.sqrt(sum(np.sum(x ** 2) for x in g))
        per_batch.append([x * min(nb, max_norm) / (1e-7 + nb) for x in g])
    w = np.array([3.0, 2.0]) / 5.0
    naive_W = w[0] * per_batch[0][0] + w[1] * per_batch[1][0]
    assert np.max(np.abs(naive_W - gW)) > 1e-3

    # a max_norm above the norm leaves the mean gradient (almost) unchanged
    acc2 = accumulate_gradients(m.loss, m.params, weight=n, max_norm=10 * norm, name="loose")
    step2 = pytensor.function([m.X, m.Y, n], [], updates=acc2.accumulate)
    for X, Y in batches:
        step2(X, Y, len(X))
    gW2, _ = pytensor.function([], acc2.grads)()
    np.testing.assert_allclose(gW2, g_mean[0], rtol=1e-6)


# ------------------------------------------------------ 7. skip_nonfinite


def test_skip_nonfinite_drops_the_bad_batch():
    m = Model()
    n = pt.scalar("n")
    acc = accumulate_gradients(m.loss, m.params, weight=n, skip_nonfinite=True)
    assert acc.skipped is not None and acc.skipped.type.dtype == "int64"
    apply = OrderedDict(L.sgd(acc.grads, m.params, learning_rate=0.5))
    apply.update(acc.reset)
    step = pytensor.function([m.X, m.Y, n], [], updates=acc.accumulate)
    apply_fn = pytensor.function([], [], updates=apply)
    grads = pytensor.function([], acc.grads)

    rng = np.random.default_rng(9)
    good1, good2 = make_batch(rng, 3), make_batch(rng, 4)
    Xbad, Ybad = make_batch(rng, 2)
    Xbad[1, 0] = np.nan
    step(*good1, 3)
    acc_before = [a.get_value().copy() for a in acc.accumulators]
    step(Xbad, Ybad, 2)
    assert int(acc.count.get_value()) == 1
    assert float(acc.total.get_value()) == 3.0
    assert int(acc.skipped.get_value()) == 1
    for a, before in zip(acc.accumulators, acc_before):
        np.testing.assert_array_equal(a.get_value(), before)
    step(*good2, 4)
    assert int(acc.count.get_value()) == 2
    assert float(acc.total.get_value()) == 7.0
    assert int(acc.skipped.get_value()) == 1

    g = np_grads(W0, B0, *concat([good1, good2]))
    gW, gb = grads()
    np.testing.assert_allclose(gW, g[0], rtol=1e-12)
    np.testing.assert_allclose(gb, g[1], rtol=1e-12)
    apply_fn()
    np.testing.assert_allclose(m.W.get_value(), W0 - 0.5 * g[0], rtol=1e-12)
    np.testing.assert_allclose(m.b.get_value(), B0 - 0.5 * g[1], rtol=1e-12)
    # skipped is never reset; count and total are
    assert int(acc.skipped.get_value()) == 1
    assert int(acc.count.get_value()) == 0 and float(acc.total.get_value()) == 0.0


# ---------------------------------------------------------- 8. dtypes


def _dtypes(acc):
    """The dtypes of an accumulation: (accumulators, total, accumulated gradients)."""
    return ([a.type.dtype for a in acc.accumulators], acc.total.type.dtype,
            [g.type.dtype for g in acc.grads])


def test_float16_params_accumulate_in_float32():
    # numba has no float16 type (NotImplementedError: float16), so this runs under the
    # C backend; the dtype checks are backend independent.
    mode = "CVM"
    m = Model("float32", w_dtype="float16", b_dtype="float16")
    n = pt.iscalar("n")
    acc = accumulate_gradients(m.loss, m.params, weight=n)
    assert _dtypes(acc) == (["float32", "float32"], "float32", ["float16", "float16"])
    apply = OrderedDict(L.sgd(acc.grads, m.params, learning_rate=0.1))
    apply.update(acc.reset)
    step = pytensor.function([m.X, m.Y, n], [], updates=acc.accumulate, mode=mode)
    apply_fn = pytensor.function([], [], updates=apply, mode=mode)
    rng = np.random.default_rng(10)
    batches = [make_batch(rng, 3, "float32"), make_batch(rng, 5, "float32")]
    for X, Y in batches:
        step(X, Y, len(X))
    assert acc.accumulators[0].get_value().dtype == np.float32
    W16 = W0.astype("float16").astype("float64")
    b16 = B0.astype("float16").astype("float64")
    g = np_grads(W16, b16, *concat(batches))
    np.testing.assert_allclose(acc.accumulators[0].get_value() / 8.0, g[0], rtol=1e-2, atol=1e-3)
    apply_fn()
    assert m.W.get_value().dtype == np.float16 and m.b.get_value().dtype == np.float16
    np.testing.assert_allclose(m.W.get_value(), W16 - 0.1 * g[0], rtol=1e-2, atol=2e-3)
    assert_buffers_zero(acc)


def test_mixed_dtypes_keep_each_dtype():
    m = Model("float64", w_dtype="float32", b_dtype="float64")
    n = pt.scalar("n")
    acc = accumulate_gradients(m.loss, m.params, weight=n)
    assert _dtypes(acc) == (["float32", "float64"], "float64", ["float32", "float64"])
    rule = L.adam(acc.grads, m.params, learning_rate=0.01)
    state = by_name([v for v in rule if v not in m.params])
    assert state["W.adam_m"].type.dtype == "float32"
    assert state["b.adam_m"].type.dtype == "float64"
    apply = OrderedDict(rule)
    apply.update(acc.reset)
    step = pytensor.function([m.X, m.Y, n], [], updates=acc.accumulate)
    apply_fn = pytensor.function([], [], updates=apply)
    rng = np.random.default_rng(11)
    batches = [make_batch(rng, 2), make_batch(rng, 5)]
    for X, Y in batches:
        step(X, Y, len(X))
    apply_fn()
    assert m.W.get_value().dtype == np.float32 and m.b.get_value().dtype == np.float64
    g = np_grads(W0.astype("float32"), B0, *concat(batches))
    exp_W, _, _ = _adam_first_step(W0.astype("float32").astype("float64"), g[0])
    exp_b, _, _ = _adam_first_step(B0, g[1])
    np.testing.assert_allclose(m.W.get_value(), exp_W, rtol=1e-5)
    np.testing.assert_allclose(m.b.get_value(), exp_b, rtol=1e-10)


# ------------------------------------------------------ 9. bad input errors


def test_bad_inputs():
    m = Model()
    with pytest.raises(TypeError, match="weight must be a scalar"):
        accumulate_gradients(m.loss, m.params, weight=pt.vector("w"))
    with pytest.raises(ValueError, match="weight must be >= 0"):
        accumulate_gradients(m.loss, m.params, weight=-1)
    with pytest.raises(ValueError, match="weight must be positive"):
        accumulate_gradients(m.loss, m.params, weight=0)
    with pytest.raises(TypeError, match="not a shared variable"):
        accumulate_gradients(m.loss, [m.W, pt.vector("b")])
    with pytest.raises(TypeError, match="wrap it in a list"):
        accumulate_gradients(m.loss, m.W)
    with pytest.raises(ValueError, match="got 1 gradient expressions for 2 parameters"):
        accumulate_gradients([pt.zeros((N_IN, N_OUT))], m.params)
    with pytest.raises(ValueError, match="repeated|same variable"):
        accumulate_gradients(m.loss, [m.W, m.W])
    with pytest.raises(ValueError, match="at least one parameter"):
        accumulate_gradients(m.loss, [])
    with pytest.raises(TypeError, match="average must be True or False"):
        accumulate_gradients(m.loss, m.params, average=3)


def test_numeric_weight_is_a_constant_per_batch_weight():
    """A numeric weight > 0 is accepted and, being equal for all batches, gives the plain mean."""
    m = Model()
    acc = accumulate_gradients(m.loss, m.params, weight=2.5)
    step = pytensor.function([m.X, m.Y], [], updates=acc.accumulate)
    rng = np.random.default_rng(12)
    batches = [make_batch(rng, 2), make_batch(rng, 4)]
    for X, Y in batches:
        step(X, Y)
    assert float(acc.total.get_value()) == 5.0
    gW, _ = pytensor.function([], acc.grads)()
    per_batch = [np_grads(W0, B0, X, Y)[0] for X, Y in batches]
    np.testing.assert_allclose(gW, (per_batch[0] + per_batch[1]) / 2, rtol=1e-12)


# ------------------------------------------------------ 15. C backend too


@pytest.mark.parametrize("rule", ["momentum", "adam"])
def test_equivalence_under_cvm(rule):
    s = build(rule, "float64", mode="CVM")
    rng = np.random.default_rng(13)
    for sizes in ([1], [4, 2, 6], [3, 3, 1, 5, 2]):
        s["reset"]()
        run_window(s, [make_batch(rng, k) for k in sizes])
        check_against_reference(s, "float64", f"{rule} CVM {sizes}")
        assert_buffers_zero(s["acc"])


# ------------------------------------------- 16. safe by default


def test_readme_two_function_recipe_is_safe_on_an_empty_window():
    """The two-function recipe, unguarded: an empty window changes nothing (no NaN)."""
    m = Model()
    x, y = m.X, m.Y
    loss, params = m.loss, m.params
    accu, reset_ = accumulate_gradients(loss, params, weight=x.shape[0])
    apply = L.adam(accu.grads, params, learning_rate=1e-3)
    apply.update(reset_)
    step_fn = pytensor.function([x, y], loss, updates=accu)
    apply_fn = pytensor.function([], [], updates=apply)
    state = by_name([v for v in apply if v not in params and v.name.startswith(("W.", "b.",
                                                                                  "adam"))])
    state = {k: v for k, v in state.items() if "grad_accu" not in k}
    snapshot = lambda: {v.name: v.get_value().copy()  # noqa: E731
                        for v in params + list(state.values())}
    before = snapshot()
    apply_fn()  # a flush right at the start: empty window
    for name, value in snapshot().items():
        assert np.all(np.isfinite(value)), name
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    assert int(state["adam.t"].get_value()) == 0

    rng = np.random.default_rng(16)
    batches = [make_batch(rng, 3), make_batch(rng, 2)]
    for X, Y in batches:
        step_fn(X, Y)
    apply_fn()
    apply_fn()  # the end-of-epoch flush right after a full window
    assert int(state["adam.t"].get_value()) == 1
    g = np_grads(W0, B0, *concat(batches))
    for p0, gi, p in zip((W0, B0), g, params):
        exp_p, _, _ = _adam_first_step(p0, gi, lr=1e-3)
        np.testing.assert_allclose(p.get_value(), exp_p, rtol=1e-10)


def test_empty_window_grads_are_zero_not_nan():
    m = Model()
    acc = accumulate_gradients(m.loss, m.params, weight=m.X.shape[0], max_norm=1.0)
    gW, gb = pytensor.function([], acc.grads)()
    assert not gW.any() and not gb.any()


def test_skip_nonfinite_checks_what_enters_the_buffer():
    """float32 3e38 is finite; times weight 10 it is inf: skipped, not buffered."""
    w = pytensor.shared(np.zeros(2, dtype="float32"), name="w")
    g = pt.vector("g", dtype="float32")
    acc = accumulate_gradients([g], [w], weight=10, skip_nonfinite=True)
    step = pytensor.function([g], [], updates=acc.accumulate)
    step(np.array([3e38, 1.0], dtype="float32"))
    assert int(acc.skipped.get_value()) == 1 and int(acc.count.get_value()) == 0
    assert float(acc.total.get_value()) == 0.0
    np.testing.assert_array_equal(acc.accumulators[0].get_value(), [0.0, 0.0])
    step(np.array([1.0, 2.0], dtype="float32"))
    assert int(acc.skipped.get_value()) == 1 and int(acc.count.get_value()) == 1
    np.testing.assert_array_equal(acc.accumulators[0].get_value(), [10.0, 20.0])


def test_name_prefixes_buffers_and_counters():
    m = Model()
    a = accumulate_gradients(m.loss, m.params, name="enc", weight=m.X.shape[0],
                             skip_nonfinite=True)
    b = accumulate_gradients(m.loss, m.params)
    assert [v.name for v in a.accumulators] == ["W.enc_grad_accu", "b.enc_grad_accu"]
    assert (a.count.name, a.total.name, a.skipped.name) == ("enc.count", "enc.total",
                                                            "enc.skipped")
    # the default name keeps today's names, which checkpoints rely on
    assert [v.name for v in b.accumulators] == ["W.grad_accu", "b.grad_accu"]
    assert b.count.name == "accumulate.count"
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        accumulate_gradients(m.loss, m.params, name="")


def test_option_type_errors():
    m = Model()
    with pytest.raises(TypeError, match="skip_nonfinite must be True or False"):
        accumulate_gradients(m.loss, m.params, skip_nonfinite="yes")
    with pytest.raises(ValueError, match="max_norm must be >= 0"):
        accumulate_gradients(m.loss, m.params, max_norm=-1.0)


def test_a_copy_of_the_grads_list_keeps_the_guard():
    """The rules recognise ``accu.grads`` by the gradients themselves, so a copy of the
    list (``list(accu.grads)``, a tuple) still gives a guarded apply step: on an empty
    window nothing moves and Adam's step count stays 0 (numpy: the values as they were)."""
    m = Model()
    acc = accumulate_gradients(m.loss, m.params)
    for copy in (list, tuple):
        rule = L.adam(copy(acc.grads), m.params, learning_rate=0.01)
        apply_fn = pytensor.function([], [], updates=L.merge_updates(rule, acc.reset))
        before = [p.get_value().copy() for p in m.params]
        apply_fn()
        for p, old in zip(m.params, before):
            np.testing.assert_array_equal(p.get_value(), old)
        t = next(v for v in rule if v.name == "adam.t")
        assert int(t.get_value()) == 0


@pytest.mark.parametrize("wrapper", ["apply_momentum", "apply_nesterov_momentum"])
def test_apply_momentum_on_guarded_sgd_keeps_the_guard(wrapper):
    """Lasagne's idiom ``apply_momentum(sgd(accu.grads, ...))``: on an empty window
    neither the parameters nor the velocities move (they would: momentum * velocity)."""
    m = Model()
    acc = accumulate_gradients(m.loss, m.params)
    upd = getattr(L, wrapper)(L.sgd(acc.grads, m.params, 0.1), m.params, momentum=0.9)
    step = pytensor.function([m.X, m.Y], [], updates=acc.accumulate)
    apply_fn = pytensor.function([], [], updates=L.merge_updates(upd, acc.reset))
    step(*make_batch(np.random.default_rng(3), 4))
    apply_fn()   # a real step: the velocities are not zero now
    values = [v.get_value().copy() for v in upd]
    assert any(np.any(v) for v, var in zip(values, upd) if var.name.endswith("velocity"))
    for _ in range(2):
        apply_fn()   # empty windows
    for var, old in zip(upd, values):
        np.testing.assert_array_equal(var.get_value(), old, err_msg=var.name)
