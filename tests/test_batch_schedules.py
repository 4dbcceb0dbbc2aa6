"""Batch-size schedules through a run-time K: compile_accumulation(every=callable).

The reference of a ramp is training on true batches of the scheduled sizes, with the
rule's plain one-function form, on the same examples in the same order (float64).
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import lasagne_accum as la
from lasagne_accum import schedules

MICRO = 16
#: K = 1, 2, 4, 8 for four windows each: true batches of 16, 32, 64 and 128
RAMP = [(1, 4), (2, 4), (4, 4), (8, 4)]


def ramp(examples):
    """K for the window that starts after `examples` examples."""
    seen = 0
    for k, windows in RAMP:
        seen += k * MICRO * windows
        if examples < seen:
            return k
    return RAMP[-1][0]


def _data():
    rng = np.random.default_rng(5)
    n = sum(k * MICRO * w for k, w in RAMP)
    X = rng.normal(size=(n, 5))
    Y = X @ rng.normal(size=(5, 2)) + 0.3 * rng.normal(size=(n, 2))
    return X, Y


def _model(name):
    x, y = pt.matrix("x"), pt.matrix("y")
    W = pytensor.shared(np.full((5, 2), 0.1), name=f"{name}.W")
    b = pytensor.shared(np.zeros(2), name=f"{name}.b")
    loss = ((x @ W + b - y) ** 2).mean()
    return x, y, [W, b], loss


RULES = {"sgd": (la.sgd, dict(learning_rate=0.05)),
         "momentum": (la.momentum, dict(learning_rate=0.02, momentum=0.9)),
         "adam": (la.adam, dict(learning_rate=0.01)),
         "lamb": (la.lamb, dict(learning_rate=0.01)),
         "lars": (la.lars, dict(learning_rate=0.5))}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_ramp_of_k_equals_true_batches_of_the_scheduled_sizes(rule):
    fn, kwargs = RULES[rule]
    X, Y = _data()
    x, y, params, loss = _model("ramp")
    trainer = la.compile_accumulation([x, y], loss, params, fn, kwargs, every=ramp,
                                      weight=x.shape[0])
    rx, ry, ref_params, ref_loss = _model("true")
    true_step = pytensor.function([rx, ry], ref_loss, updates=fn(ref_loss, ref_params, **kwargs))
    start, windows = 0, 0
    for k, count in RAMP:
        for _ in range(count):
            assert trainer.window_size() == k
            for i in range(k):
                trainer.step(X[start + i * MICRO:start + (i + 1) * MICRO],
                             Y[start + i * MICRO:start + (i + 1) * MICRO])
            true_step(X[start:start + k * MICRO], Y[start:start + k * MICRO])
            start += k * MICRO
            windows += 1
            assert trainer.steps == windows and trainer.examples == start
            for p, q in zip(params, ref_params):
                np.testing.assert_allclose(p.get_value(), q.get_value(), rtol=0, atol=1e-12,
                                           err_msg=f"{rule}, window {windows}")


def test_a_run_resumed_in_the_middle_of_a_ramp_continues_bit_for_bit(tmp_path):
    X, Y = _data()
    results = []
    for resume in (False, True):
        x, y, params, loss = _model(f"r{resume}")
        trainer = la.compile_accumulation([x, y], loss, params, la.adam,
                                          dict(learning_rate=0.01), every=ramp,
                                          weight=x.shape[0])
        batches = [(X[i:i + MICRO], Y[i:i + MICRO]) for i in range(0, len(X), MICRO)]
        for i, batch in enumerate(batches):
            if resume and i == 13:       # in a window of K = 4 (examples 192..256)
                trainer.save(tmp_path / "ckpt.npz")
                x2, y2, params2, loss2 = _model(f"r{resume}")
                trainer = la.compile_accumulation([x2, y2], loss2, params2, la.adam,
                                                  dict(learning_rate=0.01), every=ramp,
                                                  weight=x2.shape[0])
                trainer.load(tmp_path / "ckpt.npz")
                assert trainer.examples == 192 and trainer.window == 4
                params = params2
            trainer.step(*batch)
        results.append([p.get_value() for p in params])
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_every_callable_returning_a_bad_k_is_refused_and_nothing_is_lost():
    X, Y = _data()
    x, y, params, loss = _model("bad")
    answers = iter([2, 0])
    trainer = la.compile_accumulation([x, y], loss, params, la.sgd, dict(learning_rate=0.1),
                                      every=lambda examples: next(answers), weight=x.shape[0])
    trainer.step(X[:16], Y[:16])
    trainer.step(X[16:32], Y[16:32])
    before = [p.get_value().copy() for p in params]
    with pytest.raises(ValueError, match=r"every\(32\) returned 0: .* positive integer"):
        trainer.step(X[32:48], Y[32:48])
    assert trainer.pending == 0 and trainer.steps == 1
    assert all(np.array_equal(p.get_value(), b) for p, b in zip(params, before))
    for bad in (2.5, True, "2"):
        trainer = la.compile_accumulation([x, y], loss, params, la.sgd,
                                          dict(learning_rate=0.1), every=lambda e, b=bad: b)
        with pytest.raises(ValueError, match="positive integer"):
            trainer.step(X[:16], Y[:16])


def _sgd_under_the_ramp(trainer, rate):
    """Feed the ramp's micro-batches to `trainer`; numpy's sgd on the true batches, with the
    learning rate ``rate(examples_before, k)``: both parameters and the examples seen."""
    X, Y = _data()
    W, b = np.full((5, 2), 0.1), np.zeros(2)
    start = 0
    for k, count in RAMP:
        for _ in range(count):
            for i in range(k):
                trainer.step(X[start + i * MICRO:start + (i + 1) * MICRO],
                             Y[start + i * MICRO:start + (i + 1) * MICRO])
            xb, yb = X[start:start + k * MICRO], Y[start:start + k * MICRO]
            r = 2 * (xb @ W + b - yb) / yb.size
            lr = rate(start, k)
            W, b = W - lr * xb.T @ r, b - lr * r.sum(0)
            start += k * MICRO
    return W, b, start


def test_a_schedule_keyed_in_examples_advances_by_the_window_total():
    """sgd with a warm-up keyed in examples, under a ramp, against numpy's true batches."""
    warm = schedules.linear_warmup(0.0, 0.1, warmup_steps=320, unit="examples")
    x, y, params, loss = _model("ex")
    trainer = la.compile_accumulation([x, y], loss, params, la.sgd, dict(learning_rate=warm),
                                      every=ramp, weight=x.shape[0])
    W, b, seen = _sgd_under_the_ramp(trainer, lambda start, k: min(start, 320) / 320 * 0.1)
    np.testing.assert_allclose(params[0].get_value(), W, rtol=1e-12)
    np.testing.assert_allclose(params[1].get_value(), b, rtol=1e-12)
    counter = next(v for v in trainer.apply_updates if v.name == "sgd.schedule_step")
    assert int(counter.get_value()) == seen == trainer.examples


@pytest.mark.parametrize("scaling, power", [(schedules.linear_scaling, 1.0),
                                            (schedules.sqrt_scaling, 0.5)])
def test_scaling_rules_follow_the_run_time_batch(scaling, power):
    x, y, params, loss = _model("sc")
    trainer = la.compile_accumulation([x, y], loss, params, la.sgd,
                                      dict(learning_rate=scaling(0.01, 16, None)),
                                      every=ramp, weight=x.shape[0])
    W, b, _ = _sgd_under_the_ramp(trainer, lambda start, k: 0.01 * (k * MICRO / 16) ** power)
    np.testing.assert_allclose(params[0].get_value(), W, rtol=1e-12)
    np.testing.assert_allclose(params[1].get_value(), b, rtol=1e-12)
    assert scaling(0.01, 16, 64) == pytest.approx(0.01 * 4 ** power)


def test_examples_units_need_the_accumulated_weight():
    x, y, params, loss = _model("u")
    warm = schedules.linear_warmup(0.0, 0.1, 100, unit="examples")
    with pytest.raises(ValueError, match="unit='examples' reads each window's number of "
                                         "examples"):
        la.sgd(loss, params, learning_rate=warm)
    with pytest.raises(ValueError, match="batch_size=None"):
        la.compile_accumulation([x, y], loss, params, la.sgd,
                                dict(learning_rate=schedules.linear_scaling(0.1, 16, None)))
    with pytest.raises(ValueError, match="unit must be 'steps' or 'examples'"):
        schedules.cosine_decay(0.1, 100, unit="epochs")


def test_follow_noise_scale_moves_k_by_factors_of_two_towards_b_simple():
    class Trainer:
        window, noise_scale = 0, None

        class accumulation:
            grad_sq = object()

    trainer = Trainer()
    follow = la.FollowNoiseScale(batch_size=16, min_every=2, max_every=16)
    follow.bind(trainer)
    assert follow(0) == 2                      # nothing measured yet: min_every
    trainer.window, trainer.noise_scale = 2, 1000.0    # target K = 62.5
    assert follow(0) == 4
    trainer.window = 16
    assert follow(0) == 16                     # the upper bound
    trainer.window, trainer.noise_scale = 8, 40.0      # target K = 2.5
    assert follow(0) == 4
    trainer.window, trainer.noise_scale = 4, 60.0      # target 3.75: within sqrt(2)
    assert follow(0) == 4
    trainer.noise_scale = float("nan")
    assert follow(0) == 4
    with pytest.raises(ValueError, match="max_every"):
        la.FollowNoiseScale(16, min_every=8, max_every=4)
    x, y, params, loss = _model("f")
    with pytest.raises(ValueError, match="needs the noise scale"):
        la.compile_accumulation([x, y], loss, params, la.sgd, dict(learning_rate=0.1),
                                every=la.FollowNoiseScale(16), weight=x.shape[0])
