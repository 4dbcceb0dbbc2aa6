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

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from . import errors
from .errors import *  # noqa: F403  the exceptions: errors.__all__
from .errors import ShardLostError
from ..checkpoint import save_arrays
from .options import Checkpoint, DaskOptions, ServerOptions
from .local import run_local
from .server import ParameterServer
from .shard import Shard
from .worker import Worker, model_spec

if TYPE_CHECKING:
    from .._typing import PathLike, UpdateRule

__all__ = ["train", "TrainResult", "ParameterServer", "Shard", "Worker", "run_local",
           "ServerOptions", "DaskOptions", "Checkpoint"]
__all__ += errors.__all__

BACKENDS = ("local", "dask")


@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes
    ----------
    params : dict
        ``{name: array}`` at the end.
    version : tuple
        The shards' versions (optimizer steps) at the end.
    stats : dict
        The server's counters (see ``ParameterServer.stats``).
    workers : list of dict
        Each worker's report: ``pushes``, ``batches``, ``examples``,
        ``bytes`` pushed, ``losses`` as ``(wall time, loss, examples)``,
        ``staleness`` per push, ``t_start``/``t_end`` (wall time, after
        compiling), ``compile_s``.
    history : list
        ``(wall time, version, params)`` snapshots every `snapshot_interval`.
    backend, mode : str
    server : ParameterServer or None
        The local server (to keep training or save it); None for Dask, whose
        actors are released at the end (use ``checkpoint=Checkpoint(to=...)``).
    lost_workers : list of dict
        Dask: trainers whose process died (``worker``, ``address``,
        ``reason``); training went on without them.
    checkpoints : int
        Checkpoints written during training (``Checkpoint(every=...)``).
    averaged_params, ema_params : dict
        With ``train(model_average=...)`` / ``train(ema=...)``: the averages the
        server kept, ``{name: array}`` (empty without them).
    """

    params: dict
    version: tuple
    stats: dict
    workers: list
    history: list = field(default_factory=list)
    backend: str = "local"
    mode: str = "sync"
    server: object = None
    lost_workers: list = field(default_factory=list)
    checkpoints: int = 0
    averaged_params: dict = field(default_factory=dict)
    ema_params: dict = field(default_factory=dict)

    @property
    def pushes(self) -> int:
        return sum(r["pushes"] for r in self.workers)

    @property
    def examples(self) -> int:
        return sum(r["examples"] for r in self.workers)

    @property
    def t_start(self) -> float:
        return min(r["t_start"] for r in self.workers)

    @property
    def elapsed(self) -> float:
        """Seconds from the first worker's start to the last one's end (no compiling)."""
        return max(r["t_end"] for r in self.workers) - self.t_start

    @property
    def pushes_per_second(self) -> float:
        return self.pushes / self.elapsed if self.elapsed > 0 else float("nan")

    @property
    def bytes_per_example(self) -> float:
        """Gradient bytes pushed per training example."""
        return sum(r["bytes"] for r in self.workers) / self.examples

    def losses(self) -> list[tuple[float, float, int]]:
        """All workers' ``(seconds since start, batch loss, examples)``, in time order."""
        t0 = self.t_start
        return sorted((t - t0, loss, n) for r in self.workers for t, loss, n in r["losses"])


def _initial_params(build_model, model_kwargs):
    _, _, params, _ = model_spec(build_model(**dict(model_kwargs or {})))
    out = {}
    for i, p in enumerate(params):
        if not getattr(p, "name", None):
            raise ValueError(f"build_model(): params[{i}] has no name; the server keys "
                             "parameters by name")
        out[p.name] = np.array(p.get_value(), copy=True)
    return out


#: The keywords that train() took before they were grouped, and their new spelling.
RENAMED = {
    "address": "dask=DaskOptions(address=...)",
    "client": "dask=DaskOptions(client=...)",
    "security": "dask=DaskOptions(security=...)",
    "n_dask_workers": "dask=DaskOptions(n_dask_workers=...)",
    "shard_processes": "dask=DaskOptions(shard_processes=...)",
    "resume_from": "checkpoint=Checkpoint(resume_from=...)",
    "checkpoint_to": "checkpoint=Checkpoint(to=...)",
    "checkpoint_every": "checkpoint=Checkpoint(every=...)",
}


def _refuse_renamed(function):
    """Refuse the keywords of :data:`RENAMED` with a TypeError that names the new spelling."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        old = [k for k in kwargs if k in RENAMED]
        if old:
            raise TypeError(f"{function.__name__}(): " + "; ".join(
                f"{k}= is now {RENAMED[k]}" for k in old))
        return function(*args, **kwargs)

    return wrapper


@_refuse_renamed
def train(
    build_model: Callable[..., Any],
    worker_batches: Sequence[Any] | Callable[[int], Any],
    update_rule: UpdateRule,
    rule_kwargs: Mapping[str, Any] | None = None,
    *,
    n_workers: int | None = None,
    mode: str = "sync",
    backend: str = "local",
    accumulate: int = 1,
    shards: Sequence[Sequence[str]] | Mapping[str, Sequence[str]] | None = None,
    merge: str = "mean",
    staleness_scale: bool = False,
    round_timeout: float | None = None,
    on_timeout: str = "close",
    model_kwargs: Mapping[str, Any] | None = None,
    compile_mode: str | None = None,
    snapshot_interval: float | None = None,
    server: Any = None,
    keep_log: bool = False,
    profile: bool = False,
    wait_timeout: float = 600.0,
    model_average: Mapping[str, Any] | None = None,
    ema: Mapping[str, Any] | None = None,
    checkpoint: Checkpoint | Mapping[str, Any] | None = None,
    dask: DaskOptions | Mapping[str, Any] | None = None,
) -> TrainResult:
    """Train with a parameter server and one worker per batch list; same code on both backends.

    Parameters
    ----------
    build_model : callable
        ``build_model(**model_kwargs)`` returning ``(inputs, loss, params)``
        with named shared params (optionally a 4th element: the batch weight).
        For Dask: a module-level function.
    worker_batches : list or callable
        One list of batches (tuples of input arrays) per worker, or
        ``worker_batches(k)`` giving worker k's batches (with `n_workers`;
        under Dask it is called inside the task).
    update_rule, rule_kwargs
        Any rule and its hyperparameters; ``learning_rate`` may be a
        schedule of the step (compiled into each shard's rule).
    mode : {"sync", "async"}
    backend : {"local", "dask"}
        Threads in this process, or Dask processes (see `dask`).
    accumulate : int
        Batches accumulated locally per push.
    shards, merge, staleness_scale, round_timeout, on_timeout, compile_mode,
    keep_log, profile, wait_timeout, model_average, ema
        The server's options: see :class:`ServerOptions`. With
        `model_average` / `ema`, ``TrainResult.averaged_params`` /
        ``.ema_params`` hold the averages the server kept.
    snapshot_interval : float, optional
        Record ``(time, version, params)`` every this many seconds.
    server : ParameterServer or DaskParameterServer, optional
        Keep training on an existing server (its rule and options are used).
    checkpoint : Checkpoint, optional
        Resume from a file, save to one at the end and every so often.
    dask : DaskOptions, optional
        Dask only: the cluster (an address, a client, or a loopback one
        started and closed here) and where the shards live. A script that
        starts a cluster calls ``train`` under ``if __name__ ==
        "__main__":``, or ``train`` raises a RuntimeError that says so.

    Returns
    -------
    TrainResult
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'local' or 'dask', got {backend!r}")
    if callable(worker_batches):
        if n_workers is None:
            raise ValueError("with a callable worker_batches, give n_workers")
        per = [functools.partial(worker_batches, k) for k in range(n_workers)]
    else:
        per = list(worker_batches)
        if n_workers is not None and n_workers != len(per):
            raise ValueError(f"n_workers={n_workers} but {len(per)} batch lists")
    if not per:
        raise ValueError("no workers: worker_batches is empty")
    saving, cluster = Checkpoint.of(checkpoint), DaskOptions.of(dask)
    options = ServerOptions(mode=mode, merge=merge, staleness_scale=staleness_scale,
                            round_timeout=round_timeout, on_timeout=on_timeout,
                            compile_mode=compile_mode, keep_log=keep_log, profile=profile,
                            wait_timeout=wait_timeout, model_average=model_average, ema=ema)
    run: dict[str, Any] = dict(
        accumulate=accumulate, model_kwargs=model_kwargs, compile_mode=compile_mode,
        snapshot_interval=snapshot_interval,
    )

    if backend == "local":
        if server is None:
            server = ParameterServer(_initial_params(build_model, model_kwargs), update_rule,
                                     rule_kwargs, shards=shards, options=options)
        if saving.resume_from is not None:
            server.load(saving.resume_from)
        batches = [b() if callable(b) else b for b in per]
        saver = _Saver(server, saving.to, saving.every)
        reports, history = run_local(server, build_model, batches,
                                     checkpoint=saver if saving.every else None, **run)
        return _finish(server, reports, history, "local", saving.to, keep=server,
                       saves=saver.count)

    from .dask import DaskParameterServer, connect, local_cluster, run_dask
    from .dask.cluster import worker_addresses

    with contextlib.ExitStack() as stack:
        client = cluster.client
        if client is None:
            if cluster.address is not None:
                client = stack.enter_context(connect(cluster.address, security=cluster.security))
            else:
                n = cluster.n_dask_workers or len(per) + cluster.shard_processes
                client = stack.enter_context(local_cluster(n, security=cluster.security))
                client.wait_for_workers(n, timeout=wait_timeout)
        if server is None:
            addresses = worker_addresses(client)
            server = DaskParameterServer(client, _initial_params(build_model, model_kwargs),
                                         update_rule, rule_kwargs, shards=shards,
                                         workers=addresses[:cluster.shard_processes] or None,
                                         options=options)
            stack.callback(server.close)
        if saving.resume_from is not None:
            server.load(saving.resume_from)
        saver = _Saver(server, saving.to, saving.every)
        lost: list[dict[str, Any]] = []
        try:
            reports, history = run_dask(server, client, build_model, per, lost=lost,
                                        checkpoint=saver if saving.every else None, **run)
        except Exception as exc:
            cause = exc if isinstance(exc, ShardLostError) else exc.__cause__
            if isinstance(cause, ShardLostError):
                raise saver.explain(cause) from exc
            raise
        return _finish(server, reports, history, "dask", saving.to, keep=None, lost=lost,
                       saves=saver.count)


class _Saver:
    """Save the server to `path` when `every` seconds have passed since the last save."""

    def __init__(self, server, path, every):
        self.server, self.path, self.every = server, path, every
        self.count = 0
        self.due = time.monotonic()          # the first call saves: a resume point at once

    versions = None
    saved_at = None

    def __call__(self):
        if time.monotonic() >= self.due:
            arrays = self.server.state()
            save_arrays(self.path, arrays)
            self.versions = tuple(int(arrays[f"{s}/counters"][0])
                                  for s in self.server.shard_names)
            self.saved_at = time.monotonic()
            self.count += 1
            self.due = time.monotonic() + self.every

    def explain(self, exc):
        """`exc` (a ShardLostError) with what the last checkpoint holds."""
        if self.versions is None:
            return exc
        return ShardLostError(
            f"{exc} The last checkpoint, {self.path}, holds shard versions {self.versions} "
            f"(saved {time.monotonic() - self.saved_at:.1f} s before this error): the steps "
            f"after those are lost; train(..., checkpoint=Checkpoint(resume_from="
            f"{str(self.path)!r})) goes on from there.")


def _finish(server, reports, history, backend, checkpoint_to, keep, lost=(), saves=0):
    if checkpoint_to is not None:
        server.save(checkpoint_to)
    version, params = server.pull()
    averages = server.averages()
    return TrainResult(params=params, version=version, stats=server.stats(), workers=reports,
                       history=history, backend=backend, mode=server.mode, server=keep,
                       lost_workers=list(lost), checkpoints=saves,
                       averaged_params=averages.get("model_average", {}),
                       ema_params=averages.get("ema", {}))
