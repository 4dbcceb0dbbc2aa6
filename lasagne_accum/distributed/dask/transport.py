"""The caller's side: how requests reach the shard processes, behind one small interface.

Calls do not go through Dask's actor machinery (two thread hops on each side
and Dask's per-array serialization). A request and its reply are one body
each (:mod:`~lasagne_accum.distributed.dask.wire`), sent over one persisted
link per (calling thread, shard process), in the caller's own thread.

A :class:`Transport` carries them. A subclass says how a link is opened,
written, read and found closed (:class:`DirectTransport`: a blocking socket
to the process's :mod:`~lasagne_accum.distributed.dask.listener`;
:class:`CommTransport`: a Dask comm to its comm handler). :class:`Transport`
does the rest once, for every transport:

* :meth:`~Transport.send` writes a request on this thread's link, opening
  one if needed; a persisted link found closed while idle is replaced once.
* :meth:`~Transport.receive` reads the reply; a reused link closed before the
  reply came sends the request once more on a new link (a push repeated with
  the same ``(worker, seq)`` is not applied twice).
* :meth:`~Transport.call` sends requests to several processes, runs the
  caller's own work meanwhile, then reads the replies, all within the
  server's ``wait_timeout``; a process that does not answer, or holds no
  shards under that key any more, becomes
  :class:`~lasagne_accum.distributed.checks.ShardLostError`.
"""

import asyncio
import concurrent.futures
import select
import socket
import ssl
import threading
import time

import numpy as np

from ..checks import ShardLostError
from . import wire
from .actor import HANDLER, Gone
from .cluster import require_distributed
from .listener import TOKEN_BYTES, set_socket_options

GRACE = 5.0           # seconds added to wait_timeout for the message itself
RECONNECT = 2.0       # seconds to reconnect a persisted link that was found closed
_IOV_MAX = 512        # buffers per sendmsg call


class Refused(Exception):
    """The listener did not know the token: its shards were released (or it is not ours)."""


class _Links(threading.local):
    """This thread's persisted links, ``{key: link}``, its private event loop (Dask comms)
    and the timing of its last call."""

    loop = None
    timing = None

    def __init__(self):
        self.links = {}

    def event_loop(self):
        if self.loop is None or self.loop.is_closed():
            self.loop = asyncio.new_event_loop()
            self.drop([k for k, v in self.links.items() if isinstance(v, _Comm)])
        return self.loop

    def drop(self, keys=None):
        """Close this thread's links (those under `keys`, default all)."""
        for key in list(self.links if keys is None else keys):
            link = self.links.pop(key, None)
            if link is not None:
                link.abort()


_links = _Links()
_helper = None


def helper_thread():
    """One thread for calls from a thread that already runs an event loop (a notebook)."""
    global _helper
    if _helper is None:
        _helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lasagne-dask")
    return _helper


class Transport:
    """How a server's requests reach its shard processes (see the module's notes).

    Subclasses implement :meth:`key`, :meth:`open`, :meth:`write`,
    :meth:`read` and :meth:`idle_closed`, and list in ``closed_errors`` the
    errors that mean a link was closed under its caller.

    Parameters
    ----------
    server : DaskParameterServer
        Gives ``hosts`` (each group's Dask address), ``options`` and the
        names of each group's shards, for the errors.
    """

    name: str = ""
    closed_errors: tuple = (EOFError, ConnectionError)
    needs_event_loop = False

    def __init__(self, server):
        self.server = server

    # ------------------------------------------------------------ the subclass's part

    def key(self, g):
        """The key of this thread's link to group `g`'s process."""
        raise NotImplementedError

    def open(self, g, timeout):
        """A new link to group `g`'s process."""
        raise NotImplementedError

    def write(self, link, g, body, timeout):
        """Send one request body (a list of buffers) to group `g`."""
        raise NotImplementedError

    def read(self, link, timeout):
        """One reply body (bytes-like)."""
        raise NotImplementedError

    def idle_closed(self, link):
        """Was an idle link closed (here, or by the other side)?"""
        raise NotImplementedError

    # ------------------------------------------------------------ written once

    def keys(self):
        return [self.key(g) for g in range(len(self.server.hosts))]

    def send(self, g, body, timeout):
        """Write one request on this thread's link to group `g`; ``(link, reused)``."""
        key = self.key(g)
        link = _links.links.get(key)
        reused = link is not None and not self.idle_closed(link)
        if not reused:
            _links.drop([key])
            link = _links.links[key] = self.open(g, timeout)
        try:
            self.write(link, g, body, timeout)
        except self.closed_errors:
            _links.drop([key])
            if reused:                 # closed while idle: once more on a new link
                return self.send(g, body, min(timeout, RECONNECT))
            raise
        except BaseException:          # a timeout or an interrupt: the link is out of step
            _links.drop([key])
            raise
        return link, reused

    def receive(self, g, body, sent, timeout):
        """The reply body to a request that :meth:`send` sent."""
        key = self.key(g)
        link, reused = sent
        try:
            try:
                return self.read(link, timeout)
            except self.closed_errors:
                _links.drop([key])
                if not reused:
                    raise
                # closed while idle, before the request reached it: send once more on a
                # new link (a push repeated with the same (worker, seq) is applied once)
                link, _ = self.send(g, body, min(timeout, RECONNECT))
                return self.read(link, timeout)
        except BaseException:          # a timeout or an interrupt: the link is out of step
            _links.drop([key])
            raise

    def lost_errors(self):
        """The errors that mean a shard process (or its shards) is gone."""
        return (Gone, Refused, OSError, EOFError, asyncio.TimeoutError, TimeoutError,
                require_distributed().comm.CommClosedError)

    def lost(self, g, what, exc, timeout):
        """The ShardLostError for a failed exchange with group `g`'s process."""
        server = self.server
        names, host = server.group_names(g), server.hosts[g]
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            return ShardLostError(
                f"{what}: shard(s) {names} on {host} did not answer within {timeout:g} s "
                f"({type(exc).__name__}); if that process died, their state since the last "
                "checkpoint is lost: restart from a checkpoint (train(..., checkpoint_to=..., "
                "checkpoint_every=...), resume_from=)")
        error = ShardLostError(
            f"{what}: the process holding shard(s) {names} on {host} is lost "
            f"({type(exc).__name__}: {exc}); their state since the last checkpoint is lost: "
            "restart from a checkpoint")
        error.__cause__ = exc
        return error

    def call(self, jobs, what, extra=0.0, between=None):
        """Run ``{g: request}`` on the groups' processes, all at once; ``{g: value or exception}``.

        Every request is written before `between` (a callable: the caller's
        work on the shards of its own process) runs; the replies are read
        after it. This thread's ``timing`` becomes ``{"serialise", "shard",
        "round"}``: seconds encoding and decoding here, and the longest of
        the processes' seconds in their shards and waiting for sync rounds.
        """
        if not jobs:
            if between is not None:
                between()
            return {}
        if self.needs_event_loop:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:                 # this thread runs an event loop: use a thread that does not
                def there():      # and bring its timing back to this thread
                    return self.call(jobs, what, extra, between), _links.timing

                out, _links.timing = helper_thread().submit(there).result()
                return out
        lost = self.lost_errors()
        timeout = self.server.options.wait_timeout + GRACE + extra
        end = time.monotonic() + timeout
        timing = dict(serialise=0.0, shard=0.0, round=0.0)
        out, sent = {}, {}

        def attempt(g, step):
            try:
                return step()
            except lost as exc:
                _links.drop([self.key(g)])     # e.g. shards released under an open link
                out[g] = self.lost(g, what, exc, timeout)
            except Exception as exc:
                out[g] = exc

        start = time.perf_counter()
        bodies = {g: wire.encode_request(job) for g, job in jobs.items()}
        timing["serialise"] += time.perf_counter() - start
        for g, body in bodies.items():
            link = attempt(g, lambda: self.send(g, body, end - time.monotonic()))
            if g not in out:
                sent[g] = link
        try:
            if between is not None:
                between()
        finally:
            for g, link in sent.items():
                reply = attempt(g, lambda: self.receive(g, bodies[g], link,
                                                        end - time.monotonic()))
                if g in out:
                    continue
                start = time.perf_counter()
                ok, value, shard_s, round_s = wire.decode_reply(reply)
                timing["serialise"] += time.perf_counter() - start
                timing["shard"] = max(timing["shard"], shard_s)
                timing["round"] = max(timing["round"], round_s)
                if ok:
                    out[g] = value
                elif isinstance(value, Gone):
                    _links.drop([self.key(g)])
                    out[g] = self.lost(g, what, value, timeout)
                else:
                    out[g] = value
        _links.timing = timing
        return out


# ---------------------------------------------------------------- direct links


def _recv_into(sock, view):
    got = 0
    while got < view.nbytes:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the shard process closed the link")
        got += k


def _send_pieces(sock, pieces):
    views = [memoryview(p).cast("B") for p in pieces]
    views = [v for v in views if v.nbytes]
    if isinstance(sock, ssl.SSLSocket):
        for v in views:             # TLS has no sendmsg (and the SSL layer copies anyway)
            sock.sendall(v)
        return
    while views:
        n = sock.sendmsg(views[:_IOV_MAX])
        while n:
            if n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


class Link:
    """The caller's end of one direct link: a blocking socket, used by one thread.

    Every operation takes the seconds it may block; a socket timeout is a
    ``TimeoutError``, a closed link ``EOFError`` or ``OSError``.
    """

    def __init__(self, sock, max_frame):
        self._sock = sock
        self.max_frame = max_frame
        host, port = sock.getsockname()[:2]
        self.local_address = f"{host}:{port}"

    @classmethod
    def open(cls, host, port, token, ssl_context, timeout):
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            set_socket_options(sock)
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(sock, server_hostname=host)
            sock.sendall(token)
            answer = bytearray(1)
            _recv_into(sock, memoryview(answer))
            if answer == b"\x01":
                cap = bytearray(wire.HEADER)
                _recv_into(sock, memoryview(cap))
        except BaseException:
            sock.close()
            raise
        if answer != b"\x01":
            sock.close()
            raise Refused(f"{host}:{port} does not know this server's token (its shards "
                          "were released, or the process was restarted)")
        return cls(sock, int.from_bytes(cap, "little"))

    def closed(self):
        """Closed here, or by the other side while idle (an idle link has nothing to read)."""
        if self._sock.fileno() < 0:
            return True
        try:
            return bool(select.select([self._sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def write(self, pieces, timeout):
        n = wire.size(pieces)
        if n > self.max_frame:
            raise ValueError(f"a request of {n} bytes; the shard process takes at most "
                             f"{self.max_frame}")
        self._sock.settimeout(max(timeout, 1e-3))
        pieces = [n.to_bytes(wire.HEADER, "little"), *pieces]
        if n <= wire.JOIN_BELOW:        # one buffer, one segment train, one wake-up
            self._sock.sendall(b"".join(pieces))
        else:
            _send_pieces(self._sock, pieces)

    def read(self, timeout):
        self._sock.settimeout(max(timeout, 1e-3))
        header = bytearray(wire.HEADER)
        _recv_into(self._sock, memoryview(header))
        body = np.empty(int.from_bytes(header, "little"), np.uint8)   # not zeroed: filled now
        _recv_into(self._sock, memoryview(body))
        return body

    def abort(self):
        self._sock.close()

    def __del__(self):
        # the thread that held it ended (its table of links went with it): close the socket
        # here, as drop() would have, rather than leave it to the socket's own finalizer
        try:
            self._sock.close()
        except Exception:
            pass


class DirectTransport(Transport):
    """Blocking sockets to each shard process's own listener, with the server's token.

    Parameters
    ----------
    server : DaskParameterServer
    addresses : list of (host, port)
        Each group's listener.
    token : bytes
        The server's token (:data:`~lasagne_accum.distributed.dask.listener.TOKEN_BYTES`).
    """

    name = "direct"

    def __init__(self, server, addresses, token):
        super().__init__(server)
        if len(token) != TOKEN_BYTES:
            raise ValueError(f"a token has {TOKEN_BYTES} bytes")
        self.addresses, self.token = [tuple(a) for a in addresses], token

    def key(self, g):
        return (*self.addresses[g], self.token)

    def open(self, g, timeout):
        host, port = self.addresses[g]
        ssl_context = (self.server.connection_args().get("ssl_context")
                       if self.server.hosts[g].startswith("tls://") else None)
        return Link.open(host, port, self.token, ssl_context, timeout)

    def write(self, link, g, body, timeout):
        link.write(body, timeout)

    def read(self, link, timeout):
        return link.read(timeout)

    def idle_closed(self, link):
        return link.closed()


class _Comm:
    """A Dask comm driven by this thread's private event loop."""

    def __init__(self, comm, loop):
        self.comm, self.loop = comm, loop
        self.local_address = comm.local_address

    def run(self, coro, timeout):
        return self.loop.run_until_complete(asyncio.wait_for(coro, max(timeout, 1e-3)))

    def abort(self):
        self.comm.abort()


class CommTransport(Transport):
    """Dask comms to the comm handler ``lasagne_accum_shards`` of each shard process.

    No port besides Dask's own. A comm is driven by a private event loop in
    the calling thread; from a thread that already runs one (a notebook), the
    calls go through one helper thread.
    """

    name = "dask"
    needs_event_loop = True

    def __init__(self, server, keys):
        super().__init__(server)
        self.actor_keys = list(keys)

    @property
    def closed_errors(self):
        return (EOFError, ConnectionError, require_distributed().comm.CommClosedError)

    def key(self, g):
        return self.server.hosts[g]

    def open(self, g, timeout):
        loop = _links.event_loop()
        comm = loop.run_until_complete(require_distributed().comm.connect(
            self.server.hosts[g], timeout=max(timeout, 1e-3), **self.server.connection_args()))
        return _Comm(comm, loop)

    def write(self, link, g, body, timeout):
        link.run(link.comm.write({"op": HANDLER, "key": self.actor_keys[g],
                                  "payload": wire.join(body)}), timeout)

    def read(self, link, timeout):
        reply = link.run(link.comm.read(), timeout)
        if not isinstance(reply, (bytes, bytearray, memoryview)):   # Dask's own error message
            raise RuntimeError(f"shard process: {reply!r:.500}")
        # a writeable copy: the arrays of a reply are views of its body, and pulled
        # parameters are the caller's to change
        return np.frombuffer(reply, np.uint8).copy()

    def idle_closed(self, link):
        return link.comm.closed()
