"""What a request to a shard process may hold, checked before any of it is used.

Requests travel as Dask messages (:mod:`~lasagne_accum.distributed.dask.transport`):
Dask decodes them, and the shard process then refuses anything that is not a
request this library sends. A request is data: ``[method, arguments]`` made
of lists (or tuples), dicts with ``str`` keys, ``str``, ``int``, ``float``,
``bool``, ``None`` and numeric numpy arrays; :func:`check_request` names the
first field that is anything else, then checks the request's shape (method
from a fixed set, argument counts) and a push's fields with the caller's own
checks (:mod:`lasagne_accum.distributed.checks`: shard names, worker ids,
sequence numbers, weights, versions, gradients), which give the same
message on both sides of the wire.
"""

import numpy as np

from ..checks import check_arrays, check_seq, check_shard_name, check_version, check_weight, \
    check_worker_id
from ..errors import PushRejected

__all__ = ["BadRequest", "check_request", "METHODS", "SHARD_METHODS"]

_KINDS = "biufc"           # dtype kinds a request's array may have
_MAX_DEPTH = 16            # nesting a request may have (ours has at most 6)

#: The requests a shard process serves, with the number of arguments of each.
METHODS = {"call": 2, "check": 1, "push": 3, "pid": 0}
#: The shard methods a ``"call"`` request may run, with the number of their arguments.
SHARD_METHODS = {"register": 1, "next_seq": 1, "unregister": 1, "pull": 0, "stats": 0,
                 "state": 0, "state_specs": 0, "load": 1, "note_rejected": 0, "averages": 0}


class BadRequest(ValueError):
    """A request that is not one this library sends: refused before any of it was used."""


def _data(x, where, depth=0):
    """Refuse anything in `x` but names, numbers, numeric arrays, lists and str-keyed dicts."""
    if depth > _MAX_DEPTH:
        raise BadRequest(f"{where}: nested deeper than {_MAX_DEPTH}")
    kind = type(x)
    if x is None or kind in (str, int, float, bool):
        return
    if kind is np.ndarray:
        if x.dtype.kind not in _KINDS or x.dtype.fields is not None:
            raise BadRequest(f"{where}: an array of dtype {x.dtype} (only numeric arrays "
                             "are sent)")
        return
    if kind in (list, tuple):
        for i, item in enumerate(x):
            _data(item, f"{where}[{i}]", depth + 1)
        return
    if kind is dict:
        for key, item in x.items():
            if type(key) is not str:
                raise BadRequest(f"{where}: a key of type {type(key).__name__} (keys are str)")
            _data(item, f"{where}[{key[:100]!r}]", depth + 1)
        return
    raise BadRequest(f"{where}: a {kind.__name__} (a request holds names, numbers and "
                     "numeric arrays only)")


def _sequence(x, what):
    if type(x) not in (list, tuple):
        raise BadRequest(f"{what} must be a list, not {type(x).__name__}")
    return x


def _shard_calls(calls, specs, what):
    """``[(name, args)]`` with known, distinct shard names (str) and list arguments."""
    calls = _sequence(calls, what)
    if not calls:
        raise BadRequest(f"{what} is empty")
    seen = set()
    for call in calls:
        if type(call) not in (list, tuple) or len(call) != 2:
            raise BadRequest(f"each entry of {what} must be a [shard name, arguments] pair")
        name, args = call
        check_shard_name(name, specs)
        if name in seen:
            raise BadRequest(f"shard {name!r} appears twice in one request")
        seen.add(name)
        _sequence(args, f"the arguments for shard {name!r}")
    return calls


def _push_args(args, specs, name, with_arrays):
    """A push's (or a check's) values for shard `name`, checked as the caller checks them."""
    if len(args) != 5:
        raise BadRequest(f"a push to shard {name!r} takes 5 values, got {len(args)}")
    wid, seq, arrays, weight, version = args
    where = f"shard {name!r}"
    wid, seq = check_worker_id(wid), check_seq(seq)
    if not with_arrays:
        if arrays is not None or weight is not None:
            raise BadRequest("a check carries no gradients")
        return wid, seq, None, None, check_version(version, where)
    weight = check_weight(weight)
    arrays = tuple(check_arrays(arrays, specs[name], where, finite=False))
    return wid, seq, arrays, weight, check_version(version, where)


def check_request(request, specs):
    """``(method, args)`` of a decoded request, once its contents and shape are checked.

    A push's (and a check's) values are those the checks of
    :mod:`lasagne_accum.distributed.checks` return (a weight as a float...).
    Whether its gradients are finite is the shards' question
    (``check_finite``), answered by a refusal like any other push's.

    Parameters
    ----------
    request : object
        The request as Dask decoded it.
    specs : dict
        ``{shard name: {param name: (shape, dtype)}}`` of the shards this
        process holds under the request's key.

    Raises
    ------
    BadRequest
        The request is not one this library sends; the message names the
        field that is wrong without quoting the request (a push's field with
        the message the caller's check gives).
    """
    try:
        return _checked(request, specs)
    except PushRejected as exc:
        raise BadRequest(str(exc)) from None


def _checked(request, specs):
    _data(request, "request")
    if type(request) not in (list, tuple) or len(request) != 2:
        raise BadRequest("a request must be a [method, arguments] pair")
    method, args = request
    if type(method) is not str or method not in METHODS:
        raise BadRequest(f"unknown request method (one of {', '.join(METHODS)})")
    if type(args) not in (list, tuple) or len(args) != METHODS[method]:
        raise BadRequest(f"request {method!r} takes a list of {METHODS[method]} arguments")
    if method == "call":
        shard_method, calls = args
        if type(shard_method) is not str or shard_method not in SHARD_METHODS:
            raise BadRequest(f"unknown shard method (one of {', '.join(SHARD_METHODS)})")
        for name, call_args in _shard_calls(calls, specs, "a call's shard list"):
            if len(call_args) != SHARD_METHODS[shard_method]:
                raise BadRequest(f"{shard_method}() takes {SHARD_METHODS[shard_method]} "
                                 f"arguments, got {len(call_args)}")
            if shard_method in ("register", "next_seq", "unregister"):
                check_worker_id(call_args[0])
            elif shard_method == "load":
                state = call_args[0]
                if type(state) is not dict or not all(type(v) is np.ndarray
                                                      for v in state.values()):
                    raise BadRequest("load() takes a dict {name: numpy array}")
    elif method in ("check", "push"):
        calls = tuple((name, _push_args(call_args, specs, name, method == "push"))
                      for name, call_args in _shard_calls(args[0], specs,
                                                          f"a {method}'s shard list"))
        if method == "push" and not all(type(flag) is bool for flag in args[1:]):
            raise BadRequest("a push's pull and wait flags must be bools")
        args = (calls,) + tuple(args[1:])
    return method, args
