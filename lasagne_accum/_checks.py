"""Checks of what users pass in, shared by every module (private).

One number checker (:func:`check_number`), and the checks of parameter lists
(:func:`check_params`) and of what an update rule returned
(:func:`check_rule_updates`). Each raises ``TypeError`` or ``ValueError`` at
graph-build time with a message that names the argument and says what to do.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.tensor.type import TensorType

if TYPE_CHECKING:
    from pytensor.graph.basic import Variable

    from ._typing import Params, UpdateRule, Updates

__all__ = ["check_number", "check_int", "is_number", "check_params", "param_label",
           "check_rule_updates", "rule_name", "FLOAT_DTYPES"]

FLOAT_DTYPES = ("float16", "float32", "float64")
INT64_MAX = int(np.iinfo(np.int64).max)


def is_number(value: Any) -> bool:
    """A Python or numpy real number (or a 0-d numpy array of one), not a bool."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    return isinstance(value, (numbers.Real, np.number)) and not isinstance(value, (bool, np.bool_))


def check_number(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    integral_float: bool = False,
    why: str = "",
) -> Any:
    """Return `value` as a Python float (or int), or raise naming `name`.

    Parameters
    ----------
    value : number
        A Python or numpy number (or a 0-d array); bools are refused.
    name : str
        The argument's name for messages (``"lars(): trust_coefficient"``).
    low, high : number, optional
        Bounds, inclusive unless `low_open` / `high_open`.
    integer : bool
        Require an integer (a count); returns an int.
    integral_float : bool
        With `integer`, also accept a float with an integral value (``1e3``
        steps).
    why : str
        Appended to a range error: what the bound is for.

    Raises
    ------
    TypeError
        If `value` is not a number (or not an integer when one is needed), or
        is symbolic where a count fixes the graph.
    ValueError
        If a float is not finite, or the number lies outside the bounds.

    Examples
    --------
    >>> check_number(3, "every", integer=True, low=1)
    3
    >>> check_number(0, "every", integer=True, low=1)
    Traceback (most recent call last):
    ...
    ValueError: every must be an integer >= 1, got 0
    >>> check_number(0.0, "decay_steps", low=0, low_open=True)
    Traceback (most recent call last):
    ...
    ValueError: decay_steps must be > 0, got 0.0
    """
    count = integer and not integral_float  # a count that fixes the graph (check_int)
    if not is_number(value):
        if count and hasattr(value, "type"):
            raise TypeError(
                f"{name} must be a Python integer, not a symbolic variable: the number of "
                "batches per step fixes the structure of the update dictionary"
            )
        if count:
            bound = f" >= {low}" if low is not None else ""
            raise TypeError(f"{name} must be an integer{bound}, got {value!r}")
        kind = "an integer" if integer else "a number"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    if isinstance(value, np.ndarray):
        value = value[()]
    if integer:
        if isinstance(value, (numbers.Integral, np.integer)):
            value = int(value)
        elif integral_float and float(value).is_integer():
            value = int(value)
        elif count:
            bound = f" >= {low}" if low is not None else ""
            raise TypeError(f"{name} must be an integer{bound}, got {value!r}")
        else:
            raise TypeError(f"{name} must be an integer (a number of steps), got {value!r}")
    else:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
    what = "an integer " if count else ""
    reason = f": {why}" if why else ""
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {what}{'>' if low_open else '>='} {low}, "
                         f"got {value}{reason}")
    if high is not None and (value > high or (high_open and value == high)):
        if integer and high == INT64_MAX:
            raise ValueError(f"{name} must be at most {high} (the limit of the int64 counter "
                             f"it is compared with), got {value}")
        raise ValueError(f"{name} must be {what}{'<' if high_open else '<='} {high}, "
                         f"got {value}{reason}")
    return value


def check_int(value: Any, name: str, low: int = 1, high: int = INT64_MAX) -> int:
    """An integer count in ``[low, high]`` (a bool, float or symbolic value is refused).

    A count such as ``average=N`` fixes the structure of the graph, so it must
    be known when the graph is built; the default upper bound is the limit of
    the int64 counters it is compared with.

    Examples
    --------
    >>> check_int(3, "every")
    3
    """
    return check_number(value, name, integer=True, low=low, high=high)


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


def param_label(param: Any, index: int | None = None) -> str:
    """A human-readable name for `param` in messages and state names."""
    if getattr(param, "name", None):
        return param.name
    return f"param{index}" if index is not None else repr(param)


def check_params(params: Params, where: str = "params") -> list[SharedVariable]:
    """Validate a list of parameters and return it as a new list.

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
        if p.type.dtype not in FLOAT_DTYPES:
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


def check_rule_updates(
    update_rule: UpdateRule,
    grads: Sequence[Variable],
    params: Params,
    kwargs: Mapping[str, Any],
) -> Updates:
    """Call ``update_rule(grads, params, **kwargs)`` and check what it returns.

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
