"""The bytes of one request or reply, and the shape a request must have.

A message (the *body*) is a head followed by raw buffers, each at an offset
that is a multiple of :data:`ALIGN` from the start of the body:

    u32 k | u64 len(head) | u64 len(buffer i), i < k | head | pad, buffer 0 | pad, buffer 1 ...

The arrays of a message travel as those buffers: the sender copies no array
data into the message and the receiver's arrays are aligned views of the
received body, so the socket's copy is the only one. On a direct link a body
follows its 8-byte little-endian length (the frame header); over a Dask comm
it is one ``bytes`` value.

* A **request** (caller to shard process) has a JSON head: plain data that
  cannot name code, whose objects have only ``str`` keys, and whose decoder
  refuses deep nesting with an error (never a crash). Arrays are numeric
  (``bool``, integer, float, complex) and stand in the head as
  ``{"__ndarray__": i}``; the head lists each buffer's dtype and shape.
  :func:`check_request` then checks the request's shape (method from a fixed
  set, shard names that are ``str`` and known, worker ids that are ``str`` or
  ``int``, gradients of the shard's shapes and dtypes) before anything in it
  is used.
* A **reply** (shard process to caller) is a pickle (protocol 5) with its
  arrays out of band: it carries the shards' results and exceptions, and it
  comes from a process the caller chose.
"""

import io
import json
import math
import pickle
import struct

import numpy as np

ALIGN = 64                 # offset granularity of the buffers in a body
HEADER = 8                 # bytes of a frame header (the body's length)
MAX_BUFFERS = 1 << 16      # buffers one message may declare
MAX_HEAD = 1 << 20         # bytes of a request's JSON head (names and numbers only)
JOIN_BELOW = 1 << 18       # a smaller message is sent as one buffer (one copy, one syscall)
_ARRAY = "__ndarray__"
_KINDS = "biufc"           # dtype kinds a request's array may have

#: The requests a shard process serves, with the number of arguments of each.
METHODS = {"call": 2, "check": 1, "push": 3, "pid": 0}
#: The shard methods a ``"call"`` request may run, with the number of their arguments.
SHARD_METHODS = {"register": 1, "next_seq": 1, "unregister": 1, "pull": 0, "stats": 0,
                 "state": 0, "state_specs": 0, "load": 1, "note_rejected": 0, "averages": 0}

_PREFIX = struct.Struct("<IQ")
_LENGTH = struct.Struct("<Q")


class BadRequest(ValueError):
    """A request that is not one this library sends: refused before any of it was used."""


def _pad(n):
    return -n % ALIGN


def _body(head, raws):
    """The pieces of a body with `head` (bytes) and the raw buffers `raws` (memoryviews)."""
    prefix = _PREFIX.pack(len(raws), len(head)) + b"".join(
        _LENGTH.pack(r.nbytes) for r in raws)
    pieces = [prefix, head]
    offset = len(prefix) + len(head)
    for raw in raws:
        pad = _pad(offset)
        if pad:
            pieces.append(bytes(pad))
        pieces.append(raw)
        offset += pad + raw.nbytes
    return pieces


def _split(body):
    """``(head, [buffer views])`` of a body; BadRequest if its layout is inconsistent."""
    view = memoryview(body).cast("B")
    total = view.nbytes
    if total < _PREFIX.size:
        raise BadRequest(f"a message of {total} bytes is shorter than its prefix")
    k, head_len = _PREFIX.unpack_from(view, 0)
    if k > MAX_BUFFERS:
        raise BadRequest(f"a message declares {k} buffers (at most {MAX_BUFFERS})")
    offset = _PREFIX.size + k * _LENGTH.size
    if offset + head_len > total:
        raise BadRequest(f"a message of {total} bytes declares a longer head")
    lengths = [_LENGTH.unpack_from(view, _PREFIX.size + i * _LENGTH.size)[0] for i in range(k)]
    head = view[offset:offset + head_len]
    offset += head_len
    buffers = []
    for n in lengths:
        offset += _pad(offset)
        buffers.append(view[offset:offset + n])
        offset += n
    if offset != total:
        raise BadRequest(f"a message of {total} bytes declares {offset}")
    return head, buffers


def size(pieces):
    """Bytes in the body made of `pieces`."""
    return sum(memoryview(p).nbytes for p in pieces)


def join(pieces):
    """The body as one ``bytes`` (for a transport that sends one value)."""
    return b"".join(pieces)


# ------------------------------------------------------------------ replies: pickles


def encode_reply(obj):
    """The body of a reply holding `obj`, as a list of buffers (views of its arrays)."""
    buffers = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return _body(head, [b.raw() for b in buffers])


def decode_reply(body):
    """The object of a reply body; its arrays are views of `body`."""
    head, buffers = _split(body)
    return pickle.Unpickler(io.BytesIO(head), buffers=buffers).load()


# ------------------------------------------------------------------ requests: JSON and arrays


def encode_request(request):
    """The body of a request: `request` made of tuples, lists, dicts with str keys, str,
    int, float, bool, None and numeric numpy arrays (sent without a copy when contiguous)."""
    arrays = []

    def default(x):
        if isinstance(x, np.ndarray):
            arrays.append(np.ascontiguousarray(x))
            return {_ARRAY: len(arrays) - 1}
        if isinstance(x, np.integer):
            return int(x)
        if isinstance(x, np.floating):
            return float(x)
        raise TypeError(f"a request cannot carry a {type(x).__name__}")

    text = json.dumps(request, default=default, separators=(",", ":"))
    head = json.dumps([[a.dtype.str, a.shape] for a in arrays]).encode() + b"\n" + \
        text.encode()
    return _body(head, [memoryview(a).cast("B") for a in arrays])


def _array(spec, buffer):
    dtype_text, shape = spec
    if type(dtype_text) is not str or len(dtype_text) > 8 or type(shape) is not list \
            or not all(type(n) is int and n >= 0 for n in shape) or len(shape) > 32:
        raise BadRequest("a malformed array description")
    try:
        dtype = np.dtype(dtype_text)
    except TypeError:
        raise BadRequest(f"an array of unknown dtype {dtype_text!r}") from None
    if dtype.kind not in _KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise BadRequest(f"an array of dtype {dtype} (only numeric arrays are sent)")
    count = math.prod(shape)                # Python ints: no overflow
    if count * dtype.itemsize != buffer.nbytes:
        raise BadRequest(f"an array of {count} {dtype} values in a buffer of {buffer.nbytes} "
                         "bytes")
    return np.frombuffer(buffer, dtype).reshape(shape)


def decode_request(body):
    """The request in a body: lists, dicts with str keys, str, int, float, bool, None and
    numpy arrays (views of `body`); BadRequest for anything else."""
    head, buffers = _split(body)
    if head.nbytes > MAX_HEAD:
        raise BadRequest(f"a request head of {head.nbytes} bytes (at most {MAX_HEAD})")
    try:
        specs_line, _, text = bytes(head).partition(b"\n")
        specs = json.loads(specs_line)
        if type(specs) is not list or len(specs) != len(buffers) or \
                not all(type(s) is list and len(s) == 2 for s in specs):
            raise BadRequest("the array list does not match the buffers")
        arrays = [_array(s, b) for s, b in zip(specs, buffers)]

        def hook(obj):
            if len(obj) == 1 and _ARRAY in obj:
                i = obj[_ARRAY]
                if type(i) is not int or not 0 <= i < len(arrays):
                    raise BadRequest("a reference to an array that was not sent")
                return arrays[i]
            return obj

        return json.loads(text, object_hook=hook)
    except BadRequest:
        raise
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise BadRequest(f"a request that does not decode: {type(exc).__name__}: "
                         f"{str(exc)[:200]}") from None


# ------------------------------------------------------------------ the shape of a request


def _sequence(x, what):
    if type(x) not in (list, tuple):
        raise BadRequest(f"{what} must be a list, not {type(x).__name__}")
    return x


def _worker_id(x):
    if type(x) in (str, int):
        return x
    raise BadRequest(f"a worker id must be a str or an int, not {type(x).__name__}")


def _integer(x, what):
    if type(x) is int:
        return x
    raise BadRequest(f"{what} must be an int, not {type(x).__name__}")


def _gradients(x, specs, name):
    arrays = _sequence(x, f"the gradients of shard {name!r}")
    if len(arrays) != len(specs):
        raise BadRequest(f"shard {name!r} has {len(specs)} parameters, the push "
                         f"{len(arrays)} gradients")
    for a, (param, (shape, dtype)) in zip(arrays, specs.items()):
        if type(a) is not np.ndarray or a.shape != tuple(shape) or str(a.dtype) != dtype:
            got = (f"a {a.dtype}{list(a.shape)} array" if type(a) is np.ndarray
                   else f"a {type(a).__name__}")
            raise BadRequest(f"shard {name!r}: the gradient of {param!r} must be a {dtype}"
                             f"{list(shape)} array, got {got}")


def _shard_calls(calls, specs, what):
    """``[(name, args)]`` with known, distinct shard names (str) and list arguments."""
    calls = _sequence(calls, what)
    if not calls:
        raise BadRequest(f"{what} is empty")
    seen = set()
    for call in calls:
        if type(call) is not list or len(call) != 2:
            raise BadRequest(f"each entry of {what} must be a [shard name, arguments] pair")
        name, args = call
        if type(name) is not str:
            raise BadRequest(f"a shard name must be a str, not {type(name).__name__}")
        if name not in specs:
            raise BadRequest(f"no shard {name[:100]!r} in this process")
        if name in seen:
            raise BadRequest(f"shard {name!r} appears twice in one request")
        seen.add(name)
        if type(args) is not list:
            raise BadRequest(f"the arguments for shard {name!r} must be a list")
    return calls


def _push_args(args, specs, name, with_arrays):
    if len(args) != 5:
        raise BadRequest(f"a push to shard {name!r} takes 5 values, got {len(args)}")
    wid, seq, arrays, weight, version = args
    _worker_id(wid)
    _integer(seq, "seq")
    _integer(version, "version")
    if with_arrays:
        _gradients(arrays, specs[name], name)
        if type(weight) not in (int, float) or not math.isfinite(weight) or weight <= 0:
            raise BadRequest("a push's weight must be a finite number > 0")
    elif arrays is not None or weight is not None:
        raise BadRequest("a check carries no gradients")


def check_request(request, specs):
    """``(method, args)`` of a decoded request, once its shape is checked.

    Parameters
    ----------
    request : object
        What :func:`decode_request` returned.
    specs : dict
        ``{shard name: {param name: (shape, dtype)}}`` of the shards this
        process holds under the request's key.

    Raises
    ------
    BadRequest
        The request is not one this library sends; the message says what is
        wrong without quoting the request.
    """
    if type(request) is not list or len(request) != 2:
        raise BadRequest("a request must be a [method, arguments] pair")
    method, args = request
    if type(method) is not str or method not in METHODS:
        raise BadRequest(f"unknown request method (one of {', '.join(METHODS)})")
    if type(args) is not list or len(args) != METHODS[method]:
        raise BadRequest(f"request {method!r} takes a list of {METHODS[method]} arguments")
    if method == "call":
        shard_method, calls = args
        if type(shard_method) is not str or shard_method not in SHARD_METHODS:
            raise BadRequest(f"unknown shard method (one of {', '.join(SHARD_METHODS)})")
        for name, call_args in _shard_calls(calls, specs, "a call's shard list"):
            if len(call_args) != SHARD_METHODS[shard_method]:
                raise BadRequest(f"{shard_method}() takes {SHARD_METHODS[shard_method]} "
                                 f"arguments, got {len(call_args)}")
            if shard_method in ("register", "next_seq", "unregister"):
                _worker_id(call_args[0])
            elif shard_method == "load":
                state = call_args[0]
                if type(state) is not dict or not all(type(v) is np.ndarray
                                                      for v in state.values()):
                    raise BadRequest("load() takes a dict {name: numpy array}")
    elif method in ("check", "push"):
        for name, call_args in _shard_calls(args[0], specs, f"a {method}'s shard list"):
            _push_args(call_args, specs, name, with_arrays=method == "push")
        if method == "push" and not all(type(flag) is bool for flag in args[1:]):
            raise BadRequest("a push's pull and wait flags must be bools")
    return method, args
