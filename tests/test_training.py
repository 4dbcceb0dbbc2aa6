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


def test_default_modes_are_the_measured_choice():
    from lasagne_accum.machine import measured_modes

    assert default_modes("float32") == measured_modes("float32").modes
    assert set(default_modes("float64")) <= {"CVM", "NUMBA"}


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


# ------------------------------------------------ averages, checkpoints, warm-up


def _averaged_trainer(**kwargs):
    x, y, w, loss = _model()
    trainer = la.compile_accumulation(
        [x, y], loss, [w], la.sgd, dict(learning_rate=LR), every=2, weight=x.shape[0],
        model_average=dict(average_window_rate=1.0, min_average_window=1,
                           max_average_window=100),
        ema=dict(decay=0.75), **kwargs)
    return x, y, w, trainer


def test_averages_are_built_on_the_apply_step_and_reachable():
    """``trainer.model_average`` / ``trainer.ema`` average the values after each
    optimizer step (numpy: the window closes after step 1, so the average is the
    mean of both steps; the EMA starts at the initial values)."""
    _, _, w, trainer = _averaged_trainer()
    batches = _batches([2, 1, 3, 2, 1])   # two full windows, one batch pending
    for batch in batches:
        trainer.step(*batch)
    w0 = np.array([0.5, -1.0])
    w1, w2 = _reference(batches[:2], 2), _reference(batches[:4], 2)
    assert trainer.model_average.steps == 2 and trainer.ema.steps == 2
    with trainer.model_average.apply():
        np.testing.assert_allclose(w.get_value(), (w1 + w2) / 2, rtol=1e-12)
    shadow = 0.75 * (0.75 * w0 + 0.25 * w1) + 0.25 * w2
    with trainer.ema.apply():
        np.testing.assert_allclose(w.get_value(), shadow, rtol=1e-12)
    np.testing.assert_array_equal(w.get_value(), w2)   # restored, bit for bit
    assert trainer.flush() is True   # the pending batch: a third step
    trainer.apply_fn()   # an apply on an empty window does not move the averages
    assert trainer.model_average.steps == 3 and trainer.ema.steps == 3


def test_trainer_checkpoint_keeps_counters_averages_and_metadata(tmp_path):
    """Saved mid-window with loop state; a new trainer loads it: the same steps
    count, window, averages and metadata, and the rest of the run is bit-identical."""
    batches = _batches([2, 1, 3, 2, 1, 2, 2, 3, 1], seed=4)
    _, _, w, trainer = _averaged_trainer()
    for batch in batches[:5]:
        trainer.step(*batch)
    rng = np.random.default_rng(7)
    rng.random(3)
    meta = {"epoch": 1, "position": 5, "rng": rng.bit_generator.state, "note": "mid"}
    trainer.save(tmp_path / "mid.npz", metadata=meta)
    with trainer.model_average.apply():
        with pytest.raises(RuntimeError, match="restore"):
            trainer.save(tmp_path / "applied.npz")
    for batch in batches[5:]:
        trainer.step(*batch)
    trainer.flush()
    want = (w.get_value().copy(), trainer.model_average.averages()[0], trainer.ema.averages()[0],
            trainer.steps)

    _, _, w2, resumed = _averaged_trainer()
    loaded = resumed.load(tmp_path / "mid.npz")
    assert loaded == {**meta, "rng": loaded["rng"]} and resumed.steps == 2
    rng2 = np.random.default_rng(0)
    rng2.bit_generator.state = loaded["rng"]
    assert rng2.random() == rng.random()   # the data RNG resumes where it stopped
    assert resumed.pending == 1
    for batch in batches[5:]:
        resumed.step(*batch)
    resumed.flush()
    got = (w2.get_value(), resumed.model_average.averages()[0], resumed.ema.averages()[0],
           resumed.steps)
    for a, b in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(a, b)
    assert got[3] == want[3] == 5


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(model_average=0.5), TypeError, "model_average must be a dict"),
    (dict(ema=dict(decay=0.9, params=[])), TypeError, "ema: params are set by"),
    (dict(model_average=dict(average_window_rate=2.0)), ValueError, "average_window_rate"),
])
def test_bad_average_arguments(kwargs, error, match):
    x, y, w, loss = _model()
    with pytest.raises(error, match=match):
        la.compile_accumulation([x, y], loss, [w], la.sgd, dict(learning_rate=LR), **kwargs)


def test_example_warms_up_and_leaves_the_state_as_it_was():
    """Both functions run once on the example, and every value they update is put back:
    the rule's state, the window, and a random stream's generator (dropout's), so that
    the run afterwards is the run without the warm-up."""
    from pytensor.tensor.random.utils import RandomStream

    def build(example):
        x, y, w, loss = _model()
        srng = RandomStream(seed=3)
        keep = srng.binomial(1, 0.5, size=(2,)).astype("float64")   # a dropout mask
        noisy = ((x @ (w * keep) - y) ** 2).mean()
        trainer = la.compile_accumulation([x, y], noisy, [w], la.adam,
                                          dict(learning_rate=LR), every=2, example=example)
        return w, trainer

    batches = _batches([2, 3, 2, 1])
    w_cold, cold = build(None)
    w_warm, warm = build(batches[0])
    np.testing.assert_array_equal(w_warm.get_value(), [0.5, -1.0])
    state = la.collect_state(warm)
    assert all(not np.any(v.get_value()) for n, v in state.items() if n != "w")
    for batch in batches:
        cold.step(*batch)
        warm.step(*batch)
    assert warm.steps == cold.steps == 2
    np.testing.assert_array_equal(w_warm.get_value(), w_cold.get_value())
    assert not np.array_equal(w_warm.get_value(), [0.5, -1.0])


def test_merge_updates_keeps_order_and_refuses_two_values():
    a = pytensor.shared(0.0, name="a")
    b = pytensor.shared(0.0, name="b")
    inc = a + 1
    merged = la.merge_updates({a: inc}, None, {b: b * 2, a: inc})
    assert list(merged) == [a, b] and merged[a] is inc
    with pytest.raises(ValueError, match=r"merge_updates\(\): a is updated twice"):
        la.merge_updates({a: a + 1}, {b: b}, {a: a - 1})
    with pytest.raises(TypeError, match="argument 1 is a list"):
        la.merge_updates({a: inc}, [a])
    with pytest.raises(TypeError, match="not a shared variable"):
        la.merge_updates({pt.scalar("s"): inc})


def test_a_trainer_of_any_apply_function_counts_examples_from_the_total():
    """An apply function of another kind (the parameter server's push returns a dict) is
    called as it is; the examples come from the accumulation's total weight."""
    x, y, w, loss = _model()
    acc = la.accumulate_gradients(loss, [w], weight=x.shape[0])
    step = pytensor.function([x, y], loss, updates=acc.accumulate)
    reset = pytensor.function([], [], updates=acc.reset)
    calls = []

    def push():
        calls.append(float(acc.total.get_value()))
        reset()
        return {"pushed": True}

    trainer = la.AccumulationTrainer(step, push, acc, 2)
    for batch in _batches([2, 3, 4, 1]):
        trainer.step(*batch)
    assert calls == [5.0, 5.0] and trainer.examples == 10 and trainer.steps == 2
