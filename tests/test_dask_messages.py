"""The Dask backend's messages, without a cluster: what a request may hold, and its copies.

* A request is data (names, numbers, numeric arrays of the shards' shapes);
  :func:`check_request` refuses anything else with an error that names the
  field.
* A request's and a reply's arrays travel as Dask's out-of-band frames: on
  the sending side each array's frame is a view of the array, on the
  receiving side each decoded array is a view of a buffer the socket filled.
  The copies beyond the socket's are counted, and there are none.
"""

import importlib.util

import numpy as np
import pytest

from lasagne_accum.distributed.dask.schema import BadRequest, check_request

needs_dask = pytest.mark.skipif(importlib.util.find_spec("distributed") is None,
                                reason="needs dask[distributed]")

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
    frames = dumps(ToPickle((True, [{"version": 8, "params": params}], 0.0, 0.0)))
    assert _copies(params.values(), frames) == 0
    received = _received(frames)
    ok, value, _, _ = loads(received)
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
