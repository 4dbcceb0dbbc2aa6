"""Shared test reference: one model, its batches, numpy gradients and rules, one comparison.

Used by the accumulation, single-function, update-rule and README tests, so the
independent references live in one place:

* :class:`Model`: ``tanh(X W + b)`` regressed on ``Y``; the loss is the MEAN
  over the examples of the batch of the squared error, so N batches
  accumulated with ``weight=batch_size`` equal one large batch;
* :func:`np_grads`: its gradient derived by hand in float64 numpy;
* :func:`reference_step`: one step of every rule of Lasagne's set in float64
  numpy, written from the formulas, not from the library;
* :func:`assert_close`: the one comparison helper (arrays, shared variables,
  or dictionaries of either by name).
"""

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import pytensor
import pytensor.tensor as pt

# Hyperparameters of the rules in the equivalence tests (adamax: its defaults, as
# in the seed's call ``adamax(loss, params, average=5)``).
RULES = OrderedDict(
    sgd=dict(learning_rate=0.1),
    momentum=dict(learning_rate=0.01, momentum=0.9),
    nesterov_momentum=dict(learning_rate=0.05, momentum=0.9),
    adagrad=dict(learning_rate=0.1),
    rmsprop=dict(learning_rate=0.01),
    adadelta=dict(learning_rate=1.0),
    adam=dict(learning_rate=0.01),
    adamax=dict(),
    amsgrad=dict(learning_rate=0.01),
)
ADAM_FAMILY = ("adam", "adamax", "amsgrad")
# (rtol, atol relative to the largest expected magnitude): the absolute slack
# scales with the array, so small-valued state (Adadelta's ~1e-6 accumulators)
# is still checked to about rtol.
TOL = {"float64": (1e-12, 1e-14), "float32": (1e-5, 1e-6), "float16": (1e-2, 2e-3)}
N_IN, N_OUT = 3, 4
_INIT = np.random.default_rng(1234)
W0 = 0.5 * _INIT.normal(size=(N_IN, N_OUT))
B0 = 0.1 * _INIT.normal(size=N_OUT)


class Model:
    """tanh(X W + b) regressed on Y; loss = mean over examples of the squared error."""

    def __init__(self, dtype="float64", w_dtype=None, b_dtype=None):
        self.dtype = dtype
        self.W = pytensor.shared(W0.astype(w_dtype or dtype), name="W")
        self.b = pytensor.shared(B0.astype(b_dtype or dtype), name="b")
        self.params = [self.W, self.b]
        self.X = pt.matrix("X", dtype=dtype)
        self.Y = pt.matrix("Y", dtype=dtype)
        pred = pt.tanh(pt.dot(self.X, self.W) + self.b)
        self.loss = pt.mean(pt.sum((pred - self.Y) ** 2, axis=1))

    def reset_params(self):
        self.W.set_value(W0.astype(self.W.type.dtype))
        self.b.set_value(B0.astype(self.b.type.dtype))


def zero(variables):
    """Set shared variables to zero (rule state, buffers, counters)."""
    for v in variables:
        v.set_value(np.zeros_like(v.get_value()))


def make_batch(rng, size, dtype="float64"):
    X = rng.normal(size=(size, N_IN)).astype(dtype)
    Y = rng.uniform(-0.9, 0.9, size=(size, N_OUT)).astype(dtype)
    return X, Y


def concat(batches):
    return (np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches]))


def np_grads(W, b, X, Y):
    """Analytic gradient of the model's mean squared error (float64)."""
    W, b, X, Y = (np.asarray(a, dtype=np.float64) for a in (W, b, X, Y))
    h = np.tanh(X @ W + b)
    dz = 2.0 * (h - Y) * (1.0 - h ** 2) / len(X)
    return [X.T @ dz, dz.sum(axis=0)]


U32 = 2.0 ** -24  # unit roundoff of float32


def _gamma(n):
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of an n-term sum."""
    return n * U32 / (1 - n * U32)


def float32_grad_error(W, b, X, Y, n_sums=1):
    """First-order bound on |g32 - g| for the model's gradient computed in float32.

    A running error analysis of :func:`np_grads`, operation by operation
    (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., ch. 3):
    each rounding contributes at most ``U32`` relative, an n-term sum
    ``_gamma(n)`` times the sum of its terms' magnitudes, and a function's
    input error passes on times its derivative. `n_sums` extra terms cover a
    gradient that is summed over batches (weighted, then divided by the total)
    instead of over one batch. The bound is doubled at the end: the compiled
    graph orders the same operations differently (gradient of the mean, of the
    square, of tanh as ``1 - h**2``), which changes the small constants.

    Where a gradient element is a sum of terms that cancel, the bound is much
    larger than ``U32 * |g|``; a rule that divides by ``sqrt(g**2 + eps)``
    multiplies it by up to ``learning_rate / sqrt(eps)`` (Adagrad here: 100).
    """
    W, b, X, Y = (np.asarray(a, dtype=np.float64) for a in (W, b, X, Y))
    n, k = X.shape
    u, aX = U32, np.abs(X)
    z = X @ W + b
    e_z = _gamma(k + 1) * (aX @ np.abs(W) + np.abs(b))
    h = np.tanh(z)
    e_h = (1 - h ** 2) * e_z + 2 * u * np.abs(h)  # tanh rounded to within 2 ulp
    r, s = h - Y, 1 - h ** 2
    e_r = e_h + u * np.abs(r)
    e_s = 2 * np.abs(h) * e_h + 2 * u  # h*h, then 1 - h*h; |h| < 1
    dz = 2.0 * r * s / n
    e_dz = 2.0 / n * (e_r * s + np.abs(r) * e_s) + 4 * u * np.abs(dz)
    sums = _gamma(n + n_sums + 1)
    e_W = aX.T @ e_dz + sums * (aX.T @ np.abs(dz))
    e_b = e_dz.sum(axis=0) + sums * np.abs(dz).sum(axis=0)
    return [2 * e_W, 2 * e_b]


def step_with_grad_error(rule, params, grads, errors, **hyper):
    """One float64 step of `rule` from zero state, and how far float32 gradient error moves it.

    Returns ``(values, slack)``: dicts by name ('W', 'b', 'W.adagrad_accu',
    'adam.t', ...) of the step's parameters and state computed by
    :func:`reference_step` with float32-rounded hyperparameters, and of the
    largest change of each when every gradient element moves by up to its
    `errors` entry. From zero state, every rule's first step is monotone in
    each gradient element, and its state (a multiple of g, of g**2 or |g|)
    moves farthest from its value at g at one of the ends, so the two ends
    ``g - e`` and ``g + e`` bound both.
    """
    def run(sign):
        p = {n: np.asarray(v, dtype=np.float64).copy() for n, v in params.items()}
        g = {n: np.asarray(grads[n], dtype=np.float64) + sign * errors[n] for n in grads}
        state = {}
        reference_step(rule, p, g, state, hyper_dtype="float32", **hyper)
        return {**p, **state}

    values = run(0.0)
    ends = run(-1.0), run(1.0)
    slack = {n: np.max([np.abs(e[n] - values[n]) for e in ends], axis=0) for n in values}
    return values, slack


def assert_close_within(actual, expected, slack, dtype, what=""):
    """:func:`assert_close`'s tolerance plus a per-element `slack` (dicts by name)."""
    assert sorted(actual) == sorted(expected), what
    rtol, atol_rel = TOL[str(np.dtype(dtype))]
    for name, e in expected.items():
        a = _value(actual[name])
        assert a.dtype == np.dtype(dtype) or a.dtype.kind in "iu", f"{what}: {name}: {a.dtype}"
        assert np.all(np.isfinite(a)), f"{what}: {name}"
        e = np.asarray(e, dtype=np.float64)
        bound = rtol * np.abs(e) + atol_rel * float(np.max(np.abs(e))) + slack[name]
        err = np.abs(a.astype(np.float64) - e)
        worst = np.unravel_index(np.argmax(err - bound), np.shape(e)) if e.ndim else ()
        assert np.all(err <= bound), (
            f"{what}: {name}{list(worst)}: {a[worst]!r} vs {e[worst]!r}, "
            f"error {err[worst]:.3g} > bound {bound[worst]:.3g} (slack {slack[name][worst]:.3g})")


def by_name(variables):
    """{name: variable}, checking that the names are distinct."""
    out = {v.name: v for v in variables}
    assert len(out) == len(variables), [v.name for v in variables]
    return out


def values(variables):
    """{name: copy of the value} of shared variables."""
    return {v.name: np.array(v.get_value(), copy=True) for v in variables}


def _value(x):
    if hasattr(x, "get_value"):
        return np.asarray(x.get_value())
    return np.asarray(x)


def assert_close(actual, expected, dtype="float64", what="", exact=False):
    """The one comparison helper of the test suite.

    Parameters
    ----------
    actual, expected : array-like, shared variables, or dicts of them by name
        Dictionaries must have the same names; their entries must then also
        have the same dtype and `actual` must be finite.
    dtype : str
        Picks the tolerance (:data:`TOL`): 1e-12 relative for float64, 1e-5
        for float32, 1e-2 for float16, plus an absolute slack of 1e-14, 1e-6,
        2e-3 times the largest expected magnitude.
    exact : bool
        Bit-for-bit equality instead.
    """
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), what
        assert sorted(actual) == sorted(expected), what
        for name in expected:
            a, e = _value(actual[name]), _value(expected[name])
            assert a.dtype == e.dtype, f"{what}: {name}: {a.dtype} != {e.dtype}"
            assert np.all(np.isfinite(a)), f"{what}: {name}"
            assert_close(a, e, dtype, f"{what}: {name}", exact)
        return
    a, e = _value(actual), _value(expected)
    if exact:
        np.testing.assert_array_equal(a, e, err_msg=what)
        return
    rtol, atol_rel = TOL[str(np.dtype(dtype))]
    e = e.astype(np.float64)
    atol = atol_rel * float(np.max(np.abs(e))) if e.size else 0.0
    np.testing.assert_allclose(a.astype(np.float64), e, rtol=rtol, atol=atol, err_msg=what)


def reference_step(rule, params, grads, state, hyper_dtype="float64", defaults=None,
                   **hyper):
    """One step of `rule` in float64 numpy, in place on `params` and `state`.

    `params`/`grads` map parameter names to arrays; `state` maps the state
    names ('W.adam_m', 'adam.t', ...) to arrays, created as zeros on first use.
    Hyperparameters default to Lasagne's values, typed here independently
    (`defaults` overrides them: the rules without a default learning rate
    need one), and are first rounded to `hyper_dtype`: a float32 model holds
    beta2=0.999 as 0.99899995..., so 1 - beta2 differs from 1e-3 by 5e-5
    relative, more than float32 arithmetic alone explains.
    """
    defaults = dict(defaults or {})

    def hp(key, default):
        return float(np.dtype(hyper_dtype).type(hyper.get(key, defaults.get(key, default))))

    def st(key, like):
        if key not in state:
            state[key] = np.zeros_like(like, dtype=np.float64)
        return state[key]

    if rule in ADAM_FAMILY:
        t = float(state.get(f"{rule}.t", 0.0)) + 1.0
        state[f"{rule}.t"] = np.float64(t)

    for n in list(params):
        p = np.asarray(params[n], dtype=np.float64)
        g = np.asarray(grads[n], dtype=np.float64)
        if rule == "sgd":
            lr = hp("learning_rate", None)
            new_p = p - lr * g
        elif rule in ("momentum", "apply_momentum"):
            lr = hp("learning_rate", None)
            mom = hp("momentum", 0.9)
            v = st(f"{n}.momentum_velocity", p)
            x = mom * v + (p - lr * g)
            state[f"{n}.momentum_velocity"] = x - p
            new_p = x
        elif rule in ("nesterov_momentum", "apply_nesterov_momentum"):
            lr = hp("learning_rate", None)
            mom = hp("momentum", 0.9)
            v = st(f"{n}.momentum_velocity", p)
            x = mom * v + (p - lr * g) - p
            state[f"{n}.momentum_velocity"] = x
            new_p = mom * x + (p - lr * g)
        elif rule == "adagrad":
            lr, eps = hp("learning_rate", 1.0), hp("epsilon", 1e-6)
            a = st(f"{n}.adagrad_accu", p) + g ** 2
            state[f"{n}.adagrad_accu"] = a
            new_p = p - lr * g / np.sqrt(a + eps)
        elif rule == "rmsprop":
            lr, rho, eps = (hp("learning_rate", 1.0), hp("rho", 0.9),
                            hp("epsilon", 1e-6))
            a = rho * st(f"{n}.rmsprop_accu", p) + (1 - rho) * g ** 2
            state[f"{n}.rmsprop_accu"] = a
            new_p = p - lr * g / np.sqrt(a + eps)
        elif rule == "adadelta":
            lr, rho, eps = (hp("learning_rate", 1.0), hp("rho", 0.95),
                            hp("epsilon", 1e-6))
            a = rho * st(f"{n}.adadelta_accu", p) + (1 - rho) * g ** 2
            d = st(f"{n}.adadelta_delta_accu", p)
            u = g * np.sqrt(d + eps) / np.sqrt(a + eps)
            new_p = p - lr * u
            state[f"{n}.adadelta_accu"] = a
            state[f"{n}.adadelta_delta_accu"] = rho * d + (1 - rho) * u ** 2
        elif rule in ADAM_FAMILY:
            lr = hp("learning_rate", 0.002 if rule == "adamax" else 0.001)
            b1, b2 = hp("beta1", 0.9), hp("beta2", 0.999)
            eps = hp("epsilon", 1e-8)
            m = b1 * st(f"{n}.{rule}_m", p) + (1 - b1) * g
            state[f"{n}.{rule}_m"] = m
            if rule == "adamax":
                a_t = lr / (1 - b1 ** t)
                u = np.maximum(b2 * st(f"{n}.adamax_u", p), np.abs(g))
                state[f"{n}.adamax_u"] = u
                new_p = p - a_t * m / (u + eps)
            else:
                a_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                v = b2 * st(f"{n}.{rule}_v", p) + (1 - b2) * g ** 2
                state[f"{n}.{rule}_v"] = v
                if rule == "amsgrad":
                    v = np.maximum(st(f"{n}.amsgrad_vhat", p), v)
                    state[f"{n}.amsgrad_vhat"] = v
                new_p = p - a_t * m / (np.sqrt(v) + eps)
        else:  # pragma: no cover
            raise AssertionError(rule)
        params[n] = new_p
