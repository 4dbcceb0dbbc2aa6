"""Tests of the single-function form: ``rule(..., average=N)`` and ``with_accumulated_gradients``.

K windows of N calls of one compiled function must give the same parameters
and rule state as K windows of the two-function form (accumulate N batches,
apply once) and as K plain steps of the rule on the concatenated large batches
(the loss is a mean over the examples of the batch).

Compiled functions are cached in module-level dicts; shared variables are
reset with ``set_value`` before each scenario.
"""

from collections import OrderedDict
from functools import partial

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import lasagne_accum as L
from lasagne_accum import accumulate_gradients, with_accumulated_gradients

from reference import (  # tests/reference.py: tests/ is on sys.path under pytest
    B0,
    RULES,
    W0,
    Model,
    assert_close,
    concat,
    make_batch,
    np_grads,
    values,
    zero,
)

RTOL = 1e-10
K = 2  # windows per scenario


# ----------------------------------------------------------------- helpers


def is_accumulation_state(var):
    return var.name.endswith(".grad_accu") or var.name.startswith("average.")


_CACHE = {}


def reference(rule, mode=None):
    """The plain rule compiled once on a (dynamic-size) large batch."""
    key = ("ref", rule, mode)
    if key not in _CACHE:
        m = Model()
        upd = getattr(L, rule)(m.loss, m.params, **RULES[rule])
        state = [v for v in upd if v not in m.params]
        fn = pytensor.function([m.X, m.Y], [], updates=upd, mode=mode)
        _CACHE[key] = (m, state, fn)
    return _CACHE[key]


def two_function_form(rule, mode=None):
    """accumulate_gradients (weight = batch size) + the rule applied once per window."""
    skey = ("step", mode)
    if skey not in _CACHE:
        m = Model()
        n = pt.scalar("n")
        acc = accumulate_gradients(m.loss, m.params, weight=n)
        _CACHE[skey] = (m, acc, pytensor.function([m.X, m.Y, n], [], updates=acc.accumulate,
                                                  mode=mode))
    key = ("two", rule, mode)
    if key not in _CACHE:
        m, acc, step = _CACHE[skey]
        upd = getattr(L, rule)(acc.grads, m.params, **RULES[rule])
        state = [v for v in upd if v not in m.params]
        upd = OrderedDict(upd)
        upd.update(acc.reset)
        _CACHE[key] = (m, acc, step, state, pytensor.function([], [], updates=upd, mode=mode))
    return _CACHE[key]


def single_function_form(rule, every, weighted, mode=None, lazy=True):
    key = ("single", rule, every, weighted, mode, lazy)
    if key not in _CACHE:
        m = Model()
        n = pt.scalar("n")
        if lazy:
            upd = getattr(L, rule)(m.loss, m.params, **RULES[rule], average=every,
                                   weight=n if weighted else None)
        else:
            upd = with_accumulated_gradients(m.loss, m.params, every, getattr(L, rule),
                                             weight=n if weighted else None, lazy=False,
                                             **RULES[rule])
        all_state = [v for v in upd if v not in m.params]
        state = [v for v in all_state if not is_accumulation_state(v)]
        inputs = [m.X, m.Y, n] if weighted else [m.X, m.Y]
        fn = pytensor.function(inputs, [], updates=upd, mode=mode)
        _CACHE[key] = (m, state, all_state, fn)
    return _CACHE[key]


def run_scenario(rule, every, weighted, mode=None, lazy=True, seed=0):
    """K windows of `every` calls; checks against both references after each window.

    Returns the number of windows compared (K).
    """
    sm, s_state, s_all, single = single_function_form(rule, every, weighted, mode, lazy)
    rm, r_state, ref = reference(rule, mode)
    tm, acc, step, t_state, apply = two_function_form(rule, mode)
    for m in (sm, rm, tm):
        m.reset_params()
    zero(s_all + r_state + t_state + acc.accumulators + [acc.count, acc.total])

    rng = np.random.default_rng(seed)
    for window in range(K):
        if weighted:
            sizes = rng.integers(1, 7, size=every)
        else:
            sizes = [3] * every  # equal sizes: the plain mean of means is the large-batch mean
        batches = [make_batch(rng, int(k)) for k in sizes]
        start = values(sm.params + s_state)
        for i, (X, Y) in enumerate(batches):
            if weighted:
                single(X, Y, len(X))
            else:
                single(X, Y)
            if i < every - 1:  # a non-stepping call changes neither params nor rule state
                assert_close(values(sm.params + s_state), start, "float64",
                             f"{rule} N={every} call {i + 1}", exact=True)
            step(X, Y, len(X))
        apply()
        ref(*concat(batches))
        what = f"{rule} N={every} weighted={weighted} mode={mode} lazy={lazy} window {window}"
        got = values(sm.params + s_state)
        assert_close(got, values(rm.params + r_state), "float64", what + " vs large batch")
        assert_close(got, values(tm.params + t_state), "float64",
                     what + " vs two-function form")
    assert not np.allclose(sm.W.get_value(), W0)
    return window + 1


# ------------------------------- 10. single function == two functions == large batch


@pytest.mark.parametrize("every", [1, 2, 3, 5])
@pytest.mark.parametrize("rule", list(RULES))
def test_single_function_equals_two_functions_and_large_batch(rule, every):
    assert run_scenario(rule, every, weighted=False) == K


@pytest.mark.parametrize("every", [2, 5])
@pytest.mark.parametrize("rule", list(RULES))
def test_single_function_weighted_unequal_batches(rule, every):
    assert run_scenario(rule, every, weighted=True, seed=every) == K


def test_counter_and_buffers_follow_the_window():
    sm, s_state, s_all, single = single_function_form("adam", 3, True)
    sm.reset_params()
    zero(s_all)
    by = {v.name: v for v in s_all}
    count, total = by["average.count"], by["average.total"]
    assert count.type.dtype == "int64"
    assert set(by) == {"average.count", "average.total", "average.zeroed", "W.grad_accu",
                       "b.grad_accu", "W.adam_m", "W.adam_v", "b.adam_m", "b.adam_v", "adam.t"}
    assert by["average.zeroed"].type.dtype == "bool"
    rng = np.random.default_rng(1)
    batches = [make_batch(rng, k) for k in (2, 4, 1, 5)]
    expected = [(1, 2.0, 0), (2, 6.0, 0), (0, 7.0, 1), (1, 5.0, 1)]
    for (X, Y), (c, tot, t) in zip(batches, expected):
        single(X, Y, len(X))
        assert int(count.get_value()) == c
        assert float(total.get_value()) == tot
        assert float(by["adam.t"].get_value()) == t
        # the stepping call (the 3rd) leaves the buffers at zero, and says so
        assert bool(by["average.zeroed"].get_value()) == (c == 0)
        if c == 0:
            for name in ("W.grad_accu", "b.grad_accu"):
                assert not by[name].get_value().any()
    # the 4th call started a new window: the buffer holds only its weighted gradient
    g = np_grads(sm.W.get_value(), sm.b.get_value(), *batches[3])
    np.testing.assert_allclose(by["W.grad_accu"].get_value(), 5 * g[0], rtol=1e-12)


# ------------------------------------------------- 11. N = 1 is the plain rule


@pytest.mark.parametrize("rule", list(RULES))
def test_average_1_is_exactly_the_plain_rule(rule):
    m = Model()
    upd = getattr(L, rule)(m.loss, m.params, **RULES[rule], average=1)
    plain_m = Model()
    plain = getattr(L, rule)(plain_m.loss, plain_m.params, **RULES[rule])
    # same structure: no accumulator, no counter
    assert [v.name for v in upd] == [v.name for v in plain]
    assert not any(is_accumulation_state(v) for v in upd)
    f = pytensor.function([m.X, m.Y], [], updates=upd)
    g = pytensor.function([plain_m.X, plain_m.Y], [], updates=plain)
    rng = np.random.default_rng(2)
    for size in (3, 1, 4):
        batch = make_batch(rng, size)
        f(*batch)
        g(*batch)
        assert_close(values(list(upd)), values(list(plain)), "float64", rule, exact=True)


def test_with_accumulated_gradients_every_1_returns_the_rule_dict():
    m = Model()
    upd = with_accumulated_gradients(m.loss, m.params, 1, L.sgd, learning_rate=0.5)
    assert list(upd) == m.params
    pytensor.function([m.X, m.Y], [], updates=upd)(*make_batch(np.random.default_rng(3), 2))
    X, Y = make_batch(np.random.default_rng(3), 2)
    np.testing.assert_allclose(m.W.get_value(), W0 - 0.5 * np_grads(W0, B0, X, Y)[0],
                               rtol=1e-12)


# ---------------------------------------- 12. user-written rule, lazy=False


def sign_sgd(grads, params, learning_rate):
    """A user rule: a plain function returning an OrderedDict."""
    return OrderedDict((p, p - learning_rate * pt.sign(g)) for p, g in zip(params, grads))


@pytest.mark.parametrize("lazy", [True, False])
def test_user_rule_sign_sgd(lazy):
    m = Model()
    n = pt.scalar("n")
    upd = with_accumulated_gradients(m.loss, m.params, 3, sign_sgd, weight=n, lazy=lazy,
                                     learning_rate=0.01)
    f = pytensor.function([m.X, m.Y, n], [], updates=upd)
    rng = np.random.default_rng(4)
    W, b = W0.copy(), B0.copy()
    for _ in range(2):
        batches = [make_batch(rng, k) for k in (2, 5, 3)]
        for i, (X, Y) in enumerate(batches):
            f(X, Y, len(X))
            if i < 2:
                np.testing.assert_array_equal(m.W.get_value(), W)
        gW, gb = np_grads(W, b, *concat(batches))
        W, b = W - 0.01 * np.sign(gW), b - 0.01 * np.sign(gb)
        np.testing.assert_allclose(m.W.get_value(), W, rtol=1e-14)
        np.testing.assert_allclose(m.b.get_value(), b, rtol=1e-14)


@pytest.mark.parametrize("rule", ["adam", "momentum"])
def test_lazy_false_gives_the_same_numbers(rule):
    run_scenario(rule, 3, weighted=True, lazy=False, seed=11)
    lazy_false = values(single_function_form(rule, 3, True, lazy=False)[0].params)
    run_scenario(rule, 3, weighted=True, lazy=True, seed=11)
    lazy_true = values(single_function_form(rule, 3, True, lazy=True)[0].params)
    assert_close(lazy_false, lazy_true, "float64", f"{rule} lazy=False vs lazy=True")


def test_partial_of_a_library_rule_as_update_rule():
    m = Model()
    rule = L.adam(learning_rate=0.01)  # a partial (PyMC convention)
    assert isinstance(rule, partial)
    upd = with_accumulated_gradients(m.loss, m.params, 2, rule)
    f = pytensor.function([m.X, m.Y], [], updates=upd)
    rm, r_state, ref = reference("adam")
    rm.reset_params()
    zero(r_state)
    rng = np.random.default_rng(5)
    batches = [make_batch(rng, 3), make_batch(rng, 3)]
    for X, Y in batches:
        f(X, Y)
    ref(*concat(batches))
    np.testing.assert_allclose(m.W.get_value(), rm.W.get_value(), rtol=RTOL)
    np.testing.assert_allclose(m.b.get_value(), rm.b.get_value(), rtol=RTOL)


# --------------------------------------------------- 13. seed compatibility


def test_seed_calls_momentum_and_adamax_average_5():
    rng = np.random.default_rng(6)
    for name, make in [
        ("momentum", lambda loss, params: L.momentum(loss, params, 0.01, momentum=0.9,
                                                     average=5)),
        ("adamax", lambda loss, params: L.adamax(loss, params, average=5)),
    ]:
        m = Model()
        upd = make(m.loss, m.params)
        f = pytensor.function([m.X, m.Y], [], updates=upd)
        rm, r_state, ref = reference(name)  # momentum lr=0.01, mom=0.9; adamax defaults
        rm.reset_params()
        zero(r_state)
        state = [v for v in upd if v not in m.params and not is_accumulation_state(v)]
        for _ in range(2):
            batches = [make_batch(rng, 2) for _ in range(5)]
            for X, Y in batches:
                f(X, Y)
            ref(*concat(batches))
            assert_close(values(m.params + state), values(rm.params + r_state), "float64", name)


# ---------------------------------------------------------------- 14. errors


def test_errors():
    m = Model()
    with pytest.raises(ValueError, match="average must be an integer >= 1, got 0"):
        L.adam(m.loss, m.params, average=0)
    with pytest.raises(ValueError, match=">= 1"):
        L.sgd(m.loss, m.params, 0.1, average=-3)
    with pytest.raises(TypeError, match="average must be an integer"):
        L.adam(m.loss, m.params, average=2.5)
    with pytest.raises(TypeError, match="not a symbolic variable"):
        L.adam(m.loss, m.params, average=pt.iscalar())
    with pytest.raises(TypeError, match="every must be a Python integer"):
        with_accumulated_gradients(m.loss, m.params, pt.iscalar(), L.sgd, learning_rate=0.1)
    with pytest.raises(TypeError):
        L.adam(m.loss, m.params, average=True)
    with pytest.raises(ValueError, match="weight only applies"):
        L.adam(m.loss, m.params, weight=pt.scalar("n"))
    with pytest.raises(ValueError, match="weight only applies"):
        with_accumulated_gradients(m.loss, m.params, 1, L.sgd, weight=pt.scalar("n"),
                                   learning_rate=0.1)
    with pytest.raises(TypeError, match="weight must be a scalar"):
        L.adam(m.loss, m.params, average=2, weight=pt.vector("n"))

    def list_rule(grads, params):
        return [(p, p - g) for p, g in zip(params, grads)]

    with pytest.raises(TypeError, match="list_rule returned list"):
        with_accumulated_gradients(m.loss, m.params, 2, list_rule)

    def forgets_b(grads, params):
        return OrderedDict([(params[0], params[0] - grads[0])])

    with pytest.raises(ValueError, match=r"params\[1\] \(b\)"):
        with_accumulated_gradients(m.loss, m.params, 2, forgets_b)
    with pytest.raises(ValueError, match=r"params\[1\] \(b\)"):
        with_accumulated_gradients(m.loss, m.params, 1, forgets_b)

    def bad_key(grads, params):
        upd = OrderedDict((p, p - g) for p, g in zip(params, grads))
        upd[pt.vector("v")] = pt.vector("w")
        return upd

    with pytest.raises(TypeError, match="not a shared variable"):
        with_accumulated_gradients(m.loss, m.params, 2, bad_key)
    with pytest.raises(TypeError, match="update_rule must be callable"):
        with_accumulated_gradients(m.loss, m.params, 2, "adam")
    with pytest.raises(TypeError, match="shared variable"):
        L.adam(m.loss, [m.W, pt.vector("b")], average=2)
    with pytest.raises(ValueError, match="got no params"):
        L.adam(m.loss, average=2)


# ------------------------------------------------------ 15. C backend too


@pytest.mark.parametrize("rule", ["momentum", "adam"])
@pytest.mark.parametrize("weighted", [False, True])
def test_equivalence_under_cvm(rule, weighted):
    assert run_scenario(rule, 3, weighted=weighted, mode="CVM", seed=21) == K


# ------------------------------ 16. same options and checks as the two-function form


PARITY_OPTIONS = OrderedDict(
    plain=dict(),
    weight=dict(weight=True),
    average_false=dict(average=False),
    max_norm=dict(max_norm=0.05, weight=True),
    skip_nonfinite=dict(skip_nonfinite=True, weight=True),
    lazy_false=dict(lazy=False, weight=True),
    name=dict(name="enc"),
)


@pytest.mark.parametrize("option", list(PARITY_OPTIONS))
def test_both_forms_give_the_same_parameters_option_by_option(option):
    opts = dict(PARITY_OPTIONS[option])
    weighted = opts.pop("weight", False)
    lazy = opts.pop("lazy", True)
    every, hyper = 3, dict(learning_rate=0.01)

    # two functions, as in the README: apply when `every` batches are accumulated
    tm = Model()
    n1 = pt.scalar("n")
    result = accumulate_gradients(tm.loss, tm.params, weight=n1 if weighted else None, **opts)
    accu, rst = result
    apply = L.adam(accu.grads, tm.params, **hyper)
    apply.update(rst)
    inputs1 = [tm.X, tm.Y] + ([n1] if weighted else [])
    step_fn = pytensor.function(inputs1, [], updates=accu)
    apply_fn = pytensor.function([], [], updates=apply)

    # one function
    sm = Model()
    n2 = pt.scalar("n")
    upd = with_accumulated_gradients(sm.loss, sm.params, every, L.adam,
                                     weight=n2 if weighted else None, lazy=lazy,
                                     **opts, **hyper)
    single = pytensor.function([sm.X, sm.Y] + ([n2] if weighted else []), [], updates=upd)

    rng = np.random.default_rng(16)
    batches = [make_batch(rng, int(k)) for k in rng.integers(1, 6, size=8)]
    if opts.get("skip_nonfinite"):
        batches[2][0][0, 0] = np.nan
    steps = 0
    for X, Y in batches:
        extra = [len(X)] if weighted else []
        step_fn(X, Y, *extra)
        single(X, Y, *extra)
        if int(accu.count.get_value()) == every:
            apply_fn()
            steps += 1
    assert steps == 2
    t_state = [v for v in apply if v not in tm.params and v not in rst]
    s_state = [v for v in upd if v not in sm.params and not is_accumulation_state(v)
               and not v.name.startswith("enc.") and "grad_accu" not in v.name]
    assert_close(values(sm.params + s_state), values(tm.params + t_state), "float64",
                 f"option {option}")
    assert int(values(s_state)["adam.t"]) == 2
    if opts.get("skip_nonfinite"):
        assert int(upd.skipped.get_value()) == int(result.skipped.get_value()) == 1
    assert not np.allclose(sm.W.get_value(), W0)


@pytest.mark.parametrize("form", ["rule", "wrapper"])
def test_weight_zero_or_negative_is_refused_like_the_two_function_form(form):
    m = Model()

    def build(weight):
        if form == "rule":
            return L.adam(m.loss, m.params, average=2, weight=weight)
        return with_accumulated_gradients(m.loss, m.params, 2, L.sgd, weight=weight,
                                          learning_rate=0.1)

    with pytest.raises(ValueError, match="weight must be positive, got 0"):
        build(0)
    with pytest.raises(ValueError, match="weight must be >= 0"):
        build(-2.0)
    with pytest.raises(ValueError, match="weight must be positive, got 0"):
        accumulate_gradients(m.loss, m.params, weight=0)


@pytest.mark.real_backend  # the C and Numba code paths (LazyStep, Gemm with beta = 0), compiled
@pytest.mark.parametrize(("mode", "lazy"), [(None, False), ("CVM", False), ("CVM", True)])
def test_buffer_does_not_carry_nan_into_the_next_window(mode, lazy):
    """A NaN batch must not stay in the buffer (a lazy reset by 0 * NaN would keep it).

    lazy=True: the stepping call writes zeros into the buffers (LazyStep's
    fill). lazy=False: W's buffer is reset inside an in-place Gemm (beta = 0
    on a window's first call), the bias's by an elementwise select. Each must
    drop the NaN. (LazyStep's fill under Numba: ``test_fast_paths``.)
    """
    m = Model()
    upd = with_accumulated_gradients(m.loss, m.params, 2, L.sgd, learning_rate=0.1, lazy=lazy)
    f = pytensor.function([m.X, m.Y], [], updates=upd, mode=L.mode(mode))
    fg = f.maker.fgraph
    names = {fg.inputs[k]: i.variable.name for k, i in enumerate(f.maker.inputs)}
    gemm_on = [names.get(n.inputs[0]) for n in fg.toposort()
               if str(n.op).endswith("Gemm{inplace}")]   # C's Gemm or our NumbaGemm
    assert gemm_on == ["W.grad_accu"]  # the fast path is the one tested
    rng = np.random.default_rng(17)
    bad, good = make_batch(rng, 2), make_batch(rng, 2)
    bad[0][0, 0] = np.nan
    f(*bad)
    f(*good)
    assert np.isnan(m.W.get_value()).any()  # that window's step is NaN, as it must be
    m.reset_params()  # the user restores the parameters
    b3, b4 = make_batch(rng, 3), make_batch(rng, 3)
    f(*b3)
    f(*b4)
    g = np_grads(W0, B0, *concat([b3, b4]))
    np.testing.assert_allclose(m.W.get_value(), W0 - 0.1 * g[0], rtol=1e-12)
    np.testing.assert_allclose(m.b.get_value(), B0 - 0.1 * g[1], rtol=1e-12)


@pytest.mark.parametrize("mode", [None, "CVM"])
def test_a_window_start_without_zeroed_buffers_resets_them(mode):
    """The stepping call zeroes the buffers and sets ``average.zeroed``; a
    window's first call trusts the buffers only then. State that did not come
    from such a step (a checkpoint of the lazy=False form or of version 0.2,
    whose buffers keep the last window at count 0; a counter set back to 0 by
    hand) has ``zeroed`` False, and its buffers are dropped, NaN included."""
    m = Model()
    upd = with_accumulated_gradients(m.loss, m.params, 2, L.sgd, learning_rate=0.1)
    f = pytensor.function([m.X, m.Y], [], updates=upd, mode=mode)
    by = {v.name: v for v in upd}
    accus, zeroed = [by["W.grad_accu"], by["b.grad_accu"]], by["average.zeroed"]
    rng = np.random.default_rng(23)

    def window_from_stale_buffers():
        m.reset_params()
        for a in accus:  # what the last window left
            a.set_value(np.full_like(a.get_value(), np.nan))
        b1, b2 = make_batch(rng, 3), make_batch(rng, 3)
        f(*b1)
        assert not zeroed.get_value()
        f(*b2)
        g = np_grads(W0, B0, *concat([b1, b2]))
        np.testing.assert_allclose(m.W.get_value(), W0 - 0.1 * g[0], rtol=1e-12)
        np.testing.assert_allclose(m.b.get_value(), B0 - 0.1 * g[1], rtol=1e-12)
        assert zeroed.get_value() and not any(a.get_value().any() for a in accus)

    zeroed.set_value(False)  # as loaded from a checkpoint without the flag's True
    window_from_stale_buffers()
    f(*make_batch(rng, 3))  # half a window, then the user drops it
    upd.count.set_value(0)
    assert not zeroed.get_value()
    window_from_stale_buffers()


def test_skip_nonfinite_checks_the_weighted_gradient_and_lengthens_the_window():
    w = pytensor.shared(np.zeros(2, dtype="float32"), name="w")
    g = pt.vector("g", dtype="float32")
    upd = with_accumulated_gradients([g], [w], 2, L.sgd, weight=10, skip_nonfinite=True,
                                     learning_rate=0.5)
    f = pytensor.function([g], [], updates=upd)
    f(np.array([1.0, 2.0], dtype="float32"))
    f(np.array([3e38, 1.0], dtype="float32"))  # finite, but 10 * 3e38 is inf: skipped
    assert int(upd.skipped.get_value()) == 1
    np.testing.assert_array_equal(w.get_value(), [0.0, 0.0])  # no step: one batch so far
    f(np.array([3.0, 4.0], dtype="float32"))
    np.testing.assert_allclose(w.get_value(), [-0.5 * 2.0, -0.5 * 3.0], rtol=1e-6)
    assert int(upd.count.get_value()) == 0


def test_every_1_refuses_window_options():
    m = Model()
    with pytest.raises(ValueError, match="max_norm only applies with every > 1"):
        with_accumulated_gradients(m.loss, m.params, 1, L.sgd, max_norm=1.0, learning_rate=0.1)
    with pytest.raises(ValueError, match="skip_nonfinite only applies"):
        with_accumulated_gradients(m.loss, m.params, 1, L.sgd, skip_nonfinite=True,
                                   learning_rate=0.1)


def test_name_prefixes_the_single_function_state():
    m = Model()
    upd = L.adam(m.loss, m.params, average=3, weight=m.X.shape[0], name="enc")
    names = {v.name for v in upd}
    assert names == {"W", "b", "enc.count", "enc.total", "enc.zeroed", "W.enc_grad_accu",
                     "b.enc_grad_accu", "W.enc_m", "W.enc_v", "b.enc_m", "b.enc_v", "enc.t"}
    # two optimizers in one graph: names fixed by name=, not by build order
    other = Model()
    a = L.adam(other.loss, [other.W], average=2, name="first")
    b = L.adam(other.loss, [other.b], average=2, name="second")
    assert {v.name for v in a} == {"W", "first.count", "first.zeroed", "W.first_grad_accu",
                                   "W.first_m", "W.first_v", "first.t"}
    assert {v.name for v in b} == {"b", "second.count", "second.zeroed", "b.second_grad_accu",
                                   "b.second_m", "b.second_v", "second.t"}


def test_average_beyond_the_int64_counter_is_a_clear_error():
    m = Model()
    with pytest.raises(ValueError, match="average must be at most 9223372036854775807"):
        L.adam(m.loss, m.params, average=10 ** 30)
    with pytest.raises(ValueError, match="every must be at most"):
        with_accumulated_gradients(m.loss, m.params, 10 ** 30, L.sgd, learning_rate=0.1)
