"""The Dask backend's parts that need no cluster: the wire format, the request checks, the
transport interface's shared logic, and a sync round's merge.

* A message's arrays travel as raw buffers and come back as aligned views of
  the received body (no copy); a request decodes to plain data or is refused
  with :class:`BadRequest`, however it is malformed.
* :class:`Transport` does reuse, the one retry on a link closed while idle,
  timeouts and the mapping to ``ShardLostError`` for every transport: a
  transport of a few lines (a fake one here) gets all of it.
* The merge's compiled loops give the same bits as numpy and as the formula
  written out.
"""

import importlib.util
import itertools
import pickle

import numpy as np
import pytest

from lasagne_accum.distributed import ShardLostError
from lasagne_accum.distributed.checks import ServerOptions
from lasagne_accum.distributed.dask import wire
from lasagne_accum.distributed.dask.wire import BadRequest, check_request, decode_request, \
    encode_request
from lasagne_accum.distributed.merge import merge, merge_numpy


def _body(pieces):
    """The received body: one writeable buffer, as a direct link reads it."""
    return np.frombuffer(wire.join(pieces), np.uint8).copy()


# ------------------------------------------------------------------ messages


def test_request_round_trip_gives_views_of_the_body():
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    request = ("push", ([("w", ("a", np.int64(3), [w, w.T], 2.5, 7))], True, False))
    body = _body(encode_request(request))
    out = decode_request(body)
    assert out[0] == "push" and out[1][1:] == [True, False]
    (name, (wid, seq, arrays, weight, version)), = out[1][0]
    assert (name, wid, seq, weight, version) == ("w", "a", 3, 2.5, 7)
    assert type(seq) is int                                 # numpy ints become ints
    np.testing.assert_array_equal(arrays[0], w)
    np.testing.assert_array_equal(arrays[1], w.T)
    for a in arrays:
        assert np.shares_memory(a, body)                    # no copy on the way in
        assert a.flags.aligned and a.flags.writeable and a.flags.c_contiguous
        assert (a.__array_interface__["data"][0] - body.__array_interface__["data"][0]) \
            % wire.ALIGN == 0


def test_reply_round_trip_keeps_types_and_gives_views():
    params = {"w": np.linspace(0, 1, 1000), "b": np.float32(2)}
    reply = (False, ValueError("shard 'w': bad"), 0.25, 0.5)
    body = _body(wire.encode_reply((True, {"params": params, "staleness": {1: 3}}, 0.1, 0.0)))
    ok, value, shard_s, round_s = wire.decode_reply(body)
    assert ok and (shard_s, round_s) == (0.1, 0.0) and value["staleness"] == {1: 3}
    np.testing.assert_array_equal(value["params"]["w"], params["w"])
    assert np.shares_memory(value["params"]["w"], body)
    ok, exc, _, _ = wire.decode_reply(_body(wire.encode_reply(reply)))
    assert not ok and type(exc) is ValueError and str(exc) == "shard 'w': bad"


def test_a_request_cannot_carry_objects():
    with pytest.raises(TypeError, match="cannot carry a"):
        encode_request(("call", ("load", [("w", ({"x": object()},))])))


def _raw(head, arrays=()):
    return _body(wire._body(head, [memoryview(a).cast("B") for a in arrays]))


@pytest.mark.parametrize("body, message", [
    (b"", "shorter than its prefix"),
    (bytes(_raw(b"[]\n[1]"))[:-1], "declares a longer head"),
    (_raw(b"[]\n" + b"[" * 10 ** 5 + b"]" * 10 ** 5), "RecursionError"),
    (_raw(b"[]\n" + b" " * (wire.MAX_HEAD + 1)), "at most"),
    (_raw(b'[["<f4",[3]]]\n[{"__ndarray__":0}]', [np.zeros(2, np.float32)]),
     "3 float32 values in a buffer of 8 bytes"),
    (_raw(b'[["|O8",[1]]]\n[{"__ndarray__":0}]', [np.zeros(1)]), "only numeric"),
    (_raw(b'[["<f8",[1]]]\n[{"__ndarray__":1}]', [np.zeros(1)]), "was not sent"),
    (_raw(b'[]\n["call"'), "does not decode"),
    (pickle.dumps(("call", ("pull", [("w", ())]))), "buffers|shorter|longer|declares"),
])
def test_malformed_bodies_are_refused(body, message):
    with pytest.raises(BadRequest, match=message):
        decode_request(body)


SPECS = {"w": {"w": ((2,), "float64")}, "v": {"v": ((), "float32"), "u": ((1,), "float32")}}


@pytest.mark.parametrize("request_, message", [
    (["pid"], "pair"),
    (["exec", []], "unknown request method"),
    (["call", ["__init__", [["w", []]]]], "unknown shard method"),
    (["call", ["pull", [[["w"], []]]]], "must be a str"),
    (["call", ["pull", [["x", []]]]], "no shard 'x'"),
    (["call", ["pull", []]], "is empty"),
    (["call", ["pull", [["w", [1]]]]], "takes 0 arguments"),
    (["call", ["register", [["w", [[1]]]]]], "worker id"),
    (["call", ["load", [["w", [{"w": [1.0]}]]]]], "load"),
    (["check", [[["w", ["a", 0, None, None, 1.5]]]]], "version must be an int"),
    (["push", [[["w", ["a", 0, [np.zeros(3)], 1.0, 0]]], True, True]],
     r"float64\[2\] array, got a float64\[3\] array"),
    (["push", [[["v", ["a", 0, [np.zeros((), np.float32)], 1.0, 0]]], True, True]],
     "2 parameters"),
    (["push", [[["w", ["a", 0, [np.zeros(2)], float("nan"), 0]]], True, True]], "weight"),
    (["push", [[["w", ["a", 0, [np.zeros(2)], 1.0, 0]], ["w", ["a", 0, [np.zeros(2)], 1.0,
                                                                    0]]], True, True]],
     "twice"),
    (["push", [[["w", ["a", 0, [np.zeros(2)], 1.0, 0]]], 1, True]], "bools"),
])
def test_check_request_refuses_what_this_library_never_sends(request_, message):
    with pytest.raises(BadRequest, match=message):
        check_request(request_, SPECS)


def test_check_request_passes_what_the_server_sends():
    pushed = ["push", [[["v", ["a", 0, [np.zeros((), np.float32), np.zeros(1, np.float32)],
                                3.0, 4]]], True, False]]
    assert check_request(pushed, SPECS) == ("push", pushed[1])
    called = ["call", ["register", [["w", [5]], ["v", ["b"]]]]]
    assert check_request(called, SPECS) == ("call", called[1])


# ------------------------------------------------------------------ the transport interface

needs_dask = pytest.mark.skipif(importlib.util.find_spec("distributed") is None,
                                reason="the transport's errors include Dask's")


class _Server:
    hosts = ["tcp://127.0.0.1:1"]
    options = ServerOptions(mode="async", wait_timeout=1.0)

    @staticmethod
    def group_names(g):
        return "'w'"


class _Link:
    ids = itertools.count()

    def __init__(self):
        self.id, self.sent, self.closed = next(self.ids), [], False

    def abort(self):
        self.closed = True


class _Fake:
    """A transport of the interface's five methods, scripted: `reads` says what each read
    does (a reply value, or an exception to raise)."""

    def __new__(cls, reads, idle_closed=False):
        from lasagne_accum.distributed.dask.transport import Transport

        class Fake(Transport):
            name = "fake"

            def key(self, g):
                return ("fake", id(self), g)

            def open(self, g, timeout):
                link = _Link()
                self.opened.append(link)
                return link

            def write(self, link, g, body, timeout):
                link.sent.append(wire.join(body))

            def read(self, link, timeout):
                step = self.reads.pop(0)
                if isinstance(step, BaseException):
                    raise step
                return _body(wire.encode_reply(step))

            def idle_closed(self, link):
                return self.closed_when_idle

        fake = Fake(_Server())
        fake.reads, fake.opened, fake.closed_when_idle = list(reads), [], idle_closed
        return fake


@needs_dask
def test_transport_retries_once_on_a_reused_link_closed_under_it():
    from lasagne_accum.distributed.dask.transport import _links

    t = _Fake([(True, "first", 0.0, 0.0), EOFError("closed"), (True, "again", 0.001, 0.0)])
    try:
        assert t.call({0: ("pid", ())}, "pid") == {0: "first"}
        assert t.call({0: ("pid", ())}, "pid") == {0: "again"}   # sent once more, new link
        assert len(t.opened) == 2 and t.opened[0].closed
        assert t.opened[0].sent == t.opened[1].sent[:1] * 2       # the same request
        assert _links.timing["shard"] == 0.001
    finally:
        _links.drop(t.keys())


@needs_dask
def test_transport_does_not_retry_on_a_new_link_and_maps_losses():
    from lasagne_accum.distributed.dask.actor import Gone
    from lasagne_accum.distributed.dask.transport import _links

    t = _Fake([EOFError("reset"), TimeoutError("slow"), (False, Gone("released"), 0.0, 0.0),
               (False, KeyError("other"), 0.0, 0.0)])
    try:
        out = t.call({0: ("pid", ())}, "pull")
        assert isinstance(out[0], ShardLostError) and "is lost (EOFError: reset)" in str(out[0])
        out = t.call({0: ("pid", ())}, "pull")
        assert isinstance(out[0], ShardLostError) and "did not answer within" in str(out[0])
        out = t.call({0: ("pid", ())}, "pull")
        assert isinstance(out[0], ShardLostError) and "'w' on tcp://127.0.0.1:1" in str(out[0])
        assert type(t.call({0: ("pid", ())}, "pull")[0]) is KeyError    # the shard's own error
        assert len(t.opened) == 4                  # each loss dropped its link
    finally:
        _links.drop(t.keys())


@needs_dask
def test_transport_replaces_a_link_found_closed_while_idle():
    from lasagne_accum.distributed.dask.transport import _links

    t = _Fake([(True, 1, 0.0, 0.0), (True, 2, 0.0, 0.0)], idle_closed=True)
    try:
        assert t.call({0: ("pid", ())}, "pid") == {0: 1}
        assert t.call({0: ("pid", ())}, "pid") == {0: 2}
        assert len(t.opened) == 2 and t.opened[0].closed
    finally:
        _links.drop(t.keys())


# ------------------------------------------------------------------ the merge


def _written_out(arrays, weights, total, dtype, mean):
    """The round's merge as the formula reads (float64, in order, rounded once)."""
    acc = np.zeros(np.shape(arrays[0]), np.float64)
    for g, w in zip(arrays, weights):
        acc = acc + (g.astype(np.float64) * w if mean else g.astype(np.float64))
    return (acc / total if mean else acc).astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_merge_gives_the_formulas_bits(dtype, k):
    rng = np.random.default_rng(k)
    scale = 3 if dtype == "float16" else 6
    arrays = [(rng.standard_normal((64, 33)) * 10.0 ** rng.integers(-scale, scale, (64, 33)))
              .astype(dtype) for _ in range(k)]
    arrays[0][0, :3] = [-0.0, 0.0, 1e-30]
    weights = [float(rng.integers(1, 500)) + 0.25 * i for i in range(k)]
    total = sum(weights)
    scratch = {}                                  # kept between calls, as a shard does
    for mean in (True, False, True):
        expected = _written_out(arrays, weights, total, dtype, mean)
        for got in (merge(arrays, weights, total, dtype, mean),
                    merge(arrays, weights, total, dtype, mean, scratch=scratch),
                    merge_numpy(arrays, weights, total, dtype, mean)):
            assert got.dtype == np.dtype(dtype) and got.shape == (64, 33)
            assert got.tobytes() == expected.tobytes(), mean


@needs_dask
def test_a_call_from_an_event_loop_thread_keeps_its_timing():
    # a thread that runs an event loop hands the call to a helper thread: the timing the
    # call measured there is this thread's timing after it
    import asyncio

    from lasagne_accum.distributed.dask.transport import _links, helper_thread

    t = _Fake([(True, "done", 0.002, 0.003)])
    t.needs_event_loop = True

    async def in_a_loop():
        _links.timing = dict(serialise=0.0, shard=0.0, round=0.0)
        return t.call({0: ("pid", ())}, "pid"), dict(_links.timing)

    try:
        out, timing = asyncio.run(in_a_loop())
        assert out == {0: "done"}
        assert timing["shard"] == 0.002 and timing["round"] == 0.003
    finally:
        helper_thread().submit(_links.drop, t.keys()).result()
