"""The parameter server whose shards live in Dask worker processes."""

import time
import uuid

import numpy as np

from ..checks import named_params
from ..options import ServerOptions
from ..server import BaseServer
from . import transport
from .actor import ShardActor
from .cluster import require_distributed, worker_addresses
from .transport import GRACE

__all__ = ["DaskParameterServer", "place"]


def place(specs, plan, addresses):
    """``{shard name: worker address}``: each shard, largest first, to the least loaded worker.

    Loads are the shards' parameter bytes; ties go to the earlier address
    (so shards of equal size are placed round-robin).
    """
    nbytes = {s: sum(int(np.prod(specs[n][0], dtype=np.int64)) * np.dtype(specs[n][1]).itemsize
                     for n in names) for s, names in plan.items()}
    load = [0] * len(addresses)
    placement = {}
    for s in sorted(plan, key=lambda s: -nbytes[s]):
        k = min(range(len(addresses)), key=lambda i: load[i])
        placement[s] = addresses[k]
        load[k] += max(nbytes[s], 1)
    return {s: placement[s] for s in plan}


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
        Worker addresses to place shards on; default all. Give the
        addresses of processes that run no trainer to keep the shards out of
        the trainers' processes (see
        :class:`~lasagne_accum.distributed.DaskOptions`' ``shard_processes``).

    Calls reach the shards over Dask's own comms, with the cluster's security
    (:mod:`~lasagne_accum.distributed.dask.transport`). Shards are placed by
    size on the workers (``placement``: largest first, each to the least
    loaded worker); the shards of one worker live in one actor and answer one
    message per process and call. The object pickles to its actor keys and
    addresses, so tasks can take it as an argument and push directly to the
    shards. :meth:`close` releases the actors.

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

    _copy_grads = False       # a push is sent (or copied for this process's shards) at once

    def __init__(self, client, params, update_rule, rule_kwargs=None, *, shards=None,
                 workers=None, options=None, **option_kwargs):
        options = ServerOptions.of(options, **option_kwargs)
        named = named_params(params)
        arrays = {n: np.array(p.get_value() if hasattr(p, "get_value") else p, copy=True)
                  for n, p in named.items()}
        self._setup(arrays, shards, options)
        addresses = list(workers) if workers else worker_addresses(client)
        if not addresses:
            raise RuntimeError("the Dask cluster has no workers")
        self.placement = place(self.specs, self.plan, addresses)
        self.hosts = sorted(set(self.placement.values()), key=addresses.index)
        self._group_of = [self.hosts.index(self.placement[s]) for s in self.shard_names]
        self._known = [0] * len(self.shard_names)    # versions this client has seen
        self._client_args = dict(client.connection_args)
        tag = uuid.uuid4().hex[:8]
        self._keys = [f"lasagne-shards-{g}-{tag}" for g in range(len(self.hosts))]
        self._futures = []            # they hold the actors (calls go by key, not by handle)
        for address, key in zip(self.hosts, self._keys):
            specs = [(s, {n: arrays[n] for n in self.plan[s]}, update_rule, rule_kwargs)
                     for s in self.shard_names if self.placement[s] == address]
            self._futures.append(client.submit(
                ShardActor, specs, options, actor=True, workers=[address],
                allow_other_workers=False, pure=False, key=key))
        try:
            for f in self._futures:   # the actors have started
                f.result(timeout=options.wait_timeout + GRACE)
        except BaseException:
            self.close()
            raise

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_futures"] = []
        state["_client_args"] = None         # SSL contexts do not pickle; a task uses its worker's
        return state

    # ------------------------------------------------------------ routing

    def group_names(self, g):
        """The names of group `g`'s shards, for messages."""
        return ", ".join(repr(s) for s, h in self.placement.items() if h == self.hosts[g])

    def connection_args(self):
        """Dask's connection arguments here (a worker's own, or the client's)."""
        distributed = require_distributed()
        try:
            return distributed.get_worker().connection_args
        except ValueError:
            return self._client_args or {}

    def _groups(self, indices, args_list):
        groups = {}
        for pos, (i, args) in enumerate(zip(indices, args_list)):
            groups.setdefault(self._group_of[i], []).append((pos, self.shard_names[i], args))
        return groups

    def _here(self, g):
        """Group `g`'s actor object if it lives in this worker process (else None)."""
        distributed = require_distributed()
        try:
            worker = distributed.get_worker()
        except ValueError:            # not inside a Dask worker
            return None
        if worker.address != self.hosts[g]:
            return None
        return worker.state.actors.get(self._keys[g])

    def _run(self, jobs, what, extra=0.0, here=None):
        """``{g: (method, args)}``: the shards of this process directly, the others by message.

        `here` is ``{g: self._here(g)}`` where the caller has it. This thread's
        timing (:meth:`last_timing`) counts the direct calls as shard seconds.
        """
        self._check_open()
        out = {}
        if here is None:
            here = {g: self._here(g) for g in jobs}
        local_s = 0.0

        def local():
            nonlocal local_s
            start = time.perf_counter()
            for g, actor in here.items():
                if actor is not None:
                    try:
                        out[g] = actor.serve_here(*jobs[g])
                    except Exception as exc:
                        out[g] = exc
            local_s = time.perf_counter() - start

        out.update(transport.call(self, {g: job for g, job in jobs.items() if here[g] is None},
                                  what, extra, between=local))
        timing = transport.last_timing()
        if timing is not None:
            timing["shard"] = max(timing["shard"], local_s)
        return out

    def last_timing(self):
        """``{"serialise", "shard", "round"}`` seconds of this thread's last call, with the
        ``profile`` option (see :func:`~lasagne_accum.distributed.dask.transport.call`);
        else None."""
        return transport.last_timing()

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

    def _finite_checked_here(self, idx):
        if not self.options.check_finite:
            return set()
        groups = {self._group_of[i] for i in idx}
        if len(groups) > 1:      # all or nothing across processes: refused before any is sent
            return set(idx)
        return set(idx) if self._here(groups.pop()) is not None else set()

    def _push(self, indices, calls, pull, wait):
        groups = self._groups(indices, calls)
        here = {g: self._here(g) for g in groups}
        per = {}
        for g, items in groups.items():
            if here[g] is not None:              # kept by this process's shards: a copy
                per[g] = [(n, (c[0], c[1], [np.array(a) for a in c[2]], c[3], c[4]))
                          for _, n, c in items]
            else:
                per[g] = [(n, c) for _, n, c in items]
        need_check = len(groups) > 1 and self._may_diverge(indices, calls)
        if need_check:          # all or nothing across processes: check everywhere first
            outs = self._run({g: ("check", ([(n, (c[0], c[1], None, None, c[4]))
                                             for n, c in per[g]],))
                              for g in groups}, "push (check)", here=here)
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
                         extra=self.options.wait_timeout, here=here)
        failed = any(isinstance(v, Exception) or not v[0] for v in outs.values())
        if self.mode == "sync" and wait and not failed:
            start = time.perf_counter()
            for g, actor in here.items():
                if actor is not None:
                    outs[g] = actor.wait_here(per[g], outs[g], pull)
            timing = transport.last_timing()
            if timing is not None:
                timing["round"] = max(timing["round"], time.perf_counter() - start)
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
        for f in getattr(self, "_futures", []):
            f.release()
        self._futures = []
