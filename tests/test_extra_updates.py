"""Per-batch updates in the trainer (``extra_accumulate_updates``), dropout's generator,
and random generators in checkpoints.

References: a numpy loop over the same batches (running statistics, the dropout-masked
gradients), and generator states advanced by a function compiled apart from the trainer.
"""

import json
import zipfile

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import lasagne_accum
from lasagne_accum import compile_accumulation, sgd
from lasagne_accum.batch_norm import batch_norm


def running_mean_model():
    w = pytensor.shared(np.zeros(3), name="w")
    running = pytensor.shared(np.zeros(3), name="running_mean")
    x = pt.matrix("x")
    loss = ((x - w) ** 2).sum(axis=1).mean()
    return x, w, running, loss, {running: 0.9 * running + 0.1 * x.mean(axis=0)}


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(int(rng.integers(1, 5)), 3)) for _ in range(n)]


@pytest.mark.parametrize("as_callable", [False, True])
def test_extra_accumulate_updates_run_once_per_micro_batch(as_callable):
    x, w, running, loss, extra = running_mean_model()
    seen = []

    def extras(accumulate):
        seen.append(dict(accumulate))
        return extra

    trainer = compile_accumulation([x], loss, [w], sgd, dict(learning_rate=0.1), every=3,
                                   weight=x.shape[0], mode="CVM",
                                   extra_accumulate_updates=extras if as_callable else extra)
    data = batches(7)
    for b in data:
        trainer.step(b)
    trainer.flush()
    # numpy: the running mean moves once per micro-batch (7 times), and w follows SGD on
    # each window's example-weighted mean gradient (windows of 3, 3 and the flushed 1)
    ref_running, ref_w = np.zeros(3), np.zeros(3)
    for b in data:
        ref_running = 0.9 * ref_running + 0.1 * b.mean(axis=0)
    for window in (data[0:3], data[3:6], data[6:7]):
        stacked = np.concatenate(window)
        ref_w -= 0.1 * (2 * (ref_w - stacked)).mean(axis=0)
    np.testing.assert_allclose(running.get_value(), ref_running, rtol=1e-12)
    np.testing.assert_allclose(w.get_value(), ref_w, rtol=1e-12)
    assert trainer.steps == 3
    assert running in trainer.accumulate_updates
    if as_callable:   # the callable saw the accumulation's own updates (its buffers)
        (accumulate,) = seen
        assert trainer.accumulation.count in accumulate and running not in accumulate


def test_extra_accumulate_updates_are_checkpointed(tmp_path):
    x, w, running, loss, extra = running_mean_model()

    def make():
        return compile_accumulation([x], loss, [w], sgd, dict(learning_rate=0.1), every=2,
                                    weight=x.shape[0], mode="CVM",
                                    extra_accumulate_updates=extra)

    data = batches(5)
    trainer = make()
    for b in data[:3]:
        trainer.step(b)
    trainer.save(tmp_path / "ckpt.npz")
    with zipfile.ZipFile(tmp_path / "ckpt.npz") as zf:
        manifest = json.loads(np.load(zf.open(zf.namelist()[0])).tobytes())
    assert "running_mean" in [name for name, _ in manifest["names"]]
    for b in data[3:]:
        trainer.step(b)
    finished = running.get_value().copy(), w.get_value().copy()
    running.set_value(np.full(3, 7.0))
    resumed = make()
    resumed.load(tmp_path / "ckpt.npz")
    for b in data[3:]:
        resumed.step(b)
    np.testing.assert_array_equal(running.get_value(), finished[0])
    np.testing.assert_array_equal(w.get_value(), finished[1])


def test_extra_updates_refused_where_they_cannot_run():
    x, w, running, loss, extra = running_mean_model()
    kwargs = dict(weight=x.shape[0], mode="CVM")
    # a per-batch update on the apply side: named, and sent to the accumulate side
    with pytest.raises(ValueError, match=r"running_mean.*needs x.*extra_accumulate_updates"):
        compile_accumulation([x], loss, [w], sgd, dict(learning_rate=0.1),
                             extra_apply_updates=extra, **kwargs)
    # the accumulation's own buffers are not the user's to update
    with pytest.raises(ValueError, match="extra_accumulate_updates updates .* accumulation"):
        compile_accumulation([x], loss, [w], sgd, dict(learning_rate=0.1),
                             extra_accumulate_updates=lambda acc: {k: k for k in acc},
                             **kwargs)
    # an update of the apply side that needs no input is still fine there
    steps = pytensor.shared(np.int64(0), name="my_steps")
    trainer = compile_accumulation([x], loss, [w], sgd, dict(learning_rate=0.1), every=2,
                                   extra_apply_updates={steps: steps + 1}, **kwargs)
    for b in batches(4):
        trainer.step(b)
    assert int(steps.get_value()) == 2


def test_extra_accumulate_updates_refused_with_exact_batch_norm():
    x = pt.matrix("x")
    gamma, beta = (pytensor.shared(np.full(3, v), name=n) for v, n in ((1.0, "g"), (0.0, "b")))
    mean = pytensor.shared(np.zeros(3), name="bn_mean")
    var = pytensor.shared(np.ones(3), name="bn_var")
    w = pytensor.shared(np.ones(3), name="w")
    loss = (batch_norm(x, gamma, beta, mean, var) * w).sum(axis=1).mean()
    other = pytensor.shared(0.0, name="other")
    with pytest.raises(ValueError, match="batch_norm='exact'"):
        compile_accumulation([x], loss, [w], sgd, dict(learning_rate=0.1), every=2,
                             weight=x.shape[0], batch_norm="exact", mode="CVM",
                             extra_accumulate_updates={other: other + x.sum()})


# ------------------------------------------------------------------------ dropout


def dropout_model(seed=0, p=0.5):
    rng = pytensor.shared(np.random.default_rng(seed), name="dropout_rng")
    W = pytensor.shared(np.linspace(-1, 1, 6).reshape(3, 2), name="W")
    x = pt.matrix("x")
    next_rng, keep = pt.random.bernoulli(1 - p, size=x.shape, rng=rng, return_next_rng=True)
    loss = (((x * keep / (1 - p)) @ W) ** 2).sum(axis=1).mean()
    deterministic = ((x @ W) ** 2).sum(axis=1).mean()
    return rng, W, x, next_rng, keep, loss, deterministic


def advanced(seed, draws, shape, p=0.5):
    """A generator with `seed` after `draws` masks of `shape`, drawn apart from any trainer."""
    rng = pytensor.shared(np.random.default_rng(seed))
    next_rng, keep = pt.random.bernoulli(1 - p, size=shape, rng=rng, return_next_rng=True)
    draw = pytensor.function([], keep, updates={rng: next_rng}, mode="FAST_COMPILE")
    masks = [draw() for _ in range(draws)]
    return rng.get_value().bit_generator.state, masks


def dropout_gradient(W, x, mask, p=0.5):
    """d/dW of mean_i |(x_i * mask_i / (1 - p)) W|^2, in numpy."""
    z = x * mask / (1 - p)
    return 2 * z.T @ (z @ W) / len(x)


def test_dropout_generator_advances_once_per_micro_batch_in_the_trainer():
    rng, W, x, next_rng, keep, loss, deterministic = dropout_model()
    trainer = compile_accumulation([x], loss, [W], sgd, dict(learning_rate=0.1), every=2,
                                   weight=x.shape[0], outputs=[loss, keep], mode="CVM",
                                   extra_accumulate_updates={rng: next_rng})
    evaluate = pytensor.function([x], deterministic, mode="FAST_COMPILE")
    data = [np.arange(6.0).reshape(2, 3) / 5 + i for i in range(4)]
    W0 = W.get_value().copy()
    masks = [trainer.step(b)[1] for b in data]
    state, ref_masks = advanced(0, 4, (2, 3))
    assert rng.get_value().bit_generator.state == state
    for got, ref in zip(masks, ref_masks):
        np.testing.assert_array_equal(got, ref)
    # an evaluation function (no dropout in its graph) leaves the generator alone
    evaluate(data[0])
    assert rng.get_value().bit_generator.state == state
    # the SGD steps used each micro-batch's own mask
    ref = W0.copy()
    for k in (0, 2):
        ref -= 0.1 * np.mean([dropout_gradient(ref, data[i], masks[i]) for i in (k, k + 1)],
                             axis=0)
    np.testing.assert_allclose(W.get_value(), ref, rtol=1e-12)


def test_dropout_generator_in_the_one_function_form():
    rng, W, x, next_rng, keep, loss, deterministic = dropout_model(seed=3)
    updates = lasagne_accum.sgd(loss, [W], learning_rate=0.1, average=2)
    updates[rng] = next_rng
    train = pytensor.function([x], [loss, keep], updates=updates, mode="CVM")
    data = [np.arange(6.0).reshape(2, 3) / 5 - i for i in range(4)]
    W0 = W.get_value().copy()
    masks = [train(b)[1] for b in data]
    state, ref_masks = advanced(3, 4, (2, 3))
    assert rng.get_value().bit_generator.state == state
    for got, ref in zip(masks, ref_masks):
        np.testing.assert_array_equal(got, ref)
    ref = W0.copy()
    for k in (0, 2):
        ref -= 0.1 * np.mean([dropout_gradient(ref, data[i], masks[i]) for i in (k, k + 1)],
                             axis=0)
    np.testing.assert_allclose(W.get_value(), ref, rtol=1e-12)


# ------------------------------------------------------------- generators saved


@pytest.mark.parametrize("kind", ["PCG64", "MT19937", "Philox", "SFC64", "PCG64DXSM"])
def test_a_random_generator_round_trips_through_a_checkpoint(tmp_path, kind):
    gen = pytensor.shared(np.random.Generator(getattr(np.random, kind)(11)), name="gen")
    w = pytensor.shared(np.arange(3.0), name="w")
    lasagne_accum.save_state(tmp_path / "c.npz", [gen, w])
    expected = gen.get_value().random(5)     # what the saved state draws next
    gen.set_value(np.random.default_rng(99))
    lasagne_accum.load_state(tmp_path / "c.npz", [gen, w])
    np.testing.assert_array_equal(gen.get_value().random(5), expected)


def test_a_checkpoint_that_is_not_a_generator_state_is_refused(tmp_path):
    gen = pytensor.shared(np.random.default_rng(0), name="gen")
    w = pytensor.shared(np.arange(3.0), name="w")
    good = {"bit_generator": "PCG64", "state": {"state": 1, "inc": 3},
            "has_uint32": 0, "uinteger": 0}
    for bad in (b"not json", json.dumps({**good, "bit_generator": "os.system"}).encode(),
                json.dumps({"state": 1}).encode(), json.dumps([1, 2]).encode()):
        lasagne_accum.checkpoint.save_arrays(
            tmp_path / "bad.npz", {"gen": np.frombuffer(bad, np.uint8), "w": np.zeros(3)})
        before = gen.get_value().bit_generator.state
        with pytest.raises(ValueError, match="gen: not the state of a numpy random generator"):
            lasagne_accum.load_state(tmp_path / "bad.npz", [gen, w])
        assert gen.get_value().bit_generator.state == before     # nothing loaded
        np.testing.assert_array_equal(w.get_value(), np.arange(3.0))
