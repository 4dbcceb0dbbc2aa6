"""The shard's round bookkeeping as plain Python: no PyTensor function is compiled here.

Reference: a numpy SGD applied by hand (integer-valued gradients, exact).
"""

import numpy as np
import pytest

from lasagne_accum.distributed.errors import (
    NonFiniteStepError,
    PushRejected,
    RoundFailedError,
    RoundTimeoutError,
    StalePushError,
    UnknownWorkerError,
)
from lasagne_accum.distributed.options import ServerOptions
from lasagne_accum.distributed.reduction import reduce_grads, reduce_grads_numpy
from lasagne_accum.distributed.rounds import Rounds, Seen, Step, settle

SPECS = {"w": ((2,), "float64")}


class NumpySGD:
    """``w -= factor * g`` with ``factor = lr * scale``; step number `fail_at` raises.

    `check_finite`: the step is computed, then written by ``commit`` (the
    protocol of the shard's compiled apply function); without, it is
    written at once.
    """

    def __init__(self, lr=1.0, fail_at=None, check_finite=True):
        self.w = np.zeros(2)
        self.lr, self.fail_at, self.calls = lr, fail_at, []
        self.check_finite = check_finite

    def factor(self, scale):
        return self.lr * scale

    def prepare(self, arrays, factor):
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise FloatingPointError("simulated failure inside the apply function")
        self.calls.append(factor)
        with np.errstate(invalid="ignore"):
            new = self.w - factor * arrays[0]
        if not self.check_finite:
            self.w = new
            return Step()
        return Step([new], None if np.isfinite(new).all() else "NaN into parameter 'w'")

    def commit(self, step):
        if not step.taken:
            self.w = step.values[0]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def book(mode="sync", apply=None, clock=None, **options):
    apply = apply or NumpySGD()
    return Rounds("w", SPECS, ServerOptions(mode=mode, **options), apply,
                  clock=clock or Clock()), apply


def push(rounds, wid, seq, g, weight=1.0, version=None):
    version = rounds.version if version is None else version
    ticket = rounds.check(wid, seq, version)
    return rounds.commit(wid, seq, [np.asarray(g, float)], weight, version, ticket)


def test_sync_round_closes_with_the_weighted_mean():
    r, sgd = book()
    for w in "ab":
        r.register(w)
    first = push(r, "a", 0, [1.0, 0.0], weight=1)
    assert not first["applied"] and first["round"] == 0
    second = push(r, "b", 0, [0.0, 4.0], weight=3)
    assert second["applied"] and r.version == 1
    np.testing.assert_array_equal(sgd.w, -np.array([1.0, 12.0]) / 4)
    assert r.outcome(0)["workers"] == ["a", "b"] and r.outcome(0)["weight"] == 4.0


def test_retries_are_duplicates_and_checks_change_nothing():
    r, sgd = book(mode="async")
    r.register("a")
    assert push(r, "a", 0, [1.0, 1.0])["applied"]
    again = push(r, "a", 0, [1.0, 1.0], version=0)
    assert again["duplicate"] and not again["applied"]
    with pytest.raises(PushRejected, match="version 5 does not exist"):
        r.check("a", 1, 5)
    with pytest.raises(UnknownWorkerError, match="'z' is not registered"):
        r.check("z", 0, 0)
    assert r.version == 1 and sgd.calls == [1.0] and r.counts["received"] == 1


def test_sync_rejects_stale_and_second_push():
    r, _ = book()
    for w in "ab":
        r.register(w)
    push(r, "a", 0, [1.0, 1.0])
    with pytest.raises(PushRejected, match="already pushed"):
        r.check("a", 1, 0)
    push(r, "b", 0, [1.0, 1.0])
    with pytest.raises(StalePushError, match="open round is for version 1"):
        r.check("a", 1, 0)


def test_timeout_close_and_fail_with_a_clock():
    clock = Clock()
    r, sgd = book(round_timeout=2.0, clock=clock)
    for w in ("a", "b", "dead"):
        r.register(w)
    push(r, "a", 0, [2.0, 0.0])
    push(r, "b", 0, [0.0, 2.0])
    clock.now = 1.9
    assert r.outcome(0) is None and r.deadline() == pytest.approx(0.1)
    clock.now = 2.0
    result = r.outcome(0)
    assert result["timed_out"] and result["dropped"] == ["dead"]
    np.testing.assert_array_equal(sgd.w, [-1.0, -1.0])

    r, sgd = book(round_timeout=2.0, on_timeout="fail", clock=clock)
    clock.now = 0.0
    for w in ("a", "dead"):
        r.register(w)
    push(r, "a", 0, [2.0, 0.0])
    clock.now = 5.0
    with pytest.raises(RoundTimeoutError, match="without a push from 'dead'"):
        r.outcome(0)
    assert r.version == 0 and sgd.calls == [] and list(r.live) == ["a"]
    assert push(r, "a", 0, [2.0, 0.0])["applied"]          # the same seq may come again


def test_a_failing_apply_fails_the_round_and_the_book_keeps_working():
    """Issue 11 item 15: the round is discarded, its pushers get the error, nothing stays pending."""
    r, sgd = book(apply=NumpySGD(fail_at=1))
    for w in "ab":
        r.register(w)
    push(r, "a", 0, [1.0, 1.0])
    push(r, "b", 0, [1.0, 1.0])                              # round 0 applied
    push(r, "a", 1, [5.0, 5.0])
    closing = push(r, "b", 1, [5.0, 5.0])                    # round 1: the step raises
    assert not closing["applied"]
    with pytest.raises(RoundFailedError, match="could not be applied.*simulated failure"):
        r.outcome(1)
    assert r.version == 1 and not r.pending and r.counts["failed_rounds"] == 1
    np.testing.assert_array_equal(sgd.w, [-1.0, -1.0])
    assert r.stats()["live_workers"] == ["a", "b"]
    sgd.lr, sgd.fail_at = 0.5, None
    push(r, "a", 1, [5.0, 5.0])                              # the same ids again: applied now
    assert push(r, "b", 1, [5.0, 5.0])["applied"]
    np.testing.assert_array_equal(sgd.w, [-3.5, -3.5])


def test_async_apply_failure_is_an_error_and_nothing_is_recorded():
    r, sgd = book(mode="async", apply=NumpySGD(fail_at=0))
    r.register("a")
    ticket = r.check("a", 0, 0)
    with pytest.raises(RoundFailedError, match="not applied here.*simulated failure"):
        r.commit("a", 0, [np.ones(2)], 1.0, 0, ticket)
    assert r.version == 0 and 0 not in r.seen["a"]
    sgd.fail_at = None
    assert push(r, "a", 0, [1.0, 1.0])["applied"]


def test_a_non_finite_sync_step_is_refused_and_the_book_keeps_working():
    """Round 1's rate is NaN: the round is refused (its waiters get the error naming the
    parameter and the step), w keeps its last finite value, and the same pushes apply once the
    rate is finite again."""
    r, sgd = book()
    for w in "ab":
        r.register(w)
    push(r, "a", 0, [1.0, 1.0])
    push(r, "b", 0, [1.0, 1.0])                              # round 0: w = -1
    sgd.lr = float("nan")
    push(r, "a", 1, [1.0, 1.0])
    assert not push(r, "b", 1, [1.0, 1.0])["applied"]
    with pytest.raises(NonFiniteStepError,
                       match=r"sync round 1 would write NaN into parameter 'w' at step 1"):
        r.outcome(1)
    assert r.version == 1 and not r.pending and r.counts["failed_rounds"] == 1
    np.testing.assert_array_equal(sgd.w, [-1.0, -1.0])
    assert r.stats()["version"] == 1
    sgd.lr = 0.5
    push(r, "a", 1, [1.0, 1.0])
    assert push(r, "b", 1, [1.0, 1.0])["applied"]
    np.testing.assert_array_equal(sgd.w, [-1.5, -1.5])


def test_a_non_finite_async_step_raises_and_nothing_is_recorded():
    r, sgd = book(mode="async", apply=NumpySGD(lr=float("inf")))
    r.register("a")
    ticket = r.check("a", 0, 0)
    with pytest.raises(NonFiniteStepError, match="worker 'a' .seq 0. would write NaN into "
                                                 "parameter 'w' at step 0"):
        r.commit("a", 0, [np.array([1.0, 0.0])], 1.0, 0, ticket)   # inf * 0 is NaN
    assert r.version == 0 and 0 not in r.seen["a"] and sgd.w.tolist() == [0.0, 0.0]
    sgd.lr = 1.0
    assert push(r, "a", 0, [1.0, 1.0])["applied"]


def test_without_check_finite_a_non_finite_step_is_written():
    """An apply that writes as it computes (check_finite off) cannot be refused: the step is
    recorded as taken, NaN included."""
    r, sgd = book(apply=NumpySGD(lr=float("nan"), check_finite=False))
    r.register("a")
    assert push(r, "a", 0, [1.0, 1.0])["applied"] and r.version == 1
    assert np.isnan(sgd.w).all()


def test_settle_takes_the_steps_of_several_books_all_or_none():
    """Two shards' books: b's step is NaN, so a's finite step is not taken either; with a's
    apply writing in place (no check), a's step stays taken and is recorded."""
    for a_checks in (True, False):
        ra, a = book(mode="async", apply=NumpySGD(check_finite=a_checks))
        rb, b = book(mode="async", apply=NumpySGD(lr=float("nan")))
        for rounds in (ra, rb):
            rounds.register("x")
        staged = [rounds.stage("x", 0, [np.ones(2)], 1.0, 0, rounds.check("x", 0, 0))
                  for rounds in (ra, rb)]
        with pytest.raises(NonFiniteStepError, match="shard 'w'"):
            settle(staged)
        assert rb.version == 0 and b.w.tolist() == [0.0, 0.0]
        assert ra.version == (0 if a_checks else 1)
        assert a.w.tolist() == ([0.0, 0.0] if a_checks else [-1.0, -1.0])


def test_applied_seqs_round_trip_through_counters():
    r, _ = book(mode="async")
    r.register("a")
    r.register(7)
    for seq in (0, 1, 2, 5):
        push(r, "a", seq, [1.0, 1.0])
    push(r, 7, 3, [1.0, 1.0])
    counters, seqs = r.counters()
    assert counters.tolist() == [5, 5] and seqs.dtype == np.uint8
    fresh, _ = book(mode="async")
    fresh.register("a")
    fresh.load_counters(counters, Rounds.parse_seen(seqs, "test"))
    assert fresh.version == 5
    assert [s in fresh.seen["a"] for s in range(7)] == [True, True, True, False, False, True,
                                                        False]
    assert 3 in fresh.seen[7] and 2 not in fresh.seen[7]       # int ids stay ints
    with pytest.raises(ValueError, match="malformed"):
        Rounds.parse_seen(np.frombuffer(b"{nope", np.uint8), "test")


def test_seen_compacts():
    s = Seen()
    for seq in [3, 0, 2, 1]:
        s.add(seq)
    assert s.floor == 3 and s.above == set()


def test_waiters_of_one_round_share_one_read_only_copy():
    from lasagne_accum import sgd
    from lasagne_accum.distributed.shard import Shard

    shard = Shard("w", {"w": np.zeros(3)}, sgd, dict(learning_rate=1.0), mode="sync",
                  compile_mode="FAST_COMPILE")
    for wid in ("a", "b"):
        shard.register(wid)
    rid = shard.push("a", 0, {"w": np.ones(3)}, weight=1.0, version=0)["round"]
    shard.push("b", 0, {"w": 3 * np.ones(3)}, weight=1.0, version=0)
    first = shard.wait_round(rid, pull=True, shared=True)["params"]["w"]
    second = shard.wait_round(rid, pull=True, shared=True)["params"]["w"]
    own = shard.wait_round(rid, pull=True)["params"]["w"]
    assert first is second and not first.flags.writeable
    assert own is not first and own.flags.writeable
    np.testing.assert_array_equal(first, -2 * np.ones(3))       # the mean, one step
    shard.push("a", 1, {"w": np.ones(3)}, weight=1.0, version=1)
    rid = shard.push("b", 1, {"w": np.ones(3)}, weight=1.0, version=1)["round"]
    after = shard.wait_round(rid, pull=True, shared=True)["params"]["w"]
    assert after is not first
    np.testing.assert_array_equal(after, -3 * np.ones(3))
    np.testing.assert_array_equal(first, -2 * np.ones(3))       # the old one unchanged


def _written_out(arrays, weights, total, dtype, mean):
    """The round's reduction as the formula reads (float64, in order, rounded once)."""
    acc = np.zeros(np.shape(arrays[0]), np.float64)
    for g, w in zip(arrays, weights):
        acc = acc + (g.astype(np.float64) * w if mean else g.astype(np.float64))
    return (acc / total if mean else acc).astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_reduce_grads_gives_the_formulas_bits(dtype, k):
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
        for got in (reduce_grads(arrays, weights, total, dtype, mean),
                    reduce_grads(arrays, weights, total, dtype, mean, scratch=scratch),
                    reduce_grads_numpy(arrays, weights, total, dtype, mean)):
            assert got.dtype == np.dtype(dtype) and got.shape == (64, 33)
            assert got.tobytes() == expected.tobytes(), mean
