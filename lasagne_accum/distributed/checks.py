"""Input checks, the server's options and the exceptions of the parameter server.

Everything here is plain Python and numpy: no PyTensor graph is built.
"""

import dataclasses
import inspect
import math
import numbers
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable

from .._checks import check_number

# The public names, re-exported by lasagne_accum.distributed (MODES, MERGES: by name).
__all__ = [
    "ServerOptions",
    "PushRejected",
    "UnknownWorkerError",
    "StalePushError",
    "RoundFailedError",
    "RoundTimeoutError",
    "ServerTimeoutError",
    "ShardLostError",
    "ServerClosedError",
]

MODES = ("sync", "async")
MERGES = ("mean", "sum")
_FLOAT_DTYPES = ("float16", "float32", "float64")


class PushRejected(ValueError):
    """A push (or pull) with bad input; the server's state was not changed."""


class UnknownWorkerError(PushRejected):
    """A push or pull from a worker id that is not registered (or was dropped)."""


class StalePushError(PushRejected):
    """Sync mode: a push computed from a version other than the open round's."""


class RoundFailedError(RuntimeError):
    """A sync round (or an async push) could not be applied; nothing of it was applied.

    Raised to every pusher of the round. The server keeps serving: the same
    pushes (same ``(worker, seq)``) may be sent again.
    """


class RoundTimeoutError(RoundFailedError):
    """Sync mode, ``on_timeout="fail"``: a round timed out and was discarded."""


class ServerTimeoutError(TimeoutError):
    """A blocking call waited longer than the server's ``wait_timeout``; the message says for what."""


class ShardLostError(RuntimeError):
    """A process holding shards did not answer: their state since the last checkpoint is lost."""


class ServerClosedError(RuntimeError):
    """A call on a server after its ``close()`` (a Dask server's shards are released then)."""


def _number(value, name, what, error=ValueError, **bounds):
    """:func:`~lasagne_accum._checks.check_number`, its refusal re-raised as `error`.

    The message says what the number is (`what`), after the checker's own.
    """
    try:
        return check_number(value, name, **bounds)
    except (TypeError, ValueError) as exc:
        raise error(f"{exc} ({what})") from None


def _check_seconds(value, name, allow_none=True):
    if value is None and allow_none:
        return None
    what = "a number of seconds" + (", or None" if allow_none else "")
    return _number(value, name, what, low=0, low_open=True)


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """The options of a parameter server and its shards, checked once.

    Attributes
    ----------
    mode : {"sync", "async"}
        Sync: a round closes when every live worker has pushed and applies
        their merged gradient once. Async: every push is applied on arrival.
    merge : {"mean", "sum"}
        Sync mode: the mean weighted by each push's examples (exactly the
        large-batch gradient) or the plain sum.
    staleness_scale : bool
        Async mode: multiply each step by ``1 / max(1, staleness)``.
    round_timeout : float or None
        Sync mode: seconds after a round's first push before it stops waiting
        for missing workers.
    on_timeout : {"close", "fail"}
        "close": apply the pushes received and drop the missing workers;
        "fail": discard the round, drop them, raise :class:`RoundTimeoutError`.
    compile_mode : str or None
        PyTensor mode of the apply functions (default: see
        :func:`lasagne_accum.default_modes`).
    check_finite : bool
        Reject gradients with NaN or inf.
    keep_log : bool
        Keep the order of applied pushes per shard (``stats()["shards"][s]["log"]``).
    wait_timeout : float
        The longest any blocking call (push, pull, register, a sync round's
        wait, a Dask gather) waits before :class:`ServerTimeoutError` names
        what it waited for.
    model_average, ema : dict or None
        Keyword arguments of :class:`lasagne_accum.ModelAverage` and
        :class:`lasagne_accum.ExponentialMovingAverage`: each shard keeps the
        average of its parameters over its optimizer steps.

    Examples
    --------
    >>> ServerOptions(mode="async").merge
    'mean'
    >>> ServerOptions(mode="sync", staleness_scale=True)
    Traceback (most recent call last):
    ...
    ValueError: staleness_scale=True only applies to mode='async' (a sync push is never stale)
    """

    mode: str = "sync"
    merge: str = "mean"
    staleness_scale: bool = False
    round_timeout: float | None = None
    on_timeout: str = "close"
    compile_mode: str | None = None
    check_finite: bool = True
    keep_log: bool = False
    wait_timeout: float = 600.0
    model_average: Any = None
    ema: Any = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if self.merge not in MERGES:
            raise ValueError(f"merge must be 'mean' or 'sum', got {self.merge!r}")
        if self.staleness_scale and self.mode != "async":
            raise ValueError("staleness_scale=True only applies to mode='async' "
                             "(a sync push is never stale)")
        object.__setattr__(self, "staleness_scale", bool(self.staleness_scale))
        object.__setattr__(self, "round_timeout",
                           _check_seconds(self.round_timeout, "round_timeout"))
        object.__setattr__(self, "wait_timeout",
                           _check_seconds(self.wait_timeout, "wait_timeout", allow_none=False))
        if self.on_timeout not in ("close", "fail"):
            raise ValueError(f"on_timeout must be 'close' or 'fail', got {self.on_timeout!r}")
        for label in ("model_average", "ema"):
            kwargs = getattr(self, label)
            if kwargs is None:
                continue
            if not isinstance(kwargs, Mapping):
                raise TypeError(f"{label} must be a dict of keyword arguments, got "
                                f"{type(kwargs).__name__}")
            taken = {"params", "updates", "is_step", "host_mode"} & set(kwargs)
            if taken:
                raise TypeError(f"{label}: {', '.join(sorted(taken))} are the server's to "
                                "set (each shard averages its own parameters at each of "
                                "its steps); leave them out")
            object.__setattr__(self, label, dict(kwargs))
        if self.compile_mode is not None and not isinstance(self.compile_mode, str):
            raise TypeError(f"compile_mode must be a PyTensor mode name or None, got "
                            f"{self.compile_mode!r}")

    @classmethod
    def of(cls, options=None, **kwargs):
        """`options` (a :class:`ServerOptions` or None) with `kwargs` replaced."""
        if options is None:
            return cls(**kwargs)
        if not isinstance(options, cls):
            raise TypeError(f"options must be a ServerOptions, got {type(options).__name__}")
        return dataclasses.replace(options, **kwargs) if kwargs else options


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
                        f"callable(step) -> number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"learning_rate must be a finite number >= 0, got {value}")
    return "number", value


