"""Shared test reference: one model, its batches, numpy gradients and rules, one comparison.

Used by the accumulation, single-function, update-rule, reference and README
tests, so the independent references live in one place:

* :class:`Model`: ``tanh(X W + b)`` regressed on ``Y``; the loss is the MEAN
  over the examples of the batch of the squared error, so N batches
  accumulated with ``weight=batch_size`` equal one large batch;
* :func:`np_grads`: its gradient derived by hand in float64 numpy;
* :func:`reference_step`: one step of every rule in float64 numpy (Lasagne's
  set, the ``apply_*`` wrappers, and adamw, lars, lamb with optax's
  definitions; a schedule as learning rate), written from the formulas, not
  from the library;
* ``schedule_*``: every learning-rate schedule of :mod:`lasagne_accum.schedules`
  from its published definition (optax's argument meanings), in float64;
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


LARGE_BATCH = ("adamw", "lars", "lamb")
#: Rules with an int64 step counter ``<prefix>.t``.
_COUNTED = ADAM_FAMILY + ("adamw", "lamb")
#: Each rule's hyperparameter defaults, typed here from Lasagne's and optax's
#: signatures (None: the rule has no default and the caller must pass one).
DEFAULTS = {
    "sgd": dict(learning_rate=None),
    "momentum": dict(learning_rate=None, momentum=0.9),
    "nesterov_momentum": dict(learning_rate=None, momentum=0.9),
    "apply_momentum": dict(learning_rate=None, momentum=0.9),
    "apply_nesterov_momentum": dict(learning_rate=None, momentum=0.9),
    "adagrad": dict(learning_rate=1.0, epsilon=1e-6),
    "rmsprop": dict(learning_rate=1.0, rho=0.9, epsilon=1e-6),
    "adadelta": dict(learning_rate=1.0, rho=0.95, epsilon=1e-6),
    "adam": dict(learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8),
    "adamax": dict(learning_rate=0.002, beta1=0.9, beta2=0.999, epsilon=1e-8),
    "amsgrad": dict(learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8),
    # optax.adamw, optax.lars, optax.lamb
    "adamw": dict(learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8,
                  weight_decay=1e-4),
    "lars": dict(learning_rate=None, momentum=0.9, weight_decay=0.0, trust_coefficient=1e-3,
                 eps=0.0, nesterov=False),
    "lamb": dict(learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-6, weight_decay=0.0),
}


def _state_prefix(rule, name):
    """The infix of a rule's per-parameter state names: ``W.<prefix>_m``."""
    if name is not None:
        return name
    return "momentum" if "momentum" in rule else rule


def _norm(x):
    return float(np.sqrt(np.sum(np.square(x))))


def trust_ratio(param, update, coefficient=1.0, eps=0.0):
    """``coefficient * ||param|| / (||update|| + eps)``; 1 where either norm is 0.

    The layer-wise ratio of LARS (You, Gitman & Ginsburg 2017, eq. 6) and of
    LAMB (You et al. 2020, Algorithm 2), with optax's guard: a zero norm
    leaves the update unscaled.
    """
    p_norm, u_norm = _norm(param), _norm(update)
    if p_norm == 0.0 or u_norm == 0.0:
        return 1.0
    return coefficient * p_norm / (u_norm + eps)


def reference_step(rule, params, grads, state, hyper_dtype="float64", defaults=None,
                   name=None, exclude=(), base=None, **hyper):
    """One step of `rule` in float64 numpy, in place on `params` and `state`.

    `params`/`grads` map parameter names to arrays; `state` maps the state
    names ('W.adam_m', 'adam.t', ...) to arrays, created as zeros on first use.
    Hyperparameters default to the rule's own defaults, typed here
    independently in :data:`DEFAULTS` (`defaults` overrides them: the rules
    without a default learning rate need one), and are first rounded to
    `hyper_dtype`: a float32 model holds beta2=0.999 as 0.99899995..., so
    1 - beta2 differs from 1e-3 by 5e-5 relative, more than float32
    arithmetic alone explains.

    Parameters
    ----------
    rule : str
        A rule of Lasagne's set, ``apply_momentum`` or
        ``apply_nesterov_momentum`` (on an SGD step unless `base` is given),
        or one of :data:`LARGE_BATCH` (optax's definitions, see
        :func:`_large_batch_update`).
    name : str, optional
        The rule's ``name=``: replaces the rule's name in the state names
        (``W.<name>_m``, ``<name>.t``, ``<name>.schedule_step``).
    exclude : collection of str
        Names of the parameters that :data:`LARGE_BATCH` rules leave out of
        weight decay and trust ratio.
    base : dict, optional
        For the ``apply_*`` wrappers: the wrapped dictionary's new value of
        each parameter (default: the SGD step ``param - learning_rate * grad``).
    **hyper
        The rule's hyperparameters. `learning_rate` may be a schedule (a
        callable of the step): it is evaluated on the counter
        ``<name or rule>.schedule_step`` (from 0), which advances by one per
        call, once for all parameters.
    """
    defaults = dict(DEFAULTS.get(rule, {}), **(defaults or {}))
    prefix = _state_prefix(rule, name)
    lr_value = hyper.get("learning_rate", defaults.get("learning_rate"))
    if callable(lr_value):
        key = f"{name or rule}.schedule_step"
        step = int(state.get(key, 0))
        hyper = dict(hyper, learning_rate=float(lr_value(step)))
        state[key] = np.int64(step + 1)

    def hp(key, default=None):
        value = hyper.get(key, defaults.get(key, default))
        if value is None:
            raise TypeError(f"reference_step({rule!r}): no value for {key}")
        return float(np.dtype(hyper_dtype).type(value))

    def st(key, like):
        if key not in state:
            state[key] = np.zeros_like(like, dtype=np.float64)
        return state[key]

    if rule in _COUNTED:
        t = float(state.get(f"{prefix}.t", 0.0)) + 1.0
        state[f"{prefix}.t"] = np.float64(t)

    for n in list(params):
        p = np.asarray(params[n], dtype=np.float64)
        g = np.asarray(grads[n], dtype=np.float64)
        if rule in LARGE_BATCH:
            new_p = _large_batch_update(rule, n, p, g, st, state, prefix, hp,
                                        t if rule in _COUNTED else None, n in exclude,
                                        bool(hyper.get("nesterov", defaults["nesterov"]))
                                        if rule == "lars" else False)
        elif rule == "sgd":
            lr = hp("learning_rate")
            new_p = p - lr * g
        elif rule in ("momentum", "apply_momentum"):
            mom = hp("momentum")
            stepped = (p - hp("learning_rate") * g if base is None
                       else np.asarray(base[n], dtype=np.float64))
            v = st(f"{n}.{prefix}_velocity", p)
            x = mom * v + stepped
            state[f"{n}.{prefix}_velocity"] = x - p
            new_p = x
        elif rule in ("nesterov_momentum", "apply_nesterov_momentum"):
            mom = hp("momentum")
            stepped = (p - hp("learning_rate") * g if base is None
                       else np.asarray(base[n], dtype=np.float64))
            v = st(f"{n}.{prefix}_velocity", p)
            x = mom * v + stepped - p
            state[f"{n}.{prefix}_velocity"] = x
            new_p = mom * x + stepped
        elif rule == "adagrad":
            lr, eps = hp("learning_rate"), hp("epsilon")
            a = st(f"{n}.{prefix}_accu", p) + g ** 2
            state[f"{n}.{prefix}_accu"] = a
            new_p = p - lr * g / np.sqrt(a + eps)
        elif rule == "rmsprop":
            lr, rho, eps = hp("learning_rate"), hp("rho"), hp("epsilon")
            a = rho * st(f"{n}.{prefix}_accu", p) + (1 - rho) * g ** 2
            state[f"{n}.{prefix}_accu"] = a
            new_p = p - lr * g / np.sqrt(a + eps)
        elif rule == "adadelta":
            lr, rho, eps = hp("learning_rate"), hp("rho"), hp("epsilon")
            a = rho * st(f"{n}.{prefix}_accu", p) + (1 - rho) * g ** 2
            d = st(f"{n}.{prefix}_delta_accu", p)
            u = g * np.sqrt(d + eps) / np.sqrt(a + eps)
            new_p = p - lr * u
            state[f"{n}.{prefix}_accu"] = a
            state[f"{n}.{prefix}_delta_accu"] = rho * d + (1 - rho) * u ** 2
        elif rule in ADAM_FAMILY:
            lr = hp("learning_rate")
            b1, b2 = hp("beta1"), hp("beta2")
            eps = hp("epsilon")
            m = b1 * st(f"{n}.{prefix}_m", p) + (1 - b1) * g
            state[f"{n}.{prefix}_m"] = m
            if rule == "adamax":
                a_t = lr / (1 - b1 ** t)
                u = np.maximum(b2 * st(f"{n}.{prefix}_u", p), np.abs(g))
                state[f"{n}.{prefix}_u"] = u
                new_p = p - a_t * m / (u + eps)
            else:
                a_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                v = b2 * st(f"{n}.{prefix}_v", p) + (1 - b2) * g ** 2
                state[f"{n}.{prefix}_v"] = v
                if rule == "amsgrad":
                    v = np.maximum(st(f"{n}.{prefix}_vhat", p), v)
                    state[f"{n}.{prefix}_vhat"] = v
                new_p = p - a_t * m / (np.sqrt(v) + eps)
        else:  # pragma: no cover
            raise AssertionError(rule)
        params[n] = new_p


def _large_batch_update(rule, n, p, g, st, state, prefix, hp, t, excluded, nesterov):
    """One parameter's new value under AdamW, LARS or LAMB (optax's definitions).

    * AdamW (Loshchilov & Hutter 2019; ``optax.adamw``): the bias-corrected
      Adam direction ``d = m_hat / (sqrt(v_hat) + epsilon)``, then
      ``param - lr * (d + weight_decay * param)``.
    * LAMB (You et al. 2020; ``optax.lamb``): the same ``d + weight_decay *
      param``, scaled by ``||param|| / ||d + weight_decay * param||``.
    * LARS (You, Gitman & Ginsburg 2017; ``optax.lars``): ``u = g +
      weight_decay * param`` scaled by ``trust_coefficient * ||param|| /
      (||u|| + eps)``; the trace ``tr := momentum * tr - lr * u`` and
      ``param + tr`` (Nesterov: ``param + momentum * tr - lr * u``).

    An `excluded` parameter gets neither the decay nor a trust ratio.
    """
    lr, wd = hp("learning_rate"), hp("weight_decay")
    if rule == "lars":
        u = g if excluded else g + wd * p
        if not excluded:
            u = u * trust_ratio(p, u, hp("trust_coefficient"), hp("eps"))
        step = -lr * u
        trace = hp("momentum") * st(f"{n}.{prefix}_momentum", p) + step
        state[f"{n}.{prefix}_momentum"] = trace
        return p + (step + hp("momentum") * trace if nesterov else trace)
    b1, b2, eps = hp("beta1"), hp("beta2"), hp("epsilon")
    m = b1 * st(f"{n}.{prefix}_m", p) + (1 - b1) * g
    v = b2 * st(f"{n}.{prefix}_v", p) + (1 - b2) * g * g
    state[f"{n}.{prefix}_m"], state[f"{n}.{prefix}_v"] = m, v
    m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    u = m_hat / (np.sqrt(v_hat) + eps)
    if not excluded:
        u = u + wd * p
        if rule == "lamb":
            u = u * trust_ratio(p, u)
    return p - lr * u


# ------------------------------------------------------------------ schedules
#
# Learning-rate schedules as functions of the optimizer step (0, 1, 2, ...),
# written from their published definitions with optax's argument meanings.
# Each factory returns a function of a number or an array of steps that
# returns float64 values.


def _as_steps(step):
    return np.asarray(step, dtype=np.float64)


def schedule_constant(value):
    """``lr(step) = value`` (``optax.constant_schedule``)."""
    return lambda step: np.full(np.shape(step), float(value))


def schedule_linear(init_value, end_value, transition_steps, transition_begin=0):
    """Linear interpolation (``optax.linear_schedule``).

    ``init_value`` up to step ``B = max(transition_begin, 0)``, then a straight
    line reaching ``end_value`` at step ``B + transition_steps`` and staying
    there; a constant ``init_value`` when ``transition_steps <= 0``.
    """
    begin = max(int(transition_begin), 0)

    def lr(step):
        s = _as_steps(step)
        if transition_steps <= 0:
            return np.full(s.shape, float(init_value))
        progress = np.clip((s - begin) / transition_steps, 0.0, 1.0)
        return init_value + (end_value - init_value) * progress

    return lr


def schedule_cosine_decay(init_value, decay_steps, alpha=0.0, exponent=1.0):
    """Cosine annealing (Loshchilov & Hutter 2017, SGDR; ``optax.cosine_decay_schedule``).

    ``init_value * (alpha + (1 - alpha) * c ** exponent)`` with
    ``c = (1 + cos(pi * min(step, decay_steps) / decay_steps)) / 2``.
    """
    def lr(step):
        s = np.minimum(_as_steps(step), decay_steps)
        c = 0.5 * (1.0 + np.cos(np.pi * s / decay_steps))
        return init_value * (alpha + (1.0 - alpha) * c ** exponent)

    return lr


def schedule_warmup_cosine_decay(init_value, peak_value, warmup_steps, decay_steps,
                                 end_value=0.0, exponent=1.0):
    """Linear warmup, then cosine annealing (``optax.warmup_cosine_decay_schedule``).

    Steps ``0 .. W = warmup_steps``: linear from `init_value` to `peak_value`;
    from W on: ``end + (peak_value - end) * c ** exponent`` with ``c = (1 +
    cos(pi * min(step - W, T - W) / (T - W))) / 2`` and ``T = decay_steps``
    (the whole schedule's length). As in optax, the end is 0 when
    ``peak_value == 0``.
    """
    end = 0.0 if peak_value == 0.0 else end_value
    length = decay_steps - warmup_steps

    def lr(step):
        s = _as_steps(step)
        if warmup_steps > 0:
            warm = init_value + (peak_value - init_value) * np.clip(s / warmup_steps, 0.0, 1.0)
        else:
            warm = np.full(s.shape, float(init_value))
        c = 0.5 * (1.0 + np.cos(np.pi * np.clip(s - warmup_steps, 0.0, length) / length))
        decay = end + (peak_value - end) * c ** exponent
        return np.where(s < warmup_steps, warm, decay)

    return lr


def schedule_piecewise_constant(init_value, boundaries_and_scales=None):
    """``init_value`` times every ``scale`` whose ``boundary <= step``.

    ``optax.piecewise_constant_schedule``: from step `boundary` on, the rate
    is multiplied by `scale`.
    """
    items = list((boundaries_and_scales or {}).items())

    def lr(step):
        s = _as_steps(step)
        factor = np.ones(s.shape)
        for boundary, scale in items:
            factor = factor * np.where(s >= boundary, float(scale), 1.0)
        return init_value * factor

    return lr


def schedule_exponential_decay(init_value, transition_steps, decay_rate, transition_begin=0,
                               staircase=False, end_value=None):
    """Exponential decay (``optax.exponential_decay``, TensorFlow's definition).

    ``init_value * decay_rate ** ((step - B) / T)`` after step
    ``B = max(transition_begin, 0)``, `init_value` before; the exponent is
    rounded down when `staircase`; `end_value` bounds the result (from below
    when ``decay_rate < 1``, from above otherwise). ``T <= 0`` or
    ``decay_rate == 0``: a constant `init_value`.
    """
    begin = max(int(transition_begin), 0)

    def lr(step):
        s = _as_steps(step)
        if transition_steps <= 0 or decay_rate == 0:
            return np.full(s.shape, float(init_value))
        exponent = (s - begin) / transition_steps
        if staircase:
            exponent = np.floor(exponent)
        value = np.where(s > begin, init_value * float(decay_rate) ** exponent, init_value)
        if end_value is not None:
            value = (np.maximum(value, end_value) if decay_rate < 1
                     else np.minimum(value, end_value))
        return value

    return lr


def schedule_linear_scaling(base_lr, base_batch_size, batch_size):
    """Goyal et al. (2017): ``lr = base_lr * batch_size / base_batch_size``.

    `base_lr` is a number (the scaled number is returned) or a reference
    schedule (a scaled schedule is returned).
    """
    factor = batch_size / base_batch_size
    if callable(base_lr):
        return lambda step: base_lr(step) * factor
    return base_lr * factor
