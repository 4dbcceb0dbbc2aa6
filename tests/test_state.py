"""Checkpoints: every piece of training state round-trips, bit for bit."""

import os
import zipfile

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import lasagne_accum as la
from lasagne_accum import collect_state, load_state, save_state

MODE = "CVM"


def _model(seed=0, dtype="float64"):
    rng = np.random.RandomState(seed)
    W = pytensor.shared(rng.randn(3, 2).astype(dtype), name="W")
    b = pytensor.shared(np.zeros(2, dtype), name="b")
    x = pt.matrix("x", dtype=dtype)
    y = pt.matrix("y", dtype=dtype)
    loss = ((pt.tanh(x @ W + b) - y) ** 2).mean()
    return x, y, [W, b], loss


def _batches(n, seed=1, dtype="float64"):
    rng = np.random.RandomState(seed)
    return [(rng.randn(k, 3).astype(dtype), rng.randn(k, 2).astype(dtype))
            for k in rng.randint(1, 5, size=n)]


def _values(named):
    return {k: np.array(v.get_value()) for k, v in named.items()}


def _assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert np.array_equal(a[k], b[k]), k


def _trainer(seed=0):
    x, y, params, loss = _model(seed)
    trainer = la.compile_accumulation([x, y], loss, params, la.adam, dict(learning_rate=0.05),
                                      every=3, weight=x.shape[0], mode=MODE)
    return trainer, params


def test_collect_state_names_everything_a_rule_touches():
    x, y, params, loss = _model()
    named = collect_state(la.adam(loss, params))
    assert list(named) == ["W.adam_m", "W.adam_v", "W", "b.adam_m", "b.adam_v", "b", "adam.t"]


def test_collect_state_disambiguates_repeated_names_in_order():
    a = pytensor.shared(0.0, name="t")
    b = pytensor.shared(1.0, name="t")
    c = pytensor.shared(2.0)
    assert list(collect_state([a, b, c])) == ["t", "t#2", "var2"]


def test_collect_state_rejects_other_objects():
    with pytest.raises(TypeError, match="cannot collect state"):
        collect_state(42)


def test_round_trip_restores_values_and_dtypes(tmp_path):
    x, y, params, loss = _model(dtype="float32")
    upd = la.adam(loss, params, 0.1)
    f = pytensor.function([x, y], loss, updates=upd, mode=MODE)
    for xb, yb in _batches(3, dtype="float32"):
        f(xb, yb)
    named = collect_state(upd)
    saved = _values(named)
    path = tmp_path / "ckpt.npz"
    assert save_state(path, upd) == list(named)
    for var in named.values():
        var.set_value(np.zeros_like(var.get_value()))
    load_state(path, upd)
    _assert_bitwise(_values(named), saved)
    with np.load(path, allow_pickle=False) as data:  # no pickle inside
        assert all(data[k].dtype != object for k in data.files)


def test_two_function_form_resumes_mid_window_bit_identical(tmp_path):
    batches = _batches(10)
    reference, _ = _trainer()
    for batch in batches:
        reference.step(*batch)
    reference.flush()
    expected = _values(collect_state(reference))

    first, _ = _trainer()
    for batch in batches[:4]:  # one full window of 3 and one batch of the next
        first.step(*batch)
    assert first.pending == 1
    first.save(tmp_path / "mid.npz")

    resumed, _ = _trainer()
    resumed.load(tmp_path / "mid.npz")
    assert resumed.pending == 1
    for batch in batches[4:]:
        resumed.step(*batch)
    resumed.flush()
    _assert_bitwise(_values(collect_state(resumed)), expected)


def _single(seed=0):
    x, y, params, loss = _model(seed)
    upd = la.momentum(loss, params, 0.05, momentum=0.9, average=3, weight=x.shape[0])
    avg = la.ModelAverage(params, 0.5, 2, 4, updates=upd)
    upd.update(avg.updates)
    return pytensor.function([x, y], loss, updates=upd, mode=MODE), upd, avg


def test_single_function_form_and_model_average_resume_bit_identical(tmp_path):
    batches = _batches(11)
    f, upd, avg = _single()
    for batch in batches:
        f(*batch)
    expected = _values(collect_state(upd, avg))
    with avg.apply():
        expected_avg = [p.get_value().copy() for p in avg.params]

    f1, upd1, avg1 = _single()
    for batch in batches[:5]:  # mid-window: 5 = 3 + 2
        f1(*batch)
    save_state(tmp_path / "single.npz", upd1, avg1)

    f2, upd2, avg2 = _single()
    load_state(tmp_path / "single.npz", upd2, avg2)
    for batch in batches[5:]:
        f2(*batch)
    _assert_bitwise(_values(collect_state(upd2, avg2)), expected)
    with avg2.apply():
        for p, e in zip(avg2.params, expected_avg):
            assert np.array_equal(p.get_value(), e)


def test_mismatched_checkpoint_lists_every_problem_and_loads_nothing(tmp_path):
    x, y, params, loss = _model()
    upd = la.sgd(loss, params, 0.1)
    path = tmp_path / "ckpt.npz"
    save_state(path, upd)

    W2 = pytensor.shared(np.ones((3, 5)), name="W")  # wrong shape
    b2 = pytensor.shared(np.ones(2, dtype="float32"), name="b")  # wrong dtype
    c2 = pytensor.shared(np.ones(1), name="c")  # not in the checkpoint
    before = [v.get_value().copy() for v in (W2, b2, c2)]
    with pytest.raises(ValueError) as info:
        load_state(path, [W2, b2, c2])
    message = str(info.value)
    assert "W: shape (3, 2) in the checkpoint, (3, 5) in the model" in message
    assert "b: dtype float64 in the checkpoint, float32 in the model" in message
    assert "missing in the checkpoint: c" in message
    assert "nothing was loaded" in message
    for v, old in zip((W2, b2, c2), before):
        assert np.array_equal(v.get_value(), old)


def test_extra_names_in_checkpoint_are_reported(tmp_path):
    a = pytensor.shared(np.zeros(2), name="a")
    b = pytensor.shared(np.zeros(2), name="b")
    save_state(tmp_path / "c.npz", [a, b])
    with pytest.raises(ValueError, match="in the checkpoint but not in the model: b"):
        load_state(tmp_path / "c.npz", [a])
    assert load_state(tmp_path / "c.npz", [a], strict=False) == ["a"]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign"])
def test_corrupt_or_foreign_file_is_a_clear_error(tmp_path, damage):
    a = pytensor.shared(np.arange(4.0), name="a")
    path = tmp_path / "c.npz"
    save_state(path, [a])
    if damage == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint at all")
    else:
        np.savez(path, a=np.zeros(4))  # a valid npz, but not ours
    a.set_value(np.full(4, 7.0))
    with pytest.raises(ValueError, match="checkpoint"):
        load_state(path, [a])
    assert np.array_equal(a.get_value(), np.full(4, 7.0))


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    a = pytensor.shared(np.arange(4.0), name="a")
    path = tmp_path / "c.npz"
    save_state(path, [a])
    original = path.read_bytes()

    def crash(fh, **arrays):
        fh.write(b"PK partial")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", crash)
    a.set_value(np.zeros(4))
    with pytest.raises(OSError, match="disk full"):
        save_state(path, [a])
    assert path.read_bytes() == original
    assert os.listdir(tmp_path) == ["c.npz"]  # no temporary file left behind
    monkeypatch.undo()
    load_state(path, [a])
    assert np.array_equal(a.get_value(), np.arange(4.0))
    with zipfile.ZipFile(path) as z:
        assert sorted(z.namelist()) == ["__lasagne_accum_state__.npy", "a.npy"]
