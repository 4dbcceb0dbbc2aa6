"""Update rules against an independent numpy re-derivation of Lasagne's formulas.

The numpy reference below is written from Lasagne's published formulas; it
never calls lasagne_accum, so a shared mistake cannot hide.
"""

import functools
import inspect
from collections import OrderedDict

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from lasagne_accum import updates as U
from reference import assert_close  # tests/reference.py: the suite's one comparison helper
from reference import reference_step as _reference_step

N_STEPS = 5
N_BATCH = 6
LR = 0.1  # for the rules without a default learning rate
MOM = 0.9  # momentum / nesterov_momentum
MOM_APPLY = 0.5  # apply_momentum / apply_nesterov_momentum on top of sgd

ADAM_FAMILY = ("adam", "adamax", "amsgrad")

# State each rule must create per parameter (suffix after "<param name>."),
# and the scalar state it shares between parameters.
STATE_SUFFIXES = {
    "sgd": [],
    "momentum": ["momentum_velocity"],
    "nesterov_momentum": ["momentum_velocity"],
    "apply_momentum": ["momentum_velocity"],
    "apply_nesterov_momentum": ["momentum_velocity"],
    "adagrad": ["adagrad_accu"],
    "rmsprop": ["rmsprop_accu"],
    "adadelta": ["adadelta_accu", "adadelta_delta_accu"],
    "adam": ["adam_m", "adam_v"],
    "adamax": ["adamax_m", "adamax_u"],
    "amsgrad": ["amsgrad_m", "amsgrad_v", "amsgrad_vhat"],
}
SCALAR_STATE = {"adam": "adam.t", "adamax": "adamax.t", "amsgrad": "amsgrad.t"}
# Lasagne's rules, in Lasagne's order: the test's own list (the keys above), so a
# rule dropped from lasagne_accum.updates.__all__ fails test_lasagne_names_are_public.
RULES = list(STATE_SUFFIXES)
LOSS_RULES = [r for r in RULES if not r.startswith("apply_")]


def expected_names(rule, param_names):
    names = set(param_names)
    names |= {f"{p}.{s}" for p in param_names for s in STATE_SUFFIXES[rule]}
    if rule in SCALAR_STATE:
        names.add(SCALAR_STATE[rule])
    return names


def build(rule, loss_or_grads, params):
    """Call rule `rule` the way a Lasagne user would (defaults where Lasagne has them)."""
    if rule == "sgd":
        return U.sgd(loss_or_grads, params, learning_rate=LR)
    if rule == "momentum":
        return U.momentum(loss_or_grads, params, learning_rate=LR, momentum=MOM)
    if rule == "nesterov_momentum":
        return U.nesterov_momentum(loss_or_grads, params, LR, MOM)
    if rule == "apply_momentum":
        # params omitted: momentum for every key of the sgd dictionary
        return U.apply_momentum(U.sgd(loss_or_grads, params, LR), momentum=MOM_APPLY)
    if rule == "apply_nesterov_momentum":
        return U.apply_nesterov_momentum(U.sgd(loss_or_grads, params, LR), params,
                                         momentum=MOM_APPLY)
    return getattr(U, rule)(loss_or_grads, params)


# --------------------------------------------------------------- numpy reference


def reference_step(rule, params, grads, state, hyper_dtype="float64", **hyper):
    """One float64 numpy step (tests/reference.py) with this module's default hyperparameters."""
    defaults = {}
    if rule in ("sgd", "momentum", "nesterov_momentum") or rule.startswith("apply_"):
        defaults["learning_rate"] = LR
    if rule in ("momentum", "nesterov_momentum"):
        defaults["momentum"] = MOM
    elif rule.startswith("apply_"):
        defaults["momentum"] = MOM_APPLY
    return _reference_step(rule, params, grads, state, hyper_dtype, defaults, **hyper)


def ls_grads(params, x, y):
    """Gradient of 0.5 * sum((x W + b - y)^2) / N, derived by hand."""
    r = (x @ params["W"] + params["b"] - y) / x.shape[0]
    return {"W": x.T @ r, "b": r.sum(axis=0).reshape(params["b"].shape)}


def ls_loss(x, y, W, b):
    return 0.5 * pt.sum(pt.sqr(pt.dot(x, W) + b - y)) / x.shape[0]


@pytest.fixture
def problem(rng):
    """Initial W (3x4), b (4,) and N_STEPS mini-batches of a least-squares fit."""
    return dict(
        W=rng.standard_normal((3, 4)),
        b=rng.standard_normal(4) * 0.5,
        X=rng.standard_normal((N_STEPS, N_BATCH, 3)),
        Y=rng.standard_normal((N_STEPS, N_BATCH, 4)),
        GW=rng.standard_normal((N_STEPS, 3, 4)),
        Gb=rng.standard_normal((N_STEPS, 4)),
    )


def compare_all(by_name, ref_params, ref_state, dtype, step):
    for name, var in by_name.items():
        value = var.get_value()
        # step counters are int64 whatever the model's dtype
        want = "int64" if name in SCALAR_STATE.values() else dtype
        assert value.dtype == np.dtype(want), (name, value.dtype)
        expected = ref_params[name] if name in ref_params else ref_state[name]
        assert_close(value, expected, dtype, what=f"{name} after step {step}")


# ------------------------------------------------------------ 1. vs reference


@pytest.mark.parametrize("rule", RULES)
def test_rule_matches_reference_float64_loss(rule, problem):
    W = pytensor.shared(problem["W"].copy(), name="W")
    b = pytensor.shared(problem["b"].copy(), name="b")
    x, y = pt.matrix("x"), pt.matrix("y")
    upd = build(rule, ls_loss(x, y, W, b), [W, b])
    assert isinstance(upd, OrderedDict)
    by_name = {v.name: v for v in upd}
    assert set(by_name) == expected_names(rule, ["W", "b"])
    f = pytensor.function([x, y], [], updates=upd)

    ref = {"W": problem["W"].copy(), "b": problem["b"].copy()}
    state = {}
    for k in range(N_STEPS):
        f(problem["X"][k], problem["Y"][k])
        reference_step(rule, ref, ls_grads(ref, problem["X"][k], problem["Y"][k]), state)
        compare_all(by_name, ref, state, "float64", k + 1)
    # the parameters did move
    assert not np.allclose(W.get_value(), problem["W"])


# apply_* are sgd + momentum: their float64 runs and dtype checks cover them.
@pytest.mark.parametrize("rule", LOSS_RULES)
def test_rule_matches_reference_float32_grads_list(rule, problem):
    f32 = np.float32
    W = pytensor.shared(problem["W"].astype(f32), name="W", shape=(3, 4))
    b = pytensor.shared(problem["b"].astype(f32), name="b")
    gW = pt.tensor("gW", dtype="float32", shape=(3, 4))
    gb = pt.tensor("gb", dtype="float32", shape=(None,))
    upd = build(rule, [gW, gb], [W, b])
    by_name = {v.name: v for v in upd}
    assert set(by_name) == expected_names(rule, ["W", "b"])
    f = pytensor.function([gW, gb], [], updates=upd)

    ref = {"W": problem["W"].astype(f32).astype(np.float64),
           "b": problem["b"].astype(f32).astype(np.float64)}
    state = {}
    for k in range(N_STEPS):
        g = {"W": problem["GW"][k].astype(f32), "b": problem["Gb"][k].astype(f32)}
        f(g["W"], g["b"])
        reference_step(rule, ref, g, state, hyper_dtype="float32")
        compare_all(by_name, ref, state, "float32", k + 1)


# ---------------------------------------------------- 2. amsgrad differs from adam


def test_amsgrad_matches_reference_and_differs_from_adam():
    hyper = dict(learning_rate=0.1, beta2=0.9)
    w0 = np.array([1.0, -2.0, 0.5])
    w_ams = pytensor.shared(w0.copy(), name="w_ams")
    w_adam = pytensor.shared(w0.copy(), name="w_adam")
    g = pt.vector("g")
    upd = U.amsgrad([g], [w_ams], **hyper)
    upd.update(U.adam([g], [w_adam], **hyper))
    f = pytensor.function([g], [], updates=upd)
    vhat = next(v for v in upd if v.name == "w_ams.amsgrad_vhat")

    ref_ams, st_ams = {"w": w0.copy()}, {}
    ref_adam, st_adam = {"w": w0.copy()}, {}
    grads = [np.full(3, 10.0)] + [np.full(3, 0.01)] * 4  # shrinks sharply
    for gk in grads:
        f(gk)
        reference_step("amsgrad", ref_ams, {"w": gk}, st_ams, **hyper)
        reference_step("adam", ref_adam, {"w": gk}, st_adam, **hyper)
    assert_close(w_ams.get_value(), ref_ams["w"], "float64", "amsgrad w")
    assert_close(vhat.get_value(), st_ams["w.amsgrad_vhat"], "float64", "vhat")
    assert_close(w_adam.get_value(), ref_adam["w"], "float64", "adam w")
    # vhat keeps the first, large second moment: 10 = (1 - 0.9) * 10**2
    np.testing.assert_allclose(vhat.get_value(), 10.0, rtol=1e-12)
    # amsgrad and adam differ by far more than the tolerance
    assert np.max(np.abs(w_ams.get_value() - ref_adam["w"])) > 1e-3


# --------------------------------------------- 3. dtype and static shape kept


def _float32_model(rule):
    W = pytensor.shared(np.full((3, 4), 0.5, dtype="float32"), name=f"W_{rule}", shape=(3, 4))
    b = pytensor.shared(np.full((1, 4), 0.1, dtype="float32"), name=f"b_{rule}",
                        shape=(1, None))
    return W, b


@pytest.mark.parametrize("rule", RULES)
def test_float32_state_has_param_dtype_and_static_shape(rule):
    assert pytensor.config.floatX == "float64"
    W, b = _float32_model(rule)
    x, y = pt.matrix("x"), pt.matrix("y")  # float64 data
    upd = build(rule, ls_loss(x, y, W, b), [W, b])
    by_name = {v.name: v for v in upd}
    for p in (W, b):
        for suffix in STATE_SUFFIXES[rule]:
            s = by_name[f"{p.name}.{suffix}"]
            assert s.type.dtype == "float32", s.name
            assert s.type.shape == p.type.shape, (s.name, s.type.shape)
            assert s.get_value().shape == p.get_value().shape
    for var, expr in upd.items():
        # the step counter is int64; everything else float32
        assert expr.type.dtype == ("int64" if var.name == SCALAR_STATE.get(rule) else "float32"), \
            (var.name, expr.type)
        assert expr.type.ndim == var.type.ndim
    if rule in SCALAR_STATE:
        t = by_name[SCALAR_STATE[rule]]
        # an int64 step counter (a float32 one stops at 2**24)
        assert t.type.dtype == "int64" and t.type.shape == ()


@pytest.mark.parametrize("rule", RULES)
def test_mixed_float32_float64_params_keep_each_dtype(rule):
    W = pytensor.shared(np.ones((3, 4), dtype="float32"), name="W")
    b = pytensor.shared(np.ones(4), name="b")  # float64
    # a float64 gradient for the float32 parameter is cast to float32
    upd = build(rule, [pt.tensor("gW", dtype="float64", shape=(3, 4)), pt.vector("gb")], [W, b])
    for var, expr in upd.items():
        assert expr.type.dtype == var.type.dtype, (var.name, expr.type)
    assert {v.name: v.type.dtype for v in upd if v.name.startswith("W")} == {
        n: "float32" for n in expected_names(rule, ["W"]) if n.startswith("W")}


def test_float32_model_compiles_to_float32_under_float64_floatx(problem):
    # Every rule's float32 expressions are checked above without compiling and
    # compiled in the float32 reference test; here a float64 loss (float64
    # data) drives the rules with the most casts through one compiled function.
    assert pytensor.config.floatX == "float64"
    x, y = pt.matrix("x"), pt.matrix("y")  # float64 data: the loss is float64
    updates = OrderedDict()
    for rule in ["adadelta", "adam"]:
        W, b = _float32_model(rule)
        updates.update(build(rule, ls_loss(x, y, W, b), [W, b]))
    f = pytensor.function([x, y], [], updates=updates)
    outputs = f.maker.fgraph.outputs
    assert len(outputs) == len(updates)
    # the step counter adam.t is int64; every other output float32
    expected = ["int64" if v.name == "adam.t" else "float32" for v in updates]
    assert sorted(o.type.dtype for o in outputs) == sorted(expected)
    before = {v: v.get_value().copy() for v in updates}
    f(problem["X"][0], problem["Y"][0])
    f(problem["X"][1], problem["Y"][1])
    for v in updates:
        value = v.get_value()
        assert value.dtype == (np.int64 if v.name == "adam.t" else np.float32), v.name
        assert np.all(np.isfinite(value)), v.name
        if v.name.startswith(("W_", "b_")) and "." not in v.name:
            assert not np.array_equal(value, before[v]), v.name
    assert next(v for v in updates if v.name == "adam.t").get_value() == np.float32(2)


# -------------------------------------------- 4. symbolic hyperparameters


def test_shared_learning_rate_changes_the_step_of_float32_model(problem):
    f32 = np.float32
    lr = pytensor.shared(np.float64(0.1), name="lr")
    W_sgd = pytensor.shared(problem["W"].astype(f32), name="W_sgd")
    W_adam = pytensor.shared(problem["W"].astype(f32), name="W_adam")
    W_mom = pytensor.shared(problem["W"].astype(f32), name="W_mom")
    lr_in = pt.dscalar("lr_in")  # a symbolic input works too
    g = pt.tensor("g", dtype="float32", shape=(3, 4))
    upd = U.sgd([g], [W_sgd], lr)
    upd.update(U.adam([g], [W_adam], learning_rate=lr))
    upd.update(U.momentum([g], [W_mom], learning_rate=lr_in, momentum=0.5))
    f = pytensor.function([g, lr_in], [], updates=upd)
    # float32 everywhere but the int64 step counter adam.t
    assert sorted(o.type.dtype for o in f.maker.fgraph.outputs) == \
        ["float32"] * (len(upd) - 1) + ["int64"]

    ref = {k: {"W": problem["W"].astype(f32).astype(np.float64)} for k in "sam"}
    states = {k: {} for k in "sam"}
    for k, rate in enumerate([0.1, 0.01, 0.5]):
        lr.set_value(np.float64(rate))
        gk = problem["GW"][k].astype(f32)
        w_before = W_sgd.get_value().astype(np.float64)
        f(gk, 2 * rate)
        # the sgd step is exactly rate * g (float32 precision)
        np.testing.assert_allclose(w_before - W_sgd.get_value(), rate * gk, rtol=1e-4,
                                   atol=1e-6)
        reference_step("sgd", ref["s"], {"W": gk}, states["s"], learning_rate=rate,
                       hyper_dtype="float32")
        reference_step("adam", ref["a"], {"W": gk}, states["a"], learning_rate=rate,
                       hyper_dtype="float32")
        reference_step("momentum", ref["m"], {"W": gk}, states["m"], learning_rate=2 * rate,
                       momentum=0.5, hyper_dtype="float32")
        for key, var in (("s", W_sgd), ("a", W_adam), ("m", W_mom)):
            assert var.get_value().dtype == np.float32
            np.testing.assert_allclose(var.get_value(), ref[key]["W"], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{var.name} after step {k + 1}")


# ------------------------------------------------------ 5. PyMC partial


def test_rule_without_loss_and_params_returns_partial(problem):
    rule = U.adam(learning_rate=0.01)
    assert callable(rule) and isinstance(rule, functools.partial)
    assert rule.keywords["learning_rate"] == 0.01
    target = np.array([1.0, -1.0, 3.0])
    w1 = pytensor.shared(np.zeros(3), name="w1")
    w2 = pytensor.shared(np.zeros(3), name="w2")
    upd = rule(pt.sum((w1 - target) ** 2), [w1])
    upd.update(U.adam(pt.sum((w2 - target) ** 2), [w2], learning_rate=0.01))
    f = pytensor.function([], [], updates=upd)
    ref, state = {"w": np.zeros(3)}, {}
    for _ in range(3):
        f()
        reference_step("adam", ref, {"w": 2 * (ref["w"] - target)}, state, learning_rate=0.01)
    np.testing.assert_allclose(w1.get_value(), w2.get_value(), rtol=1e-15, atol=0)
    assert_close(w1.get_value(), ref["w"], "float64", "partial adam w")
    # and not the default learning rate: 3 steps of ~0.01 each
    np.testing.assert_allclose(np.abs(w1.get_value()), 0.03, rtol=1e-3)


@pytest.mark.parametrize("rule", LOSS_RULES)
def test_partial_for_every_rule(rule):
    kwargs = {"learning_rate": 0.05}
    p = getattr(U, rule)(**kwargs)
    assert isinstance(p, functools.partial)
    w = pytensor.shared(np.ones(2), name="w")
    upd = p(pt.sum(w ** 2), [w])
    assert w in upd and isinstance(upd, OrderedDict)


def test_missing_params_or_loss_raises():
    w = pytensor.shared(np.ones(2), name="w")
    loss = pt.sum(w ** 2)
    with pytest.raises(ValueError, match="params"):
        U.adam(loss)
    with pytest.raises(ValueError, match="loss_or_grads"):
        U.adam(params=[w])


# ------------------------------------------------------------ 6. errors


@pytest.fixture
def W_named():
    return pytensor.shared(np.zeros((3, 4)), name="W_culprit", shape=(3, 4))


@pytest.mark.parametrize("rule", RULES)
def test_param_not_shared_raises_type_error_naming_it(rule):
    Wsym = pt.matrix("W_symbolic")
    with pytest.raises(TypeError, match="W_symbolic"):
        build(rule, pt.sum(Wsym ** 2), [Wsym])


def test_single_shared_instead_of_list_raises(W_named):
    with pytest.raises(TypeError, match="W_culprit"):
        U.adam(pt.sum(W_named ** 2), W_named)


def test_grads_list_of_wrong_length_raises(W_named):
    b = pytensor.shared(np.zeros(4), name="b")
    with pytest.raises(ValueError, match="1 gradient.*2 param"):
        U.adam([pt.matrix("g")], [W_named, b])
    with pytest.raises(ValueError, match="3 gradient.*2 param"):
        U.sgd([pt.matrix(), pt.vector(), pt.vector()], [W_named, b], 0.1)


@pytest.mark.parametrize("static_param_shape", [True, False])
def test_gradient_shape_mismatch_raises_naming_param(static_param_shape):
    shape = (3, 4) if static_param_shape else None
    W = pytensor.shared(np.zeros((3, 4)), name="W_culprit", shape=shape)
    g = pt.tensor("g", dtype="float64", shape=(3, 5))
    with pytest.raises(ValueError, match="W_culprit"):
        U.sgd([g], [W], 0.1)
    with pytest.raises(ValueError, match="W_culprit"):
        U.adam([pt.vector("g1")], [W])  # wrong number of dimensions


def test_integer_param_raises_type_error_naming_it():
    k = pytensor.shared(np.arange(3), name="k_int")
    with pytest.raises(TypeError, match="k_int"):
        U.sgd(pt.sum(k), [k], 0.1)
    with pytest.raises(TypeError, match="k_int"):
        U.adam([pt.vector()], [k])


def test_duplicated_param_raises_naming_it(W_named):
    b = pytensor.shared(np.zeros(4), name="b")
    with pytest.raises(ValueError, match="W_culprit"):
        U.rmsprop(pt.sum(W_named ** 2) + pt.sum(b), [W_named, b, W_named])


@pytest.mark.parametrize("apply", ["apply_momentum", "apply_nesterov_momentum"])
def test_apply_momentum_param_without_update_raises_naming_it(apply, W_named):
    b = pytensor.shared(np.zeros(4), name="b_missing")
    with pytest.raises(ValueError, match="b_missing"):
        getattr(U, apply)(U.sgd(pt.sum(W_named ** 2), [W_named], 0.1), [W_named, b])


def test_non_scalar_loss_raises(W_named):
    with pytest.raises(ValueError, match="scalar"):
        U.sgd(W_named ** 2, [W_named], 0.1)


def test_norm_constraint_1d_without_axes_raises():
    with pytest.raises(ValueError, match="norm_axes"):
        U.norm_constraint(pt.vector("v"), 1.0)


@pytest.mark.parametrize("rule", LOSS_RULES)
def test_negative_learning_rate_raises(rule, W_named):
    with pytest.raises(ValueError, match="learning_rate"):
        getattr(U, rule)(pt.sum(W_named ** 2), [W_named], learning_rate=-0.1)


@pytest.mark.parametrize("rule", ["adagrad", "rmsprop", "adadelta", "adam", "adamax", "amsgrad"])
def test_negative_epsilon_raises(rule, W_named):
    with pytest.raises(ValueError, match="epsilon"):
        getattr(U, rule)(pt.sum(W_named ** 2), [W_named], epsilon=-1e-8)


@pytest.mark.parametrize("rule", ADAM_FAMILY)
def test_beta1_of_one_raises(rule, W_named):
    with pytest.raises(ValueError, match="beta1"):
        getattr(U, rule)(pt.sum(W_named ** 2), [W_named], beta1=1.0)


def test_sgd_without_learning_rate_raises(W_named):
    with pytest.raises(TypeError, match="learning_rate"):
        U.sgd(pt.sum(W_named ** 2), [W_named])


@pytest.mark.parametrize("average, exc", [(0, ValueError), (-3, ValueError),
                                          (2.5, TypeError), (True, TypeError)])
@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_invalid_average_raises(rule, average, exc, W_named):
    kw = {"learning_rate": 0.1} if rule == "sgd" else {}
    with pytest.raises(exc, match="average"):
        getattr(U, rule)(pt.sum(W_named ** 2), [W_named], average=average, **kw)


# ------------------------------------------------------ 8. Lasagne drop-in

PUBLIC = RULES + ["get_or_compute_grads", "norm_constraint", "total_norm_constraint"]


@pytest.mark.parametrize("name", PUBLIC)
def test_lasagne_name_exists_and_is_callable(name):
    assert callable(getattr(U, name))


def test_lasagne_names_are_public():
    """``from lasagne_accum.updates import *`` (and the top level) gives Lasagne's names."""
    import lasagne_accum

    assert set(PUBLIC) <= set(U.__all__)
    assert set(U.__all__) <= set(lasagne_accum.__all__)


def _defaults(fn):
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _positional(fn):
    return [k for k, p in inspect.signature(fn).parameters.items()
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]


@pytest.mark.parametrize("name, positional, defaults", [
    ("sgd", ["loss_or_grads", "params", "learning_rate"], {}),
    ("momentum", ["loss_or_grads", "params", "learning_rate", "momentum"], {"momentum": 0.9}),
    ("nesterov_momentum", ["loss_or_grads", "params", "learning_rate", "momentum"],
     {"momentum": 0.9}),
    ("apply_momentum", ["updates", "params", "momentum"], {"params": None, "momentum": 0.9}),
    ("apply_nesterov_momentum", ["updates", "params", "momentum"],
     {"params": None, "momentum": 0.9}),
    ("adagrad", ["loss_or_grads", "params", "learning_rate", "epsilon"],
     {"learning_rate": 1.0, "epsilon": 1e-6}),
    ("rmsprop", ["loss_or_grads", "params", "learning_rate", "rho", "epsilon"],
     {"learning_rate": 1.0, "rho": 0.9, "epsilon": 1e-6}),
    ("adadelta", ["loss_or_grads", "params", "learning_rate", "rho", "epsilon"],
     {"learning_rate": 1.0, "rho": 0.95, "epsilon": 1e-6}),
    ("adam", ["loss_or_grads", "params", "learning_rate", "beta1", "beta2", "epsilon"],
     {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}),
    ("adamax", ["loss_or_grads", "params", "learning_rate", "beta1", "beta2", "epsilon"],
     {"learning_rate": 0.002, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}),
    ("amsgrad", ["loss_or_grads", "params", "learning_rate", "beta1", "beta2", "epsilon"],
     {"learning_rate": 0.001, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}),
    ("norm_constraint", ["tensor_var", "max_norm", "norm_axes", "epsilon"],
     {"norm_axes": None, "epsilon": 1e-7}),
    ("total_norm_constraint", ["tensor_vars", "max_norm", "epsilon", "return_norm"],
     {"epsilon": 1e-7, "return_norm": False}),
    ("get_or_compute_grads", ["loss_or_grads", "params"], {}),
])
def test_signature_and_defaults_match_lasagne(name, positional, defaults):
    fn = getattr(U, name)
    assert _positional(fn) == positional
    got = _defaults(fn)
    for key, value in defaults.items():
        assert got[key] == value, (name, key, got[key])


def test_constraints_reexported_from_updates():
    import lasagne_accum
    from lasagne_accum import _graph, constraints

    assert U.norm_constraint is constraints.norm_constraint
    assert U.total_norm_constraint is constraints.total_norm_constraint
    assert U.get_or_compute_grads is _graph.get_or_compute_grads
    assert lasagne_accum.adam is U.adam


# ------------------------------------------- 9. safe by default


@pytest.mark.parametrize("rule", ADAM_FAMILY)
def test_step_counter_is_int64_and_counts_past_2_to_the_24(rule):
    """A float32 counter stops at 2**24 (2**24 + 1 rounds back); an int64 one does not."""
    w = pytensor.shared(np.array([1.0, -2.0], dtype="float32"), name="w")
    g = pt.vector("g", dtype="float32")
    upd = getattr(U, rule)([g], [w], learning_rate=0.01)
    t = {v.name: v for v in upd}[f"{rule}.t"]
    assert t.type.dtype == "int64"
    t.set_value(np.int64(2 ** 24))
    f = pytensor.function([g], [], updates=upd, mode="CVM")
    grad = np.array([0.5, -0.25], dtype="float32")
    f(grad)
    assert int(t.get_value()) == 2 ** 24 + 1
    f(grad)
    assert int(t.get_value()) == 2 ** 24 + 2
    assert w.get_value().dtype == np.float32
    # numpy reference from t = 2**24 with zero moments (beta ** t underflows to 0)
    params, state = {"w": np.array([1.0, -2.0])}, {f"{rule}.t": np.float64(2 ** 24)}
    for _ in range(2):
        reference_step(rule, params, {"w": grad}, state, hyper_dtype="float32",
                       learning_rate=0.01)
    np.testing.assert_allclose(w.get_value(), params["w"], rtol=1e-6)


@pytest.mark.parametrize("rule", LOSS_RULES)
def test_float16_params_train_without_nan_in_float32_arithmetic(rule):
    """float16: state and arithmetic in float32, the result cast back."""
    # PyTensor's Numba backend has no float16 (NotImplementedError); C compiles it.
    w = pytensor.shared(np.array([1.0, -0.5, 0.25], dtype="float16"), name="w")
    g = pt.vector("g", dtype="float16")
    hyper = {"learning_rate": 0.01} if rule in ("sgd", "momentum", "nesterov_momentum") else {}
    upd = getattr(U, rule)([g], [w], **hyper)
    for var, expr in upd.items():
        assert expr.type.dtype == var.type.dtype, var.name
    assert w.type.dtype == "float16"
    for var in upd:
        if var is not w and var.type.ndim == 1:
            assert var.type.dtype == "float32", var.name  # state in float32
    f = pytensor.function([g], [], updates=upd, mode="CVM")
    params, state = {"w": w.get_value().astype(np.float64)}, {}
    rng = np.random.default_rng(4)
    for _ in range(3):
        grad = rng.normal(size=3).astype("float16")
        f(grad)
        reference_step(rule, params, {"w": grad}, state, hyper_dtype="float32",
                       **({"learning_rate": 0.01} if hyper else {}))
        params["w"] = params["w"].astype(np.float16).astype(np.float64)  # stored in float16
    value = w.get_value()
    assert value.dtype == np.float16 and np.all(np.isfinite(value))
    np.testing.assert_allclose(value.astype(np.float64), params["w"], rtol=2e-3, atol=1e-3)


def test_loss_that_does_not_depend_on_a_param_names_it():
    W = pytensor.shared(np.ones((2, 2)), name="W")
    b = pytensor.shared(np.ones(2), name="b_unused")
    x = pt.matrix("x")
    with pytest.raises(ValueError, match=r"does not depend on params\[1\] \(b_unused\)"):
        U.adam(((x @ W) ** 2).sum(), [W, b])
    with pytest.raises(ValueError, match=r"params\[1\] \(b_unused\)"):
        U.sgd(((x @ W) ** 2).sum(), [W, b], average=2, learning_rate=0.1)


def test_a_bare_gradient_instead_of_a_list_says_so():
    W = pytensor.shared(np.ones((2, 2)), name="W")
    with pytest.raises(ValueError, match=r"pass a list with one gradient per parameter \(\[grad\]\)"):
        U.adam(pt.matrix("gW"), [W])


@pytest.mark.parametrize("rule, wrong, right", [
    ("adam", "lr", "learning_rate"), ("sgd", "lr", "learning_rate"),
    ("rmsprop", "eps", "epsilon"), ("adam", "beta_1", "beta1"),
    ("momentum", "learning_rat", "learning_rate"),
])
def test_a_misspelled_keyword_gets_a_suggestion(rule, wrong, right):
    W = pytensor.shared(np.ones(2), name="W")
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{wrong}'; did you mean "
                                        f"{right}="):
        getattr(U, rule)((W ** 2).sum(), [W], **{wrong: 0.1})


def test_a_misspelled_keyword_through_the_accumulating_wrapper():
    import lasagne_accum as la

    W = pytensor.shared(np.ones(2), name="W")
    with pytest.raises(TypeError, match="did you mean learning_rate="):
        la.with_accumulated_gradients((W ** 2).sum(), [W], 2, U.adam, lr=0.1)


@pytest.mark.parametrize("rule", RULES)
def test_name_replaces_the_rule_name_in_state_names(rule):
    W = pytensor.shared(np.ones((2, 2)), name="W")
    g = [pt.matrix("g")]
    if rule.startswith("apply_"):
        upd = getattr(U, rule)(U.sgd(g, [W], 0.1), name="enc")
        default = getattr(U, rule)(U.sgd(g, [W], 0.1))
    else:
        kw = {"learning_rate": 0.1} if rule in ("sgd", "momentum", "nesterov_momentum") else {}
        upd = getattr(U, rule)(g, [W], name="enc", **kw)
        default = getattr(U, rule)(g, [W], **kw)
    names = sorted(v.name for v in upd)
    expected = sorted(
        n.replace(f".{rule.replace('apply_', '').replace('nesterov_', '')}_", ".enc_")
         .replace(f"{rule}.t", "enc.t")
        for n in (v.name for v in default)
    )
    assert names == expected
    if rule not in ("sgd",):
        assert any("enc" in n for n in names)
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        getattr(U, "adam")(g, [W], name=3)
