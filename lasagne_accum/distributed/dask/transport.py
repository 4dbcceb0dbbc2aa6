"""The caller's side: requests to the shard processes over Dask's own comms.

A request calls the comm handler :data:`HANDLER` that each shard process
installs on its ``distributed.Worker``
(:func:`~lasagne_accum.distributed.dask.actor.install_handler`) as Dask calls
its own: ``pool(address).lasagne_accum_shards(key=..., request=...)``, a
``PooledRPCCall`` of a ``distributed.core.ConnectionPool`` (one per set of
connection arguments, so the cluster's ``Security`` decides TLS), whose
``send_recv`` closes a comm left out of step by an error, a timeout or a
cancel. It runs on this process's one background event-loop thread: a calling
thread hands its requests to that loop and waits for the replies; it never
runs a loop of its own, so calls from a thread that runs one (a notebook) work.

Numpy arrays travel as Dask's out-of-band frames: a request's arrays are
wrapped in ``Serialize``, whose frame is a view of the array (no copy here),
and the shard process's arrays are views of the frames read from the socket;
a reply is a ``ToPickle`` whose arrays are pickle buffers, also out of band,
and this process's arrays are views of the frames it read. A refusal is data
too: Dask's ``error_message`` (status :data:`REFUSED`), made the exception
again by :func:`decode` (``clean_exception``).

:func:`call` sends requests to several processes at once, runs the caller's
own work meanwhile, then collects the replies, all within the server's
``wait_timeout``. A pooled comm found closed (the other side dropped it while
it was idle) is replaced and the request sent once more (Dask's ``retry``; a
push repeated with the same ``(worker, seq)`` is not applied twice). A
process that does not answer, or holds no shards under that key any more,
becomes :class:`~lasagne_accum.distributed.errors.ShardLostError`.
"""

import asyncio
import concurrent.futures
import functools
import os
import threading
import time

import numpy as np

from ..errors import ShardLostError
from .actor import HANDLER, REFUSED, Gone
from .cluster import require_distributed

__all__ = ["call", "decode", "GRACE"]

GRACE = 5.0           # seconds added to wait_timeout for the message itself


class _Comms:
    """This process's background event loop and its connection pools."""

    def __init__(self):
        self.lock = threading.Lock()
        self.loop = self.thread = None
        self.pools = {}                   # connection arguments' key: (arguments, pool)
        self.calls = {}                   # (pool, address): the PooledRPCCall's HANDLER
        self.timing = threading.local()

    def submit(self, coro):
        """Run `coro` on the loop (started on first use); a concurrent.futures.Future."""
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.loop = asyncio.new_event_loop()
                self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                               name="lasagne-accum-comms")
                self.thread.start()
                self.pools, self.calls = {}, {}
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def pool(self, args):
        """The pool for the connection arguments `args` (on the loop)."""
        key = tuple(sorted((k, id(v)) for k, v in args.items()))
        if key not in self.pools:
            pool = await require_distributed().core.ConnectionPool(connection_args=args)
            self.pools[key] = (args, pool)      # `args` kept: the ids in the key stay theirs
        return self.pools[key][1]

    async def handler(self, args, address):
        """``(pool, PooledRPCCall's HANDLER at `address`)`` for the connection arguments
        `args` (on the loop); kept, as making the call object costs 5 us a request."""
        pool = await self.pool(args)
        call = self.calls.get((pool, address))
        if call is None:
            call = self.calls[pool, address] = getattr(pool(address), HANDLER)
        return pool, call

    def after_fork(self):
        self.__init__()


_comms = _Comms()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_comms.after_fork)


def outgoing(x):
    """A request as a Dask message holds it: arrays as out-of-band frames (not copied when
    contiguous), numpy scalars as Python numbers, tuples as lists."""
    if isinstance(x, np.ndarray):      # (np.ascontiguousarray would make a 0-d array 1-d)
        return require_distributed().protocol.Serialize(
            x if x.flags.c_contiguous else np.ascontiguousarray(x))
    if isinstance(x, (list, tuple)):
        return [outgoing(v) for v in x]
    if isinstance(x, dict):
        return {k: outgoing(v) for k, v in x.items()}
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return x


class _IdleCommClosed(ConnectionError):
    """A comm that idled in the pool was found closed by the other side."""


async def _request(pool, handler, address, message):
    """One request: `handler`, a PooledRPCCall of `pool` to `address`, as Dask calls one."""
    # the pool hands out an idle comm before it opens one (no await between this look and
    # its choice); an idle comm may have been closed by the other side meanwhile
    idle = any(not c.closed() for c in pool.available.get(address, ()))
    try:
        return await handler(**message)
    except (require_distributed().comm.CommClosedError, EOFError, ConnectionError) as exc:
        if not idle:
            raise
        for comm in list(pool.available.get(address, ())):   # idle as long: dropped too
            comm.abort()
        raise _IdleCommClosed(f"an idle pooled comm to {address} was closed: {exc}") from exc


async def _send(args, address, message):
    """:func:`_request`; once more on a fresh comm if an idle one was found closed.
    (Dask's ``retry_operation`` takes its count from Dask's config, 0 by default: this
    one retry is part of the transport's meaning, not a setting.)"""
    pool, handler = await _comms.handler(args, address)
    return await require_distributed().utils_comm.retry(
        functools.partial(_request, pool, handler, address, message), count=1,
        delay_min=0.0, delay_max=0.0, jitter_fraction=0.0,
        retry_on_exceptions=_IdleCommClosed, operation=HANDLER)


def decode(reply):
    """A shard handler's reply as ``(value, seconds)``: the request's value, or for a
    refusal its exception (with the shard process's traceback); `seconds` are ``[shard,
    round]`` when the request asked for them (profile), else empty."""
    if reply is None:                   # no handler there: a process that is not ours
        return Gone("the process has no shard handler (restarted?)"), []
    if isinstance(reply, dict) and reply.get("status") == REFUSED:
        _, exc, tb = require_distributed().core.clean_exception(**reply)
        return exc.with_traceback(tb), []
    value, *seconds = reply
    return value, seconds


def _lost(server, g, what, exc, timeout):
    """The ShardLostError for a failed exchange with group `g`'s process."""
    names, host = server.group_names(g), server.hosts[g]
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, concurrent.futures.TimeoutError)):
        return ShardLostError(
            f"{what}: shard(s) {names} on {host} did not answer within {timeout:g} s "
            f"({type(exc).__name__}); if that process died, their state since the last "
            "checkpoint is lost: restart from a checkpoint (train(..., checkpoint="
            "Checkpoint(...)))")
    error = ShardLostError(
        f"{what}: the process holding shard(s) {names} on {host} is lost "
        f"({type(exc).__name__}: {exc}); their state since the last checkpoint is lost: "
        "restart from a checkpoint")
    error.__cause__ = exc
    return error


def last_timing():
    """``{"serialise", "shard", "round"}`` seconds of this thread's last :func:`call` (None
    unless the server's ``profile`` option is on)."""
    return getattr(_comms.timing, "value", None)


def call(server, jobs, what, extra=0.0, between=None):
    """Run ``{g: request}`` on the groups' processes, all at once; ``{g: value or exception}``.

    Every request is handed to the event loop before `between` (a callable:
    the caller's work on the shards of its own process) runs; the replies are
    collected after it. With the server's ``profile`` option, this thread's
    timing (:func:`last_timing`) becomes ``{"serialise", "shard", "round"}``:
    seconds preparing the requests here, and the longest of the processes'
    seconds in their shards and waiting for sync rounds.
    """
    profile = server.options.profile
    timing = dict(serialise=0.0, shard=0.0, round=0.0) if profile else None
    _comms.timing.value = timing
    if not jobs:
        if between is not None:
            between()
        return {}
    distributed = require_distributed()
    lost = (Gone, OSError, EOFError, asyncio.TimeoutError, TimeoutError,
            concurrent.futures.TimeoutError, distributed.comm.CommClosedError)
    timeout = server.options.wait_timeout + GRACE + extra
    end = time.monotonic() + timeout
    args = server.connection_args()
    start = time.perf_counter()
    messages = {g: dict(key=server._keys[g], request=outgoing(job), profile=profile)
                for g, job in jobs.items()}
    if profile:
        timing["serialise"] += time.perf_counter() - start
    futures = {g: _comms.submit(asyncio.wait_for(
        _send(args, server.hosts[g], message), timeout)) for g, message in messages.items()}
    out = {}
    try:
        if between is not None:
            between()
    finally:
        for g, future in futures.items():
            try:
                value, seconds = decode(future.result(max(end - time.monotonic(), 0.0) + 1.0))
                if isinstance(value, Gone):
                    raise value
                if profile and seconds:
                    timing["shard"] = max(timing["shard"], seconds[0])
                    timing["round"] = max(timing["round"], seconds[1])
                out[g] = value
            except lost as exc:
                future.cancel()
                out[g] = _lost(server, g, what, exc, timeout)
            except BaseException as exc:
                future.cancel()
                if not isinstance(exc, Exception):
                    raise
                out[g] = exc
    return out
