"""The local backend: K workers as threads against one in-process server.

No extra dependency. Each worker compiles its own gradient function (in the
calling thread, one after the other, before any thread starts: a compiled
PyTensor function is never called from two threads), and each shard
serializes its own updates with a lock.

PyTensor's compiled functions hold the GIL, so threads interleave rather than
compute in parallel: two local workers train about as fast as one. Use the
local backend to develop and test, and the Dask backend (processes) for
parallel compute.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .server import ParameterServer
from .worker import Worker, raise_worker_errors, worker_lists

if TYPE_CHECKING:
    import numpy as np

__all__ = ["run_local", "snapshot"]


def snapshot(server):
    """``(wall time, version, {name: array})`` of the server now."""
    version, params = server.pull()
    return time.time(), version, params


def run_local(
    server: ParameterServer,
    build_model: Callable[..., Any],
    worker_batches: Sequence[Any],
    *,
    accumulate: int = 1,
    model_kwargs: Mapping[str, Any] | None = None,
    compile_mode: str | None = None,
    snapshot_interval: float | None = None,
    worker_ids: Sequence[str | int] | None = None,
    on_tick: Callable[[], Any] | None = None,
    tick: float = 0.1,
) -> tuple[list[dict[str, Any]], list[tuple[float, Any, dict[str, np.ndarray]]]]:
    """Run one thread per entry of `worker_batches` against `server`.

    Parameters
    ----------
    server : ParameterServer
    build_model : callable
        See :class:`~lasagne_accum.distributed.worker.Worker`.
    worker_batches : list
        One iterable of batches (tuples of input arrays) per worker.
    accumulate : int
        Batches per push.
    snapshot_interval : float, optional
        Every this many seconds, record ``(time, version, params)`` from the
        server (for loss-versus-time curves).
    worker_ids : list, optional
        Default ``worker0``, ``worker1``...
    on_tick : callable, optional
        Called every `tick` seconds while the workers run (the caller
        decides when to save).

    Returns
    -------
    (reports, history)
        The workers' reports (see :meth:`Worker.run`) and the snapshots.

    Raises
    ------
    RuntimeError
        If a worker failed (after the others finished; the failed worker
        unregistered itself, so sync rounds went on without it).
    """
    if not isinstance(server, ParameterServer):
        raise TypeError("run_local() needs a ParameterServer (the in-process server)")
    worker_batches, ids = worker_lists(worker_batches, worker_ids)
    workers = [Worker(server, wid, build_model, accumulate=accumulate,
                      model_kwargs=model_kwargs, compile_mode=compile_mode) for wid in ids]
    for wid in ids:          # every worker is live before the first round opens
        server.register(wid)
    reports: list[Any] = [None] * len(ids)
    errors = [None] * len(ids)
    barrier = threading.Barrier(len(ids))

    def start():                 # timed training starts together (after JIT warm-up)
        try:
            barrier.wait(timeout=server.options.wait_timeout)
        except threading.BrokenBarrierError:   # a worker failed before it: go on
            pass

    def target(k):
        try:
            reports[k] = workers[k].run(worker_batches[k], start=start)
        except BaseException as exc:     # reported after the others finish
            errors[k] = exc
            barrier.abort()

    threads = [threading.Thread(target=target, args=(k,), name=f"lasagne-{wid}", daemon=True)
               for k, wid in enumerate(ids)]
    history: list[Any] = []
    for t in threads:
        t.start()
    try:
        due = time.monotonic() + (snapshot_interval or 0)
        while True:
            alive = [t for t in threads if t.is_alive()]
            if not alive:
                break
            if not snapshot_interval and on_tick is None:
                alive[0].join()
                continue
            wait = tick if on_tick is not None else max(0.0, due - time.monotonic())
            if snapshot_interval:
                wait = min(wait, max(0.0, due - time.monotonic()))
            alive[0].join(timeout=wait)
            if snapshot_interval and time.monotonic() >= due:
                history.append(snapshot(server))
                due += snapshot_interval
            if on_tick is not None:
                on_tick()
    finally:
        for t in threads:
            t.join()
    if snapshot_interval:
        history.append(snapshot(server))
    raise_worker_errors(ids, errors)
    return reports, history
