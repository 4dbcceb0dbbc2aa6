"""The Dask backend: server shards as Dask actors, workers as Dask tasks.

The server's shards are placed round-robin on the cluster's workers; the
shards of one worker live in one Dask actor (``client.submit(ShardActor,
..., actor=True)``), so updates of shards on different workers run in
different processes while each shard's updates are serialized by its lock,
and a push costs one message per process. Each trainer is a Dask task that
compiles its own gradient function and talks to the actors directly.

A push to shards in several processes is checked on all of them before it is
applied anywhere (one extra message, skipped in async mode when every version
in the push is one this client has already seen). Waiting for a sync round
is event-driven: the shard wakes the waiting coroutine when the round ends.
Every call to an actor is bounded by the server's ``wait_timeout``: a lost
process becomes :class:`~lasagne_accum.distributed.checks.ShardLostError`.

Without an address, :func:`local_cluster` starts a ``LocalCluster`` of
processes bound to 127.0.0.1 (scheduler, workers, nannies and the scheduler's
HTTP endpoint all on loopback, random ports, no dashboard) and closes it on
exit. With an address, the client connects to your scheduler; pass
``security=distributed.security.Security(...)`` to use TLS.

Importing this module does not import ``distributed``; the functions that
need it do.
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid

import numpy as np

from .checks import PushRejected, RoundFailedError, ServerOptions, ServerTimeoutError, \
    ShardLostError, named_params
from .server import BaseServer
from .shard import Shard, push_atomic
from .worker import Worker, raise_worker_errors, worker_lists

__all__ = ["DaskParameterServer", "ShardActor", "local_cluster", "connect", "run_dask"]

_GRACE = 5.0         # seconds added to wait_timeout for the message itself
SAME_PROCESS_SHORTCUT = True   # a task calls the shards of its own process without a message


def _require_distributed():
    try:
        import distributed
    except ImportError:
        raise ImportError("the dask backend needs Dask's distributed scheduler: "
                          "pip install 'dask[distributed]' (or lasagne_accum[distributed])") \
            from None
    return distributed


class ShardActor:
    """The shards placed on one Dask worker, as one Dask actor.

    Each method takes a list of ``(shard name, args)`` and returns a list of
    ``(ok, result or exception)``, so that one message per process serves
    every shard there. Shard work runs on one thread of the actor's own;
    :meth:`push_many` and :meth:`wait_round` are coroutines on the worker's
    event loop, so waiting for a sync round never blocks the pushes that
    close it, and they wait on an event that the shard sets when a round
    ends (no polling).
    """

    def __init__(self, shard_specs, options):
        self.options = options
        self._shards = {}
        for name, params, update_rule, rule_kwargs in shard_specs:
            shard = Shard(name, params, update_rule, rule_kwargs, options)
            shard.book.listeners.append(lambda rid, name=name: self._round_ended(name))
            self._shards[name] = shard
        self._pool = None
        self._loop = None
        self._events = {name: None for name in self._shards}

    def pid(self):
        import os
        return os.getpid()

    # ------------------------------------------------------------ threads and events

    def _executor(self):
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shards")
        return self._pool

    async def _run(self, fn, *args):
        """Run shard work on the actor's thread, so that the event loop stays responsive.

        (Running small shards on the loop itself, without the thread hop, was
        measured: no faster on the digits MLP, within the noise of a loaded
        machine.)
        """
        self._loop = asyncio.get_running_loop()
        return await self._loop.run_in_executor(self._executor(), fn, *args)

    def _event(self, name):
        if self._events[name] is None:
            self._events[name] = asyncio.Event()
        return self._events[name]

    def _round_ended(self, name):          # called with the shard's lock held, any thread
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake, name)

    def _wake(self, name):
        event, self._events[name] = self._events[name], None
        if event is not None:
            event.set()

    # ------------------------------------------------------------ calls

    def call(self, method, calls):
        out = []
        for name, args in calls:
            try:
                out.append((True, getattr(self._shards[name], method)(*args)))
            except Exception as exc:      # sent back, raised by the caller
                out.append((False, exc))
        return out

    async def call_async(self, method, calls):
        """:meth:`call` on the shards' thread, from the event loop."""
        return await self._run(self.call, method, calls)

    def _check(self, calls):
        shards = [self._shards[name] for name, _ in calls]
        try:
            for shard, (_, (wid, seq, _, _, version)) in zip(shards, calls):
                with shard.lock:
                    shard.book.check(wid, seq, version)
        except (PushRejected, RoundFailedError) as exc:
            return False, exc
        return True, None

    async def check_many(self, calls):
        """Would these pushes be taken? ``(True, None)`` or ``(False, exception)``; changes nothing."""
        return await self._run(self._check, calls)

    def _push(self, calls, pull):
        shards = [self._shards[name] for name, _ in calls]
        try:
            return True, push_atomic(shards, [c for _, c in calls], pull=pull)
        except (PushRejected, RoundFailedError) as exc:
            return False, exc

    async def push_many(self, calls, pull=False, wait=True, timeout=None):
        """Push to this process's shards atomically; in sync mode with `wait`, wait for the rounds.

        Returns ``(True, [per-shard result])`` or ``(False, exception)``.
        """
        ok, results = await self._run(self._push, calls, pull)
        if not ok or self.options.mode != "sync" or not wait:
            return ok, results
        out = []
        try:
            for (name, _), r in zip(calls, results):
                if r.get("round") is None:
                    out.append(r)
                    continue
                info = await self.wait_round(name, r["round"], pull, timeout)
                out.append(dict(info, duplicate=r["duplicate"]))
        except (RoundFailedError, ServerTimeoutError) as exc:
            return False, exc
        return True, out

    async def wait_round(self, name, round_id, pull=False, timeout=None):
        """Wait for a sync round of shard `name` to end (event-driven); its result."""
        shard = self._shards[name]
        self._loop = asyncio.get_running_loop()
        wait_for = self.options.wait_timeout if timeout is None else timeout
        end = time.monotonic() + wait_for
        while True:
            event = self._event(name)             # taken before the check: no lost wake-up
            result = shard.wait_round(round_id, timeout=0, blocking=False, pull=pull)
            if result is not None:
                return result
            left = end - time.monotonic()
            if left <= 0:
                raise ServerTimeoutError(
                    f"shard {name!r}: waited {wait_for:g} s for sync round {round_id} to "
                    f"close; it still waits for pushes from "
                    f"{', '.join(map(repr, shard.book.missing())) or 'nobody'} (set "
                    "round_timeout= to drop workers that stop pushing)")
            deadline = shard.book.deadline()
            step = left if deadline is None else min(left, deadline + 1e-3)
            if shard.lock.locked():
                step = min(step, 0.005)           # the lock was busy: look again soon
            try:
                await asyncio.wait_for(event.wait(), max(step, 1e-4))
            except asyncio.TimeoutError:
                pass


class DaskParameterServer(BaseServer):
    """The parameter server with its shards in Dask actors.

    Same methods and options as
    :class:`~lasagne_accum.distributed.server.ParameterServer`, plus:

    Parameters
    ----------
    client : distributed.Client
    params, update_rule, rule_kwargs, shards, options, **option_kwargs
        As for ``ParameterServer``. The rule and its hyperparameters (a
        schedule callable included) are pickled to the actors; a
        shared-variable learning rate would be a copy there, so use a
        schedule.
    workers : list of str, optional
        Worker addresses to place shards on (round-robin); default all.

    Shards are placed round-robin on the workers (``placement``); the shards
    of one worker live in one actor (one message per process and call).
    The object pickles to its actor handles, so tasks can take it as an
    argument and push directly to the shards. :meth:`close` releases the
    actors.
    """

    def __init__(self, client, params, update_rule, rule_kwargs=None, *, shards=None,
                 workers=None, options=None, **option_kwargs):
        options = ServerOptions.of(options, **option_kwargs)
        named = named_params(params)
        arrays = {n: np.array(p.get_value() if hasattr(p, "get_value") else p, copy=True)
                  for n, p in named.items()}
        self._setup(arrays, shards, options)
        addresses = list(workers) if workers else sorted(client.scheduler_info()["workers"])
        if not addresses:
            raise RuntimeError("the Dask cluster has no workers")
        self.placement = {s: addresses[i % len(addresses)] for i, s in enumerate(self.plan)}
        self.hosts = list(dict.fromkeys(self.placement.values()))
        self._group_of = [self.hosts.index(self.placement[s]) for s in self.shard_names]
        self._known = [0] * len(self.shard_names)    # versions this client has seen
        tag = uuid.uuid4().hex[:8]
        self._futures = []
        for g, address in enumerate(self.hosts):
            specs = [(s, {n: arrays[n] for n in self.plan[s]}, update_rule, rule_kwargs)
                     for s in self.shard_names if self.placement[s] == address]
            self._futures.append(client.submit(
                ShardActor, specs, options, actor=True, workers=[address],
                allow_other_workers=False, pure=False, key=f"lasagne-shards-{g}-{tag}"))
        try:
            self._actors = [f.result(timeout=options.wait_timeout + _GRACE)
                            for f in self._futures]
        except BaseException:
            self.close()
            raise

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_futures"] = []
        return state

    def _groups(self, indices, args_list):
        groups = {}
        for pos, (i, args) in enumerate(zip(indices, args_list)):
            groups.setdefault(self._group_of[i], []).append((pos, self.shard_names[i], args))
        return groups

    def _here(self, g):
        """Group `g`'s actor object if it lives in this worker process (else None)."""
        if not SAME_PROCESS_SHORTCUT:
            return None
        distributed = _require_distributed()
        try:
            worker = distributed.get_worker()
        except ValueError:            # not inside a Dask worker
            return None
        if worker.address != self.hosts[g]:
            return None
        return worker.state.actors.get(self._actors[g].key)

    def _invoke(self, g, method, *args):
        """Start ``actor.method(*args)`` on group `g`'s actor; ShardLostError if it is gone.

        From a task in the actor's own process the coroutine is scheduled on
        that process's event loop directly: no message to itself, no
        serialization (the arrays were copied when the push was checked).
        """
        actor = self._here(g)
        if actor is not None:
            fn = getattr(actor, method)
            if asyncio.iscoroutinefunction(fn):
                loop = _require_distributed().get_worker().loop.asyncio_loop
                return asyncio.run_coroutine_threadsafe(fn(*args), loop)
            done = concurrent.futures.Future()
            done.set_result(fn(*args))
            return done
        try:
            return getattr(self._actors[g], method)(*args)
        except (OSError, EOFError, RuntimeError, ValueError) as exc:
            names = [s for s, h in self.placement.items() if h == self.hosts[g]]
            raise ShardLostError(
                f"{method}: the process holding shard(s) {', '.join(map(repr, names))} on "
                f"{self.hosts[g]} is lost ({type(exc).__name__}: {exc}); their state since "
                "the last checkpoint is lost: restart from a checkpoint") from exc

    def _result(self, g, future, what, extra=0.0):
        """`future`'s result within the timeout; ShardLostError if the process is gone."""
        timeout = self.options.wait_timeout + _GRACE + extra
        names = [s for s, h in self.placement.items() if h == self.hosts[g]]
        try:
            return future.result(timeout=timeout)
        except (PushRejected, RoundFailedError, ServerTimeoutError):
            raise
        except (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError) as exc:
            raise ShardLostError(
                f"{what}: shard(s) {', '.join(map(repr, names))} on {self.hosts[g]} did not "
                f"answer within {timeout:g} s ({type(exc).__name__}); if that process died, "
                "their state since the last checkpoint is lost: restart from a checkpoint "
                "(train(..., checkpoint_to=..., checkpoint_every=...), resume_from=)") from None
        except (OSError, EOFError, RuntimeError, ValueError) as exc:
            distributed = _require_distributed()
            lost = (OSError, EOFError, distributed.comm.CommClosedError)
            if isinstance(exc, lost) or "actor" in str(exc).lower() or \
                    type(exc).__name__ in ("KilledWorker", "FutureCancelledError"):
                raise ShardLostError(
                    f"{what}: the process holding shard(s) {', '.join(map(repr, names))} on "
                    f"{self.hosts[g]} is lost ({type(exc).__name__}: {exc}); their state "
                    "since the last checkpoint is lost: restart from a checkpoint") from exc
            raise

    def _gather(self, n, groups, futures, what, extra=0.0):
        results, error = [None] * n, None
        for g, items in groups.items():
            try:
                outs = self._result(g, futures[g], what, extra)
            except Exception as exc:
                error = error or exc
                continue
            for (pos, _, _), (ok, value) in zip(items, outs):
                if ok:
                    results[pos] = value
                else:
                    error = error or value
        if error is not None:
            raise error
        return results

    def _call(self, indices, method, args_list):
        groups = self._groups(indices, args_list)
        futures = {g: self._invoke(g, "call_async", method, [(n, a) for _, n, a in items])
                   for g, items in groups.items()}
        return self._gather(len(indices), groups, futures, method)

    def _push(self, indices, calls, pull, wait):
        groups = self._groups(indices, calls)
        need_check = len(groups) > 1 and (self.mode == "sync" or any(
            c[4] > self._known[i] for i, c in zip(indices, calls)))
        if need_check:          # all or nothing across processes: check everywhere first
            futures = {g: self._invoke(g, "check_many",
                                       [(n, (c[0], c[1], None, None, c[4])) for _, n, c in items])
                       for g, items in groups.items()}
            for g, future in futures.items():
                ok, exc = self._result(g, future, "push (check)")
                if not ok:
                    raise exc
        futures = {g: self._invoke(g, "push_many", [(n, c) for _, n, c in items], pull, wait)
                   for g, items in groups.items()}
        results, error = [None] * len(indices), None
        for g, items in groups.items():
            try:
                ok, value = self._result(g, futures[g], "push", extra=self.options.wait_timeout)
            except Exception as exc:
                error = error or exc
                continue
            if not ok:
                error = error or value
                continue
            for (pos, _, _), r in zip(items, value):
                results[pos] = r
        if error is not None:
            raise error
        for i, r in zip(indices, results):
            if r.get("version") is not None:
                self._known[i] = max(self._known[i], r["version"])
        return results

    def _note_rejected(self):
        try:
            self._call([0], "note_rejected", [()])
        except Exception:       # counting must not hide the rejection itself
            pass

    def actor_pids(self):
        """``{worker address: process id}`` of the processes holding shards."""
        return {self.hosts[g]: self._result(g, self._invoke(g, "pid"), "pid")
                for g in range(len(self._actors))}

    def close(self):
        """Release the shard actors (their state is lost: :meth:`save` first)."""
        for f in getattr(self, "_futures", []):
            f.release()
        self._futures = []


@contextlib.contextmanager
def local_cluster(n_workers=2, *, security=None, silence_logs=logging.ERROR, **cluster_kwargs):
    """Start a ``LocalCluster`` of processes on 127.0.0.1; yield a Client; close both.

    One thread per worker process, no dashboard, random loopback ports.
    `security` (a ``distributed.security.Security``, or True for a temporary
    self-signed one, which needs the ``cryptography`` package) turns on TLS.
    """
    distributed = _require_distributed()
    kwargs = dict(n_workers=n_workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                  dashboard_address=None, worker_dashboard_address=None,
                  scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                  security=security, silence_logs=silence_logs)
    kwargs.update(cluster_kwargs)
    cluster = distributed.LocalCluster(**kwargs)
    try:
        client = distributed.Client(cluster, security=cluster.security)
        try:
            yield client
        finally:
            client.close()
    finally:
        cluster.close()


@contextlib.contextmanager
def connect(address, *, security=None):
    """A Client of the scheduler at `address`; closed (not the cluster) on exit."""
    distributed = _require_distributed()
    client = distributed.Client(address, security=security)
    try:
        yield client
    finally:
        client.close()


class _StartBarrier:
    """Called by each trainer task after its warm-up: report ready, wait for the go."""

    def __init__(self, tag, timeout=300):
        self.tag, self.timeout = tag, timeout

    def ready_event(self, worker_id):
        return f"{self.tag}-ready-{worker_id}"

    def __call__(self, worker_id):
        distributed = _require_distributed()
        distributed.Event(self.ready_event(worker_id)).set()
        distributed.Event(f"{self.tag}-go").wait(self.timeout)


def _worker_task(server, worker_id, build_model, batches, accumulate, model_kwargs,
                 compile_mode, barrier=None):
    """Run one trainer inside a Dask worker process."""
    try:
        worker = Worker(server, worker_id, build_model, accumulate=accumulate,
                        model_kwargs=model_kwargs, compile_mode=compile_mode)
        if callable(batches):
            batches = batches()
    except BaseException:
        server.unregister(worker_id)      # let sync rounds go on without it
        raise
    start = None if barrier is None else (lambda: barrier(worker_id))
    return worker.run(batches, start=start)


def _trainer_addresses(client, server, n):
    """Where trainers run: workers without shards when there are enough of them, else all."""
    addresses = sorted(client.scheduler_info()["workers"])
    free = [a for a in addresses if a not in set(getattr(server, "hosts", ()))]
    return free if len(free) >= n else addresses


def run_dask(server, client, build_model, worker_batches, *, accumulate=1, model_kwargs=None,
             compile_mode=None, snapshot_interval=None, worker_ids=None, checkpoint=None,
             lost=None, tick=0.5):
    """Run one Dask task per entry of `worker_batches` against `server`.

    Same arguments and result as :func:`lasagne_accum.distributed.local.run_local`;
    an entry of `worker_batches` may also be a callable returning the batches
    (called inside the task, so the data need not travel).

    A trainer whose process dies is reported in `lost` (a list this
    function appends ``{"worker", "address", "reason"}`` to) and unregistered,
    so sync rounds go on without it; the others finish (the processes are
    checked every `tick` seconds). `checkpoint`, a callable, is called about
    every 0.1 s while training runs (the caller decides when to save).
    """
    distributed = _require_distributed()
    worker_batches, ids = worker_lists(worker_batches, worker_ids)
    addresses = _trainer_addresses(client, server, len(ids))
    for wid in ids:          # every worker is live before the first round opens
        server.register(wid)
    barrier = None
    if sum(client.nthreads()[a] for a in addresses) >= len(ids):   # all trainers at once
        barrier = _StartBarrier(f"lasagne-{uuid.uuid4().hex[:8]}",
                                timeout=server.options.wait_timeout)
    pinned = [addresses[k % len(addresses)] for k in range(len(ids))]
    futures = [client.submit(_worker_task, server, wid, build_model, batches, accumulate,
                             model_kwargs, compile_mode, barrier, pure=False,
                             workers=[address], allow_other_workers=False)
               for wid, batches, address in zip(ids, worker_batches, pinned)]
    history = []
    lost = [] if lost is None else lost
    dead = set()
    try:
        if barrier is not None:
            _release_when_ready(distributed, client, ids, futures, barrier, pinned, dead)
        due = time.monotonic() + (snapshot_interval or 0)
        look = time.monotonic() + tick
        while True:
            pending = [f for k, f in enumerate(futures) if not f.done() and k not in dead]
            if not pending:
                break
            wait = max(0.01, look - time.monotonic())
            if checkpoint is not None:
                wait = min(wait, 0.1)
            if snapshot_interval:
                wait = min(wait, max(0.01, due - time.monotonic()))
            try:
                distributed.wait(pending, timeout=wait, return_when="FIRST_COMPLETED")
            except (TimeoutError, getattr(distributed, "TimeoutError", TimeoutError)):
                pass
            if time.monotonic() >= look:      # one scheduler query per tick, not per wake-up
                _find_dead(client, server, ids, futures, pinned, dead, lost)
                look = time.monotonic() + tick
            if snapshot_interval and time.monotonic() >= due:
                history.append((time.time(),) + server.pull())
                due += snapshot_interval
            if checkpoint is not None:
                checkpoint()
        if snapshot_interval:
            history.append((time.time(),) + server.pull())
        reports, errors = [], []
        for k, (wid, f) in enumerate(zip(ids, futures)):
            if k in dead:
                errors.append(None)
                continue
            try:
                reports.append(f.result(timeout=server.options.wait_timeout))
                errors.append(None)
            except Exception as exc:
                errors.append(exc)
        raise_worker_errors(ids, errors)
        return reports, history
    finally:
        for f in futures:
            f.release()


def _find_dead(client, server, ids, futures, pinned, dead, lost):
    """Mark trainers whose worker process is gone; unregister them (sync rounds go on)."""
    alive = set(client.scheduler_info()["workers"])
    for k, (wid, f, address) in enumerate(zip(ids, futures, pinned)):
        if k in dead or f.done() or address in alive:
            continue
        dead.add(k)
        f.cancel()
        lost.append(dict(worker=wid, address=address,
                         reason=f"the process of worker {address} is gone"))
        try:
            server.unregister(wid)
        except Exception:      # its shards may be gone too: the survivors' pushes say so
            pass


def _release_when_ready(distributed, client, ids, futures, barrier, pinned, dead):
    """Set the start event once every trainer has reported ready (or failed, or died)."""
    waiting = dict(zip(ids, futures))
    index = {wid: k for k, wid in enumerate(ids)}
    end = time.monotonic() + barrier.timeout
    while waiting and time.monotonic() < end:
        alive = set(client.scheduler_info()["workers"])
        for wid, f in list(waiting.items()):
            if f.status in ("error", "cancelled", "finished") or \
                    pinned[index[wid]] not in alive or \
                    distributed.Event(barrier.ready_event(wid), client=client).wait(0.05):
                del waiting[wid]
    distributed.Event(f"{barrier.tag}-go", client=client).set()
