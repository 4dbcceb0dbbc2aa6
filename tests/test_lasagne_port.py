"""The Lasagne page's complete port (docs/lasagne.rst, "A complete port"), run as written.

The page shows the port as code blocks (a full training script is too long for a
doctest); these tests read the blocks from the page and execute them on small data, so
the page cannot drift from what runs: the script trains (the loss falls), its dropout
generator advances by exactly its two draws per micro-batch, ``trainer.save``/``load`` and
``load_state`` restore the parameters, running statistics and generator exactly, the old
Lasagne checkpoint is read into the right variables, and ``dense()`` draws Lasagne's
``GlorotUniform`` values bit for bit from the same ``RandomState``. The page's claim about
running statistics at small micro-batches is checked here too.
"""

import re
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import lasagne_accum as la

PAGE = Path(__file__).resolve().parent.parent / "docs" / "lasagne.rst"
SIZES = "N, BATCH, NUM_EPOCHS = 4, 125, 10"
SMALL = "N, BATCH, NUM_EPOCHS = 2, 16, 4"
N_TRAIN, N_VAL = 160, 80


def port_blocks():
    """The ``code-block:: python`` bodies of the page's "A complete port" section."""
    text = PAGE.read_text()
    section = text[text.index("\nA complete port\n"):]
    blocks = []
    for match in re.finditer(r"^\.\. code-block:: python\n\n((?:   .*\n|\n)+)", section, re.M):
        lines = [line[3:] for line in match.group(1).splitlines()]
        blocks.append("\n".join(lines).strip() + "\n")
    assert len(blocks) == 3, "the script, the loading lines, the old Lasagne checkpoint"
    return blocks


def digits_like(seed=0):
    """Ten noisy prototypes of 64 features in [0, 1], int32 labels (the digits' sizes)."""
    rng = np.random.default_rng(seed)
    prototypes = rng.random((10, 64))
    y = rng.integers(0, 10, N_TRAIN + N_VAL).astype("int32")
    X = np.clip(prototypes[y] + rng.normal(0, 0.3, (len(y), 64)), 0, 1)
    return X[:N_TRAIN], y[:N_TRAIN], X[N_TRAIN:], y[N_TRAIN:]


@pytest.fixture()
def trained(tmp_path, monkeypatch, capsys):
    """The page's script run on small data in `tmp_path`: its namespace and printed lines."""
    script, _, _ = port_blocks()
    assert SIZES in script
    monkeypatch.chdir(tmp_path)
    data = digits_like()
    ns = {"load_dataset": lambda: data}
    exec(compile(script.replace(SIZES, SMALL), f"{PAGE}:port", "exec"), ns)
    return ns, capsys.readouterr().out.splitlines()


def test_the_port_trains_draws_once_per_micro_batch_and_reloads_exactly(trained):
    ns, lines = trained
    trainer, srng = ns["trainer"], ns["srng"]
    # it trains: four epochs of ten micro-batches, a step every two
    assert len(lines) == 4
    numbers = [[float(v) for v in re.findall(r"(\d+\.\d+)", line)] for line in lines]
    train_loss, val_loss = [n[0] for n in numbers], [n[1] for n in numbers]
    assert train_loss[-1] < 0.5 * train_loss[0]
    assert val_loss[-1] < val_loss[0]
    assert numbers[-1][2] > 80.0                          # accuracy, %, of ten classes
    assert trainer.steps == 4 * (N_TRAIN // 16) // 2

    # the generator advanced by the two dropout draws of each micro-batch, exactly
    ref = pytensor.shared(np.random.default_rng(1))       # the script's seed
    next1, keep1 = pt.random.bernoulli(0.8, size=(16, 64), rng=ref, return_next_rng=True)
    next2, keep2 = pt.random.bernoulli(0.5, size=(16, 800), rng=next1, return_next_rng=True)
    # both masks are outputs: PyTensor drops a draw whose values nothing uses, and the
    # generator then does not advance for it
    draw = pytensor.function([], [keep1, keep2], updates={ref: next2})
    for _ in range(4 * (N_TRAIN // 16)):                  # epochs x micro-batches
        draw()
    assert srng.get_value().bit_generator.state == ref.get_value().bit_generator.state
    X_val, y_val = digits_like()[2:]
    first = ns["val_fn"](X_val, y_val)
    assert srng.get_value().bit_generator.state == ref.get_value().bit_generator.state
    assert [float(v) for v in ns["val_fn"](X_val, y_val)] == [float(v) for v in first]

    # trainer.load and load_state put back what the script saved
    _, load_block, _ = port_blocks()
    resume, evaluate = load_block.strip().splitlines()
    kept = [*ns["params"], ns["mean"], ns["var"]]
    saved = {v.name: v.get_value() for v in kept}
    adam = [v for v in trainer.apply_updates if "adam" in (v.name or "")]
    saved_adam = {v.name: v.get_value() for v in adam}
    saved_rng = srng.get_value().bit_generator.state
    X, y = digits_like()[:2]
    for i in range(3):                                    # move everything on
        trainer.step(X[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)])
    assert not np.array_equal(ns["W1"].get_value(), saved["hidden.W"])
    assert trainer.pending == 1
    exec(resume, ns)
    assert ns["meta"] == {"epoch": 4}
    for v in kept:
        assert np.array_equal(v.get_value(), saved[v.name]), v.name
    for v in adam:
        assert np.array_equal(v.get_value(), saved_adam[v.name]), v.name
    assert srng.get_value().bit_generator.state == saved_rng
    assert trainer.pending == 0
    assert [float(v) for v in ns["val_fn"](X_val, y_val)] == [float(v) for v in first]

    for v in kept:                                        # evaluation only
        v.set_value(np.zeros_like(v.get_value()))
    exec(evaluate, ns)
    for v in kept:
        assert np.array_equal(v.get_value(), saved[v.name]), v.name


def test_the_old_run_lines(trained, tmp_path, monkeypatch):
    ns, _ = trained
    # an old Lasagne checkpoint is read into the right variables
    _, _, old_block = port_blocks()
    rng = np.random.default_rng(3)
    # get_all_param_values(network) of the Lasagne MLP: DenseLayer W, b; BatchNormLayer
    # beta, gamma, mean, inv_std; DenseLayer W, b
    shapes = [(64, 800), (800,), (800,), (800,), (800,), (800,), (800, 10), (10,)]
    values = [rng.normal(size=s) for s in shapes]
    values[5] = rng.uniform(0.5, 3, size=800)
    old = tmp_path / "lasagne"
    old.mkdir()
    np.savez(old / "model.npz", *values)
    monkeypatch.chdir(old)
    exec(old_block, ns)
    for name, i in (("W1", 0), ("b1", 1), ("beta", 2), ("gamma", 3), ("mean", 4), ("W2", 6),
                    ("b2", 7)):
        assert np.array_equal(ns[name].get_value(), values[i]), name
    np.testing.assert_allclose(1 / np.sqrt(ns["var"].get_value() + 1e-4), values[5],
                               rtol=1e-12)

    # dense() draws Lasagne's GlorotUniform values bit for bit from the same RandomState
    def lasagne_glorot_uniform(rs, shape, gain=1.0):
        # lasagne.init.Glorot.sample and Uniform(std=...).sample, as Lasagne computes them
        n1, n2 = shape[:2]
        receptive_field_size = np.prod(shape[2:])
        std = gain * np.sqrt(2.0 / ((n1 + n2) * receptive_field_size))
        a, b = 0.0 - np.sqrt(3) * std, 0.0 + np.sqrt(3) * std
        return rs.uniform(low=a, high=b, size=shape)

    ns["init"] = np.random.RandomState(1234)
    W, b = ns["dense"](64, 800, "check")
    expected = lasagne_glorot_uniform(np.random.RandomState(1234), (64, 800))
    assert np.array_equal(W.get_value(), expected)
    assert np.abs(W.get_value()).max() <= np.sqrt(6 / (64 + 800))
    assert not b.get_value().any()


def test_running_var_does_not_depend_on_the_micro_batch_lasagne_inv_std_does():
    """The page: Lasagne's running inv_std, an average of 1 / sqrt(biased var + eps), grows
    as the batch shrinks; running_var, an average of unbiased variances, does not."""
    sigma = 2.0
    x = pt.matrix("x")
    running = {}
    for size in (4, 32):
        rm = pytensor.shared(np.zeros(50), name="rm")
        rv = pytensor.shared(np.ones(50), name="rv")
        out = la.batch_norm(x, pytensor.shared(np.ones(50)), pytensor.shared(np.zeros(50)),
                            rm, rv, epsilon=1e-4)
        step = pytensor.function([x], [], updates=la.batch_norm_updates(out))
        data = np.random.default_rng(size)
        inv_std, seen = np.ones(50), []
        for i in range(400):
            xb = data.normal(1.0, sigma, (size, 50))
            step(xb)
            inv_std = 0.9 * inv_std + 0.1 / np.sqrt(xb.var(axis=0) + 1e-4)   # Lasagne's
            if i >= 100:
                seen.append((rv.get_value().mean(), inv_std.mean()))
        running[size] = np.mean(seen, axis=0)
    for size in (4, 32):
        assert abs(running[size][0] / sigma ** 2 - 1) < 0.05, running
    assert running[4][1] * sigma > 1.4                   # 1.6 in expectation
    assert abs(running[32][1] * sigma - 1) < 0.1
    assert running[4][1] / running[32][1] > 1.3
