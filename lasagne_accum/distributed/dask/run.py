"""Training on a Dask cluster: one task per trainer, watched until every one has finished."""

import time
import uuid

from ..worker import Worker, raise_worker_errors, worker_lists
from .cluster import require_distributed, worker_addresses

__all__ = ["run_dask"]


class _StartBarrier:
    """Called by each trainer task after its warm-up: report ready, wait for the go."""

    def __init__(self, tag, timeout=300):
        self.tag, self.timeout = tag, timeout

    def ready_event(self, worker_id):
        return f"{self.tag}-ready-{worker_id}"

    def __call__(self, worker_id):
        distributed = require_distributed()
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


def _trainer_addresses(client, server, n):
    """Where trainers run: workers without shards when there are enough of them, else all."""
    addresses = worker_addresses(client)
    free = [a for a in addresses if a not in set(getattr(server, "hosts", ()))]
    return free if len(free) >= n else addresses


def run_dask(server, client, build_model, worker_batches, *, accumulate=1, model_kwargs=None,
             compile_mode=None, snapshot_interval=None, worker_ids=None, on_tick=None,
             lost=None, tick=0.5):
    """Run one Dask task per entry of `worker_batches` against `server`.

    Same arguments and result as :func:`lasagne_accum.distributed.local.run_local`;
    an entry of `worker_batches` may also be a callable returning the batches
    (called inside the task, so the data need not travel).

    A trainer whose process dies is reported in `lost` (a list this
    function appends ``{"worker", "address", "reason"}`` to) and unregistered,
    so sync rounds go on without it; the others finish (the processes are
    checked every `tick` seconds). `on_tick`, a callable, is called about
    every 0.1 s while training runs (the caller decides when to save).
    """
    distributed = require_distributed()
    worker_batches, ids = worker_lists(worker_batches, worker_ids)
    addresses = _trainer_addresses(client, server, len(ids))
    for wid in ids:          # every worker is live before the first round opens
        server.register(wid)
    barrier = None
    if sum(client.nthreads()[a] for a in addresses) >= len(ids):   # all trainers at once
        barrier = _StartBarrier(f"lasagne-{uuid.uuid4().hex[:8]}",
                                timeout=server.options.wait_timeout)
    pinned = [addresses[k % len(addresses)] for k in range(len(ids))]
    futures = [client.submit(_worker_task, server, wid, build_model, batches, accumulate,
                             model_kwargs, compile_mode, barrier, pure=False,
                             workers=[address], allow_other_workers=False)
               for wid, batches, address in zip(ids, worker_batches, pinned)]
    history = []
    lost = [] if lost is None else lost
    dead = set()
    try:
        if barrier is not None:
            _release_when_ready(distributed, client, ids, futures, barrier, pinned, dead)
        due = time.monotonic() + (snapshot_interval or 0)
        look = time.monotonic() + tick
        while True:
            pending = [f for k, f in enumerate(futures) if not f.done() and k not in dead]
            if not pending:
                break
            wait = max(0.01, look - time.monotonic())
            if on_tick is not None:
                wait = min(wait, 0.1)
            if snapshot_interval:
                wait = min(wait, max(0.01, due - time.monotonic()))
            try:
                distributed.wait(pending, timeout=wait, return_when="FIRST_COMPLETED")
            except (TimeoutError, getattr(distributed, "TimeoutError", TimeoutError)):
                pass
            if time.monotonic() >= look:      # one scheduler query per tick, not per wake-up
                _find_dead(client, server, ids, futures, pinned, dead, lost)
                look = time.monotonic() + tick
            if snapshot_interval and time.monotonic() >= due:
                history.append((time.time(),) + server.pull())
                due += snapshot_interval
            if on_tick is not None:
                on_tick()
        if snapshot_interval:
            history.append((time.time(),) + server.pull())
        reports, errors = [], []
        for k, (wid, f) in enumerate(zip(ids, futures)):
            if k in dead:
                errors.append(None)
                continue
            try:
                reports.append(f.result(timeout=server.options.wait_timeout))
                errors.append(None)
            except Exception as exc:
                errors.append(exc)
        raise_worker_errors(ids, errors)
        return reports, history
    finally:
        for f in futures:
            f.release()


def _find_dead(client, server, ids, futures, pinned, dead, lost):
    """Mark trainers whose worker process is gone; unregister them (sync rounds go on)."""
    alive = set(worker_addresses(client))
    for k, (wid, f, address) in enumerate(zip(ids, futures, pinned)):
        if k in dead or f.done() or address in alive:
            continue
        dead.add(k)
        f.cancel()
        lost.append(dict(worker=wid, address=address,
                         reason=f"the process of worker {address} is gone"))
        try:
            server.unregister(wid)
        except Exception:      # its shards may be gone too: the survivors' pushes say so
            pass


def _release_when_ready(distributed, client, ids, futures, barrier, pinned, dead):
    """Set the start event once every trainer has reported ready (or failed, or died)."""
    waiting = dict(zip(ids, futures))
    index = {wid: k for k, wid in enumerate(ids)}
    end = time.monotonic() + barrier.timeout
    while waiting and time.monotonic() < end:
        alive = set(worker_addresses(client))
        for wid, f in list(waiting.items()):
            if f.status in ("error", "cancelled", "finished") or \
                    pinned[index[wid]] not in alive or \
                    distributed.Event(barrier.ready_event(wid), client=client).wait(0.05):
                del waiting[wid]
    distributed.Event(f"{barrier.tag}-go", client=client).set()
