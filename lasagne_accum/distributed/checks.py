"""The parameter server's input checks: parameters, shard plans, pushes, learning rates.

Everything here is plain Python and numpy: no PyTensor graph is built.
"""

import inspect
import math
import numbers
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable

from .errors import PushRejected
from .options import _number

_FLOAT_DTYPES = ("float16", "float32", "float64")


# ------------------------------------------------------------------ params and shards


def named_params(params):
    """``{name: ndarray or shared variable}`` from a dict or a list of named shared variables."""
    if isinstance(params, Mapping):
        items = list(params.items())
    elif isinstance(params, (list, tuple)):
        items = []
        for i, p in enumerate(params):
            if not isinstance(p, SharedVariable):
                raise TypeError(f"params[{i}] is a {type(p).__name__}; give a dict "
                                "{name: array} or a list of named shared variables")
            if not p.name:
                raise ValueError(f"params[{i}] has no name; the server keys parameters "
                                 "by name (pytensor.shared(value, name='W1'))")
            items.append((p.name, p))
    else:
        raise TypeError("params must be a dict {name: array} or a list of named shared "
                        f"variables, got {type(params).__name__}")
    if not items:
        raise ValueError("the server needs at least one parameter")
    out = OrderedDict()
    for name, value in items:
        if not isinstance(name, str) or not name:
            raise TypeError(f"parameter names must be non-empty strings, got {name!r}")
        if name in out:
            raise ValueError(f"parameter name {name!r} appears twice")
        if not isinstance(value, SharedVariable):
            value = np.array(value, copy=True)
        dtype = str(value.type.dtype if isinstance(value, SharedVariable) else value.dtype)
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"parameter {name!r} has dtype {dtype}; only float16/32/64 "
                            "parameters can be trained")
        out[name] = value
    return out


def _value(p):
    return p.get_value(borrow=True) if isinstance(p, SharedVariable) else p


def param_specs(named):
    """``{name: (shape, dtype)}`` of named params."""
    return OrderedDict((n, (tuple(np.shape(_value(p))), str(np.asarray(_value(p)).dtype)))
                       for n, p in named.items())


def plan_shards(names, shards):
    """``OrderedDict(shard_name -> [param names])``, validated.

    `shards` is None (one shard per parameter, named after it), a list of
    lists of names (shards ``shard0``, ``shard1``...) or a dict
    ``{shard_name: [names]}``.

    Examples
    --------
    >>> dict(plan_shards(["w", "b"], None))
    {'w': ['w'], 'b': ['b']}
    >>> dict(plan_shards(["w", "b"], [["w", "b"]]))
    {'shard0': ['w', 'b']}
    """
    names = list(names)
    if shards is None:
        return OrderedDict((n, [n]) for n in names)
    if isinstance(shards, Mapping):
        plan = OrderedDict((k, list(v)) for k, v in shards.items())
    elif isinstance(shards, (list, tuple)):
        plan = OrderedDict()
        for i, group in enumerate(shards):
            if isinstance(group, str):
                raise TypeError(f"shards[{i}] is the string {group!r}; give a list of "
                                f"parameter names: [[{group!r}], ...]")
            plan[f"shard{i}"] = list(group)
    else:
        raise TypeError(f"shards must be None, a list of lists of parameter names or a "
                        f"dict, got {type(shards).__name__}")
    owner = {}
    for sname, group in plan.items():
        if not isinstance(sname, str) or not sname:
            raise TypeError(f"shard names must be non-empty strings, got {sname!r}")
        if not group:
            raise ValueError(f"shard {sname!r} has no parameters")
        for n in group:
            if n not in names:
                raise ValueError(f"shard {sname!r} names unknown parameter {n!r} "
                                 f"(parameters: {', '.join(names)})")
            if n in owner:
                raise ValueError(f"parameter {n!r} is in shards {owner[n]!r} and {sname!r}")
            owner[n] = sname
    unassigned = [n for n in names if n not in owner]
    if unassigned:
        raise ValueError(f"parameters in no shard: {', '.join(unassigned)}")
    return plan


# ------------------------------------------------------------------ pushes


def _describe(x):
    return type(x).__name__ if not hasattr(x, "dtype") else f"{x.dtype} array"


def check_grads(grads, specs, where, check_finite=True, copy=True):
    """Validate ``{name: array}`` against ``{name: (shape, dtype)}``; the arrays in spec order.

    With `copy` (the default) each is a copy, the only one on the way in;
    without, a C-contiguous array (the caller's own where it is one), for a
    server that sends the push away at once.
    """
    if not isinstance(grads, Mapping):
        raise PushRejected(f"{where}: grads must be a dict {{parameter name: array}}, got "
                           f"{type(grads).__name__}")
    unknown = [k for k in grads if k not in specs]
    if unknown:
        raise PushRejected(f"{where}: unknown parameter name(s) {', '.join(map(repr, unknown))} "
                           f"(expected: {', '.join(specs)})")
    missing = [k for k in specs if k not in grads]
    if missing:
        raise PushRejected(f"{where}: no gradient for {', '.join(map(repr, missing))}")
    out = []
    for name, (shape, dtype) in specs.items():
        g = grads[name]
        if not isinstance(g, (np.ndarray, np.number, numbers.Real)) or isinstance(g, bool):
            raise PushRejected(f"{where}: gradient for {name!r} is a {_describe(g)}, "
                               "not a numpy array")
        g = np.asarray(g)
        if str(g.dtype) != dtype:
            raise PushRejected(f"{where}: gradient for {name!r} has dtype {g.dtype}, the "
                               f"parameter {dtype} (cast it with .astype({dtype!r}))")
        if g.shape != shape:
            raise PushRejected(f"{where}: gradient for {name!r} has shape {g.shape}, the "
                               f"parameter {shape}")
        if check_finite and not np.all(np.isfinite(g)):
            raise PushRejected(f"{where}: gradient for {name!r} has NaN or inf values")
        out.append(np.array(g, copy=True) if copy else np.ascontiguousarray(g))
    return out


def check_seq(seq):
    return _number(seq, "seq", "the worker's push counter", PushRejected, integer=True, low=0)


def check_weight(weight):
    return _number(weight, "weight", "the examples behind the gradient, a finite number",
                   PushRejected, low=0, low_open=True)


def check_worker_id(worker_id):
    if not isinstance(worker_id, (str, numbers.Integral)) or isinstance(worker_id, bool):
        raise PushRejected(f"worker ids must be strings or integers, got {worker_id!r}")
    return worker_id


def check_version(version, where):
    if isinstance(version, bool) or not isinstance(version, numbers.Integral):
        raise PushRejected(f"{where}: version must be the integer shard version the gradient "
                           f"was computed from (from pull()), got {version!r}")
    return int(version)


# ------------------------------------------------------------------ the rule


def learning_rate_kind(update_rule, rule_kwargs):
    """(kind, value) of the rule's learning rate: "number", "schedule", "symbolic" or "none"."""
    if "learning_rate" in rule_kwargs:
        value = rule_kwargs["learning_rate"]
    else:
        try:
            sig = inspect.signature(update_rule)
        except (TypeError, ValueError):
            return "none", None
        param = sig.parameters.get("learning_rate")
        if param is None:
            return "none", None
        value = param.default
        if value is inspect.Parameter.empty or value is None:
            raise TypeError("the update rule needs a learning_rate: pass it in rule_kwargs")
    if isinstance(value, Variable):
        return "symbolic", value
    if callable(value):
        return "schedule", value
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.number, np.ndarray)):
        raise TypeError("learning_rate must be a number, a symbolic scalar or a schedule "
                        "(a callable of the symbolic step, see lasagne_accum.schedules), "
                        f"got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"learning_rate must be a finite number >= 0, got {value}")
    return "number", value


