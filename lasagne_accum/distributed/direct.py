"""The Dask backend's direct links: one socket per (calling thread, shard process).

A request over a Dask comm costs about 0.45 ms there and back on loopback
(Dask's message framing and its comm layer on both sides), where the same
bytes over a plain socket take about 0.1 ms. So each shard process also
listens on a socket of its own, beside Dask's: same host as its Dask worker,
a port the system picks, TLS with the worker's own certificates when the
cluster uses TLS. Nothing else changes: the requests and replies are the
pickled buffers that the comm handler serves (``dask._serve``), on the
worker's event loop.

The wire, both ways: an 8-byte little-endian length, then that many bytes.
A link opens with the server's token (16 random bytes, made by the client
and sent to the shard actors through Dask); the listener answers one byte,
1 (the link is bound to that token's shards) or 0 (refused; it closes the
link). Nothing is unpickled before the token matched.
"""

import asyncio
import contextlib
import hmac
import secrets
import select
import socket
import weakref

TOKEN_BYTES = 16
_HEADER = 8
_HANDSHAKE_TIMEOUT = 30.0     # seconds a new link may take to send its token
_listeners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # Worker -> Listener


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def _nodelay(writer):
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(_HEADER, "little") + payload


async def _read_frame(reader) -> bytes:
    n = int.from_bytes(await reader.readexactly(_HEADER), "little")
    return await reader.readexactly(n)


class Listener:
    """The direct-link listener of one shard process (one per ``distributed.Worker``).

    `serve(key, payload)` is the coroutine that answers one request for the
    shards under actor `key`.
    """

    def __init__(self, worker, serve) -> None:
        from distributed.comm import get_address_host, parse_address

        protocol, _ = parse_address(worker.address)
        self.ssl = worker.security.get_listen_args("worker").get("ssl_context") \
            if protocol == "tls" else None
        self.host = get_address_host(worker.address)
        self._sock = socket.create_server((self.host, 0), backlog=128,
                                          family=socket.AF_INET6 if ":" in self.host
                                          else socket.AF_INET)
        self.port = self._sock.getsockname()[1]
        self._serve = serve
        self._actors = worker.state.actors  # actor key -> actor, kept by Dask
        self._tokens: dict = {}           # token -> actor key
        self._writers: set = set()
        self._loop = worker.loop.asyncio_loop
        self._server = None
        # the socket listens already: links made before the server starts wait in its backlog
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._start()))

    async def _start(self):
        self._server = await asyncio.start_server(self._link, sock=self._sock, ssl=self.ssl)

    def add(self, token: bytes, key: str):
        self._tokens[token] = key

    def _key_of(self, token: bytes):
        """The actor key that `token` admits to; None (and the token forgotten) once released."""
        for known, key in list(self._tokens.items()):
            if hmac.compare_digest(known, token):
                if key in self._actors:
                    return key
                del self._tokens[known]
        return None

    async def _link(self, reader, writer):
        _nodelay(writer)
        self._writers.add(writer)
        try:
            key = self._key_of(await asyncio.wait_for(reader.readexactly(TOKEN_BYTES),
                                                      _HANDSHAKE_TIMEOUT))
            writer.write(b"\x01" if key is not None else b"\x00")
            await writer.drain()
            while key is not None:
                reply = await self._serve(key, await _read_frame(reader))
                writer.write(_frame(reply))
                await writer.drain()
        except (asyncio.IncompleteReadError, OSError):   # timeouts and resets included
            pass                          # the caller went away: its link with it
        except asyncio.CancelledError:    # the worker is closing: no error to log
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def abort_links(self) -> int:
        """Abort every open link (on the event loop); how many. For tests."""
        writers = list(self._writers)
        for w in writers:
            self._loop.call_soon_threadsafe(w.transport.abort)
        return len(writers)


def listen(worker, serve):
    """Start this process's listener (once per worker); its ``(host, port)``.

    None where the worker's Dask address is not TCP or TLS (``inproc``,
    ``ucx``, ...): calls then go over Dask comms.
    """
    from distributed.comm import parse_address

    if parse_address(worker.address)[0] not in ("tcp", "tls"):
        return None
    listener = _listeners.get(worker)
    if listener is None:
        listener = _listeners[worker] = Listener(worker, serve)
    return listener.host, listener.port


def admit(worker, token: bytes, key: str):
    """Let links that show `token` reach the shards of actor `key` on `worker` (if it listens)."""
    listener = _listeners.get(worker)
    if listener is not None:
        listener.add(token, key)


def listener_of(worker):
    """`worker`'s listener, or None (for tests)."""
    return _listeners.get(worker)


class Refused(Exception):
    """The listener did not know the token: its shards were released (or it is not ours)."""


def _recv_exactly(sock, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the shard process closed the link")
        got += k
    return buf


class Link:
    """The caller's end of one direct link: a blocking socket, used by one thread.

    Every operation takes the seconds it may block; a socket timeout is a
    ``TimeoutError``, a closed link ``EOFError`` or ``OSError``.
    """

    def __init__(self, sock):
        self._sock = sock
        host, port = sock.getsockname()[:2]
        self.local_address = f"{host}:{port}"

    @classmethod
    def open(cls, host, port, token, ssl_context, timeout):
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(sock, server_hostname=host)
            sock.sendall(token)
            answer = _recv_exactly(sock, 1)
        except BaseException:
            sock.close()
            raise
        if answer != b"\x01":
            sock.close()
            raise Refused(f"{host}:{port} does not know this server's token (its shards "
                          "were released, or the process was restarted)")
        return cls(sock)

    def closed(self) -> bool:
        """Closed here, or by the other side while idle (an idle link has nothing to read)."""
        if self._sock.fileno() < 0:
            return True
        try:
            return bool(select.select([self._sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def write(self, payload: bytes, timeout: float):
        self._sock.settimeout(max(timeout, 1e-3))
        self._sock.sendall(_frame(payload))

    def read(self, timeout: float) -> bytearray:
        self._sock.settimeout(max(timeout, 1e-3))
        n = int.from_bytes(_recv_exactly(self._sock, _HEADER), "little")
        return _recv_exactly(self._sock, n)

    def abort(self):
        self._sock.close()

    def __del__(self):
        # the thread that held it ended (its table of links went with it): close the socket
        # here, as drop() would have, rather than leave it to the socket's own finalizer
        try:
            self._sock.close()
        except Exception:
            pass
