"""Distributed training with a parameter server: sync and async modes, two backends.

The server owns the parameters and the update rule's state, split into
shards with one compiled apply function each (one shard per parameter by
default; the rule is called once per shard, so a split Adam keeps a step
counter per shard and stays Adam). Workers pull the parameters, compute the
gradients of their batches (optionally accumulating N of them first, which
cuts the traffic N times) and push them.

* ``mode="sync"``: a round closes when every live worker has pushed, and the
  weighted mean is applied once: the same step as single-process training
  on the concatenated batches. A worker that dies mid-round is dropped after
  ``round_timeout`` seconds (``on_timeout="close"``) or the round fails with
  :class:`RoundTimeoutError` (``"fail"``); the server keeps serving.
* ``mode="async"``: every push is applied on arrival, serialized per shard;
  its staleness is recorded and ``staleness_scale=True`` divides its step by
  it.

Backends: ``"local"`` (threads in this process, no dependency) and
``"dask"`` (shards as Dask actors in processes of their own, workers as Dask
tasks; a loopback ``LocalCluster`` of processes unless you give an address).
:func:`train` runs the same code on both.
"""

from __future__ import annotations

from . import errors
from .errors import *  # noqa: F403  the exceptions: errors.__all__
from .options import Checkpoint, DaskOptions, ServerOptions
from .local import run_local
from .server import ParameterServer
from .shard import Shard
from .training import TrainResult, train
from .worker import Worker

__all__ = ["train", "TrainResult", "ParameterServer", "Shard", "Worker", "run_local",
           "ServerOptions", "DaskOptions", "Checkpoint"]
__all__ += errors.__all__

