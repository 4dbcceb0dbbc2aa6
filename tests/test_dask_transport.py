"""The Dask backend's transport: requests to the shard handler over Dask's pooled comms.

Calls from trainers (and from the client process) reach the shards as Dask
messages to the comm handler that each shard process serves, over comms from
a Dask ``ConnectionPool`` driven by one event-loop thread per process. These
tests check what that path must keep: exactly-once pushes when a pooled comm
was closed under it (sent once more only then), ShardLostError when the shards
are gone, refusals returned as data (Dask logs no traceback), calls from a
thread that runs an event loop, cross-process all-or-nothing pushes, TLS
where the cluster uses it, and the refusal of scripts whose worker processes
could not import them. One loopback ``LocalCluster`` (2 processes) serves
the module and is closed at the end.
"""

import asyncio
import importlib.util
import logging
import os
import pickle
import ssl
import threading
import time

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


@pytest.fixture
def server(client):
    """A fresh async server on the module's cluster (one shard per process), closed after."""
    s = _server(client)
    yield s
    s.close()


def _abort_comms_from(peers, dask_worker):
    """Abort this worker's incoming Dask comms from the addresses `peers`; how many."""
    comms = [c for c in list(dask_worker._comms) if c.peer_address in peers]
    for c in comms:
        c.abort()
    return len(comms)


def _idle_comms(server):
    """This process's idle pooled comms to `server`'s shard processes."""
    from lasagne_accum.distributed.dask.transport import _comms

    return [c for _, pool in _comms.pools.values() for h in server.hosts
            for c in pool.available.get(h, ())]


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
    # the shard processes drop this process's pooled comms while they are idle
    mine = [c.local_address for c in _idle_comms(server)]
    assert len(mine) >= 2
    closed = client.run(_abort_comms_from, mine, workers=server.hosts)
    assert sum(closed.values()) >= 2
    time.sleep(0.2)
    r = server.push("a", 1, g, version=(1, 1))
    assert r["applied"] and not r["duplicate"] and r["version"] == (2, 2)
    assert not set(c.local_address for c in _idle_comms(server)) & set(mine)   # new comms
    again = server.push("a", 1, g, version=(1, 1))           # the same id: not twice
    assert again["duplicate"] and not again["applied"] and again["version"] == (2, 2)
    _, params = server.pull()
    np.testing.assert_array_equal(params["w"], -2 * np.ones(3))
    assert server.stats()["applied"] == 2


def test_calls_are_timed_only_with_the_profile_option(client, server):
    server.register("a")
    server.push("a", 0, {"w": np.ones(3), "b": np.ones(1)}, version=(0, 0), pull=True)
    assert server.options.profile is False and server.last_timing() is None
    profiled = _server(client, profile=True)
    try:
        profiled.register("a")
        profiled.push("a", 0, {"w": np.ones(3), "b": np.ones(1)}, version=(0, 0), pull=True)
        timing = profiled.last_timing()
        assert sorted(timing) == ["round", "serialise", "shard"]
        assert timing["shard"] > 0 and timing["serialise"] > 0 and timing["round"] == 0.0
    finally:
        profiled.close()


def test_a_scalar_parameter_is_pushed_and_pulled_as_a_scalar(client):
    from lasagne_accum.distributed.dask import DaskParameterServer

    server = DaskParameterServer(client, {"s": np.zeros(()), "w": np.zeros(2)}, sgd,
                                 dict(learning_rate=0.5), mode="async", compile_mode="CVM")
    try:
        version, _ = server.register("a")
        r = server.push("a", 0, {"s": np.float64(1.0), "w": np.ones(2)}, version=version,
                        pull=True)
        assert r["params"]["s"].shape == () and r["params"]["s"] == -0.5
    finally:
        server.close()


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
    copy = pickle.loads(pickle.dumps(server))     # what a task holds: it does not see close()
    server.close()                    # the actors go: their state is lost
    _wait_released(client, server)
    start = time.monotonic()
    with pytest.raises(ShardLostError, match="lost.*restart from a checkpoint"):
        copy.pull()
    assert time.monotonic() - start < 2.0 + 5.0


def test_a_closed_server_refuses_calls_at_once(client):
    from lasagne_accum.distributed.dask.transport import _comms

    server = _server(client)
    server.register("a")
    server.close()
    opened = sum(pool.open for _, pool in _comms.pools.values())
    for call in (server.pull, server.stats, server.actor_pids, lambda: server.register("b"),
                 lambda: server.push("a", 0, {"w": np.ones(3), "b": np.ones(1)},
                                     version=(0, 0))):
        with pytest.raises(ServerClosedError, match="DaskParameterServer was closed"):
            call()
    # refused before any message is sent: no comm taken from the pool, none opened
    assert sum(pool.open for _, pool in _comms.pools.values()) == opened
    assert sum(pool.active for _, pool in _comms.pools.values()) == 0


def test_shards_released_under_open_comms_raise_shard_lost(client):
    server = _server(client, wait_timeout=2.0)
    server.register("a")                          # this process's comms are open now
    assert len(_idle_comms(server)) >= 2
    for f in server._futures:                     # the actors go, the comms stay open
        f.release()
    server._futures = []
    _wait_released(client, server)
    with pytest.raises(ShardLostError, match="lost.*no shards under that key"):
        server.pull()                             # both processes answer: no such shards
    server.close()


def test_calls_from_many_threads_share_one_event_loop_thread(client, server):
    from lasagne_accum.distributed.dask import transport

    server.register("a")
    loops = set()

    def pulls():
        for _ in range(3):
            server.pull()
        loops.add(id(transport._comms.loop))

    threads = [threading.Thread(target=pulls) for _ in range(4)]
    before = threading.active_count()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(loops) == 1 and threading.active_count() <= before
    assert [t.name for t in threading.enumerate()].count("lasagne-accum-comms") == 1


def _actor_keys(dask_worker):
    return list(dask_worker.state.actors)


def _wait_released(client, server, timeout=30):
    """Until no worker holds `server`'s actors (a release reaches the workers later)."""
    end = time.monotonic() + timeout
    while any(set(server._keys) & set(a) for a in client.run(_actor_keys).values()):
        assert time.monotonic() < end, "the actors were not released"
        time.sleep(0.05)


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
            comms = _idle_comms(server)
            assert len(comms) == 2 and all(c.peer_address.startswith("tls://") for c in comms)
            assert all(isinstance(c.stream.socket, ssl.SSLSocket) for c in comms)
        finally:
            server.close()


def _environ(name):
    return os.environ.get(name)


def _profiling(dask_worker):
    return "profile" in dask_worker.periodic_callbacks


def _intervals(dask_worker=None, dask_scheduler=None):
    """``{periodic callback: milliseconds}`` of a Dask server."""
    server = dask_worker if dask_worker is not None else dask_scheduler
    return {name: pc.callback_time for name, pc in server.periodic_callbacks.items()}


def test_local_cluster_workers_keep_glibcs_allocator_default_and_do_not_profile(client):
    """Dask's MALLOC_TRIM_THRESHOLD_ would make every large array fresh pages, each time; its
    profiler would take the GIL from a trainer every 10 ms; its housekeeping, at Dask's
    defaults, runs every 20 to 500 ms in every process of the cluster."""
    from lasagne_accum.distributed.dask.cluster import KEEP_GLIBC_DEFAULT

    assert KEEP_GLIBC_DEFAULT == "MALLOC_TRIM_THRESHOLD_"
    assert set(client.run(_environ, KEEP_GLIBC_DEFAULT).values()) == {None}
    assert set(client.run(_environ, "OMP_NUM_THREADS").values()) == {"1"}   # Dask's other
    assert set(client.run(_profiling).values()) == {False}
    workers = list(client.run(_intervals).values())
    nannies = [_intervals(nanny) for nanny in client.cluster.workers.values()]
    scheduler = client.run_on_scheduler(_intervals)
    assert len(workers) == len(nannies) == 2
    for server in workers + nannies + [scheduler]:
        assert server["tick"] == 1000 and server["monitor"] == 5000
    for server in workers + nannies:
        assert server["memory_monitor"] == 500
    assert scheduler["stealing"] == 1000


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


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _watch_core_log(on, dask_worker):
    """Keep (`on`) or stop keeping the warnings and errors of Dask's ``distributed.core``
    logger (where a handler's exception is logged) in this process; those kept."""
    log = logging.getLogger("distributed.core")
    if on and not hasattr(dask_worker, "_records"):
        dask_worker._records = _Records()
        log.addHandler(dask_worker._records)
    records = getattr(dask_worker, "_records", None)
    if not on and records is not None:
        log.removeHandler(records)
        del dask_worker._records
    return [] if records is None else records.messages


def test_refusals_come_back_as_data_and_dask_logs_no_traceback(client, server):
    from distributed.core import rpc

    from lasagne_accum.distributed.dask import HANDLER, transport

    server.register("a")
    host, key = server.hosts[0], server._keys[0]
    shard = next(s for s, h in server.placement.items() if h == host)
    shapes = [server.specs[n][0] for n in server.plan[shard]]
    assert client.run(_watch_core_log, True, workers=[host]) == {host: []}

    def push(*extra):
        grads = [np.ones(s + extra) for s in shapes]
        return transport.outgoing(["push", [[[shard, ["a", 0, grads, 1.0, 0]]], False, False]])

    hostile = [  # (message, what the refusal names)
        (dict(key=key, request=["pid", []], bogus=1), "'bogus'"),
        (dict(key="not-a-key", request=["pid", []]), "no shards under that key"),
        (dict(key=key, request=["nope", []]), "unknown request method"),
        (dict(key=key, request=push(2)), "shape"),
    ]

    async def send_all():
        async with rpc(host, connection_args=client.connection_args) as remote:
            replies = [await getattr(remote, HANDLER)(**m) for m, _ in hostile]
            replies.append(await getattr(remote, HANDLER)(
                key=key, request=push(), profile=True))
        return replies

    try:
        replies = asyncio.run(send_all())
    finally:
        logged = client.run(_watch_core_log, False, workers=[host])[host]
    assert logged == []                                   # Dask logged no exception
    for (_, named), reply in zip(hostile, replies):
        assert isinstance(reply, dict) and reply["status"] == "refused"      # data, no raise
        exc, seconds = transport.decode(reply)
        assert isinstance(exc, Exception) and named in str(exc) and seconds == []
        assert exc.__traceback__ is not None           # the shard process's, for the reader
    (ok, results), seconds = transport.decode(replies[-1])
    assert ok and results[0]["applied"] and len(seconds) == 2          # the honest one
    _, params = server.pull()                                        # applied once
    for n in server.plan[shard]:
        np.testing.assert_array_equal(params[n], -np.ones(server.specs[n][0]))


class _Comm:
    def __init__(self):
        self.aborted = False

    def closed(self):
        return self.aborted

    def abort(self):
        self.aborted = True


class _Pool:
    """Dask's ConnectionPool as _send sees it: `available` comms and ``pool(address).op()``
    (a PooledRPCCall), answering from `replies` (an exception is raised)."""

    def __init__(self, idle, replies):
        self.available, self.replies, self.sent = {"h": set(idle)}, list(replies), 0

    def __call__(self, address):
        pool = self

        class Call:
            async def lasagne_accum_shards(self, **message):
                pool.sent += 1
                reply = pool.replies.pop(0)
                if isinstance(reply, BaseException):
                    raise reply
                return reply

        return Call()


@pytest.mark.parametrize("idle, replies, sent, outcome", [
    (2, ["closed", ("ok",)], 2, ("ok",)),          # an idle comm closed: once more
    (0, ["closed", ("ok",)], 1, "CommClosedError"),  # a fresh comm: the process is lost
    (1, ["closed", "closed"], 2, "CommClosedError"),  # once only
    (1, [("ok",)], 1, ("ok",)),
])
def test_a_request_is_sent_once_more_only_after_an_idle_comm_was_found_closed(
        monkeypatch, idle, replies, sent, outcome):
    from distributed.comm import CommClosedError

    from lasagne_accum.distributed.dask import transport

    comms = [_Comm() for _ in range(idle)]
    pool = _Pool(comms, [CommClosedError("peer gone") if r == "closed" else r
                         for r in replies])

    async def handler(args, address):
        return pool, pool(address).lasagne_accum_shards

    monkeypatch.setattr(transport._comms, "handler", handler)
    try:
        got = asyncio.run(transport._send({}, "h", dict(key="k", request=["pid", []])))
    except OSError as exc:                # the caller's ShardLostError
        got = type(exc).__name__
    assert got == outcome and pool.sent == sent
    if sent == 2:                           # the idle comms that were left: dropped too
        assert all(c.closed() for c in comms)


def test_a_reply_is_decoded_as_a_value_a_refusal_or_no_handler():
    from distributed.core import error_message

    from lasagne_accum.distributed.dask import transport
    from lasagne_accum.distributed.dask.actor import Gone

    assert transport.decode(((True, 3),)) == ((True, 3), [])
    assert transport.decode((7, 0.5, 0.25)) == (7, [0.5, 0.25])
    try:
        raise PushRejected("grads['w']: shape (2,), expected (3,)")
    except PushRejected as exc:
        message = error_message(exc, status="refused")
    received = {**message, "exception": message["exception"].data,    # as Dask reads it
                "traceback": message["traceback"].data}
    exc, seconds = transport.decode(received)
    assert type(exc) is PushRejected and "grads['w']" in str(exc) and seconds == []
    gone, _ = transport.decode(None)
    assert isinstance(gone, Gone)


_START_CLUSTER = ("from lasagne_accum.distributed.dask import local_cluster\n"
                  "with local_cluster(1):\n"
                  "    pass\n")


def _run_script(tmp_path, args, stdin=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)


def test_a_script_that_starts_a_cluster_at_its_top_level_is_refused_before_any_process(
        tmp_path):
    """Dask's spawned workers import the __main__ script: a top-level call would start a
    cluster in each of them. Refused with the file and line, before a process starts."""
    script = tmp_path / "train_me.py"
    script.write_text("import os\n" + _START_CLUSTER)
    done = _run_script(tmp_path, [str(script)])
    assert done.returncode != 0
    assert f"{script}, line 3: the Dask backend starts worker processes" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert "Nanny" not in done.stderr            # refused before Dask started anything


def test_a_script_read_from_standard_input_is_refused_before_any_process(tmp_path):
    """spawn re-imports __main__ from its file, which a script read from stdin lacks (Dask's
    nanny would fail after tracebacks): refused at once, with what to do instead."""
    done = _run_script(tmp_path, ["-"], stdin=_START_CLUSTER)
    assert done.returncode != 0
    assert "a script read from standard input (python -) has none" in done.stderr
    assert "Nanny" not in done.stderr


def test_unguarded_line_knows_main_guards_functions_and_classes():
    from lasagne_accum.distributed.dask.cluster import unguarded_line

    source = ("import x\n"                          # 1
              "def f():\n"                          # 2
              "    train()\n"                       # 3
              "class C:\n"                          # 4
              "    y = train()\n"                   # 5
              "if __name__ == '__main__':\n"        # 6
              "    train()\n"                       # 7
              "if '__main__' == __name__:\n"        # 8
              "    train()\n"                       # 9
              "if __name__ != '__main__':\n"        # 10
              "    train()\n"                       # 11
              "train()\n")                          # 12
    assert [unguarded_line(source, n) for n in (3, 5, 7, 9, 11, 12)] == [
        None, None, None, None, 11, 12]
    assert unguarded_line("def (:\n", 1) is None   # does not parse: no verdict
