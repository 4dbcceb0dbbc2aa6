"""Fault injection on the Dask backend: real processes killed by PID on a loopback cluster.

Each test starts what it needs on 127.0.0.1, kills one worker process with
SIGKILL, and checks that training neither hangs nor silently loses work:
``train()`` returns with the dead trainer reported, or raises a clear error,
within a bounded time. The cluster's processes are stopped by PID at the end.
Every test is bounded (``timeout`` on each wait, < 60 s in all).
"""

import functools
import importlib.util
import os
import signal
import threading
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from lasagne_accum import sgd
from lasagne_accum.distributed import Checkpoint, DaskOptions, ParameterServer, ShardLostError, \
    train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("distributed") is None,
                                reason="needs dask[distributed]")

N_IN, N_OUT = 3, 2


def build_model():
    """A float64 linear model, squared error (module level: picklable)."""
    W = pytensor.shared(np.zeros((N_IN, N_OUT)), name="W")
    b = pytensor.shared(np.zeros(N_OUT), name="b")
    x, y = pt.matrix("x"), pt.matrix("y")
    loss = pt.mean(pt.sum((x @ W + b - y) ** 2, axis=1))
    return [x, y], loss, [W, b]


def slow_batches(seed, n, delay):
    """`n` batches of 4, one every `delay` seconds (called inside the trainer task)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        time.sleep(delay)
        yield rng.normal(size=(4, N_IN)), rng.normal(size=(4, N_OUT))


def _alive(pid):
    """True while `pid` runs: a killed process its parent has not reaped yet (a zombie)
    is not alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:     # "pid (name) state ..."
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):              # no /proc: the signal found it
        return True


@pytest.fixture
def cluster():
    """3 worker processes on loopback: shards go on the first, trainers on the others."""
    from lasagne_accum.distributed.dask import local_cluster

    pids = set()
    with local_cluster(3) as client:
        client.wait_for_workers(3, timeout=30)
        state = dict(client=client, pids=pids)

        def worker_pids():
            found = client.run(os.getpid)
            pids.update(found.values())
            return found

        state["worker_pids"] = worker_pids
        worker_pids()
        try:
            yield state
        finally:
            worker_pids()
    for pid in pids:                  # whatever the cluster's close left behind, by PID
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def _server(client, mode, **kw):
    from lasagne_accum.distributed.dask import DaskParameterServer

    first = sorted(client.scheduler_info()["workers"])[0]
    p0 = {p.name: p.get_value() for p in build_model()[2]}
    return DaskParameterServer(client, p0, sgd, dict(learning_rate=0.01), mode=mode,
                               workers=[first], compile_mode="CVM", **kw)


def _kill_when(server, pid, versions, timeout=30):
    """Kill `pid` once the server reached `versions` steps; returns the kill's monotonic time."""
    box = {}

    def run():
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if min(server.pull()[0]) >= versions:
                    break
            except Exception:
                return
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        box["t"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_trainer_process_dies_train_returns_and_reports_it(cluster, mode):
    client = cluster["client"]
    round_timeout = 3.0 if mode == "sync" else None
    server = _server(client, mode, round_timeout=round_timeout, wait_timeout=20.0)
    try:
        trainers = [a for a in sorted(client.scheduler_info()["workers"])
                    if a not in server.hosts]
        victim = cluster["worker_pids"]()[trainers[1]]        # worker1 runs there
        n = 40
        batches = [functools.partial(slow_batches, k, n, 0.05) for k in range(2)]
        killer, box = _kill_when(server, victim, 5)
        start = time.monotonic()
        result = train(build_model, batches, None, server=server, mode=mode,
                       dask=DaskOptions(client=client),
                       backend="dask", compile_mode="CVM")
        end = time.monotonic()
        killer.join(timeout=5)
        assert "t" in box, "the trainer was not killed"
        assert not _alive(victim)
        assert end - box["t"] < (round_timeout or 0) + 20       # bounded, never a hang
        assert [r["worker"] for r in result.lost_workers] == ["worker1"]
        assert trainers[1] in result.lost_workers[0]["address"]
        survivor = result.workers[0]
        assert survivor["worker"] == "worker0" and survivor["pushes"] == n
        stats = result.stats
        if mode == "sync":        # every round after the death is the survivor's alone
            assert stats["version"][0] >= n and stats["applied"] >= n + 5
        else:
            assert stats["applied"] == stats["version"][0] >= n   # each push made, once
        assert stats["live_workers"] == []
        assert end - start < 55
    finally:
        server.close()


def test_shard_process_dies_pending_calls_fail_fast_and_checkpoint_resumes(cluster, tmp_path):
    client = cluster["client"]
    server = _server(client, "sync", round_timeout=3.0, wait_timeout=5.0)
    path = tmp_path / "ps.npz"
    shard_pid = cluster["worker_pids"]()[server.hosts[0]]
    batches = [functools.partial(slow_batches, k, 60, 0.05) for k in range(2)]
    killer, box = _kill_when(server, shard_pid, 8)
    start = time.monotonic()
    with pytest.raises((ShardLostError, RuntimeError), match="shard.*lost") as info:
        train(build_model, batches, None, server=server, dask=DaskOptions(client=client),
              mode="sync", backend="dask", compile_mode="CVM",
              checkpoint=Checkpoint(to=path, every=0.2))
    end = time.monotonic()
    killer.join(timeout=5)
    server.close()
    assert "t" in box and not _alive(shard_pid)
    assert end - box["t"] < 5.0 + 5.0 + 10          # wait_timeout + grace + slack: no hang
    assert isinstance(info.value, ShardLostError)
    message = str(info.value)
    assert "restart from a checkpoint" in message and "Checkpoint(resume_from=" in message
    # the last periodic checkpoint (the first is written as training starts) resumes in a
    # fresh server; the steps lost are those after its version
    fresh = ParameterServer({p.name: p.get_value() for p in build_model()[2]}, sgd,
                            dict(learning_rate=0.01), mode="sync")
    fresh.load(path)
    saved = fresh.pull()[0]
    assert saved[0] == saved[1] and 0 <= saved[0] <= 60
    assert f"holds shard versions {saved}" in message        # the steps after it were lost
    assert end - start < 55
