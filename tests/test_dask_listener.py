"""Bad input and hostile links against the shard processes' direct listener and comm handler.

Each test sends one of the cases a loopback fuzzing of the listener found (as
an attacker, or a caller out of step, would send it) and checks what must
hold afterwards: the shard process is alive, the server's own callers keep
being answered (worst latency under 100 ms), the process's memory stays within
the frame cap times the links, and the listener counted what it closed. The
clusters bind 127.0.0.1 only and are closed by the fixtures that started them.
Timeouts the tests wait for are shortened in the shard processes (and put
back) through ``client.run``.
"""

import asyncio
import importlib.util
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from lasagne_accum import sgd

pytestmark = pytest.mark.skipif(importlib.util.find_spec("distributed") is None,
                                reason="needs dask[distributed]")

N = 250_000                          # float64 parameter: 2 MB, so frames are sizeable
P0 = {"w": np.zeros(N), "b": np.zeros(3)}
MARGIN = 4 << 20                     # actor.FRAME_MARGIN


@pytest.fixture(scope="module")
def client():
    from lasagne_accum.distributed.dask import local_cluster

    with local_cluster(1) as c:
        c.wait_for_workers(1, timeout=30)
        yield c


def _server(client, **kw):
    from lasagne_accum.distributed.dask import DaskParameterServer

    return DaskParameterServer(client, P0, sgd, dict(learning_rate=1.0), mode="async",
                               compile_mode="CVM", shards=[["w", "b"]], **kw)


@pytest.fixture
def server(client):
    s = _server(client)
    assert s.transport == "direct"
    yield s
    s.close()


# ------------------------------------------------------------------ run in the shard process


def _counts(dask_worker):
    from lasagne_accum.distributed.dask.listener import listener_of

    listener = listener_of(dask_worker)
    return dict(listener.counts, pending=len(listener.pending), links=len(listener.links))


def _rss(dask_worker):
    import psutil

    return psutil.Process().memory_info().rss


def _set_limits(dask_worker, **limits):
    """Set the listener's module limits here; returns the old values."""
    from lasagne_accum.distributed.dask import listener

    old = {k: getattr(listener, k) for k in limits}
    for k, v in limits.items():
        setattr(listener, k, v)
    return old


def _socket_options(dask_worker):
    """``[(keepalive, idle, interval, probes, user timeout ms)]`` of the admitted links."""
    from lasagne_accum.distributed.dask.listener import listener_of

    out = []
    for link in listener_of(dask_worker).links:
        sock = link.transport.get_extra_info("socket")
        out.append(tuple(sock.getsockopt(level, name) for level, name in (
            (socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            (socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))))
    return out


class _Limits:
    """Shorter listener timeouts in the shard processes for one test; put back after."""

    def __init__(self, client, **limits):
        self.client, self.limits = client, limits

    def __enter__(self):
        self.old = next(iter(self.client.run(_set_limits, **self.limits).values()))

    def __exit__(self, *exc):
        self.client.run(_set_limits, **self.old)


def _admitted(address, token):
    """A raw link that showed `token`: ``(socket, the largest request it may send)``."""
    sock = socket.create_connection(address, timeout=10)
    sock.sendall(token)
    answer = b""
    while len(answer) < 9:
        chunk = sock.recv(9 - len(answer))
        assert chunk, f"the listener closed the link after {answer!r}"
        answer += chunk
    assert answer[:1] == b"\x01"
    return sock, int.from_bytes(answer[1:], "little")


def _frame(body):
    return len(body).to_bytes(8, "little") + body


def _request(obj):
    from lasagne_accum.distributed.dask import wire

    return wire.join(wire.encode_request(obj))


def _json_body(head_text):
    """A request body whose JSON head is `head_text` (bytes) and that has no arrays."""
    head = b"[]\n" + head_text
    return struct.pack("<IQ", 0, len(head)) + head


def _reply(sock):
    from lasagne_accum.distributed.dask import wire

    n = int.from_bytes(_recv(sock, 8), "little")
    return wire.decode_reply(bytearray(_recv(sock, n)))


def _recv(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _closed(sock, timeout=10):
    """Wait until the other side closed `sock`; True if it did within `timeout` s."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionError:
        return True
    except socket.timeout:
        return False


class _Latency:
    """The server's own calls from a thread, timed, while an attack runs."""

    def __init__(self, server):
        self.server, self.times, self.errors = server, [], []
        self._stop, self._ready = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        self.server.stats()                   # this thread's link is open before the attack
        self._ready.set()
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                self.server.stats()
            except Exception as exc:          # noted, and the test fails on it
                self.errors.append(exc)
            self.times.append(time.perf_counter() - start)
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=30)

    @property
    def worst(self):
        return max(self.times)


def _accepted(client, before, n, timeout=20):
    """The listener's counts once it has accepted `n` links since `before` (counts)."""
    end = time.monotonic() + timeout
    while True:
        now = next(iter(client.run(_counts).values()))
        new = now["pending"] - before["pending"] + now["refused_pending"] \
            - before["refused_pending"] + now["handshake_timeout"] - before["handshake_timeout"]
        if new >= n or time.monotonic() > end:
            return now
        time.sleep(0.05)


def _alive(client, server):
    pids = server.actor_pids()
    return all(isinstance(p, int) and p > 0 for p in pids.values()) and \
        set(client.run(os.getpid).values()) >= set(pids.values())


def _idle_connects(client, server):
    """40 more idle connects (no token) than the listener keeps pending, held past a
    4 s handshake timeout: ``(before, during, after)`` counts, the growth of the shard
    process's memory, and the other callers' latencies meanwhile."""
    from lasagne_accum.distributed.dask import listener

    address = server._transport.addresses[0]
    before = next(iter(client.run(_counts).values()))
    rss = next(iter(client.run(_rss).values()))
    idle = []
    with _Limits(client, HANDSHAKE_TIMEOUT=4.0), _Latency(server) as latency:
        for _ in range(listener.MAX_PENDING + 40):
            idle.append(socket.create_connection(address, timeout=10))
        during = _accepted(client, before, listener.MAX_PENDING + 40)
        grown = next(iter(client.run(_rss).values())) - rss
        time.sleep(4.5)                                     # past the handshake timeout
        after = next(iter(client.run(_counts).values()))
    for sock in idle:
        sock.close()
    return before, during, after, grown, latency


# ------------------------------------------------------------------ the cases


def test_links_not_yet_admitted_are_capped_and_time_out(client, server):
    from lasagne_accum.distributed.dask import listener

    before, during, after, grown, latency = _idle_connects(client, server)
    assert during["pending"] == listener.MAX_PENDING
    assert during["refused_pending"] - before["refused_pending"] == 40
    assert after["pending"] == 0
    assert after["handshake_timeout"] - before["handshake_timeout"] == listener.MAX_PENDING
    assert grown < 16 << 20
    assert not latency.errors and latency.worst < 0.1
    assert _alive(client, server)
    server.register("a")                                   # the server still serves
    assert server.push("a", 0, {"w": np.ones(N), "b": np.ones(3)}, version=(0,))["applied"]


def test_oversized_and_stalled_frames_close_the_link_and_memory_stays_bounded(client, server):
    address, token = server._transport.addresses[0], server._transport.token
    before = next(iter(client.run(_counts).values()))
    rss = next(iter(client.run(_rss).values()))
    with _Limits(client, FRAME_TIMEOUT=1.5), _Latency(server) as latency:
        huge, cap = _admitted(address, token)
        assert cap == 8 * (N + 3) + MARGIN                  # the state, plus the margin
        huge.sendall((1 << 60).to_bytes(8, "little"))
        assert _closed(huge, timeout=5)                     # closed at once, nothing read
        over, _ = _admitted(address, token)
        over.sendall((cap + 1).to_bytes(8, "little"))
        assert _closed(over, timeout=5)
        stalled = []
        for _ in range(4):                                  # announced in full, half sent
            sock, _ = _admitted(address, token)
            sock.sendall(cap.to_bytes(8, "little") + bytes(cap // 2))
            stalled.append(sock)
        time.sleep(0.5)
        grown = next(iter(client.run(_rss).values())) - rss
        assert all(_closed(s, timeout=10) for s in stalled)  # after the frame timeout
        after = next(iter(client.run(_counts).values()))
    assert after["frame_too_large"] - before["frame_too_large"] == 2
    assert after["frame_timeout"] - before["frame_timeout"] == 4
    assert grown < 4 * cap + (32 << 20)                     # one frame per link at most
    assert not latency.errors and latency.worst < 0.1
    assert _alive(client, server)


def test_listener_side_links_have_keepalive_and_a_user_timeout(client, server):
    from lasagne_accum.distributed.dask import listener

    server.pull()                                            # this thread's link
    options = next(iter(client.run(_socket_options).values()))
    assert options and all(o == (1, listener.KEEPALIVE_IDLE, listener.KEEPALIVE_INTERVAL,
                                 listener.KEEPALIVE_PROBES, listener.USER_TIMEOUT * 1000)
                           for o in options)
    assert listener.KEEPALIVE_IDLE + listener.KEEPALIVE_INTERVAL * listener.KEEPALIVE_PROBES \
        <= listener.USER_TIMEOUT


def _nested_pickle(depth):
    """The fuzzer's data-only pickle, ``("call", ("pull", [(name, ())]))`` with the shard
    name nested `depth` deep in 1-tuples (written opcode by opcode: pickling it would
    recurse). The request format of this library is not a pickle any more."""
    return (b"\x80\x05\x8c\x04call\x8c\x04pull]\x8c\x01w" + b"\x85" * depth
            + b")\x86a\x86\x86.")


def _with_arrays(head, arrays):
    """A request body with a hand-written JSON head and these raw buffers."""
    from lasagne_accum.distributed.dask import wire

    return wire.join(wire._body(head, [memoryview(a).cast("B") for a in arrays]))


BAD_REQUESTS = {
    "a pickle with a name nested 10**6 deep": _nested_pickle(10 ** 6),
    "a JSON name nested 10**5 deep": _json_body(
        b'["call",["pull",[[' + b"[" * 10 ** 5 + b'"w"' + b"]" * 10 ** 5 + b",[]]]]]"),
    "a JSON name nested 10**6 deep (longer than a head may be)": _json_body(
        b'["call",["pull",[[' + b"[" * 10 ** 6 + b'"w"' + b"]" * 10 ** 6 + b",[]]]]]"),
    "an unknown method": _request(["eval", ["pull"]]),
    "an unknown shard method": _request(["call", ["__init__", [["shard0", []]]]]),
    "a shard name that is not a str": _request(["call", ["pull", [[7, []]]]]),
    "an unknown shard": _request(["call", ["pull", [["nope", []]]]]),
    "one shard twice in a push": _request(
        ["push", [[["shard0", ["a", 0, [np.ones(N), np.ones(3)], 1.0, 0]],
                   ["shard0", ["a", 0, [np.ones(N), np.ones(3)], 1.0, 0]]], False, True]]),
    "a gradient of the wrong shape": _request(
        ["push", [[["shard0", ["a", 0, [np.ones(N + 1), np.ones(3)], 1.0, 0]]], False, True]]),
    "a worker id that is a list": _request(["call", ["register", [["shard0", [["a"]]]]]]),
    "an array of objects": _with_arrays(b'[["|O8",[1]]]\n["pid",[{"__ndarray__":0}]]',
                                        [np.zeros(1, np.int64)]),
}


@pytest.mark.parametrize("transport", ["direct", "dask"])
def test_malformed_requests_are_errors_and_the_shards_live_on(client, transport):
    from lasagne_accum.distributed.dask.actor import HANDLER
    from lasagne_accum.distributed.dask.wire import BadRequest

    server = _server(client, transport=transport)
    try:
        server.register("a")
        replies = {}
        if transport == "direct":
            sock, cap = _admitted(server._transport.addresses[0], server._transport.token)
            for what, body in BAD_REQUESTS.items():
                assert len(body) <= cap, what
                sock.sendall(_frame(body))
                replies[what] = _reply(sock)       # the same link: still usable
            sock.close()
        else:
            from distributed.comm import connect

            async def send_all():
                comm = await connect(server.hosts[0])
                out = {}
                for what, body in BAD_REQUESTS.items():
                    await comm.write({"op": HANDLER, "key": server._keys[0], "payload": body})
                    out[what] = await comm.read()
                # a key that is not a str: no shards under it
                await comm.write({"op": HANDLER, "key": [[server._keys[0]]], "payload": b""})
                out["a key that is not a str"] = await comm.read()
                comm.abort()
                return out

            from lasagne_accum.distributed.dask import wire

            raw = asyncio.run(send_all())
            replies = {k: wire.decode_reply(bytearray(v)) for k, v in raw.items()}
        for what, (ok, value, _, _) in replies.items():
            assert not ok, what
            expected = (BadRequest,) if what != "a key that is not a str" else (Exception,)
            assert isinstance(value, expected), (what, value)
        assert "nested" not in str(replies["an unknown shard"][1])
        assert "no shard 'nope'" in str(replies["an unknown shard"][1])
        assert "twice" in str(replies["one shard twice in a push"][1])
        assert "must be a float64[250000] array" in str(
            replies["a gradient of the wrong shape"][1])
        # nothing was applied, the process is alive and serves
        assert server.stats()["applied"] == 0 and server.pull()[0] == (0,)
        assert _alive(client, server)
        assert server.push("a", 0, {"w": np.ones(N), "b": np.ones(3)}, version=(0,))["applied"]
    finally:
        server.close()


def test_one_links_pipelined_requests_do_not_starve_the_others(client, server):
    address, token = server._transport.addresses[0], server._transport.token
    flood = 300
    sock, _ = _admitted(address, token)
    pull = _frame(_request(["call", ["pull", [["shard0", []]]]]))
    got = []

    def read_all():
        for _ in range(flood):
            got.append(_reply(sock)[0])

    reader = threading.Thread(target=read_all, daemon=True)
    with _Latency(server) as latency:
        time.sleep(0.05)
        start = time.perf_counter()
        sock.sendall(pull * flood)                 # 300 pulls of 2 MB, written at once
        reader.start()
        reader.join(timeout=60)
        flooded = time.perf_counter() - start
    sock.close()
    assert got == [True] * flood
    assert flooded > 0.1                           # the flood took a while to serve
    assert not latency.errors and latency.worst < 0.1
    assert sum(t > 0 for t in latency.times) > 5


def test_tls_listener_caps_pending_handshakes():
    """The fuzzer's first case: plain TCP connects, idle, to a TLS cluster's listener."""
    from lasagne_accum.distributed.dask import listener, local_cluster

    with local_cluster(1, security=True) as tls:
        server = _server(tls)
        try:
            assert tls.scheduler_info()["address"].startswith("tls://127.0.0.1:")
            before, during, after, grown, latency = _idle_connects(tls, server)
            assert during["pending"] == listener.MAX_PENDING
            assert during["refused_pending"] == 40
            assert after["pending"] == 0 and after["handshake_timeout"] == listener.MAX_PENDING
            assert grown < 64 << 20              # at most MAX_PENDING handshakes' buffers
            assert not latency.errors and latency.worst < 0.1
            assert _alive(tls, server)
        finally:
            server.close()


# ------------------------------------------------------------------ the main guard


def test_unguarded_line_finds_calls_outside_the_main_guard():
    from lasagne_accum.distributed.dask.cluster import unguarded_line

    source = textwrap.dedent("""\
        import x
        train()
        def main():
            train()
        if __name__ == "__main__":
            train()
            main()
        if "__main__" == __name__: train()
        else:
            train()
        """)
    assert [n for n in range(1, 11) if unguarded_line(source, n)] == [1, 2, 5, 9, 10]
    assert unguarded_line("def (", 1) is None


def test_a_script_without_the_main_guard_gets_one_clear_error(tmp_path):
    script = tmp_path / "train_digits.py"
    script.write_text(textwrap.dedent("""\
        import numpy as np
        from lasagne_accum import sgd
        from lasagne_accum.distributed import train

        def build_model():
            import pytensor, pytensor.tensor as pt
            w = pytensor.shared(np.zeros(2), name="w")
            x = pt.matrix("x")
            return [x], (x @ w).sum(), [w]

        train(build_model, [[(np.ones((2, 2)),)]], sgd, dict(learning_rate=0.1),
              backend="dask")
        """))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 1
    assert f"{script}, line 11" in proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr
    assert "Nanny" not in proc.stderr and len(proc.stderr.splitlines()) < 40
