"""The exceptions of the parameter server (re-exported by :mod:`lasagne_accum.distributed`)."""

__all__ = [
    "PushRejected",
    "UnknownWorkerError",
    "StalePushError",
    "RoundFailedError",
    "RoundTimeoutError",
    "ServerTimeoutError",
    "ShardLostError",
    "ServerClosedError",
]


class PushRejected(ValueError):
    """A push (or pull) with bad input; the server's state was not changed."""


class UnknownWorkerError(PushRejected):
    """A push or pull from a worker id that is not registered (or was dropped)."""


class StalePushError(PushRejected):
    """Sync mode: a push computed from a version other than the open round's."""


class RoundFailedError(RuntimeError):
    """A sync round, or an async push's step on a shard, could not be applied.

    A failed sync round applied nothing and is raised to every pusher of the
    round. A failed async step applied nothing on its shard; the shards the
    push reached before it (or that other processes hold) may have applied
    it. The server keeps serving: the same pushes (same ``(worker, seq)``)
    may be sent again, and each shard applies a push once.
    """


class RoundTimeoutError(RoundFailedError):
    """Sync mode, ``on_timeout="fail"``: a round timed out and was discarded."""


class ServerTimeoutError(TimeoutError):
    """A blocking call waited longer than the server's ``wait_timeout``; the message says for what."""


class ShardLostError(RuntimeError):
    """A process holding shards did not answer: their state since the last checkpoint is lost."""


class ServerClosedError(RuntimeError):
    """A call on a server after its ``close()`` (a Dask server's shards are released then)."""
