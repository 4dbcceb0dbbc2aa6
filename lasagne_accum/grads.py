"""Gradients, parameter checks and the one helper that makes state.

Every module of :mod:`lasagne_accum` builds its state (velocities, moments,
accumulators, counters) through :func:`state_like` and :func:`scalar_state`,
so all state variables follow one convention: same dtype (or a wider float
for accumulators), same static shape as their parameter, and a readable,
stable name such as ``W1.adam_m`` that checkpoints rely on.

It is also the one home of the checks every module shares:
:func:`check_params`, :func:`check_int` (an integer >= k, not a bool),
:func:`hyperparameter`, :func:`check_rule_updates` (what an update rule
returned) with :func:`rule_name`, and :func:`as_host_array` (a shared value
as numpy, JAX and torch arrays included).
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.gradient import DisconnectedInputError
from pytensor.graph.traversal import ancestors
from pytensor.tensor.type import TensorType
from pytensor.tensor.variable import TensorVariable

if TYPE_CHECKING:
    from pytensor.graph.basic import Variable
    from pytensor.tensor.sharedvar import TensorSharedVariable

    from ._typing import LossOrGrads, Params, Scalar, UpdateRule, Updates

__all__ = [
    "get_or_compute_grads",
    "check_params",
    "param_label",
    "state_like",
    "scalar_state",
    "hyperparameter",
    "accumulator_dtype",
    "check_every",
    "check_int",
    "check_rule_updates",
    "rule_name",
    "as_host_array",
]

_FLOAT_DTYPES = ("float16", "float32", "float64")
_INT64_MAX = int(np.iinfo(np.int64).max)


def as_host_array(value: Any) -> np.ndarray:
    """A shared variable's value as a numpy array, wherever it lives.

    Shared values are numpy arrays under the C and Numba backends, JAX arrays
    after a call compiled with ``mode="JAX"`` and torch tensors with
    ``mode="PYTORCH"``; this copies device values to the host.

    Examples
    --------
    >>> as_host_array([1.0, 2.0])
    array([1., 2.])
    """
    if hasattr(value, "detach"):  # torch tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def check_int(value: Any, name: str, low: int = 1, high: int = _INT64_MAX) -> int:
    """Return `value` as a Python int in ``[low, high]``, or raise naming `name`.

    Accepts Python and numpy integers; refuses bools, floats, strings and
    symbolic variables (a count such as ``average=N`` fixes the structure of
    the graph, so it must be known when the graph is built).

    Parameters
    ----------
    value : int
    name : str
        The argument's name, for error messages.
    low : int
        Smallest allowed value (default 1).
    high : int
        Largest allowed value; default the largest int64, the limit of the
        int64 counters the value is compared with.

    Raises
    ------
    TypeError
        If `value` is not an integer (or is a bool, or symbolic).
    ValueError
        If it lies outside ``[low, high]``.

    Examples
    --------
    >>> check_int(3, "every")
    3
    >>> check_int(0, "every")
    Traceback (most recent call last):
    ...
    ValueError: every must be an integer >= 1, got 0
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        if hasattr(value, "type"):
            raise TypeError(
                f"{name} must be a Python integer, not a symbolic variable: the number of "
                "batches per step fixes the structure of the update dictionary"
            )
        raise TypeError(f"{name} must be an integer >= {low}, got {value!r}")
    value = int(value)
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(
            f"{name} must be at most {high} (the limit of the int64 counter it is "
            f"compared with), got {value}"
        )
    return value


def rule_name(rule: Callable[..., Any]) -> str:
    """The name of an update rule (a function, a partial, any callable) for messages.

    Examples
    --------
    >>> from functools import partial
    >>> rule_name(partial(sorted, reverse=True))
    'sorted'
    """
    name = getattr(rule, "__name__", None)
    if name is None and hasattr(rule, "func"):
        return rule_name(rule.func)
    return name or repr(rule)


def check_rule_updates(
    update_rule: UpdateRule,
    grads: Sequence[Variable],
    params: Params,
    kwargs: Mapping[str, Any],
) -> Updates:
    """Call ``update_rule(grads, params, **kwargs)`` and check what it returns.

    Parameters
    ----------
    update_rule : callable
        Any rule returning an update dictionary (a library rule, a partial of
        one, a user-written function).
    grads, params : lists
        Passed to the rule.
    kwargs : dict
        The rule's hyperparameters.

    Returns
    -------
    OrderedDict
        The rule's dictionary, in its order.

    Raises
    ------
    TypeError
        If `update_rule` is not callable, returns something other than a
        mapping, or a key is not a shared variable.
    ValueError
        If the dictionary does not update every parameter.
    """
    if not callable(update_rule):
        raise TypeError(f"update_rule must be callable, got {type(update_rule).__name__}")
    label = rule_name(update_rule)
    result = update_rule(grads, params, **dict(kwargs or {}))
    if not isinstance(result, Mapping):
        raise TypeError(
            f"update_rule {label} returned {type(result).__name__}, not an update "
            "dictionary; it must return a dict mapping shared variables to new values"
        )
    for i, p in enumerate(params):
        if p not in result:
            raise ValueError(
                f"update_rule {label} does not update params[{i}] "
                f"({param_label(p, i)}); its dictionary must update every parameter"
            )
    for var in result:
        if not isinstance(var, SharedVariable):
            raise TypeError(
                f"update_rule {label} returned a key {var!r} that is not a shared variable"
            )
    return OrderedDict(result)


def param_label(param: Any, index: int | None = None) -> str:
    """A human-readable name for `param` in messages and state names."""
    if getattr(param, "name", None):
        return param.name
    return f"param{index}" if index is not None else repr(param)


def check_params(params: Params, where: str = "params") -> list[SharedVariable]:
    """Validate a list of parameters and return it as a list.

    Parameters
    ----------
    params : list of shared variables
        The parameters an update dictionary will update.
    where : str
        What to call the list in error messages.

    Returns
    -------
    list
        `params` as a new list.

    Raises
    ------
    TypeError
        If `params` is not a list or tuple (a single shared variable, a dict),
        if an element is not a shared tensor variable, or if its dtype is not
        a float type.
    ValueError
        If the same parameter appears twice.
    """
    if isinstance(params, SharedVariable):
        raise TypeError(
            f"{where} must be a list of shared variables, got the single shared "
            f"variable {param_label(params)}; wrap it in a list: [{param_label(params)}]"
        )
    if isinstance(params, (dict, str)) or not hasattr(params, "__iter__"):
        raise TypeError(
            f"{where} must be a list of shared variables, got {type(params).__name__}"
        )
    params = list(params)
    seen: dict[Any, int] = {}
    for i, p in enumerate(params):
        if not isinstance(p, SharedVariable):
            raise TypeError(
                f"{where}[{i}] ({param_label(p, i)}) is a {type(p).__name__}, not a "
                "shared variable: update rules can only update shared variables "
                "(create it with pytensor.shared(numpy_array, name=...))"
            )
        if not isinstance(p.type, TensorType):
            raise TypeError(f"{where}[{i}] ({param_label(p, i)}) is not a tensor")
        if p.type.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{where}[{i}] ({param_label(p, i)}) has dtype {p.type.dtype}; "
                "only float16/float32/float64 parameters can be trained "
                "(an integer parameter has no gradient)"
            )
        if id(p) in seen:
            raise ValueError(
                f"{where}[{i}] ({param_label(p, i)}) is the same variable as "
                f"{where}[{seen[id(p)]}]; pass each parameter once"
            )
        seen[id(p)] = i
    return params


def _check_grad(grad, param, i):
    """Return `grad` as a tensor of `param`'s dtype, or raise naming `param`."""
    label = param_label(param, i)
    try:
        grad = pt.as_tensor_variable(grad)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"gradient for {label} is not a tensor expression: {exc}") from None
    if grad.type.ndim != param.type.ndim:
        raise ValueError(
            f"gradient for {label} has {grad.type.ndim} dimensions but {label} has "
            f"{param.type.ndim}; pass grads in the same order as params"
        )
    pshape = param.type.shape
    # A shared variable's static shape is usually unknown; its value is not.
    value_shape = np.shape(param.get_value(borrow=True))
    for axis, (g, p, v) in enumerate(zip(grad.type.shape, pshape, value_shape)):
        known = p if p is not None else v
        if g is not None and g != known:
            raise ValueError(
                f"gradient for {label} has length {g} on axis {axis} but {label} has "
                f"length {known}; pass grads in the same order as params"
            )
    if not grad.type.dtype.startswith("float"):
        raise TypeError(
            f"gradient for {label} has dtype {grad.type.dtype}; a float gradient is needed"
        )
    if grad.type.dtype != param.type.dtype:
        grad = pt.cast(grad, param.type.dtype)
    return grad


def get_or_compute_grads(loss_or_grads: LossOrGrads, params: Params) -> list[TensorVariable]:
    """Return a list of gradient expressions, one per parameter.

    Parameters
    ----------
    loss_or_grads : symbolic scalar or list of expressions
        A scalar loss expression, or a list of gradient expressions (one per
        parameter, in the order of `params`).
    params : list of shared variables
        The variables to return the gradients for.

    Returns
    -------
    list of expressions
        If `loss_or_grads` is a list, its elements checked against `params`
        and cast to each parameter's dtype; otherwise
        ``pytensor.grad(loss_or_grads, params)``.

    Raises
    ------
    ValueError
        If `loss_or_grads` is a list of a different length than `params`, a
        gradient's shape cannot match its parameter, the loss is not a scalar,
        or a parameter appears twice.
    TypeError
        If an element of `params` is not a float shared variable.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> w = pytensor.shared(np.ones(3), name="w")
    >>> x = pt.vector("x")
    >>> (g,) = get_or_compute_grads(pt.sum(w * x), [w])
    >>> g.eval({x: [1.0, 2.0, 3.0]})
    array([1., 2., 3.])
    """
    params = check_params(params)
    if isinstance(loss_or_grads, (list, tuple)):
        if len(loss_or_grads) != len(params):
            raise ValueError(
                f"got {len(loss_or_grads)} gradient expressions for {len(params)} "
                "parameters; pass one gradient per parameter"
            )
        return [_check_grad(g, p, i) for i, (g, p) in enumerate(zip(loss_or_grads, params))]
    if not isinstance(loss_or_grads, pytensor.graph.basic.Variable):
        raise TypeError(
            "loss_or_grads must be a scalar loss expression or a list of gradients, "
            f"got {type(loss_or_grads).__name__}"
        )
    ndim = getattr(loss_or_grads.type, "ndim", None)
    if ndim != 0:
        hint = "reduce it first (for example with .mean())"
        if ndim is not None and len(params) == 1 and ndim == params[0].type.ndim:
            hint = (
                f"if it is the gradient of {param_label(params[0], 0)}, pass a list with one "
                f"gradient per parameter ([grad]); if it is a loss, {hint}"
            )
        raise ValueError(
            f"loss_or_grads must be a scalar loss or a list of gradients; got a single "
            f"{ndim}-dimensional {loss_or_grads.type} (the loss must be a scalar): {hint}"
        )
    try:
        grads = cast("list[Variable]", pytensor.grad(loss_or_grads, params))
    except DisconnectedInputError:
        inputs = set(ancestors([loss_or_grads]))
        loose = [f"params[{i}] ({param_label(p, i)})" for i, p in enumerate(params)
                 if p not in inputs]
        raise ValueError(
            f"the loss does not depend on {', '.join(loose) or 'some of the params'}; "
            "remove it from params (or pass its gradient yourself in a list)"
        ) from None
    return [_check_grad(g, p, i) for i, (g, p) in enumerate(zip(grads, params))]


def accumulator_dtype(dtype: str | np.dtype) -> str:
    """The dtype to accumulate values of `dtype` in: at least float32."""
    return "float64" if str(dtype) == "float64" else "float32"


def state_like(
    param: SharedVariable,
    suffix: str,
    index: int | None = None,
    dtype: str | None = None,
    value: float = 0.0,
) -> TensorSharedVariable:
    """A shared variable shaped like `param`, filled with `value`.

    Parameters
    ----------
    param : shared variable
        The parameter the state belongs to.
    suffix : str
        Appended to the parameter's name: ``W1`` and ``"adam_m"`` give
        ``W1.adam_m``.
    index : int, optional
        Position of `param` in its list, used in the name when the parameter
        has none (``param0.adam_m``).
    dtype : str, optional
        Defaults to the parameter's dtype.
    value : float
        Initial value of every element.

    Returns
    -------
    TensorSharedVariable
        With the parameter's static shape (broadcast pattern) and current
        value shape.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> W = pytensor.shared(np.ones((2, 3), dtype="float32"), name="W", shape=(2, 3))
    >>> m = state_like(W, "adam_m")
    >>> m.name, m.type.dtype, m.type.shape, m.get_value().sum()
    ('W.adam_m', 'float32', (2, 3), np.float32(0.0))
    """
    dtype = dtype or param.type.dtype
    shape = np.shape(param.get_value(borrow=True))
    return pytensor.shared(
        np.full(shape, value, dtype=dtype),
        name=f"{param_label(param, index)}.{suffix}",
        shape=param.type.shape,
    )


def scalar_state(name: str, dtype: str, value: float = 0) -> TensorSharedVariable:
    """A scalar shared variable (a counter or a running total).

    Examples
    --------
    >>> t = scalar_state("adam.t", "float32")
    >>> t.name, t.type.dtype, t.type.ndim
    ('adam.t', 'float32', 0)
    """
    return pytensor.shared(np.asarray(value, dtype=dtype), name=name)


def hyperparameter(
    value: Scalar,
    name: str,
    dtype: str,
    *,
    low: float | None = None,
    high: float | None = None,
    high_open: bool = False,
) -> TensorVariable:
    """Return `value` as a scalar of `dtype`, checking Python numbers.

    Parameters
    ----------
    value : number or symbolic scalar
        A Python/numpy number, or a scalar expression (a shared learning rate,
        for example, so that a schedule can change it between calls).
    name : str
        The hyperparameter's name, for error messages.
    dtype : str
        The dtype of the parameter it will be combined with; the value is cast
        to it so that a float32 model stays float32.
    low, high : float, optional
        Allowed range for a number (inclusive; `high` exclusive when
        `high_open`). Symbolic values cannot be checked at build time.

    Raises
    ------
    TypeError
        If `value` is neither a number nor a scalar expression.
    ValueError
        If a number is not finite or lies outside the allowed range.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number or a symbolic scalar, got a bool")
    if isinstance(value, (numbers.Real, np.number)) or (
        isinstance(value, np.ndarray) and value.ndim == 0
    ):
        number = float(value)
        if not np.isfinite(number):
            raise ValueError(f"{name} must be finite, got {number}")
        if low is not None and number < low:
            raise ValueError(f"{name} must be >= {low}, got {number}")
        if high is not None and (number > high or (high_open and number == high)):
            bound = "<" if high_open else "<="
            raise ValueError(f"{name} must be {bound} {high}, got {number}")
        return pt.constant(np.asarray(number, dtype=dtype), name=name)
    if isinstance(value, pytensor.graph.basic.Variable):
        if getattr(value.type, "ndim", None) != 0:
            raise TypeError(f"{name} must be a scalar, got {value.type}")
        if not isinstance(value, TensorVariable):
            value = pt.as_tensor_variable(value)
        return value if value.type.dtype == dtype else pt.cast(value, dtype)
    raise TypeError(
        f"{name} must be a number or a symbolic scalar, got {type(value).__name__}"
    )


def check_every(every: int, name: str = "average") -> int:
    """Return `every` as an int >= 1, or raise naming `name` (see :func:`check_int`)."""
    return check_int(every, name, low=1)
