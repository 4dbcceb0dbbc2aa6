"""The parameter server's input checks: parameters, shard plans, pushes, learning rates.

A push is checked field by field by the functions here, on the caller's side
and, across the wire, in the shard process
(:mod:`~lasagne_accum.distributed.dask.schema`): one refusal, one message,
on both sides; each raises :class:`~lasagne_accum.distributed.PushRejected`.
Everything here is plain Python and numpy: no PyTensor graph is built.
"""

import contextlib
import inspect
import numbers
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable

from .._checks import FLOAT_DTYPES, INT64_MAX, check_integer, check_number, check_range, \
    check_real, shown
from .errors import PushRejected


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
        if dtype not in FLOAT_DTYPES:
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


@contextlib.contextmanager
def _refusing(what, where=""):
    """A check's TypeError or ValueError as a PushRejected that says what the field is."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        raise PushRejected(f"{where}{exc} ({what})") from None


def check_worker_id(worker_id):
    """A worker id: a str or an int that fits an int64."""
    if isinstance(worker_id, (bool, np.bool_)) or not isinstance(worker_id,
                                                                  (str, numbers.Integral)):
        raise PushRejected(f"a worker id must be a str or an int, got {type(worker_id).__name__}")
    if isinstance(worker_id, numbers.Integral) and abs(int(worker_id)) > INT64_MAX:
        raise PushRejected(f"a worker id must fit an int64, got {shown(worker_id)}")
    return worker_id


def check_shard_name(name, shards):
    """`name`, one of `shards`."""
    if not isinstance(name, str):
        raise PushRejected(f"a shard name must be a str, got {type(name).__name__}")
    if name not in shards:
        raise PushRejected(f"unknown shard {name[:100]!r} (shards: {', '.join(shards)})")
    return name


def check_seq(seq):
    with _refusing("the worker's push counter"):
        return check_range(check_integer(seq, "seq"), "seq", low=0, high=INT64_MAX)


def check_weight(weight):
    with _refusing("the examples behind the gradient"):
        return check_range(check_real(weight, "weight"), "weight", low=0, low_open=True)


def check_version(version, where):
    """An integer; the shard says whether that version exists."""
    with _refusing("the shard version the gradient was computed from, from pull()", where + ": "):
        return check_range(check_integer(version, "version"), "version", low=-INT64_MAX,
                           high=INT64_MAX)


def check_names(grads, names, where=""):
    """`grads`, a dict whose keys are among `names`."""
    if not isinstance(grads, Mapping):
        raise PushRejected(f"{where}grads must be a dict {{parameter name: array}}, got "
                           f"{type(grads).__name__}")
    unknown = [k for k in grads if k not in names]
    if unknown:
        raise PushRejected(f"{where}unknown parameter name(s) {', '.join(map(repr, unknown))} "
                           f"(parameters: {', '.join(names)})")
    return grads


def check_gradient(g, name, spec, where, finite=True):
    """A numpy array of its parameter's ``(shape, dtype)`` `spec`, finite with `finite`."""
    if not isinstance(g, (np.ndarray, np.generic)):
        raise PushRejected(f"{where}: the gradient of {name!r} is a {type(g).__name__}, not a "
                           "numpy array")
    shape, dtype = spec
    if g.dtype != dtype or g.shape != tuple(shape):
        wrong = f"dtype {g.dtype}" if g.dtype != dtype else "the wrong shape"
        cast = f" (cast it with .astype({dtype!r}))" if g.dtype != dtype else ""
        raise PushRejected(f"{where}: the gradient of {name!r} has {wrong}: it must be a {dtype}"
                           f"{list(shape)} array, got a {g.dtype}{list(g.shape)} array{cast}")
    return check_finite_gradient(g, name, where) if finite else g


def check_finite_gradient(g, name, where):
    """`g`, a numeric array, refused if it holds NaN or inf."""
    if not np.isfinite(g).all():
        raise PushRejected(f"{where}: the gradient of {name!r} has NaN or inf values")
    return g


def check_arrays(arrays, specs, where, finite=True):
    """A shard's gradients as the wire has them: a list in the order of its ``{name: (shape,
    dtype)}`` `specs` (None, or the end of a short list, is a missing one)."""
    if not isinstance(arrays, (list, tuple)):
        raise PushRejected(f"{where}: the gradients must be a list, got {type(arrays).__name__}")
    if len(arrays) > len(specs):
        raise PushRejected(f"{where}: {len(arrays)} gradients for {len(specs)} parameters")
    missing = [n for i, n in enumerate(specs) if i >= len(arrays) or arrays[i] is None]
    if missing:
        raise PushRejected(f"{where}: no gradient for {', '.join(map(repr, missing))} "
                           f"({len(specs)} parameter{'s' * (len(specs) > 1)}, "
                           f"{len(specs) - len(missing)} given)")
    return [check_gradient(g, n, spec, where, finite)
            for g, (n, spec) in zip(arrays, specs.items())]


def check_grads(grads, specs, where, check_finite=True, copy=True):
    """:func:`check_arrays` of ``{name: array}`` (a number is a 0-d array), in spec order.

    With `copy` (the default) each is a copy, the only one on the way in;
    without, a C-contiguous array (the caller's own where it is one), for a
    server that sends the push away at once.
    """
    check_names(grads, specs, where + ": ")
    arrays = [grads.get(n) for n in specs]
    arrays = check_arrays([np.asarray(g) if isinstance(g, numbers.Real) and not isinstance(
        g, bool) else g for g in arrays], specs, where, check_finite)
    if copy:
        return [np.array(g) for g in arrays]
    # (np.ascontiguousarray would make a 0-d array 1-d)
    return [np.asarray(g) if g.flags.c_contiguous else np.array(g, order="C") for g in arrays]


def aligned(a):
    """`a`, copied if it is an unaligned numpy array (a view of a Dask message may be one;
    PyTensor's C code refuses those)."""
    return np.array(a) if isinstance(a, np.ndarray) and not a.flags.aligned else a


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
    return "number", check_number(value, "learning_rate", low=0)


