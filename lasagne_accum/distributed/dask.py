"""The Dask backend: server shards held by Dask actors, workers as Dask tasks.

The server's shards are placed round-robin on the cluster's workers; the
shards of one worker live in one Dask actor (``client.submit(ShardActor,
..., actor=True)``), which places them, keeps them alive and releases them.
Updates of shards in different processes run in parallel; each shard's
updates are serialized by its lock.

Calls do not go through the actor machinery (two thread hops on each side
and Dask's per-array serialization: about 2 ms per call on loopback).
The call and its reply travel as one pickled buffer (protocol 5: the
gradient arrays are copied as raw bytes, no per-array frames), one message
each way, over one persisted link per (calling thread, shard process), in
the caller's own thread (no thread hop). Two transports carry it
(``transport=``):

* ``"direct"`` (the default): a blocking socket to a listener of the
  library's own (:mod:`~lasagne_accum.distributed.direct`), which each shard
  process opens beside its Dask worker (same host, a random port, the
  cluster's TLS); a link is refused unless it shows the server's token. A
  no-op request costs about 0.15 ms there and back on loopback.
* ``"dask"``: a Dask comm to the comm handler ``"lasagne_accum_shards"``
  that each shard process installs on its ``distributed.Worker``, driven by
  a private event loop in the caller's thread: no other port (for networks
  that only let Dask's own through), about 0.43 ms. A server whose workers'
  Dask addresses are not all TCP or TLS uses it too, and so does one whose
  shard processes cannot all open their socket (a ``RuntimeWarning`` says
  why: a contact address that is not the machine's own, behind a NAT, say).

A push to shards in several processes goes to all of them at once. The
shards of the caller's own process are called directly, without a message.

A push to shards in several processes is checked on all of them before it is
applied anywhere (one extra message), unless every shard must take the same
decision on it: versions this client has already seen from every shard, and
in sync mode no ``round_timeout`` (see ``DaskParameterServer._may_diverge``). Waiting for a sync round
is event-driven: the shard wakes the waiting coroutine (remote callers) or
thread (callers in its own process) when the round ends. Every call is
bounded by the server's ``wait_timeout``: a lost process becomes
:class:`~lasagne_accum.distributed.checks.ShardLostError`.

Without an address, :func:`local_cluster` starts a ``LocalCluster`` of
processes bound to 127.0.0.1 (scheduler, workers, nannies and the scheduler's
HTTP endpoint all on loopback, random ports, no dashboard) and closes it on
exit. With an address, the client connects to your scheduler; pass
``security=distributed.security.Security(...)`` to use TLS (the shard comms
use the same security).

Importing this module does not import ``distributed``; the functions that
need it do.
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import pickle
import threading
import time
import uuid
import warnings

import numpy as np

from . import direct
from .checks import PushRejected, RoundFailedError, ServerOptions, ServerTimeoutError, \
    ShardLostError, named_params
from .server import BaseServer
from .shard import Shard, push_atomic
from .worker import Worker, raise_worker_errors, worker_lists

__all__ = ["DaskParameterServer", "ShardActor", "local_cluster", "connect", "run_dask"]

_GRACE = 5.0         # seconds added to wait_timeout for the message itself
_RECONNECT = 2.0     # seconds to reconnect a persisted comm that was found closed
HANDLER = "lasagne_accum_shards"      # the comm handler's name on the shard processes
SAME_PROCESS_SHORTCUT = True   # a task calls the shards of its own process without a message


def _closed():
    """The errors that say a Dask comm was closed."""
    return (_require_distributed().comm.CommClosedError, OSError)


def _require_distributed():
    try:
        import distributed
    except ImportError:
        raise ImportError("the dask backend needs Dask's distributed scheduler: "
                          "pip install 'dask[distributed]' (or lasagne_accum[distributed])") \
            from None
    return distributed


class _Gone(Exception):
    """The shard process answered, but holds no shards under that key (released)."""


# ---------------------------------------------------------------- the shard process's side


def _listen(dask_worker):
    """Run by ``client.run`` on a shard process: start its direct listener.

    ``(host, port)``; None where the worker's address is not TCP or TLS; the
    error as a string where the socket cannot be opened (an address to bind
    that is not this machine's, behind a NAT, say).
    """
    try:
        return direct.listen(dask_worker, lambda key, payload: _serve(dask_worker, key, payload))
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def install_handler(worker):
    """Serve :data:`HANDLER` on `worker` (a ``distributed.Worker``); idempotent."""
    if HANDLER in worker.handlers:
        return

    async def lasagne_accum_shards(key=None, payload=None):
        return await _serve(worker, key, payload)

    worker.handlers[HANDLER] = lasagne_accum_shards


async def _serve(worker, key, payload):
    """One request: `payload` is the pickled ``(method, args)``; the reply, ``(ok, value)``."""
    try:
        actor = worker.state.actors.get(key)
        if actor is None:
            raise _Gone(f"no shards under {key!r} on {worker.address} (released, or the "
                        "process was restarted)")
        method, args = pickle.loads(payload)
        out = (True, await actor.serve(method, args))
    except Exception as exc:
        out = (False, exc)
    try:
        return pickle.dumps(out, protocol=5)
    except Exception as exc:          # an unpicklable result or exception: say what it was
        return pickle.dumps((False, RuntimeError(f"unpicklable reply: {out!r:.300} ({exc})")),
                            protocol=5)


class ShardActor:
    """The shards placed on one Dask worker, as one Dask actor.

    Requests arrive through :data:`HANDLER` (:meth:`serve`, on the worker's
    event loop) or, from a task in the same process, directly
    (:meth:`serve_here`, in the caller's thread). Each request covers every
    shard of this process that a call needs: ``("call", (method, [(shard
    name, args)]))`` returns ``[(ok, result or exception)]``; ``("check",
    (calls,))`` and ``("push", (calls, pull, wait))`` return ``(True,
    result)`` or ``(False, exception)``; ``("pid", ())`` the process id.
    Waiting for a sync round never blocks the event loop: the coroutine
    waits on an event that the shard sets when a round ends (no polling).
    """

    def __init__(self, shard_specs, options, key=None, token=None):
        self.options = options
        self._shards = {}
        for name, params, update_rule, rule_kwargs in shard_specs:
            shard = Shard(name, params, update_rule, rule_kwargs, options)
            shard.book.listeners.append(lambda rid, name=name: self._round_ended(name))
            self._shards[name] = shard
        self._loop = None
        self._events = {name: None for name in self._shards}
        try:
            worker = _require_distributed().get_worker()
        except ValueError:            # built outside a Dask worker (a test): no handler
            return
        self._loop = worker.loop.asyncio_loop
        install_handler(worker)
        if token is not None:
            direct.admit(worker, token, key)

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

    async def serve(self, method, args):
        """One request, on the event loop (the shard work itself is short: run in place)."""
        if method == "push":
            return await self.push_many(*args)
        return self.serve_here(method, args)

    def serve_here(self, method, args):
        """One request in the caller's thread; a sync push does not wait here (:meth:`wait_here`)."""
        if method == "call":
            return self.call(*args)
        if method == "check":
            return self._check(*args)
        if method == "push":
            calls, pull = args[:2]
            return self._push(calls, pull)
        if method == "pid":
            return self.pid()
        raise ValueError(f"unknown request {method!r}")

    def call(self, method, calls):
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
            return True, push_atomic(shards, [c for _, c in calls], pull=pull)
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

    async def push_many(self, calls, pull=False, wait=True, timeout=None):
        """Push to this process's shards atomically; in sync mode with `wait`, wait for the rounds.

        Returns ``(True, [per-shard result])`` or ``(False, exception)``.
        """
        ok, results = self._push(calls, pull)
        if not ok or self.options.mode != "sync" or not wait:
            return ok, results
        infos = {}
        try:
            for (name, _), r in zip(calls, results):
                if r.get("round") is not None:
                    infos[name] = await self.wait_round(name, r["round"], pull, timeout)
        except (RoundFailedError, ServerTimeoutError) as exc:
            return False, exc
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
            # blocking=False a busy lock read as an open round, and the round's end,
            # already signalled, was missed until the timeout)
            result = shard.wait_round(round_id, timeout=0, pull=pull)
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
            try:
                await asyncio.wait_for(event.wait(), max(step, 1e-4))
            except asyncio.TimeoutError:
                pass


# ---------------------------------------------------------------- the caller's side


class _Links(threading.local):
    """This thread's private event loop and its persisted links, ``{key: link}``.

    A key is the Dask address (a Dask comm) or ``(host, port, token)`` (a
    :class:`~lasagne_accum.distributed.direct.Link`).
    """

    loop = None

    def __init__(self):
        self.comms = {}

    def event_loop(self):
        if self.loop is None or self.loop.is_closed():
            self.loop = asyncio.new_event_loop()
            self.comms = {}
        return self.loop

    def drop(self, keys=None):
        """Close this thread's links (those under `keys`, default all)."""
        for key in list(self.comms if keys is None else keys):
            comm = self.comms.pop(key, None)
            if comm is not None:
                comm.abort()


_links = _Links()
_helper = None


def _helper_thread():
    """One thread for calls from a thread that already runs an event loop (a notebook)."""
    global _helper
    if _helper is None:
        _helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lasagne-dask")
    return _helper


class DaskParameterServer(BaseServer):
    """The parameter server with its shards held by Dask actors.

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
    transport : {"direct", "dask"}
        How calls reach the shards of other processes: ``"direct"`` (the
        default), a socket that each shard process opens beside its Dask
        worker (same host, a random port, the cluster's TLS, links checked
        against this server's random token); ``"dask"``, a Dask comm to the
        comm handler :data:`HANDLER` (no other port; about 0.3 ms more per
        call on loopback). See the module's notes. ``train`` builds its
        server with the default; pass ``server=`` to choose.

    Shards are placed round-robin on the workers (``placement``); the shards
    of one worker live in one actor and answer one message per process and
    call. The object pickles to its actor keys, addresses and token, so
    tasks can take it as an argument and push directly to the shards (pass
    it only through your cluster: the token admits its holder).
    :meth:`close` releases the actors.

    Examples
    --------
    >>> import numpy as np
    >>> from lasagne_accum import sgd
    >>> from lasagne_accum.distributed.dask import DaskParameterServer, local_cluster
    >>> with local_cluster(2) as client:                        # doctest: +SKIP
    ...     server = DaskParameterServer(client, {"w": np.zeros(3)}, sgd,
    ...                                  dict(learning_rate=0.1), mode="async")
    ...     version, _ = server.register("a")
    ...     r = server.push("a", 0, {"w": np.ones(3)}, version=version, pull=True)
    ...     server.close()
    >>> r["params"]["w"]                                        # doctest: +SKIP
    array([-0.1, -0.1, -0.1])
    """

    def __init__(self, client, params, update_rule, rule_kwargs=None, *, shards=None,
                 workers=None, transport="direct", options=None, **option_kwargs):
        if transport not in ("direct", "dask"):
            raise ValueError(f"transport must be 'direct' or 'dask', not {transport!r}")
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
        self._client_args = dict(client.connection_args)
        self.transport = transport
        self._token = direct.new_token() if transport == "direct" else None
        self._direct = [None] * len(self.hosts)     # (host, port) of each direct listener
        if transport == "direct":
            where = client.run(_listen, workers=self.hosts,
                               callback_timeout=options.wait_timeout + _GRACE)
            if all(isinstance(where[a], (tuple, list)) for a in self.hosts):
                self._direct = [tuple(where[a]) for a in self.hosts]
            else:                           # not TCP or TLS, or no socket: Dask comms
                self.transport, self._token = "dask", None
                failed = {a: w for a, w in where.items() if isinstance(w, str)}
                if failed:
                    warnings.warn(
                        "direct links unavailable, using Dask comms (transport='dask'): "
                        + "; ".join(f"{a}: {w}" for a, w in failed.items()), RuntimeWarning,
                        stacklevel=2)
        tag = uuid.uuid4().hex[:8]
        self._keys = [f"lasagne-shards-{g}-{tag}" for g in range(len(self.hosts))]
        self._futures = []            # they hold the actors (calls go by key, not by handle)
        for address, key in zip(self.hosts, self._keys):
            specs = [(s, {n: arrays[n] for n in self.plan[s]}, update_rule, rule_kwargs)
                     for s in self.shard_names if self.placement[s] == address]
            self._futures.append(client.submit(
                ShardActor, specs, options, key, self._token, actor=True, workers=[address],
                allow_other_workers=False, pure=False, key=key))
        try:
            for f in self._futures:   # the actors have started
                f.result(timeout=options.wait_timeout + _GRACE)
        except BaseException:
            self.close()
            raise

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_futures"] = []
        state["_client_args"] = None         # SSL contexts do not pickle; a task uses its worker's
        return state

    # ------------------------------------------------------------ transport

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
        return worker.state.actors.get(self._keys[g])

    def _names(self, g):
        return ", ".join(repr(s) for s, h in self.placement.items() if h == self.hosts[g])

    def _lost(self, g, what, exc, timeout):
        """The ShardLostError for a failed exchange with group `g`'s process."""
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            return ShardLostError(
                f"{what}: shard(s) {self._names(g)} on {self.hosts[g]} did not answer within "
                f"{timeout:g} s ({type(exc).__name__}); if that process died, their state since "
                "the last checkpoint is lost: restart from a checkpoint "
                "(train(..., checkpoint_to=..., checkpoint_every=...), resume_from=)")
        error = ShardLostError(
            f"{what}: the process holding shard(s) {self._names(g)} on {self.hosts[g]} is lost "
            f"({type(exc).__name__}: {exc}); their state since the last checkpoint is lost: "
            "restart from a checkpoint")
        error.__cause__ = exc
        return error

    def _connection_args(self):
        distributed = _require_distributed()
        try:
            return distributed.get_worker().connection_args
        except ValueError:
            return self._client_args or {}

    def _link_key(self, g):
        """The key of this thread's link to group `g`'s process in ``_links.comms``."""
        return self.hosts[g] if self._direct[g] is None else (*self._direct[g], self._token)

    def _link_keys(self):
        return [self._link_key(g) for g in range(len(self.hosts))]

    def _direct_link(self, g, timeout):
        """This thread's direct link to group `g`'s process; ``(link, reused)``."""
        key = self._link_key(g)
        link = _links.comms.get(key)
        if link is not None and not link.closed():
            return link, True
        _links.drop([key])
        host, port = self._direct[g]
        ssl_context = (self._connection_args().get("ssl_context")
                       if self.hosts[g].startswith("tls://") else None)
        link = _links.comms[key] = direct.Link.open(host, port, self._token, ssl_context,
                                                    timeout)
        return link, False

    def _direct_send(self, g, payload, timeout):
        """Write one request on this thread's direct link to group `g`; ``(link, reused)``."""
        link, reused = self._direct_link(g, timeout)
        try:
            link.write(payload, timeout)
        except (OSError, EOFError):
            _links.drop([self._link_key(g)])
            if reused:                 # closed while idle: once more on a new link
                return self._direct_send(g, payload, min(timeout, _RECONNECT))
            raise
        return link, reused

    def _direct_receive(self, g, payload, sent, timeout):
        """The reply to a request sent by :meth:`_direct_send` (bytes)."""
        link, reused = sent
        try:
            try:
                return link.read(timeout)
            except (EOFError, ConnectionError):
                _links.drop([self._link_key(g)])
                if not reused:
                    raise
                # closed while idle: send once more on a new link (a push repeated with
                # the same (worker, seq) is not applied twice)
                link, _ = self._direct_send(g, payload, min(timeout, _RECONNECT))
                return link.read(timeout)
        except BaseException:          # a timeout or an interrupt: the link is out of step
            _links.drop([self._link_key(g)])
            raise

    async def _send(self, g, payload, timeout):
        """Write one request to group `g`'s process on this thread's comm; ``(comm, reused)``."""
        key = self._link_key(g)
        comm = _links.comms.get(key)
        reused = comm is not None and not comm.closed()
        if not reused:
            comm = await _require_distributed().comm.connect(
                self.hosts[g], timeout=timeout, **self._connection_args())
            _links.comms[key] = comm
        try:
            await comm.write({"op": HANDLER, "key": self._keys[g], "payload": payload})
        except _closed():
            _links.drop([key])
            if reused:                 # closed while idle: once more on a new link
                return await self._send(g, payload, min(timeout, _RECONNECT))
            raise
        except BaseException:          # cancelled (a timeout): the link is out of step
            _links.drop([key])
            raise
        return comm, reused

    async def _receive(self, g, payload, sent, timeout):
        """The reply to a request sent by :meth:`_send`; its value, or raises its exception."""
        key = self._link_key(g)
        comm, reused = sent
        try:
            try:
                reply = await comm.read()
            except _closed():
                _links.drop([key])
                if not reused:
                    raise
                # closed while idle: send once more on a new comm (a push repeated
                # with the same (worker, seq) is not applied twice)
                comm, _ = await self._send(g, payload, min(timeout, _RECONNECT))
                reply = await comm.read()
        except BaseException:
            _links.drop([key])
            raise
        return self._value(reply, self.hosts[g])

    @staticmethod
    def _value(reply, address):
        """A reply's value, or raises the exception it carries."""
        if not isinstance(reply, (bytes, bytearray)):        # Dask's own error message
            raise RuntimeError(f"shard process {address}: {reply!r:.500}")
        ok, value = pickle.loads(reply)
        if not ok:
            raise value
        return value

    def _lost_errors(self):
        return (_Gone, direct.Refused, OSError, EOFError, asyncio.TimeoutError, TimeoutError,
                _require_distributed().comm.CommClosedError)

    def _remote(self, jobs, what, extra=0.0, between=None):
        """Run ``{g: (method, args)}`` on other processes, all at once; ``{g: result or exc}``.

        Every request is written before `between` (a callable, the work on
        this process's own shards) runs; the replies are read after it.
        """
        if not jobs:
            if between is not None:
                between()
            return {}
        if self.transport == "direct":
            return self._remote_direct(jobs, what, extra, between)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:                     # this thread runs an event loop: use a thread that does not
            return _helper_thread().submit(self._remote, jobs, what, extra, between).result()
        lost = self._lost_errors()
        timeout = self.options.wait_timeout + _GRACE + extra
        end = time.monotonic() + timeout
        loop = _links.event_loop()
        payloads = {g: pickle.dumps(job, protocol=5) for g, job in jobs.items()}
        out = {}

        async def guard(g, make):
            try:
                return await asyncio.wait_for(make(), max(1e-3, end - time.monotonic()))
            except lost as exc:
                out[g] = self._lost(g, what, exc, timeout)
            except Exception as exc:
                out[g] = exc

        async def every(groups, make):
            if len(groups) == 1:
                g = next(iter(groups))
                return {g: await guard(g, lambda: make(g))}
            done = await asyncio.gather(*(guard(g, lambda g=g: make(g)) for g in groups))
            return dict(zip(groups, done))

        sent = loop.run_until_complete(every(jobs, lambda g: self._send(g, payloads[g], timeout)))
        try:
            if between is not None:
                between()
        finally:
            todo = {g: v for g, v in sent.items() if g not in out}
            if todo:
                got = loop.run_until_complete(every(
                    todo, lambda g: self._receive(g, payloads[g], todo[g], timeout)))
                out.update({g: v for g, v in got.items() if g not in out})
        return out

    def _remote_direct(self, jobs, what, extra=0.0, between=None):
        """:meth:`_remote` over direct links: blocking sockets in this thread, no event loop."""
        lost = self._lost_errors()
        timeout = self.options.wait_timeout + _GRACE + extra
        end = time.monotonic() + timeout
        out, sent = {}, {}

        def attempt(g, step):
            try:
                return step()
            except lost as exc:
                _links.drop([self._link_key(g)])     # shards released under an open link
                out[g] = self._lost(g, what, exc, timeout)
            except Exception as exc:
                out[g] = exc

        for g, job in jobs.items():
            payload = pickle.dumps(job, protocol=5)
            link = attempt(g, lambda: self._direct_send(g, payload, end - time.monotonic()))
            if g not in out:
                sent[g] = payload, link
        try:
            if between is not None:
                between()
        finally:
            for g, (payload, link) in sent.items():
                value = attempt(g, lambda: self._value(self._direct_receive(
                    g, payload, link, end - time.monotonic()), self.hosts[g]))
                if g not in out:
                    out[g] = value
        return out

    def _run(self, jobs, what, extra=0.0):
        """``{g: (method, args)}``: the shards of this process directly, the others by message."""
        self._check_open()
        out = {}
        here = {g: self._here(g) for g in jobs}

        def local():
            for g, actor in here.items():
                if actor is not None:
                    try:
                        out[g] = actor.serve_here(*jobs[g])
                    except Exception as exc:
                        out[g] = exc

        out.update(self._remote({g: job for g, job in jobs.items() if here[g] is None}, what,
                                extra, between=local))
        return out

    # ------------------------------------------------------------ BaseServer's backend

    def _call(self, indices, method, args_list):
        groups = self._groups(indices, args_list)
        outs = self._run({g: ("call", (method, [(n, a) for _, n, a in items]))
                          for g, items in groups.items()}, method)
        results, error = [None] * len(indices), None
        for g, items in groups.items():
            if isinstance(outs[g], Exception):
                error = error or outs[g]
                continue
            for (pos, _, _), (ok, value) in zip(items, outs[g]):
                if ok:
                    results[pos] = value
                else:
                    error = error or value
        if error is not None:
            raise error
        return results

    def _push(self, indices, calls, pull, wait):
        groups = self._groups(indices, calls)
        per = {g: [(n, c) for _, n, c in items] for g, items in groups.items()}
        need_check = len(groups) > 1 and self._may_diverge(indices, calls)
        if need_check:          # all or nothing across processes: check everywhere first
            outs = self._run({g: ("check", ([(n, (c[0], c[1], None, None, c[4]))
                                             for n, c in per[g]],))
                              for g in groups}, "push (check)")
            for g in groups:
                if isinstance(outs[g], Exception):
                    raise outs[g]
                ok, exc = outs[g]
                if not ok:
                    raise exc
        # the requests to other processes are written first (there they wait for their
        # rounds); then this process's shards are pushed, without waiting for their
        # rounds (serve_here), while the others work; then the replies; then this
        # process's rounds
        outs = self._run({g: ("push", (per[g], pull, wait)) for g in groups}, "push",
                         extra=self.options.wait_timeout)
        failed = any(isinstance(v, Exception) or not v[0] for v in outs.values())
        if self.mode == "sync" and wait and not failed:
            for g in groups:
                actor = self._here(g)
                if actor is not None:
                    outs[g] = actor.wait_here(per[g], outs[g], pull)
        results, error = [None] * len(indices), None
        for g, items in groups.items():
            if isinstance(outs[g], Exception):
                error = error or outs[g]
                continue
            ok, value = outs[g]
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

    def _may_diverge(self, indices, calls):
        """Could the shards of different processes take different decisions on this push?

        Shards refuse a push for reasons of their own state: a version they
        have not reached, or (sync) a round that went on without the worker
        (``round_timeout`` drops it from some shards' rounds, maybe not yet
        from others'). Pushes of versions this client has already seen from
        every shard (async: at most; sync: exactly, with no round timeout)
        are refused by all shards or by none: no check is needed.
        """
        if self.mode == "sync":
            return self.options.round_timeout is not None or any(
                c[4] != self._known[i] for i, c in zip(indices, calls))
        return any(c[4] > self._known[i] for i, c in zip(indices, calls))

    def _note_rejected(self):
        try:
            self._call([0], "note_rejected", [()])
        except Exception:       # counting must not hide the rejection itself
            pass

    def actor_pids(self):
        """``{worker address: process id}`` of the processes holding shards."""
        outs = self._run({g: ("pid", ()) for g in range(len(self.hosts))}, "pid")
        for value in outs.values():
            if isinstance(value, Exception):
                raise value
        return {self.hosts[g]: pid for g, pid in outs.items()}

    def close(self):
        """Release the shard actors (their state is lost: :meth:`save` first).

        Later calls on this object raise ``ServerClosedError``. A copy that a
        task took before (pickled) does not know: its calls raise
        ``ShardLostError`` once the release has reached the workers.
        """
        self.closed = True
        links = self._link_keys() if hasattr(self, "_direct") else []
        _links.drop(links)
        if _helper is not None:
            _helper.submit(_links.drop, links).result()
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
    try:
        return worker.run(batches, start=start)
    finally:
        _links.drop(server._link_keys())


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
