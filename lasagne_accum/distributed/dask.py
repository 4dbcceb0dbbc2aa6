"""The Dask backend: server shards as Dask actors, workers as Dask tasks.

The server's shards are placed round-robin on the cluster's workers; the
shards of one worker live in one Dask actor (``client.submit(ShardActor,
..., actor=True)``), so updates of shards on different workers run in
different processes while each shard's updates are serialized by its lock,
and a push costs one message per process. Each trainer is a Dask task that
compiles its own gradient function and talks to the actors directly.

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

from .core import BaseServer, Shard, Worker, named_params

__all__ = ["DaskParameterServer", "ShardActor", "local_cluster", "connect", "run_dask"]


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
    every shard there. Synchronous methods run on the worker's actor thread;
    :meth:`push_wait` and :meth:`wait_round` are coroutines on the worker's
    event loop, so waiting for a sync round never blocks the pushes that
    close it. Each shard still serializes its own updates with its lock.
    """

    def __init__(self, shard_specs):
        self._shards = {}
        for args, kwargs in shard_specs:
            shard = Shard(*args, **kwargs)
            self._shards[shard.name] = shard
        self._pusher = None

    async def call_async(self, method, calls):
        """:meth:`call` on the actor's own thread, from the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor(), self.call, method, calls)

    def _executor(self):
        if self._pusher is None:
            self._pusher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shards")
        return self._pusher

    def call(self, method, calls):
        out = []
        for name, args in calls:
            try:
                out.append((True, getattr(self._shards[name], method)(*args)))
            except Exception as exc:      # sent back, raised by the caller
                out.append((False, exc))
        return out

    async def push_wait(self, calls, pull=False):
        """Sync mode in one message: push to the shards, then wait for their rounds.

        Returns ``(ok, (push result, round info))`` per shard.
        """
        pushed = await self.call_async("push", calls)
        out = []
        for (name, _), (ok, result) in zip(calls, pushed):
            if not ok or result.get("round") is None:
                out.append((ok, (result, None) if ok else result))
                continue
            try:
                out.append((True, (result, await self.wait_round(name, result["round"], pull))))
            except Exception as exc:
                out.append((False, exc))
        return out

    async def wait_round(self, name, round_id, pull=False, poll=0.002):
        shard = self._shards[name]
        while True:
            result = shard.wait_round(round_id, timeout=0, blocking=False, pull=pull)
            if result is not None:
                return result
            await asyncio.sleep(poll)


class DaskParameterServer(BaseServer):
    """The parameter server with its shards in Dask actors.

    Same methods and options as
    :class:`~lasagne_accum.distributed.core.ParameterServer`, plus:

    Parameters
    ----------
    client : distributed.Client
    params, update_rule, rule_kwargs, mode, shards, merge, staleness_scale,
    round_timeout, on_timeout, compile_mode, check_finite, keep_log
        As for ``ParameterServer``. The rule, its hyperparameters (a schedule
        callable included) are pickled to the actors; a shared-variable
        learning rate would be a copy there, so use a schedule.
    workers : list of str, optional
        Worker addresses to place shards on (round-robin); default all.

    Shards are placed round-robin on the workers (``placement``); the shards
    of one worker live in one actor (one message per process and call).
    The object pickles to its actor handles, so tasks can take it as an
    argument and push directly to the shards. :meth:`close` releases the
    actors.
    """

    def __init__(self, client, params, update_rule, rule_kwargs=None, *, mode="sync",
                 shards=None, merge="mean", staleness_scale=False, round_timeout=None,
                 on_timeout="close", compile_mode=None, check_finite=True, keep_log=False,
                 workers=None):
        named = named_params(params)
        arrays = {n: np.array(p.get_value() if hasattr(p, "get_value") else p, copy=True)
                  for n, p in named.items()}
        self._setup(arrays, shards, mode, merge, staleness_scale, round_timeout, on_timeout,
                    check_finite)
        addresses = list(workers) if workers else sorted(client.scheduler_info()["workers"])
        if not addresses:
            raise RuntimeError("the Dask cluster has no workers")
        opts = dict(mode=mode, merge=merge, staleness_scale=staleness_scale,
                    round_timeout=round_timeout, on_timeout=on_timeout,
                    compile_mode=compile_mode, check_finite=check_finite, keep_log=keep_log)
        self.placement = {s: addresses[i % len(addresses)] for i, s in enumerate(self.plan)}
        hosts = list(dict.fromkeys(self.placement.values()))
        self._group_of = [hosts.index(self.placement[s]) for s in self.shard_names]
        tag = uuid.uuid4().hex[:8]
        self._futures = []
        for g, address in enumerate(hosts):
            specs = [((s, {n: arrays[n] for n in self.plan[s]}, update_rule, rule_kwargs), opts)
                     for s in self.shard_names if self.placement[s] == address]
            self._futures.append(client.submit(
                ShardActor, specs, actor=True, workers=[address], allow_other_workers=False,
                pure=False, key=f"lasagne-shards-{g}-{tag}"))
        try:
            self._actors = [f.result() for f in self._futures]
        except BaseException:
            self.close()
            raise

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_futures"] = []
        return state

    def _call(self, indices, method, args_list):
        groups = {}
        for pos, (i, args) in enumerate(zip(indices, args_list)):
            groups.setdefault(self._group_of[i], []).append((pos, self.shard_names[i], args))
        futures = {g: self._actors[g].call_async(method, [(n, a) for _, n, a in items])
                   for g, items in groups.items()}
        return self._gather(len(indices), groups, futures)

    def _push_wait(self, idx, args, pull):
        groups = {}
        for pos, (i, a) in enumerate(zip(idx, args)):
            groups.setdefault(self._group_of[i], []).append((pos, self.shard_names[i], a))
        futures = {g: self._actors[g].push_wait([(n, a) for _, n, a in items], pull)
                   for g, items in groups.items()}
        pairs = self._gather(len(idx), groups, futures)
        return [p[0] for p in pairs], [p[1] for p in pairs]

    @staticmethod
    def _gather(n, groups, futures):
        results, error = [None] * n, None
        for g, items in groups.items():
            try:
                outs = futures[g].result()
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

    def _wait(self, index, round_id, pull=False):
        return self._actors[self._group_of[index]].wait_round(
            self.shard_names[index], round_id, pull).result()

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


def _release_when_ready(distributed, client, ids, futures, barrier):
    """Set the start event once every trainer has reported ready (or failed)."""
    waiting = dict(zip(ids, futures))
    while waiting:
        for wid, f in list(waiting.items()):
            if f.status in ("error", "cancelled") or \
                    distributed.Event(barrier.ready_event(wid), client=client).wait(0.05):
                del waiting[wid]
    distributed.Event(f"{barrier.tag}-go", client=client).set()


def run_dask(server, client, build_model, worker_batches, *, accumulate=1, model_kwargs=None,
             compile_mode=None, snapshot_interval=None, worker_ids=None):
    """Run one Dask task per entry of `worker_batches` against `server`.

    Same arguments and result as :func:`lasagne_accum.distributed.local.run_local`;
    an entry of `worker_batches` may also be a callable returning the batches
    (called inside the task, so the data need not travel).
    """
    distributed = _require_distributed()
    worker_batches = list(worker_batches)
    ids = list(worker_ids) if worker_ids is not None else \
        [f"worker{k}" for k in range(len(worker_batches))]
    if len(ids) != len(worker_batches):
        raise ValueError(f"{len(ids)} worker ids for {len(worker_batches)} batch lists")
    addresses = sorted(client.scheduler_info()["workers"])
    for wid in ids:          # every worker is live before the first round opens
        server.register(wid)
    barrier = None
    if sum(client.nthreads().values()) >= len(ids):     # all trainers run at once
        barrier = _StartBarrier(f"lasagne-{uuid.uuid4().hex[:8]}")
    futures = [client.submit(_worker_task, server, wid, build_model, batches, accumulate,
                             model_kwargs, compile_mode, barrier, pure=False,
                             workers=[addresses[k % len(addresses)]])
               for k, (wid, batches) in enumerate(zip(ids, worker_batches))]
    history = []
    try:
        if barrier is not None:
            _release_when_ready(distributed, client, ids, futures, barrier)
        if snapshot_interval:
            due = time.monotonic() + snapshot_interval
            while not all(f.done() for f in futures):
                try:
                    distributed.wait(futures, timeout=max(0.01, due - time.monotonic()))
                except (TimeoutError, getattr(distributed, "TimeoutError", TimeoutError)):
                    pass
                if time.monotonic() >= due:
                    version, params = server.pull()
                    history.append((time.time(), version, params))
                    due += snapshot_interval
            version, params = server.pull()
            history.append((time.time(), version, params))
        distributed.wait(futures)
        reports, errors = [], []
        for wid, f in zip(ids, futures):
            try:
                reports.append(f.result())
            except Exception as exc:
                errors.append((wid, exc))
        if errors:
            wid, error = errors[0]
            raise RuntimeError(f"worker {wid!r} failed: {type(error).__name__}: {error}") from error
        return reports, history
    finally:
        for f in futures:
            f.release()
