"""compile_accumulation, AccumulationTrainer and run_epoch against a numpy re-derivation."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import lasagne_accum as la
from lasagne_accum.training import default_modes

LR = 0.1


def _model():
    w = pytensor.shared(np.array([0.5, -1.0]), name="w")
    x = pt.matrix("x")
    y = pt.vector("y")
    loss = ((x @ w - y) ** 2).mean()
    return x, y, w, loss


def _grad(w, xb, yb):
    """d/dw of mean((x w - y)^2), by hand."""
    return 2 * xb.T @ (xb @ w - yb) / len(yb)


def _batches(sizes, seed=0):
    rng = np.random.RandomState(seed)
    return [(rng.randn(k, 2), rng.randn(k)) for k in sizes]


def _reference(batches, every):
    """SGD on the concatenation of each window of `every` batches, last window partial."""
    w = np.array([0.5, -1.0])
    for start in range(0, len(batches), every):
        window = batches[start:start + every]
        xb = np.concatenate([b[0] for b in window])
        yb = np.concatenate([b[1] for b in window])
        w = w - LR * _grad(w, xb, yb)
    return w


@pytest.mark.parametrize("mode", [None, "CVM", "NUMBA"])
def test_step_applies_every_n_and_flush_applies_the_rest(mode):
    x, y, w, loss = _model()
    trainer = la.compile_accumulation([x, y], loss, [w], la.sgd, dict(learning_rate=LR),
                                      every=3, weight=x.shape[0], mode=mode)
    batches = _batches([2, 1, 3, 4, 1, 2, 5])
    for i, batch in enumerate(batches, 1):
        trainer.step(*batch)
        assert trainer.steps == i // 3
    assert trainer.pending == 1
    assert trainer.flush() is True
    assert (trainer.steps, trainer.pending) == (3, 0)
    np.testing.assert_allclose(w.get_value(), _reference(batches, 3), rtol=1e-12)


def test_flush_with_nothing_accumulated_changes_nothing():
    x, y, w, loss = _model()
    trainer = la.compile_accumulation([x, y], loss, [w], la.adam, dict(learning_rate=LR),
                                      every=2)
    before = {v.name: np.array(v.get_value()) for v in trainer.apply_updates}
    assert trainer.flush() is False
    trainer.apply_fn()  # called directly on an empty window: guarded, no NaN, no step
    after = {v.name: np.array(v.get_value()) for v in trainer.apply_updates}
    assert before.keys() == after.keys()
    for name in before:
        assert np.array_equal(before[name], after[name]), name
    assert trainer.steps == 0


def test_run_epoch_returns_mean_loss_and_flushes():
    x, y, w, loss = _model()
    trainer = la.compile_accumulation([x, y], loss, [w], la.sgd, dict(learning_rate=LR),
                                      every=2, weight=x.shape[0])
    batches = _batches([3, 3, 2])
    w0 = w.get_value().copy()
    expected_loss = np.mean([np.mean((xb @ w0 - yb) ** 2) for xb, yb in batches[:2]]
                            + [np.mean((batches[2][0] @ _reference(batches[:2], 2)
                                        - batches[2][1]) ** 2)])
    mean_loss = la.run_epoch(trainer, batches, progress=False)
    assert trainer.steps == 2
    np.testing.assert_allclose(mean_loss, expected_loss, rtol=1e-12)
    np.testing.assert_allclose(w.get_value(), _reference(batches, 2), rtol=1e-12)


def test_skip_nonfinite_batches_do_not_count_towards_the_window():
    x, y, w, loss = _model()
    trainer = la.compile_accumulation([x, y], loss, [w], la.sgd, dict(learning_rate=LR),
                                      every=2, weight=x.shape[0], skip_nonfinite=True)
    good = _batches([2, 2])
    bad = (np.full((2, 2), np.nan), np.zeros(2))
    trainer.step(*good[0])
    trainer.step(*bad)  # skipped: the window still has one batch
    assert trainer.steps == 0
    trainer.step(*good[1])
    assert trainer.steps == 1
    assert int(trainer.accumulation.skipped.get_value()) == 1
    np.testing.assert_allclose(w.get_value(), _reference(good, 2), rtol=1e-12)


def test_extra_apply_updates_run_once_per_step():
    x, y, w, loss = _model()
    steps = pytensor.shared(np.int64(0), name="steps")
    trainer = la.compile_accumulation([x, y], loss, [w], la.sgd, dict(learning_rate=LR),
                                      every=2, extra_apply_updates={steps: steps + 1})
    for batch in _batches([1, 1, 1, 1]):
        trainer.step(*batch)
    assert int(steps.get_value()) == 2
    with pytest.raises(ValueError, match="rule updates too"):
        la.compile_accumulation([x, y], loss, [w], la.sgd, dict(learning_rate=LR),
                                extra_apply_updates={w: w})


@pytest.mark.parametrize("every, error", [(0, ValueError), (2.0, TypeError),
                                          (pt.iscalar(), TypeError)])
def test_bad_every_is_rejected(every, error):
    x, y, w, loss = _model()
    with pytest.raises(error, match="every"):
        la.compile_accumulation([x, y], loss, [w], la.sgd, dict(learning_rate=LR), every=every)


def test_bad_rule_is_rejected():
    x, y, w, loss = _model()
    with pytest.raises(TypeError, match="callable"):
        la.compile_accumulation([x, y], loss, [w], "adam")
    with pytest.raises(TypeError, match="not an update dictionary"):
        la.compile_accumulation([x, y], loss, [w], lambda g, p: [p[0] - g[0]])


def test_default_modes_follow_blas():
    acc_mode, apply_mode = default_modes()
    assert apply_mode == "NUMBA"
    assert acc_mode == ("CVM" if pytensor.config.blas__ldflags else "NUMBA")


def test_extra_apply_updates_callable_sees_the_rule_updates():
    x, y, w, loss = _model()
    holder = {}

    def average(apply):
        holder["avg"] = la.ModelAverage([w], 1.0, 1, 100, updates=apply)
        return holder["avg"].updates

    trainer = la.compile_accumulation([x, y], loss, [w], la.sgd, dict(learning_rate=LR),
                                      every=2, weight=x.shape[0], extra_apply_updates=average)
    batches = _batches([2, 1, 3, 2])
    for batch in batches:
        trainer.step(*batch)
    avg = holder["avg"]
    assert avg.steps == 2
    w1, w2 = _reference(batches[:2], 2), _reference(batches, 2)
    with avg.apply():  # the average of the values after each step
        np.testing.assert_allclose(w.get_value(), (w1 + w2) / 2, rtol=1e-12)


def test_name_prefixes_the_trainers_state_and_an_empty_flush_is_not_a_step():
    x, y, w, loss = _model()
    trainer = la.compile_accumulation([x, y], loss, [w], la.adam, dict(learning_rate=LR),
                                      every=2, name="enc")
    names = {v.name for v in trainer.apply_updates}
    assert {"enc.count", "w.enc_grad_accu", "w.adam_m", "adam.t"} <= names
    assert trainer.accumulation.count.name == "enc.count"
    trainer.apply_fn()  # called directly on an empty window: nothing moves
    np.testing.assert_array_equal(w.get_value(), [0.5, -1.0])
    t = next(v for v in trainer.apply_updates if v.name == "adam.t")
    assert int(t.get_value()) == 0
