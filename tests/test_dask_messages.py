"""The Dask backend's messages, without a cluster: what a request may hold, and its copies.

* A request is data (names, numbers, numeric arrays of the shards' shapes);
  :func:`check_request` refuses anything else with an error that names the
  field.
* A push is checked by the same functions on both sides of the wire: a
  malformed push is refused by the caller's server and, sent as it is, by
  the shard process, with the same message (NaN and inf by the shard
  process's push, which refuses them as data, like a stale version).
* A request's and a reply's arrays travel as Dask's out-of-band frames: on
  the sending side each array's frame is a view of the array, on the
  receiving side each decoded array is a view of a buffer the socket filled.
  The copies beyond the socket's are counted, and there are none.
"""

import asyncio
import importlib.util

import numpy as np
import pytest

from lasagne_accum import sgd
from lasagne_accum.distributed import ParameterServer, PushRejected, ServerOptions
from lasagne_accum.distributed.dask.actor import ShardActor
from lasagne_accum.distributed.dask.schema import BadRequest, check_request

needs_dask = pytest.mark.skipif(importlib.util.find_spec("distributed") is None,
                                reason="needs dask[distributed]")

SPECS = {"w": {"w": ((2,), "float64")}, "v": {"v": ((), "float32"), "u": ((1,), "float32")}}


@pytest.mark.parametrize("request_, message", [
    (["pid"], "pair"),
    (["exec", []], "unknown request method"),
    (["call", ["__init__", [["w", []]]]], "unknown shard method"),
    (["call", ["pull", [[["w"], []]]]], "must be a str"),
    (["call", ["pull", [["x", []]]]], "unknown shard 'x'"),
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
    # anything but data, wherever it is, is refused naming where it is
    (["call", ["register", [["w", [object()]]]]],
     r"request\[1\]\[1\]\[0\]\[1\]\[0\]: a object"),
    (["push", [[["w", ["a", 0, [np.array([b"x", b"y"])], 1.0, 0]]], True, True]],
     r"request\[1\]\[0\]\[0\]\[1\]\[2\]\[0\]: an array of dtype \|S1"),
    (["call", ["load", [["w", [{1: np.zeros(2)}]]]]], r"request\[1\]\[1\]\[0\]\[1\]\[0\]: a "
                                                      "key of type int"),
    (["pid", [{"deep": [[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]}]], "nested deeper"),
])
def test_check_request_refuses_what_this_library_never_sends(request_, message):
    with pytest.raises(BadRequest, match=message):
        check_request(request_, SPECS)


def test_check_request_passes_what_the_server_sends_as_dask_decodes_it():
    # Dask's msgpack gives tuples where the sender had lists
    pushed = ("push", ((("v", ("a", 0, (np.zeros((), np.float32), np.zeros(1, np.float32)),
                                3.0, 4)),), True, False))
    assert check_request(pushed, SPECS) == ("push", pushed[1])
    called = ["call", ["register", [["w", [5]], ["v", ["b"]]]]]
    assert check_request(called, SPECS) == ("call", called[1])


# ------------------------------------------------------------------ one push vocabulary

ONE_PUSH = dict(worker_id="a", seq=1, weight=2.0, version=(0, 0), grads={
    "w": np.ones((2, 3)), "b": np.ones(3, np.float32), "v": np.ones((), np.float32)})
ALL_SHARDS = {"wb": ["w", "b"], "v": ["v"]}


def _with(**changes):
    grads = dict(ONE_PUSH["grads"], **changes.pop("grads", {}))
    for name in changes.pop("drop", ()):
        del grads[name]
    return dict(ONE_PUSH, grads=grads, **changes)


#: a push with one thing wrong, and the word the refusal must name it by
MALFORMED = {
    "wrong dtype": (_with(grads={"b": np.ones(3)}), "'b' has dtype float64"),
    "integer gradient": (_with(grads={"w": np.ones((2, 3), np.int64)}), "dtype int64"),
    "wrong shape": (_with(grads={"w": np.ones((3, 2))}), "'w' has the wrong shape"),
    "array for a scalar": (_with(grads={"v": np.ones(1, np.float32)}), "'v' has the wrong"),
    "not an array": (_with(grads={"w": [[1.0] * 3] * 2}), "'w' is a list, not a numpy"),
    "NaN": (_with(grads={"w": np.full((2, 3), np.nan)}), "'w' has NaN or inf"),
    "inf": (_with(grads={"b": np.array([0, np.inf, 0], np.float32)}), "'b' has NaN or inf"),
    "missing array": (_with(drop=["b"]), "no gradient for 'b'"),
    "negative weight": (_with(weight=-1.0), "weight must be > 0"),
    "zero weight": (_with(weight=0), "weight must be > 0"),
    "NaN weight": (_with(weight=float("nan")), "weight must be finite"),
    "inf weight": (_with(weight=float("inf")), "weight must be finite"),
    "text weight": (_with(weight="2"), "weight must be a number"),
    "non-integer seq": (_with(seq=1.5), "seq must be an integer"),
    "negative seq": (_with(seq=-1), "seq must be >= 0"),
    "bool seq": (_with(seq=True), "seq must be an integer"),
    "non-integer version": (_with(version=(0.5, 0)), "version must be an integer"),
    "float worker id": (_with(worker_id=1.5), "worker id"),
    "bool worker id": (_with(worker_id=True), "worker id"),
    "unknown shard": (_with(shards=["nope"]), "unknown shard 'nope'"),
    "shard name not a str": (_with(shards=[3]), "shard name must be a str"),
}


@pytest.fixture(scope="module")
def caller(cheap_modes):
    params = {"w": np.zeros((2, 3)), "b": np.zeros(3, np.float32), "v": np.zeros((), np.float32)}
    return ParameterServer(params, sgd, dict(learning_rate=0.1), shards=ALL_SHARDS, mode="async")


def _on_the_wire(server, push):
    """The push request the caller would send for `push`, each shard's gradients in its order."""
    shards = push.get("shards") or list(server.plan)
    calls = [[s, [push["worker_id"], push["seq"],
                  [push["grads"].get(n) for n in server.plan.get(s, [])], push["weight"],
                  push["version"][server.shard_names.index(s)] if s in server.plan else 0]]
             for s in shards]
    return ["push", [calls, False, True]]


def _specs(server):
    return {s: {n: server.specs[n] for n in names} for s, names in server.plan.items()}


def _pushed_there(caller, push):
    """Send `push` as it is to a shard process like the caller's (its shard actor, its
    request checked first as it arrives): raises the refusal, or returns the results."""
    method, args = check_request(_on_the_wire(caller, push), _specs(caller))
    actor = ShardActor([(s, {n: np.zeros(*caller.specs[n]) for n in names}, sgd,
                         dict(learning_rate=0.1)) for s, names in caller.plan.items()],
                       ServerOptions(mode="async"))
    for shard in actor._shards.values():
        shard.register(push["worker_id"])
    ok, value = asyncio.run(actor.push_many(*args))
    if not ok:
        raise value
    return value


@pytest.mark.parametrize("case", list(MALFORMED))
def test_the_caller_and_the_shard_refuse_a_malformed_push_with_one_message(caller, case):
    push, names = MALFORMED[case]
    with pytest.raises(PushRejected) as here:
        caller.push(**push)
    with pytest.raises((BadRequest, PushRejected)) as there:
        _pushed_there(caller, push)
    assert str(here.value) == str(there.value)
    assert names in str(here.value)


def test_the_shard_reads_a_short_gradient_list_as_missing_ones_and_passes_a_good_push(caller):
    request = _on_the_wire(caller, ONE_PUSH)
    request[1][0][0][1][2] = request[1][0][0][1][2][:1]         # shard 'wb' without 'b'
    with pytest.raises(BadRequest, match=r"^shard 'wb': no gradient for 'b' \(2 parameters, 1 "):
        check_request(request, _specs(caller))
    method, args = check_request(_on_the_wire(caller, ONE_PUSH), _specs(caller))
    assert method == "push" and [name for name, _ in args[0]] == ["wb", "v"]
    nan = _on_the_wire(caller, _with(grads={"w": np.full((2, 3), np.nan)}))
    check_request(nan, _specs(caller))          # refused by the push (check_finite) or not


def _received(frames):
    """The frames as the receiving socket leaves them: each in a buffer of its own."""
    return [memoryview(bytearray(memoryview(f).cast("B"))) for f in frames]


def _copies(arrays, buffers):
    """How many of `arrays` share memory with none of `buffers` (each was copied once)."""
    views = [np.frombuffer(b, np.uint8) for b in buffers if memoryview(b).nbytes]
    return sum(not any(np.shares_memory(a, v) for v in views) for a in arrays)


@needs_dask
def test_a_push_and_its_reply_are_copied_only_by_the_socket():
    from distributed.protocol import ToPickle, dumps, loads

    from lasagne_accum.distributed.dask.actor import HANDLER
    from lasagne_accum.distributed.dask.transport import outgoing

    specs = {"w": {"a": ((512, 64), "float32"), "b": ((64,), "float64")}}
    grads = [np.random.default_rng(0).standard_normal((512, 64)).astype(np.float32),
             np.arange(64.0)]
    request = ["push", [[["w", ["t0", 3, grads, 2.0, 7]]], True, True]]
    frames = dumps({"op": HANDLER, "key": "k", "request": outgoing(request)})
    assert _copies(grads, frames) == 0                 # sent from where the gradients lie
    received = _received(frames)
    decoded = loads(received)["request"]
    method, args = check_request(decoded, specs)
    arrays = args[0][0][1][2]
    assert method == "push" and _copies(arrays, received) == 0     # views of the socket's
    for got, sent in zip(arrays, grads):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        np.testing.assert_array_equal(got, sent)

    params = {"a": grads[0] * 2, "b": grads[1] + 1}    # the shard's reply: pulled params
    frames = dumps(ToPickle(((True, [{"version": 8, "params": params}]), 0.0, 0.0)))
    assert _copies(params.values(), frames) == 0
    received = _received(frames)
    (ok, value), _, _ = loads(received)
    pulled = value[0]["params"]
    assert ok and _copies(pulled.values(), received) == 0
    assert all(a.flags.writeable for a in pulled.values())      # the caller's to change
    for name in params:
        np.testing.assert_array_equal(pulled[name], params[name])


@needs_dask
def test_a_request_carries_numpy_scalars_as_numbers_and_no_other_objects():
    from distributed.protocol import dumps, loads

    from lasagne_accum.distributed.dask.transport import outgoing

    request = outgoing(["call", ("register", [("w", [np.int64(5)])])])
    assert request == ["call", ["register", [["w", [5]]]]]
    assert type(request[1][1][0][1][0]) is int
    assert check_request(loads(_received(dumps(request))), SPECS)[0] == "call"
