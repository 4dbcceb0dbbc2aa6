"""One shard: some parameters, the rule's compiled apply function, and a lock.

:class:`ApplyFunction` is the PyTensor part (build the rule's graph for the
shard's parameters, with a schedule's step counter in it, and compile it;
a number learning rate and the staleness scale enter as a factor fed at
every step); :class:`~lasagne_accum.distributed.rounds.Rounds` is the
bookkeeping; :class:`Shard` puts them behind one lock. :func:`push_atomic`
pushes to several shards at once: it checks the push on every one of them
before it commits it to any, so a rejected push leaves no trace, and with
``check_finite`` it computes every shard's step before it takes any, so a
step that would write NaN or inf on one shard is taken on none.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable

from ..checkpoint import collect_state
from ..merge import merge_updates
from .._graph import scalar_state, write_value
from .._pytensor.values import store_output
from ..rules._core import evaluate_schedule
from ..model_average import ExponentialMovingAverage, ModelAverage
from .._checks import check_rule_updates, rule_name
from ..training import warm_up_calls
from . import reduction
from .checks import aligned, check_grads, check_seq, check_version, check_weight, \
    check_worker_id, learning_rate_kind, named_params, param_specs
from .errors import PushRejected
from .options import ServerOptions
from .compiling import compile_function
from .rounds import Rounds, Step, settle

if TYPE_CHECKING:
    from .._typing import UpdateRule

__all__ = ["Shard", "ApplyFunction", "push_atomic", "unregister_atomic"]


class ApplyFunction:
    """The update rule for some parameters, compiled: ``fn(grads..., factor)``.

    Parameters
    ----------
    shard_name : str
        Prefixes the rule's shard-level state (``W1/adam.t``).
    params : dict
        ``{name: shared variable}``.
    update_rule, rule_kwargs
        The rule is called once here, so its step counter is the shard's own.
        ``learning_rate`` may be a number, a symbolic scalar or a schedule
        (a callable of the symbolic step, as the rules take it). A schedule is
        compiled into the apply function with the shard's own step counter
        (``<shard>/schedule_step``), advanced with every applied step; the
        factor input carries a number learning rate times the staleness scale
        (or the scale alone; a rule without a learning rate gets its gradients
        scaled by it).
    compile_mode : str, optional
    averages : dict, optional
        ``{"model_average": kwargs, "ema": kwargs}`` (either may be None): the
        averages of the parameters the apply function keeps, advanced at each
        of its calls (each is an optimizer step of this shard).
    check_finite : bool
        Compute each step's new values (parameters, the rule's state, the
        averages) as outputs, check that they are finite, and write them
        only at :meth:`commit`. False: the compiled function updates them in
        place as it computes them (no copy, no check).
    """

    def __init__(self, shard_name, params, update_rule, rule_kwargs, compile_mode,
                 averages=None, check_finite=False):
        if not callable(update_rule):
            raise TypeError(f"update_rule must be callable, got {type(update_rule).__name__}")
        rule_kwargs = dict(rule_kwargs or {})
        self.params = params
        self.specs = param_specs(params)
        grads = [pt.tensor(dtype=p.type.dtype, shape=np.shape(p.get_value(borrow=True)),
                           name=f"{n}.grad") for n, p in params.items()]
        factor = pt.dscalar(f"{shard_name}.lr_factor")
        self.kind, self.base = learning_rate_kind(update_rule, rule_kwargs)
        used, step = grads, None
        if self.kind == "none":
            used = [g * pt.cast(factor, g.type.dtype) for g in grads]
        elif self.kind == "symbolic":
            rule_kwargs["learning_rate"] = self.base * factor
        elif self.kind == "schedule":
            step = scalar_state("schedule_step", "int64")
            rule_kwargs["learning_rate"] = evaluate_schedule(
                self.base, step, rule_name(update_rule)) * factor
        else:
            rule_kwargs["learning_rate"] = factor
        updates = check_rule_updates(update_rule, used, list(params.values()), rule_kwargs)
        if step is not None:
            updates[step] = step + np.int64(1)
        self.averages = {}
        for key, cls in (("model_average", ModelAverage), ("ema", ExponentialMovingAverage)):
            kwargs = (averages or {}).get(key)
            if kwargs is not None:
                self.averages[key] = cls(list(params.values()), updates=updates, is_step=True,
                                         **kwargs)
        updates = merge_updates(updates, *(a.updates for a in self.averages.values()))
        prefixes = tuple(f"{n}." for n in params)
        for i, var in enumerate(updates):
            if var.name in params and params[var.name] is var:
                continue
            if not (var.name or "").startswith(prefixes):
                # shard-level state (adam.t): one per shard, named after it
                var.name = f"{shard_name}/{var.name or f'state{i}'}"
        self.updates = OrderedDict(updates)
        self.check_finite = bool(check_finite)
        if self.check_finite:       # the new values come out; commit() writes them
            self._targets = list(self.updates)
            self._checked = [(i, var) for i, var in enumerate(self._targets)
                             if np.dtype(var.type.dtype).kind in "fc"]
            new = [self.updates[v] for v in self._targets]
            # one pass over each new value in the compiled code, instead of a
            # numpy isfinite (and its temporary) per value afterwards
            finite = pt.all([pt.all(pt.isfinite(new[i])) for i, _ in self._checked]
                            or [pt.constant(True)])
            self._fn = compile_function(grads + [factor], new + [finite], {},
                                        compile_mode, role="apply")
        else:
            self._fn = compile_function(grads + [factor], [], self.updates, compile_mode,
                                        role="apply")
        zeros = [np.zeros(shape, dtype) for shape, dtype in self.specs.values()]
        warm_up_calls(self.updates, lambda: self._fn(*zeros, 0.0))

    def factor(self, scale):
        """The factor input of one step whose staleness scale is `scale`."""
        return self.base * scale if self.kind == "number" else scale

    def prepare(self, arrays, factor):
        """Compute one step: a :class:`~lasagne_accum.distributed.rounds.Step`.

        With `check_finite`, nothing is written yet (:meth:`commit` does) and
        ``step.bad`` names the first value that is not finite; without, the
        step is written in place now (``step.taken``).
        """
        out = self._fn(*map(aligned, arrays), factor)
        if not self.check_finite:
            return Step()
        *out, finite = out
        if finite:
            return Step(out)
        for i, var in self._checked:
            value = np.asarray(out[i])
            if not np.isfinite(value).all():
                what = "NaN" if np.isnan(value).any() else "inf"
                kind = "parameter" if self.params.get(var.name) is var else "the rule's state"
                return Step(out, f"{what} into {kind} {var.name!r}")
        return Step(out)

    def commit(self, step):
        """Write a step :meth:`prepare` computed (nothing to do when it was taken in place)."""
        if step.taken:
            return
        for var, value in zip(self._targets, step.values):
            if isinstance(var.get_value(borrow=True), np.ndarray):
                store_output(var, value)              # a fresh output: the variable owns it
            else:
                write_value(var, value)               # a device value keeps its storage

    def state_variables(self):
        """``{name: shared variable}``: params and the rule's state."""
        return collect_state(self.updates)


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
        dictionary. It is called once for this shard, so its step counter
        (``adam.t``) is the shard's own.
    rule_kwargs : dict, optional
        Hyperparameters; ``learning_rate`` may be a number, a symbolic scalar
        (in-process only) or a schedule (:mod:`lasagne_accum.schedules`, or
        any callable of the symbolic step), compiled into the shard's rule
        with the shard's own step counter (0 for the first step).
    options : ServerOptions, optional
    **option_kwargs
        Fields of :class:`~lasagne_accum.distributed.options.ServerOptions`.
    """

    def __init__(
        self,
        name: str,
        params: Mapping[str, SharedVariable],
        update_rule: UpdateRule,
        rule_kwargs: Mapping[str, Any] | None = None,
        options: ServerOptions | None = None,
        **option_kwargs: Any,
    ) -> None:
        self.options = ServerOptions.of(options, **option_kwargs)
        self.name = name
        named = named_params(params)
        self.params = OrderedDict(
            (n, p if isinstance(p, SharedVariable) else pytensor.shared(p, name=n))
            for n, p in named.items())
        self.specs = param_specs(self.params)
        self.fn = ApplyFunction(name, self.params, update_rule, rule_kwargs,
                                self.options.compile_mode,
                                dict(model_average=self.options.model_average,
                                     ema=self.options.ema),
                                check_finite=self.options.check_finite)
        self.updates = self.fn.updates
        self.lock = threading.Lock()
        self._cond = threading.Condition(self.lock)
        self.book = Rounds(name, self.specs, self.options, self.fn)
        if self.options.mode == "sync":      # compiled now, not when the first round closes
            reduction.warm_up(dtype for _, dtype in self.specs.values())
        self.book.listeners.append(lambda rid: self._cond.notify_all())

    # ---------------------------------------------------------------- workers

    def register(self, worker_id: str | int) -> tuple[int, dict[str, np.ndarray]]:
        """Add a live worker (idempotent); return ``(version, {name: array})``."""
        check_worker_id(worker_id)
        with self.lock:
            self.book.register(worker_id)
            return self.book.version, self._copy()

    def next_seq(self, worker_id: str | int) -> int:
        """One more than the highest seq of `worker_id` applied here (0 if none)."""
        with self.lock:
            seen = self.book.seen.get(worker_id)
            if seen is None:
                return 0
            return max([seen.floor] + list(seen.above)) + 1

    def unregister(self, worker_id: str | int) -> bool:
        """Remove a worker from the live set (a sync round may close now); True if it was live."""
        return unregister_atomic([self], worker_id)[0]

    # ---------------------------------------------------------------- pull

    def pull(self) -> tuple[int, dict[str, np.ndarray]]:
        """``(version, {name: array copy})`` of this shard."""
        with self.lock:
            self.book.expire()
            return self.book.version, self._copy()

    def _copy(self):
        return {n: p.get_value(borrow=False) for n, p in self.params.items()}

    _loads = 0                 # load() calls: with the version, what a shared copy is of
    _shared = None             # ((version, loads), {name: read-only copy})

    def _shared_copy(self):
        """A read-only copy of the parameters, made once per version and handed to every
        caller that asks for that version (the waiters of one sync round)."""
        key = (self.book.version, self._loads)
        if self._shared is None or self._shared[0] != key:
            arrays = self._copy()
            for a in arrays.values():
                a.flags.writeable = False
            self._shared = (key, arrays)
        return dict(self._shared[1])

    # ---------------------------------------------------------------- push

    def push(
        self,
        worker_id: str | int,
        seq: int,
        grads: Mapping[str, np.ndarray],
        weight: float = 1.0,
        version: int | None = None,
        pull: bool = False,
    ) -> dict[str, Any]:
        """Apply (async) or add to the open round (sync) one worker's gradients.

        Parameters
        ----------
        worker_id : str or int
            A registered worker.
        seq : int
            The worker's push counter: a second push with the same
            ``(worker_id, seq)`` (a retry) is not applied again.
        grads : dict
            ``{parameter name: array}`` for every parameter of the shard.
        weight : float
            Examples behind the gradient (its weight in the sync mean).
        version : int
            The shard version the gradient was computed from.
        pull : bool
            Also return the parameters after the push (``params``).

        Returns
        -------
        dict
            ``applied``, ``duplicate``, ``staleness`` (async), ``round`` (sync:
            the id to pass to :meth:`wait_round`), ``version``.

        Raises
        ------
        PushRejected
            Bad input; nothing changes on the shard.
        RoundFailedError
            Async mode: the step could not be applied (nothing was);
            :class:`~lasagne_accum.distributed.NonFiniteStepError` when it would
            write NaN or inf.
        """
        where = f"shard {self.name!r}"
        try:
            call = (check_worker_id(worker_id), check_seq(seq),
                    check_grads(grads, self.specs, where, self.options.check_finite),
                    check_weight(weight), check_version(version, where))
        except PushRejected:
            self.note_rejected()
            raise
        return push_atomic([self], [call], pull, count_rejected=True)[0]

    def note_rejected(self, n: int = 1) -> None:
        """Count `n` rejected pushes (the server counts each rejected push once)."""
        with self.lock:
            self.book.counts["rejected"] += n

    # ---------------------------------------------------------------- sync rounds

    def wait_round(
        self,
        round_id: int,
        timeout: float | None = None,
        blocking: bool = True,
        pull: bool = False,
        shared: bool = False,
    ) -> dict[str, Any] | None:
        """Wait for sync round `round_id` to close; return its result.

        Parameters
        ----------
        round_id : int
            From :meth:`push`.
        timeout : float, optional
            Seconds to wait (default the server's ``wait_timeout``); then
            :class:`ServerTimeoutError`. 0 checks once and returns None if
            the round is open.
        blocking : bool
            False: return None at once if another thread holds the lock.
        pull : bool
            Also return the parameters (``params``) with the current ``version``.
        shared : bool
            With `pull`: read-only arrays that every caller of this version
            shares (for callers that only send them on), instead of a copy each.

        Returns
        -------
        dict or None
            ``round``, ``version`` (after the round), ``workers`` (merged, in
            merge order), ``weight``, ``timed_out``, ``dropped``.

        Raises
        ------
        RoundFailedError
            The round could not be applied, or timed out with
            ``on_timeout="fail"`` (:class:`RoundTimeoutError`).
        ServerTimeoutError
            Waited `timeout` seconds.
        """
        if not self.lock.acquire(blocking):
            return None
        try:
            wait_for = self.options.wait_timeout if timeout is None else timeout
            end = time.monotonic() + wait_for
            while True:
                result = self.book.outcome(round_id)
                if result is not None:
                    if pull:
                        result["version"] = self.book.version
                        result["params"] = self._shared_copy() if shared else self._copy()
                    return result
                left = end - time.monotonic()
                if timeout == 0:
                    return None
                if left <= 0:
                    raise self.book.wait_timed_out(round_id, wait_for)
                deadline = self.book.deadline()
                self._cond.wait(max(1e-4, left if deadline is None else min(left, deadline)))
        finally:
            self.lock.release()

    # ---------------------------------------------------------------- stats, state

    def averages(self) -> dict[str, dict[str, np.ndarray]]:
        """``{"model_average": {name: array}, "ema": {...}}`` of the averages this shard keeps.

        An average with no step yet is left out (it has nothing to average).
        """
        with self.lock:
            return {key: dict(zip(self.params, avg.averages()))
                    for key, avg in self.fn.averages.items() if avg.steps > 0}

    def stats(self) -> dict[str, Any]:
        """Counters of this shard (a plain dict)."""
        with self.lock:
            return self.book.stats()

    def _counter_names(self):
        return f"{self.name}/counters", f"{self.name}/applied_seqs"

    def state_specs(self) -> OrderedDict[str, tuple[tuple[int, ...] | None, np.dtype]]:
        """``{name: (shape, dtype)}`` of :meth:`state` (shape None: any length)."""
        with self.lock:
            out = OrderedDict((n, (tuple(np.shape(v.get_value(borrow=True))),
                                   str(np.asarray(v.get_value(borrow=True)).dtype)))
                              for n, v in self.fn.state_variables().items())
        counters, seqs = self._counter_names()
        out[counters] = ((2,), "int64")
        out[seqs] = (None, "uint8")
        return out

    def state(self) -> OrderedDict[str, np.ndarray]:
        """``{name: array}``: params, rule state, counters and each worker's applied seqs."""
        with self.lock:
            out = OrderedDict((n, v.get_value(borrow=False))
                              for n, v in self.fn.state_variables().items())
            counters, seqs = self._counter_names()
            out[counters], out[seqs] = self.book.counters()
            return out

    def load(self, arrays: Mapping[str, np.ndarray]) -> list[str]:
        """Set the state from :meth:`state`'s format; all checks first.

        The record of applied seqs is optional (checkpoints of earlier
        versions lack it); without it, the current record is kept.
        """
        counters_name, seqs_name = self._counter_names()
        with self.lock:
            named = self.fn.state_variables()
            expected = list(named) + [counters_name]
            problems = []
            missing = [n for n in expected if n not in arrays]
            extra = [n for n in arrays if n not in expected and n != seqs_name]
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
                    elif self.options.check_finite and a.dtype.kind in "fc" and \
                            not np.isfinite(a).all():
                        problems.append(f"{n}: holds NaN or inf (check_finite)")
            counters = np.asarray(arrays.get(counters_name, np.zeros(2, np.int64)))
            if counters.shape != (2,) or counters.dtype != np.int64:
                problems.append(f"{counters_name}: expected 2 int64 values")
            seen = None
            if seqs_name in arrays:
                try:
                    seen = self.book.parse_seen(arrays[seqs_name], f"shard {self.name!r}")
                except ValueError as exc:
                    problems.append(str(exc))
            if self.book.pending:
                problems.append("a sync round is open")
            if problems:
                raise ValueError(f"shard {self.name!r}: cannot load; nothing was loaded:\n  "
                                 + "\n  ".join(problems))
            for n, var in named.items():
                var.set_value(np.array(arrays[n], copy=True))
            self.book.load_counters(counters, seen)
            self._loads += 1
            self._cond.notify_all()
            return expected


@contextlib.contextmanager
def _locked(shards):
    """Hold the locks of `shards`, taken in their order."""
    with contextlib.ExitStack() as stack:
        for shard in shards:
            stack.enter_context(shard.lock)
        yield


def push_atomic(shards, calls, pull=False, count_rejected=False):
    """Push to several shards as one: check every shard, then commit to every shard.

    Parameters
    ----------
    shards : list of Shard
        In a fixed order (their locks are taken in this order).
    calls : list
        Per shard ``(worker_id, seq, arrays, weight, version)``, checked
        (arrays in the shard's spec order, already copied).
    pull : bool
        Add each shard's ``params`` to its result.
    count_rejected : bool
        Count a rejection on the first shard (the server counts it itself).

    Returns
    -------
    list of dict
        Each shard's result (see :meth:`Shard.push`).

    Raises
    ------
    PushRejected
        From the first shard that refuses the push; no shard has changed.
    RoundFailedError
        Async mode: a shard's compiled step raised, or would write NaN or inf
        (:class:`NonFiniteStepError`). With ``check_finite`` (the default)
        every shard computes its step before any is taken: none was taken.
        Without it, steps are written as they are computed: the shards
        before the failing one applied the push (a resend of the same
        ``(worker_id, seq)`` completes it). In sync mode the same holds for
        the rounds this push closes, and the error goes to their waiters.
    """
    with _locked(shards):
        try:
            tickets = [shard.book.check(wid, seq, version)
                       for shard, (wid, seq, _, _, version) in zip(shards, calls)]
        except PushRejected:
            if count_rejected:
                shards[0].book.counts["rejected"] += 1
            raise
        out = settle([shard.book.stage(wid, seq, arrays, weight, version, ticket)
                      for shard, (wid, seq, arrays, weight, version), ticket
                      in zip(shards, calls, tickets)])
        for shard, result in zip(shards, out):
            if pull and (shard.options.mode == "async" or result["applied"]
                         or result["duplicate"]):
                result["params"] = shard._copy()
        return out


def unregister_atomic(shards, worker_id):
    """Remove a worker from several shards as one: the sync rounds this closes are taken
    all or none (see :func:`push_atomic`). Returns, per shard, whether it was live."""
    with _locked(shards):
        left = [shard.book.leave(worker_id) for shard in shards]
        settle([staged for _, pending in left for staged in pending])
        return [was for was, _ in left]
