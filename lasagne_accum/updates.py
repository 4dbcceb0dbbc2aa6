"""Lasagne's update rules on PyTensor.

Every rule builds graph and returns an :class:`~collections.OrderedDict`
mapping each shared variable (parameters and the rule's state) to its new
value; compile it with ``pytensor.function(inputs, outputs, updates=...)``.
Signatures, defaults and formulas are Lasagne's, so a script written for
``lasagne.updates`` only changes its import.

Four additions, all optional:

* ``learning_rate`` may be a schedule, a callable of the optimizer step (see
  :mod:`lasagne_accum.schedules`): the rule then owns an int64 counter
  ``<rule>.schedule_step`` that advances once per optimizer step (per apply
  call in the two-function form, per stepping call with ``average=N``).
* ``average=N`` (every loss-based rule): the dictionary accumulates the
  gradients of N calls and steps on every N-th call only, in one compiled
  function (see :func:`lasagne_accum.with_accumulated_gradients`).
* Calling a rule with neither `loss_or_grads` nor `params` returns a partial
  of it with the given hyperparameters (the PyMC convention), to hand to
  another function as ``update_rule``.
* Dtypes are kept: a float32 model compiles to float32 updates under
  PyTensor's default ``floatX=float64``. A float16 parameter is updated in
  float32 (float32 state, the result cast back): float16 cannot hold Adam's
  epsilon or small squared gradients. PyTensor's Numba backend cannot compile
  float16 at all; compile float16 models with ``mode="CVM"``.
* Step counters (``adam.t``) are int64 whatever the parameters' dtype.
* ``name=`` on every rule replaces the rule's name in its state's names
  (``W.enc_m``, ``enc.t``), so several optimizers in one graph get stable names.
* Given ``accu.grads`` of :func:`lasagne_accum.accumulate_gradients`, a rule
  guards its updates: an apply on an empty window changes nothing.
* A misspelled keyword gets a suggestion (``lr=`` -> ``learning_rate=``).

The functions `norm_constraint`, `total_norm_constraint` and
`get_or_compute_grads` are re-exported here as in Lasagne.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections import OrderedDict
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Concatenate, ParamSpec, TypeVar, cast

import numpy as np
import pytensor.tensor as pt

from .constraints import norm_constraint, total_norm_constraint
from .grads import (
    accumulator_dtype,
    check_every,
    check_params,
    get_or_compute_grads,
    hyperparameter,
    param_label,
    scalar_state,
    state_like,
)

if TYPE_CHECKING:
    from ._typing import (
        Exclude,
        LearningRate,
        LossOrGrads,
        LossRule,
        Params,
        Scalar,
        Updates,
        UpdatesLike,
    )

_F = TypeVar("_F", bound=Callable[..., Any])
_P = ParamSpec("_P")

__all__ = [
    "sgd",
    "momentum",
    "nesterov_momentum",
    "apply_momentum",
    "apply_nesterov_momentum",
    "adagrad",
    "rmsprop",
    "adadelta",
    "adam",
    "adamax",
    "amsgrad",
    "get_or_compute_grads",
    "norm_constraint",
    "total_norm_constraint",
]


def _build(rule, core, loss_or_grads, params, average, weight, hyper):
    """Shared front end of every loss-based rule.

    Returns a partial of `rule` when both `loss_or_grads` and `params` are
    omitted, routes ``average > 1`` to the accumulating wrapper, and otherwise
    checks the inputs and calls ``core(grads, params, **hyper)``. `hyper`
    holds the rule's hyperparameters and its ``name``.

    When `loss_or_grads` is the ``.grads`` of an :func:`accumulate_gradients`
    result, the rule's updates are guarded (:meth:`Accumulation.guard`): an
    apply function built from them changes nothing on an empty window.
    """
    if loss_or_grads is None and params is None:
        extra = {} if (average == 1 and weight is None) else {"average": average, "weight": weight}
        if hyper.get("name") is None:
            hyper = {k: v for k, v in hyper.items() if k != "name"}
        return partial(rule, **hyper, **extra)
    if loss_or_grads is None or params is None:
        missing = "loss_or_grads" if loss_or_grads is None else "params"
        raise ValueError(
            f"{rule.__name__}() got no {missing}: pass both loss_or_grads and params, "
            "or neither to get a partial of the rule with these hyperparameters"
        )
    every = check_every(average)
    if every > 1:
        return _accumulated(rule, loss_or_grads, params, every, weight, hyper)
    if weight is not None:
        raise ValueError(
            f"{rule.__name__}(): weight only applies with average > 1 "
            "(it weights each call's gradient in the accumulated mean)"
        )
    params = check_params(params)
    grads = get_or_compute_grads(loss_or_grads, params)
    updates = _with_schedule(rule, core, grads, params, hyper)  # a callable learning_rate
    # accu.grads of the two-function form: no step on an empty window
    accumulation = getattr(loss_or_grads, "accumulation", None)
    return updates if accumulation is None else accumulation.guard(updates)


_KEYWORD_ALIASES = {"lr": "learning_rate", "eta": "learning_rate", "eps": "epsilon",
                    "beta_1": "beta1", "beta_2": "beta2", "b1": "beta1", "b2": "beta2",
                    "mu": "momentum", "decay": "rho", "every": "average", "n": "average"}


def _rule(fn: _F) -> _F:
    """Mark a public rule: an unknown keyword gets a suggestion (``lr`` -> ``learning_rate``)."""
    known = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for key in kwargs:
            if key not in known:
                guess = _KEYWORD_ALIASES.get(key)
                if guess not in known:
                    close = difflib.get_close_matches(key, known, n=1)
                    guess = close[0] if close else None
                hint = (f"did you mean {guess}=?" if guess
                        else f"its keywords are {', '.join(known)}")
                raise TypeError(
                    f"{fn.__name__}() got an unexpected keyword argument '{key}'; {hint}"
                )
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]  # functools.wraps keeps the signature


def _loss_rule(
    fn: Callable[Concatenate[LossOrGrads | None, Params | None, _P],
                 Updates | Callable[..., Updates]],
) -> LossRule[_P]:
    """:func:`_rule` for a loss-based rule, typed by its hyperparameters.

    Type checkers see :class:`~lasagne_accum._typing.LossRule`: the updates
    when called with `loss_or_grads` and `params`, a partial without them.
    """
    return cast("LossRule[_P]", _rule(fn))


def _state_suffix(name, default, what):
    """``W.<suffix>``: ``adam_m`` by default, ``enc_m`` with ``name="enc"``."""
    if name is None:
        return f"{default}_{what}"
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    return f"{name}_{what}"


def _compute_dtype(param):
    """dtype of a rule's arithmetic and state: the param's, float32 for float16.

    float16 has too little range and precision for optimizer state (Adam's
    epsilon 1e-8 is 0 in float16, its squared gradients underflow), so a
    float16 parameter is updated in float32 and the result cast back.
    """
    return accumulator_dtype(param.type.dtype)


def _require(value, name, rule):
    if value is None:
        raise TypeError(f"{rule}() missing required argument: '{name}'")
    return value


def _timestep_dtype(params):
    """dtype of the bias-correction arithmetic: float32 for float16/32 models, else float64.

    The step counter itself is an int64 (``adam.t``), cast to this dtype where used.
    """
    if not params:
        return "float64"
    return np.result_type(*[accumulator_dtype(p.type.dtype) for p in params]).name


def _cast(x, dtype):
    return x if x.type.dtype == dtype else pt.cast(x, dtype)


# --------------------------------------------------------------------------- sgd


def _sgd(grads, params, learning_rate, name=None, cast_back=True):
    _require(learning_rate, "learning_rate", "sgd")
    _state_suffix(name, "sgd", "")  # sgd has no state; the name is checked all the same
    updates = OrderedDict()
    for param, grad in zip(params, grads):
        dtype = _compute_dtype(param)
        lr = hyperparameter(learning_rate, "learning_rate", dtype, low=0)
        new = _cast(param, dtype) - lr * _cast(grad, dtype)
        # momentum adds its velocity to the float32 value of a float16 param
        updates[param] = _cast(new, param.type.dtype) if cast_back else new
    return updates


@_loss_rule
def sgd(
    loss_or_grads: LossOrGrads | None = None,
    params: Params | None = None,
    learning_rate: LearningRate | None = None,
    *,
    average: int = 1,
    weight: Scalar | None = None,
    name: str | None = None,
) -> Updates | Callable[..., Updates]:
    """Stochastic Gradient Descent (SGD) updates.

    * ``param := param - learning_rate * gradient``

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to generate update expressions for.
    learning_rate : float or symbolic scalar
        The learning rate controlling the size of update steps (required).
    average : int
        Accumulate the mean gradient of this many calls and step on every
        `average`-th call only (default 1: step every call).
    weight : symbolic scalar, optional
        With ``average > 1``: this call's weight in the mean (for example the
        batch size), so that batches of different sizes average exactly.
    name : str, optional
        Accepted for uniformity with the other rules (SGD has no state).

    Returns
    -------
    OrderedDict
        A dictionary mapping each parameter to its update expression.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([1.0, 2.0]), name="w")
    >>> step = pytensor.function([], [], updates=sgd((w ** 2).sum(), [w], 0.25))
    >>> _ = step()
    >>> w.get_value()
    array([0.5, 1. ])
    """
    return _build(sgd, _sgd, loss_or_grads, params, average, weight,
                  dict(learning_rate=learning_rate, name=name))


# ---------------------------------------------------------------------- momentum


def _updated(updates, params, rule):
    updates = OrderedDict(updates)
    params = list(updates.keys()) if params is None else check_params(params)
    for i, param in enumerate(params):
        if param not in updates:
            raise ValueError(
                f"{rule}(): params[{i}] ({param_label(param, i)}) has no entry in updates"
            )
    return updates, params


@_rule
def apply_momentum(
    updates: UpdatesLike,
    params: Params | None = None,
    momentum: Scalar = 0.9,
    *,
    name: str | None = None,
) -> Updates:
    """Return a modified update dictionary including momentum.

    Generates update expressions of the form:

    * ``velocity := momentum * velocity + updates[param] - param``
    * ``param := param + velocity``

    Parameters
    ----------
    updates : OrderedDict
        A dictionary mapping parameters to update expressions.
    params : iterable of shared variables, optional
        The variables to apply momentum to. If omitted, all keys of `updates`.
    momentum : float or symbolic scalar
        The amount of momentum to apply. Higher momentum results in smoothing
        over more update steps. Default 0.9.
    name : str, optional
        Replaces ``momentum`` in the velocities' names (``W.enc_velocity``
        with ``name="enc"``; default ``W.momentum_velocity``).

    Returns
    -------
    OrderedDict
        A copy of `updates` with momentum updates for all `params`.

    Notes
    -----
    Higher momentum also results in larger update steps. To counter that, you
    can optionally scale your learning rate by ``1 - momentum``.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([1.0]), name="w")
    >>> upd = apply_momentum(sgd((w ** 2).sum(), [w], 0.1), momentum=0.5)
    >>> [v.name for v in upd]
    ['w', 'w.momentum_velocity']
    """
    result, params = _updated(updates, params, "apply_momentum")
    suffix = _state_suffix(name, "momentum", "velocity")
    for i, param in enumerate(params):
        dtype = _compute_dtype(param)
        mom = hyperparameter(momentum, "momentum", dtype, low=0, high=1)
        velocity = state_like(param, suffix, i, dtype=dtype)
        x = mom * velocity + _cast(pt.as_tensor_variable(result[param]), dtype)
        result[velocity] = x - _cast(param, dtype)
        result[param] = _cast(x, param.type.dtype)
    return result


@_loss_rule
def momentum(
    loss_or_grads: LossOrGrads | None = None,
    params: Params | None = None,
    learning_rate: LearningRate | None = None,
    momentum: Scalar = 0.9,
    *,
    average: int = 1,
    weight: Scalar | None = None,
    name: str | None = None,
) -> Updates | Callable[..., Updates]:
    """Stochastic Gradient Descent (SGD) updates with momentum.

    * ``velocity := momentum * velocity - learning_rate * gradient``
    * ``param := param + velocity``

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to generate update expressions for.
    learning_rate : float or symbolic scalar
        The learning rate controlling the size of update steps (required).
    momentum : float or symbolic scalar
        The amount of momentum to apply. Higher momentum results in smoothing
        over more update steps. Default 0.9.
    average : int
        Accumulate the mean gradient of this many calls and step on every
        `average`-th call only (default 1). ``momentum(loss, params, lr,
        momentum=0.999, average=5)`` is the seed discussion's call.
    weight : symbolic scalar, optional
        With ``average > 1``: this call's weight in the mean.
    name : str, optional
        Replaces the rule's name in its state variables' names (``W.enc_m``,
        ``enc.t`` with ``name="enc"``), so that two optimizers in one graph get
        stable names; default: the rule's name (``W.adam_m``, ``adam.t``).

    Returns
    -------
    OrderedDict
        A dictionary mapping each parameter and its velocity to its update.

    See Also
    --------
    apply_momentum : Generic function applying momentum to updates.
    nesterov_momentum : Nesterov's variant of SGD with momentum.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([1.0]), name="w")
    >>> f = pytensor.function([], [], updates=momentum((w ** 2).sum(), [w], 0.1, 0.5))
    >>> _ = f(); _ = f()
    >>> w.get_value()  # 1 - 0.2 = 0.8, then 0.8 + 0.5 * (-0.2) - 0.16 = 0.54
    array([0.54])
    """
    return _build(_momentum_public, _momentum, loss_or_grads, params, average, weight,
                  dict(learning_rate=learning_rate, momentum=momentum, name=name))


def _momentum(grads, params, learning_rate, momentum, name=None):
    _require(learning_rate, "learning_rate", "momentum")
    return apply_momentum(_sgd(grads, params, learning_rate, cast_back=False), params, momentum,
                          name=name)


_momentum_public = momentum


@_rule
def apply_nesterov_momentum(
    updates: UpdatesLike,
    params: Params | None = None,
    momentum: Scalar = 0.9,
    *,
    name: str | None = None,
) -> Updates:
    """Return a modified update dictionary including Nesterov momentum.

    Generates update expressions of the form:

    * ``velocity := momentum * velocity + updates[param] - param``
    * ``param := param + momentum * velocity + updates[param] - param``

    Parameters
    ----------
    updates : OrderedDict
        A dictionary mapping parameters to update expressions.
    params : iterable of shared variables, optional
        The variables to apply momentum to. If omitted, all keys of `updates`.
    momentum : float or symbolic scalar
        The amount of momentum to apply. Default 0.9.
    name : str, optional
        Replaces ``momentum`` in the velocities' names (``W.enc_velocity``
        with ``name="enc"``; default ``W.momentum_velocity``).

    Returns
    -------
    OrderedDict
        A copy of `updates` with Nesterov momentum for all `params`.

    Notes
    -----
    As in Lasagne, this uses the formulation of Bengio et al. [1]_ in which
    the parameter holds the "look-ahead" value, so the gradient is always
    taken at the current parameter.

    References
    ----------
    .. [1] Bengio, Y., Boulanger-Lewandowski, N. & Pascanu, R. (2013):
       Advances in optimizing recurrent networks. ICASSP 2013, 8624-8628.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([1.0]), name="w")
    >>> upd = apply_nesterov_momentum(sgd((w ** 2).sum(), [w], 0.1), momentum=0.5)
    >>> [v.name for v in upd]
    ['w', 'w.momentum_velocity']
    """
    result, params = _updated(updates, params, "apply_nesterov_momentum")
    suffix = _state_suffix(name, "momentum", "velocity")
    for i, param in enumerate(params):
        dtype = _compute_dtype(param)
        mom = hyperparameter(momentum, "momentum", dtype, low=0, high=1)
        velocity = state_like(param, suffix, i, dtype=dtype)
        new = _cast(pt.as_tensor_variable(result[param]), dtype)
        x = mom * velocity + new - _cast(param, dtype)
        result[velocity] = x
        result[param] = _cast(mom * x + new, param.type.dtype)
    return result


@_loss_rule
def nesterov_momentum(
    loss_or_grads: LossOrGrads | None = None,
    params: Params | None = None,
    learning_rate: LearningRate | None = None,
    momentum: Scalar = 0.9,
    *,
    average: int = 1,
    weight: Scalar | None = None,
    name: str | None = None,
) -> Updates | Callable[..., Updates]:
    """Stochastic Gradient Descent (SGD) updates with Nesterov momentum.

    * ``velocity := momentum * velocity - learning_rate * gradient``
    * ``param := param + momentum * velocity - learning_rate * gradient``

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to generate update expressions for.
    learning_rate : float or symbolic scalar
        The learning rate controlling the size of update steps (required).
    momentum : float or symbolic scalar
        The amount of momentum to apply. Default 0.9.
    average : int
        Accumulate the mean gradient of this many calls and step on every
        `average`-th call only (default 1).
    weight : symbolic scalar, optional
        With ``average > 1``: this call's weight in the mean.
    name : str, optional
        Replaces the rule's name in its state variables' names (``W.enc_m``,
        ``enc.t`` with ``name="enc"``), so that two optimizers in one graph get
        stable names; default: the rule's name (``W.adam_m``, ``adam.t``).

    Returns
    -------
    OrderedDict
        A dictionary mapping each parameter and its velocity to its update.

    Notes
    -----
    See :func:`apply_nesterov_momentum` for the formulation.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([1.0]), name="w")
    >>> f = pytensor.function([], [], updates=nesterov_momentum((w ** 2).sum(), [w], 0.1, 0.5))
    >>> _ = f()
    >>> w.get_value()  # 1 + 0.5 * (-0.2) - 0.2
    array([0.7])
    """
    return _build(_nesterov_public, _nesterov, loss_or_grads, params, average, weight,
                  dict(learning_rate=learning_rate, momentum=momentum, name=name))


def _nesterov(grads, params, learning_rate, momentum, name=None):
    _require(learning_rate, "learning_rate", "nesterov_momentum")
    return apply_nesterov_momentum(_sgd(grads, params, learning_rate, cast_back=False), params,
                                   momentum, name=name)


_nesterov_public = nesterov_momentum


# ------------------------------------------------------------ adaptive rates


def _adagrad(grads, params, learning_rate, epsilon, name=None):
    updates = OrderedDict()
    suffix = _state_suffix(name, "adagrad", "accu")
    for i, (param, grad) in enumerate(zip(params, grads)):
        dtype = _compute_dtype(param)
        grad = _cast(grad, dtype)
        lr = hyperparameter(learning_rate, "learning_rate", dtype, low=0)
        eps = hyperparameter(epsilon, "epsilon", dtype, low=0)
        accu = state_like(param, suffix, i, dtype=dtype)
        accu_new = accu + grad ** 2
        updates[accu] = accu_new
        new = _cast(param, dtype) - (lr * grad / pt.sqrt(accu_new + eps))
        updates[param] = _cast(new, param.type.dtype)
    return updates


@_loss_rule
def adagrad(
    loss_or_grads: LossOrGrads | None = None,
    params: Params | None = None,
    learning_rate: LearningRate = 1.0,
    epsilon: Scalar = 1e-6,
    *,
    average: int = 1,
    weight: Scalar | None = None,
    name: str | None = None,
) -> Updates | Callable[..., Updates]:
    """Adagrad updates.

    Scale learning rates by dividing with the square root of accumulated
    squared gradients. See [1]_ for further description.

    * ``accu := accu + gradient ** 2``
    * ``param := param - learning_rate * gradient / sqrt(accu + epsilon)``

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to generate update expressions for.
    learning_rate : float or symbolic scalar
        The learning rate controlling the size of update steps. Default 1.0,
        Lasagne's; Adagrad's effective step shrinks by itself.
    epsilon : float or symbolic scalar
        Small value added for numerical stability (inside the square root, as
        in Lasagne). Default 1e-6.
    average : int
        Accumulate the mean gradient of this many calls and step on every
        `average`-th call only (default 1).
    weight : symbolic scalar, optional
        With ``average > 1``: this call's weight in the mean.
    name : str, optional
        Replaces the rule's name in its state variables' names (``W.enc_m``,
        ``enc.t`` with ``name="enc"``), so that two optimizers in one graph get
        stable names; default: the rule's name (``W.adam_m``, ``adam.t``).

    Returns
    -------
    OrderedDict
        A dictionary mapping each parameter and its accumulator to its update.

    Notes
    -----
    Using step size eta Adagrad calculates the learning rate for feature i at
    time step t as ``eta / sqrt(sum_{t'<=t} g_{t',i} ** 2 + epsilon)``, so the
    learning rate is monotonically decreasing.

    References
    ----------
    .. [1] Duchi, J., Hazan, E. & Singer, Y. (2011): Adaptive subgradient
       methods for online learning and stochastic optimization. JMLR 12,
       2121-2159.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([1.0]), name="w")
    >>> f = pytensor.function([], [], updates=adagrad((w ** 2).sum(), [w], 0.1, epsilon=0.0))
    >>> _ = f()
    >>> w.get_value()  # 1 - 0.1 * 2 / sqrt(4)
    array([0.9])
    """
    return _build(adagrad, _adagrad, loss_or_grads, params, average, weight,
                  dict(learning_rate=learning_rate, epsilon=epsilon, name=name))


def _rmsprop(grads, params, learning_rate, rho, epsilon, name=None):
    updates = OrderedDict()
    suffix = _state_suffix(name, "rmsprop", "accu")
    for i, (param, grad) in enumerate(zip(params, grads)):
        dtype = _compute_dtype(param)
        grad = _cast(grad, dtype)
        lr = hyperparameter(learning_rate, "learning_rate", dtype, low=0)
        r = hyperparameter(rho, "rho", dtype, low=0, high=1)
        eps = hyperparameter(epsilon, "epsilon", dtype, low=0)
        accu = state_like(param, suffix, i, dtype=dtype)
        accu_new = r * accu + (1 - r) * grad ** 2
        updates[accu] = accu_new
        new = _cast(param, dtype) - (lr * grad / pt.sqrt(accu_new + eps))
        updates[param] = _cast(new, param.type.dtype)
    return updates


@_loss_rule
def rmsprop(
    loss_or_grads: LossOrGrads | None = None,
    params: Params | None = None,
    learning_rate: LearningRate = 1.0,
    rho: Scalar = 0.9,
    epsilon: Scalar = 1e-6,
    *,
    average: int = 1,
    weight: Scalar | None = None,
    name: str | None = None,
) -> Updates | Callable[..., Updates]:
    """RMSProp updates.

    Scale learning rates by dividing with the moving average of the root mean
    squared (RMS) gradients. See [1]_ for further description.

    * ``accu := rho * accu + (1 - rho) * gradient ** 2``
    * ``param := param - learning_rate * gradient / sqrt(accu + epsilon)``

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to generate update expressions for.
    learning_rate : float or symbolic scalar
        The learning rate controlling the size of update steps. Default 1.0
        (Lasagne's).
    rho : float or symbolic scalar
        Gradient moving average decay factor, in [0, 1]. Default 0.9.
    epsilon : float or symbolic scalar
        Small value added for numerical stability, inside the square root.
        Default 1e-6.
    average : int
        Accumulate the mean gradient of this many calls and step on every
        `average`-th call only (default 1).
    weight : symbolic scalar, optional
        With ``average > 1``: this call's weight in the mean.
    name : str, optional
        Replaces the rule's name in its state variables' names (``W.enc_m``,
        ``enc.t`` with ``name="enc"``), so that two optimizers in one graph get
        stable names; default: the rule's name (``W.adam_m``, ``adam.t``).

    Returns
    -------
    OrderedDict
        A dictionary mapping each parameter and its accumulator to its update.

    Notes
    -----
    `rho` should be between 0 and 1. A value of `rho` close to 1 will decay
    the moving average slowly and a value close to 0 will decay the moving
    average fast.

    References
    ----------
    .. [1] Tieleman, T. & Hinton, G. (2012): Neural Networks for Machine
       Learning, Lecture 6.5 - rmsprop. Coursera.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([1.0]), name="w")
    >>> f = pytensor.function([], [], updates=rmsprop((w ** 2).sum(), [w], 0.1, 0.75, 0.0))
    >>> _ = f()
    >>> w.get_value()  # 1 - 0.1 * 2 / sqrt(0.25 * 4)
    array([0.8])
    """
    return _build(rmsprop, _rmsprop, loss_or_grads, params, average, weight,
                  dict(learning_rate=learning_rate, rho=rho, epsilon=epsilon, name=name))


def _adadelta(grads, params, learning_rate, rho, epsilon, name=None):
    updates = OrderedDict()
    suffix = _state_suffix(name, "adadelta", "accu")
    delta_suffix = _state_suffix(name, "adadelta", "delta_accu")
    for i, (param, grad) in enumerate(zip(params, grads)):
        dtype = _compute_dtype(param)
        grad = _cast(grad, dtype)
        lr = hyperparameter(learning_rate, "learning_rate", dtype, low=0)
        r = hyperparameter(rho, "rho", dtype, low=0, high=1)
        eps = hyperparameter(epsilon, "epsilon", dtype, low=0)
        accu = state_like(param, suffix, i, dtype=dtype)
        delta_accu = state_like(param, delta_suffix, i, dtype=dtype)
        accu_new = r * accu + (1 - r) * grad ** 2
        updates[accu] = accu_new
        update = grad * pt.sqrt(delta_accu + eps) / pt.sqrt(accu_new + eps)
        updates[param] = _cast(_cast(param, dtype) - lr * update, param.type.dtype)
        updates[delta_accu] = r * delta_accu + (1 - r) * update ** 2
    return updates


@_loss_rule
def adadelta(
    loss_or_grads: LossOrGrads | None = None,
    params: Params | None = None,
    learning_rate: LearningRate = 1.0,
    rho: Scalar = 0.95,
    epsilon: Scalar = 1e-6,
    *,
    average: int = 1,
    weight: Scalar | None = None,
    name: str | None = None,
) -> Updates | Callable[..., Updates]:
    """Adadelta updates.

    Scale learning rates by the ratio of accumulated gradients to accumulated
    updates, see [1]_ and Notes for further description.

    * ``accu := rho * accu + (1 - rho) * gradient ** 2``
    * ``update = gradient * sqrt(delta_accu + epsilon) / sqrt(accu + epsilon)``
    * ``param := param - learning_rate * update``
    * ``delta_accu := rho * delta_accu + (1 - rho) * update ** 2``

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to generate update expressions for.
    learning_rate : float or symbolic scalar
        The learning rate controlling the size of update steps. Default 1.0,
        as in the paper: Adadelta sets its own step size.
    rho : float or symbolic scalar
        Squared gradient moving average decay factor, in [0, 1]. Default 0.95.
    epsilon : float or symbolic scalar
        Small value added for numerical stability. Default 1e-6.
    average : int
        Accumulate the mean gradient of this many calls and step on every
        `average`-th call only (default 1).
    weight : symbolic scalar, optional
        With ``average > 1``: this call's weight in the mean.
    name : str, optional
        Replaces the rule's name in its state variables' names (``W.enc_m``,
        ``enc.t`` with ``name="enc"``), so that two optimizers in one graph get
        stable names; default: the rule's name (``W.adam_m``, ``adam.t``).

    Returns
    -------
    OrderedDict
        A dictionary mapping each parameter and its two accumulators to their
        updates.

    Notes
    -----
    rho should be between 0 and 1. A value of rho close to 1 will decay the
    moving average slowly and a value close to 0 will decay the moving
    average fast. rho = 0.95 and epsilon = 1e-6 are suggested in the paper
    and reported to work for multiple datasets (MNIST, speech). In the paper,
    no learning rate is considered (so learning_rate=1.0).

    References
    ----------
    .. [1] Zeiler, M. D. (2012): ADADELTA: An Adaptive Learning Rate Method.
       arXiv:1212.5701.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([1.0]), name="w")
    >>> upd = adadelta((w ** 2).sum(), [w])
    >>> [v.name for v in upd]
    ['w.adadelta_accu', 'w', 'w.adadelta_delta_accu']
    """
    return _build(adadelta, _adadelta, loss_or_grads, params, average, weight,
                  dict(learning_rate=learning_rate, rho=rho, epsilon=epsilon, name=name))


# ------------------------------------------------------------ adam family


def _adam_family(grads, params, learning_rate, beta1, beta2, epsilon, kind, name=None):
    """Adam, Adamax and AMSGrad share a timestep and the first moment."""
    prefix = kind if name is None else name
    _state_suffix(name, kind, "m")  # checks name
    t_dtype = _timestep_dtype(params)
    # An int64 step counter: a float32 one stops counting at 2**24 steps.
    t_prev = scalar_state(f"{prefix}.t", "int64")
    one = pt.constant(np.asarray(1, dtype=t_dtype))
    t_next = t_prev + np.int64(1)
    t = pt.cast(t_next, t_dtype)
    lr_t = hyperparameter(learning_rate, "learning_rate", t_dtype, low=0)
    b1_t = hyperparameter(beta1, "beta1", t_dtype, low=0, high=1, high_open=True)
    b2_t = hyperparameter(beta2, "beta2", t_dtype, low=0, high=1)
    if kind == "adamax":
        a_t = lr_t / (one - b1_t ** t)
    else:
        a_t = lr_t * pt.sqrt(one - b2_t ** t) / (one - b1_t ** t)

    updates = OrderedDict()
    for i, (param, g_t) in enumerate(zip(params, grads)):
        dtype = _compute_dtype(param)
        g_t = _cast(g_t, dtype)
        b1 = hyperparameter(beta1, "beta1", dtype)
        b2 = hyperparameter(beta2, "beta2", dtype)
        eps = hyperparameter(epsilon, "epsilon", dtype, low=0)
        a = _cast(a_t, dtype)
        m_prev = state_like(param, f"{prefix}_m", i, dtype=dtype)
        m_t = b1 * m_prev + (1 - b1) * g_t
        updates[m_prev] = m_t
        if kind == "adamax":
            u_prev = state_like(param, f"{prefix}_u", i, dtype=dtype)
            u_t = pt.maximum(b2 * u_prev, abs(g_t))
            updates[u_prev] = u_t
            step = a * m_t / (u_t + eps)
        else:
            v_prev = state_like(param, f"{prefix}_v", i, dtype=dtype)
            v_t = b2 * v_prev + (1 - b2) * g_t ** 2
            updates[v_prev] = v_t
            if kind == "amsgrad":
                v_hat_prev = state_like(param, f"{prefix}_vhat", i, dtype=dtype)
                v_t = pt.maximum(v_hat_prev, v_t)
                updates[v_hat_prev] = v_t
            step = a * m_t / (pt.sqrt(v_t) + eps)
        updates[param] = _cast(_cast(param, dtype) - step, param.type.dtype)
    updates[t_prev] = t_next
    return updates


def _adam(grads, params, learning_rate, beta1, beta2, epsilon, name=None):
    return _adam_family(grads, params, learning_rate, beta1, beta2, epsilon, "adam", name)


def _adamax(grads, params, learning_rate, beta1, beta2, epsilon, name=None):
    return _adam_family(grads, params, learning_rate, beta1, beta2, epsilon, "adamax", name)


def _amsgrad(grads, params, learning_rate, beta1, beta2, epsilon, name=None):
    return _adam_family(grads, params, learning_rate, beta1, beta2, epsilon, "amsgrad", name)


@_loss_rule
def adam(
    loss_or_grads: LossOrGrads | None = None,
    params: Params | None = None,
    learning_rate: LearningRate = 0.001,
    beta1: Scalar = 0.9,
    beta2: Scalar = 0.999,
    epsilon: Scalar = 1e-8,
    *,
    average: int = 1,
    weight: Scalar | None = None,
    name: str | None = None,
) -> Updates | Callable[..., Updates]:
    """Adam updates.

    Adam updates implemented as in [1]_:

    * ``t := t + 1``
    * ``a_t = learning_rate * sqrt(1 - beta2 ** t) / (1 - beta1 ** t)``
    * ``m := beta1 * m + (1 - beta1) * gradient``
    * ``v := beta2 * v + (1 - beta2) * gradient ** 2``
    * ``param := param - a_t * m / (sqrt(v) + epsilon)``

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to generate update expressions for.
    learning_rate : float or symbolic scalar
        Learning rate. Default 0.001, the paper's.
    beta1 : float or symbolic scalar
        Exponential decay rate for the first moment estimates, in [0, 1).
        Default 0.9.
    beta2 : float or symbolic scalar
        Exponential decay rate for the second moment estimates, in [0, 1].
        Default 0.999.
    epsilon : float or symbolic scalar
        Constant for numerical stability, added outside the square root (as
        in the paper's section 2 and Lasagne). Default 1e-8.
    average : int
        Accumulate the mean gradient of this many calls and step on every
        `average`-th call only (default 1); the timestep then counts steps.
    weight : symbolic scalar, optional
        With ``average > 1``: this call's weight in the mean.
    name : str, optional
        Replaces the rule's name in its state variables' names (``W.enc_m``,
        ``enc.t`` with ``name="enc"``), so that two optimizers in one graph get
        stable names; default: the rule's name (``W.adam_m``, ``adam.t``).

    Returns
    -------
    OrderedDict
        A dictionary mapping each parameter and its moments to their updates;
        the shared timestep ``adam.t`` comes last.

    Notes
    -----
    The paper [1]_ includes an additional hyperparameter lambda. This is only
    needed to prove convergence of the algorithm and has no practical use
    (personal communication with the authors), it is therefore omitted here.
    The bias correction is folded into the step size ``a_t`` (the paper's
    efficient form), which is why epsilon acts on the uncorrected ``sqrt(v)``.

    References
    ----------
    .. [1] Kingma, D. P. & Ba, J. L. (2015): Adam: A Method for Stochastic
       Optimization. ICLR 2015. arXiv:1412.6980.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([1.0, -1.0]), name="w")
    >>> f = pytensor.function([], [], updates=adam((w ** 2).sum(), [w], 0.1))
    >>> _ = f()
    >>> w.get_value().round(6)  # the first step has size learning_rate
    array([ 0.9, -0.9])
    """
    return _build(adam, _adam, loss_or_grads, params, average, weight,
                  dict(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon, name=name))


@_loss_rule
def adamax(
    loss_or_grads: LossOrGrads | None = None,
    params: Params | None = None,
    learning_rate: LearningRate = 0.002,
    beta1: Scalar = 0.9,
    beta2: Scalar = 0.999,
    epsilon: Scalar = 1e-8,
    *,
    average: int = 1,
    weight: Scalar | None = None,
    name: str | None = None,
) -> Updates | Callable[..., Updates]:
    """Adamax updates.

    Adamax updates implemented as in [1]_. This is a variant of the Adam
    algorithm based on the infinity norm.

    * ``t := t + 1``
    * ``a_t = learning_rate / (1 - beta1 ** t)``
    * ``m := beta1 * m + (1 - beta1) * gradient``
    * ``u := max(beta2 * u, abs(gradient))``
    * ``param := param - a_t * m / (u + epsilon)``

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to generate update expressions for.
    learning_rate : float or symbolic scalar
        Learning rate. Default 0.002, the paper's.
    beta1 : float or symbolic scalar
        Exponential decay rate for the first moment estimates, in [0, 1).
        Default 0.9.
    beta2 : float or symbolic scalar
        Exponential decay rate for the weighted infinity norm estimates, in
        [0, 1]. Default 0.999.
    epsilon : float or symbolic scalar
        Constant for numerical stability. Default 1e-8.
    average : int
        Accumulate the mean gradient of this many calls and step on every
        `average`-th call only (default 1). ``adamax(loss, params,
        average=5)`` is the seed discussion's call.
    weight : symbolic scalar, optional
        With ``average > 1``: this call's weight in the mean.
    name : str, optional
        Replaces the rule's name in its state variables' names (``W.enc_m``,
        ``enc.t`` with ``name="enc"``), so that two optimizers in one graph get
        stable names; default: the rule's name (``W.adam_m``, ``adam.t``).

    Returns
    -------
    OrderedDict
        A dictionary mapping each parameter and its moments to their updates;
        the shared timestep ``adamax.t`` comes last.

    References
    ----------
    .. [1] Kingma, D. P. & Ba, J. L. (2015): Adam: A Method for Stochastic
       Optimization. ICLR 2015. arXiv:1412.6980.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([1.0, -1.0]), name="w")
    >>> f = pytensor.function([], [], updates=adamax((w ** 2).sum(), [w], 0.1))
    >>> _ = f()
    >>> w.get_value().round(6)
    array([ 0.9, -0.9])
    """
    return _build(adamax, _adamax, loss_or_grads, params, average, weight,
                  dict(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon, name=name))


@_loss_rule
def amsgrad(
    loss_or_grads: LossOrGrads | None = None,
    params: Params | None = None,
    learning_rate: LearningRate = 0.001,
    beta1: Scalar = 0.9,
    beta2: Scalar = 0.999,
    epsilon: Scalar = 1e-8,
    *,
    average: int = 1,
    weight: Scalar | None = None,
    name: str | None = None,
) -> Updates | Callable[..., Updates]:
    """AMSGrad updates.

    AMSGrad updates implemented as in [1]_: Adam with the maximum of all
    second moment estimates so far in the denominator.

    * ``t := t + 1``
    * ``a_t = learning_rate * sqrt(1 - beta2 ** t) / (1 - beta1 ** t)``
    * ``m := beta1 * m + (1 - beta1) * gradient``
    * ``v := beta2 * v + (1 - beta2) * gradient ** 2``
    * ``v_hat := max(v_hat, v)``
    * ``param := param - a_t * m / (sqrt(v_hat) + epsilon)``

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to generate update expressions for.
    learning_rate : float or symbolic scalar
        Learning rate. Default 0.001.
    beta1 : float or symbolic scalar
        Exponential decay rate for the first moment estimates, in [0, 1).
        Default 0.9.
    beta2 : float or symbolic scalar
        Exponential decay rate for the second moment estimates, in [0, 1].
        Default 0.999.
    epsilon : float or symbolic scalar
        Constant for numerical stability. Default 1e-8.
    average : int
        Accumulate the mean gradient of this many calls and step on every
        `average`-th call only (default 1).
    weight : symbolic scalar, optional
        With ``average > 1``: this call's weight in the mean.
    name : str, optional
        Replaces the rule's name in its state variables' names (``W.enc_m``,
        ``enc.t`` with ``name="enc"``), so that two optimizers in one graph get
        stable names; default: the rule's name (``W.adam_m``, ``adam.t``).

    Returns
    -------
    OrderedDict
        A dictionary mapping each parameter and its moments to their updates;
        the shared timestep ``amsgrad.t`` comes last.

    References
    ----------
    .. [1] Reddi, S. J., Kale, S. & Kumar, S. (2018): On the Convergence of
       Adam and Beyond. ICLR 2018.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([1.0]), name="w")
    >>> upd = amsgrad((w ** 2).sum(), [w])
    >>> [v.name for v in upd]
    ['w.amsgrad_m', 'w.amsgrad_v', 'w.amsgrad_vhat', 'w', 'amsgrad.t']
    """
    return _build(amsgrad, _amsgrad, loss_or_grads, params, average, weight,
                  dict(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon, name=name))


# ------------------------------------------------------------ large-batch rules
#
# adamw, lars and lamb (optax's definitions; optax is the reference their tests
# compare with), the schedule support of `_build` (a callable learning_rate),
# and the parameter exclusion (`exclude=`) the three rules share.

import numbers  # noqa: E402

from pytensor.compile.sharedvalue import SharedVariable  # noqa: E402
from pytensor.graph.basic import Variable  # noqa: E402

__all__ += ["adamw", "lars", "lamb"]


def _is_schedule(value):
    return callable(value) and not isinstance(value, Variable)


def _with_schedule(rule, core, grads, params, hyper):
    """Call ``core``; a callable learning_rate gets a step counter owned by the rule.

    The counter (int64 shared scalar ``<name>.schedule_step``, starting at 0)
    is the schedule's argument, and ``step := step + 1`` joins the rule's
    updates, so it advances exactly when the rule's updates are applied: once
    per apply call in the two-function form, once per stepping call with
    ``average=N`` (the updates sit behind the stepping select).
    """
    lr = hyper.get("learning_rate")
    rule_name = getattr(rule, "__name__", "rule")
    if lr is None or not _is_schedule(lr):
        if lr is not None and not isinstance(
                lr, (numbers.Real, np.number, np.ndarray, Variable)):
            raise TypeError(
                f"{rule_name}(): learning_rate must be a number, a symbolic scalar or a "
                "schedule (a callable of the optimizer step, see lasagne_accum.schedules), "
                f"got {type(lr).__name__}"
            )
        return core(grads, params, **hyper)
    prefix = hyper.get("name") or rule_name
    step = scalar_state(f"{prefix}.schedule_step", "int64")
    value = _evaluate_schedule(lr, step, rule_name)
    updates = core(grads, params, **dict(hyper, learning_rate=value))
    updates[step] = step + pt.constant(np.int64(1))
    return updates


def _accumulated(rule, loss_or_grads, params, every, weight, hyper):
    """The ``average=N`` form: the rule behind :func:`with_accumulated_gradients`.

    A rule's `name` goes to the rule (its state names) and prefixes the
    accumulation's counters (``x.count``; ``average.count`` without a name);
    it must not reach ``with_accumulated_gradients``' own `name` alone.
    """
    from .averaged import with_accumulated_gradients

    hyper = dict(hyper)
    name = hyper.pop("name", None)
    update_rule = rule if name is None else partial(rule, name=name)
    return with_accumulated_gradients(loss_or_grads, params, every, update_rule,
                                      weight=weight, name=name or "average", **hyper)


def _evaluate_schedule(schedule, step, rule_name):
    """``schedule(step)`` on the symbolic step, checked to be a scalar."""
    label = getattr(schedule, "__name__", None) or type(schedule).__name__
    try:
        value = schedule(step)
    except Exception as exc:
        raise TypeError(
            f"{rule_name}(): the learning_rate schedule {label} failed on the symbolic "
            f"int64 step ({type(exc).__name__}: {exc}); a schedule is called once, "
            "with a symbolic step, so build it from lasagne_accum.schedules or "
            "pytensor.tensor operations (pt.switch rather than if)"
        ) from exc
    if isinstance(value, (bool, np.bool_)) or value is None:
        raise TypeError(
            f"{rule_name}(): the learning_rate schedule {label} returned {value!r}; it must "
            "return a scalar (a number or a symbolic scalar)"
        )
    if isinstance(value, (numbers.Real, np.number)):
        return value
    if isinstance(value, np.ndarray) or isinstance(value, Variable):
        ndim = value.ndim if isinstance(value, np.ndarray) else getattr(value.type, "ndim", None)
        if ndim != 0:
            raise ValueError(
                f"{rule_name}(): the learning_rate schedule {label} returned a value with "
                f"{ndim} dimensions ({getattr(value, 'type', value.shape)}); it must return a "
                "scalar for a scalar step"
            )
        return value if isinstance(value, Variable) else value[()]
    raise TypeError(
        f"{rule_name}(): the learning_rate schedule {label} returned "
        f"{type(value).__name__}; it must return a scalar (a number or a symbolic scalar)"
    )


def _excluded(exclude, params, rule):
    """One bool per parameter: True where `exclude` names it."""
    if exclude is None:
        return [False] * len(params)
    if isinstance(exclude, SharedVariable):
        raise TypeError(
            f"{rule}(): exclude must be a list of parameters or a predicate, got the "
            f"single shared variable {param_label(exclude)}; wrap it in a list"
        )
    if callable(exclude):
        flags = []
        for i, p in enumerate(params):
            flag = exclude(p)
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(
                    f"{rule}(): exclude({param_label(p, i)}) returned "
                    f"{type(flag).__name__}; the predicate must return True or False"
                )
            flags.append(bool(flag))
        return flags
    if isinstance(exclude, (str, dict)) or not hasattr(exclude, "__iter__"):
        raise TypeError(
            f"{rule}(): exclude must be a list of parameters or a predicate on a shared "
            f"variable, got {type(exclude).__name__}"
        )
    position = {id(p): i for i, p in enumerate(params)}
    flags = [False] * len(params)
    for j, var in enumerate(exclude):
        if id(var) not in position:
            raise ValueError(
                f"{rule}(): exclude[{j}] ({param_label(var, j)}) is not one of params; "
                "exclude lists parameters from params (biases, norm scales). Where the "
                "rule sees only some of them (a parameter-server shard), pass a predicate "
                "instead, such as exclude=lambda p: p.ndim == 1"
            )
        flags[position[id(var)]] = True
    return flags


def _positive(value, name, rule, reason):
    """Check a Python number > 0 (symbolic values cannot be checked)."""
    if isinstance(value, (numbers.Real, np.number)) and not isinstance(value, bool):
        if not float(value) > 0:
            raise ValueError(f"{rule}(): {name} must be > 0, got {value}: {reason}")


def _norm(x):
    return pt.sqrt(pt.sum(x * x))


def _trust_ratio(param, update, coefficient, eps):
    """``coefficient * ||param|| / (||update|| + eps)``, 1 where either norm is 0."""
    p_norm, u_norm = _norm(param), _norm(update)
    ratio = coefficient * p_norm / (u_norm + eps)
    zero = pt.or_(pt.eq(p_norm, 0), pt.eq(u_norm, 0))
    return pt.switch(zero, pt.constant(np.asarray(1, dtype=param.type.dtype)), ratio)


def _adam_direction(grads, params, beta1, beta2, epsilon, prefix):
    """Bias-corrected Adam directions ``m_hat / (sqrt(v_hat) + epsilon)`` and their updates.

    The int64 timestep ``<prefix>.t`` and the moments ``<param>.<prefix>_m/_v``
    are created here; the bias corrections are computed in float64 and cast
    to each parameter's dtype, as optax does.
    """
    t_prev = scalar_state(f"{prefix}.t", "int64")
    t = t_prev + pt.constant(np.int64(1))
    t_float = pt.cast(t, "float64")
    b1_t = hyperparameter(beta1, "beta1", "float64", low=0, high=1, high_open=True)
    b2_t = hyperparameter(beta2, "beta2", "float64", low=0, high=1)
    correction1, correction2 = 1 - b1_t ** t_float, 1 - b2_t ** t_float
    updates, directions = OrderedDict(), []
    for i, (param, g) in enumerate(zip(params, grads)):
        dtype = param.type.dtype
        b1 = hyperparameter(beta1, "beta1", dtype)
        b2 = hyperparameter(beta2, "beta2", dtype)
        eps = hyperparameter(epsilon, "epsilon", dtype, low=0)
        m_prev = state_like(param, f"{prefix}_m", i)
        v_prev = state_like(param, f"{prefix}_v", i)
        m = b1 * m_prev + (1 - b1) * g
        v = b2 * v_prev + (1 - b2) * g ** 2
        updates[m_prev], updates[v_prev] = m, v
        m_hat = m / _cast(correction1, dtype)
        v_hat = v / _cast(correction2, dtype)
        directions.append(m_hat / (pt.sqrt(v_hat) + eps))
    return directions, updates, (t_prev, t)


def _decay(weight_decay):
    """False when weight_decay is the number 0 (no decay term in the graph)."""
    return not (isinstance(weight_decay, (numbers.Real, np.number))
                and not isinstance(weight_decay, bool) and float(weight_decay) == 0.0)


def _adamw(grads, params, learning_rate, beta1, beta2, epsilon, weight_decay, exclude, name):
    prefix = name or "adamw"
    excluded = _excluded(exclude, params, "adamw")
    directions, updates, (t_prev, t) = _adam_direction(grads, params, beta1, beta2, epsilon,
                                                       prefix)
    for param, u, skip in zip(params, directions, excluded):
        dtype = param.type.dtype
        lr = hyperparameter(learning_rate, "learning_rate", dtype, low=0)
        wd = hyperparameter(weight_decay, "weight_decay", dtype, low=0)
        if _decay(weight_decay) and not skip:
            u = u + wd * param
        updates[param] = param - lr * u
    updates[t_prev] = t
    return updates


@_loss_rule
def adamw(
    loss_or_grads: LossOrGrads | None = None,
    params: Params | None = None,
    learning_rate: LearningRate = 1e-3,
    beta1: Scalar = 0.9,
    beta2: Scalar = 0.999,
    epsilon: Scalar = 1e-8,
    weight_decay: Scalar = 1e-4,
    *,
    exclude: Exclude | None = None,
    average: int = 1,
    weight: Scalar | None = None,
    name: str | None = None,
) -> Updates | Callable[..., Updates]:
    """AdamW updates: Adam with decoupled weight decay.

    AdamW as in [1]_ and ``optax.adamw``: bias-corrected moments, epsilon
    added to ``sqrt(v_hat)``, and a weight decay that is not mixed into the
    moments:

    * ``t := t + 1``
    * ``m := beta1 * m + (1 - beta1) * gradient``
    * ``v := beta2 * v + (1 - beta2) * gradient ** 2``
    * ``u = (m / (1 - beta1 ** t)) / (sqrt(v / (1 - beta2 ** t)) + epsilon)``
    * ``u = u + weight_decay * param`` (not for parameters in `exclude`)
    * ``param := param - learning_rate * u``

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to generate update expressions for.
    learning_rate : float, symbolic scalar or schedule
        Learning rate. Default 0.001 (Adam's). A schedule (a callable of the
        optimizer step, see :mod:`lasagne_accum.schedules`) is evaluated on
        an int64 step counter the rule owns, ``adamw.schedule_step``, that
        counts optimizer steps: once per apply in the two-function form,
        once per stepping call with ``average=N``. The decay is scaled by it
        too, as in optax.
    beta1 : float or symbolic scalar
        Decay rate of the first moment, in [0, 1). Default 0.9.
    beta2 : float or symbolic scalar
        Decay rate of the second moment, in [0, 1]. Default 0.999.
    epsilon : float or symbolic scalar
        Added to ``sqrt(v_hat)`` (the paper's and optax's place). Default 1e-8.
    weight_decay : float or symbolic scalar
        Decoupled decay coefficient, >= 0. Default 1e-4 (optax's).
    exclude : list of shared variables or callable, optional
        Parameters that get no weight decay (biases, norm scales), or a
        predicate ``exclude(param) -> bool``: optax's ``mask``, inverted.
    average : int
        Accumulate the mean gradient of this many calls and step on every
        `average`-th call only (default 1); the timestep counts steps.
    weight : symbolic scalar, optional
        With ``average > 1``: this call's weight in the mean.
    name : str, optional
        Replaces ``adamw`` in the state names (``W.adamw_m``, ``W.adamw_v``,
        ``adamw.t``).

    Returns
    -------
    OrderedDict
        A dictionary mapping each parameter and its moments to their updates;
        the int64 timestep ``adamw.t`` comes last.

    Raises
    ------
    ValueError
        If `weight_decay`, `learning_rate` or `epsilon` is a negative number,
        a beta lies outside its range, or `exclude` names a non-parameter.
    TypeError
        If `learning_rate` is neither a number, a symbolic scalar nor a
        schedule, or a schedule does not return a scalar.

    Notes
    -----
    Against ``optax.adamw(learning_rate, b1, b2, eps, weight_decay=...,
    mask=...)`` (``eps_root=0``, no Nesterov), which the tests compare with:
    the same arithmetic; ``exclude`` lists what optax's mask leaves out.
    Unlike :func:`adam` (Lasagne's, epsilon against the uncorrected
    ``sqrt(v)``), epsilon here acts on the bias-corrected ``sqrt(v_hat)``.

    References
    ----------
    .. [1] Loshchilov, I. & Hutter, F. (2019): Decoupled Weight Decay
       Regularization. ICLR 2019. arXiv:1711.05101.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([1.0, -1.0]), name="w")
    >>> f = pytensor.function([], [], updates=adamw((w ** 2).sum(), [w], 0.1,
    ...                                              weight_decay=0.5))
    >>> _ = f()
    >>> w.get_value().round(6)  # 1 - 0.1 * (1 + 0.5 * 1): the first Adam step is 1
    array([ 0.85, -0.85])
    """
    return _build(adamw, _adamw, loss_or_grads, params, average, weight,
                  dict(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon,
                       weight_decay=weight_decay, exclude=exclude, name=name))


def _lars(grads, params, learning_rate, momentum, weight_decay, trust_coefficient, eps,
          nesterov, exclude, name):
    _require(learning_rate, "learning_rate", "lars")
    _positive(trust_coefficient, "trust_coefficient", "lars",
              "it scales every step (0 would freeze the parameters); the paper uses 0.001")
    prefix = name or "lars"
    excluded = _excluded(exclude, params, "lars")
    updates = OrderedDict()
    for i, (param, g, skip) in enumerate(zip(params, grads, excluded)):
        dtype = param.type.dtype
        lr = hyperparameter(learning_rate, "learning_rate", dtype, low=0)
        mom = hyperparameter(momentum, "momentum", dtype, low=0, high=1)
        wd = hyperparameter(weight_decay, "weight_decay", dtype, low=0)
        coefficient = hyperparameter(trust_coefficient, "trust_coefficient", dtype, low=0)
        epsilon = hyperparameter(eps, "eps", dtype, low=0)
        u = g
        if not skip:
            if _decay(weight_decay):
                u = u + wd * param
            u = u * _trust_ratio(param, u, coefficient, epsilon)
        u = -lr * u
        trace = state_like(param, f"{prefix}_momentum", i)
        trace_new = u + mom * trace
        updates[trace] = trace_new
        updates[param] = param + (u + mom * trace_new if nesterov else trace_new)
    return updates


@_loss_rule
def lars(
    loss_or_grads: LossOrGrads | None = None,
    params: Params | None = None,
    learning_rate: LearningRate | None = None,
    momentum: Scalar = 0.9,
    weight_decay: Scalar = 0.0,
    trust_coefficient: Scalar = 0.001,
    eps: Scalar = 0.0,
    nesterov: bool = False,
    *,
    exclude: Exclude | None = None,
    average: int = 1,
    weight: Scalar | None = None,
    name: str | None = None,
) -> Updates | Callable[..., Updates]:
    """LARS updates: SGD with momentum and layer-wise trust ratios.

    Layer-wise Adaptive Rate Scaling as in [1]_ and ``optax.lars``. Per
    parameter (``||.||`` is the norm over all its elements):

    * ``u = gradient + weight_decay * param``
    * ``u = u * trust_coefficient * ||param|| / (||u|| + eps)``, the ratio
      taken as 1 where ``||param||`` or ``||u||`` is 0
    * ``trace := momentum * trace - learning_rate * u``
    * ``param := param + trace`` (Nesterov: ``param := param + momentum *
      trace - learning_rate * u``)

    Parameters in `exclude` skip the first two lines (plain momentum SGD).

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to generate update expressions for.
    learning_rate : float, symbolic scalar or schedule
        The global learning rate (required). A schedule (a callable of the
        optimizer step, see :mod:`lasagne_accum.schedules`) is evaluated on
        an int64 step counter the rule owns, ``lars.schedule_step``, that
        counts optimizer steps: once per apply in the two-function form,
        once per stepping call with ``average=N``. The trace holds
        learning-rate-scaled steps, as in optax.
    momentum : float or symbolic scalar
        Decay of the momentum trace, in [0, 1]. Default 0.9.
    weight_decay : float or symbolic scalar
        L2 coefficient added to the gradient before the trust ratio, >= 0.
        Default 0.
    trust_coefficient : float or symbolic scalar
        The paper's eta, > 0. Default 0.001 (the paper's and optax's).
    eps : float or symbolic scalar
        Added to ``||u||`` in the ratio, >= 0. Default 0.
    nesterov : bool
        Nesterov's form of the momentum. Default False.
    exclude : list of shared variables or callable, optional
        Parameters without weight decay and trust ratio (biases, batch-norm
        scales, as in [1]_), or a predicate ``exclude(param) -> bool``:
        optax's ``weight_decay_mask`` and ``trust_ratio_mask``, inverted.
    average : int
        Accumulate the mean gradient of this many calls and step on every
        `average`-th call only (default 1).
    weight : symbolic scalar, optional
        With ``average > 1``: this call's weight in the mean.
    name : str, optional
        Replaces ``lars`` in the state names (``W.lars_momentum``).

    Returns
    -------
    OrderedDict
        A dictionary mapping each parameter and its trace to their updates.

    Raises
    ------
    ValueError
        If `trust_coefficient` <= 0, `weight_decay`, `eps` or `learning_rate`
        is a negative number, `momentum` lies outside [0, 1], or `exclude`
        names a non-parameter.
    TypeError
        If `learning_rate` is missing, or a schedule does not return a scalar.

    Notes
    -----
    Against ``optax.lars(learning_rate, weight_decay, weight_decay_mask,
    trust_coefficient, eps, trust_ratio_mask, momentum, nesterov)``, which
    the tests compare with: the same arithmetic, one ``exclude`` for both of
    optax's masks (a parameter excluded from one is excluded from both).

    References
    ----------
    .. [1] You, Y., Gitman, I. & Ginsburg, B. (2017): Large Batch Training of
       Convolutional Networks. arXiv:1708.03888.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([3.0, 4.0]), name="w")
    >>> f = pytensor.function([], [], updates=lars((w ** 2).sum(), [w], 1.0,
    ...                                             trust_coefficient=0.1))
    >>> _ = f()
    >>> w.get_value()  # ratio 0.1 * 5 / 10: a step of 0.05 * gradient [6, 8]
    array([2.7, 3.6])
    """
    return _build(lars, _lars, loss_or_grads, params, average, weight,
                  dict(learning_rate=learning_rate, momentum=momentum,
                       weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                       eps=eps, nesterov=nesterov, exclude=exclude, name=name))


def _lamb(grads, params, learning_rate, beta1, beta2, epsilon, weight_decay, exclude, name):
    prefix = name or "lamb"
    excluded = _excluded(exclude, params, "lamb")
    directions, updates, (t_prev, t) = _adam_direction(grads, params, beta1, beta2, epsilon,
                                                       prefix)
    for param, u, skip in zip(params, directions, excluded):
        dtype = param.type.dtype
        lr = hyperparameter(learning_rate, "learning_rate", dtype, low=0)
        wd = hyperparameter(weight_decay, "weight_decay", dtype, low=0)
        if not skip:
            if _decay(weight_decay):
                u = u + wd * param
            one = pt.constant(np.asarray(1, dtype=dtype))
            zero = pt.constant(np.asarray(0, dtype=dtype))
            u = u * _trust_ratio(param, u, one, zero)
        updates[param] = param - lr * u
    updates[t_prev] = t
    return updates


@_loss_rule
def lamb(
    loss_or_grads: LossOrGrads | None = None,
    params: Params | None = None,
    learning_rate: LearningRate = 1e-3,
    beta1: Scalar = 0.9,
    beta2: Scalar = 0.999,
    epsilon: Scalar = 1e-6,
    weight_decay: Scalar = 0.0,
    *,
    exclude: Exclude | None = None,
    average: int = 1,
    weight: Scalar | None = None,
    name: str | None = None,
) -> Updates | Callable[..., Updates]:
    """LAMB updates: Adam directions with layer-wise trust ratios.

    LAMB as in [1]_ and ``optax.lamb``. Per parameter (``||.||`` is the norm
    over all its elements):

    * ``t := t + 1``
    * ``m := beta1 * m + (1 - beta1) * gradient``
    * ``v := beta2 * v + (1 - beta2) * gradient ** 2``
    * ``u = (m / (1 - beta1 ** t)) / (sqrt(v / (1 - beta2 ** t)) + epsilon)
      + weight_decay * param``
    * ``param := param - learning_rate * (||param|| / ||u||) * u``, the ratio
      taken as 1 where ``||param||`` or ``||u||`` is 0

    Parameters in `exclude` get neither the decay nor the ratio (Adam).

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to generate update expressions for.
    learning_rate : float, symbolic scalar or schedule
        Learning rate. Default 0.001 (optax's). A schedule (a callable of the
        optimizer step, see :mod:`lasagne_accum.schedules`) is evaluated on
        an int64 step counter the rule owns, ``lamb.schedule_step``, that
        counts optimizer steps: once per apply in the two-function form,
        once per stepping call with ``average=N``.
    beta1 : float or symbolic scalar
        Decay rate of the first moment, in [0, 1). Default 0.9.
    beta2 : float or symbolic scalar
        Decay rate of the second moment, in [0, 1]. Default 0.999.
    epsilon : float or symbolic scalar
        Added to ``sqrt(v_hat)``. Default 1e-6 (the paper's and optax's).
    weight_decay : float or symbolic scalar
        Decoupled decay coefficient, >= 0. Default 0.
    exclude : list of shared variables or callable, optional
        Parameters without weight decay and trust ratio (biases, layer-norm
        scales), or a predicate ``exclude(param) -> bool``.
    average : int
        Accumulate the mean gradient of this many calls and step on every
        `average`-th call only (default 1); the timestep counts steps.
    weight : symbolic scalar, optional
        With ``average > 1``: this call's weight in the mean.
    name : str, optional
        Replaces ``lamb`` in the state names (``W.lamb_m``, ``W.lamb_v``,
        ``lamb.t``).

    Returns
    -------
    OrderedDict
        A dictionary mapping each parameter and its moments to their updates;
        the int64 timestep ``lamb.t`` comes last.

    Raises
    ------
    ValueError
        If `weight_decay`, `learning_rate` or `epsilon` is a negative number,
        a beta lies outside its range, or `exclude` names a non-parameter.
    TypeError
        If `learning_rate` is neither a number, a symbolic scalar nor a
        schedule, or a schedule does not return a scalar.

    Notes
    -----
    Against ``optax.lamb(learning_rate, b1, b2, eps, eps_root=0,
    weight_decay, mask)``, one deliberate difference: optax's `mask` removes
    the decay only and keeps the trust ratio for every parameter, while
    `exclude` removes both, as the LAMB paper's BERT setup does for biases and
    layer-norm parameters. Without `exclude` the two are the same
    arithmetic; with it, ours equals optax's chain ``scale_by_adam``,
    masked ``add_decayed_weights``, masked ``scale_by_trust_ratio``,
    ``scale_by_learning_rate`` (what the tests compare with).

    References
    ----------
    .. [1] You, Y. et al. (2020): Large Batch Optimization for Deep Learning:
       Training BERT in 76 minutes. ICLR 2020. arXiv:1904.00962.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([3.0, 4.0]), name="w")
    >>> f = pytensor.function([], [], updates=lamb((w ** 2).sum(), [w], 0.1, epsilon=0.0))
    >>> _ = f()
    >>> w.get_value().round(6)  # u = [1, 1]; ratio 5 / sqrt(2)
    array([2.646447, 3.646447])
    """
    return _build(lamb, _lamb, loss_or_grads, params, average, weight,
                  dict(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon,
                       weight_decay=weight_decay, exclude=exclude, name=name))
