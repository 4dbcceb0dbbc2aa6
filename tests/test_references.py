"""adamw, lars, lamb, every schedule and every rule's float16 policy, against tests/reference.py.

The expected numbers come only from the float64 numpy references of
``tests/reference.py`` (``reference_step``, ``schedule_*``), written from the
published formulas with optax's definitions; nothing here imports optax, so
these checks run where it is not installed (``test_large_batch.py`` and
``test_schedules.py`` compare with optax itself, the second reference).

* Schedules: every schedule of :mod:`lasagne_accum.schedules` on steps
  0..500, symbolic (one compiled function) and on Python ints, to 1e-12.
* Large-batch rules: 12 steps of adamw, lars and lamb (defaults, weight
  decay, ``exclude=`` as a list and as a predicate, schedules as
  ``learning_rate``) and of Lasagne rules with schedules, in one compiled
  float64 function; parameters and every state variable to 1e-12, counters
  exact. ``average=N`` and the two-function form with schedules: the
  schedule's counter advances once per optimizer step.
* float16: every rule on float16 parameters and gradients keeps float32
  state, returns float16 parameters within one float16 ulp of the reference
  (the reference's parameters stored in float16 and its state in float32
  after every step) and float32 state to about 1e-5.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from lasagne_accum import accumulate_gradients, schedules
from lasagne_accum import updates as U

import reference as R  # tests/reference.py: tests/ is on sys.path under pytest
from reference import assert_close, reference_step

#: FAST_COMPILE is swapped for the suite's cheap Python mode (conftest.py at the
#: repository root); a real FAST_COMPILE compiles float16 too, which Numba cannot.
MODE = "FAST_COMPILE"


# ================================================================= schedules

STEPS = np.arange(501)

# (id, ours, the reference) with optax's argument meanings
SCHEDULES = [
    ("constant", schedules.constant(0.3), R.schedule_constant(0.3)),
    ("linear_warmup", schedules.linear_warmup(0.0, 0.4, 100), R.schedule_linear(0.0, 0.4, 100)),
    ("linear_warmup_begin", schedules.linear_warmup(0.01, 0.2, 77, transition_begin=20),
     R.schedule_linear(0.01, 0.2, 77, transition_begin=20)),
    ("linear_negative_begin", schedules.linear_warmup(0.05, 0.5, 40, transition_begin=-15),
     R.schedule_linear(0.05, 0.5, 40, transition_begin=-15)),
    ("linear_decay", schedules.linear_warmup(1.0, 0.1, 333), R.schedule_linear(1.0, 0.1, 333)),
    ("linear_no_steps", schedules.linear_warmup(0.5, 1.0, 0), R.schedule_linear(0.5, 1.0, 0)),
    ("cosine_decay", schedules.cosine_decay(0.1, 300), R.schedule_cosine_decay(0.1, 300)),
    ("cosine_alpha_exponent", schedules.cosine_decay(2.0, 451, alpha=0.1, exponent=2.5),
     R.schedule_cosine_decay(2.0, 451, alpha=0.1, exponent=2.5)),
    ("warmup_cosine", schedules.warmup_cosine_decay(0.0, 0.1, 50, 400),
     R.schedule_warmup_cosine_decay(0.0, 0.1, 50, 400)),
    ("warmup_cosine_end", schedules.warmup_cosine_decay(1e-3, 0.5, 123, 456, end_value=0.02,
                                                        exponent=0.5),
     R.schedule_warmup_cosine_decay(1e-3, 0.5, 123, 456, end_value=0.02, exponent=0.5)),
    ("warmup_cosine_no_warmup", schedules.warmup_cosine_decay(0.0, 0.3, 0, 200),
     R.schedule_warmup_cosine_decay(0.0, 0.3, 0, 200)),
    ("warmup_cosine_zero_peak", schedules.warmup_cosine_decay(0.2, 0.0, 30, 300, end_value=0.05),
     R.schedule_warmup_cosine_decay(0.2, 0.0, 30, 300, end_value=0.05)),
    ("piecewise", schedules.piecewise_constant(0.1, {250: 2.0, 100: 0.1, 0: 0.5, 500: 0.5}),
     R.schedule_piecewise_constant(0.1, {250: 2.0, 100: 0.1, 0: 0.5, 500: 0.5})),
    ("piecewise_none", schedules.piecewise_constant(0.7), R.schedule_piecewise_constant(0.7)),
    ("exponential", schedules.exponential_decay(0.1, 50, 0.5),
     R.schedule_exponential_decay(0.1, 50, 0.5)),
    ("exponential_all", schedules.exponential_decay(0.1, 30, 0.7, transition_begin=40,
                                                    staircase=True, end_value=0.01),
     R.schedule_exponential_decay(0.1, 30, 0.7, transition_begin=40, staircase=True,
                                  end_value=0.01)),
    ("exponential_growth", schedules.exponential_decay(0.01, 100, 1.5, end_value=0.05),
     R.schedule_exponential_decay(0.01, 100, 1.5, end_value=0.05)),
    ("exponential_no_steps", schedules.exponential_decay(0.2, 0, 0.5),
     R.schedule_exponential_decay(0.2, 0, 0.5)),
    ("exponential_zero_rate", schedules.exponential_decay(0.2, 10, 0.0),
     R.schedule_exponential_decay(0.2, 10, 0.0)),
    ("linear_scaling", schedules.linear_scaling(schedules.warmup_cosine_decay(0.0, 0.1, 50, 400),
                                                32, 512),
     R.schedule_linear_scaling(R.schedule_warmup_cosine_decay(0.0, 0.1, 50, 400), 32, 512)),
    ("linear_scaling_piecewise", schedules.linear_scaling(
        schedules.piecewise_constant(0.1, {10: 0.5}), 8, 64),
     R.schedule_linear_scaling(R.schedule_piecewise_constant(0.1, {10: 0.5}), 8, 64)),
]
SCHEDULE_IDS = [s[0] for s in SCHEDULES]


def _reference_values(ref):
    return np.broadcast_to(np.asarray(ref(STEPS), dtype=np.float64), STEPS.shape)


@pytest.fixture(scope="module")
def symbolic_schedules():
    """Every schedule on one symbolic int64 vector of steps, in one compiled function."""
    steps = pt.lvector("steps")
    outputs = [ours(steps) for _, ours, _ in SCHEDULES]
    assert all(o.type.dtype == "float64" and o.type.ndim == 1 for o in outputs)
    fn = pytensor.function([steps], outputs, mode=MODE)
    return dict(zip(SCHEDULE_IDS, fn(STEPS)))


def test_reference_schedules_hand_values():
    """The references themselves, at values worked out by hand from the formulas."""
    c1, c3 = (1 + np.cos(np.pi / 4)) / 2, (1 + np.cos(3 * np.pi / 4)) / 2
    cases = [
        (R.schedule_linear(0.0, 1.0, 4), 6, [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]),
        (R.schedule_linear(1.0, 3.0, 2, transition_begin=2), 6, [1.0, 1.0, 1.0, 2.0, 3.0, 3.0]),
        (R.schedule_cosine_decay(1.0, 4), 6, [1.0, c1, 0.5, c3, 0.0, 0.0]),
        (R.schedule_cosine_decay(2.0, 2, alpha=0.5, exponent=2.0), 3,
         [2.0, 2.0 * (0.5 + 0.5 * 0.25), 1.0]),
        (R.schedule_warmup_cosine_decay(0.0, 1.0, 2, 6), 8,
         [0.0, 0.5, 1.0, c1, 0.5, c3, 0.0, 0.0]),
        (R.schedule_warmup_cosine_decay(0.0, 1.0, 2, 4, end_value=0.2), 5,
         [0.0, 0.5, 1.0, 0.6, 0.2]),
        (R.schedule_piecewise_constant(1.0, {3: 0.5, 5: 0.1}), 7,
         [1.0, 1.0, 1.0, 0.5, 0.5, 0.05, 0.05]),
        (R.schedule_exponential_decay(1.0, 2, 0.5), 5, [1.0, 2 ** -0.5, 0.5, 2 ** -1.5, 0.25]),
        (R.schedule_exponential_decay(1.0, 2, 0.5, staircase=True, end_value=0.3), 5,
         [1.0, 1.0, 0.5, 0.5, 0.3]),
        (R.schedule_exponential_decay(1.0, 1, 2.0, transition_begin=1, end_value=3.0), 4,
         [1.0, 1.0, 2.0, 3.0]),
        (R.schedule_linear_scaling(R.schedule_constant(0.1), 256, 8192), 2, [3.2, 3.2]),
    ]
    for ref, n, expected in cases:
        np.testing.assert_allclose(ref(np.arange(n)), expected, rtol=1e-15, atol=1e-16)
    assert R.schedule_linear_scaling(0.1, 256, 8192) == pytest.approx(3.2, rel=1e-15)


@pytest.mark.parametrize("name", SCHEDULE_IDS)
def test_symbolic_schedule_equals_reference(symbolic_schedules, name):
    ref = dict((s[0], s[2]) for s in SCHEDULES)[name]
    assert_close(symbolic_schedules[name], _reference_values(ref), "float64", name)


@pytest.mark.parametrize("name", SCHEDULE_IDS)
def test_python_int_schedule_equals_reference(name):
    ours, ref = dict((s[0], s[1:]) for s in SCHEDULES)[name]
    values = [ours(int(k)) for k in STEPS]
    assert all(type(v) is float for v in values)
    assert_close(np.array(values), _reference_values(ref), "float64", name)
    # a numpy integer step gives the same number
    assert ours(np.int64(137)) == pytest.approx(float(_reference_values(ref)[137]), rel=1e-12,
                                                abs=1e-15)


def test_linear_scaling_of_a_number_equals_reference():
    for args in [(0.1, 256, 8192), (0.05, 64, 32), (3e-4, 7, 91)]:
        assert schedules.linear_scaling(*args) == pytest.approx(
            R.schedule_linear_scaling(*args), rel=1e-15)


# ======================================================== rules in float64

SHAPES = {"W": (3, 2), "b": (2,), "g": (4,)}
NAMES = list(SHAPES)
RULE_STEPS = 12


def _initial():
    rng = np.random.default_rng(7)
    return {"W": rng.normal(size=(3, 2)), "b": np.zeros(2),   # a zero norm: trust ratio 1
            "g": 1.0 + 0.1 * rng.normal(size=4)}


def _gradients(n):
    rng = np.random.default_rng(11)
    return [{k: rng.normal(size=s) for k, s in SHAPES.items()} for _ in range(n)]


# Schedules as learning rates: (ours, reference); each passes through its
# warmup, its decay and its end within RULE_STEPS steps.
WARMUP_COSINE = (schedules.warmup_cosine_decay(0.0, 0.05, 3, 10, end_value=1e-3),
                 R.schedule_warmup_cosine_decay(0.0, 0.05, 3, 10, end_value=1e-3))
PIECEWISE = (schedules.piecewise_constant(0.5, {4: 0.5, 8: 0.2}),
             R.schedule_piecewise_constant(0.5, {4: 0.5, 8: 0.2}))
STAIRCASE = (schedules.exponential_decay(0.02, 3, 0.5, transition_begin=2, staircase=True,
                                         end_value=0.004),
             R.schedule_exponential_decay(0.02, 3, 0.5, transition_begin=2, staircase=True,
                                          end_value=0.004))
COSINE = (schedules.cosine_decay(0.05, 8, alpha=0.1), R.schedule_cosine_decay(0.05, 8, alpha=0.1))
LINEAR = (schedules.linear_warmup(0.01, 0.05, 6, transition_begin=2),
          R.schedule_linear(0.01, 0.05, 6, transition_begin=2))
SCALED = (schedules.linear_scaling(schedules.linear_warmup(0.0, 0.1, 5), 32, 64),
          R.schedule_linear_scaling(R.schedule_linear(0.0, 0.1, 5), 32, 64))
CONSTANT = (schedules.constant(0.01), R.schedule_constant(0.01))
VECTORS = "vectors"   # exclude=lambda p: p.ndim == 1: b and g

# case -> (rule, hyperparameters, schedule pair or None, excluded names / VECTORS / None)
CASES = {
    "adamw_defaults": ("adamw", {}, None, None),
    "adamw_decay": ("adamw", dict(learning_rate=0.01, beta1=0.8, beta2=0.99, epsilon=1e-7,
                                  weight_decay=0.1), None, None),
    "adamw_exclude": ("adamw", dict(learning_rate=0.01, weight_decay=0.1), None, ["b", "g"]),
    "adamw_schedule": ("adamw", dict(weight_decay=0.1), WARMUP_COSINE, VECTORS),
    "lars_defaults": ("lars", dict(learning_rate=0.5), None, None),
    "lars_decay": ("lars", dict(learning_rate=0.5, momentum=0.8, weight_decay=0.01,
                                trust_coefficient=0.02, eps=1e-3), None, None),
    "lars_nesterov_exclude": ("lars", dict(learning_rate=0.5, weight_decay=0.01,
                                           trust_coefficient=0.02, nesterov=True), None, ["g"]),
    "lars_schedule": ("lars", dict(weight_decay=0.01, trust_coefficient=0.5), PIECEWISE, VECTORS),
    "lamb_defaults": ("lamb", {}, None, None),
    "lamb_decay": ("lamb", dict(learning_rate=0.01, beta2=0.99, weight_decay=0.05), None, None),
    "lamb_exclude": ("lamb", dict(learning_rate=0.01, beta2=0.99, epsilon=1e-7,
                                  weight_decay=0.05), None, ["g"]),
    "lamb_schedule": ("lamb", dict(beta2=0.99, weight_decay=0.05), STAIRCASE, VECTORS),
    "sgd_schedule": ("sgd", {}, SCALED, None),
    "momentum_schedule": ("momentum", dict(momentum=0.8), COSINE, None),
    "nesterov_schedule": ("nesterov_momentum", {}, LINEAR, None),
    "adam_schedule": ("adam", {}, CONSTANT, None),
    "adamax_schedule": ("adamax", dict(beta2=0.99), WARMUP_COSINE, None),
}
EXCLUDE_CASES = [c for c, spec in CASES.items() if spec[3] is not None]
SCHEDULE_CASES = [c for c, spec in CASES.items() if spec[2] is not None]


def _excluded_names(case):
    spec = CASES[case][3]
    if spec is None:
        return set()
    return {k for k in NAMES if len(SHAPES[k]) == 1} if spec == VECTORS else set(spec)


def _build(case, grads, **extra):
    """Fresh float64 params for `case` and the rule's updates on `grads` (name=case)."""
    rule, hyper, schedule, exclude = CASES[case]
    params = {k: pytensor.shared(v, name=k) for k, v in _initial().items()}
    kwargs = dict(hyper, name=case)
    if schedule is not None:
        kwargs["learning_rate"] = schedule[0]
    if exclude == VECTORS:
        kwargs["exclude"] = lambda p: p.ndim == 1
    elif exclude is not None:
        kwargs["exclude"] = [params[k] for k in exclude]
    return params, getattr(U, rule)(grads, [params[k] for k in NAMES], **kwargs, **extra)


def _reference(case, gradient_steps, exclude="case", schedule=None):
    """(params, state) after one reference step per entry of `gradient_steps`.

    `exclude` and `schedule` replace the case's (for the sensitivity checks).
    """
    rule, hyper, case_schedule, _ = CASES[case]
    hyper = dict(hyper)
    schedule = schedule or (case_schedule[1] if case_schedule is not None else None)
    if schedule is not None:
        hyper["learning_rate"] = schedule
    excluded = _excluded_names(case) if exclude == "case" else set(exclude)
    params, state = _initial(), {}
    for g in gradient_steps:
        reference_step(rule, params, g, state, name=case, exclude=excluded, **hyper)
    return params, state


def _inputs():
    return [pt.tensor(name=f"g_{k}", dtype="float64", shape=s) for k, s in SHAPES.items()]


def _feed(g):
    return [g[k] for k in NAMES]


def _assert_state_equals(updates, ref_state, what):
    """Every state variable of `updates` equals its reference, by name; counters exactly."""
    ours = {v.name: v for v in updates if v.name not in NAMES}
    assert sorted(ours) == sorted(ref_state), what
    for key, expected in ref_state.items():
        value = np.asarray(ours[key].get_value())
        if key.endswith(".t") or key.endswith(".schedule_step"):
            assert value.dtype == np.int64, f"{what}: {key}: {value.dtype}"
            assert int(value) == int(expected), f"{what}: {key}"
        else:
            assert value.dtype == np.float64, f"{what}: {key}: {value.dtype}"
            assert_close(value, expected, "float64", f"{what}: {key}")


@pytest.fixture(scope="module")
def direct():
    """Every case in one float64 function, called RULE_STEPS times."""
    grads = _inputs()
    params, updates = {}, {}
    for case in CASES:
        params[case], updates[case] = _build(case, grads)
    fn = pytensor.function(grads, [], updates=[kv for u in updates.values() for kv in u.items()],
                           mode=MODE)
    for g in _gradients(RULE_STEPS):
        fn(*_feed(g))
    return params, updates


@pytest.mark.parametrize("case", list(CASES))
def test_rule_equals_reference(direct, case):
    """Parameters and every state variable (moments, traces, counters) after 12 steps."""
    params, updates = direct
    ref_params, ref_state = _reference(case, _gradients(RULE_STEPS))
    for k in NAMES:
        value = params[case][k].get_value()
        assert value.dtype == np.float64
        assert_close(value, ref_params[k], "float64", f"{case}: {k}")
        # the rule moved every parameter: the comparison is not of initial values
        assert np.max(np.abs(value - _initial()[k])) > 1e-4, (case, k)
    _assert_state_equals(updates[case], ref_state, case)


@pytest.mark.parametrize("case", EXCLUDE_CASES)
def test_exclude_changes_the_result(case):
    """The excluded parameters move differently without `exclude`: the check above sees it."""
    grads = _gradients(RULE_STEPS)
    with_exclude, _ = _reference(case, grads)
    without, _ = _reference(case, grads, exclude=())
    for k in _excluded_names(case):
        assert np.max(np.abs(with_exclude[k] - without[k])) > 1e-6 * np.max(np.abs(without[k]))


@pytest.mark.parametrize("case", SCHEDULE_CASES)
def test_schedule_changes_the_result(case):
    """A counter stuck at 0 or advancing twice per step gives other numbers."""
    grads = _gradients(RULE_STEPS)
    expected, _ = _reference(case, grads)
    schedule = CASES[case][2][1]
    stuck, _ = _reference(case, grads, schedule=lambda step: schedule(0))
    twice, _ = _reference(case, grads, schedule=lambda step: schedule(2 * step))
    if case == "adam_schedule":   # a constant schedule: the counter cannot matter
        assert_close(stuck["W"], expected["W"], "float64")
        return
    for other in (stuck, twice):
        assert np.max(np.abs(other["W"] - expected["W"])) > 1e-6


def test_lars_trust_ratio_reference_by_hand():
    """One LARS step worked out by hand: ratio 0.1 * 5 / 10 scales the gradient [6, 8]."""
    params, state = {"w": np.array([3.0, 4.0])}, {}
    reference_step("lars", params, {"w": np.array([6.0, 8.0])}, state, learning_rate=1.0,
                   trust_coefficient=0.1)
    np.testing.assert_allclose(params["w"], [2.7, 3.6], rtol=1e-15)
    np.testing.assert_allclose(state["w.lars_momentum"], [-0.3, -0.4], rtol=1e-15)


def test_lamb_and_adamw_references_by_hand():
    """First steps worked out by hand: Adam's first direction is sign(g) (epsilon 0)."""
    params, state = {"w": np.array([3.0, 4.0])}, {}
    reference_step("lamb", params, {"w": np.array([6.0, 8.0])}, state, learning_rate=0.1,
                   epsilon=0.0)
    # u = [1, 1]; ratio ||w|| / ||u|| = 5 / sqrt(2)
    np.testing.assert_allclose(params["w"], np.array([3.0, 4.0]) - 0.5 / np.sqrt(2), rtol=1e-15)
    assert state["lamb.t"] == 1
    params, state = {"w": np.array([1.0, -1.0])}, {}
    reference_step("adamw", params, {"w": np.array([2.0, -2.0])}, state, learning_rate=0.1,
                   epsilon=0.0, weight_decay=0.5)
    np.testing.assert_allclose(params["w"], [0.85, -0.85], rtol=1e-15)


# ------------------------------------------- schedules count optimizer steps

EVERY, WINDOWS, EXTRA = 3, 5, 2
AVERAGED = ["adamw_schedule", "lars_schedule", "lamb_schedule", "sgd_schedule",
            "momentum_schedule", "adamax_schedule"]


def _window_means(gradient_steps):
    """The mean gradient of each full window of EVERY calls, summed in call order."""
    means = []
    for w in range(len(gradient_steps) // EVERY):
        window = gradient_steps[w * EVERY:(w + 1) * EVERY]
        total = {k: window[0][k].copy() for k in NAMES}
        for g in window[1:]:
            total = {k: total[k] + g[k] for k in NAMES}
        means.append({k: total[k] / EVERY for k in NAMES})
    return means


@pytest.fixture(scope="module")
def averaged():
    """average=EVERY and the two-function form, WINDOWS windows and EXTRA more calls."""
    grads = _inputs()
    single, two, upd_single, upd_acc, upd_apply = {}, {}, [], [], []
    counters = {}
    for case in AVERAGED:
        single[case], upd = _build(case, grads, average=EVERY)
        upd_single += list(upd.items())
        two[case] = {k: pytensor.shared(v, name=k) for k, v in _initial().items()}
        plist = [two[case][k] for k in NAMES]
        accu, reset = accumulate_gradients(grads, plist, name=f"{case}_accumulate")
        rule, hyper, schedule, exclude = CASES[case]
        kwargs = dict(hyper, name=case, learning_rate=schedule[0])
        if exclude == VECTORS:
            kwargs["exclude"] = lambda p: p.ndim == 1
        apply = getattr(U, rule)(accu.grads, plist, **kwargs)
        counters[case] = {
            form: {v.name: v for v in d if v.name.startswith(f"{case}.")}
            for form, d in (("single", upd), ("two", apply))}
        upd_acc += list(accu.items())
        upd_apply += list(apply.items()) + list(reset.items())
    f_single = pytensor.function(grads, [], updates=upd_single, mode=MODE)
    f_acc = pytensor.function(grads, [], updates=upd_acc, mode=MODE)
    f_apply = pytensor.function([], [], updates=upd_apply, mode=MODE)
    for n, g in enumerate(_gradients(WINDOWS * EVERY + EXTRA), 1):
        f_single(*_feed(g))
        f_acc(*_feed(g))
        if n % EVERY == 0:
            f_apply()
    return {"single": single, "two": two}, counters


@pytest.mark.parametrize("form", ["single", "two"])
@pytest.mark.parametrize("case", AVERAGED)
def test_schedule_advances_once_per_optimizer_step(averaged, case, form):
    """average=3 and the two-function form: one schedule step (and one t) per window.

    After 5 windows and 2 more calls (an open window) the parameters are the
    reference's after 5 steps on the windows' mean gradients, and the
    counters read 5, not 17 calls.
    """
    params, counters = averaged
    means = _window_means(_gradients(WINDOWS * EVERY + EXTRA))
    assert len(means) == WINDOWS
    ref_params, ref_state = _reference(case, means)
    for k in NAMES:
        assert_close(params[form][case][k].get_value(), ref_params[k], "float64",
                     f"{form} {case}: {k}")
    found = counters[case][form]
    expected = {key for key in ref_state if key.startswith(f"{case}.")}
    assert f"{case}.schedule_step" in expected
    assert expected <= set(found), (sorted(found), sorted(expected))
    for key in expected:
        assert found[key].type.dtype == "int64"
        assert int(found[key].get_value()) == WINDOWS == int(ref_state[key]), (form, key)


# ================================================ float16 parameters: dtypes

F16_STEPS = 3
F16_SHAPES = {"W": (3, 2), "b": (4,)}
F16_NAMES = list(F16_SHAPES)
# b's gradient has a zero component (an Adam-family epsilon of 0 would make it
# 0 / 0 = NaN) and a subnormal float16 one, 2**-24, which is 6e-8 against the
# epsilon 1e-8 of the Adam family and AdamW.
ZERO, TINY = 1, 2

# rule -> hyperparameters (the `base` SGD step's learning rate for the wrappers);
# steps large enough to move float16 values by many ulps
F16_RULES = {
    "sgd": dict(learning_rate=0.1),
    "momentum": dict(learning_rate=0.05, momentum=0.9),
    "nesterov_momentum": dict(learning_rate=0.05, momentum=0.8),
    "apply_momentum": dict(learning_rate=0.1, momentum=0.5),
    "apply_nesterov_momentum": dict(learning_rate=0.1, momentum=0.5),
    "adagrad": dict(learning_rate=0.1),
    "rmsprop": dict(learning_rate=0.01),
    "adadelta": dict(),
    "adam": dict(learning_rate=0.01),
    "adamax": dict(learning_rate=0.01),
    "amsgrad": dict(learning_rate=0.01),
    "adamw": dict(learning_rate=0.05, weight_decay=0.1),
    "lars": dict(learning_rate=0.5, trust_coefficient=0.1, weight_decay=0.01),
    "lamb": dict(learning_rate=0.05, weight_decay=0.05),
}
F16_EXCLUDED = {"adamw": {"b"}, "lars": {"b"}, "lamb": {"b"}}


def _f16_initial():
    rng = np.random.default_rng(21)
    return {"W": rng.normal(size=(3, 2)).astype(np.float16),
            "b": np.array([0.5, -0.25, 1.0, -2.0], dtype=np.float16)}


def _f16_gradients():
    rng = np.random.default_rng(22)
    steps = []
    for _ in range(F16_STEPS):
        g = {k: rng.normal(size=s).astype(np.float16) for k, s in F16_SHAPES.items()}
        g["b"][ZERO], g["b"][TINY] = 0.0, np.float16(2.0 ** -24)
        steps.append(g)
    return steps


def _f16_updates(rule, params, grads, hyper):
    plist = [params[k] for k in F16_NAMES]
    hyper = dict(hyper)
    if rule.startswith("apply_"):
        lr = hyper.pop("learning_rate")
        return getattr(U, rule)(U.sgd(grads, plist, lr), plist, **hyper)
    if rule in F16_EXCLUDED:
        hyper["exclude"] = [params[k] for k in F16_EXCLUDED[rule]]
    return getattr(U, rule)(grads, plist, **hyper)


def _f16_reference(rule, hyper, epsilon=None):
    """Parameters and state after each step: params stored in float16, state in float32."""
    hyper = dict(hyper)
    if epsilon is not None:
        hyper["epsilon"] = epsilon
    params = {k: v.astype(np.float64) for k, v in _f16_initial().items()}
    state, history = {}, []
    for g in _f16_gradients():
        g = {k: v.astype(np.float64) for k, v in g.items()}
        base = None
        if rule.startswith("apply_"):
            # the wrapped SGD dictionary's float16 value of each parameter
            lr = float(np.float32(hyper["learning_rate"]))
            base = {k: (params[k] - lr * g[k]).astype(np.float32).astype(np.float16)
                    for k in F16_NAMES}
        reference_step(rule, params, g, state, hyper_dtype="float32", base=base,
                       exclude=F16_EXCLUDED.get(rule, ()), **hyper)
        params = {k: v.astype(np.float16).astype(np.float64) for k, v in params.items()}
        state = {k: (v.astype(np.float32).astype(np.float64) if k.rpartition(".")[2] != "t"
                     else v) for k, v in state.items()}
        history.append(({k: v.copy() for k, v in params.items()},
                        {k: np.copy(v) for k, v in state.items()}))
    return history


def _assert_float16_close(value, expected, what):
    """`value` (float16) within one float16 ulp of `expected` (a float16 value, in float64)."""
    assert value.dtype == np.float16, what
    assert np.all(np.isfinite(value)), what
    e16 = expected.astype(np.float16)
    np.testing.assert_array_equal(e16.astype(np.float64), expected, err_msg=what)
    ulp = np.abs(np.spacing(e16)).astype(np.float64)
    err = np.abs(value.astype(np.float64) - expected)
    assert np.all(err <= ulp), f"{what}: {value} vs {e16}, error {err} > ulp {ulp}"


@pytest.mark.parametrize("rule", list(F16_RULES))
def test_float16_params_float32_state_equal_reference(rule):
    """float16 params and gradients: float32 state and arithmetic, float16 results.

    Three steps, compiled; after each, the float16 parameters equal the
    reference rounded to float16 within one float16 ulp and the float32
    state equals the reference (state rounded to float32) to 1e-5.
    """
    hyper = F16_RULES[rule]
    params = {k: pytensor.shared(v, name=k) for k, v in _f16_initial().items()}
    grads = [pt.tensor(name=f"g_{k}", dtype="float16", shape=s) for k, s in F16_SHAPES.items()]
    updates = _f16_updates(rule, params, grads, hyper)
    state_vars = {v.name: v for v in updates if v.name not in F16_NAMES}
    for var, expr in updates.items():
        assert expr.type.dtype == var.type.dtype, var.name
    for k in F16_NAMES:
        assert updates[params[k]].type.dtype == "float16", k
    for name, var in state_vars.items():
        counter = name.endswith(".t")
        assert var.type.dtype == ("int64" if counter else "float32"), name
        if not counter:
            assert var.type.shape == params[name.partition(".")[0]].type.shape, name

    fn = pytensor.function(grads, [], updates=updates, mode=MODE)
    # compiled: the parameters' outputs are float16, the state's float32
    out_dtypes = {out.type.dtype for out in fn.maker.fgraph.outputs}
    assert "float16" in out_dtypes and out_dtypes <= {"float16", "float32", "int64"}

    history = _f16_reference(rule, hyper)
    assert sorted(state_vars) == sorted(history[0][1]), rule
    for step, (g, (ref_params, ref_state)) in enumerate(zip(_f16_gradients(), history), 1):
        fn(*[g[k] for k in F16_NAMES])
        for k in F16_NAMES:
            _assert_float16_close(params[k].get_value(), ref_params[k], f"{rule} step {step}: {k}")
        for name, var in state_vars.items():
            value = np.asarray(var.get_value())
            if name.endswith(".t"):
                assert value.dtype == np.int64 and int(value) == step == int(ref_state[name])
            else:
                assert value.dtype == np.float32, name
                assert_close(value, ref_state[name], "float32", f"{rule} step {step}: {name}")
    # every parameter moved by more than a float16 ulp: the comparison is not of initial values
    initial = _f16_initial()
    for k in F16_NAMES:
        moved = np.abs(params[k].get_value().astype(np.float64) - initial[k])
        assert np.max(moved) > 4 * np.max(np.abs(np.spacing(initial[k]))), (rule, k)


@pytest.mark.parametrize("rule", ["adamw", "lamb", "adam", "adamax", "amsgrad"])
def test_float16_epsilon_is_not_rounded_to_zero(rule):
    """Epsilon 1e-8 (1e-6 for lamb) is 0 in float16; in float32 it is not.

    Two float16 gradient components show it: a zero one (0 / (0 + eps) = 0
    keeps the parameter; with eps = 0 it is 0 / 0 = NaN) and a subnormal one,
    2**-24 = 6e-8, whose bias-corrected direction is g / (|g| + eps) < 1.
    """
    hyper = dict(learning_rate=0.1)
    if rule in ("adamw", "lamb"):
        hyper["weight_decay"] = 0.0
    w = pytensor.shared(np.array([1.0, -1.0, 0.5], dtype=np.float16), name="w")
    g = pt.tensor(name="g", dtype="float16", shape=(3,))
    updates = getattr(U, rule)([g], [w], **hyper)
    fn = pytensor.function([g], [], updates=updates, mode=MODE)
    grad = np.array([0.0, 2.0 ** -24, 1.0], dtype=np.float16)
    epsilon = {"lamb": 1e-6}.get(rule, 1e-8)

    def reference(eps):
        params, state = {"w": w.get_value().astype(np.float64)}, {}
        with np.errstate(invalid="ignore", divide="ignore"):
            for _ in range(3):
                reference_step(rule, params, {"w": grad.astype(np.float64)}, state,
                               hyper_dtype="float32", epsilon=eps, **hyper)
                params["w"] = params["w"].astype(np.float16).astype(np.float64)
        return params["w"]

    expected, without_eps = reference(epsilon), reference(0.0)
    for _ in range(3):
        fn(grad)
    value = w.get_value()
    assert value[0] == np.float16(1.0)             # a zero gradient leaves it exactly
    _assert_float16_close(value, expected, rule)
    # the test can fail: without epsilon the reference is NaN at the zero gradient
    assert np.isnan(without_eps[0])
    # and far (or NaN, for lamb's shared trust ratio) at the subnormal one
    assert not abs(without_eps[1] - expected[1]) <= 4 * abs(np.spacing(np.float16(expected[1])))
