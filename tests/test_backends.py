"""The same numbers in every PyTensor backend that is installed.

Each backend's results are compared with the C backend's (whose numbers the
other test modules check against independent numpy references), every
function compiled with ``lasagne_accum.mode(<backend>)``. A backend is
skipped only when its package is missing. (What PyTensor's own modes get
wrong without the library's fixes: ``tests/test_upstream_*.py``.)

This is the module that compiles for real (the root ``conftest.py`` runs the
others with Python implementations), and compiling is what costs: seconds per
graph in C and Numba, tens of seconds in PyTorch. So the rules under test are
put side by side in ONE graph per (form, dtype, backend), each rule on its own
copy of the model (state names prefixed by the rule), and every test compares
all of them at once; a failure names the rule and variable that differ.
"""

import importlib.util

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import lasagne_accum as la

RULES = {
    "sgd": dict(learning_rate=0.1),
    "momentum": dict(learning_rate=0.1, momentum=0.9),
    "nesterov_momentum": dict(learning_rate=0.1, momentum=0.9),
    "adagrad": dict(learning_rate=0.1),
    "rmsprop": dict(learning_rate=0.01),
    "adadelta": dict(),
    "adam": dict(learning_rate=0.05),
    "adamax": dict(learning_rate=0.05),
    "amsgrad": dict(learning_rate=0.05),
}
REFERENCE = "CVM"


def _installed(module):
    return importlib.util.find_spec(module) is not None


BACKENDS = [
    pytest.param("NUMBA", id="numba"),
    pytest.param("JAX", id="jax", marks=pytest.mark.skipif(not _installed("jax"),
                                                          reason="jax not installed")),
    pytest.param("PYTORCH", id="pytorch", marks=pytest.mark.skipif(
        not _installed("torch"), reason="torch not installed")),
]
TOL = {"float64": 1e-12, "float32": 1e-6}


def _model(dtype, prefix="", inputs=None):
    """tanh regression in float64; in float32 a linear one, because backends evaluate
    float32 transcendental functions differently (C in double precision, Numba and JAX
    in single), which alone moves results by a few 1e-6."""
    rng = np.random.RandomState(0)
    W = pytensor.shared(rng.randn(4, 3).astype(dtype), name=prefix + "W")
    b = pytensor.shared(np.zeros(3, dtype), name=prefix + "b")
    x, y = inputs or (pt.matrix("x", dtype=dtype), pt.matrix("y", dtype=dtype))
    out = x @ W + b
    loss = (((pt.tanh(out) if dtype == "float64" else out) - y) ** 2).mean()
    return x, y, [W, b], loss


def _data(dtype, n=6):
    """In float32 the targets sit well above the fit, so that no gradient is a sum that
    cancels to near zero: Adam divides by its magnitude and would turn the last-bit
    differences of the backends' float32 sums (C accumulates them in double) into
    visible ones."""
    rng = np.random.RandomState(1)
    shift = 3.0 if dtype == "float32" else 0.0
    return [(rng.randn(k, 4).astype(dtype), (rng.randn(k, 3) + shift).astype(dtype))
            for k in rng.randint(1, 5, size=n)]


def _host(updates):
    values = {v.name: np.asarray(v.get_value()) for v in updates}
    assert len(values) == len(updates), "two state variables share a name"
    return values


def _assert_close(got, want, dtype):
    """Relative to each array's scale: an element that cancels to near zero carries the
    rounding of its larger terms, so its own relative error says nothing."""
    assert got.keys() == want.keys()
    for name in want:
        scale = float(np.max(np.abs(want[name]))) or 1.0
        np.testing.assert_allclose(got[name], want[name], rtol=TOL[dtype],
                                   atol=TOL[dtype] * scale, err_msg=name)


def _models(rules, dtype):
    """One model per rule, all fed by the same symbolic inputs x, y."""
    x, y = pt.matrix("x", dtype=dtype), pt.matrix("y", dtype=dtype)
    return x, y, {rule: _model(dtype, f"{rule}.", (x, y))[2:] for rule in rules}


def _plain_updates(rules, dtype):
    """Each rule on its own model, applied directly: inputs, updates and losses."""
    x, y, models = _models(rules, dtype)
    upd, losses = {}, []
    for rule, (params, loss) in models.items():
        upd.update(getattr(la, rule)(loss, params, **RULES[rule]))
        losses.append(loss)
    return x, y, upd, losses


def _run_plain(rules, dtype, mode):
    x, y, upd, losses = _plain_updates(rules, dtype)
    f = pytensor.function([x, y], losses, updates=upd, mode=la.mode(mode))
    for batch in _data(dtype, 3):
        f(*batch)
    return _host(upd)


def _run_two_function(rules, dtype, mode):
    x, y, models = _models(rules, dtype)
    accu_all, apply_all, averages = {}, {}, []
    for rule, (params, loss) in models.items():
        accu, reset = la.accumulate_gradients(loss, params, weight=x.shape[0], name=f"{rule}.acc")
        apply = getattr(la, rule)(accu.grads, params, **RULES[rule])
        avg = la.ModelAverage(params, 0.5, 2, 3, updates=apply, name=f"{rule}.avg")
        apply.update(reset)
        apply.update(avg.updates)
        accu_all.update(accu)
        apply_all.update(apply)
        averages.append((avg, params))
    step = pytensor.function([x, y], [], updates=accu_all, mode=la.mode(mode))
    apply_fn = pytensor.function([], [], updates=apply_all, mode=la.mode(mode))
    for i, batch in enumerate(_data(dtype, 9), 1):
        step(*batch)
        if i % 3 == 0:
            apply_fn()
    out = _host(apply_all)
    for avg, params in averages:
        with avg.apply():
            out.update({f"avg.{p.name}": np.asarray(p.get_value()) for p in params})
        out.update({f"restored.{p.name}": np.asarray(p.get_value()) for p in params})
    return out


def _run_single_function(rules, dtype, mode):
    """The first rule through its ``average=3`` keyword, the others through
    ``with_accumulated_gradients`` (the same core, under their own state names)."""
    x, y, models = _models(rules, dtype)
    upd = {}
    for i, (rule, (params, loss)) in enumerate(models.items()):
        if i == 0:
            upd.update(getattr(la, rule)(loss, params, average=3, weight=x.shape[0],
                                         **RULES[rule]))
        else:
            upd.update(la.with_accumulated_gradients(loss, params, 3, getattr(la, rule),
                                                     weight=x.shape[0], name=f"{rule}.average",
                                                     **RULES[rule]))
    f = pytensor.function([x, y], [], updates=upd, mode=la.mode(mode))
    for batch in _data(dtype, 6):
        f(*batch)
    return _host(upd)


_reference_cache = {}


def _reference(kind, rules, dtype):
    key = (kind, tuple(rules), dtype)
    if key not in _reference_cache:
        _reference_cache[key] = kind(rules, dtype, REFERENCE)
    return _reference_cache[key]


@pytest.mark.parametrize("mode", BACKENDS)
def test_every_rule_agrees_float64(mode):
    rules = sorted(RULES)
    got = _run_plain(rules, "float64", mode)
    assert {name.split(".")[0] for name in got} >= set(rules)   # every rule is in the graph
    _assert_close(got, _reference(_run_plain, rules, "float64"), "float64")


def _run_float32(rules, dtype, mode):
    """The rules as in :func:`_run_plain`, and beside them in the same graph Adam
    through ``average=3``, which steps on the third call: its ``ifelse`` selects the
    rule's values and the buffers' zeros, and JAX wants both branches in one dtype."""
    x, y, upd, losses = _plain_updates(rules, dtype)
    params, loss = _model(dtype, "single.", (x, y))[2:]
    upd.update(la.adam(loss, params, average=3, name="single.average", **RULES["adam"]))
    f = pytensor.function([x, y], [*losses, loss], updates=upd, mode=la.mode(mode))
    for batch in _data(dtype, 3):
        f(*batch)
    return _host(upd)


def _expected_dtype(name):
    if name.endswith((".t", ".count")):
        return np.int64  # step and window counters
    return np.bool_ if name.endswith(".zeroed") else np.float32


@pytest.mark.parametrize("mode", BACKENDS)
def test_float32_agrees_and_stays_float32(mode):
    rules = ["adam", "momentum"]
    got = _run_float32(rules, "float32", mode)
    assert any(name.startswith("single.") and name.endswith("grad_accu") for name in got)
    for name, value in got.items():   # float32 state stays float32
        assert value.dtype == _expected_dtype(name), name
    _assert_close(got, _reference(_run_float32, rules, "float32"), "float32")


@pytest.mark.parametrize("mode", BACKENDS)
def test_two_function_form_and_model_average_agree(mode):
    rules = ["adam", "nesterov_momentum"]
    got = _run_two_function(rules, "float64", mode)
    _assert_close(got, _reference(_run_two_function, rules, "float64"), "float64")
    for rule in rules:  # apply/restore gave the trained values back
        for name in ("W", "b"):
            assert np.array_equal(got[f"restored.{rule}.{name}"], got[f"{rule}.{name}"])


@pytest.mark.parametrize("mode", BACKENDS)
def test_single_function_form_agrees(mode):
    rules = ["adam", "rmsprop"]
    _assert_close(_run_single_function(rules, "float64", mode),
                  _reference(_run_single_function, rules, "float64"), "float64")


@pytest.mark.skipif(not _installed("jax"), reason="jax not installed")
def test_jax_two_function_reset_stays_float32():
    """The reset writes constants: zeros broadcast to a buffer's shape (``Alloc``) and,
    for the 0-d weight total, the constant itself (``DeepCopyOp``). PyTensor hands JAX
    a 0-d constant as a Python number, which JAX takes as float64."""
    x, y, params, loss = _model("float32")
    acc = la.accumulate_gradients(loss, params, weight=x.shape[0])
    step = pytensor.function([x, y], [], updates=acc.accumulate, mode=la.mode("JAX"))
    reset = pytensor.function([], [], updates=acc.reset, mode=la.mode("JAX"))
    for batch in _data("float32", 2):
        step(*batch)
    reset()
    got = {v.name: np.asarray(v.get_value()) for v in acc.reset}
    assert {name: v.dtype for name, v in got.items()} == {
        "W.grad_accu": np.float32, "b.grad_accu": np.float32,
        "accumulate.total": np.float32, "accumulate.count": np.int64}
    assert not any(v.any() for v in got.values())


@pytest.mark.skipif(not _installed("jax"), reason="jax not installed")
def test_jax_state_stays_on_device_and_checkpoints(tmp_path):
    import jax

    x, y, params, loss = _model("float32")
    upd = la.adam(loss, params, 0.05)
    avg = la.ModelAverage(params, 0.5, 3, 10, updates=upd)  # closes at step 3
    upd.update(avg.updates)
    f = pytensor.function([x, y], loss, updates=upd, mode=la.mode("JAX"))
    for batch in _data("float32", 3):
        f(*batch)
    # Between calls every piece of state is a JAX array: no host round trip per step.
    assert all(isinstance(v.get_value(borrow=True), jax.Array) for v in upd)
    saved = {v.name: np.asarray(v.get_value()) for v in upd}
    la.save_state(tmp_path / "jax.npz", upd)
    for v in upd:
        v.set_value(np.zeros_like(np.asarray(v.get_value())))
    la.load_state(tmp_path / "jax.npz", upd)
    for v in upd:
        assert np.array_equal(np.asarray(v.get_value()), saved[v.name])
    before = [np.asarray(p.get_value()) for p in params]
    with avg.apply():
        averaged = [np.asarray(p.get_value()) for p in params]
    after = [np.asarray(p.get_value()) for p in params]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert not all(np.array_equal(a, b) for a, b in zip(before, averaged))
    f(*_data("float32", 1)[0])  # training goes on after apply/restore
    assert all(isinstance(v.get_value(borrow=True), jax.Array) for v in upd)
