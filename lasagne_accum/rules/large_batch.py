"""Large-batch rules: AdamW, LARS and LAMB, with optax's definitions.

optax is the second reference their tests compare with (the first is the
numpy re-derivation in ``tests/reference.py``). All three take ``exclude=``
(parameters left out of weight decay and trust ratios: biases, norm scales)
and update float16 parameters in float32, as every rule does.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable

from .._checks import check_number, is_number, param_label
from .._graph import hyperparameter, state_like
from ._adam import adam_moments, optax_directions
from ._core import _build, _cast, _compute_dtype, _loss_rule, _require

if TYPE_CHECKING:
    from .._typing import Exclude, LearningRate, LossOrGrads, Params, Scalar, Updates

__all__ = ["adamw", "lars", "lamb"]


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


def _norm(x):
    return pt.sqrt(pt.sum(x * x))


def _trust_ratio(param, update, coefficient, eps):
    """``coefficient * ||param|| / (||update|| + eps)``, 1 where either norm is 0."""
    p_norm, u_norm = _norm(param), _norm(update)
    ratio = coefficient * p_norm / (u_norm + eps)
    zero = pt.or_(pt.eq(p_norm, 0), pt.eq(u_norm, 0))
    return pt.switch(zero, pt.constant(np.asarray(1, dtype=param.type.dtype)), ratio)


def _decay(weight_decay):
    """False when weight_decay is the number 0 (no decay term in the graph)."""
    return not (isinstance(weight_decay, (numbers.Real, np.number))
                and not isinstance(weight_decay, bool) and float(weight_decay) == 0.0)


def _decoupled(rule, trust_ratio, grads, params, learning_rate, beta1, beta2, epsilon,
               weight_decay, exclude, name):
    """AdamW's step: optax's Adam direction plus the decoupled weight decay; with
    `trust_ratio`, LAMB's: that direction scaled by the layer's trust ratio."""
    prefix = name or rule
    excluded = _excluded(exclude, params, rule)
    t_prev, t_next, moments = adam_moments(grads, params, beta1, beta2, prefix)
    directions = optax_directions(moments, beta1, beta2, epsilon, t_next)
    updates = OrderedDict()
    for mom in moments:
        updates.update(mom.updates)
    for mom, u, skip in zip(moments, directions, excluded):
        param, dtype = mom.param, mom.dtype
        p = _cast(param, dtype)
        lr = hyperparameter(learning_rate, "learning_rate", dtype, low=0)
        wd = hyperparameter(weight_decay, "weight_decay", dtype, low=0)
        if not skip:
            if _decay(weight_decay):
                u = u + wd * p
            if trust_ratio:
                one = pt.constant(np.asarray(1, dtype=dtype))
                zero = pt.constant(np.asarray(0, dtype=dtype))
                u = u * _trust_ratio(p, u, one, zero)
        updates[param] = _cast(p - lr * u, param.type.dtype)
    updates[t_prev] = t_next
    return updates


def _adamw(grads, params, learning_rate, beta1, beta2, epsilon, weight_decay, exclude, name):
    return _decoupled("adamw", False, grads, params, learning_rate, beta1, beta2, epsilon,
                      weight_decay, exclude, name)


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
    if is_number(trust_coefficient):
        check_number(trust_coefficient, "lars(): trust_coefficient", low=0, low_open=True,
                     why="it scales every step (0 would freeze the parameters); the paper "
                         "uses 0.001")
    prefix = name or "lars"
    excluded = _excluded(exclude, params, "lars")
    updates = OrderedDict()
    for i, (param, g, skip) in enumerate(zip(params, grads, excluded)):
        dtype = _compute_dtype(param)
        p, u = _cast(param, dtype), _cast(g, dtype)
        lr = hyperparameter(learning_rate, "learning_rate", dtype, low=0)
        mom = hyperparameter(momentum, "momentum", dtype, low=0, high=1)
        wd = hyperparameter(weight_decay, "weight_decay", dtype, low=0)
        coefficient = hyperparameter(trust_coefficient, "trust_coefficient", dtype, low=0)
        epsilon = hyperparameter(eps, "eps", dtype, low=0)
        if not skip:
            if _decay(weight_decay):
                u = u + wd * p
            u = u * _trust_ratio(p, u, coefficient, epsilon)
        u = -lr * u
        trace = state_like(param, f"{prefix}_momentum", i, dtype=dtype)
        trace_new = u + mom * trace
        updates[trace] = trace_new
        updates[param] = _cast(p + (u + mom * trace_new if nesterov else trace_new),
                               param.type.dtype)
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
    return _decoupled("lamb", True, grads, params, learning_rate, beta1, beta2, epsilon,
                      weight_decay, exclude, name)


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

