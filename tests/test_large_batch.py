"""adamw, lars, lamb and learning-rate schedules in the rules, exact against optax.

Every rule runs 30 optimizer steps on one fixed sequence of gradients (fed as
inputs, so the same numbers reach both libraries); optax computes the
reference in float64 (``jax.enable_x64`` scoped to the reference code, so
other test modules are unaffected). To keep compiles few, every case of a
form (direct, ``average=4``, two-function) lives in ONE compiled function:
each case has its own copies of the parameters and its own rule state.
Those big functions compile with ``FAST_COMPILE`` (5 s instead of minutes of
cold C/Numba compiling; the arithmetic is the graph's, not the linker's), and
one test repeats the schedule cases in float32 under the default mode.
"""

import functools

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from lasagne_accum import accumulate_gradients, adamw, lamb, lars, schedules, sgd

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

STEPS, EVERY = 30, 4
MODE = "FAST_COMPILE"
SHAPES = {"W": (3, 2), "b": (2,), "g": (4,)}
NAMES = list(SHAPES)


def _initial():
    rng = np.random.default_rng(7)
    return {"W": rng.normal(size=(3, 2)), "b": np.zeros(2),   # a zero norm: ratio 1
            "g": 1.0 + 0.1 * rng.normal(size=4)}


def _gradients(n):
    rng = np.random.default_rng(11)
    return [{k: rng.normal(size=s) for k, s in SHAPES.items()} for _ in range(n)]


WARMUP = dict(init_value=0.0, peak_value=0.05, warmup_steps=5, decay_steps=25, end_value=1e-3)


def _is_vector(p):
    return p.ndim == 1


def _int64(schedule):
    return lambda count: schedule(jnp.asarray(count, jnp.int64))


# case name -> (our rule, our kwargs, optax transformation factory). Excluded
# parameters by name, for optax's masks: the same as our `exclude`.
def _cases():
    def mask(excluded):
        return lambda params: {k: k not in excluded for k in params}

    def lamb_ref(lr, wd=0.0, excluded=()):
        # optax.lamb masks the decay only; our exclude also drops the trust ratio
        # (the paper's choice), which is this chain: see lamb's Notes.
        m = mask(excluded)
        return optax.chain(
            optax.scale_by_adam(b1=0.9, b2=0.99, eps=1e-6),
            optax.add_decayed_weights(wd, mask=m),
            optax.masked(optax.scale_by_trust_ratio(), m),
            optax.scale_by_learning_rate(lr))

    cosine = schedules.warmup_cosine_decay(**WARMUP)
    # optax evaluates schedules on its int32 count, where several of them give
    # float32 values even under x64; ours are float64, so the reference gets an
    # int64 count (see lasagne_accum.schedules).
    cosine_ref = _int64(optax.warmup_cosine_decay_schedule(**WARMUP))
    return {
        "adamw": (adamw, dict(learning_rate=0.01, weight_decay=0.0),
                  lambda: optax.adamw(0.01, weight_decay=0.0)),
        "adamw_decay": (adamw, dict(learning_rate=0.01, beta1=0.8, beta2=0.99, epsilon=1e-7,
                                    weight_decay=0.1),
                        lambda: optax.adamw(0.01, b1=0.8, b2=0.99, eps=1e-7, weight_decay=0.1)),
        "adamw_exclude": (adamw, dict(learning_rate=0.01, weight_decay=0.1, exclude=["b"]),
                          lambda: optax.adamw(0.01, weight_decay=0.1, mask=mask({"b"}))),
        "adamw_schedule": (adamw, dict(learning_rate=cosine, weight_decay=0.1,
                                       exclude=_is_vector),
                           lambda: optax.adamw(cosine_ref, weight_decay=0.1,
                                               mask=mask({"b", "g"}))),
        "lars": (lars, dict(learning_rate=0.5, trust_coefficient=0.02),
                 lambda: optax.lars(0.5, trust_coefficient=0.02)),
        "lars_decay": (lars, dict(learning_rate=0.5, momentum=0.8, weight_decay=0.01,
                                  trust_coefficient=0.02, eps=1e-3),
                       lambda: optax.lars(0.5, momentum=0.8, weight_decay=0.01,
                                          trust_coefficient=0.02, eps=1e-3)),
        "lars_exclude": (lars, dict(learning_rate=0.5, weight_decay=0.01,
                                    trust_coefficient=0.02, nesterov=True, exclude=["b"]),
                         lambda: optax.lars(0.5, weight_decay=0.01, trust_coefficient=0.02,
                                            nesterov=True, weight_decay_mask=mask({"b"}),
                                            trust_ratio_mask=mask({"b"}))),
        "lars_schedule": (lars, dict(learning_rate=cosine, weight_decay=0.01,
                                     trust_coefficient=0.5, exclude=_is_vector),
                          lambda: optax.lars(cosine_ref, weight_decay=0.01, trust_coefficient=0.5,
                                             weight_decay_mask=mask({"b", "g"}),
                                             trust_ratio_mask=mask({"b", "g"}))),
        "lamb": (lamb, dict(learning_rate=0.01, beta2=0.99),
                 lambda: optax.lamb(0.01, b2=0.99)),
        "lamb_decay": (lamb, dict(learning_rate=0.01, beta2=0.99, weight_decay=0.05),
                       lambda: optax.lamb(0.01, b2=0.99, weight_decay=0.05)),
        "lamb_exclude": (lamb, dict(learning_rate=0.01, beta2=0.99, weight_decay=0.05,
                                    exclude=["b"]),
                         lambda: lamb_ref(0.01, 0.05, {"b"})),
        "lamb_schedule": (lamb, dict(learning_rate=cosine, beta2=0.99, weight_decay=0.05,
                                     exclude=_is_vector),
                          lambda: lamb_ref(cosine_ref, 0.05, {"b", "g"})),
        "sgd_schedule": (sgd, dict(learning_rate=schedules.exponential_decay(0.1, 7, 0.5)),
                         lambda: optax.sgd(_int64(optax.exponential_decay(0.1, 7, 0.5)))),
    }


CASES = _cases()
AVERAGED = ["adamw_exclude", "adamw_schedule", "lars_exclude", "lars_schedule",
            "lamb_exclude", "lamb_schedule"]


def _build(case, dtype, grads, **extra):
    """Fresh params for one case and the rule's updates on `grads`."""
    rule, kwargs, _ = CASES[case]
    params = {k: pytensor.shared(v.astype(dtype), name=k) for k, v in _initial().items()}
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("exclude"), list):
        kwargs["exclude"] = [params[k] for k in kwargs["exclude"]]
    if rule is not sgd:
        kwargs["name"] = case
    return params, rule(grads, [params[k] for k in NAMES], **kwargs, **extra)


def _inputs(dtype):
    return [pt.tensor(name=f"g_{k}", dtype=dtype, shape=s) for k, s in SHAPES.items()]


def _feed(values, dtype):
    return [values[k].astype(dtype) for k in NAMES]


# ------------------------------------------------------------------ references


@functools.lru_cache(maxsize=None)
def _optax_run(case, dtype, every=1):
    """Parameters after STEPS optimizer steps of optax (MultiSteps when every > 1)."""
    with jax.enable_x64(True):
        tx = CASES[case][2]()
        if every > 1:
            # MultiSteps accumulates in float32 by default; ours in the
            # parameter's dtype when that is wider
            tx = optax.MultiSteps(tx, every_k_schedule=every, accumulator_dtype=dtype)
        params = {k: jnp.asarray(v, dtype=dtype) for k, v in _initial().items()}
        state = tx.init(params)

        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        if every > 1:       # MultiSteps' lax.cond is slow eagerly; jit costs ~1 s
            step = jax.jit(step)

        for g in _gradients(STEPS * every):
            params, state = step(params, state, {k: jnp.asarray(v, dtype=dtype)
                                                 for k, v in g.items()})
        return {k: np.asarray(v) for k, v in params.items()}


def _assert_equals_optax(ours, case, dtype, every=1):
    ref = _optax_run(case, dtype, every)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == "float64" else dict(rtol=1e-5, atol=1e-6)
    for k in NAMES:
        value = ours[k].get_value()
        assert value.dtype == np.dtype(dtype), (case, k, value.dtype)
        np.testing.assert_allclose(value, ref[k], err_msg=f"{case}: {k}", **tol)
    # the rule moved the parameters: the comparison is not of initial values
    assert not np.allclose(ours["W"].get_value(), _initial()["W"].astype(dtype))


# ------------------------------------------------------------------ direct form


@pytest.fixture(scope="module", params=["float64", "float32"])
def direct(request):
    """All cases in one function, called STEPS times; the params of each case."""
    dtype = request.param
    grads = _inputs(dtype)
    params, updates = {}, {}
    for case in CASES:
        params[case], upd = _build(case, dtype, grads)
        updates.update(upd)
    fn = pytensor.function(grads, [], updates=updates, mode=MODE)
    for g in _gradients(STEPS):
        fn(*_feed(g, dtype))
    return dtype, params, updates, fn


@pytest.mark.parametrize("case", list(CASES))
def test_rule_equals_optax(direct, case):
    dtype, params, _, _ = direct
    _assert_equals_optax(params[case], case, dtype)


def test_float32_model_compiles_to_float32_updates(direct):
    dtype, _, updates, fn = direct
    assert len(fn.maker.fgraph.outputs) == len(updates)
    for var in updates:
        expected = "int64" if var.type.dtype == "int64" else dtype
        assert var.type.dtype == expected, var.name
    assert all(out.type.dtype in (dtype, "int64") for out in fn.maker.fgraph.outputs)


def test_default_mode_float32_schedules():
    """The default backend compiles the schedule cases to float32 and agrees with optax."""
    grads = _inputs("float32")
    params, updates = {}, {}
    cases = ["adamw_schedule", "lars_schedule", "lamb_schedule"]
    for case in cases:
        params[case], upd = _build(case, "float32", grads)
        updates.update(upd)
    fn = pytensor.function(grads, [], updates=updates)
    assert all(out.type.dtype in ("float32", "int64") for out in fn.maker.fgraph.outputs)
    for g in _gradients(STEPS):
        fn(*_feed(g, "float32"))
    for case in cases:
        _assert_equals_optax(params[case], case, "float32")


def test_state_names_and_counters(direct):
    _, _, updates, _ = direct
    names = {v.name: v for v in updates}
    for rule in ("adamw_decay", "lamb_decay"):
        assert {f"W.{rule}_m", f"W.{rule}_v", f"{rule}.t"} <= set(names)
        assert names[f"{rule}.t"].type.dtype == "int64"
        assert int(names[f"{rule}.t"].get_value()) == STEPS
    assert "W.lars_momentum" in names and "lars.t" not in names
    for case in ("adamw_schedule", "lars_schedule", "lamb_schedule"):
        step = names[f"{case}.schedule_step"]
        assert step.type.dtype == "int64" and int(step.get_value()) == STEPS
    assert int(names["sgd.schedule_step"].get_value()) == STEPS


def test_default_state_names():
    W = pytensor.shared(np.ones((2, 2)), name="W")
    names = [v.name for v in adamw([pt.ones((2, 2))], [W])]
    assert names == ["W.adamw_m", "W.adamw_v", "W", "adamw.t"]
    names = [v.name for v in lamb([pt.ones((2, 2))], [W], learning_rate=lambda s: 0.1 + 0 * s)]
    assert names == ["W.lamb_m", "W.lamb_v", "W", "lamb.t", "lamb.schedule_step"]
    assert [v.name for v in lars([pt.ones((2, 2))], [W], 0.1)] == ["W.lars_momentum", "W"]


def test_names_with_average():
    """name= reaches the rule's state and the accumulation's counters with average=N."""
    W = pytensor.shared(np.ones((2, 2)), name="W")
    cosine = schedules.cosine_decay(0.1, 10)
    names = [v.name for v in adamw([pt.ones((2, 2))], [W], cosine, average=3, name="x")]
    assert names == ["W.x_grad_accu", "W.x_m", "W.x_v", "W", "x.t", "x.schedule_step", "x.count",
                     "x.zeroed"]
    names = [v.name for v in lamb([pt.ones((2, 2))], [W], average=3)]
    assert names == ["W.grad_accu", "W.lamb_m", "W.lamb_v", "W", "lamb.t", "average.count",
                     "average.zeroed"]


# ------------------------------------------------------- accumulated gradients


@pytest.fixture(scope="module")
def averaged():
    """average=4 and the two-function form, every case of AVERAGED in one function each."""
    dtype = "float64"
    grads = _inputs(dtype)
    single, two, upd_single, upd_acc, upd_apply = {}, {}, {}, {}, {}
    counters = {}
    for case in AVERAGED:
        single[case], upd = _build(case, dtype, grads, average=EVERY)
        upd_single.update(upd)
        two[case] = {k: pytensor.shared(v, name=k) for k, v in _initial().items()}
        plist = [two[case][k] for k in NAMES]
        accu, reset = accumulate_gradients(grads, plist)
        rule, kwargs, _ = CASES[case]
        kwargs = dict(kwargs, name=case)
        if isinstance(kwargs.get("exclude"), list):
            kwargs["exclude"] = [two[case][k] for k in kwargs["exclude"]]
        apply = rule(accu.grads, plist, **kwargs)
        counters[case] = [v for d in (upd, apply) for v in d if v.name.endswith(".schedule_step")]
        upd_acc.update(accu)
        upd_apply.update(apply)
        upd_apply.update(reset)
    f_single = pytensor.function(grads, [], updates=upd_single, mode=MODE)
    f_acc = pytensor.function(grads, [], updates=upd_acc, mode=MODE)
    f_apply = pytensor.function([], [], updates=upd_apply, mode=MODE)
    for n, g in enumerate(_gradients(STEPS * EVERY), 1):
        f_single(*_feed(g, dtype))
        f_acc(*_feed(g, dtype))
        if n % EVERY == 0:
            f_apply()
    return single, two, counters


@pytest.mark.parametrize("case", AVERAGED)
def test_average_4_equals_optax_multisteps(averaged, case):
    single, _, _ = averaged
    _assert_equals_optax(single[case], case, "float64", every=EVERY)


@pytest.mark.parametrize("case", AVERAGED)
def test_two_function_form_equals_optax_multisteps(averaged, case):
    _, two, _ = averaged
    _assert_equals_optax(two[case], case, "float64", every=EVERY)


def test_schedule_counts_optimizer_steps_not_calls(averaged):
    _, _, counters = averaged
    for case in ("adamw_schedule", "lars_schedule", "lamb_schedule"):
        single_counter, two_counter = counters[case]
        assert int(single_counter.get_value()) == STEPS     # not STEPS * EVERY calls
        assert int(two_counter.get_value()) == STEPS


# ------------------------------------------------------------------ bad input


def _w():
    return pytensor.shared(np.ones(3), name="W")


@pytest.mark.parametrize("rule, kwargs, match", [
    (adamw, dict(weight_decay=-0.1), "weight_decay"),
    (lars, dict(learning_rate=0.1, weight_decay=-1e-4), "weight_decay"),
    (lamb, dict(weight_decay=-0.01), "weight_decay"),
    (lars, dict(learning_rate=0.1, trust_coefficient=0.0), "trust_coefficient"),
    (lars, dict(learning_rate=0.1, trust_coefficient=-0.001), "trust_coefficient"),
    (lars, dict(learning_rate=0.1, eps=-1.0), "eps"),
    (adamw, dict(beta1=1.0), "beta1"),
    (lamb, dict(learning_rate=lambda step: pt.stack([step, step]) * 0.1), "learning_rate"),
    (adamw, dict(learning_rate=lambda step: np.ones(2)), "learning_rate"),
])
def test_bad_hyperparameters_raise_value_error(rule, kwargs, match):
    W = _w()
    with pytest.raises(ValueError, match=match):
        rule([pt.ones(3)], [W], **kwargs)


@pytest.mark.parametrize("rule, kwargs, match", [
    (adamw, dict(learning_rate=[0.1]), "learning_rate must be a number, a symbolic scalar or "
                                       "a schedule"),
    (sgd, dict(learning_rate="0.1"), "learning_rate"),
    (lars, dict(), "learning_rate"),
    (lamb, dict(learning_rate=lambda step: 0.1 if step < 10 else 0.01), "symbolic"),
    (adamw, dict(learning_rate=lambda step: None), "learning_rate schedule"),
    (lars, dict(learning_rate=0.1, exclude=lambda p: "yes"), "predicate"),
    (lamb, dict(exclude=_w()), "wrap it in a list"),
])
def test_bad_arguments_raise_type_error(rule, kwargs, match):
    W = _w()
    with pytest.raises(TypeError, match=match):
        rule([pt.ones(3)], [W], **kwargs)


def test_exclude_must_name_parameters():
    W, other = _w(), pytensor.shared(np.ones(2), name="other")
    with pytest.raises(ValueError, match=r"exclude\[0\] \(other\) is not one of params"):
        adamw([pt.ones(3)], [W], exclude=[other])


def test_warmup_longer_than_decay_raises():
    with pytest.raises(ValueError, match="warmup_steps"):
        schedules.warmup_cosine_decay(0.0, 0.1, warmup_steps=100, decay_steps=50)


def test_partial_keeps_schedule_and_exclude():
    """The PyMC-style partial passes the schedule and exclude through unchanged."""
    W, b = _w(), pytensor.shared(np.zeros(3), name="b")
    cosine = schedules.cosine_decay(0.1, 10)
    rule = lars(learning_rate=cosine, exclude=[b], trust_coefficient=0.5)
    updates = rule([pt.ones(3), pt.ones(3)], [W, b])
    step = [v for v in updates if v.name == "lars.schedule_step"]
    assert len(step) == 1
    fn = pytensor.function([], [], updates=updates, mode=MODE)
    fn()
    # W: ratio 0.5 * sqrt(3) / sqrt(3) = 0.5, lr 0.1: 1 - 0.05; b excluded: 0 - 0.1
    np.testing.assert_allclose(W.get_value(), np.full(3, 0.95), rtol=1e-14)
    np.testing.assert_allclose(b.get_value(), np.full(3, -0.1), rtol=1e-14)
    assert int(step[0].get_value()) == 1


# ------------------------------------------------------------ parameter server


def test_parameter_server_lars_schedule_equals_optax():
    """In the parameter server, one shard per parameter, the schedule counts shard steps.

    A predicate `exclude` works there, where each shard sees only its own
    parameters (a list naming another shard's parameter would be refused).
    """
    from lasagne_accum.distributed import ParameterServer

    rule, kwargs, make_ref = CASES["lars_schedule"]
    server = ParameterServer(_initial(), rule, kwargs, mode="async", compile_mode=MODE)
    version, _ = server.register("a")
    for seq, g in enumerate(_gradients(STEPS)):
        server.push("a", seq, g, version=version)
        version, params = server.pull()
    assert version == (STEPS,) * len(NAMES)
    with jax.enable_x64(True):
        tx = make_ref()
        ref = {k: jnp.asarray(v) for k, v in _initial().items()}
        state = tx.init(ref)
        for g in _gradients(STEPS):
            updates, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, ref)
            ref = optax.apply_updates(ref, updates)
    for k in NAMES:
        np.testing.assert_allclose(params[k], np.asarray(ref[k]), rtol=1e-10, atol=1e-12,
                                   err_msg=k)


def test_jax_mode_average_2_equals_optax_multisteps():
    """PyTensor's JAX backend compiles the rules, schedules and the lazy step select."""
    grads = _inputs("float64")
    params, updates = {}, {}
    cases = ["adamw_schedule", "lars_exclude", "lamb_schedule", "sgd_schedule"]
    for case in cases:
        params[case], upd = _build(case, "float64", grads, average=2)
        updates.update(upd)
    fn = pytensor.function(grads, [], updates=updates, mode="JAX")
    for g in _gradients(STEPS * 2):
        fn(*_feed(g, "float64"))
    for case in cases:
        _assert_equals_optax(params[case], case, "float64", every=2)
