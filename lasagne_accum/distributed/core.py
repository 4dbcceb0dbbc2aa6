"""Engine-free parameter-server logic: shards, the in-process server, the worker.

A :class:`Shard` owns some parameters, the update rule's state for them and
one compiled apply function; it serializes its own updates with a lock. A
server (:class:`ParameterServer` here, ``DaskParameterServer`` in
:mod:`lasagne_accum.distributed.dask`) routes each push to its shards and
validates everything first, so a rejected push changes nothing. A
:class:`Worker` pulls parameters, computes (and optionally accumulates)
gradients with its own compiled function and pushes them.

Two modes:

* ``"sync"``: a round closes when every live worker has pushed; the shard
  applies the merged gradient once (``merge="mean"``: the mean weighted by the
  examples behind each push, which is exactly the gradient of the
  concatenated batches; ``"sum"``: the plain sum of the pushes).
* ``"async"``: each push is applied on arrival. Each push carries the version
  it was computed from; ``staleness = version now - that version`` is
  recorded, and ``staleness_scale=True`` multiplies the step by
  ``1 / max(1, staleness)``.

Versions are per shard: shard k's version counts the optimizer steps it has
taken. ``pull()`` returns a tuple of them, in ``server.shard_names`` order.
"""

import inspect
import itertools
import math
import numbers
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable

from ..accumulate import accumulate_gradients
from ..state import collect_state, load_state, save_state
from ..training import default_modes

__all__ = [
    "ParameterServer",
    "Shard",
    "Worker",
    "PushRejected",
    "UnknownWorkerError",
    "StalePushError",
    "RoundTimeoutError",
    "MODES",
    "MERGES",
]

MODES = ("sync", "async")
MERGES = ("mean", "sum")
_FLOAT_DTYPES = ("float16", "float32", "float64")
_KEEP_RESULTS = 256          # sync round results kept for late waiters


class PushRejected(ValueError):
    """A push (or pull) with bad input; the server's state was not changed."""


class UnknownWorkerError(PushRejected):
    """A push or pull from a worker id that is not registered (or was dropped)."""


class StalePushError(PushRejected):
    """Sync mode: a push computed from a version other than the open round's."""


class RoundTimeoutError(RuntimeError):
    """Sync mode, ``on_timeout="fail"``: a round timed out and was discarded."""


# ------------------------------------------------------------------ helpers


def _check_options(mode, merge, staleness_scale, round_timeout, on_timeout):
    if mode not in MODES:
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
    if merge not in MERGES:
        raise ValueError(f"merge must be 'mean' or 'sum', got {merge!r}")
    if staleness_scale and mode != "async":
        raise ValueError("staleness_scale=True only applies to mode='async' "
                         "(a sync push is never stale)")
    if round_timeout is not None:
        if isinstance(round_timeout, bool) or not isinstance(round_timeout, numbers.Real) \
                or not round_timeout > 0 or not math.isfinite(round_timeout):
            raise ValueError(f"round_timeout must be a number of seconds > 0 or None, "
                             f"got {round_timeout!r}")
    if on_timeout not in ("close", "fail"):
        raise ValueError(f"on_timeout must be 'close' or 'fail', got {on_timeout!r}")


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


def _describe(x):
    return type(x).__name__ if not hasattr(x, "dtype") else f"{x.dtype} array"


def check_grads(grads, specs, where, check_finite=True):
    """Validate ``{name: array}`` against ``{name: (shape, dtype)}``; return copies in spec order."""
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
        out.append(np.array(g, copy=True))
    return out


def check_seq(seq):
    if isinstance(seq, bool) or not isinstance(seq, (numbers.Integral,)) or seq < 0:
        raise PushRejected(f"seq must be an integer >= 0 (the worker's push counter), "
                           f"got {seq!r}")
    return int(seq)


def check_weight(weight):
    if isinstance(weight, bool) or not isinstance(weight, (numbers.Real, np.number)) \
            or not math.isfinite(float(weight)) or float(weight) <= 0:
        raise PushRejected(f"weight must be a finite number > 0 (the examples behind the "
                           f"gradient), got {weight!r}")
    return float(weight)


def check_worker_id(worker_id):
    if not isinstance(worker_id, (str, numbers.Integral)) or isinstance(worker_id, bool):
        raise PushRejected(f"worker ids must be strings or integers, got {worker_id!r}")
    return worker_id


class _Seen:
    """The set of a worker's applied sequence numbers, compacted below a floor."""

    __slots__ = ("floor", "above")

    def __init__(self):
        self.floor, self.above = -1, set()

    def __contains__(self, seq):
        return seq <= self.floor or seq in self.above

    def add(self, seq):
        self.above.add(seq)
        while self.floor + 1 in self.above:
            self.floor += 1
            self.above.discard(self.floor)


def _learning_rate(update_rule, rule_kwargs):
    """(kind, value) of the rule's learning rate: number, schedule, symbolic, or none."""
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


def _rule_name(rule):
    return getattr(rule, "__name__", None) or getattr(getattr(rule, "func", None),
                                                      "__name__", repr(rule))


# -------------------------------------------------------------------- shard


class Shard:
    """Some parameters, the rule's state for them, and one compiled apply function.

    All methods are thread-safe: one lock serializes the shard's updates
    (different shards update in parallel). A server (local or Dask) creates
    shards; you rarely call them directly.

    Parameters
    ----------
    name : str
        The shard's name; it prefixes the rule's shard-level state in
        checkpoints (``W1/adam.t``).
    params : dict
        ``{name: ndarray or shared variable}`` (shared variables are used as
        they are and updated in place).
    update_rule : callable
        ``update_rule(grads, params, **rule_kwargs)`` returning an update
        dictionary (:func:`lasagne_accum.adam`, a partial, your own). It is
        called once for this shard, so its step counter (``adam.t``) is the
        shard's own.
    rule_kwargs : dict, optional
        Hyperparameters. ``learning_rate`` may be a number, a symbolic scalar
        (a shared variable you change between steps; in-process only) or a
        callable ``schedule(step) -> float`` evaluated at every step of the
        shard with its step count (0 for the first step).
    mode, merge, staleness_scale, round_timeout, on_timeout, compile_mode,
    check_finite, keep_log
        See :class:`ParameterServer`.
    """

    def __init__(self, name, params, update_rule, rule_kwargs=None, *, mode="sync",
                 merge="mean", staleness_scale=False, round_timeout=None, on_timeout="close",
                 compile_mode=None, check_finite=True, keep_log=False):
        _check_options(mode, merge, staleness_scale, round_timeout, on_timeout)
        if not callable(update_rule):
            raise TypeError(f"update_rule must be callable, got {type(update_rule).__name__}")
        self.name = name
        self.mode, self.merge = mode, merge
        self.staleness_scale = bool(staleness_scale)
        self.round_timeout, self.on_timeout = round_timeout, on_timeout
        self.check_finite, self.keep_log = check_finite, keep_log
        named = named_params(params)
        self.params = OrderedDict(
            (n, p if isinstance(p, SharedVariable) else pytensor.shared(p, name=n))
            for n, p in named.items())
        self.specs = param_specs(self.params)
        self._build(update_rule, dict(rule_kwargs or {}), compile_mode)

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._version = 0            # optimizer steps taken
        self._applied = 0            # pushes applied (async) or merged (sync)
        self._live = OrderedDict()   # worker id -> True
        self._dropped = {}           # worker id -> reason
        self._seen = {}              # worker id -> _Seen
        self._last = {}              # worker id -> (seq, round id) of its last sync push
        self._pending = OrderedDict()  # worker id -> (seq, grads, weight)
        self._round = 0              # id of the open (or next) sync round
        self._round_started = None
        self._results = OrderedDict()
        self._stats = dict(received=0, duplicates=0, rejected=0, bytes=0, examples=0.0,
                           rounds=0, timeouts=0, failed_rounds=0)
        self._staleness = {}
        self._log = []

    # ---------------------------------------------------------------- build

    def _build(self, update_rule, rule_kwargs, compile_mode):
        params = list(self.params.values())
        grads = [pt.tensor(dtype=p.type.dtype, shape=np.shape(p.get_value(borrow=True)),
                           name=f"{n}.grad") for n, p in self.params.items()]
        factor = pt.dscalar(f"{self.name}.lr_factor")
        kind, base = _learning_rate(update_rule, rule_kwargs)
        self._lr_kind, self._lr_base = kind, base
        used = grads
        if kind == "none":
            used = [g * pt.cast(factor, g.type.dtype) for g in grads]
        elif kind == "symbolic":
            rule_kwargs["learning_rate"] = base * factor
        else:
            rule_kwargs["learning_rate"] = factor
        updates = update_rule(used, params, **rule_kwargs)
        if not isinstance(updates, Mapping):
            raise TypeError(f"update_rule {_rule_name(update_rule)} returned "
                            f"{type(updates).__name__}, not an update dictionary")
        for n, p in self.params.items():
            if p not in updates:
                raise ValueError(f"update_rule {_rule_name(update_rule)} does not update "
                                 f"parameter {n!r}")
        prefixes = tuple(f"{n}." for n in self.params)
        for i, var in enumerate(updates):
            if not isinstance(var, SharedVariable):
                raise TypeError(f"update_rule {_rule_name(update_rule)} returned a key "
                                f"{var!r} that is not a shared variable")
            if var.name in self.params and self.params[var.name] is var:
                continue
            if not (var.name or "").startswith(prefixes):
                # shard-level state (adam.t): one per shard, named after it
                var.name = f"{self.name}/{var.name or f'state{i}'}"
        self.updates = OrderedDict(updates)
        mode = compile_mode or default_modes()[1]
        self._fn = pytensor.function(grads + [factor], [], updates=self.updates, mode=mode)
        self._warm_up()

    def _warm_up(self):
        """Call the apply function once (JIT backends compile on the first call), then undo it."""
        saved = [(var, var.get_value(borrow=False)) for var in self.updates]
        try:
            self._fn(*[np.zeros(shape, dtype) for shape, dtype in self.specs.values()], 0.0)
        finally:
            for var, value in saved:
                var.set_value(value)

    def _lr_factor(self, scale):
        """The value fed to the apply function's factor input (checked first)."""
        if self._lr_kind == "number":
            return self._lr_base * scale
        if self._lr_kind == "schedule":
            value = self._lr_base(self._version)
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"learning-rate schedule returned {value!r} at step "
                                 f"{self._version}, not a number") from None
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"learning-rate schedule returned {value} at step "
                                 f"{self._version}; it must be finite and >= 0")
            return value * scale
        return scale

    # ---------------------------------------------------------------- workers

    def register(self, worker_id):
        """Add a live worker (idempotent); return ``(version, {name: array})``."""
        check_worker_id(worker_id)
        with self._cond:
            self._expire()
            self._live[worker_id] = True
            self._dropped.pop(worker_id, None)
            self._seen.setdefault(worker_id, _Seen())
            return self._version, self._copy()

    def unregister(self, worker_id):
        """Remove a worker from the live set (a sync round may close now).

        Returns True if it was live. Its pending sync push, if any, stays in
        the round.
        """
        with self._cond:
            was = self._live.pop(worker_id, None) is not None
            if self._pending and self._complete():
                self._close_round(timed_out=False)
            self._cond.notify_all()
            return was

    def workers(self):
        with self._lock:
            return list(self._live)

    def _require_live(self, worker_id):
        if worker_id not in self._live:
            reason = self._dropped.get(worker_id)
            why = f" ({reason})" if reason else ""
            raise UnknownWorkerError(f"shard {self.name!r}: worker {worker_id!r} is not "
                                     f"registered{why}; call register({worker_id!r}) first")

    # ---------------------------------------------------------------- pull

    def pull(self):
        """``(version, {name: array copy})`` of this shard."""
        with self._cond:
            self._expire()
            return self._version, self._copy()

    def version(self):
        with self._cond:
            self._expire()
            return self._version

    def _copy(self):
        return {n: p.get_value(borrow=False) for n, p in self.params.items()}

    # ---------------------------------------------------------------- push

    def push(self, worker_id, seq, grads, weight=1.0, version=None, pull=False):
        """Apply (async) or add to the open round (sync) one worker's gradients.

        Parameters
        ----------
        worker_id : str or int
            A registered worker.
        seq : int
            The worker's push counter: a second push with the same
            ``(worker_id, seq)`` (a retry) is not applied again.
        grads : dict
            ``{parameter name: array}`` for every parameter of the shard, of
            the parameter's shape and dtype.
        weight : float
            Examples behind the gradient (its weight in the sync mean).
        version : int
            The shard version the gradient was computed from.
        pull : bool
            Also return the parameters after the push (``params``), saving a
            :meth:`pull` (async mode, or the push that closes a sync round).

        Returns
        -------
        dict
            ``applied`` (the push changed the parameters now: async, or the
            push that closed a sync round), ``duplicate``, ``staleness``
            (async), ``round`` (sync: the id to pass to :meth:`wait_round`),
            ``version`` (the shard's version after the call).

        Raises
        ------
        PushRejected
            Bad input (names, shape, dtype, non-finite values, weight, seq,
            version); ``UnknownWorkerError`` for an unregistered worker,
            ``StalePushError`` for a sync push from another version. Nothing
            changes on the shard.
        """
        where = f"shard {self.name!r}"
        try:
            check_worker_id(worker_id)
            seq = check_seq(seq)
            weight = check_weight(weight)
            arrays = check_grads(grads, self.specs, where, self.check_finite)
            if isinstance(version, bool) or not isinstance(version, numbers.Integral):
                raise PushRejected(f"{where}: version must be the integer shard version the "
                                   f"gradient was computed from (from pull()), got {version!r}")
            version = int(version)
        except PushRejected:
            with self._lock:
                self._stats["rejected"] += 1
            raise
        with self._cond:
            try:
                self._expire()
                self._require_live(worker_id)
                if seq in self._seen[worker_id] or self._pending.get(worker_id, (None,))[0] == seq:
                    self._stats["duplicates"] += 1
                    last = self._last.get(worker_id)
                    return self._pulled(pull, dict(
                        applied=False, duplicate=True, staleness=None,
                        round=last[1] if last and last[0] == seq else None))
                if version < 0 or version > self._version:
                    raise PushRejected(f"{where}: version {version} does not exist (the shard "
                                       f"is at version {self._version})")
                if self.mode == "sync":
                    if version != self._version:
                        raise StalePushError(
                            f"{where}: push computed from version {version} but the open "
                            f"round is for version {self._version}; pull() and recompute")
                    if worker_id in self._pending:
                        raise PushRejected(f"{where}: worker {worker_id!r} already pushed "
                                           f"(seq {self._pending[worker_id][0]}) in this round")
            except PushRejected:
                self._stats["rejected"] += 1
                raise
            self._stats["received"] += 1
            self._stats["bytes"] += sum(a.nbytes for a in arrays)
            self._stats["examples"] += weight
            if self.mode == "async":
                return self._pulled(pull, self._apply_async(worker_id, seq, arrays, version))
            if not self._pending:
                self._round_started = time.monotonic()
            self._pending[worker_id] = (seq, arrays, weight)
            self._last[worker_id] = (seq, self._round)
            rid = self._round
            closed = self._complete() and self._close_round(timed_out=False)
            return self._pulled(pull and bool(closed), dict(
                applied=bool(closed), duplicate=False, staleness=0, round=rid))

    def _apply_async(self, worker_id, seq, arrays, version):
        staleness = self._version - version
        scale = 1.0 / max(1, staleness) if self.staleness_scale else 1.0
        self._fn(*arrays, self._lr_factor(scale))
        self._seen[worker_id].add(seq)
        self._version += 1
        self._applied += 1
        self._staleness[staleness] = self._staleness.get(staleness, 0) + 1
        if self.keep_log:
            self._log.append((worker_id, seq, staleness))
        return dict(applied=True, duplicate=False, staleness=staleness, round=None)

    def _pulled(self, pull, result):
        result["version"] = self._version
        if pull:
            result["params"] = self._copy()
        return result

    # ---------------------------------------------------------------- sync rounds

    def _complete(self):
        return bool(self._pending) and all(w in self._pending for w in self._live)

    def _merged(self):
        order = sorted(self._pending, key=str)
        total = sum(self._pending[w][2] for w in order)
        merged = []
        for i, (shape, dtype) in enumerate(self.specs.values()):
            acc = np.zeros(shape, np.float64)
            for w in order:
                _, arrays, weight = self._pending[w]
                if self.merge == "mean":
                    acc += weight * arrays[i].astype(np.float64)
                else:
                    acc += arrays[i]
            if self.merge == "mean":
                acc /= total
            merged.append(acc.astype(dtype))
        return order, total, merged

    def _close_round(self, timed_out):
        """Apply the merged pending pushes; return the round's result."""
        order, total, merged = self._merged()
        missing = [w for w in self._live if w not in self._pending]
        self._fn(*merged, self._lr_factor(1.0))
        for w in order:
            self._seen[w].add(self._pending[w][0])
        if self.keep_log:
            self._log.append(tuple((w, self._pending[w][0]) for w in order))
        dropped = self._drop(missing, "dropped after missing the timeout of round "
                                      f"{self._round}") if timed_out else []
        self._version += 1
        self._applied += len(order)
        self._stats["rounds"] += 1
        self._stats["timeouts"] += bool(timed_out)
        result = dict(round=self._round, version=self._version, workers=order, weight=total,
                      timed_out=bool(timed_out), dropped=dropped)
        self._finish_round(result)
        return result

    def _fail_round(self):
        missing = [w for w in self._live if w not in self._pending]
        pushed = sorted(self._pending, key=str)
        self._drop(missing, f"dropped after missing the timeout of round {self._round}")
        for w in pushed:      # not applied: the same (worker, seq) may be pushed again
            if self._last.get(w, (None,))[0] == self._pending[w][0]:
                self._last.pop(w)
        self._stats["timeouts"] += 1
        self._stats["failed_rounds"] += 1
        message = (f"shard {self.name!r}: sync round {self._round} (version {self._version}) "
                   f"timed out after {self.round_timeout} s without a push from "
                   f"{', '.join(map(repr, missing))}; the round was discarded (nothing "
                   f"applied), those workers were dropped, and the server keeps serving: "
                   f"push again to retry")
        self._finish_round(RoundTimeoutError(message))

    def _drop(self, workers, reason):
        for w in workers:
            self._live.pop(w, None)
            self._dropped[w] = reason
        return list(workers)

    def _finish_round(self, result):
        self._results[self._round] = result
        while len(self._results) > _KEEP_RESULTS:
            self._results.popitem(last=False)
        self._pending.clear()
        self._round += 1
        self._round_started = None
        self._cond.notify_all()

    def _expire(self):
        """Close or fail a sync round past its timeout (called under the lock)."""
        if (self.round_timeout is None or not self._pending
                or time.monotonic() - self._round_started < self.round_timeout):
            return
        if self.on_timeout == "close":
            self._close_round(timed_out=True)
        else:
            self._fail_round()

    def _deadline_wait(self):
        if self.round_timeout is None or self._round_started is None:
            return None
        return max(0.0, self._round_started + self.round_timeout - time.monotonic())

    def wait_round(self, round_id, timeout=None, blocking=True, pull=False):
        """Wait for sync round `round_id` to close; return its result.

        Parameters
        ----------
        round_id : int
            From :meth:`push`.
        timeout : float, optional
            Give up after this many seconds and return None (the round's own
            ``round_timeout`` applies regardless). 0 checks once.
        blocking : bool
            False: return None at once if another thread holds the shard's
            lock (for callers that must not block, such as an event loop).
        pull : bool
            Also return the parameters (``params``) with the shard's current
            ``version``.

        Returns
        -------
        dict or None
            ``round``, ``version`` (after the round), ``workers`` (merged, in
            merge order), ``weight``, ``timed_out``, ``dropped``.

        Raises
        ------
        RoundTimeoutError
            The round timed out with ``on_timeout="fail"``.
        """
        if not self._lock.acquire(blocking):
            return None
        try:
            end = None if timeout is None else time.monotonic() + timeout
            while True:
                self._expire()
                if round_id in self._results:
                    result = self._results[round_id]
                    if isinstance(result, Exception):
                        raise RoundTimeoutError(str(result))
                    return self._pulled(pull, dict(result)) if pull else dict(result)
                if round_id < self._round:
                    return self._pulled(pull, dict(round=round_id, expired=True))
                if round_id > self._round:
                    raise ValueError(f"shard {self.name!r}: round {round_id} has not opened "
                                     f"(the open round is {self._round})")
                waits = [w for w in (self._deadline_wait(),
                                     None if end is None else end - time.monotonic())
                         if w is not None]
                wait = min(waits) if waits else None
                if end is not None and end - time.monotonic() <= 0:
                    return None
                self._cond.wait(wait if wait is None else max(wait, 1e-4))
        finally:
            self._lock.release()

    # ---------------------------------------------------------------- stats, state

    def stats(self):
        """Counters of this shard (a plain dict)."""
        with self._cond:
            self._expire()
            out = dict(self._stats, name=self.name, mode=self.mode, version=self._version,
                       applied=self._applied, pending=len(self._pending),
                       live_workers=list(self._live), dropped=dict(self._dropped),
                       staleness=dict(sorted(self._staleness.items())))
            if self.keep_log:
                out["log"] = list(self._log)
            return out

    def _counters_name(self):
        return f"{self.name}/counters"

    def state(self):
        """``{name: array}``: params, rule state and counters (a checkpoint's content)."""
        with self._lock:
            out = OrderedDict((n, v.get_value(borrow=False))
                              for n, v in collect_state(self.updates).items())
            out[self._counters_name()] = np.array([self._version, self._applied], np.int64)
            return out

    def load(self, arrays):
        """Set the state from :meth:`state`'s format; all checks first."""
        with self._lock:
            if self._pending:
                raise RuntimeError(f"shard {self.name!r}: cannot load a checkpoint while a "
                                   "sync round is open")
            named = collect_state(self.updates)
            expected = list(named) + [self._counters_name()]
            problems = []
            missing = [n for n in expected if n not in arrays]
            extra = [n for n in arrays if n not in expected]
            if missing:
                problems.append(f"missing: {', '.join(missing)}")
            if extra:
                problems.append(f"not in this shard: {', '.join(extra)}")
            for n, var in named.items():
                if n in arrays:
                    cur = np.asarray(var.get_value(borrow=True))
                    a = np.asarray(arrays[n])
                    if a.dtype != cur.dtype or a.shape != cur.shape:
                        problems.append(f"{n}: {a.dtype}{list(a.shape)} in the checkpoint, "
                                        f"{cur.dtype}{list(cur.shape)} here")
            counters = np.asarray(arrays.get(self._counters_name(), np.zeros(2, np.int64)))
            if counters.shape != (2,) or counters.dtype != np.int64:
                problems.append(f"{self._counters_name()}: expected 2 int64 values")
            if problems:
                raise ValueError(f"shard {self.name!r}: cannot load; nothing was loaded:\n  "
                                 + "\n  ".join(problems))
            for n, var in named.items():
                var.set_value(np.array(arrays[n], copy=True))
            self._version, self._applied = int(counters[0]), int(counters[1])
            self._round_started = None
            self._cond.notify_all()
            return expected


# ------------------------------------------------------------------ servers


class BaseServer:
    """Routing and validation shared by the in-process and Dask servers.

    Subclasses implement ``_call(indices, method, args_list)`` (run
    ``shard.method(*args)`` on each shard index, concurrently where possible,
    and return the results or raise the first error) and
    ``_wait(index, round_id)``.
    """

    mode = "sync"

    def _setup(self, named, shards, mode, merge, staleness_scale, round_timeout, on_timeout,
               check_finite):
        _check_options(mode, merge, staleness_scale, round_timeout, on_timeout)
        self.mode, self.merge = mode, merge
        self.check_finite = check_finite
        self.specs = param_specs(named)
        self.plan = plan_shards(self.specs, shards)
        self.shard_names = tuple(self.plan)
        self.names = tuple(self.specs)
        self._shard_of = {n: i for i, group in enumerate(self.plan.values()) for n in group}

    # ------------------------------------------------------------ routing

    def _targets(self, shards):
        if shards is None:
            return list(range(len(self.shard_names)))
        if isinstance(shards, str):
            shards = [shards]
        out = []
        for s in shards:
            if s not in self.plan:
                raise PushRejected(f"unknown shard {s!r} (shards: {', '.join(self.shard_names)})")
            out.append(self.shard_names.index(s))
        return sorted(set(out))

    def register(self, worker_id):
        """Register a worker on every shard; return ``(version, {name: array})``."""
        check_worker_id(worker_id)
        results = self._call(self._targets(None), "register", [(worker_id,)] * len(self.plan))
        return self._combine(results)

    def unregister(self, worker_id):
        """Remove a worker from every shard's live set (a sync round may close)."""
        results = self._call(self._targets(None), "unregister", [(worker_id,)] * len(self.plan))
        return any(results)

    def pull(self, shards=None):
        """``(version, {name: array})``; `version` is a tuple, one entry per shard.

        With `shards` (names), only those shards' params; other version
        entries are None.
        """
        idx = self._targets(shards)
        results = self._call(idx, "pull", [()] * len(idx))
        return self._combine(results, idx)

    def _combine(self, results, idx=None):
        idx = list(range(len(self.plan))) if idx is None else idx
        version = [None] * len(self.plan)
        values = {}
        for i, (v, arrays) in zip(idx, results):
            version[i] = v
            values.update(arrays)
        return tuple(version), {n: values[n] for n in self.names if n in values}

    def push(self, worker_id, seq, grads, weight=1.0, version=None, *, shards=None, wait=True,
             pull=False):
        """Push one worker's gradients to their shards.

        Parameters
        ----------
        worker_id : str or int
            A registered worker.
        seq : int
            The worker's push counter; a retry with the same ``(worker_id,
            seq)`` is applied once.
        grads : dict
            ``{parameter name: array}``: every parameter of the target shards,
            each of the parameter's shape and dtype.
        weight : float
            Examples behind the gradient: its weight in the sync mean.
        version : tuple of int
            The version from the :meth:`pull` the gradient was computed from.
        shards : list of str, optional
            Async mode: push to these shards only (default all).
        wait : bool
            Sync mode: return when the round has closed (default). False:
            return at once (the ``round`` entries say what to wait for).
        pull : bool
            Also return the target shards' parameters after the push (and
            after the round, in sync mode) as ``params``, with their versions
            in ``version``: one call instead of a push and a :meth:`pull`.

        Returns
        -------
        dict
            ``applied`` (every target shard applied it, or its round closed),
            ``duplicate`` (a retry: not applied again), ``staleness`` (the
            largest over the shards; async), ``version`` (tuple after the
            push), ``shards`` (per-shard results; in sync mode with `wait`,
            the round's result: merged ``workers``, ``timed_out``, ``dropped``).

        Raises
        ------
        PushRejected, UnknownWorkerError, StalePushError
            Bad input; nothing was applied anywhere.
        RoundTimeoutError
            Sync mode with ``on_timeout="fail"``: the round timed out.
        """
        idx = self._targets(shards)
        if self.mode == "sync" and len(idx) != len(self.plan):
            raise PushRejected("sync mode: a push must cover every shard")
        check_worker_id(worker_id)
        seq = check_seq(seq)
        weight = check_weight(weight)
        if isinstance(version, Mapping):
            version = tuple(version.get(s) for s in self.shard_names)
        if not isinstance(version, (tuple, list)) or len(version) != len(self.plan):
            raise PushRejected(f"version must be the tuple of {len(self.plan)} shard versions "
                               f"returned by pull() or register(), got {version!r}")
        if not isinstance(grads, Mapping):
            raise PushRejected(f"grads must be a dict {{parameter name: array}}, got "
                               f"{type(grads).__name__}")
        unknown = [k for k in grads if k not in self._shard_of]
        if unknown:
            raise PushRejected(f"unknown parameter name(s) {', '.join(map(repr, unknown))} "
                               f"(parameters: {', '.join(self.names)})")
        outside = [k for k in grads if self._shard_of[k] not in idx]
        if outside:
            raise PushRejected(f"gradient for {', '.join(map(repr, outside))} whose shard "
                               "this push does not target")
        args = []
        for i in idx:
            names = self.plan[self.shard_names[i]]
            sub = {n: grads[n] for n in names if n in grads}
            arrays = check_grads(sub, OrderedDict((n, self.specs[n]) for n in names),
                                 f"shard {self.shard_names[i]!r}", self.check_finite)
            v = version[i]
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise PushRejected(f"version[{i}] (shard {self.shard_names[i]!r}) must be an "
                                   f"integer, got {v!r}")
            args.append((worker_id, seq, dict(zip(names, arrays)), weight, int(v)))
        out_version = [None] * len(self.plan)
        per = OrderedDict()
        if self.mode == "sync" and wait:
            results, infos = self._push_wait(idx, args, pull)
            for i, r, info in zip(idx, results, infos):
                per[self.shard_names[i]] = r if info is None else dict(info,
                                                                       duplicate=r["duplicate"])
                out_version[i] = r["version"] if info is None else info["version"]
            applied = all(not r["duplicate"] for r in results)
        else:
            results = self._call(idx, "push", [a + (pull,) for a in args])
            for i, r in zip(idx, results):
                per[self.shard_names[i]] = r
                out_version[i] = r["version"]
            applied = all(r["applied"] for r in results)
        stal = [r["staleness"] for r in results if r.get("staleness") is not None]
        out = dict(applied=applied, duplicate=any(r["duplicate"] for r in results),
                   staleness=max(stal) if stal else None, version=tuple(out_version),
                   shards=per)
        if pull:
            params = {}
            missing = [i for i in idx if "params" not in per[self.shard_names[i]]]
            for i in idx:
                params.update(per[self.shard_names[i]].pop("params", {}))
            if missing:
                for i, (v, arrays) in zip(missing, self._call(missing, "pull",
                                                              [()] * len(missing))):
                    params.update(arrays)
                    out_version[i] = v
                out["version"] = tuple(out_version)
            out["params"] = {n: params[n] for n in self.names if n in params}
        return out

    def _push_wait(self, idx, args, pull):
        """Sync mode: push to each shard, then wait for its round: (results, infos)."""
        results = self._call(idx, "push", args)
        infos = [None if r.get("round") is None else self._wait(i, r["round"], pull)
                 for i, r in zip(idx, results)]      # round None: a retry of an old push
        return results, infos

    def wait(self, push_result):
        """Sync mode, after ``push(..., wait=False)``: wait for its rounds."""
        out = OrderedDict()
        for s, r in push_result["shards"].items():
            if r.get("round") is not None:
                out[s] = self._wait(self.shard_names.index(s), r["round"])
        return out

    def stats(self):
        """Per-shard counters and totals.

        ``applied`` is the number of pushes every shard has applied (merged
        in sync mode); ``version`` the tuple of shard versions.
        """
        per = self._call(self._targets(None), "stats", [()] * len(self.plan))
        hist = {}
        for s in per:
            for k, c in s["staleness"].items():
                hist[k] = hist.get(k, 0) + c
        return dict(
            mode=self.mode, version=tuple(s["version"] for s in per),
            applied=min(s["applied"] for s in per),
            rounds=min(s["rounds"] for s in per),
            timeouts=max(s["timeouts"] for s in per),
            received=max(s["received"] for s in per),
            duplicates=max(s["duplicates"] for s in per),
            rejected=max(s["rejected"] for s in per),
            bytes=sum(s["bytes"] for s in per),
            examples=max(s["examples"] for s in per),
            staleness=dict(sorted(hist.items())),
            live_workers=per[0]["live_workers"],
            shards=dict(zip(self.shard_names, per)),
        )

    def state(self):
        """``{name: array}`` of every shard: params, rule state, counters."""
        merged = OrderedDict()
        for part in self._call(self._targets(None), "state", [()] * len(self.plan)):
            for n, a in part.items():
                if n in merged:
                    raise ValueError(f"two shards hold state named {n!r}; rename it")
                merged[n] = a
        return merged

    def save(self, path):
        """Checkpoint params, rule state and counters to one ``.npz`` (atomic).

        Written with :func:`lasagne_accum.save_state`; parameters keep their
        names, so ``load_state(path, my_params, strict=False)`` reads them
        into a single-process model. Returns the names written.
        """
        holders = [pytensor.shared(a, name=n) for n, a in self.state().items()]
        return save_state(path, holders)

    def load(self, path):
        """Restore a checkpoint written by :meth:`save` (same params, shards and rule).

        Everything is checked before anything is set; registrations and the
        record of applied ``(worker, seq)`` ids are kept.
        """
        current = self.state()
        holders = [pytensor.shared(a, name=n) for n, a in current.items()]
        load_state(path, holders)
        loaded = OrderedDict((h.name, h.get_value(borrow=True)) for h in holders)
        parts = self._call(self._targets(None), "state", [()] * len(self.plan))
        self._call(self._targets(None), "load", [({n: loaded[n] for n in part},)
                                                 for part in parts])
        return list(loaded)

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ParameterServer(BaseServer):
    """A parameter server in this process: shards with locks, for threads.

    Parameters
    ----------
    params : dict or list
        ``{name: ndarray}`` (the server keeps copies), or a list of named
        shared variables (used as they are: the server updates them in place).
    update_rule : callable
        Any rule ``update_rule(grads, params, **rule_kwargs)``; it is called
        once per shard, so per-shard step counters (``adam.t``) make a split
        Adam exactly Adam in sync mode.
    rule_kwargs : dict, optional
        Hyperparameters; ``learning_rate`` may be a number, a shared variable
        or a callable ``schedule(step) -> float`` evaluated at each shard step.
    mode : {"sync", "async"}
        See the module docstring.
    shards : None, list of lists, or dict
        None: one shard per parameter. Else groups of parameter names (a rule
        that couples parameters, like a global norm clip, needs them in one
        shard).
    merge : {"mean", "sum"}
        Sync mode: the weighted mean of the round's pushes (exactly the
        large-batch gradient) or their plain sum.
    staleness_scale : bool
        Async mode: multiply each step by ``1 / max(1, staleness)``.
    round_timeout : float, optional
        Sync mode: seconds after a round's first push before it stops waiting
        for missing workers.
    on_timeout : {"close", "fail"}
        "close": apply the pushes received and drop the missing workers;
        "fail": discard the round, drop the missing workers and raise
        :class:`RoundTimeoutError` to the waiting pushers.
    compile_mode : str, optional
        PyTensor mode of the apply functions (default: Numba, see
        :func:`lasagne_accum.training.default_modes`).
    check_finite : bool
        Reject gradients with NaN or inf (default True).
    keep_log : bool
        Keep the arrival order of applied pushes per shard in ``stats()``
        (for tests and debugging).

    Examples
    --------
    >>> import numpy as np
    >>> from lasagne_accum import sgd
    >>> server = ParameterServer({"w": np.zeros(2)}, sgd, dict(learning_rate=0.5),
    ...                          mode="async", compile_mode="FAST_COMPILE")
    >>> version, params = server.register("a")
    >>> r = server.push("a", 0, {"w": np.array([1.0, 2.0])}, version=version)
    >>> server.pull()
    ((1,), {'w': array([-0.5, -1. ])})
    >>> server.push("a", 0, {"w": np.array([1.0, 2.0])}, version=version)["duplicate"]
    True
    """

    def __init__(self, params, update_rule, rule_kwargs=None, *, mode="sync", shards=None,
                 merge="mean", staleness_scale=False, round_timeout=None, on_timeout="close",
                 compile_mode=None, check_finite=True, keep_log=False):
        named = named_params(params)
        self._setup(named, shards, mode, merge, staleness_scale, round_timeout, on_timeout,
                    check_finite)
        opts = dict(mode=mode, merge=merge, staleness_scale=staleness_scale,
                    round_timeout=round_timeout, on_timeout=on_timeout,
                    compile_mode=compile_mode, check_finite=check_finite, keep_log=keep_log)
        self.shards = [Shard(s, OrderedDict((n, named[n]) for n in group), update_rule,
                             rule_kwargs, **opts) for s, group in self.plan.items()]

    def _call(self, indices, method, args_list):
        return [getattr(self.shards[i], method)(*args) for i, args in zip(indices, args_list)]

    def _wait(self, index, round_id, pull=False):
        return self.shards[index].wait_round(round_id, pull=pull)


# ------------------------------------------------------------------ worker


def model_spec(built):
    """``(inputs, loss, params, weight)`` from what a ``build_model`` returned."""
    if isinstance(built, Mapping):
        inputs, loss, params = built["inputs"], built["loss"], built["params"]
        weight = built.get("weight")
    elif isinstance(built, (tuple, list)) and len(built) in (3, 4):
        inputs, loss, params = built[:3]
        weight = built[3] if len(built) == 4 else None
    else:
        raise TypeError("build_model() must return (inputs, loss, params), (inputs, loss, "
                        "params, weight) or a dict with those keys")
    inputs = list(inputs)
    if weight is None:
        weight = inputs[0].shape[0]       # examples in the batch
    return inputs, loss, list(params), weight


def _aligned(a):
    """`a`, copied if it is an unaligned array (Dask's transfers make those; C code refuses them)."""
    if isinstance(a, np.ndarray) and not a.flags.aligned:
        return np.array(a, copy=True)
    return a


class Worker:
    """A trainer: pulls params, computes gradients on its batches, pushes them.

    Parameters
    ----------
    server : ParameterServer or DaskParameterServer
    worker_id : str or int
    build_model : callable
        ``build_model(**model_kwargs)`` returning ``(inputs, loss, params)``
        (or with a 4th element, the batch's weight; default: the first
        input's length). Param names must match the server's. Called in the
        worker (each worker compiles its own function: a compiled function
        is never shared between threads). With Dask it must be picklable: a
        module-level function.
    accumulate : int
        Batches whose gradients are accumulated locally (weighted by batch
        size) before one push: N times less traffic.
    model_kwargs : dict, optional
    compile_mode : str, optional
        PyTensor mode of both functions (default:
        :func:`lasagne_accum.training.default_modes`).
    """

    def __init__(self, server, worker_id, build_model, *, accumulate=1, model_kwargs=None,
                 compile_mode=None):
        if isinstance(accumulate, bool) or not isinstance(accumulate, numbers.Integral) \
                or accumulate < 1:
            raise ValueError(f"accumulate must be an integer >= 1, got {accumulate!r}")
        check_worker_id(worker_id)
        self.server, self.worker_id = server, worker_id
        self.accumulate = int(accumulate)
        start = time.perf_counter()
        inputs, loss, params, weight = model_spec(build_model(**dict(model_kwargs or {})))
        names = [p.name for p in params]
        specs = param_specs(OrderedDict((p.name, p) for p in params))
        if list(specs) != list(server.specs) and sorted(specs) != sorted(server.specs):
            raise ValueError(f"worker {worker_id!r}: the model's params {names} do not match "
                             f"the server's {list(server.specs)}")
        for n, spec in specs.items():
            if tuple(spec) != tuple(server.specs[n]):
                raise ValueError(f"worker {worker_id!r}: param {n!r} is {spec} in the model, "
                                 f"{server.specs[n]} on the server")
        self.params = OrderedDict(zip(names, params))
        acc = accumulate_gradients(loss, params, weight=weight)
        acc_mode, read_mode = (compile_mode, compile_mode) if compile_mode else default_modes()
        self._step = pytensor.function(inputs, loss, updates=acc.accumulate, mode=acc_mode)
        self._read = pytensor.function([], list(acc.grads) + [acc.total], updates=acc.reset,
                                       mode=read_mode)
        self.compile_seconds = time.perf_counter() - start
        self.seq = 0
        self.version = None

    def _set(self, values):
        for n, v in values.items():
            self.params[n].set_value(_aligned(v))

    def run(self, batches, *, register=True, unregister=True, start=None):
        """Train on `batches` (tuples of the inputs), pushing every `accumulate` batches.

        A partial window at the end is pushed too. The first batch is run
        once untimed (and its gradient discarded) so that JIT backends
        compile before ``t_start``; `start`, if given, is called after that
        (a barrier, so that timed runs start together). Returns a report:
        pushes, batches, examples, bytes pushed, ``losses`` as ``(wall time,
        loss, examples)``, ``staleness`` per push, start and end wall times,
        ``server_s`` (seconds spent in push calls: transfer, waiting for the
        round, applying).
        The worker unregisters at the end, also when it fails.
        """
        report = dict(worker=self.worker_id, pushes=0, batches=0, examples=0.0, bytes=0,
                      duplicates=0, losses=[], staleness=[], compile_s=self.compile_seconds,
                      server_s=0.0)
        try:
            if register:
                self.version, values = self.server.register(self.worker_id)
            else:
                self.version, values = self.server.pull()
            self._set(values)
            batches = (tuple(_aligned(a) for a in batch) for batch in batches)
            first = next(batches, None)
            if first is not None:       # JIT backends compile on the first call: not timed
                self._step(*first)
                self._read()
                batches = itertools.chain([first], batches)
            if start is not None:
                start()
            report["t_start"] = time.time()
            window = 0
            for batch in batches:
                loss = self._step(*batch)
                report["losses"].append((time.time(), float(loss), len(batch[0])))
                report["batches"] += 1
                window += 1
                if window == self.accumulate:
                    self._push(report)
                    window = 0
            if window:
                self._push(report)
            report["t_end"] = time.time()
        finally:
            if unregister:
                try:
                    self.server.unregister(self.worker_id)
                except Exception:     # the server is gone: nothing to tell it
                    pass
        return report

    def _push(self, report):
        *grads, total = self._read()
        grads = OrderedDict((n, np.asarray(g)) for n, g in zip(self.params, grads))
        start = time.perf_counter()
        result = self.server.push(self.worker_id, self.seq, grads, weight=float(total),
                                  version=self.version, pull=True)
        report["server_s"] += time.perf_counter() - start
        self.seq += 1
        report["pushes"] += 1
        report["examples"] += float(total)
        report["bytes"] += sum(g.nbytes for g in grads.values())
        report["duplicates"] += bool(result["duplicate"])
        if result["staleness"] is not None:
            report["staleness"].append(result["staleness"])
        self.version = result["version"]
        self._set(result["params"])
        return result
