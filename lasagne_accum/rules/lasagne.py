"""Lasagne's update rules on PyTensor, with Lasagne's signatures, defaults and formulas.

See :mod:`lasagne_accum.updates` (the public module) for what they add to
Lasagne's: ``average=N``, schedules, partials, ``name=``, float16 in
float32, the guard of an accumulation's apply step.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytensor.tensor as pt

from .._checks import check_params, param_label
from .._graph import guard_updates, hyperparameter, state_like
from ._adam import adam_moments
from ._core import (
    _build,
    _cast,
    _compute_dtype,
    _loss_rule,
    _require,
    _rule,
    _state_suffix,
    _timestep_dtype,
)

if TYPE_CHECKING:
    from .._typing import LearningRate, LossOrGrads, Params, Scalar, Updates, UpdatesLike

__all__ = ["sgd", "momentum", "nesterov_momentum", "apply_momentum",
           "apply_nesterov_momentum", "adagrad", "rmsprop", "adadelta", "adam", "adamax",
           "amsgrad"]


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


def _keep_guard(result, param, velocity, signal):
    """Guard a wrapper's new values as the wrapped rule's were (``accu.grads``' empty window).

    The wrapped value of `param` may carry a step signal (the guard of an
    accumulation's apply step): the velocity and the parameter then keep their
    values when it is false, as the wrapped rule's did.
    """
    if signal is not None:
        result.update(guard_updates({velocity: result[velocity], param: result[param]}, signal))


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
        wrapped = pt.as_tensor_variable(result[param])
        x = mom * velocity + _cast(wrapped, dtype)
        result[velocity] = x - _cast(param, dtype)
        result[param] = _cast(x, param.type.dtype)
        _keep_guard(result, param, velocity, getattr(wrapped.tag, "step_signal", None))
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
        wrapped = pt.as_tensor_variable(result[param])
        new = _cast(wrapped, dtype)
        x = mom * velocity + new - _cast(param, dtype)
        result[velocity] = x
        result[param] = _cast(mom * x + new, param.type.dtype)
        _keep_guard(result, param, velocity, getattr(wrapped.tag, "step_signal", None))
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
    """Adam, Adamax and AMSGrad: the moments of :mod:`._adam`, Lasagne's bias correction."""
    prefix = kind if name is None else name
    _state_suffix(name, kind, "m")  # checks name
    t_dtype = _timestep_dtype(params)
    one = pt.constant(np.asarray(1, dtype=t_dtype))
    lr_t = hyperparameter(learning_rate, "learning_rate", t_dtype, low=0)
    b1_t = hyperparameter(beta1, "beta1", t_dtype, low=0, high=1, high_open=True)
    b2_t = hyperparameter(beta2, "beta2", t_dtype, low=0, high=1)
    t_prev, t_next, moments = adam_moments(grads, params, beta1, beta2, prefix, kind)
    t = pt.cast(t_next, t_dtype)
    if kind == "adamax":
        a_t = lr_t / (one - b1_t ** t)
    else:
        a_t = lr_t * pt.sqrt(one - b2_t ** t) / (one - b1_t ** t)

    updates = OrderedDict()
    for mom in moments:
        param, dtype = mom.param, mom.dtype
        eps = hyperparameter(epsilon, "epsilon", dtype, low=0)
        a = _cast(a_t, dtype)
        updates.update(mom.updates)
        if kind == "adamax":
            step = a * mom.m / (mom.second + eps)
        else:
            step = a * mom.m / (pt.sqrt(mom.second) + eps)
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


