"""The Dask backend: server shards as Dask actors, workers as Dask tasks.

Each shard of the server is a Dask actor (``client.submit(ShardActor, ...,
actor=True)``) placed round-robin on the cluster's workers, so updates of
different shards run in different processes while each shard's updates are
serialized by its actor. Each trainer is a Dask task that compiles its own
gradient function and talks to the shard actors directly.

Without an address, :func:`local_cluster` starts a ``LocalCluster`` of
processes bound to 127.0.0.1 (scheduler, workers, nannies and the scheduler's
HTTP endpoint all on loopback, random ports, no dashboard) and closes it on
exit. With an address, the client connects to your scheduler; pass
``security=distributed.security.Security(...)`` to use TLS.

Importing this module does not import ``distributed``; the functions that
need it do.
"""

import asyncio
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
    """A :class:`~lasagne_accum.distributed.core.Shard` living in a Dask actor.

    Synchronous methods run on the worker's actor thread (one at a time);
    :meth:`wait_round` is a coroutine on the worker's event loop, so waiting
    for a sync round never blocks the pushes that close it.
    """

    def __init__(self, *args, **kwargs):
        self._shard = Shard(*args, **kwargs)

    def register(self, worker_id):
        return self._shard.register(worker_id)

    def unregister(self, worker_id):
        return self._shard.unregister(worker_id)

    def pull(self):
        return self._shard.pull()

    def push(self, worker_id, seq, grads, weight, version):
        return self._shard.push(worker_id, seq, grads, weight, version)

    def stats(self):
        return self._shard.stats()

    def state(self):
        return dict(self._shard.state())

    def load(self, arrays):
        return self._shard.load(arrays)

    async def wait_round(self, round_id, poll=0.002):
        while True:
            result = self._shard.wait_round(round_id, timeout=0, blocking=False)
            if result is not None:
                return result
            await asyncio.sleep(poll)


class DaskParameterServer(BaseServer):
    """The parameter server with its shards as Dask actors.

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
        tag = uuid.uuid4().hex[:8]
        self._futures = [
            client.submit(ShardActor, s, {n: arrays[n] for n in group}, update_rule,
                          rule_kwargs, actor=True, workers=[addresses[i % len(addresses)]],
                          allow_other_workers=False, pure=False, key=f"shard-{s}-{tag}", **opts)
            for i, (s, group) in enumerate(self.plan.items())]
        try:
            self._actors = [f.result() for f in self._futures]
        except BaseException:
            self.close()
            raise
        self.placement = dict(zip(self.shard_names,
                                  [addresses[i % len(addresses)] for i in range(len(self.plan))]))

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_futures"] = []
        return state

    def _call(self, indices, method, args_list):
        futures = [getattr(self._actors[i], method)(*args) for i, args in zip(indices, args_list)]
        results, error = [], None
        for f in futures:
            try:
                results.append(f.result())
            except Exception as exc:
                results.append(None)
                error = error or exc
        if error is not None:
            raise error
        return results

    def _wait(self, index, round_id):
        return self._actors[index].wait_round(round_id).result()

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


def _worker_task(server, worker_id, build_model, batches, accumulate, model_kwargs,
                 compile_mode):
    """Run one trainer inside a Dask worker process."""
    try:
        worker = Worker(server, worker_id, build_model, accumulate=accumulate,
                        model_kwargs=model_kwargs, compile_mode=compile_mode)
        if callable(batches):
            batches = batches()
    except BaseException:
        server.unregister(worker_id)      # let sync rounds go on without it
        raise
    return worker.run(batches)


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
    futures = [client.submit(_worker_task, server, wid, build_model, batches, accumulate,
                             model_kwargs, compile_mode, pure=False,
                             workers=[addresses[k % len(addresses)]])
               for k, (wid, batches) in enumerate(zip(ids, worker_batches))]
    history = []
    try:
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
            wid, exc = errors[0]
            raise RuntimeError(f"worker {wid!r} failed: {type(exc).__name__}: {exc}") from exc
        return reports, history
    finally:
        for f in futures:
            f.release()
