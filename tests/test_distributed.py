"""Tests of lasagne_accum.distributed: the parameter server, its modes and backends.

Independent references:

* exactly once: the serial numpy application of the same SGD pushes
  (integer-valued gradients, so any order gives the same bits; and random
  ones replayed in the server's recorded arrival order);
* sync mode: one step of the plain rule compiled single-process on the
  concatenation of every worker's batches of the round (float64, 1e-10);
* checkpoints: an uninterrupted run of the same training;
* a refused non-finite step: the steps before it, computed single-process,
  or the state read before the refused push.

The Dask tests share one loopback ``LocalCluster`` (2 processes) per module,
started by a fixture that closes it, and are skipped when ``distributed`` is
not installed.
"""

import importlib.util
import threading
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from lasagne_accum import adam, momentum, sgd
from lasagne_accum.distributed import (
    Checkpoint,
    DaskOptions,
    NonFiniteStepError,
    ParameterServer,
    PushRejected,
    RoundFailedError,
    RoundTimeoutError,
    ServerClosedError,
    ServerOptions,
    StalePushError,
    UnknownWorkerError,
    Worker,
    train,
)

HAVE_DASK = importlib.util.find_spec("distributed") is not None
needs_dask = pytest.mark.skipif(not HAVE_DASK, reason="needs dask[distributed]")
TOL = dict(rtol=1e-10, atol=1e-13)
N_IN, N_HID, N_OUT = 4, 5, 3


# ------------------------------------------------------------------ model, data


def build_model(seed=0):
    """A float64 tanh MLP, squared error averaged over examples (module level: picklable)."""
    rng = np.random.RandomState(seed)
    W1 = pytensor.shared(0.5 * rng.randn(N_IN, N_HID), name="W1")
    b1 = pytensor.shared(0.1 * rng.randn(N_HID), name="b1")
    W2 = pytensor.shared(0.5 * rng.randn(N_HID, N_OUT), name="W2")
    b2 = pytensor.shared(np.zeros(N_OUT), name="b2")
    x, y = pt.matrix("x"), pt.matrix("y")
    pred = pt.tanh(x @ W1 + b1) @ W2 + b2
    loss = pt.mean(pt.sum((pred - y) ** 2, axis=1))
    return [x, y], loss, [W1, b1, W2, b2]


def batches_for(seed, sizes):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(n, N_IN)), rng.normal(size=(n, N_OUT))) for n in sizes]


def reference_sync(rule, rule_kwargs, worker_batches, accumulate, schedule=None):
    """Single process: one plain rule step per round on the concatenated batches."""
    inputs, loss, params = build_model()
    lr = pytensor.shared(np.float64(0.0), name="lr")
    kwargs = dict(rule_kwargs)
    if schedule is not None:
        kwargs["learning_rate"] = lr
    step = pytensor.function(inputs, loss, updates=rule(loss, params, **kwargs))
    rounds = max(-(-len(b) // accumulate) for b in worker_batches)
    for r in range(rounds):
        part = [b for wb in worker_batches for b in wb[r * accumulate:(r + 1) * accumulate]]
        if schedule is not None:
            lr.set_value(np.float64(schedule(r)))
        step(np.concatenate([p[0] for p in part]), np.concatenate([p[1] for p in part]))
    return {p.name: p.get_value() for p in params}


def state_of(server):
    return {n: np.array(a) for n, a in server.state().items()}


def assert_same_state(a, b):
    assert list(a) == list(b)
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)


# ------------------------------------------------------------------ exactly once


def _hammer(server, wid, grads, record):
    for seq, g in enumerate(grads):
        version, _ = server.pull()
        result = server.push(wid, seq, g, version=version)
        record.append(result)


def test_async_exactly_once_under_threads_integer_grads():
    """8 threads x 25 pushes, 8 times on one server: every push applied exactly once."""
    K, M, REPEATS = 8, 25, 8
    p0 = {"w": np.zeros(6), "v": np.zeros((2, 3))}
    server = ParameterServer(p0, sgd, dict(learning_rate=1.0), mode="async")
    rng = np.random.default_rng(0)
    expected = {n: a.copy() for n, a in p0.items()}
    for rep in range(REPEATS):
        grads = {k: [{n: rng.integers(-5, 6, size=a.shape).astype(float) for n, a in p0.items()}
                     for _ in range(M)] for k in range(K)}
        ids = [f"r{rep}w{k}" for k in range(K)]
        for wid in ids:
            server.register(wid)
        records = {k: [] for k in range(K)}
        threads = [threading.Thread(target=_hammer, args=(server, ids[k], grads[k], records[k]))
                   for k in range(K)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for k in range(K):
            assert len(records[k]) == M
            assert all(r["applied"] and not r["duplicate"] for r in records[k])
            for g in grads[k]:
                for n in expected:
                    expected[n] -= g[n]
        stats = server.stats()
        assert stats["applied"] == (rep + 1) * K * M
        assert stats["version"] == ((rep + 1) * K * M,) * 2
        assert stats["duplicates"] == 0 and stats["rejected"] == 0
        _, params = server.pull()
        for n in expected:
            np.testing.assert_array_equal(params[n], expected[n])


def test_async_arrival_order_replay_float_grads():
    """Random float gradients: the parameters equal the serial replay in arrival order."""
    K, M, lr = 8, 20, 0.1
    rng = np.random.default_rng(1)
    p0 = {"w": rng.normal(size=5), "v": rng.normal(size=(3, 2))}
    server = ParameterServer(p0, sgd, dict(learning_rate=lr), mode="async", keep_log=True)
    grads = {f"w{k}": [{n: rng.normal(size=a.shape) for n, a in p0.items()} for _ in range(M)]
             for k in range(K)}
    for wid in grads:
        server.register(wid)
    threads = [threading.Thread(target=_hammer, args=(server, wid, grads[wid], []))
               for wid in grads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = server.stats()
    assert stats["applied"] == K * M
    _, params = server.pull()
    for name in p0:
        log = stats["shards"][name]["log"]
        assert sorted((w, s) for w, s, _ in log) == sorted(
            (w, s) for w in grads for s in range(M))          # each push once
        value = p0[name].copy()
        for wid, seq, _ in log:
            value = value - lr * grads[wid][seq][name]
        np.testing.assert_allclose(params[name], value, rtol=1e-15, atol=1e-15)
    hist = stats["staleness"]
    assert sum(hist.values()) == 2 * K * M                   # two shards


def test_retried_push_is_applied_once_async():
    server = ParameterServer({"w": np.zeros(3)}, sgd, dict(learning_rate=1.0), mode="async")
    version, _ = server.register("a")
    g = {"w": np.array([1.0, 2.0, 3.0])}
    first = server.push("a", 7, g, version=version)
    again = server.push("a", 7, g, version=version)
    assert first["applied"] and not first["duplicate"]
    assert again["duplicate"] and not again["applied"]
    assert server.pull()[1]["w"].tolist() == [-1.0, -2.0, -3.0]
    server.push("a", 3, g, version=version)                  # an older, unseen seq is fine
    assert server.push("a", 3, g, version=version)["duplicate"]
    stats = server.stats()
    assert stats["applied"] == 2 and stats["duplicates"] == 2


def test_retried_push_is_applied_once_sync():
    server = ParameterServer({"w": np.zeros(2)}, sgd, dict(learning_rate=1.0), mode="sync")
    for w in "ab":
        server.register(w)
    ga, gb = {"w": np.array([1.0, 0.0])}, {"w": np.array([0.0, 3.0])}
    pending = server.push("a", 0, ga, weight=1, version=(0,), wait=False)
    retry = server.push("a", 0, ga, weight=1, version=(0,), wait=False)
    assert not pending["applied"] and retry["duplicate"]
    server.push("b", 0, gb, weight=2, version=(0,))
    late_retry = server.push("a", 0, ga, weight=1, version=(0,))   # after the round closed
    assert late_retry["duplicate"]
    np.testing.assert_allclose(server.pull()[1]["w"], -(np.array([1.0, 6.0]) / 3))
    assert server.stats()["applied"] == 2 and server.stats()["version"] == (1,)


# ------------------------------------------------------------------ sync = large batch


@pytest.mark.parametrize("accumulate", [1, 3])
def test_sync_equals_single_process_large_batch(accumulate):
    """3 workers, batches of different sizes, a split Adam: the large-batch Adam, exactly."""
    sizes = [[5, 3, 4, 6, 2, 5], [7, 2, 2, 5, 4, 1], [4, 4, 6, 3, 3, 2]]
    worker_batches = [batches_for(10 + k, s) for k, s in enumerate(sizes)]
    result = train(build_model, worker_batches, adam, dict(learning_rate=0.05), mode="sync",
                   accumulate=accumulate, compile_mode="CVM")
    expected = reference_sync(adam, dict(learning_rate=0.05), worker_batches, accumulate)
    rounds = 6 // accumulate
    assert result.version == (rounds,) * 4
    assert result.stats["applied"] == 3 * rounds
    for name, value in expected.items():
        np.testing.assert_allclose(result.params[name], value, **TOL, err_msg=name)
    state = result.server.state()
    for name in expected:                                   # one step counter per shard
        assert state[f"{name}/adam.t"] == rounds


def test_sync_schedule_and_uneven_workers():
    """A learning-rate schedule(step), and a worker that runs out of batches early."""
    worker_batches = [batches_for(20, [4, 4, 4, 4]), batches_for(21, [3, 5])]
    schedule = lambda step: 0.1 / (1 + step)                 # noqa: E731
    result = train(build_model, worker_batches, momentum, dict(learning_rate=schedule),
                   mode="sync", compile_mode="CVM")
    expected = reference_sync(momentum, dict(learning_rate=None), worker_batches, 1,
                              schedule=schedule)
    for name, value in expected.items():
        np.testing.assert_allclose(result.params[name], value, **TOL, err_msg=name)


def test_sync_merge_sum():
    server = ParameterServer({"w": np.zeros(2)}, sgd, dict(learning_rate=0.5), mode="sync",
                             merge="sum")
    for w in "ab":
        server.register(w)
    server.push("a", 0, {"w": np.array([1.0, 2.0])}, weight=10, version=(0,), wait=False)
    server.push("b", 0, {"w": np.array([3.0, 4.0])}, weight=1, version=(0,))
    np.testing.assert_array_equal(server.pull()[1]["w"], [-2.0, -3.0])


# ------------------------------------------------------------------ dead workers


def _three_worker_server(on_timeout):
    server = ParameterServer({"w": np.zeros(2)}, sgd, dict(learning_rate=1.0), mode="sync",
                             round_timeout=1.0, on_timeout=on_timeout)
    for w in ("a", "b", "dead"):
        server.register(w)
    return server


def _push_in_threads(server, pushes):
    """Push each ``(worker, seq, grads, weight, version)`` from a thread of its own.

    Returns ``{worker: its reply, or the exception it raised}`` and the seconds
    until every thread was joined.
    """
    out, threads = {}, []
    for wid, seq, grads, weight, version in pushes:
        def run(wid=wid, seq=seq, grads=grads, weight=weight, version=version):
            try:
                out[wid] = server.push(wid, seq, grads, weight=weight, version=version)
            except Exception as exc:
                out[wid] = exc
        threads.append(threading.Thread(target=run))
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return out, time.monotonic() - start


def test_sync_dead_worker_round_closes_after_timeout():
    server = _three_worker_server("close")
    ga, gb = np.array([1.0, 0.0]), np.array([0.0, 4.0])
    out, elapsed = _push_in_threads(server, [("a", 0, {"w": ga}, 1.0, (0,)),
                                             ("b", 0, {"w": gb}, 3.0, (0,))])
    assert 0.95 < elapsed < 10
    info = out["a"]["shards"]["w"]
    assert info["timed_out"] and info["dropped"] == ["dead"] and info["workers"] == ["a", "b"]
    np.testing.assert_allclose(server.pull()[1]["w"], -(ga * 1 + gb * 3) / 4)
    # the server keeps serving: the next round closes with the live workers at once
    out, elapsed = _push_in_threads(server, [("a", 1, {"w": ga}, 1.0, (1,)),
                                             ("b", 1, {"w": gb}, 1.0, (1,))])
    assert elapsed < 0.9 and not out["a"]["shards"]["w"]["timed_out"]
    assert server.stats()["version"] == (2,)
    with pytest.raises(UnknownWorkerError, match="dropped after missing the timeout"):
        server.push("dead", 0, {"w": ga}, version=(0,))
    server.register("dead")                                 # and may come back
    assert "dead" in server.stats()["live_workers"]


def test_sync_dead_worker_round_fails_with_clear_error():
    server = _three_worker_server("fail")
    before = state_of(server)
    ga, gb = np.array([1.0, 0.0]), np.array([0.0, 4.0])
    out, _ = _push_in_threads(server, [("a", 0, {"w": ga}, 1.0, (0,)),
                                       ("b", 0, {"w": gb}, 1.0, (0,))])
    for w in "ab":
        assert isinstance(out[w], RoundTimeoutError)
        assert "'dead'" in str(out[w]) and "timed out" in str(out[w])
    assert_same_state(state_of(server), before)                # nothing applied
    assert server.stats()["live_workers"] == ["a", "b"]
    # still serving: the same pushes (same ids: they were not applied) go through
    out, elapsed = _push_in_threads(server, [("a", 0, {"w": ga}, 1.0, (0,)),
                                             ("b", 0, {"w": gb}, 1.0, (0,))])
    assert elapsed < 0.9 and out["a"]["applied"]
    np.testing.assert_allclose(server.pull()[1]["w"], -(ga + gb) / 2)


def _failing_batches(batches, after):
    for i, b in enumerate(batches):
        if i == after:
            raise RuntimeError("simulated crash")
        yield b


def test_train_worker_crash_mid_training():
    """A worker that raises unregisters; the others finish; train() names it."""
    good = batches_for(30, [4] * 5)
    server = ParameterServer({p.name: p.get_value() for p in build_model()[2]}, sgd,
                             dict(learning_rate=0.1), mode="sync", compile_mode="CVM")
    with pytest.raises(RuntimeError, match="worker 'worker1' failed.*simulated crash"):
        train(build_model, [good, _failing_batches(batches_for(31, [4] * 5), 2)], None,
              server=server, compile_mode="CVM")
    stats = server.stats()
    assert stats["version"] == (5,) * 4                     # worker0 trained to the end
    assert stats["applied"] == 2 * 2 + 3                    # worker1 pushed twice, then died
    assert stats["live_workers"] == []


# ------------------------------------------------------------------ async options


def test_async_staleness_scale():
    server = ParameterServer({"w": np.zeros(1)}, sgd, dict(learning_rate=1.0), mode="async",
                             staleness_scale=True)
    version, _ = server.register("a")
    server.register("b")
    results = [server.push(w, 0, {"w": np.array([g])}, version=version)
               for w, g in (("a", 1.0), ("b", 4.0))]
    server.register("c")
    results.append(server.push("c", 0, {"w": np.array([8.0])}, version=version))
    assert [r["staleness"] for r in results] == [0, 1, 2]
    assert server.pull()[1]["w"][0] == -(1.0 + 4.0 + 8.0 / 2)
    assert server.stats()["staleness"] == {0: 1, 1: 1, 2: 1}


def test_async_learning_rate_schedule_and_shared_rate():
    server = ParameterServer({"w": np.zeros(1)}, sgd,
                             dict(learning_rate=lambda step: 1.0 / (1 + step)), mode="async")
    v, _ = server.register("a")
    for seq in range(4):
        v = server.push("a", seq, {"w": np.ones(1)}, version=v)["version"]
    assert server.pull()[1]["w"][0] == pytest.approx(-(1 + 1 / 2 + 1 / 3 + 1 / 4), abs=1e-15)

    lr = pytensor.shared(np.float64(1.0), name="lr")
    server = ParameterServer({"w": np.zeros(1)}, sgd, dict(learning_rate=lr), mode="async",
                             staleness_scale=True)
    v0, _ = server.register("a")
    server.push("a", 0, {"w": np.ones(1)}, version=v0)
    lr.set_value(np.float64(0.5))
    server.push("a", 1, {"w": np.ones(1)}, version=v0)       # stale by 1
    server.push("a", 2, {"w": np.ones(1)}, version=v0)       # stale by 2: halved
    assert server.pull()[1]["w"][0] == -(1.0 + 0.5 + 0.25)


def test_partial_push_to_named_shards_async():
    server = ParameterServer({"w": np.zeros(2), "b": np.zeros(1)}, sgd,
                             dict(learning_rate=1.0), mode="async")
    v, _ = server.register("a")
    r = server.push("a", 0, {"b": np.ones(1)}, version=v, shards=["b"], pull=True)
    assert r["version"] == (None, 1) and set(r["params"]) == {"b"}
    version, params = server.pull(shards=["b"])
    assert version == (None, 1) and list(params) == ["b"] and params["b"].tolist() == [-1.0]


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpoint_resume_same_result(tmp_path, mode):
    """Epoch 1, save, a fresh server loads it, epoch 2 == two epochs without a stop."""
    schedule = lambda step: 0.05 * 0.9 ** step               # noqa: E731
    epoch = [batches_for(40, [4, 6, 5, 3]), batches_for(41, [5, 5, 2, 4])]
    if mode == "async":
        epoch = epoch[:1]                                    # one worker: a determined order
    kw = dict(mode=mode, compile_mode="CVM")
    straight = train(build_model, [b + b for b in epoch], adam,
                     dict(learning_rate=schedule), **kw)
    path = tmp_path / "server.npz"
    first = train(build_model, epoch, adam, dict(learning_rate=schedule),
                  checkpoint=Checkpoint(to=path), **kw)
    names = np.load(path).files
    assert "W1" in names and "W1.adam_m" in names and "W1/adam.t" in names \
        and "W1/counters" in names
    resumed = train(build_model, epoch, adam, dict(learning_rate=schedule),
                    checkpoint=Checkpoint(resume_from=path), **kw)
    assert first.version == tuple(v // 2 for v in straight.version)
    assert resumed.version == straight.version
    assert resumed.stats["applied"] == straight.stats["applied"]
    for name, value in straight.params.items():
        np.testing.assert_allclose(resumed.params[name], value, rtol=1e-13, atol=1e-15)
    a, b = state_of(resumed.server), state_of(straight.server)
    assert list(a) == list(b)
    for name in a:                                           # rule state and counters too
        np.testing.assert_allclose(a[name], b[name], rtol=1e-13, atol=1e-15, err_msg=name)


def test_checkpoint_mismatch_loads_nothing(tmp_path):
    a = ParameterServer({"w": np.zeros(2)}, adam, mode="async")
    path = tmp_path / "a.npz"
    a.save(path)
    b = ParameterServer({"w": np.ones(3)}, adam, mode="async")
    before = state_of(b)
    with pytest.raises(ValueError, match="nothing was loaded"):
        b.load(path)
    assert_same_state(state_of(b), before)


# ------------------------------------------------------------------ bad input


@pytest.fixture
def served():
    server = ParameterServer({"w": np.zeros((2, 3)), "b": np.zeros(3, dtype="float32")}, adam,
                             dict(learning_rate=0.1), mode="async")
    version, _ = server.register("good")
    server.push("good", 0, {"w": np.ones((2, 3)), "b": np.ones(3, "float32")}, version=version)
    return server


GOOD = {"w": np.ones((2, 3)), "b": np.ones(3, "float32")}
BAD_PUSHES = {
    "wrong shape": (dict(grads={"w": np.ones((3, 2)), "b": GOOD["b"]}), "shape"),
    "wrong dtype": (dict(grads={"w": GOOD["w"], "b": np.ones(3)}), "dtype float64"),
    "unknown param": (dict(grads=dict(GOOD, extra=np.ones(1))), "unknown parameter name"),
    "missing param": (dict(grads={"w": GOOD["w"]}), "no gradient for 'b'"),
    "not an array": (dict(grads={"w": [[1.0] * 3] * 2, "b": GOOD["b"]}), "not a numpy array"),
    "nan": (dict(grads={"w": np.full((2, 3), np.nan), "b": GOOD["b"]}), "NaN"),
    "unknown shard": (dict(shards=["nope"]), "unknown shard 'nope'"),
    "unregistered worker": (dict(worker="stranger"), "not registered"),
    "bad weight": (dict(weight=0.0), "weight must be"),
    "bad seq": (dict(seq=-1), "seq must be"),
    "bad version": (dict(version=(1,)), "version must be the tuple"),
    "future version": (dict(version=(5, 5)), "does not exist"),
}


@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_bad_push_rejected_state_untouched(served, case):
    kwargs, message = BAD_PUSHES[case]
    before, stats = state_of(served), served.stats()
    call = dict(worker="good", seq=1, grads=GOOD, weight=1.0, version=(1, 1))
    call.update(kwargs)
    with pytest.raises(PushRejected, match=message):
        served.push(call.pop("worker"), call.pop("seq"), call.pop("grads"), **call)
    assert_same_state(state_of(served), before)
    after = served.stats()
    assert (after["applied"], after["version"]) == (stats["applied"], stats["version"])


def test_bad_pull_and_errors_are_specific(served):
    with pytest.raises(PushRejected, match="unknown shard"):
        served.pull(shards=["nope"])
    with pytest.raises(UnknownWorkerError):
        served.push("stranger", 0, GOOD, version=(1, 1))


def test_a_closed_server_refuses_every_call(served):
    _, before = served.pull()
    with served:                        # a with-block closes it at the end
        pass
    assert served.closed
    calls = {
        "pull": lambda: served.pull(),
        "push": lambda: served.push("good", 1, GOOD, version=(1, 1)),
        "register": lambda: served.register("other"),
        "next_seq": lambda: served.next_seq("good"),
        "unregister": lambda: served.unregister("good"),
        "stats": lambda: served.stats(),
        "state": lambda: served.state(),
    }
    for name, call in calls.items():
        with pytest.raises(ServerClosedError, match="ParameterServer was closed"):
            call()
            pytest.fail(f"{name} did not raise")
    served.close()                      # closing twice is allowed
    for s in served.shards:             # nothing reached the shards
        assert s.stats()["applied"] == 1 and s.stats()["rejected"] == 0
        for n in s.params:
            np.testing.assert_array_equal(s.params[n].get_value(), before[n])


def test_sync_rejects_stale_and_partial_pushes():
    server = ParameterServer({"w": np.zeros(2), "b": np.zeros(1)}, sgd,
                             dict(learning_rate=1.0), mode="sync")
    server.register("a")
    g = {"w": np.ones(2), "b": np.ones(1)}
    server.push("a", 0, g, version=(0, 0))
    with pytest.raises(StalePushError, match="pull"):
        server.push("a", 1, g, version=(0, 0))
    with pytest.raises(PushRejected, match="every shard"):
        server.push("a", 1, {"b": np.ones(1)}, version=(1, 1), shards=["b"])
    # a push valid for shard 'w' but not 'b' leaves no pending gradient anywhere
    with pytest.raises(PushRejected, match="shape"):
        server.push("a", 1, {"w": np.ones(2), "b": np.ones(2)}, version=(1, 1))
    assert all(s["pending"] == 0 for s in server.stats()["shards"].values())


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="hogwild"), "mode must be"),
    (dict(merge="max"), "merge must be"),
    (dict(mode="sync", staleness_scale=True), "staleness_scale"),
    (dict(round_timeout=-1), "round_timeout"),
    (dict(on_timeout="retry"), "on_timeout"),
    (dict(shards=[["w"], ["w"]]), "in shards"),
    (dict(shards=[["w"]]), "in no shard"),
    (dict(shards=[["w", "b", "zz"]]), "unknown parameter 'zz'"),
])
def test_bad_server_options(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ParameterServer({"w": np.zeros(2), "b": np.zeros(1)}, sgd, dict(learning_rate=1.0),
                        **kwargs)


def test_worker_model_must_match_server():
    server = ParameterServer({"W1": np.zeros((2, 2))}, sgd, dict(learning_rate=1.0))
    with pytest.raises(ValueError, match="do not match"):
        Worker(server, "w", build_model)


# ------------------------------------------------------------------ exactly once, rejected pushes


def _two_shards(mode, **kw):
    return ParameterServer({"w": np.zeros(2), "b": np.zeros(1)}, sgd, dict(learning_rate=1.0),
                           mode=mode, **kw)


def test_rejected_push_is_atomic_async():
    """Shard 'w' would take version 0, shard 'b' refuses 99: nothing is applied anywhere."""
    server = _two_shards("async")
    server.register("a")
    before = state_of(server)
    with pytest.raises(PushRejected, match="version 99 does not exist"):
        server.push("a", 0, {"w": np.ones(2), "b": np.ones(1)}, version=(0, 99))
    assert_same_state(state_of(server), before)
    stats = server.stats()
    assert stats["received"] == 0 and stats["version"] == (0, 0)
    # the same (worker, seq) was not recorded: it goes through now
    assert server.push("a", 0, {"w": np.ones(2), "b": np.ones(1)}, version=(0, 0))["applied"]
    assert server.pull()[1]["w"].tolist() == [-1.0, -1.0]


def test_rejected_push_is_atomic_sync_and_the_round_does_not_hang():
    server = _two_shards("sync", wait_timeout=5.0)
    for w in "ab":
        server.register(w)
    with pytest.raises(PushRejected, match="version 3 does not exist"):
        server.push("a", 0, {"w": np.ones(2), "b": np.ones(1)}, version=(0, 3), wait=False)
    assert all(s["pending"] == 0 for s in server.stats()["shards"].values())
    out, elapsed = _push_ones_in_threads(server, [("a", 0), ("b", 0)])
    assert elapsed < 5 and out["a"]["applied"] and out["b"]["applied"]
    assert server.stats()["version"] == (1, 1)


def _push_ones_in_threads(server, pushes):
    """Each ``(worker, seq)`` pushes ones to shards w and b from version ``(seq, seq)``."""
    return _push_in_threads(server, [(wid, seq, {"w": np.ones(2), "b": np.ones(1)}, 1.0,
                                      (seq, seq)) for wid, seq in pushes])


def _break_applies(server, broken, shards=None):
    """The compiled step of each shard (of those indexed by `shards`) raises while
    ``broken["on"]`` (an injected fault)."""
    for i, shard in enumerate(server.shards):
        if shards is not None and i not in shards:
            continue
        def step(*args, _fn=shard.fn._fn):
            if broken["on"]:
                raise FloatingPointError("injected: the step overflowed")
            return _fn(*args)
        shard.fn._fn = step


def _halving(step):
    return 0.5 * 0.5 ** step


def test_failing_apply_fails_the_sync_round_and_the_server_keeps_serving():
    """Round 1's step raises: the round fails for its pushers, state (the schedule's step
    counters included) as before, and the same pushes apply once the step works again."""
    broken = {"on": False}
    server = ParameterServer({"w": np.zeros(2), "b": np.zeros(1)}, sgd,
                             dict(learning_rate=_halving), mode="sync", wait_timeout=10.0)
    _break_applies(server, broken)
    for w in "ab":
        server.register(w)
    _push_ones_in_threads(server, [("a", 0), ("b", 0)])
    before = state_of(server)
    assert before["w/schedule_step"] == 1 and before["b/schedule_step"] == 1
    broken["on"] = True
    out, elapsed = _push_ones_in_threads(server, [("a", 1), ("b", 1)])
    assert elapsed < 10
    for w in "ab":
        assert isinstance(out[w], RoundFailedError), out[w]
        assert "could not be applied" in str(out[w]) and "overflowed" in str(out[w])
    assert_same_state(state_of(server), before)
    stats = server.stats()
    assert stats["failed_rounds"] == 1 and stats["version"] == (1, 1)
    assert all(s["pending"] == 0 for s in stats["shards"].values())
    assert server.pull()[0] == (1, 1) and server.register("c")[0] == (1, 1)
    server.unregister("c")
    broken["on"] = False
    out, _ = _push_ones_in_threads(server, [("a", 1), ("b", 1)])      # the same ids, applied now
    assert out["a"]["applied"] and out["b"]["applied"]
    # rates 0.5 then 0.25 (step 1: the failed round did not advance the schedule)
    np.testing.assert_array_equal(server.pull()[1]["w"], [-0.75, -0.75])
    assert int(server.state()["w/schedule_step"]) == 2


def test_failing_apply_async_applies_nothing_and_the_push_can_be_retried():
    broken = {"on": True}
    server = ParameterServer({"w": np.zeros(2), "b": np.zeros(1)}, sgd,
                             dict(learning_rate=_halving), mode="async")
    _break_applies(server, broken)
    server.register("a")
    before = state_of(server)
    with pytest.raises(RoundFailedError, match="overflowed"):
        server.push("a", 0, {"w": np.ones(2), "b": np.ones(1)}, version=(0, 0))
    assert_same_state(state_of(server), before)
    assert server.stats()["version"] == (0, 0)
    broken["on"] = False
    assert server.push("a", 0, {"w": np.ones(2), "b": np.ones(1)}, version=(0, 0))["applied"]
    np.testing.assert_array_equal(server.pull()[1]["w"], [-0.5, -0.5])


@pytest.mark.parametrize("check_finite", [True, False])
def test_an_async_push_failing_on_its_second_shard_is_completed_by_its_resend(check_finite):
    """Shard b's step raises. With check_finite, every shard computes its step before any is
    taken: neither shard applied the push. Without, steps are written as they are computed:
    shard w has applied it (it came first), b has not. Either way the resend of the same
    (worker, seq) completes it, once on each shard."""
    broken = {"on": True}
    server = ParameterServer({"w": np.zeros(2), "b": np.zeros(1)}, sgd,
                             dict(learning_rate=_halving), mode="async",
                             check_finite=check_finite)
    assert [s.name for s in server.shards] == ["w", "b"]
    _break_applies(server, broken, shards=[1])
    server.register("a")
    grads = {"w": np.ones(2), "b": np.ones(1)}
    with pytest.raises(RoundFailedError, match="'b'.*not applied here.*overflowed"):
        server.push("a", 0, grads, version=(0, 0))
    state = server.state()
    w_took = 0 if check_finite else 1
    assert server.stats()["version"] == (w_took, 0)
    assert int(state["w/schedule_step"]) == w_took and int(state["b/schedule_step"]) == 0
    np.testing.assert_array_equal(state["w"], [-0.5 * w_took] * 2)
    np.testing.assert_array_equal(state["b"], [0.0])
    broken["on"] = False
    server.push("a", 0, grads, version=(0, 0))
    server.push("a", 0, grads, version=(0, 0))                 # a third send changes nothing
    state = server.state()
    assert server.stats()["version"] == (1, 1)
    np.testing.assert_array_equal(state["w"], [-0.5, -0.5])
    np.testing.assert_array_equal(state["b"], [-0.5])


def test_a_schedule_and_the_staleness_scale_multiply():
    """Async, staleness_scale: step k's rate is schedule(k) / max(1, staleness)."""
    server = ParameterServer({"w": np.zeros(1)}, sgd, dict(learning_rate=_halving),
                             mode="async", staleness_scale=True)
    v0, _ = server.register("a")
    for seq in range(3):                                       # stale by 0, 1, 2
        server.push("a", seq, {"w": np.ones(1)}, version=v0)
    expected = -(0.5 + 0.25 / 1 + 0.125 / 2)
    assert server.pull()[1]["w"][0] == pytest.approx(expected, abs=1e-15)


def test_a_schedule_is_compiled_into_each_shard_with_its_own_step_counter():
    """Async steps 0..3 on shard w, 0..1 on shard b: each shard's rate is the schedule at its
    own step (numpy reference), and the counter is checkpointed state."""
    schedule = lambda step: 0.5 * 0.9 ** step                # noqa: E731
    server = ParameterServer({"w": np.zeros(1), "b": np.zeros(1)}, sgd,
                             dict(learning_rate=schedule), mode="async")
    server.register("a")
    for seq in range(4):
        shards = None if seq < 2 else ["w"]
        grads = {"w": np.ones(1)} if shards else {"w": np.ones(1), "b": np.ones(1)}
        server.push("a", seq, grads, version=server.pull()[0] if not shards else
                    server.pull(shards=["w"])[0], shards=shards)
    params = server.pull()[1]
    assert params["w"][0] == pytest.approx(-sum(0.5 * 0.9 ** k for k in range(4)), abs=1e-15)
    assert params["b"][0] == pytest.approx(-sum(0.5 * 0.9 ** k for k in range(2)), abs=1e-15)
    state = server.state()
    assert int(state["w/schedule_step"]) == 4 and int(state["b/schedule_step"]) == 2


def test_a_schedule_that_branches_in_python_is_refused_naming_the_rule():
    with pytest.raises(TypeError, match=r"sgd\(\).*schedule.*pt.switch rather than if"):
        ParameterServer({"w": np.zeros(1)}, sgd,
                        dict(learning_rate=lambda step: 0.1 if step < 10 else 0.01))


def test_rejected_counts_every_rejected_push_once():
    server = _two_shards("async")
    server.register("a")
    good = {"w": np.ones(2), "b": np.ones(1)}
    bad_calls = [
        dict(worker_id="a", seq=0, grads={"w": np.ones(3), "b": np.ones(1)}, version=(0, 0)),
        dict(worker_id="a", seq=0, grads=good, version=(0,)),
        dict(worker_id="a", seq=-1, grads=good, version=(0, 0)),
        dict(worker_id="nobody", seq=0, grads=good, version=(0, 0)),
        dict(worker_id="a", seq=0, grads=good, version=(0, 7)),
    ]
    for call in bad_calls:
        with pytest.raises(PushRejected):
            server.push(**call)
    assert server.stats()["rejected"] == len(bad_calls)


def test_two_simultaneous_identical_pushes_exactly_one_applied():
    server = _two_shards("async")
    server.register("a")
    for seq in range(30):
        barrier = threading.Barrier(2)
        out = []

        def run(seq=seq):
            barrier.wait()
            out.append(server.push("a", seq, {"w": np.ones(2), "b": np.ones(1)},
                                   version=(0, 0)))

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted((r["applied"], r["duplicate"]) for r in out) == [(False, True),
                                                                       (True, False)]
    assert server.stats()["version"] == (30, 30)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_retry_after_load_is_not_applied_twice(tmp_path, mode):
    """Issue 11 item 17: the highest applied seq per worker travels with the checkpoint."""
    server = _two_shards(mode)
    server.register("a")
    g = {"w": np.array([1.0, 2.0]), "b": np.array([3.0])}
    server.push("a", 0, g, version=(0, 0))
    path = tmp_path / "ps.npz"
    server.save(path)
    restarted = _two_shards(mode)
    restarted.register("a")
    restarted.load(path)
    assert restarted.next_seq("a") == 1
    retry = restarted.push("a", 0, g, version=(1, 1))
    assert retry["duplicate"] and not retry["applied"]
    assert restarted.pull()[1]["w"].tolist() == [-1.0, -2.0]
    assert restarted.push("a", 1, g, version=(1, 1))["applied"]
    assert restarted.pull()[1]["w"].tolist() == [-2.0, -4.0]


def test_blocking_calls_time_out_with_a_clear_error():
    """Issue 15 item 3: a sync push waiting for a worker that never pushes, without round_timeout."""
    from lasagne_accum.distributed import ServerTimeoutError

    server = ParameterServer({"w": np.zeros(2)}, sgd, dict(learning_rate=1.0), mode="sync",
                             wait_timeout=0.5)
    for w in ("a", "silent"):
        server.register(w)
    start = time.monotonic()
    with pytest.raises(ServerTimeoutError, match=r"waited 0.5 s for sync round 0.*'silent'"):
        server.push("a", 0, {"w": np.ones(2)}, version=(0,))
    assert 0.45 < time.monotonic() - start < 5
    with pytest.raises(ValueError, match=r"wait_timeout must be > 0, got .* \(a number of seconds\)"):
        ParameterServer({"w": np.zeros(2)}, sgd, dict(learning_rate=1.0), wait_timeout=0)


def _slow(batches, delay):
    for b in batches:
        time.sleep(delay)
        yield b


def test_checkpoint_every_saves_while_training_local(tmp_path):
    path = tmp_path / "ps.npz"
    data = [_slow(batches_for(80, [4] * 12), 0.05)]
    result = train(build_model, data, sgd, dict(learning_rate=0.1), mode="async",
                   compile_mode="CVM", checkpoint=Checkpoint(to=path, every=0.1))
    assert result.checkpoints >= 2                     # ~0.6 s of training, a save per 0.1 s
    fresh = ParameterServer({p.name: p.get_value() for p in build_model()[2]}, sgd,
                            dict(learning_rate=0.1), mode="async")
    fresh.load(path)                                   # the final save: the end state
    assert fresh.pull()[0] == result.version == (12,) * 4
    with pytest.raises(ValueError, match=r"Checkpoint\(every=...\) needs to="):
        train(build_model, data, sgd, dict(learning_rate=0.1), checkpoint=dict(every=1.0))


@pytest.mark.parametrize("old, new", [
    ("address", r"dask=DaskOptions\(address=...\)"),
    ("client", r"dask=DaskOptions\(client=...\)"),
    ("security", r"dask=DaskOptions\(security=...\)"),
    ("n_dask_workers", r"dask=DaskOptions\(n_dask_workers=...\)"),
    ("shard_processes", r"dask=DaskOptions\(shard_processes=...\)"),
    ("resume_from", r"checkpoint=Checkpoint\(resume_from=...\)"),
    ("checkpoint_to", r"checkpoint=Checkpoint\(to=...\)"),
    ("checkpoint_every", r"checkpoint=Checkpoint\(every=...\)"),
    ("snapshot_interval", r"checkpoint=Checkpoint\(snapshot_every=...\)"),
    ("model_kwargs", r"build_model=functools.partial\(build_model, \*\*model_kwargs\)"),
])
def test_train_refuses_the_old_keywords_naming_the_new_spelling(old, new):
    with pytest.raises(TypeError, match=rf"train\(\): {old}= is now {new}"):
        train(build_model, [batches_for(1, [2])], sgd, dict(learning_rate=0.1), **{old: None})


def test_train_grouped_options_are_checked():
    data = [batches_for(1, [2])]
    with pytest.raises(ValueError, match="shard_processes must be an integer >= 0, got -1"):
        train(build_model, data, sgd, dict(learning_rate=0.1), dask=DaskOptions(
            shard_processes=-1))
    with pytest.raises(TypeError, match="dask= takes a DaskOptions .* got str"):
        train(build_model, data, sgd, dict(learning_rate=0.1), dask="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="every"):
        Checkpoint(to="x.npz", every=0)


def test_train_help_fits_one_screen():
    import math
    import pydoc

    text = pydoc.plain(pydoc.render_doc(train)).splitlines()
    # one screen: at most 40 rows on an 80-column terminal, long lines wrapped
    assert sum(max(1, math.ceil(len(line) / 80)) for line in text) <= 40


# ------------------------------------------------------------------ accumulation traffic


def test_local_accumulation_cuts_traffic():
    data = [batches_for(50, [4] * 8)]
    per_example = {}
    for n in (1, 4):
        r = train(build_model, data, sgd, dict(learning_rate=0.1), mode="async", accumulate=n,
                  compile_mode="CVM")
        assert r.pushes == 8 // n and r.examples == 32
        per_example[n] = r.bytes_per_example
    assert per_example[1] == pytest.approx(4 * per_example[4])


# ------------------------------------------------------------------ Dask backend


@pytest.fixture(scope="module")
def dask_client():
    if not HAVE_DASK:
        pytest.skip("needs dask[distributed]")
    from lasagne_accum.distributed.dask import local_cluster

    with local_cluster(2) as client:
        yield client


def _push_integer_grads(server, wid, seeds):
    """A Dask task: push integer gradients directly to the shard actors."""
    out = []
    for seq, seed in enumerate(seeds):
        version, _ = server.pull()
        g = {n: np.random.default_rng(seed).integers(-5, 6, size=s).astype(float)
             for n, (s, _) in server.specs.items()}
        r = server.push(wid, seq, g, version=version)
        if seq == 0:                                         # a retry of the same id
            assert server.push(wid, seq, g, version=version)["duplicate"]
        out.append(r["applied"])
    return out


@needs_dask
def test_dask_cluster_is_loopback_only(dask_client):
    info = dask_client.scheduler_info()
    assert info["address"].startswith("tcp://127.0.0.1:")
    assert all(a.startswith("tcp://127.0.0.1:") for a in info["workers"])
    assert len(info["workers"]) == 2


@needs_dask
def test_dask_async_exactly_once(dask_client):
    from lasagne_accum.distributed.dask import DaskParameterServer

    K, M = 4, 15
    p0 = {"w": np.zeros(4), "v": np.zeros((2, 2))}
    server = DaskParameterServer(dask_client, p0, sgd, dict(learning_rate=1.0), mode="async",
                                 compile_mode="CVM")
    try:
        assert set(server.placement.values()) == set(dask_client.scheduler_info()["workers"])
        seeds = {f"w{k}": [1000 * k + m for m in range(M)] for k in range(K)}
        for wid in seeds:
            server.register(wid)
        futures = [dask_client.submit(_push_integer_grads, server, wid, s, pure=False)
                   for wid, s in seeds.items()]
        assert all(all(f.result()) for f in futures)
        stats = server.stats()
        assert stats["applied"] == K * M and stats["duplicates"] == K
        expected = {n: -sum(np.random.default_rng(s).integers(-5, 6, size=a.shape)
                            for ss in seeds.values() for s in ss) for n, a in p0.items()}
        _, params = server.pull()
        for n in p0:
            np.testing.assert_array_equal(params[n], expected[n])
        # bad input crosses the process boundary as the same exception, state untouched
        before = state_of(server)
        with pytest.raises(PushRejected, match="shape"):
            server.push("w0", 99, {"w": np.ones(5), "v": np.ones((2, 2))}, version=(0, 0))
        with pytest.raises(UnknownWorkerError):
            server.push("nobody", 0, {"w": np.ones(4), "v": np.ones((2, 2))}, version=(0, 0))
        assert_same_state(state_of(server), before)
    finally:
        server.close()


@needs_dask
def test_dask_sync_equals_local_and_large_batch(dask_client, tmp_path):
    sizes = [[5, 3, 4, 6], [7, 2, 2, 5]]
    worker_batches = [batches_for(60 + k, s) for k, s in enumerate(sizes)]
    kw = dict(mode="sync", accumulate=2, compile_mode="CVM")
    path = tmp_path / "dask.npz"
    on_dask = train(build_model, worker_batches, adam, dict(learning_rate=0.05), backend="dask",
                    dask=DaskOptions(client=dask_client), checkpoint=Checkpoint(to=path), **kw)
    local = train(build_model, worker_batches, adam, dict(learning_rate=0.05), **kw)
    expected = reference_sync(adam, dict(learning_rate=0.05), worker_batches, 2)
    assert on_dask.backend == "dask" and on_dask.version == (2,) * 4
    for name, value in expected.items():
        np.testing.assert_allclose(on_dask.params[name], value, **TOL, err_msg=name)
        np.testing.assert_allclose(local.params[name], value, **TOL, err_msg=name)
    # a Dask checkpoint restores into a local server (same names)
    server = ParameterServer({p.name: p.get_value() for p in build_model()[2]}, adam,
                             dict(learning_rate=0.05), mode="sync")
    server.load(path)
    for name, value in on_dask.params.items():
        np.testing.assert_array_equal(server.pull()[1][name], value)


@needs_dask
def test_dask_async_training_with_staleness(dask_client):
    worker_batches = [batches_for(70 + k, [4] * 6) for k in range(2)]
    r = train(build_model, worker_batches, sgd, dict(learning_rate=0.05), mode="async",
              backend="dask", dask=DaskOptions(client=dask_client), staleness_scale=True, compile_mode="CVM")
    assert r.stats["applied"] == 12 and r.version == (12,) * 4
    assert sum(r.stats["staleness"].values()) == 12 * 4
    assert all(np.all(np.isfinite(v)) for v in r.params.values())


@needs_dask
def test_dask_simultaneous_identical_pushes_exactly_one_applied(dask_client):
    """Shards in two processes: two identical pushes racing; exactly one reports applied."""
    from lasagne_accum.distributed.dask import DaskParameterServer

    server = DaskParameterServer(dask_client, {"w": np.zeros(2), "b": np.zeros(1)}, sgd,
                                 dict(learning_rate=1.0), mode="async", compile_mode="CVM")
    try:
        assert len(set(server.placement.values())) == 2
        server.register("a")
        g = {"w": np.ones(2), "b": np.ones(1)}
        for seq in range(15):
            barrier = threading.Barrier(2)
            out = []

            def run(seq=seq):
                barrier.wait()
                out.append(server.push("a", seq, g, version=(0, 0)))

            threads = [threading.Thread(target=run) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            assert sorted((r["applied"], r["duplicate"]) for r in out) == [(False, True),
                                                                           (True, False)]
        stats = server.stats()
        assert stats["version"] == (15, 15) and stats["rejected"] == 0
        with pytest.raises(PushRejected, match="version 99"):        # atomic across processes
            server.push("a", 99, g, version=(0, 99))
        assert server.stats()["version"] == (15, 15) and server.stats()["rejected"] == 1
    finally:
        server.close()


# ------------------------------------------------------------------ averages on the server


def _averaged_reference(batches, lr, ma_kwargs, ema_kwargs):
    """Single-process SGD with ModelAverage and EMA over the same steps (one per batch)."""
    import lasagne_accum as la

    inputs, loss, params = build_model()
    upd = la.sgd(loss, params, lr)
    ma = la.ModelAverage(params, updates=upd, **ma_kwargs)
    ema = la.ExponentialMovingAverage(params, updates=upd, **ema_kwargs)
    f = pytensor.function(inputs, loss, updates=la.merge_updates(upd, ma.updates, ema.updates))
    for batch in batches:
        f(*batch)
    names = [p.name for p in params]
    return dict(zip(names, ma.averages())), dict(zip(names, ema.averages()))


@pytest.mark.parametrize("backend, mode", [("local", "sync"), ("local", "async"),
                                           ("dask", "sync")])
def test_server_keeps_the_averages_of_a_single_process_run(backend, mode, tmp_path):
    """One worker, one batch per push: every push is an optimizer step of every shard, so
    the server's averages equal ModelAverage / EMA of a single-process run (1e-12)."""
    if backend == "dask":
        pytest.importorskip("distributed")
    batches = batches_for(5, [4, 3, 4, 2, 4, 4, 1, 3, 2])
    ma_kwargs = dict(average_window_rate=0.5, min_average_window=2, max_average_window=4)
    ema_kwargs = dict(decay=0.8)
    result = train(build_model, [batches], sgd, dict(learning_rate=0.1), mode=mode,
                   backend=backend, model_average=ma_kwargs, ema=ema_kwargs,
                   checkpoint=Checkpoint(to=tmp_path / "server.npz"), compile_mode="CVM")
    want_ma, want_ema = _averaged_reference(batches, 0.1, ma_kwargs, ema_kwargs)
    assert set(result.averaged_params) == set(want_ma) == set(result.params)
    for name in want_ma:
        np.testing.assert_allclose(result.averaged_params[name], want_ma[name], rtol=1e-12,
                                   atol=1e-14, err_msg=name)
        np.testing.assert_allclose(result.ema_params[name], want_ema[name], rtol=1e-12,
                                   atol=1e-14, err_msg=name)
    saved = np.load(tmp_path / "server.npz").files   # the averages are in the checkpoint
    assert any("model_average" in n for n in saved) and any(n.endswith(".ema") for n in saved)


def test_server_average_arguments_are_checked():
    with pytest.raises(TypeError, match="model_average must be a dict"):
        train(build_model, [batches_for(1, [2])], sgd, dict(learning_rate=0.1), model_average=0.5)
    with pytest.raises(TypeError, match="ema: updates are the server's to set"):
        train(build_model, [batches_for(1, [2])], sgd, dict(learning_rate=0.1),
              ema=dict(decay=0.9, updates={}))


def build_model_with_batch_norm(seed=0):
    """build_model with a batch-norm layer on the hidden units (module level: picklable)."""
    import lasagne_accum as la

    inputs, _, params = build_model(seed)
    x, y = inputs
    W1, b1, W2, b2 = params
    bn = [pytensor.shared(np.full(N_HID, v), name=n) for v, n in
          ((1.0, "g"), (0.0, "b"), (0.0, "rm"), (1.0, "rv"))]
    pred = pt.tanh(la.batch_norm(x @ W1 + b1, *bn)) @ W2 + b2
    return [x, y], pt.mean(pt.sum((pred - y) ** 2, axis=1)), [W1, b1, W2, b2]


def test_a_model_with_batch_norm_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="batch_norm\\(\\) layers, which the parameter server"):
        train(build_model_with_batch_norm, [batches_for(1, [4, 4])], adam,
              dict(learning_rate=0.05), mode="sync", compile_mode="CVM")


# ------------------------------------------------------------------ non-finite steps


def _nan_at_step_1(step):
    """A learning-rate schedule with a bug: NaN at step 1, 0.1 elsewhere (module level)."""
    return pt.switch(pt.eq(step, 1), np.nan, 0.1)


def _server(backend, request, params, rule, rule_kwargs, one_process=False, **options):
    """A ParameterServer, or a DaskParameterServer on the module's cluster (its shards in
    both processes, or in one with `one_process`)."""
    if backend == "local":
        return ParameterServer(params, rule, rule_kwargs, **options)
    from lasagne_accum.distributed.dask import DaskParameterServer

    client = request.getfixturevalue("dask_client")
    workers = sorted(client.scheduler_info()["workers"])[:1] if one_process else None
    return DaskParameterServer(client, params, rule, rule_kwargs, workers=workers,
                               compile_mode="CVM", **options)


def _train_on(server, backend, request, worker_batches, mode):
    dask = DaskOptions(client=request.getfixturevalue("dask_client")) \
        if backend == "dask" else None
    return train(build_model, worker_batches, sgd, dict(learning_rate=_nan_at_step_1),
                 mode=mode, backend=backend, server=server, compile_mode="CVM", dask=dask)


BACKENDS = [pytest.param("local"), pytest.param("dask", marks=needs_dask)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_schedule_giving_nan_stops_train_naming_the_parameter_and_the_step(backend, mode,
                                                                            request):
    """The schedule is NaN at step 1: train() raises naming a parameter and step 1, and every
    shard keeps its state after step 0: one SGD step at rate 0.1 on the first batches,
    computed single-process (sync: two trainers; async: one, so step 0 is its first push).
    pull() and stats() answer with that state; the server keeps serving."""
    n = 2 if mode == "sync" else 1
    worker_batches = [batches_for(80 + k, [4, 3]) for k in range(n)]
    initial = {p.name: p.get_value() for p in build_model()[2]}
    server = _server(backend, request, initial, sgd, dict(learning_rate=_nan_at_step_1),
                     mode=mode)
    try:
        with pytest.raises(RuntimeError, match=r"NonFiniteStepError: shard '\w+': .*would "
                           r"write NaN into parameter '(W1|b1|W2|b2)' at step 1") as info:
            _train_on(server, backend, request, worker_batches, mode)
        if backend == "local":
            assert isinstance(info.value.__cause__, NonFiniteStepError)
        expected = reference_sync(sgd, dict(learning_rate=0.1),
                                  [wb[:1] for wb in worker_batches], 1)
        version, params = server.pull()
        assert version == (1,) * 4
        for name, value in expected.items():
            np.testing.assert_allclose(params[name], value, **TOL, err_msg=name)
        stats = server.stats()
        assert stats["version"] == (1,) * 4 and stats["applied"] == n
        assert stats["failed_rounds"] == (1 if mode == "sync" else 0)
        state = server.state()
        assert all(int(state[f"{s}/schedule_step"]) == 1 for s in server.shard_names)
        assert all(np.isfinite(a).all() for a in state.values())
    finally:
        server.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_check_finite_a_nan_step_is_written_as_before(backend, request):
    """check_finite=False (documented: no checks, steps written as computed): train() returns
    and the NaN of step 1 is in every parameter."""
    worker_batches = [batches_for(80 + k, [4, 3]) for k in range(2)]
    initial = {p.name: p.get_value() for p in build_model()[2]}
    server = _server(backend, request, initial, sgd, dict(learning_rate=_nan_at_step_1),
                     mode="sync", check_finite=False)
    try:
        result = _train_on(server, backend, request, worker_batches, "sync")
        assert result.version == (2,) * 4
        assert all(np.isnan(v).all() for v in result.params.values())
    finally:
        server.close()


def _overflowing(backend, request, mode, **options):
    """Two float32 shards; pushing OVERFLOW takes b past the largest float32 (-inf), w not."""
    return _server(backend, request, {"w": np.zeros(2, np.float32),
                                      "b": np.full(1, -3e38, np.float32)},
                   sgd, dict(learning_rate=1.0), mode=mode, wait_timeout=30.0, **options)


OVERFLOW = {"w": np.ones(2, np.float32), "b": np.full(1, 3e38, np.float32)}
FINITE = {"w": np.ones(2, np.float32), "b": np.ones(1, np.float32)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_step_non_finite_on_one_shard_is_taken_on_none(backend, mode, request):
    """Shard b's step would write -inf, shard w's is finite: neither is taken (Dask: both
    shards in one process); every pusher gets the error naming b and step 0; the state equals
    the one read before the push, and a finite push is then applied on both."""
    server = _overflowing(backend, request, mode, one_process=True)
    try:
        workers = ["x", "y"] if mode == "sync" else ["x"]
        for w in workers:
            server.register(w)
        before = state_of(server)
        out, _ = _push_in_threads(server, [(w, 0, OVERFLOW, 1.0, (0, 0)) for w in workers])
        for w in workers:
            assert isinstance(out[w], NonFiniteStepError), out[w]
            assert "would write inf into parameter 'b' at step 0" in str(out[w])
        assert_same_state(state_of(server), before)
        assert server.pull()[0] == (0, 0) and server.stats()["version"] == (0, 0)
        out, _ = _push_in_threads(server, [(w, 1, FINITE, 1.0, (0, 0)) for w in workers])
        assert all(out[w]["applied"] for w in workers), out
        version, params = server.pull()
        assert version == (1, 1)
        np.testing.assert_array_equal(params["w"], [-1.0, -1.0])
    finally:
        server.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_round_closed_by_a_leaving_worker_is_refused_on_every_shard(backend, request):
    """Sync: x pushes an overflowing gradient, y leaves, which closes the round: neither
    shard takes its step (Dask: both shards in one process); the round failed, state as before."""
    server = _overflowing(backend, request, "sync", one_process=True)
    try:
        for w in "xy":
            server.register(w)
        before = state_of(server)
        server.push("x", 0, OVERFLOW, version=(0, 0), wait=False)
        server.unregister("y")
        assert_same_state(state_of(server), before)
        stats = server.stats()
        assert stats["version"] == (0, 0) and stats["failed_rounds"] == 1
        assert all(s["pending"] == 0 for s in stats["shards"].values())
    finally:
        server.close()


def test_a_non_finite_rule_state_is_refused_naming_it():
    """float32 Adam: a gradient of 1e20 squares past the largest float32 into adam_v while
    the parameter's step stays finite; the step is refused all the same."""
    server = ParameterServer({"w": np.zeros(2, np.float32)}, adam, dict(learning_rate=0.1),
                             mode="async")
    version, _ = server.register("a")
    before = state_of(server)
    with pytest.raises(NonFiniteStepError, match=r"inf into the rule's state 'w.adam_v' at "
                                                 r"step 0"):
        server.push("a", 0, {"w": np.array([1e20, 1.0], np.float32)}, version=version)
    assert_same_state(state_of(server), before)


# ------------------------------------------------------------- train() on one screen


def test_train_fits_one_screen_of_help():
    import inspect
    import math
    import pydoc

    assert len(inspect.signature(train).parameters) <= 15
    text = pydoc.render_doc(train, renderer=pydoc.plaintext)
    rows = sum(max(1, math.ceil(len(line) / 80)) for line in text.splitlines())
    assert rows <= 40, rows


def test_every_server_option_reaches_the_server_through_train():
    import dataclasses
    import functools

    changed = dict(merge="sum", round_timeout=30.0, on_timeout="fail",
                   compile_mode="FAST_COMPILE", check_finite=False, keep_log=True,
                   profile=True, wait_timeout=60.0)
    explicit = dict(mode="sync", model_average=dict(average_window_rate=0.5),
                    ema=dict(decay=0.9))
    fields = {f.name for f in dataclasses.fields(ServerOptions)}
    # every field is either a keyword of train() itself or reachable as an option
    assert fields == set(changed) | set(explicit) | {"staleness_scale"}
    run = functools.partial(train, functools.partial(build_model, seed=1),
                            [batches_for(1, [2, 2])], sgd, dict(learning_rate=0.1), **explicit)
    for given in (dict(**changed), dict(options=changed),
                  dict(options=ServerOptions(**changed, **explicit))):
        if "options" in given and isinstance(given["options"], ServerOptions):
            result = train(functools.partial(build_model, seed=1), [batches_for(1, [2, 2])],
                           sgd, dict(learning_rate=0.1), **given)
        else:
            result = run(**given)
        opts = result.server.options
        for name, value in {**changed, **explicit}.items():
            assert getattr(opts, name) == value, name
    async_run = train(build_model, [batches_for(1, [2, 2])], sgd, dict(learning_rate=0.1),
                      mode="async", staleness_scale=True, shards=[["W1", "b1", "W2", "b2"]])
    assert async_run.server.options.staleness_scale is True
    assert list(async_run.server.shard_names) == ["shard0"]
    in_options = train(build_model, [batches_for(1, [2])], sgd, dict(learning_rate=0.1),
                       options=dict(mode="async"))
    assert in_options.server.options.mode == "async"
    with pytest.raises(TypeError, match="ema given twice"):
        train(build_model, [batches_for(1, [2])], sgd, dict(learning_rate=0.1),
              ema=dict(decay=0.9), options=dict(ema=dict(decay=0.5)))
    with pytest.raises(TypeError, match="given twice"):
        train(build_model, [batches_for(1, [2])], sgd, dict(learning_rate=0.1),
              options=dict(merge="sum"), merge="mean")


@pytest.mark.parametrize("backend, one_process", [
    ("local", False), pytest.param("dask", False, marks=needs_dask),
    pytest.param("dask", True, marks=needs_dask)])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_gradient_is_refused_naming_it_where_it_is_checked(backend, one_process,
                                                                        bad, request):
    """The caller checks gradients for NaN and inf where its process holds the shards (local)
    or where the push spans several processes (Dask, all or nothing); a Dask process that
    holds every shard of the push checks them there (`one_process`). Either way the push is
    refused naming the parameter, counted once as rejected, and nothing of it is applied."""
    initial = {"w": np.zeros((2, 3)), "b": np.zeros(3, np.float32)}
    server = _server(backend, request, initial, sgd, dict(learning_rate=0.1), one_process,
                     mode="async", shards={"w": ["w"], "b": ["b"]})
    try:
        version, _ = server.register("a")
        grads = {"w": np.ones((2, 3)), "b": np.array([0, bad, 0], np.float32)}
        with pytest.raises(PushRejected, match=r"shard 'b': the gradient of 'b' has NaN or inf"):
            server.push("a", 0, grads, version=version)
        stats = server.stats()
        assert stats["rejected"] == 1 and stats["applied"] == 0
        assert stats["version"] == (0, 0)
        _, params = server.pull()
        assert not params["w"].any() and not params["b"].any()
        server.push("a", 0, {"w": np.ones((2, 3)), "b": np.ones(3, np.float32)},
                    version=version)           # the same seq, finite: applied once
        _, params = server.pull()
        np.testing.assert_array_equal(params["w"], np.full((2, 3), -0.1))
        np.testing.assert_array_equal(params["b"], np.full(3, np.float32(-0.1)))
    finally:
        server.close()
