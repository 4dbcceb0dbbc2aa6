"""The exceptions of the parameter server (re-exported by :mod:`lasagne_accum.distributed`)."""

__all__ = [
    "PushRejected",
    "UnknownWorkerError",
    "StalePushError",
    "RoundFailedError",
    "RoundTimeoutError",
    "NonFiniteStepError",
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
    round. A failed async step applied nothing on its shard. With
    ``check_finite`` (the default) the shards of one process compute their
    steps of a push (or of the rounds it closes) before any is taken, and
    take all or none; without it, or in other processes, shards may have
    applied what failed on another. The server keeps serving: the same
    pushes (same ``(worker, seq)``) may be sent again, and each shard
    applies a push once.
    """


class RoundTimeoutError(RoundFailedError):
    """Sync mode, ``on_timeout="fail"``: a round timed out and was discarded."""


class NonFiniteStepError(RoundFailedError):
    """A step would have written NaN or inf (``check_finite``): it was refused.

    The message names the parameter (or the rule's state) and the shard's
    step (its version: the schedule's step). Nothing of the step was
    applied on the shards that took part in it (in one process): the
    parameters keep their last finite values, ``pull()`` and ``stats()``
    answer as before the step, and the server keeps serving.
    """


class ServerTimeoutError(TimeoutError):
    """A blocking call waited longer than the server's ``wait_timeout``; the message says for what."""


class ShardLostError(RuntimeError):
    """A process holding shards did not answer: their state since the last checkpoint is lost."""


class ServerClosedError(RuntimeError):
    """A call on a server after its ``close()`` (a Dask server's shards are released then)."""
