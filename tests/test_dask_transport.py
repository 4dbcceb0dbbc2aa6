"""The Dask backend's transports: direct links, and the shard handler over Dask comms.

Calls from trainers (and from the client process) reach the shards over a
persisted link per (thread, process), not through Dask's actor calls: a
socket of the library's own (``transport="direct"``, the default) or a Dask
comm to the comm handler that each shard process serves (``"dask"``). These
tests check, for both, what that path must keep: exactly-once pushes when a
persisted link was closed under it, ShardLostError when the shards are gone,
calls from a thread that runs an event loop, cross-process all-or-nothing
pushes, and TLS where the cluster uses it; and that a direct listener admits
no link without the server's token. One loopback ``LocalCluster`` (2
processes) serves the module and is closed at the end.
"""

import asyncio
import importlib.util
import os
import pickle
import socket
import ssl
import threading
import time
import warnings

import numpy as np
import pytest

from lasagne_accum import sgd
from lasagne_accum.distributed import PushRejected, ServerClosedError, ShardLostError, \
    UnknownWorkerError

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


@pytest.fixture(params=["direct", "dask"])
def server(client, request):
    """A fresh async server on the module's cluster (one shard per process), closed after."""
    s = _server(client, transport=request.param)
    assert s.transport == request.param
    yield s
    s.close()


def _abort_comms_from(peers, dask_worker):
    """Abort this worker's incoming Dask comms from the addresses `peers`; how many."""
    comms = [c for c in list(dask_worker._comms) if c.peer_address in peers]
    for c in comms:
        c.abort()
    return len(comms)


def _abort_direct_links(dask_worker):
    """Abort every direct link this worker's listener serves; how many."""
    from lasagne_accum.distributed.dask.listener import listener_of

    return listener_of(dask_worker).abort_links()


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
    from lasagne_accum.distributed.dask.transport import _links

    mine = [c.local_address for c in _links.links.values()]
    if server.transport == "direct":
        assert all(isinstance(k, tuple) for k in _links.links)      # no Dask comm used
        closed = client.run(_abort_direct_links, workers=server.hosts)
    else:
        assert all(isinstance(k, str) for k in _links.links)
        closed = client.run(_abort_comms_from, mine, workers=server.hosts)
    assert sum(closed.values()) >= 2
    time.sleep(0.2)
    r = server.push("a", 1, g, version=(1, 1))
    assert r["applied"] and not r["duplicate"] and r["version"] == (2, 2)
    assert not set(c.local_address for c in _links.links.values()) & set(mine)   # new comms
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


@pytest.mark.parametrize("transport", ["direct", "dask"])
def test_released_shards_raise_shard_lost_within_the_timeout(client, transport):
    from lasagne_accum.distributed.dask.transport import _links

    server = _server(client, wait_timeout=2.0, transport=transport)
    server.register("a")
    copy = pickle.loads(pickle.dumps(server))     # what a task holds: it does not see close()
    server.close()                    # the actors go: their state is lost
    _wait_released(client, server)
    start = time.monotonic()
    with pytest.raises(ShardLostError, match="lost.*restart from a checkpoint"):
        copy.pull()
    assert time.monotonic() - start < 2.0 + 5.0
    if transport == "direct":         # its links were the released shards': none left open
        assert not any(k in _links.links for k in copy._link_keys())


@pytest.mark.parametrize("transport", ["direct", "dask"])
def test_a_closed_server_refuses_calls_at_once(client, transport):
    from lasagne_accum.distributed.dask.transport import _links

    server = _server(client, transport=transport)
    server.register("a")
    server.close()
    for call in (server.pull, server.stats, server.actor_pids, lambda: server.register("b"),
                 lambda: server.push("a", 0, {"w": np.ones(3), "b": np.ones(1)},
                                     version=(0, 0))):
        with pytest.raises(ServerClosedError, match="DaskParameterServer was closed"):
            call()
    # refused before any link is opened: the actors may not be released yet, and a new
    # link to a process that still holds them would stay open in this thread
    assert not any(k in _links.links for k in server._link_keys())


def test_shards_released_under_an_open_direct_link_drop_it(client):
    from lasagne_accum.distributed.dask.transport import _links

    server = _server(client, wait_timeout=2.0)
    server.register("a")                          # this thread's links are open now
    keys = server._link_keys()
    assert all(k in _links.links for k in keys)
    for f in server._futures:                     # the actors go, the links stay open
        f.release()
    server._futures = []                          # (close() would drop the links too)
    _wait_released(client, server)
    assert all(k in _links.links for k in keys)   # still open
    with pytest.raises(ShardLostError, match="lost.*restart from a checkpoint"):
        server.pull()                             # both processes answer: no such shards
    assert not any(k in _links.links for k in keys)
    server.close()


def test_direct_links_of_an_ended_thread_are_closed(client):
    from lasagne_accum.distributed.dask.transport import _links

    server = _server(client)
    sockets = []

    def call():                       # a short-lived thread: its links are its own
        server.pull()
        sockets.extend(link._sock for link in _links.links.values())

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            thread = threading.Thread(target=call)
            thread.start()
            thread.join(timeout=30)
            del thread
        assert len(sockets) == 2                          # one per shard process
        assert all(s.fileno() == -1 for s in sockets)     # closed when the thread ended
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    finally:
        server.close()


def _actor_keys(dask_worker):
    return list(dask_worker.state.actors)


def _wait_released(client, server, timeout=30):
    """Until no worker holds `server`'s actors (a release reaches the workers later)."""
    end = time.monotonic() + timeout
    while any(set(server._keys) & set(a) for a in client.run(_actor_keys).values()):
        assert time.monotonic() < end, "the actors were not released"
        time.sleep(0.05)


def _token_answer(address, token):
    """Open a plain TCP link to a direct listener, send `token` and close the sending side:
    all that comes back before the listener closes the link."""
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(token)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(64):
            answer += chunk
    return answer


def test_direct_listener_admits_only_the_servers_token(client):
    from lasagne_accum.distributed.dask.transport import _links

    server = _server(client)
    other = _server(client)          # same processes, same listeners, another token
    try:
        token, addresses = server._transport.token, server._transport.addresses
        assert server.transport == "direct" and len(addresses) == 2
        assert addresses == other._transport.addresses and token != other._transport.token
        for address in addresses:
            assert address[0] == "127.0.0.1"
            assert _token_answer(address, os.urandom(16)) == b"\x00"    # refused, closed
            assert _token_answer(address, b"x") == b""                # too short: closed
            answer = _token_answer(address, token)                    # admitted, and the
            assert answer[:1] == b"\x01" and len(answer) == 9         # largest request
            assert int.from_bytes(answer[1:], "little") >= 4 << 20
        server.register("a")
        other.register("a")
        r = server.push("a", 0, {"w": np.ones(3), "b": np.ones(1)}, version=(0, 0), pull=True)
        np.testing.assert_array_equal(r["params"]["w"], -np.ones(3))
        _, params = other.pull()                   # the other server's shards: untouched
        np.testing.assert_array_equal(params["w"], np.zeros(3))
        tokens = {k[2] for k in _links.links if isinstance(k, tuple)}
        assert {server._transport.token, other._transport.token} <= tokens
    finally:
        server.close()
        other.close()
    _wait_released(client, server)
    for address in addresses:                      # the released server's token: refused
        assert _token_answer(address, token) == b"\x00"


def test_no_direct_socket_falls_back_to_dask_comms_with_a_warning(client, monkeypatch):
    from lasagne_accum.distributed.dask import actor

    def unbindable(dask_worker):          # as a contact address that is not this machine's
        return "OSError: [Errno 99] Cannot assign requested address"

    monkeypatch.setattr(actor, "_listen", unbindable)
    with pytest.warns(RuntimeWarning, match="direct links unavailable, using Dask comms.*"
                                            "Cannot assign requested address"):
        server = _server(client)
    try:
        assert server.transport == "dask" and not hasattr(server._transport, "token")
        server.register("a")
        r = server.push("a", 0, {"w": np.ones(3), "b": np.ones(1)}, version=(0, 0), pull=True)
        np.testing.assert_array_equal(r["params"]["w"], -np.ones(3))
    finally:
        server.close()


def test_listen_reports_a_socket_it_cannot_open():
    from lasagne_accum.distributed.dask import actor

    class Worker:                          # what the listener reads of a distributed.Worker
        address = "tcp://192.0.2.1:4000"   # TEST-NET-1: never this machine's
        state = type("State", (), {"actors": {}})()
        loop = None

    assert actor._listen(Worker()).startswith("OSError")


def test_transport_is_checked(client):
    with pytest.raises(ValueError, match="transport must be 'direct' or 'dask'"):
        _server(client, transport="tcp")


@pytest.mark.parametrize("transport", ["direct", "dask"])
def test_shard_comms_use_the_clusters_tls(transport):
    from lasagne_accum.distributed.dask import local_cluster
    from lasagne_accum.distributed.dask.transport import _links

    with local_cluster(2, security=True) as tls_client:
        server = _server(tls_client, transport=transport)
        try:
            assert all(h.startswith("tls://127.0.0.1:") for h in server.hosts)
            seen = tls_client.submit(_push_then_pull, server, "a", 3, pure=False).result(
                timeout=60)
            assert seen == [(1, 1), (2, 2), (3, 3)]
            _, params = server.pull()                     # from the client's process
            np.testing.assert_array_equal(params["w"], -3 * np.ones(3))
            if transport == "direct":
                links = [_links.links[k] for k in server._link_keys()]
                assert all(isinstance(link._sock, ssl.SSLSocket) for link in links)
                # the token in plain TCP: the TLS handshake fails and the link is closed
                assert _token_answer(server._transport.addresses[0],
                                     server._transport.token) == b""
        finally:
            server.close()


def _environ(name):
    return os.environ.get(name)


def _profiling(dask_worker):
    return "profile" in dask_worker.periodic_callbacks


def test_local_cluster_workers_keep_glibcs_allocator_default_and_do_not_profile(client):
    """Dask's MALLOC_TRIM_THRESHOLD_ would make every large array fresh pages, each time; its
    profiler would take the GIL from a trainer every 10 ms."""
    from lasagne_accum.distributed.dask.cluster import KEEP_GLIBC_DEFAULT

    assert KEEP_GLIBC_DEFAULT == "MALLOC_TRIM_THRESHOLD_"
    assert set(client.run(_environ, KEEP_GLIBC_DEFAULT).values()) == {None}
    assert set(client.run(_environ, "OMP_NUM_THREADS").values()) == {"1"}   # Dask's other
    assert set(client.run(_profiling).values()) == {False}


def test_worker_addresses_do_not_come_from_the_clients_cache(client, monkeypatch):
    """The client refreshes scheduler_info() in the background without the workers: a
    refresh between the query and its return once made every trainer look lost."""
    from lasagne_accum.distributed.dask import run
    from lasagne_accum.distributed.dask.cluster import worker_addresses

    addresses = worker_addresses(client)
    assert len(addresses) == 2 and all(a.startswith("tcp://127.0.0.1:") for a in addresses)
    monkeypatch.setattr(type(client), "scheduler_info", lambda self, **kw: {"workers": {}})
    assert worker_addresses(client) == addresses

    class Pending:                                   # a trainer's future, still running
        def done(self):
            return False

    dead, lost = set(), []
    run._find_dead(client, None, ["w0", "w1"], [Pending(), Pending()], addresses, dead, lost)
    assert dead == set() and lost == []
