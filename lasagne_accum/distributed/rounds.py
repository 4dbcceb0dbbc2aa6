"""The bookkeeping of one shard, in plain Python: workers, retries, sync rounds, counters.

:class:`Rounds` decides what a push does (a duplicate, a rejection, an
async step, a place in the open sync round, the push that closes it) and
keeps the counters; the arithmetic is an ``apply`` object it is given (the
compiled function of :mod:`lasagne_accum.distributed.shard`, or a numpy
function in tests). It has no lock: its owner holds one around every call.

A step is taken in two phases: :meth:`Rounds.stage` computes it (a
:class:`Step`), :func:`settle` takes the staged steps of several shards, or,
when one of them failed (its computation raised, or it would write NaN or
inf), refuses every one that was not already written in place.
"""

import json
import time
from collections import OrderedDict

import numpy as np

from .errors import NonFiniteStepError, PushRejected, RoundFailedError, RoundTimeoutError, \
    ServerTimeoutError, StalePushError, UnknownWorkerError
from .._checks import INT64_MAX
from .checks import check_worker_id
from .reduction import reduce_grads

__all__ = ["Rounds", "Seen", "Step", "Staged", "settle"]

KEEP_RESULTS = 256          # sync round results kept for late waiters
MAX_SEEN_BYTES = 1 << 26    # the largest such record (JSON text) a checkpoint may hold


class Seen:
    """The set of a worker's applied sequence numbers, compacted below a floor.

    Examples
    --------
    >>> s = Seen()
    >>> for seq in (0, 1, 3):
    ...     s.add(seq)
    >>> (s.floor, sorted(s.above), 2 in s, 3 in s)
    (1, [3], False, True)
    """

    __slots__ = ("floor", "above")

    def __init__(self, floor=-1, above=()):
        self.floor, self.above = int(floor), set(int(a) for a in above)

    def __contains__(self, seq):
        return seq <= self.floor or seq in self.above

    def add(self, seq):
        self.above.add(seq)
        while self.floor + 1 in self.above:
            self.floor += 1
            self.above.discard(self.floor)


class Step:
    """A step an apply object computed: what it writes, and whether that is finite.

    Attributes
    ----------
    values : list or None
        The new values, written by ``apply.commit(step)``; None when the
        step was written in place as it was computed (``taken``: without
        ``check_finite`` nothing is kept to refuse it with).
    bad : str or None
        What is not finite in `values`, for messages (``"NaN into parameter
        'w'"``); None when all of it is finite (or unchecked).
    """

    __slots__ = ("values", "bad")

    def __init__(self, values=None, bad=None):
        self.values, self.bad = values, bad

    @property
    def taken(self):
        return self.values is None


class Staged:
    """One shard's part of a push (or a round's close) between :meth:`Rounds.stage` and
    :func:`settle`.

    `result` is the result when nothing is to be taken; `step` the computed
    step (None: none, or its computation raised); `failure` the error that
    refuses it (and every step settled with it); ``take()`` writes the step
    and records it, returning the result; ``refuse(error)`` records the
    refusal, returning the result. `raises`: the failure is raised to the
    caller (an async push), not handed to a round's waiters.
    """

    __slots__ = ("result", "step", "failure", "take", "refuse", "raises")

    def __init__(self, result=None, step=None, failure=None, take=None, refuse=None,
                 raises=False):
        self.result, self.step, self.failure = result, step, failure
        self.take, self.refuse, self.raises = take, refuse, raises


def settle(staged):
    """Take the staged steps of several shards (the same lock hold), all or none.

    If any of them failed, every step not already written in place is
    refused (a step computed without ``check_finite`` was written as it was
    computed: it is recorded as taken). Returns each one's result; raises
    the failure of an async push once all are settled.
    """
    failure = next((s.failure for s in staged if s.failure is not None), None)
    out = []
    for s in staged:
        if s.take is None:
            out.append(s.result)
        elif s.step is not None and (failure is None or s.step.taken):
            out.append(s.take())
        else:
            out.append(s.refuse(failure))
    if failure is not None and any(s.raises for s in staged):
        raise failure
    return out


class Rounds:
    """Who may push, what was applied, and the open sync round of one shard.

    Parameters
    ----------
    name : str
        The shard's name (in messages).
    specs : dict
        ``{param name: (shape, dtype)}``.
    options : ServerOptions
    apply : object
        ``apply.factor(scale)`` returns the factor input of a step whose
        staleness scale is `scale`; ``apply.prepare(arrays, factor)``
        computes one step (a :class:`Step`), ``apply.commit(step)`` writes it.

    Notes
    -----
    The caller holds a lock around every method. :meth:`check` changes
    nothing (besides expiring a timed-out round), so a push to several
    shards is checked on all of them before it is committed to any.
    """

    def __init__(self, name, specs, options, apply, clock=time.monotonic):
        self.name, self.specs, self.options, self.apply = name, specs, options, apply
        self.clock = clock
        self.version = 0             # optimizer steps taken
        self.applied = 0             # pushes applied (async) or merged (sync)
        self.live = OrderedDict()    # worker id -> True
        self.dropped = {}            # worker id -> reason
        self.seen = {}               # worker id -> Seen
        self.last = {}               # worker id -> (seq, round id) of its last sync push
        self.pending = OrderedDict()  # worker id -> (seq, arrays, weight)
        self.round = 0               # id of the open (or next) sync round
        self.round_started = None
        self.results = OrderedDict()
        self.counts = dict(received=0, duplicates=0, rejected=0, bytes=0, examples=0.0,
                           rounds=0, timeouts=0, failed_rounds=0)
        self.staleness = {}
        self.log = []
        self.listeners = []          # callables(round id), called when a round ends
        self._scratch = {}           # param index -> the reduction's buffers, kept between rounds

    @property
    def where(self):
        return f"shard {self.name!r}"

    # ------------------------------------------------------------ workers

    def register(self, worker_id):
        self.expire()
        self.live[worker_id] = True
        self.dropped.pop(worker_id, None)
        self.seen.setdefault(worker_id, Seen())

    def unregister(self, worker_id):
        """Remove a live worker; a sync round waiting only for it closes. True if it was live."""
        was, staged = self.leave(worker_id)
        settle(staged)
        return was

    def leave(self, worker_id):
        """:meth:`unregister`'s first phase: ``(was live, [the round it closes, staged])``."""
        was = self.live.pop(worker_id, None) is not None
        return was, [self._closing(timed_out=False)] if self.pending and self._complete() else []

    def require_live(self, worker_id):
        if worker_id not in self.live:
            reason = self.dropped.get(worker_id)
            why = f" ({reason})" if reason else ""
            raise UnknownWorkerError(f"{self.where}: worker {worker_id!r} is not registered"
                                     f"{why}; call register({worker_id!r}) first")

    # ------------------------------------------------------------ pushes

    def check(self, worker_id, seq, version):
        """Decide what a push would do; change nothing.

        Returns
        -------
        ("duplicate", result) or ("new", factor)
            `factor` is the async step's factor input (a number learning
            rate times the staleness scale, or the scale; None in sync mode,
            where it is computed when the round closes).

        Raises
        ------
        PushRejected, UnknownWorkerError, StalePushError
            The push cannot be taken.
        """
        self.expire()
        self.require_live(worker_id)
        if seq in self.seen[worker_id] or self.pending.get(worker_id, (None,))[0] == seq:
            last = self.last.get(worker_id)
            return "duplicate", dict(applied=False, duplicate=True, staleness=None,
                                     round=last[1] if last and last[0] == seq else None)
        if version < 0 or version > self.version:
            raise PushRejected(f"{self.where}: version {version} does not exist (the shard is "
                               f"at version {self.version})")
        if self.options.mode == "sync":
            if version != self.version:
                raise StalePushError(
                    f"{self.where}: push computed from version {version} but the open round "
                    f"is for version {self.version}; pull() and recompute")
            if worker_id in self.pending:
                raise PushRejected(f"{self.where}: worker {worker_id!r} already pushed (seq "
                                   f"{self.pending[worker_id][0]}) in this round")
            return "new", None
        staleness = self.version - version
        scale = 1.0 / max(1, staleness) if self.options.staleness_scale else 1.0
        return "new", self.apply.factor(scale)

    def commit(self, worker_id, seq, arrays, weight, version, ticket):
        """Carry out a push that :meth:`check` accepted (same lock hold); return its result."""
        return settle([self.stage(worker_id, seq, arrays, weight, version, ticket)])[0]

    def stage(self, worker_id, seq, arrays, weight, version, ticket):
        """The first phase of :meth:`commit`: the push is counted and queued, and the step
        it makes (async, or the sync round it completes) computed but not taken;
        :func:`settle` takes it, or refuses it."""
        kind, value = ticket
        if kind == "duplicate":
            self.counts["duplicates"] += 1
            return Staged(result=dict(value, version=self.version))
        self.counts["received"] += 1
        self.counts["bytes"] += sum(a.nbytes for a in arrays)
        self.counts["examples"] += weight
        if self.options.mode == "async":
            return self._stage_async(worker_id, seq, arrays, value, self.version - version)
        if not self.pending:
            self.round_started = self.clock()
        self.pending[worker_id] = (seq, arrays, weight)
        self.last[worker_id] = (seq, self.round)
        result = dict(applied=False, duplicate=False, staleness=0, round=self.round,
                      version=self.version)
        if not self._complete():
            return Staged(result=result)
        closing = self._closing(timed_out=False)

        def take():
            closing.take()
            return dict(result, applied=True, version=self.version)

        def refuse(error):
            closing.refuse(error)
            return result

        return Staged(step=closing.step, failure=closing.failure, take=take, refuse=refuse)

    def _stage_async(self, worker_id, seq, arrays, factor, staleness):
        step, failure = self._compute(
            arrays, factor, lambda exc: RoundFailedError(
                f"{self.where}: applying the push of worker {worker_id!r} (seq {seq}) failed, "
                f"not applied here: {type(exc).__name__}: {exc}"),
            lambda bad: NonFiniteStepError(
                f"{self.where}: the push of worker {worker_id!r} (seq {seq}) would write "
                f"{bad} at step {self.version}; refused: nothing of the push was applied, "
                f"the parameters keep their last finite values (version {self.version}), "
                "and the server keeps serving (check_finite=True)"))

        def take():
            self.apply.commit(step)
            self.seen[worker_id].add(seq)
            self.version += 1
            self.applied += 1
            self.staleness[staleness] = self.staleness.get(staleness, 0) + 1
            if self.options.keep_log:
                self.log.append((worker_id, seq, staleness))
            return dict(applied=True, duplicate=False, staleness=staleness, round=None,
                        version=self.version)

        return Staged(step=step, failure=failure, take=take, refuse=lambda error: None,
                      raises=True)

    def _compute(self, arrays, factor, on_error, on_bad):
        """``(step, failure)``: the step `arrays` make (not taken), or the error refusing it."""
        try:
            step = self.apply.prepare(arrays, factor)
        except Exception as exc:
            failure = on_error(exc)
            failure.__cause__ = exc
            return None, failure
        return step, (on_bad(step.bad) if step.bad is not None else None)

    # ------------------------------------------------------------ sync rounds

    def _complete(self):
        return bool(self.pending) and all(w in self.pending for w in self.live)

    def merged(self):
        """``(order, total weight, arrays)`` of the open round: the weighted mean or the sum.

        The arrays are valid until the next call (the reduction reuses its buffers).
        """
        order = sorted(self.pending, key=str)
        total = sum(self.pending[w][2] for w in order)
        mean = self.options.merge == "mean"
        weights = [self.pending[w][2] for w in order]
        # in float64, in a fixed order: the same bits whatever the arrival order
        out = [reduce_grads([self.pending[w][1][i] for w in order], weights, total, dtype,
                            mean, scratch=self._scratch.setdefault(i, {}))
               for i, (_, dtype) in enumerate(self.specs.values())]
        return order, total, out

    def close_round(self, timed_out):
        """Apply the open round; return its result, or None if applying failed (round failed)."""
        return settle([self._closing(timed_out)])[0]

    def _closing(self, timed_out):
        """The open round's step, computed but not taken: a :class:`Staged` whose ``take()``
        closes the round (returning its result) and ``refuse(error)`` fails it (None)."""
        order, total, merged = self.merged()
        step, failure = self._compute(
            merged, self.apply.factor(1.0), lambda exc: RoundFailedError(
                f"{self.where}: sync round {self.round} (version {self.version}) could not "
                f"be applied: {type(exc).__name__}: {exc}; nothing of it was applied and the "
                "server keeps serving: push again to retry"),
            lambda bad: NonFiniteStepError(
                f"{self.where}: sync round {self.round} would write {bad} at step "
                f"{self.version}; the round was refused on every shard it closed on: nothing "
                f"of it was applied, the parameters keep their last finite values (version "
                f"{self.version}), and the server keeps serving (check_finite=True)"))

        def take():
            self.apply.commit(step)
            return self._closed(order, total, timed_out)

        def refuse(error):
            self.fail_round(error, missing=[])

        return Staged(step=step, failure=failure, take=take, refuse=refuse)

    def _closed(self, order, total, timed_out):
        """Record the open round as applied; its result."""
        missing = [w for w in self.live if w not in self.pending]
        for w in order:
            self.seen[w].add(self.pending[w][0])
        if self.options.keep_log:
            self.log.append(tuple((w, self.pending[w][0]) for w in order))
        dropped = self._drop(missing, "dropped after missing the timeout of round "
                                      f"{self.round}") if timed_out else []
        self.version += 1
        self.applied += len(order)
        self.counts["rounds"] += 1
        self.counts["timeouts"] += bool(timed_out)
        result = dict(round=self.round, version=self.version, workers=order, weight=total,
                      timed_out=bool(timed_out), dropped=dropped)
        self._finish(result)
        return result

    def fail_round(self, error, missing):
        """Discard the open round (nothing applied); `error` goes to its waiters."""
        self._drop(missing, f"dropped after missing the timeout of round {self.round}")
        for w, (seq, _, _) in self.pending.items():   # not applied: may be pushed again
            if self.last.get(w, (None,))[0] == seq:
                self.last.pop(w)
        self.counts["failed_rounds"] += 1
        self._finish(error)

    def _drop(self, workers, reason):
        for w in workers:
            self.live.pop(w, None)
            self.dropped[w] = reason
        return list(workers)

    def _finish(self, result):
        self.results[self.round] = result
        while len(self.results) > KEEP_RESULTS:
            self.results.popitem(last=False)
        self.pending.clear()
        rid = self.round
        self.round += 1
        self.round_started = None
        for listener in self.listeners:
            listener(rid)

    def expire(self):
        """Close or fail a sync round past its timeout."""
        timeout = self.options.round_timeout
        if timeout is None or not self.pending or self.clock() - self.round_started < timeout:
            return
        missing = [w for w in self.live if w not in self.pending]
        if self.options.on_timeout == "close":
            if self.close_round(timed_out=True) is None:      # it failed: still a timeout
                self.counts["timeouts"] += 1
            return
        self.counts["timeouts"] += 1
        self.fail_round(RoundTimeoutError(
            f"{self.where}: sync round {self.round} (version {self.version}) timed out after "
            f"{timeout} s without a push from {', '.join(map(repr, missing))}; the round was "
            "discarded (nothing applied), those workers were dropped, and the server keeps "
            "serving: push again to retry"), missing)

    def deadline(self):
        """Seconds until the open round times out (None: no timeout or no open round)."""
        if self.options.round_timeout is None or self.round_started is None:
            return None
        return max(0.0, self.round_started + self.options.round_timeout - self.clock())

    def outcome(self, round_id):
        """The result of round `round_id`, None while it is open; raises if it failed."""
        self.expire()
        if round_id in self.results:
            result = self.results[round_id]
            if isinstance(result, Exception):
                raise type(result)(str(result))
            return dict(result)
        if round_id < self.round:
            return dict(round=round_id, expired=True, version=self.version)
        if round_id > self.round:
            raise ValueError(f"{self.where}: round {round_id} has not opened (the open round "
                             f"is {self.round})")
        return None

    def missing(self):
        """Live workers the open round still waits for."""
        return [w for w in self.live if w not in self.pending]

    def wait_timed_out(self, round_id, waited):
        """The error of a wait of `waited` seconds for sync round `round_id` to close."""
        return ServerTimeoutError(
            f"{self.where}: waited {waited:g} s for sync round {round_id} to close; it still "
            f"waits for pushes from {', '.join(map(repr, self.missing())) or 'nobody'} (set "
            "round_timeout= to drop workers that stop pushing)")

    # ------------------------------------------------------------ stats, state

    def stats(self):
        self.expire()
        out = dict(self.counts, name=self.name, mode=self.options.mode, version=self.version,
                   applied=self.applied, pending=len(self.pending),
                   live_workers=list(self.live), dropped=dict(self.dropped),
                   staleness=dict(sorted(self.staleness.items())))
        if self.options.keep_log:
            out["log"] = list(self.log)
        return out

    def counters(self):
        """``(int64 [version, applied], uint8 JSON of each worker's applied seqs)``."""
        seen = [[w, s.floor, sorted(s.above)] for w, s in self.seen.items()
                if s.floor >= 0 or s.above]
        text = json.dumps(dict(seen=seen)).encode("utf-8")
        return (np.array([self.version, self.applied], np.int64),
                np.frombuffer(text, np.uint8).copy())

    @staticmethod
    def parse_seen(array, where):
        """``{worker id: Seen}`` from :meth:`counters`' second array; ValueError if malformed."""
        def seqs(values):   # counters, as the shard keeps them: int64
            if not all(type(v) is int and -1 <= v <= INT64_MAX for v in values):
                raise ValueError("a seq is not an integer from -1 to 2**63 - 1")
            return values

        try:
            array = np.asarray(array)
            # the size a header declares is checked before a byte is read
            if array.dtype != np.uint8 or array.ndim != 1 or array.size > MAX_SEEN_BYTES:
                raise ValueError(f"expected at most {MAX_SEEN_BYTES} bytes of JSON text (a "
                                 f"1-d uint8 array), got {array.dtype}{list(array.shape)}")
            data = json.loads(array.tobytes().decode("utf-8"))
            return {check_worker_id(w): Seen(*seqs([floor]), seqs(list(above)))
                    for w, floor, above in data["seen"]}
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, OverflowError,
                PushRejected) as exc:
            raise ValueError(f"{where}: the record of applied pushes is malformed: {exc}") \
                from None

    def load_counters(self, counters, seen):
        """Set version, applied and the applied seqs (checked by the caller)."""
        if self.pending:
            raise RuntimeError(f"{self.where}: cannot load a checkpoint while a sync round "
                               "is open")
        self.version, self.applied = int(counters[0]), int(counters[1])
        if seen is not None:
            self.seen = dict(seen)
            for w in self.live:
                self.seen.setdefault(w, Seen())
        self.round_started = None
