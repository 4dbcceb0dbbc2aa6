"""Checks of what users pass in, shared by every module (private).

Small number checks that each say one thing (:func:`check_real`,
:func:`check_integer`, :func:`check_range`) and their compositions
(:func:`check_number`, :func:`check_int`), and the checks of parameter lists
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

__all__ = ["check_real", "check_integer", "check_range", "check_number", "check_int",
           "is_number", "check_params", "param_label", "check_rule_updates", "rule_name",
           "FLOAT_DTYPES"]

FLOAT_DTYPES = ("float16", "float32", "float64")
INT64_MAX = int(np.iinfo(np.int64).max)


def is_number(value: Any) -> bool:
    """A Python or numpy real number (or a 0-d numpy array of one), not a bool."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    return isinstance(value, (numbers.Real, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_))


def shown(value: Any) -> str:
    """`value` for a message: an integer of more than 30 digits by its size, not its digits
    (Python refuses to print one of over 4,300)."""
    if isinstance(value, (numbers.Integral, np.integer)) and abs(int(value)) >= 10 ** 30:
        return f"an integer of {int(value).bit_length()} bits"
    return str(value)


def _scalar(value: Any) -> Any:
    return value[()] if isinstance(value, np.ndarray) and value.ndim == 0 else value


def check_real(value: Any, name: str) -> float:
    """`value`, a finite real number (see :func:`is_number`), as a Python float."""
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        value = float(_scalar(value))
    except OverflowError:       # an integer beyond any float
        raise ValueError(f"{name} must be finite, got {shown(_scalar(value))}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_integer(value: Any, name: str, integral_float: bool = False) -> int:
    """`value`, a Python or numpy integer (with `integral_float`, also a float with an
    integral value: ``1e3`` steps), as a Python int."""
    if not is_number(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    value = _scalar(value)
    if isinstance(value, (numbers.Integral, np.integer)) or (
            integral_float and float(value).is_integer()):
        return int(value)
    raise TypeError(f"{name} must be an integer, got {value!r}")


def check_range(value: Any, name: str, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False, why: str = "") -> Any:
    """`value` if it lies within the bounds (inclusive unless `low_open` / `high_open`);
    `why`, appended to the message, says what a bound is for."""
    reason = f": {why}" if why else ""
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got "
                         f"{shown(value)}{reason}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got "
                         f"{shown(value)}{reason}")
    return value


def check_number(value: Any, name: str, **bounds: Any) -> float:
    """A finite number (:func:`check_real`) within `bounds` (:func:`check_range`'s).

    Examples
    --------
    >>> check_number(0.0, "decay_steps", low=0, low_open=True)
    Traceback (most recent call last):
    ...
    ValueError: decay_steps must be > 0, got 0.0
    """
    return check_range(check_real(value, name), name, **bounds)


def check_int(value: Any, name: str, low: int = 1) -> int:
    """A count known when the graph is built (``average=N`` fixes its structure): an
    integer from `low` to the limit of the int64 counters it is compared with.

    Examples
    --------
    >>> check_int(0, "every")
    Traceback (most recent call last):
    ...
    ValueError: every must be an integer >= 1, got 0
    """
    if hasattr(value, "type"):
        raise TypeError(f"{name} must be a Python integer, not a symbolic variable: the "
                        "number of batches per step fixes the structure of the update dictionary")
    value = check_integer(value, name)
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")
    if value > INT64_MAX:
        raise ValueError(f"{name} must be at most {INT64_MAX} (the limit of the int64 counter "
                         f"it is compared with), got {value}")
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
