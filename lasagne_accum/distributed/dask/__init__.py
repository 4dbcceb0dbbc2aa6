"""The Dask backend: server shards held by Dask actors, trainers as Dask tasks.

The package, by job:

* :mod:`~lasagne_accum.distributed.dask.actor`: the shard process's side, the
  shards of one worker as one Dask actor (:class:`ShardActor`), the comm
  handler and how a request is served;
* :mod:`~lasagne_accum.distributed.dask.schema`: what a request may hold,
  checked before any of it is used;
* :mod:`~lasagne_accum.distributed.dask.transport`: the caller's side,
  requests over Dask's pooled comms from one event-loop thread per process;
* :mod:`~lasagne_accum.distributed.dask.server`: :class:`DaskParameterServer`;
* :mod:`~lasagne_accum.distributed.dask.cluster`: :func:`local_cluster`,
  :func:`connect`;
* :mod:`~lasagne_accum.distributed.dask.run`: :func:`run_dask`, the driver.

The server's shards are placed on the workers it is given by size; the
shards of one worker live in one Dask actor (``client.submit(ShardActor,
..., actor=True)``), which places them, keeps them alive and releases them.
Updates of shards in different processes run in parallel; each shard's
updates are serialized by its lock. Where the shards live is a choice:
:func:`~lasagne_accum.distributed.train` puts them in processes of their own
(``DaskOptions(shard_processes=1)``), beside none of the trainers, because a
process's event loop cannot answer while a trainer's compiled PyTensor call
holds that process's GIL; ``shard_processes=0`` puts them beside the trainers.

Calls do not go through the actor machinery: a request is one Dask message to
the comm handler ``"lasagne_accum_shards"`` that each shard process installs
on its ``distributed.Worker``, over a pooled Dask comm (Dask's addresses, its
TLS, no port of ours), with numpy arrays as Dask's out-of-band frames. The
shard process checks what Dask decoded (names, numbers and numeric arrays of
the shards' shapes, nothing else) before using any of it. A push to shards in
several processes goes to all of them at once; the shards of the caller's own
process are called directly, without a message. It is checked on all of them
before it is applied anywhere (one extra message), unless every shard must
take the same decision on it: versions this client has already seen from
every shard, and in sync mode no ``round_timeout``. Waiting for a sync round
is event-driven: the shard wakes the waiting coroutine (remote callers) or
thread (callers in its own process) when the round ends. Every call is
bounded by the server's ``wait_timeout``: a lost process becomes
:class:`~lasagne_accum.distributed.ShardLostError`.

Without an address, :func:`local_cluster` starts a ``LocalCluster`` of
processes bound to 127.0.0.1 (scheduler, workers, nannies and the
scheduler's HTTP endpoint all on loopback, random ports, no dashboard) and
closes it on exit; called from a script's top level without ``if __name__ ==
"__main__":`` it raises at once, saying to add the guard. With an address,
the client connects to your scheduler; pass
``security=distributed.security.Security(...)`` to use TLS (the shard comms
use the same security).

Importing this package does not import ``distributed``; the functions that
need it do.
"""

from .actor import HANDLER, ShardActor  # noqa: F401  (internal: importable from here too)
from .cluster import connect, local_cluster
from .run import run_dask
from .server import DaskParameterServer

__all__ = ["DaskParameterServer", "local_cluster", "connect", "run_dask"]
