"""The Dask backend's transport: the shard handler over persisted comms.

Calls from trainers (and from the client process) reach the shards through
the comm handler that each shard process serves, not through Dask's actor
calls. These tests check what that path must keep: exactly-once pushes when
a persisted comm was closed under it, ShardLostError when the shards are
gone, calls from a thread that runs an event loop, and cross-process
all-or-nothing pushes. One loopback ``LocalCluster`` (2 processes) serves
the module and is closed at the end.
"""

import asyncio
import importlib.util
import time

import numpy as np
import pytest

from lasagne_accum import sgd
from lasagne_accum.distributed import PushRejected, ShardLostError, UnknownWorkerError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("distributed") is None,
                                reason="needs dask[distributed]")

P0 = {"w": np.zeros(3), "b": np.zeros(1)}        # one shard per process (round-robin)


@pytest.fixture(scope="module")
def client():
    from lasagne_accum.distributed.dask import local_cluster

    with local_cluster(2) as c:
        c.wait_for_workers(2, timeout=30)
        yield c


def _server(client, **kw):
    from lasagne_accum.distributed.dask import DaskParameterServer

    return DaskParameterServer(client, P0, sgd, dict(learning_rate=1.0), mode="async",
                               compile_mode="CVM", **kw)


@pytest.fixture
def server(client):
    """A fresh async server on the module's cluster (one shard per process), closed after."""
    s = _server(client)
    yield s
    s.close()


def _abort_comms_from(peers, dask_worker):
    """Abort this worker's incoming comms from the addresses `peers`; how many."""
    comms = [c for c in list(dask_worker._comms) if c.peer_address in peers]
    for c in comms:
        c.abort()
    return len(comms)


def _installed(dask_worker):
    from lasagne_accum.distributed.dask import HANDLER

    return HANDLER in dask_worker.handlers


def _push_then_pull(server, wid, n):
    """A Dask task: `n` pushes of ones, each with pull=True; the versions seen."""
    version, _ = server.register(wid)
    seen = []
    for seq in range(n):
        r = server.push(wid, seq, {"w": np.ones(3), "b": np.ones(1)}, version=version,
                        pull=True)
        version = r["version"]
        seen.append(version)
    return seen


def test_handler_serves_the_shards_of_every_process(client, server):
    assert len(set(server.placement.values())) == 2
    assert client.run(_installed, workers=server.hosts) == {h: True for h in server.hosts}
    seen = client.submit(_push_then_pull, server, "a", 5, pure=False).result(timeout=60)
    assert seen == [(k, k) for k in range(1, 6)]       # every push applied once, in order
    _, params = server.pull()
    np.testing.assert_array_equal(params["w"], -5 * np.ones(3))
    np.testing.assert_array_equal(params["b"], -5 * np.ones(1))
    assert sorted(server.actor_pids()) == sorted(server.hosts)


def test_push_on_a_comm_closed_under_it_is_resent_and_applied_once(client, server):
    version, _ = server.register("a")
    g = {"w": np.ones(3), "b": np.ones(1)}
    assert server.push("a", 0, g, version=version)["applied"]
    # the shard processes drop this thread's persisted comms while they are idle
    from lasagne_accum.distributed.dask import _links

    mine = [c.local_address for c in _links.comms.values()]
    closed = client.run(_abort_comms_from, mine, workers=server.hosts)
    assert sum(closed.values()) == 2
    time.sleep(0.2)
    r = server.push("a", 1, g, version=(1, 1))
    assert r["applied"] and not r["duplicate"] and r["version"] == (2, 2)
    assert not set(c.local_address for c in _links.comms.values()) & set(mine)   # new comms
    again = server.push("a", 1, g, version=(1, 1))           # the same id: not twice
    assert again["duplicate"] and not again["applied"] and again["version"] == (2, 2)
    _, params = server.pull()
    np.testing.assert_array_equal(params["w"], -2 * np.ones(3))
    assert server.stats()["applied"] == 2


def test_cross_process_push_is_all_or_nothing(client, server):
    server.register("a")
    g = {"w": np.ones(3), "b": np.ones(1)}
    server.push("a", 0, g, version=(0, 0))
    with pytest.raises(PushRejected, match="version 7"):     # only shard 'b' refuses
        server.push("a", 1, g, version=(1, 7))
    with pytest.raises(UnknownWorkerError):
        server.push("nobody", 0, g, version=(1, 1))
    stats = server.stats()
    assert stats["version"] == (1, 1) and stats["applied"] == 1 and stats["rejected"] == 2


def test_calls_from_a_thread_running_an_event_loop(client, server):
    server.register("a")

    async def inside():           # a notebook's situation: a loop runs in this thread
        r = server.push("a", 0, {"w": np.full(3, 2.0), "b": np.ones(1)}, version=(0, 0),
                        pull=True)
        return r["version"], r["params"]

    version, params = asyncio.run(inside())
    assert version == (1, 1)
    np.testing.assert_array_equal(params["w"], -2 * np.ones(3))
    np.testing.assert_array_equal(params["b"], -np.ones(1))


def test_released_shards_raise_shard_lost_within_the_timeout(client):
    server = _server(client, wait_timeout=2.0)
    server.register("a")
    server.close()                    # the actors go: their state is lost
    start = time.monotonic()
    with pytest.raises(ShardLostError, match="lost.*restart from a checkpoint"):
        for _ in range(50):           # the release reaches the workers asynchronously
            server.pull()
            time.sleep(0.1)
    assert time.monotonic() - start < 2.0 + 5.0 + 5.0


def test_shard_comms_use_the_clusters_tls():
    from lasagne_accum.distributed.dask import local_cluster

    with local_cluster(2, security=True) as tls_client:
        server = _server(tls_client)
        try:
            assert all(h.startswith("tls://127.0.0.1:") for h in server.hosts)
            seen = tls_client.submit(_push_then_pull, server, "a", 3, pure=False).result(
                timeout=60)
            assert seen == [(1, 1), (2, 2), (3, 3)]
            _, params = server.pull()                     # from the client's process
            np.testing.assert_array_equal(params["w"], -3 * np.ones(3))
        finally:
            server.close()
