"""The shard process's side: the shards as one Dask actor, and how a request is served.

A request reaches a shard process as a Dask message to the comm handler
:data:`HANDLER`, which :func:`install_handler` puts on the process's
``distributed.Worker``. :func:`serve` checks what Dask decoded
(:func:`~lasagne_accum.distributed.dask.schema.check_request`), runs it on the
worker's event loop and returns the reply: the value, and when the caller
profiles, the seconds it spent in the shard process and those of them waiting
for a sync round to close. The reply goes back as a ``ToPickle``: its arrays
are out-of-band frames. A refusal goes back as data too, never raised in the
handler (Dask would log its traceback): Dask's own error message, with the
status :data:`REFUSED`.
"""

import asyncio
import os
import time

from ..errors import PushRejected, RoundFailedError, ServerTimeoutError
from ..checks import check_finite_gradient
from ..shard import Shard, push_atomic, unregister_atomic
from .cluster import require_distributed
from .schema import check_request

__all__ = ["ShardActor", "HANDLER", "REFUSED", "Gone", "serve", "install_handler"]

HANDLER = "lasagne_accum_shards"      # the comm handler's name on the shard processes
REFUSED = "refused"                   # the status of a refusal's error message


class Gone(Exception):
    """The shard process answered, but holds no shards under that key (released)."""


def install_handler(worker):
    """Serve :data:`HANDLER` on `worker` (a ``distributed.Worker``); idempotent."""
    if HANDLER in worker.handlers:
        return
    distributed = require_distributed()
    to_pickle, error_message = distributed.protocol.ToPickle, distributed.core.error_message

    async def lasagne_accum_shards(key=None, request=None, profile=False, **unknown):
        try:
            if unknown:
                raise ValueError(f"the request has unknown field(s) {sorted(unknown)!r:.200}; "
                                 "expected key, request, profile")
            return to_pickle(await serve(worker, key, request, profile is True))
        except Exception as exc:      # sent back, not raised: Dask logs what a handler raises
            return error_message(exc, status=REFUSED)    # (an unpicklable one as its repr)

    worker.handlers[HANDLER] = lasagne_accum_shards


async def serve(worker, key, request, profile=False):
    """Answer one request for the shards under actor `key`: ``(value,)``, or with `profile`
    ``(value, seconds in the shard process, seconds of them waiting for rounds)``; a
    refusal is raised.

    Parameters
    ----------
    worker : distributed.Worker
    key : str
        The actor's key.
    request : object
        The request as Dask decoded it (checked here before any use).
    profile : bool
        Add the seconds spent here and those waiting for rounds to the reply.
    """
    start = time.perf_counter() if profile else None
    timing = {"round": 0.0} if profile else None
    actor = worker.state.actors.get(key) if type(key) is str else None
    if actor is None:
        raise Gone(f"no shards under that key on {worker.address} (released, or the "
                   "process was restarted)")
    method, args = check_request(request, actor.specs)
    del request
    value = await actor.serve(method, args, timing)
    if not profile:
        return (value,)
    elapsed = time.perf_counter() - start
    return value, elapsed - timing["round"], timing["round"]


class ShardActor:
    """The shards placed on one Dask worker, as one Dask actor.

    Requests arrive through :func:`serve` (on the worker's event loop) or,
    from a task in the same process, directly (:meth:`serve_here`, in the
    caller's thread). Each request covers every shard of this process that a
    call needs: ``["call", [method, [[shard name, args]]]]`` returns
    ``[(ok, result or exception)]``; ``["check", [calls]]`` and ``["push",
    [calls, pull, wait]]`` return ``(True, result)`` or ``(False,
    exception)``; ``["pid", []]`` the process id. Waiting for a sync round
    never blocks the event loop: the coroutine waits on an event that the
    shard sets when a round ends (no polling).

    Attributes
    ----------
    specs : dict
        ``{shard name: {param name: (shape, dtype)}}``, what requests are
        checked against.
    """

    def __init__(self, shard_specs, options):
        self.options = options
        self._shards = {}
        for name, params, update_rule, rule_kwargs in shard_specs:
            shard = Shard(name, params, update_rule, rule_kwargs, options)
            shard.book.listeners.append(lambda rid, name=name: self._round_ended(name))
            self._shards[name] = shard
        self.specs = {name: dict(shard.specs) for name, shard in self._shards.items()}
        self._loop = None
        self._events = {name: None for name in self._shards}
        try:
            worker = require_distributed().get_worker()
        except (ValueError, ImportError):   # built outside a Dask worker (a test): no handler
            return
        self._loop = worker.loop.asyncio_loop
        install_handler(worker)

    def pid(self):
        return os.getpid()

    # ------------------------------------------------------------ events

    def _event(self, name):
        if self._events[name] is None:
            self._events[name] = asyncio.Event()
        return self._events[name]

    def _round_ended(self, name):          # called with the shard's lock held, any thread
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake, name)

    def _wake(self, name):
        event, self._events[name] = self._events[name], None
        if event is not None:
            event.set()

    # ------------------------------------------------------------ requests

    async def serve(self, method, args, timing=None):
        """One checked request, on the event loop (the shard work itself is short: in place)."""
        if method == "push":
            return await self.push_many(*args, timing=timing)
        return self.serve_here(method, args)

    def serve_here(self, method, args):
        """One request in the caller's thread; a sync push does not wait here
        (:meth:`wait_here` does)."""
        if method == "call":
            return self.call(*args)
        if method == "check":
            return self._check(*args)
        if method == "push":
            calls, pull, wait = args
            waits = self.options.mode == "sync" and wait    # wait_here brings the params
            return self._push(calls, pull and not waits)
        if method == "pid":
            return self.pid()
        raise ValueError(f"unknown request {method!r}")

    def call(self, method, calls):
        if method == "unregister" and len({args[0] for _, args in calls}) == 1:
            # one worker leaves: the rounds it closes here are taken all or none
            try:
                return [(True, was) for was in unregister_atomic(
                    [self._shards[name] for name, _ in calls], calls[0][1][0])]
            except Exception as exc:      # sent back, raised by the caller
                return [(False, exc)] * len(calls)
        out = []
        for name, args in calls:
            try:
                out.append((True, getattr(self._shards[name], method)(*args)))
            except Exception as exc:      # sent back, raised by the caller
                out.append((False, exc))
        return out

    def _check(self, calls):
        shards = [self._shards[name] for name, _ in calls]
        try:
            for shard, (_, (wid, seq, _, _, version)) in zip(shards, calls):
                with shard.lock:
                    shard.book.check(wid, seq, version)
        except (PushRejected, RoundFailedError) as exc:
            return False, exc
        return True, None

    def _push(self, calls, pull):
        shards = [self._shards[name] for name, _ in calls]
        try:
            return True, push_atomic(shards, [tuple(c) for _, c in calls], pull=pull)
        except (PushRejected, RoundFailedError) as exc:
            return False, exc

    @staticmethod
    def _merged(calls, results, infos):
        """Each push result, replaced by its round's result (`infos`, by shard) where it has one."""
        return [r if name not in infos else dict(infos[name], duplicate=r["duplicate"])
                for (name, _), r in zip(calls, results)]

    def wait_here(self, calls, pushed, pull=False, timeout=None):
        """In the caller's thread: each sync round of a :meth:`_push` result, blocking on the
        shard's condition; ``(True, [round result])`` or ``(False, exception)``."""
        ok, results = pushed
        if not ok or self.options.mode != "sync":
            return pushed
        try:
            infos = {name: self._shards[name].wait_round(r["round"], timeout=timeout, pull=pull)
                     for (name, _), r in zip(calls, results) if r.get("round") is not None}
        except (RoundFailedError, ServerTimeoutError) as exc:
            return False, exc
        return True, self._merged(calls, results, infos)

    async def push_many(self, calls, pull=False, wait=True, timeout=None, timing=None):
        """Push to this process's shards atomically; in sync mode with `wait`, wait for the rounds.

        Returns ``(True, [per-shard result])`` or ``(False, exception)``;
        adds the seconds spent waiting for rounds to ``timing["round"]``.
        """
        waits = self.options.mode == "sync" and wait   # the round's result brings the params
        if self.options.check_finite:     # the caller checks only the shards it holds
            try:
                for name, (_, _, arrays, _, _) in calls:
                    for g, param in zip(arrays, self.specs[name]):
                        check_finite_gradient(g, param, f"shard {name!r}")
            except PushRejected as exc:     # counted by the caller, as every refusal
                return False, exc
        ok, results = self._push(calls, pull and not waits)
        if not ok or not waits:
            return ok, results
        infos = {}
        start = time.perf_counter()
        try:
            for (name, _), r in zip(calls, results):
                if r.get("round") is not None:
                    infos[name] = await self.wait_round(name, r["round"], pull, timeout)
        except (RoundFailedError, ServerTimeoutError) as exc:
            return False, exc
        finally:
            if timing is not None:
                timing["round"] += time.perf_counter() - start
        return True, self._merged(calls, results, infos)

    async def wait_round(self, name, round_id, pull=False, timeout=None):
        """Wait for a sync round of shard `name` to end (event-driven); its result."""
        shard = self._shards[name]
        self._loop = asyncio.get_running_loop()
        wait_for = self.options.wait_timeout if timeout is None else timeout
        end = time.monotonic() + wait_for
        while True:
            event = self._event(name)             # taken before the check: no lost wake-up
            # the lock is only ever held for a step or a copy: wait for it (with
            # blocking=False a busy lock would read as an open round, and the round's
            # end, already signalled, would be missed until the timeout); the round's
            # waiters share one copy of the parameters, which is only sent
            result = shard.wait_round(round_id, timeout=0, pull=pull, shared=True)
            if result is not None:
                return result
            left = end - time.monotonic()
            if left <= 0:
                raise shard.book.wait_timed_out(round_id, wait_for)
            deadline = shard.book.deadline()
            step = left if deadline is None else min(left, deadline + 1e-3)
            try:
                await asyncio.wait_for(event.wait(), max(step, 1e-4))
            except asyncio.TimeoutError:
                pass
