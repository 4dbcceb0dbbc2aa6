"""Hostile requests over Dask's comms: the shard handler refuses them, and nothing changes.

A property test (hypothesis) of the shard processes' front door. Malformed
requests, generated, are sent as Dask messages over a ``ConnectionPool`` of
this test's own (its own event loop, in a thread) to the comm handler a live
shard process serves, exactly as a peer on the cluster's network could send
them: some as msgpack with their arrays as out-of-band frames (as the
library's own transport sends a request), some pickled whole (which is how
objects that are not data reach a Dask handler: sets, numpy scalars, object
arrays, integers beyond 64 bits...). Each must come back as a refusal,
returned as data (not raised in the handler: Dask would log a traceback),
whose message names the field that is wrong. The tests do not depend on the
refusal's form (the caller's transport is being reworked): a refusal is an
exception anywhere in the reply, or Dask's error message.

Categories (each batch holds one request of each): the message's fields
(unknown actor keys, keys that are not str, unknown fields); requests that
are not ``[method, arguments]``; unknown methods and shard methods (dunder
and private names included); wrong argument counts; objects that are not
data anywhere in a request, or nesting deeper than 16; shard lists (not a
list, empty, not pairs, unknown shard names of up to 1 MB, non-str names, a
shard twice); push and check fields (worker ids, sequence numbers, weights
with NaN, infinite, zero, negative or non-number values, versions of the
wrong type or that no shard has, gradients of the wrong type, number (up to
10**5), dtype, shape, with NaN or inf, arrays that declare up to 2**59
elements, flags); pushes and checks from unregistered workers; ``load``
requests with one entry wrong; repeated sequence numbers (replays with other
gradients and versions), which are the library's retries: answered as
duplicates, not refused, and not applied.

Afterwards (after each batch) a digest of the shards' parameters, rule state,
versions, counters, sequence table and live workers is unchanged; and an
honest trainer pushing beside the hostile requests had each of its pushes
applied once (its version count, its sequence table, and its parameters
against a numpy re-derivation of its momentum steps).

One loopback ``LocalCluster`` (one worker process, 127.0.0.1) serves the
module and is closed at the end. The cases at the end of the file are the
edges where the shard once answered wrongly, each with what it did.
"""

import asyncio
import collections
import copy
import datetime
import decimal
import fractions
import hashlib
import http
import importlib.util
import json
import re
import threading
import urllib.parse
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lasagne_accum import momentum

pytestmark = pytest.mark.skipif(importlib.util.find_spec("distributed") is None,
                                reason="needs dask[distributed]")

# ------------------------------------------------------------------ the shards under attack

PARAMS = {"w": np.zeros((3, 2)), "b": np.zeros(2, np.float32), "s": np.zeros(())}
SHARDS = {"dense": ["w", "b"], "s": ["s"]}
LR, MU = 0.1, 0.9
#: each shard's ``{param: (shape, dtype)}``: what a request is checked against
SPECS = {s: {n: (PARAMS[n].shape, str(PARAMS[n].dtype)) for n in names}
         for s, names in SHARDS.items()}
PARAM_SPECS = {n: spec for specs in SPECS.values() for n, spec in specs.items()}
#: what ``load`` takes for each shard (the record of applied seqs is optional)
STATE_SPECS = {s: dict(**specs, **{f"{n}.momentum_velocity": spec for n, spec in specs.items()},
                       **{f"{s}/counters": ((2,), "int64")})
               for s, specs in SPECS.items()}

PAST = "past"                # registered, with pushes 0..PAST_PUSHES-1 applied before the attack
PAST_PUSHES = 3              # (so each shard is at version PAST_PUSHES)
HONEST = "honest"            # the concurrent trainer
KEY = "<the shard actor's key>"     # in a generated message: the real key, put in when sent
BATCH = 25                   # hostile requests per hypothesis example, sent at once

METHODS = {"call": 2, "check": 1, "push": 3, "pid": 0}
SHARD_METHODS = {"register": 1, "next_seq": 1, "unregister": 1, "pull": 0, "stats": 0,
                 "state": 0, "state_specs": 0, "load": 1, "note_rejected": 0, "averages": 0}
#: send_recv's and Dask's own message fields, and the handler's
RESERVED = {"op", "reply", "serializers", "deserializers", "close", "comm", "key", "request",
            "profile"}

SETTINGS = dict(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])

SENT = collections.Counter()      # requests sent, by test
SEEN = collections.defaultdict(collections.Counter)   # categories sent, by test


def _grad(name, seed):
    shape, dtype = PARAM_SPECS[name]
    return np.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _prepared(client):
    """A server on `client` whose worker PAST pushed PAST_PUSHES times."""
    from lasagne_accum.distributed.dask import DaskParameterServer

    server = DaskParameterServer(client, PARAMS, momentum, dict(learning_rate=LR, momentum=MU),
                                 shards=SHARDS, mode="async", compile_mode="CVM")
    try:
        assert len(server.hosts) == 1         # one actor holds both shards
        version, _ = server.register(PAST)
        for seq in range(PAST_PUSHES):
            r = server.push(PAST, seq, {n: _grad(n, 1000 + seq) for n in PARAMS},
                            version=version, pull=True)
            version = r["version"]
        assert version == (PAST_PUSHES, PAST_PUSHES)
        state = server.state()
        for s, specs in STATE_SPECS.items():          # what load() is sent, as the shard has it
            for n, (shape, dtype) in specs.items():
                assert state[n].shape == shape and str(state[n].dtype) == dtype, n
    except BaseException:
        server.close()
        raise
    return server


def _digest(server):
    """``{entry: sha256}`` of every shard's parameters, rule state, counters (version, applied)
    and sequence table, and the live workers."""
    out = {}
    for name, a in server.state().items():
        a = np.ascontiguousarray(a)
        out[name] = hashlib.sha256(repr((a.dtype.str, a.shape)).encode() + a.tobytes()).hexdigest()
    out["live workers"] = sorted(map(repr, server.stats()["live_workers"]))
    return out


# ------------------------------------------------------------------ the wire


class Case:
    """One hostile message and what must come back.

    `message` holds ``key`` and ``request`` (and maybe unknown fields);
    `names`: the strings the refusal's text must hold (the field), or None
    for a replay, which must be answered as a duplicate, applied nowhere.
    `encoding`: "msgpack" (arrays as out-of-band frames) or "pickle" (the
    request pickled whole), where the request allows both.
    """

    __slots__ = ("label", "message", "names", "encoding")

    def __init__(self, label, message, names, encoding="msgpack"):
        self.label, self.message, self.names, self.encoding = label, message, names, encoding

    def __repr__(self):
        return (f"Case({self.label!r}, names={self.names!r}, encoding={self.encoding!r}, "
                f"message={_show(self.message):.1500})")


def _show(x):
    """repr(x), with arrays as their dtype and shape and ints too long to print as their size."""
    if type(x) is int and x.bit_length() > 4000:
        return f"<an int of {x.bit_length()} bits>"
    if isinstance(x, np.ndarray) and type(x) is np.ndarray:
        return f"array({x.dtype}{list(x.shape)}{', broadcast' if 0 in x.strides else ''})"
    if type(x) in (list, tuple):
        inner = ", ".join(_show(v) for v in x)
        return f"[{inner}]" if type(x) is list else f"({inner})"
    if type(x) is dict:
        return "{" + ", ".join(f"{k!r}: {_show(v)}" for k, v in x.items()) + "}"
    return repr(x)


def _msgpackable(x):
    if x is None or type(x) in (bool, str, bytes, float, np.ndarray):
        return True
    if type(x) is int:
        return -2 ** 63 <= x < 2 ** 64
    if type(x) in (list, tuple):
        return all(_msgpackable(v) for v in x)
    if type(x) is dict:
        return all(type(k) in (str, int) and _msgpackable(k) and _msgpackable(v)
                   for k, v in x.items())
    return False


def _declares_huge(x):
    """Does `x` hold an array that declares far more elements than it has (a broadcast)?"""
    if type(x) is np.ndarray:
        return x.size > 2 ** 20 and 0 in x.strides
    if type(x) in (list, tuple):
        return any(_declares_huge(v) for v in x)
    if type(x) is dict:
        return any(_declares_huge(v) for v in x.values())
    return False


def _msgpack_form(x):
    from distributed.protocol import Serialize

    if isinstance(x, np.ndarray):
        return Serialize(x)
    if type(x) in (list, tuple):
        return [_msgpack_form(v) for v in x]
    if type(x) is dict:
        return {k: _msgpack_form(v) for k, v in x.items()}
    return x


def _encoded(case, key):
    """The message as sent: the real key put in, the request in its encoding."""
    from distributed.protocol import ToPickle

    message = {k: (key if type(v) is str and v == KEY else v) for k, v in case.message.items()}
    request = message.get("request")
    pickled = (case.encoding == "pickle" or not _msgpackable(request)) \
        and not _declares_huge(request)     # (a pickle would copy what a broadcast declares)
    message["request"] = ToPickle(request) if pickled else _msgpack_form(request)
    return message


class Wire:
    """This test's own sender: an event loop in a thread, and a Dask ConnectionPool on it."""

    def __init__(self, connection_args):
        from distributed.core import ConnectionPool

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hostile-wire",
                                       daemon=True)
        self.thread.start()

        async def start():
            pool = ConnectionPool(connection_args=connection_args)
            await pool.start()
            return pool

        self.pool = self._run(start())

    def _run(self, coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def send(self, server, cases):
        """Send `cases` to `server`'s shard process at once; ``("reply", reply)`` or
        ``("raised", exception)`` of each."""
        from lasagne_accum.distributed.dask.actor import HANDLER

        address, key = server.hosts[0], server._keys[0]

        async def one(case):
            try:
                return "reply", await getattr(self.pool(address), HANDLER)(
                    **_encoded(case, key))
            except Exception as exc:
                return "raised", exc

        async def batch():
            return await asyncio.gather(*(one(case) for case in cases))

        return self._run(batch())

    def close(self):
        try:
            self._run(self.pool.close(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()


def _refusals(reply):
    """The refusals a reply carries: its exceptions (as data), or Dask's error message."""
    from distributed.core import clean_exception

    if isinstance(reply, BaseException):
        return [reply]
    if isinstance(reply, dict):
        if "status" in reply and ("exception" in reply or "exception_text" in reply):
            try:
                _, exc, _ = clean_exception(**reply)
            except Exception:
                exc = None
            return [exc if exc is not None else Exception(reply.get("exception_text"))]
        return [e for v in reply.values() for e in _refusals(v)]
    if isinstance(reply, (list, tuple)):
        return [e for v in reply for e in _refusals(v)]
    return []


def _push_results(reply):
    """The per-shard results of a push in a reply (dicts with ``duplicate``)."""
    if isinstance(reply, dict):
        return [reply] if "duplicate" in reply else [r for v in reply.values()
                                                     for r in _push_results(v)]
    if isinstance(reply, (list, tuple)):
        return [r for v in reply for r in _push_results(v)]
    return []


def _problem(case, outcome):
    """What is wrong with what `case` got, or None: it must get a refusal naming the field,
    returned as data (or, for a replay, a duplicate applied nowhere)."""
    how, reply = outcome
    if how != "reply":
        return (f"{case!r}: raised at the caller, not refused as data "
                f"({type(reply).__name__}: {reply!s:.300})")
    refusals = _refusals(reply)
    text = "\n".join(f"{type(e).__name__}: {e}" for e in refusals)
    if case.names is None:
        results = _push_results(reply)
        if refusals or not results:
            return f"{case!r}: {reply!r:.500}"
        if not all(r["duplicate"] and not r["applied"] for r in results):
            return f"{case!r}: a replay was applied: {results!r:.500}"
        return None
    if not refusals:
        return f"{case!r} was accepted: {reply!r:.500}"
    missing = [n for n in case.names if not _names_it(text, n)]
    if missing:
        return f"{case!r}: the refusal does not name {missing}: {text!r:.600}"
    return None


def _names_it(text, name):
    """Does `text` hold `name`, not as the end of a longer word ("version" in "conversion")?"""
    return re.search(r"(?<![A-Za-z0-9_])" + re.escape(name), text) is not None


def _attack(server, wire, batch, test, check_digest=True):
    before = _digest(server) if check_digest else None
    outcomes = wire.send(server, batch)
    for case, outcome in zip(batch, outcomes):
        problem = _problem(case, outcome)
        assert problem is None, problem
        SEEN[test][case.label] += 1
    SENT[test] += len(batch)
    if check_digest:
        assert _digest(server) == before


# ------------------------------------------------------------------ values

_ints64 = st.integers(-2 ** 63, 2 ** 63 - 1)
_names = st.text(max_size=8)
_keys = st.text(max_size=6).filter(lambda k: not k.startswith("__"))   # __Serialized__: Dask's
_scalars = st.none() | st.booleans() | _ints64 | st.floats() | _names
#: data (what a request may hold), of any shape
_junk = st.recursive(_scalars, lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(_keys, c, max_size=2), max_leaves=6)
_not_lists = _scalars | st.dictionaries(_keys, _scalars, max_size=2)

_zero_d = st.sampled_from
BAD_WORKER_IDS = st.one_of(
    st.floats(), st.booleans(), st.none(), st.lists(st.integers(0, 9), max_size=2),
    st.dictionaries(_keys, st.integers(0, 9), max_size=1),
    _zero_d([np.array(3), np.array(1.5), np.array(True), np.array([1])]))
BAD_SEQS = st.one_of(
    st.integers(-2 ** 63, -1), st.integers(-10 ** 40, -1), st.floats(), st.booleans(),
    st.text(max_size=5), st.none(), st.lists(st.integers(0, 5), max_size=2),
    _zero_d([np.array(1.0), np.array(-1), np.array(True), np.array(np.nan), np.array(2 + 0j),
             np.array([3])]))
BAD_WEIGHTS = st.one_of(
    st.floats(max_value=0.0), st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.integers(-2 ** 63, 0), st.text(max_size=5), st.none(), st.booleans(),
    st.lists(st.floats(1, 2), max_size=2),
    _zero_d([np.array(np.nan), np.array(np.inf, np.float32), np.array(-np.inf, np.float16),
             np.array(-1.0, np.float16), np.array(0), np.array(True), np.array([1.0]),
             np.array(np.nan, np.float32)]))
BAD_VERSION_TYPES = st.one_of(
    st.floats(), st.text(max_size=5), st.none(), st.booleans(),
    st.lists(st.integers(0, 3), max_size=2),
    _zero_d([np.array(1.0), np.array(True), np.array([0]), np.array(np.nan)]))
#: versions no shard has: refused by the shard's book, not by the request's checks
ABSENT_VERSIONS = st.one_of(st.integers(-2 ** 63, -1), st.integers(10 ** 6, 2 ** 63 - 1),
                            st.integers(10 ** 6, 10 ** 100), _zero_d([np.array(-1)]))
GRAD_DTYPES = ["float16", "float32", "float64", "int8", "int64", "uint16", "bool", "complex64",
               "complex128", ">f8", ">f4"]
#: what no request holds (pickled): objects that are not data, arrays that are not numeric
NOT_DATA = [
    set(), frozenset({1}), bytearray(b"x"), complex(1, 2), fractions.Fraction(1, 3),
    decimal.Decimal("1.5"), np.float64(2.0), np.int64(3), np.bool_(True), np.str_("w"),
    np.float32(1), collections.OrderedDict(a=1), collections.deque([1]), range(2), slice(1, 2),
    Ellipsis, datetime.date(2020, 1, 1), uuid.UUID(int=1), len, int, object(),
    http.HTTPStatus.OK, urllib.parse.urlparse("tcp://127.0.0.1:1"), NotImplemented,
    np.ma.masked_array([1.0]), np.array(["a"]), np.array([b"a"]), np.array([None], object),
    np.zeros(2, [("a", "f8")]), np.zeros(2, "V8"), np.array(["2020-01-01"], "datetime64[D]"),
    np.array([1], "timedelta64[s]"), b"bytes"]


def _huge_shape(draw):
    """A shape of 2**31 to 2**59 elements."""
    total = draw(st.integers(31, 59))
    ndim = draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=ndim - 1, max_size=ndim - 1)))
    bits = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    return tuple(2 ** b for b in bits)


@st.composite
def _other_shape(draw, shape):
    return draw(st.lists(st.integers(0, 4), max_size=3).map(tuple).filter(lambda s: s != shape))


# ------------------------------------------------------------------ pushes and checks


@st.composite
def _calls(draw, wid=PAST, seq=None, with_arrays=True, versions=st.integers(0, PAST_PUSHES)):
    """A well-formed shard list of a push (or a check): one or both shards, `wid`, a fresh
    seq (never applied) unless given."""
    names = draw(st.permutations(list(SPECS)))[: draw(st.integers(1, len(SPECS)))]
    seq = draw(st.integers(PAST_PUSHES, 2 ** 62)) if seq is None else seq
    seed = draw(st.integers(0, 2 ** 32 - 1))
    weight = draw(st.floats(1e-3, 1e3) | st.integers(1, 1000)) if with_arrays else None
    return [[s, [wid, seq, [_grad(n, seed) for n in SPECS[s]] if with_arrays else None, weight,
                 draw(versions)]] for s in names]


PUSH_DEFECTS = ["worker id", "seq", "weight", "version type", "absent version",
                "gradients type", "too many gradients", "missing gradient",
                "gradient not an array", "gradient dtype", "gradient shape",
                "huge declared gradient", "non-finite gradient", "non-numeric gradient",
                "value count", "unknown shard", "shard name type", "shard twice",
                "shard list type", "empty shard list", "entry not a pair", "arguments type",
                "flags", "argument count", "unregistered worker"]
CHECK_DEFECTS = ["worker id", "seq", "version type", "absent version", "check with gradients",
                 "value count", "unknown shard", "shard name type", "shard twice",
                 "shard list type", "empty shard list", "entry not a pair", "arguments type",
                 "argument count", "unregistered worker"]
PUSH_KINDS = [("push", k) for k in PUSH_DEFECTS] + [("check", k) for k in CHECK_DEFECTS]


def _shard_list_defect(draw, kind, calls, what):
    """Break the shard list `calls` (of a call, push or check) as `kind` says; ``(calls,
    names)``."""
    i = draw(st.integers(0, len(calls) - 1))
    name = calls[i][0]
    if kind == "unknown shard":
        calls[i][0] = bad = draw(st.text(max_size=30).filter(lambda s: s not in SPECS)
                                 | st.integers(200, 10 ** 6).map(lambda n: "x" * n))
        return calls, ("unknown shard", repr(bad[:100]))
    if kind == "shard name type":
        calls[i][0] = draw(st.one_of(_ints64, st.none(), st.floats(), st.booleans(),
                                     st.lists(_names, max_size=2)))
        return calls, ("shard name must be a str",)
    if kind == "shard twice":
        calls.insert(draw(st.integers(0, len(calls))), copy.deepcopy(calls[i]))
        return calls, (f"shard {name!r} appears twice",)
    if kind == "shard list type":
        return draw(_not_lists), (f"{what} must be a list",)
    if kind == "empty shard list":
        return draw(st.sampled_from([[], ()])), (f"{what} is empty",)
    if kind == "entry not a pair":
        calls[i] = draw(_not_lists | st.lists(_scalars, max_size=4).filter(lambda x: len(x) != 2))
        return calls, (f"each entry of {what}",)
    if kind == "arguments type":
        calls[i][1] = draw(_not_lists)
        return calls, (f"the arguments for shard {name!r} must be a list",)
    raise AssertionError(kind)


@st.composite
def push_cases(draw, method, kind):
    """A push or a check with one thing wrong: `kind`."""
    calls = draw(_calls(with_arrays=method == "push"))
    flags = [draw(st.booleans()), draw(st.booleans())] if method == "push" else []
    encoding = draw(st.sampled_from(["msgpack", "pickle"]))
    i = draw(st.integers(0, len(calls) - 1))
    shard, values = calls[i]
    specs = SPECS[shard]
    j = draw(st.integers(0, len(specs) - 1))
    param = list(specs)[j]
    shape, dtype = specs[param]
    arrays = values[2]
    if kind == "worker id":
        values[0], names = draw(BAD_WORKER_IDS), ("worker id",)
    elif kind == "seq":
        values[1], names = draw(BAD_SEQS), ("seq",)
    elif kind == "weight":
        values[3], names = draw(BAD_WEIGHTS), ("weight",)
    elif kind == "version type":
        values[4], names = draw(BAD_VERSION_TYPES), ("version",)
    elif kind == "absent version":
        values[4], names = draw(ABSENT_VERSIONS), ("version",)
    elif kind == "unregistered worker":
        values[0] = draw(st.text(max_size=30).filter(lambda w: w not in (PAST, HONEST)) | _ints64)
        for _, v in calls:
            v[0] = values[0]
        names = ("worker", "not registered")
    elif kind == "gradients type":
        values[2] = draw(_not_lists | st.just(dict(zip(specs, arrays)))
                         | st.just(arrays[0]))
        names = ("the gradients must be a list",)
    elif kind == "too many gradients":
        extra = draw(st.integers(1, 3) | st.just(10 ** 5))      # (a long list: None)
        values[2] = arrays + ([_grad(param, 0)] if extra < 4 else [None]) * extra
        names = ("gradients for",)
    elif kind == "missing gradient":
        if draw(st.booleans()):
            values[2], names = arrays[:j], (f"no gradient for {param!r}",)
        else:
            arrays[j], names = None, (f"no gradient for {param!r}",)
    elif kind == "gradient not an array":
        arrays[j] = draw(st.floats() | _ints64 | st.booleans() | _names
                         | st.just(np.asarray(arrays[j]).tolist()))
        names = (f"the gradient of {param!r} is a",)
    elif kind == "gradient dtype":
        wrong = draw(st.sampled_from([d for d in GRAD_DTYPES if d != dtype]))
        arrays[j] = np.zeros(shape, wrong)
        names = (f"the gradient of {param!r} has dtype",)
    elif kind == "gradient shape":
        arrays[j] = np.zeros(draw(_other_shape(shape)), dtype)
        names = (f"the gradient of {param!r} has the wrong shape",)
    elif kind == "huge declared gradient":
        arrays[j] = np.broadcast_to(np.zeros(1, dtype), _huge_shape(draw))
        names = (f"the gradient of {param!r} has the wrong shape",)
    elif kind == "non-finite gradient":
        bad = np.array(arrays[j])
        flat = bad.reshape(-1)
        for k in draw(st.lists(st.integers(0, flat.size - 1), min_size=1, max_size=3)):
            flat[k] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        arrays[j], names = bad, (f"the gradient of {param!r} has NaN or inf",)
    elif kind == "non-numeric gradient":
        arrays[j] = draw(st.sampled_from([a for a in NOT_DATA if type(a) is np.ndarray]))
        names, encoding = (f"request[1][0][{i}][1][2][{j}]: an array of dtype",), "pickle"
    elif kind == "check with gradients":
        if draw(st.booleans()):
            values[2] = [_grad(n, 0) for n in specs]
        else:
            values[3] = draw(st.floats(0.5, 2))
        names = ("a check carries no gradients",)
    elif kind == "value count":
        k = draw(st.sampled_from([0, 1, 2, 3, 4, 6, 7]))
        calls[i][1] = values[:k] if k < 5 else values + [draw(_junk) for _ in range(k - 5)]
        names = (f"takes 5 values, got {k}",)
    elif kind == "flags":
        flags[draw(st.integers(0, 1))] = draw(st.integers(0, 1) | st.none() | _names
                                              | st.floats() | st.lists(st.booleans(), max_size=1))
        names = ("pull and wait flags must be bools",)
    elif kind == "argument count":
        n = METHODS[method]
        extra = draw(st.lists(_junk, max_size=2).filter(lambda x: 1 + len(flags) + len(x) != n))
        request = [method, ([calls] + flags + extra)[: draw(st.integers(0, n + 2))]]
        if len(request[1]) == n:
            request[1] = request[1] + [None]
        return Case(f"{method}: {kind}", {"key": KEY, "request": request},
                    (f"request {method!r} takes a list of {n} arguments",), encoding)
    else:
        calls, names = _shard_list_defect(draw, kind, calls, f"a {method}'s shard list")
    return Case(f"{method}: {kind}", {"key": KEY, "request": [method, [calls] + flags],
                                      "profile": draw(st.booleans())}, names, encoding)


@st.composite
def replay_cases(draw, wid=PAST, seqs=st.integers(0, PAST_PUSHES - 1)):
    """A push of a seq the worker already had applied, with other gradients and any version."""
    calls = draw(_calls(wid=wid, seq=draw(seqs), versions=st.integers(0, 10 ** 9)))
    flags = [draw(st.booleans()), draw(st.booleans())]
    return Case("replayed seq", {"key": KEY, "request": ["push", [calls] + flags]}, None,
                draw(st.sampled_from(["msgpack", "pickle"])))


# ------------------------------------------------------------------ requests


def _skeletons():
    """Well-formed requests of every method, to put what is not data into."""
    g = [_grad(n, 0) for n in SPECS["dense"]]
    return [
        ["pid", []],
        ["call", ["pull", [["dense", []], ["s", []]]]],
        ["call", ["register", [["s", ["x"]]]]],
        ["call", ["load", [["s", [{n: np.zeros(shape, dtype)
                                   for n, (shape, dtype) in STATE_SPECS["s"].items()}]]]]],
        ["check", [[["dense", [PAST, 9, None, None, 0]], ["s", [PAST, 9, None, None, 0]]]]],
        ["push", [[["dense", [PAST, 9, g, 1.0, 0]], ["s", [PAST, 9, [np.zeros(())], 2, 1]]],
                  True, False]],
    ]


def _positions(x, path=()):
    """Every place in `x` (list items, dict values) as a path, `x` itself first."""
    yield path
    if type(x) in (list, tuple):
        for i, v in enumerate(x):
            yield from _positions(v, path + (i,))
    elif type(x) is dict:
        for k, v in x.items():
            yield from _positions(v, path + (k,))


SKELETONS = [(s, list(_positions(s))) for s in _skeletons()]


def _where(path):
    return "request" + "".join(f"[{p[:100]!r}]" if type(p) is str else f"[{p}]" for p in path)


def _put(request, path, value):
    if not path:
        return value
    request = copy.deepcopy(request)
    parent = request
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    return request


REQUEST_DEFECTS = ["not a pair", "unknown method", "argument list", "unknown shard method",
                   "call: argument count", "call: worker id", "call: load takes a dict",
                   "call: unknown shard", "call: shard name type", "call: shard twice",
                   "call: shard list type", "call: empty shard list", "call: entry not a pair",
                   "call: arguments type", "unknown key", "not data", "key not a str",
                   "nested too deep"]
#: shard methods a hostile caller would like to reach
DANGEROUS = ["__init__", "__class__", "__dict__", "__reduce__", "__getattribute__", "lock",
             "book", "fn", "params", "push", "wait_round", "_copy", "_shared_copy", "specs",
             "options", "name"]


@st.composite
def request_cases(draw, kind):
    """A request with its envelope, method, arguments, shard list or contents wrong: `kind`."""
    encoding = draw(st.sampled_from(["msgpack", "pickle"]))
    key = KEY
    if kind == "not a pair":
        request = draw(_not_lists | st.lists(_junk, max_size=4).filter(lambda x: len(x) != 2))
        names = ("a request must be a [method, arguments] pair",)
    elif kind == "unknown method":
        method = draw(st.text(max_size=10).filter(lambda m: m not in METHODS)
                      | st.sampled_from(["__init__", "serve", "serve_here", "_push", "call_",
                                         "PUSH", " push"])
                      | _ints64 | st.none() | st.floats() | st.booleans()
                      | st.lists(st.sampled_from(list(METHODS)), max_size=2))
        request, names = [method, draw(_junk)], ("unknown request method",)
    elif kind == "argument list":
        method = draw(st.sampled_from(list(METHODS)))
        args = draw(_not_lists | st.lists(_junk, max_size=4).filter(
            lambda x: len(x) != METHODS[method]))
        request, names = [method, args], (f"request {method!r} takes",)
    elif kind == "unknown shard method":
        method = draw(st.text(max_size=10).filter(lambda m: m not in SHARD_METHODS)
                      | st.sampled_from(DANGEROUS) | _ints64 | st.none()
                      | st.lists(st.sampled_from(list(SHARD_METHODS)), max_size=2))
        request = ["call", [method, [["dense", []]]]]
        names = ("unknown shard method",)
    elif kind == "call: argument count":
        method = draw(st.sampled_from(list(SHARD_METHODS)))
        n = SHARD_METHODS[method]
        args = draw(st.lists(st.just(PAST), max_size=3).filter(lambda a: len(a) != n))
        shards = draw(st.permutations(list(SPECS)))[:draw(st.integers(1, 2))]
        request = ["call", [method, [[s, list(args)] for s in shards]]]
        names = (f"{method}() takes {n} arguments",)
    elif kind == "call: worker id":
        method = draw(st.sampled_from(["register", "next_seq", "unregister"]))
        request = ["call", [method, [["s", [draw(BAD_WORKER_IDS)]]]]]
        names = ("worker id",)
    elif kind == "call: load takes a dict":
        state = {n: np.zeros(shape, dtype) for n, (shape, dtype) in STATE_SPECS["s"].items()}
        state[draw(st.sampled_from(list(state)))] = draw(
            st.floats() | st.lists(st.floats(), max_size=2) | _names | st.none()
            | st.dictionaries(_keys, st.floats(), max_size=1))
        request = ["call", ["load", [["s", [draw(st.just(state) | _not_lists.filter(
            lambda x: type(x) is not dict) | st.lists(_junk, max_size=2))]]]]]
        names = ("load() takes a dict",)
    elif kind.startswith("call: "):
        method = draw(st.sampled_from(["pull", "stats", "state", "averages"]))
        calls = [[s, []] for s in draw(st.permutations(list(SPECS)))[:draw(st.integers(1, 2))]]
        calls, names = _shard_list_defect(draw, kind[len("call: "):], calls,
                                          "a call's shard list")
        request = ["call", [method, calls]]
    elif kind in ("unknown key", "key not a str"):
        key = draw(st.text(max_size=30) if kind == "unknown key" else _ints64 | st.none()
                   | st.floats() | st.booleans() | st.lists(_names, max_size=2))
        request = draw(st.sampled_from([["pid", []], ["call", ["pull", [["dense", []]]]]]))
        names = ("no shards under that key",)
    elif kind == "not data":
        skeleton, paths = draw(st.sampled_from(SKELETONS))
        path = draw(st.sampled_from(paths))
        if draw(st.integers(0, 5)) == 0:       # a dict with a key that is not a str
            bad_key = draw(st.sampled_from([1, 2.5, None, True, (1, 2), b"k"]))
            request = _put(skeleton, path, {bad_key: 0})
            names = (f"{_where(path)}: a key of type",)
        else:
            request = _put(skeleton, path, draw(st.sampled_from(NOT_DATA)))
            names = (f"{_where(path)}: a",)
        encoding = "pickle"
    elif kind == "nested too deep":
        skeleton, paths = draw(st.sampled_from(SKELETONS))
        path = draw(st.sampled_from(paths))
        nest = draw(_scalars)
        for _ in range(17 - len(path) + draw(st.integers(0, 4))):
            nest = [nest] if draw(st.booleans()) else {"d": nest}
        request, names = _put(skeleton, path, nest), ("nested deeper than 16",)
    else:
        raise AssertionError(kind)
    return Case(kind, {"key": key, "request": request, "profile": draw(st.booleans())}, names,
                encoding)


# ------------------------------------------------------------------ load


LOAD_DEFECTS = ["missing entry", "entry not in this shard", "state dtype", "state shape",
                "counters", "record of applied seqs"]
#: records of applied seqs that are not one (as load() reads it, no record passes)
BAD_RECORDS = [b"\xff\xfe", b"", b"[]", b"null", b"{}", b'{"seen": 5}', b'{"seen": [[1, 2]]}',
               b'{"seen": [["a", "x", []]]}', b'{"seen": [["a", NaN, []]]}',
               b'{"seen": [["a", 0, 5]]}', b'{"seen": [[["a"], 0, []]]}',
               b'{"seen": [["a", 0, ["b"]]]}', b'{"seen": [["a", 0, [], 1]]}', b"\x00" * 9]


def _parses_as_record(b):
    try:
        data = json.loads(b.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and "seen" in data


@st.composite
def load_cases(draw, kind):
    """A load of one shard's state (as ``state()`` gives it) with one entry wrong: `kind`."""
    shard = draw(st.sampled_from(list(SPECS)))
    specs = STATE_SPECS[shard]
    state = {n: np.zeros(shape, dtype) for n, (shape, dtype) in specs.items()}
    state[f"{shard}/counters"] = np.array([PAST_PUSHES, PAST_PUSHES], np.int64)
    record = f"{shard}/applied_seqs"
    if draw(st.booleans()):         # a record that load() takes
        state[record] = np.frombuffer(json.dumps({"seen": [[PAST, PAST_PUSHES - 1, []]]}).encode(),
                                      np.uint8).copy()
    name = draw(st.sampled_from([n for n in specs if n != f"{shard}/counters"]))
    shape, dtype = specs.get(name, ((), ""))
    if kind == "missing entry":
        name = draw(st.sampled_from(list(specs)))
        del state[name]
        names = ("missing: ", name)
    elif kind == "entry not in this shard":
        name = draw(st.text(min_size=1, max_size=20).filter(lambda k: k not in specs
                                                              and k != record))
        state[name] = np.zeros(draw(st.sampled_from([(), (2,)])))
        names = ("not in this shard: ", name)
    elif kind == "state dtype":
        wrong = draw(st.sampled_from([d for d in ["float16", "float32", "float64", "int64", "bool",
                                                  "complex128", ">f8"] if d != dtype]))
        state[name] = np.zeros(shape, wrong)
        names = (f"{name}: ", "in the checkpoint")
    elif kind == "state shape":
        state[name] = np.zeros(draw(_other_shape(shape)), dtype)
        names = (f"{name}: ", "in the checkpoint")
    elif kind == "counters":
        state[f"{shard}/counters"] = draw(st.sampled_from([
            np.array([1, 1, 1]), np.array([1, 1], np.int32), np.array([1.0, 1.0]), np.array(3),
            np.zeros((2, 1), np.int64), np.array([1, 1], np.uint64)]))
        names = (f"{shard}/counters: expected 2 int64 values",)
    elif kind == "record of applied seqs":
        raw = draw(st.sampled_from(BAD_RECORDS)
                   | st.binary(max_size=16).filter(lambda b: not _parses_as_record(b)))
        state[record] = np.frombuffer(raw, np.uint8).copy()
        names = ("the record of applied pushes is malformed",)
    else:
        raise AssertionError(kind)
    return Case(f"load: {kind}", {"key": KEY, "request": ["call", ["load", [[shard, [state]]]]]},
                (f"shard {shard!r}: cannot load",) + names,
                draw(st.sampled_from(["msgpack", "pickle"])))


@st.composite
def unknown_field_cases(draw):
    fields = draw(st.dictionaries(st.from_regex(r"[a-z_]{1,12}", fullmatch=True).filter(
        lambda k: k not in RESERVED and not k.startswith("__")), _junk, min_size=1, max_size=3))
    message = dict(fields, key=KEY, request=["pid", []])
    return Case("unknown message field", message, tuple(repr(f) for f in fields))


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def client():
    from lasagne_accum.distributed.dask import local_cluster

    with local_cluster(1) as c:
        c.wait_for_workers(1, timeout=30)
        yield c


@pytest.fixture(scope="module")
def wire(client):
    w = Wire(dict(client.connection_args))
    yield w
    w.close()


@pytest.fixture(scope="module")
def target(client):
    server = _prepared(client)
    yield server
    server.close()


@pytest.fixture
def scratch(client):
    """A server of its own, for a request that may change (or break) it."""
    server = _prepared(client)
    yield server
    server.close()


# ------------------------------------------------------------------ the properties

# every batch holds one case of each category (hypothesis draws the rest), all sent at once
REQUEST_BATCH = st.tuples(*[request_cases(k) for k in REQUEST_DEFECTS] * 2)
PUSH_BATCH = st.tuples(*[push_cases(m, k) for m, k in PUSH_KINDS])
LOAD_BATCH = st.tuples(*[load_cases(k) for k in LOAD_DEFECTS] * 4)
REPLAY_BATCH = st.lists(replay_cases(), min_size=BATCH, max_size=BATCH)
FIELD_BATCH = st.lists(unknown_field_cases(), min_size=BATCH, max_size=BATCH)

REQUEST_EXAMPLES = 25        # x 36 requests
PUSH_EXAMPLES = 25           # x 40
LOAD_EXAMPLES = 10           # x 24
REPLAY_EXAMPLES = 6          # x 25
FIELD_EXAMPLES = 2           # x 25
CONCURRENT_EXAMPLES = 16     # x 25


def _property(server, wire, test, batches, examples):
    """Send `examples` batches drawn from `batches` (each request refused as it must be, the
    digest unchanged after each batch); the requests sent, and the count per category."""

    @settings(max_examples=examples, **SETTINGS)
    @given(batches)
    def attack(batch):
        _attack(server, wire, batch, test)

    attack()
    return SENT[test], SEEN[test]


def test_malformed_requests_are_refused_naming_the_field(target, wire):
    sent, seen = _property(target, wire, "requests", REQUEST_BATCH, REQUEST_EXAMPLES)
    assert sent >= REQUEST_EXAMPLES * 2 * len(REQUEST_DEFECTS)
    assert set(REQUEST_DEFECTS) <= set(seen), sorted(set(REQUEST_DEFECTS) - set(seen))


def test_malformed_pushes_and_checks_are_refused_naming_the_field(target, wire):
    sent, seen = _property(target, wire, "pushes", PUSH_BATCH, PUSH_EXAMPLES)
    kinds = {f"{m}: {k}" for m, k in PUSH_KINDS}
    assert sent >= PUSH_EXAMPLES * len(PUSH_KINDS)
    assert kinds <= set(seen), sorted(kinds - set(seen))


def test_malformed_loads_are_refused_naming_the_entry(target, wire):
    sent, seen = _property(target, wire, "loads", LOAD_BATCH, LOAD_EXAMPLES)
    kinds = {f"load: {k}" for k in LOAD_DEFECTS}
    assert sent >= LOAD_EXAMPLES * 4 * len(LOAD_DEFECTS)
    assert kinds <= set(seen), sorted(kinds - set(seen))


def test_replayed_seqs_are_duplicates_applied_nowhere(target, wire):
    """A repeated (worker, seq) is the library's retry: answered as a duplicate (not a
    refusal), whatever its gradients and version, and not applied again."""
    sent, seen = _property(target, wire, "replays", REPLAY_BATCH, REPLAY_EXAMPLES)
    assert sent >= REPLAY_EXAMPLES * BATCH and "replayed seq" in seen


def test_unknown_message_fields_are_refused_as_data(target, wire):
    sent, seen = _property(target, wire, "fields", FIELD_BATCH, FIELD_EXAMPLES)
    assert sent >= FIELD_EXAMPLES * BATCH and "unknown message field" in seen


def _honest_grads(seq):
    rng = np.random.default_rng([7, seq])
    return {n: np.asarray(rng.standard_normal(p.shape), p.dtype) for n, p in PARAMS.items()}


def test_an_honest_trainer_beside_hostile_requests_has_each_push_applied_once(client, wire):
    test = "concurrent"
    server = _prepared(client)
    try:
        version, _ = server.register(HONEST)
        start = server.state()
        results, errors = [], []
        acked = [0]
        stop, started = threading.Event(), threading.Event()

        def train():
            nonlocal version
            try:
                seq = 0
                while not stop.is_set() or seq < 20:
                    r = server.push(HONEST, seq, _honest_grads(seq), version=version, pull=True)
                    results.append(r)
                    version = r["version"]
                    seq += 1
                    acked[0] = seq
                    started.set()
            except BaseException as exc:      # raised in the test below
                errors.append(exc)
                started.set()

        trainer = threading.Thread(target=train, name="honest-trainer")
        trainer.start()
        try:
            assert started.wait(60)
            first = acked[0]
            honest_seqs = st.integers(0, 10 ** 6).map(lambda k: k % max(acked[0], 1))
            any_request = st.sampled_from(REQUEST_DEFECTS).flatmap(request_cases)
            any_push = st.sampled_from(PUSH_KINDS).flatmap(lambda mk: push_cases(*mk))
            any_load = st.sampled_from(LOAD_DEFECTS).flatmap(load_cases)
            hostile = st.tuples(*[any_request] * 6, *[any_push] * 10, *[any_load] * 3,
                                *[replay_cases()] * 2,
                                *[replay_cases(wid=HONEST, seqs=honest_seqs)] * 4)

            @settings(max_examples=CONCURRENT_EXAMPLES, **SETTINGS)
            @given(hostile)
            def attack(batch):
                assert not errors
                _attack(server, wire, batch, test, check_digest=False)

            attack()
            during = acked[0] - first
        finally:
            stop.set()
            trainer.join(120)
        assert not trainer.is_alive() and not errors, errors
        assert SENT[test] >= CONCURRENT_EXAMPLES * BATCH
        assert during > 0, "the trainer pushed nothing while the hostile requests flew"

        # each honest push applied once: in order, fresh, no staleness
        n = len(results)
        assert [(r["applied"], r["duplicate"], r["staleness"]) for r in results] == \
            [(True, False, 0)] * n
        assert [r["version"] for r in results] == \
            [(PAST_PUSHES + k,) * 2 for k in range(1, n + 1)]
        state = server.state()
        for s in SPECS:
            assert state[f"{s}/counters"].tolist() == [PAST_PUSHES + n] * 2
            assert json.loads(state[f"{s}/applied_seqs"].tobytes()) == {
                "seen": [[PAST, PAST_PUSHES - 1, []], [HONEST, n - 1, []]]}
        assert sorted(server.stats()["live_workers"]) == sorted([PAST, HONEST])
        # and the parameters and velocities are those of n momentum steps, no more
        p = {k: np.array(start[k]) for k in PARAMS}
        v = {k: np.array(start[f"{k}.momentum_velocity"]) for k in PARAMS}
        for seq in range(n):             # Lasagne's momentum: x = mu v + (p - lr g); v = x - p
            for k, g in _honest_grads(seq).items():
                x = np.asarray(MU * v[k] + (p[k] - LR * g), p[k].dtype)
                v[k], p[k] = x - p[k], x
        for k in PARAMS:                 # (a push missed or applied twice is ~0.1 off)
            tol = dict(rtol=1e-4, atol=1e-4) if PARAMS[k].dtype == np.float32 else \
                dict(rtol=1e-9, atol=1e-9)
            np.testing.assert_allclose(state[k], p[k], err_msg=k, **tol)
            np.testing.assert_allclose(state[f"{k}.momentum_velocity"], v[k], err_msg=k, **tol)
    finally:
        server.close()


# ------------------------------------------------------------------ known gaps

_G = {s: [_grad(n, 5) for n in SPECS[s]] for s in SPECS}


def _push(shard, wid=PAST, seq=99, weight=1.0, version=0):
    return {"key": KEY, "request": ["push", [[[shard, [wid, seq, _G[shard], weight, version]]],
                                             False, True]]}


def _load(shard, **entries):
    state = {n: np.zeros(shape, dtype) for n, (shape, dtype) in STATE_SPECS[shard].items()}
    state[f"{shard}/counters"] = np.array([PAST_PUSHES, PAST_PUSHES], np.int64)
    state.update({k.replace("__", "/"): v for k, v in entries.items()})
    return {"key": KEY, "request": ["call", ["load", [[shard, [state]]]]]}


def _record(raw):
    return np.frombuffer(raw, np.uint8).copy()


#: requests the shard once refused with a message that named no field (each "was:" says how)
REFUSED_UNNAMED = {
    "weight beyond float range": (
        Case("weight beyond float range", _push("s", weight=10 ** 400), ("weight",), "pickle"),
        "was: check_weight converts an int weight with float(), whose OverflowError is not "
        "caught: the refusal is 'int too large to convert to float', naming no field"),
    "version of 5000 digits": (
        Case("version of 5000 digits", _push("s", version=10 ** 5000), ("version",), "pickle"),
        "was: a version over 4300 digits passes check_version; the shard's refusal "
        "message formats it, and Python's int-to-str limit raises ValueError instead, naming "
        "no field"),
    "worker id of 5000 digits": (
        Case("worker id of 5000 digits", _push("s", wid=10 ** 5000), ("worker",), "pickle"),
        "was: an int worker id over 4300 digits passes check_worker_id; the not-registered "
        "message formats it, and Python's int-to-str limit raises ValueError instead"),
    "record declaring 2**52 bytes": (
        Case("record declaring 2**52 bytes",
             _load("s", s__applied_seqs=np.broadcast_to(np.zeros(1, np.uint8), (2 ** 52,))),
             ("applied",), "msgpack"),
        "was: Shard.load reads the record of applied seqs with tobytes() before any size "
        "check: an array that declares 2**52 elements (a broadcast: one byte on the wire) "
        "is MemoryError() with no message; one that declares less than the host's memory "
        "is allocated and filled"),
    "record with an infinite floor": (
        Case("record with an infinite floor",
             _load("s", s__applied_seqs=_record(b'{"seen": [["a", Infinity, []]]}')),
             ("record of applied pushes",), "msgpack"),
        "was: Rounds.parse_seen does int(Infinity), whose OverflowError it does not catch: "
        "the refusal is 'cannot convert float infinity to integer', naming no field"),
}

#: requests the shard once took though it should not (each "was:" says what happened)
ACCEPTED = {
    "complex weight": (
        Case("complex weight", _push("s", weight=np.array(complex(2, np.nan))), ("weight",)),
        "was: check_weight takes a 0-d complex array (is_number counts numpy complex numbers) "
        "and drops its imaginary part, NaN included: the push is applied"),
    "seq of 5000 digits": (
        Case("seq of 5000 digits", _push("s", seq=10 ** 5000), ("seq",), "pickle"),
        "was: check_seq has no upper bound: a seq over 4300 digits is applied, and then the "
        "shard's record of applied seqs cannot be written as JSON: state() and save() raise "
        "ValueError from then on"),
    "load of NaN parameters": (
        Case("load of NaN parameters", _load("s", s=np.array(np.nan)), ("'s'",)),
        "was: load() takes non-finite parameter values with check_finite on; pull() then "
        "answers NaN (a step that would write them is refused)"),
}


@pytest.mark.parametrize("label", list(REFUSED_UNNAMED))
def test_edge_requests_are_refused_and_change_nothing(target, wire, label):
    """The edges below are refused (as data), and nothing changes."""
    case, _ = REFUSED_UNNAMED[label]
    before = _digest(target)
    ((how, reply),) = wire.send(target, [case])
    assert how == "reply" and _refusals(reply), reply
    assert _digest(target) == before


@pytest.mark.parametrize("label", list(REFUSED_UNNAMED))
def test_edge_refusals_name_the_field(target, wire, label):
    case, _ = REFUSED_UNNAMED[label]
    problem = _problem(case, wire.send(target, [case])[0])
    assert problem is None, problem


@pytest.mark.parametrize("label", list(ACCEPTED))
def test_edge_requests_once_taken_are_refused(scratch, wire, label):
    case, _ = ACCEPTED[label]
    problem = _problem(case, wire.send(scratch, [case])[0])
    assert problem is None, problem
