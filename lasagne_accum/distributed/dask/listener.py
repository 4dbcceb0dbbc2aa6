"""The direct links' listener: one socket per shard process, beside its Dask worker.

A request over a Dask comm pays Dask's message framing and comm layer on both
sides, where the same bytes over a plain socket do not. So each shard process
also listens on a socket of its own: same host as its Dask worker, a port the
system picks, TLS with the worker's own certificates when the cluster uses
TLS. Requests and replies are the bodies of
:mod:`~lasagne_accum.distributed.dask.wire`, served on the worker's event
loop.

The wire: a link opens with the server's token (16 random bytes, made by the
client and sent to the shard actors through Dask); the listener answers one
byte, 1 (the link is bound to that token's shards) followed by the largest
request body those shards take (8 bytes, little-endian), or 0 (refused; it
closes the link). Then each way a frame is an 8-byte little-endian body
length and the body. Nothing of a frame is decoded before the token matched.

What a link may cost the shard process is bounded:

* **Links not yet admitted** (TLS handshake and token): at most
  :data:`MAX_PENDING` at once (more are closed at once), each given
  :data:`HANDSHAKE_TIMEOUT` seconds for both.
* **Frames**: a frame header larger than the shards' largest request
  (``ShardActor.max_request``) closes the link before any of the frame is
  read; a frame that has begun must be complete within
  :data:`FRAME_TIMEOUT` seconds. A frame is read straight into one buffer of
  its announced size (no second copy, none when the link closes midway).
* **One frame at a time per link**: reading stops while a request is served
  and its reply is written, and the event loop runs other links' requests
  between two of one link's (a link that pipelines requests waits its turn).
  So the memory held for requests is at most one frame per admitted link.
* **Dead peers**: TCP keepalive and a TCP user timeout on every accepted
  socket, so the links of a host that vanished are closed by the kernel.

Each of these closes or refuses a link, and counts it in
``Listener.counts``.
"""

import asyncio
import contextlib
import hmac
import socket
import weakref

import numpy as np

from . import wire

TOKEN_BYTES = 16
MAX_PENDING = 64              # links at once that have not shown a token yet
HANDSHAKE_TIMEOUT = 10.0      # seconds for a new link's TLS handshake and token
FRAME_TIMEOUT = 30.0          # seconds for a frame, once its first byte has arrived
KEEPALIVE_IDLE = 10           # seconds of silence before the first keepalive probe
KEEPALIVE_INTERVAL = 4        # seconds between probes
KEEPALIVE_PROBES = 5          # unanswered probes before the kernel closes the link
USER_TIMEOUT = 30             # seconds sent data may stay unacknowledged
_listeners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # Worker -> Listener


def set_socket_options(sock):
    """TCP_NODELAY, keepalive and the user timeout on a link's socket (where the OS has them)."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE),
                            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                            ("TCP_KEEPCNT", KEEPALIVE_PROBES),
                            ("TCP_USER_TIMEOUT", USER_TIMEOUT * 1000)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Early(asyncio.Protocol):
    """What arrives on a TLS link before its TLS transport is handed to the link: the token."""

    def __init__(self, link):
        self.link, self.data = link, bytearray()

    def data_received(self, data):
        self.data += data
        if len(self.data) > TOKEN_BYTES:    # a client waits for the answer to its token
            self.link._close("handshake_failed")

    def eof_received(self):
        return False

    def connection_lost(self, exc):
        self.link.connection_lost(exc)


class _Link(asyncio.BufferedProtocol):
    """One accepted link: handshake, then frames read into buffers of their own size."""

    def __init__(self, listener):
        self.listener = listener
        self.loop = listener.loop
        self.transport = None
        self.key = None
        self.max_frame = 0
        self.state = "token"          # token, header, body, busy, closed
        self.buffer = bytearray(TOKEN_BYTES)
        self.got = 0
        self.timer = None
        self.task = None
        self.can_write = None         # a future while the transport's buffer is full

    # ------------------------------------------------------------ connection

    def connection_made(self, transport):
        listener = self.listener
        set_socket_options(transport.get_extra_info("socket"))
        self.transport = transport
        if len(listener.pending) >= MAX_PENDING:
            listener.counts["refused_pending"] += 1
            self.state = "closed"
            transport.abort()
            return
        listener.pending.add(self)
        listener.links.add(self)
        self.timer = self.loop.call_later(HANDSHAKE_TIMEOUT, self._expired, "handshake_timeout")
        if listener.ssl is not None:
            transport.pause_reading()     # nothing is read before the TLS layer is in place
            self.task = self.loop.create_task(self._start_tls())

    async def _start_tls(self):
        # the token may arrive before start_tls returns the TLS transport: until then an
        # _Early protocol keeps it (the link answers on the TLS transport only)
        early = _Early(self)
        try:
            # the link's own timer (HANDSHAKE_TIMEOUT, counted) fires first
            transport = await self.loop.start_tls(
                self.transport, early, self.listener.ssl, server_side=True,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT + 5)
        except Exception:               # a reset, or the peer does not speak our TLS
            self._close("handshake_failed")
            return
        if self.state == "closed":
            transport.abort()
            return
        self.transport = transport
        transport.set_protocol(self)
        data = memoryview(early.data)
        while data.nbytes and self.state == "token":
            buf = self.get_buffer(data.nbytes)
            n = min(len(buf), data.nbytes)
            buf[:n] = data[:n]
            data = data[n:]
            self.buffer_updated(n)

    def connection_lost(self, exc):
        if self.state != "closed":
            self.listener.counts["closed_by_peer"] += 1
        self._forget()

    def eof_received(self):
        return False                    # close our side too

    def _forget(self):
        self.state = "closed"
        self.buffer = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.listener.pending.discard(self)
        self.listener.links.discard(self)
        if self.can_write is not None and not self.can_write.done():
            self.can_write.set_result(None)

    def _close(self, reason):
        """Abort the link, counted under `reason`."""
        if self.state == "closed":
            return
        self.listener.counts[reason] = self.listener.counts.get(reason, 0) + 1
        self._forget()
        if self.transport is not None:
            self.transport.abort()

    def _expired(self, reason):
        self.timer = None
        self._close(reason)

    # ------------------------------------------------------------ flow control

    def pause_writing(self):
        if self.can_write is None or self.can_write.done():
            self.can_write = self.loop.create_future()

    def resume_writing(self):
        if self.can_write is not None and not self.can_write.done():
            self.can_write.set_result(None)

    # ------------------------------------------------------------ reading

    def get_buffer(self, sizehint):
        if self.state not in ("token", "header", "body"):
            return bytearray(1)         # closed or busy: whatever still arrives is dropped
        return memoryview(self.buffer)[self.got:]

    def buffer_updated(self, nbytes):
        if self.state not in ("token", "header", "body"):
            return
        if self.state == "header" and self.got == 0 and nbytes:   # a frame has begun
            self.timer = self.loop.call_later(FRAME_TIMEOUT, self._expired, "frame_timeout")
        self.got += nbytes
        if self.got < len(self.buffer):
            return
        if self.state == "token":
            self._admit(bytes(self.buffer))
        elif self.state == "header":
            self._header(int.from_bytes(self.buffer, "little"))
        else:
            self._frame()

    def _admit(self, token):
        self.key = self.listener.key_of(token)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.listener.pending.discard(self)
        if self.key is None:
            self.listener.counts["refused_token"] += 1
            self.state = "closed"
            self.transport.write(b"\x00")
            self.transport.close()
            return
        self.listener.counts["admitted"] += 1
        self.max_frame = self.listener.max_frames[self.key]
        self.transport.write(b"\x01" + self.max_frame.to_bytes(wire.HEADER, "little"))
        self._next_frame()

    def _next_frame(self):
        self.state, self.buffer, self.got = "header", bytearray(wire.HEADER), 0

    def _header(self, n):
        if not 0 < n <= self.max_frame:
            self._close("frame_too_large")
            return
        # numpy's empty buffer is not zeroed: its pages are touched only as bytes arrive
        self.state, self.buffer, self.got = "body", np.empty(n, np.uint8), 0

    def _frame(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        body, self.buffer = self.buffer, None
        self.state = "busy"
        self.transport.pause_reading()
        self.task = self.loop.create_task(self._answer(body))

    async def _answer(self, body):
        try:
            pieces = await self.listener.serve(self.key, body)
            del body
            if self.state == "closed":
                return
            size = wire.size(pieces)
            header = size.to_bytes(wire.HEADER, "little")
            if size <= wire.JOIN_BELOW:   # one write, one wake-up of the caller
                self.transport.write(b"".join([header, *pieces]))
            else:               # piece by piece: each sent from where it lies, if it can be
                self.transport.write(header)
                for piece in pieces:
                    self.transport.write(piece)
            del pieces
            if self.can_write is not None:
                await self.can_write          # the reply is on its way: bounded buffers
            await asyncio.sleep(0)            # other links' requests go first
            if self.state == "closed":
                return
            self._next_frame()
            self.transport.resume_reading()
        except asyncio.CancelledError:        # the worker is closing
            self._close("cancelled")
        except Exception:                     # a reply that cannot be written: the link goes
            self._close("failed")


class Listener:
    """The direct-link listener of one shard process (one per ``distributed.Worker``).

    `serve(key, body)` is the coroutine that answers one request (a body)
    for the shards under actor `key` with the reply's body (a list of
    buffers).
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
        self.serve = serve
        self._actors = worker.state.actors  # actor key -> actor, kept by Dask
        self._tokens: dict = {}           # token -> actor key
        self.max_frames: dict = {}        # actor key -> the largest request body it takes
        self.pending: set = set()         # links that have not shown a token yet
        self.links: set = set()           # every open link
        self.counts = dict(admitted=0, refused_token=0, refused_pending=0,
                           handshake_timeout=0, handshake_failed=0, frame_too_large=0,
                           frame_timeout=0, closed_by_peer=0)
        self.loop = worker.loop.asyncio_loop
        self._server = None
        # the socket listens already: links made before the server starts wait in its backlog
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._start()))

    async def _start(self):
        self._server = await self.loop.create_server(lambda: _Link(self), sock=self._sock)

    def add(self, token: bytes, key: str, max_frame: int):
        self._tokens[token] = key
        self.max_frames[key] = int(max_frame)

    def key_of(self, token: bytes):
        """The actor key that `token` admits to; None (and the token forgotten) once released."""
        for known, key in list(self._tokens.items()):
            if hmac.compare_digest(known, token):
                if key in self._actors:
                    return key
                del self._tokens[known]
                self.max_frames.pop(key, None)
        return None

    def abort_links(self) -> int:
        """Abort every open link (on the event loop); how many. For tests."""
        links = list(self.links)
        for link in links:
            if link.transport is not None:
                self.loop.call_soon_threadsafe(link.transport.abort)
        return len(links)


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


def admit(worker, token: bytes, key: str, max_frame: int):
    """Let links that show `token` reach the shards of actor `key` on `worker` (if it
    listens), with request bodies of at most `max_frame` bytes."""
    listener = _listeners.get(worker)
    if listener is not None:
        listener.add(token, key, max_frame)


def listener_of(worker):
    """`worker`'s listener, or None (for tests)."""
    return _listeners.get(worker)
