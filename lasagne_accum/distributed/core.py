"""The parameter server's pieces, re-exported from the modules that hold them.

* :mod:`~lasagne_accum.distributed.checks`: input checks, :class:`ServerOptions`, exceptions;
* :mod:`~lasagne_accum.distributed.rounds`: a shard's bookkeeping (plain Python);
* :mod:`~lasagne_accum.distributed.shard`: the compiled apply function and :class:`Shard`;
* :mod:`~lasagne_accum.distributed.server`: :class:`BaseServer`, :class:`ParameterServer`;
* :mod:`~lasagne_accum.distributed.worker`: :class:`Worker`.

Modes: ``"sync"`` (a round closes when every live worker has pushed; the
shard applies the merged gradient once: the weighted mean, which is exactly
the gradient of the concatenated batches, or the sum) and ``"async"`` (each
push is applied on arrival; ``staleness = version now - version it was
computed from`` is recorded, and ``staleness_scale=True`` multiplies the
step by ``1 / max(1, staleness)``). Versions are per shard.
"""

from .checks import (  # noqa: F401
    MERGES,
    MODES,
    PushRejected,
    RoundFailedError,
    RoundTimeoutError,
    ServerOptions,
    ServerTimeoutError,
    ShardLostError,
    StalePushError,
    UnknownWorkerError,
    check_grads,
    named_params,
    param_specs,
    plan_shards,
)
from .rounds import Rounds, Seen  # noqa: F401
from .server import BaseServer, ParameterServer  # noqa: F401
from .shard import ApplyFunction, Shard, push_atomic  # noqa: F401
from .worker import Worker, model_spec  # noqa: F401

__all__ = [
    "ParameterServer",
    "BaseServer",
    "Shard",
    "Worker",
    "ServerOptions",
    "PushRejected",
    "UnknownWorkerError",
    "StalePushError",
    "RoundFailedError",
    "RoundTimeoutError",
    "ServerTimeoutError",
    "ShardLostError",
    "MODES",
    "MERGES",
    "ApplyFunction",
    "Rounds",
    "Seen",
    "push_atomic",
    "check_grads",
    "named_params",
    "param_specs",
    "plan_shards",
    "model_spec",
]
