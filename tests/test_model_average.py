"""Tests of ModelAverage and ExponentialMovingAverage (lasagne_accum.model_average).

ModelAverage is checked against an independent numpy re-implementation of
PaddlePaddle's ``average_accumulates`` kernel (``PaddleWindowRef`` below),
executed sequentially per optimizer step:

    num_updates += 1; num_accumulates += 1; sum_1 += param
    if num_updates % max_num_accumulates == 0: sum_2 += sum_1; sum_1 = 0
    if num_accumulates >= min_average_window and
       num_accumulates >= min(max_average_window,
                              int(float32(num_updates) * float32(rate))):
        sum_3 = sum_1 + sum_2; sum_1 = sum_2 = 0
        old_num_accumulates = num_accumulates; num_accumulates = 0
    average = (sum_1 + sum_2 + sum_3) / (num_accumulates + old_num_accumulates)
"""

import time
from collections import OrderedDict

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from lasagne_accum import (
    ExponentialMovingAverage,
    ModelAverage,
    accumulate_gradients,
    sgd,
    with_accumulated_gradients,
)

MODE = "CVM"  # C VM: compiles once into the on-disk cache, fast to call


# --------------------------------------------------------------------------
# independent references
# --------------------------------------------------------------------------


class PaddleWindowRef:
    """Sequential numpy version of Paddle's average_accumulates, float64 sums."""

    def __init__(self, shapes, rate, min_window, max_window, max_num_accumulates=16384):
        self.rate = rate
        self.min_window = min_window
        self.max_window = max_window
        self.max_num_accumulates = max_num_accumulates
        self.num_updates = 0
        self.num_accumulates = 0
        self.old_num_accumulates = 0
        self.sums = [[np.zeros(s, np.float64) for _ in range(3)] for s in shapes]

    def step(self, values):
        self.num_updates += 1
        self.num_accumulates += 1
        for sums, v in zip(self.sums, values):
            sums[0] = sums[0] + np.asarray(v, np.float64)
        if self.num_updates % self.max_num_accumulates == 0:
            for sums in self.sums:
                sums[1] = sums[1] + sums[0]
                sums[0] = np.zeros_like(sums[0])
        limit = min(self.max_window, int(np.float32(self.num_updates) * np.float32(self.rate)))
        closed = self.num_accumulates >= self.min_window and self.num_accumulates >= limit
        if closed:
            for sums in self.sums:
                sums[2] = sums[0] + sums[1]
                sums[0] = np.zeros_like(sums[0])
                sums[1] = np.zeros_like(sums[1])
            self.old_num_accumulates = self.num_accumulates
            self.num_accumulates = 0
        return closed

    def counters(self):
        return (self.num_updates, self.num_accumulates, self.old_num_accumulates)

    def averages(self):
        n = self.num_accumulates + self.old_num_accumulates
        return [(s[0] + s[1] + s[2]) / n for s in self.sums]


def lib_counters(ma):
    return (int(ma.num_updates.get_value()), int(ma.num_accumulates.get_value()),
            int(ma.old_num_accumulates.get_value()))


def check_against_ref(ma, ref, where, avg_rtol=1e-12):
    assert lib_counters(ma) == ref.counters(), where
    for i, (lib_sums, ref_sums) in enumerate(zip(ma.sums, ref.sums)):
        for k in range(3):
            np.testing.assert_allclose(lib_sums[k].get_value(), ref_sums[k], rtol=1e-12,
                                       atol=1e-12, err_msg=f"{where}: param {i} sum_{k + 1}")
    if ref.num_accumulates + ref.old_num_accumulates:
        for i, (p, a, r) in enumerate(zip(ma.params, ma.averages(), ref.averages())):
            assert a.dtype == p.get_value().dtype, where
            np.testing.assert_allclose(a, r, rtol=avg_rtol, atol=avg_rtol,
                                       err_msg=f"{where}: average of param {i}")


def shared(value, name):
    return pytensor.shared(np.asarray(value), name=name)


# --------------------------------------------------------------------------
# 1. stepped alongside the reference
# --------------------------------------------------------------------------

WINDOWS = [
    # rate, min, max, max_num_accumulates
    (0.5, 2, 4, 7),
    (0.0, 3, 10, 7),      # rate 0: fixed windows of min steps
    (0.0, 0, 5, 16384),   # rate 0, min 0: every step closes a window
    (1.0, 3, 50, 7),      # rate 1
    (0.15, 10, 10, 7),    # min == max
    (0.3, 0, 40, 16384),  # min 0
    (0.2, 5, 30, 1),      # sum_1 moves into sum_2 on every step
    (0.05, 20, 200, 13),
]


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: "r{}-min{}-max{}-mna{}".format(*w))
@pytest.mark.parametrize("form", ["assigned", "pre_step", "sgd"])
def test_model_average_matches_paddle_reference(window, form):
    rate, lo, hi, mna = window
    rng = np.random.default_rng(100 * WINDOWS.index(window) + len(form))
    w64 = shared(rng.standard_normal((2, 3)), "w64")
    w32 = shared(rng.standard_normal(4).astype(np.float32), "w32")
    params = [w64, w32]
    x64, x32 = pt.matrix("x64", dtype="float64"), pt.vector("x32", dtype="float32")
    if form == "sgd":
        loss = ((w64 - x64) ** 2).sum() + ((w32 - x32) ** 2).sum()
        upd = sgd(loss, params, 0.3)
    else:
        upd = {w64: x64, w32: x32}
    ma = ModelAverage(params, rate, lo, hi, max_num_accumulates=mna,
                      updates=None if form == "pre_step" else upd)
    fn = pytensor.function([x64, x32], [], updates={**upd, **ma.updates}, mode=MODE)
    ref = PaddleWindowRef([(2, 3), (4,)], rate, lo, hi, mna)

    closes = 0
    for t in range(1, 401):
        a64 = rng.standard_normal((2, 3))
        a32 = rng.standard_normal(4).astype(np.float32)
        before = [p.get_value() for p in params]
        fn(a64, a32)
        after = [p.get_value() for p in params]
        if form == "assigned":
            np.testing.assert_array_equal(after[0], a64)
            np.testing.assert_array_equal(after[1], a32)
        closes += ref.step(before if form == "pre_step" else after)
        # averages() is float32 for the float32 param
        check_against_ref(ma, ref, f"{form} step {t}", avg_rtol=2e-6)
    assert closes > 3  # the windows really did close along the way


# --------------------------------------------------------------------------
# 2. hand-checked window closes (value added at step t is t)
# --------------------------------------------------------------------------


def _counting_setup(rate, lo, hi, mode):
    w = shared(np.zeros(1), "w")
    t = shared(np.int64(0), "t")
    upd = {w: pt.cast(t + 1, "float64") * pt.ones_like(w), t: t + 1}
    ma = ModelAverage([w], rate, lo, hi, updates=upd)
    fn = pytensor.function([], [], updates={**upd, **ma.updates}, mode=mode)
    return w, ma, fn


@pytest.mark.parametrize("mode", [MODE, None], ids=["cvm", "default"])
def test_window_closes_rate_half_min2_max4(mode):
    w, ma, fn = _counting_setup(0.5, 2, 4, mode)
    closes, olds, avgs = [], {}, {}
    for t in range(1, 13):
        fn()
        assert w.get_value()[0] == t
        nu, na, old = lib_counters(ma)
        assert nu == t
        if na == 0:
            closes.append(t)
            olds[t] = old
        avgs[t] = ma.averages()[0][0]
    assert closes == [2, 4, 7, 11]
    assert olds == {2: 2, 4: 2, 7: 3, 11: 4}
    # hand-computed averages (current partial window + last closed one)
    assert avgs[1] == 1.0            # 1 / 1
    assert avgs[2] == 1.5            # (1 + 2) / 2
    assert avgs[3] == 2.0            # (3 + [1 + 2]) / 3
    assert avgs[4] == 3.5            # (3 + 4) / 2
    assert avgs[5] == 4.0            # (5 + [3 + 4]) / 3
    assert avgs[7] == 6.0            # (5 + 6 + 7) / 3
    assert avgs[11] == 9.5           # (8 + 9 + 10 + 11) / 4
    assert avgs[12] == 10.0          # (12 + [8 + ... + 11]) / 5
    s1, s2, s3 = (s.get_value()[0] for s in ma.sums[0])
    assert (s1 + s2, s3) == (12.0, 38.0)


def test_window_closes_rate_015_min2_max10():
    w, ma, fn = _counting_setup(0.15, 2, 10, MODE)
    closes = []
    for t in range(1, 22):
        fn()
        if lib_counters(ma)[1] == 0:
            closes.append(t)
    # every 2 steps while int(0.15 * t) <= 2; at t = 20 the limit is
    # int(float32(20) * float32(0.15)) = 3, so the window closes at 21 instead
    assert closes == [2, 4, 6, 8, 10, 12, 14, 16, 18, 21]
    assert lib_counters(ma) == (21, 0, 3)
    assert ma.averages()[0][0] == 20.0  # (19 + 20 + 21) / 3


# --------------------------------------------------------------------------
# 3. precision over 10**6 float32 updates
# --------------------------------------------------------------------------


def test_precision_million_float32_updates():
    n_steps = 10**6
    rate, lo, hi = 0.3, 10**5, 10**6
    offsets = np.arange(3, dtype=np.float32)
    # 1 + 1e-3 sin(t) (unbiased rounding), and 1.0001 + 1e-5 sin(t), whose
    # float32 accumulation rounds the same way every step (detects float32 sums)
    base = np.array([1, 1, 1.0001], np.float32)
    amp = np.array([1e-3, 1e-3, 1e-5], np.float32)
    w = shared(np.ones(3, np.float32), "w")
    t = shared(np.int64(0), "t")
    t_new = t + 1
    value = base + amp * pt.sin(pt.cast(t_new, "float32") + offsets)
    upd = {w: pt.cast(value, "float32"), t: t_new}
    ma_big = ModelAverage([w], rate, lo, hi, updates=upd, name="ma_default")
    ma_small = ModelAverage([w], rate, lo, hi, max_num_accumulates=100, updates=upd,
                            name="ma_small")
    # control: float32 sums, which the default float64 sums are there to avoid
    ma_f32 = ModelAverage([w], rate, lo, hi, updates=upd, sum_dtype="float32", name="ma_f32")
    fn = pytensor.function(
        [], [], updates={**upd, **ma_big.updates, **ma_small.updates, **ma_f32.updates},
        mode=MODE)

    # the exact values the graph adds, and their float64 prefix sums
    steps = np.arange(1, n_steps + 1, dtype=np.float32)
    values = (base + amp * np.sin(steps[:, None] + offsets[None, :])).astype(np.float32)
    assert values.dtype == np.float32
    prefix = np.concatenate([np.zeros((1, 3)), np.cumsum(values.astype(np.float64), axis=0)])

    # counters do not depend on max_num_accumulates: one reference serves all
    ref = PaddleWindowRef([], rate, lo, hi)
    checkpoints = set(range(50_000, n_steps + 1, 50_000)) | {100_000 - 1, 100_000 + 1}
    start = time.perf_counter()
    n_checked = 0
    for step in range(1, n_steps + 1):
        fn()
        ref.step([])
        if step in checkpoints:
            n_checked += 1
            for ma in (ma_big, ma_small):
                assert lib_counters(ma) == ref.counters(), (ma.name, step)
                n = ref.num_accumulates + ref.old_num_accumulates
                exact = (prefix[step] - prefix[step - n]) / n
                avg = ma.averages()[0]
                assert avg.dtype == np.float32
                np.testing.assert_allclose(avg, exact, rtol=1e-6, atol=0,
                                           err_msg=f"{ma.name} at step {step}, window {n}")
    elapsed = time.perf_counter() - start
    assert n_checked == len(checkpoints)
    assert int(t.get_value()) == n_steps
    np.testing.assert_allclose(w.get_value(), values[-1], rtol=1e-6)
    # the final average spans a long window (last closed + current)
    n = sum(ref.counters()[1:])
    assert n > 2 * 10**5
    # the check is sensitive: float32 sums drift far beyond 1e-6 here
    assert lib_counters(ma_f32) == ref.counters()
    exact = (prefix[n_steps] - prefix[n_steps - n]) / n
    assert np.max(np.abs(ma_f32.averages()[0] / exact - 1)) > 1e-5
    # no wall-clock assertion (flaky on a loaded machine); shown with -s
    print(f"\n{n_steps} calls in {elapsed:.1f} s: {elapsed / n_steps * 1e6:.1f} us per call "
          "(including the reference counters)")


# --------------------------------------------------------------------------
# 4. apply() / restore()
# --------------------------------------------------------------------------


def _trained(kind, n_steps=5):
    """`n_steps` steps of the average `kind` of AVERAGES over two parameters.

    Returns the average, the parameters, the values set at each step, a copy
    of the trained values and the averages.
    """
    avg_cls, kwargs = AVERAGES[kind]
    rng = np.random.default_rng(7)
    w64 = shared(rng.standard_normal((3, 2)), "w64")
    w32 = shared(rng.standard_normal(5).astype(np.float32), "w32")
    x64, x32 = pt.matrix("x64", dtype="float64"), pt.vector("x32", dtype="float32")
    upd = {w64: x64, w32: x32}
    avg = avg_cls([w64, w32], updates=upd, **kwargs)
    fn = pytensor.function([x64, x32], [], updates={**upd, **avg.updates}, mode=MODE)
    history = []
    for _ in range(n_steps):
        a64 = rng.standard_normal((3, 2))
        a32 = rng.standard_normal(5).astype(np.float32)
        fn(a64, a32)
        history.append((a64, a32))
    params = [w64, w32]
    return avg, params, history, _snapshot(params), avg.averages()


AVERAGES = {
    "model_average": (ModelAverage, dict(average_window_rate=0.5, min_average_window=2,
                                         max_average_window=4)),
    "ema": (ExponentialMovingAverage, dict(decay=0.9)),
}


def _snapshot(params):
    return [np.array(p.get_value(), copy=True) for p in params]


def _assert_bitwise(params, saved):
    for p, s in zip(params, saved):
        value = p.get_value()
        assert value.dtype == s.dtype
        assert np.array_equal(value, s)


@pytest.mark.parametrize("kind", list(AVERAGES))
def test_apply_context_swaps_and_restores_bitwise(kind):
    avg, params, history, trained, expected = _trained(kind)
    assert not any(np.array_equal(e, t) for e, t in zip(expected, trained))
    with avg.apply() as ctx:
        assert ctx is avg and avg.applied
        for p, e in zip(params, expected):
            assert p.get_value().dtype == e.dtype
            np.testing.assert_array_equal(p.get_value(), e)
    assert not avg.applied
    _assert_bitwise(params, trained)
    if kind == "model_average":
        # 5 steps, windows close at 2 and 4: average of steps 3, 4, 5
        for i, e in enumerate(expected):
            ref = np.mean([h[i] for h in history[2:]], axis=0, dtype=np.float64)
            np.testing.assert_allclose(e, ref, rtol=1e-6)


@pytest.mark.parametrize("kind", list(AVERAGES))
def test_apply_need_restore_false_and_exception(kind):
    avg, params, _, trained, expected = _trained(kind)

    with avg.apply(need_restore=False):
        pass
    assert avg.applied
    for p, e in zip(params, expected):
        np.testing.assert_array_equal(p.get_value(), e)
    avg.restore()
    assert not avg.applied
    _assert_bitwise(params, trained)

    avg.apply(need_restore=False)  # plain call, no with-block
    np.testing.assert_array_equal(params[0].get_value(), expected[0])
    avg.restore()
    _assert_bitwise(params, trained)

    with pytest.raises(ZeroDivisionError):
        with avg.apply():
            np.testing.assert_array_equal(params[1].get_value(), expected[1])
            1 / 0
    assert not avg.applied
    _assert_bitwise(params, trained)


@pytest.mark.parametrize("kind", list(AVERAGES))
def test_nested_apply_and_restore_without_apply_raise(kind):
    avg, params, _, trained, expected = _trained(kind)
    with pytest.raises(RuntimeError, match="restore"):
        avg.restore()
    _assert_bitwise(params, trained)
    with avg.apply():
        with pytest.raises(RuntimeError, match="already applied"):
            avg.apply()
        # the failed nested apply changed nothing; still averaged
        np.testing.assert_array_equal(params[0].get_value(), expected[0])
        assert avg.applied
    _assert_bitwise(params, trained)
    with pytest.raises(RuntimeError):
        avg.restore()


def test_model_average_apply_before_any_step_raises():
    w = shared(np.array([1.5, -2.0], np.float32), "w")
    saved = _snapshot([w])
    ma = ModelAverage([w], 0.5, 2, 4, updates={w: w * 2})
    with pytest.raises(RuntimeError, match="no optimizer step"):
        ma.apply()
    with pytest.raises(RuntimeError, match="no optimizer step"):
        with ma.apply():
            pass
    with pytest.raises(RuntimeError, match="no optimizer step"):
        ma.averages()
    assert not ma.applied
    _assert_bitwise([w], saved)
    with pytest.raises(RuntimeError):
        ma.restore()


def test_ema_apply_before_any_step_raises():
    w = shared(np.array([1.5, -2.0], np.float32), "w")
    ema = ExponentialMovingAverage([w], 0.9, updates={w: w * 2})
    with pytest.raises(RuntimeError, match="no optimizer step"):
        ema.apply()
    assert np.array_equal(w.get_value(), np.array([1.5, -2.0], np.float32))


# --------------------------------------------------------------------------
# 5. bad input
# --------------------------------------------------------------------------


def test_model_average_rejects_bad_arguments():
    w = shared(np.zeros(2), "w_bad")
    v = shared(np.zeros(3), "v_missing")
    for rate in (-0.1, 1.5, -1e-9, 1.0 + 1e-9, float("nan")):
        with pytest.raises(ValueError, match="average_window_rate"):
            ModelAverage([w], rate, 2, 4)
    with pytest.raises(ValueError, match="must not exceed"):
        ModelAverage([w], 0.5, 5, 3)
    with pytest.raises(ValueError, match="min_average_window"):
        ModelAverage([w], 0.5, -1, 3)
    with pytest.raises(ValueError, match="max_num_accumulates"):
        ModelAverage([w], 0.5, 2, 4, max_num_accumulates=0)
    for bad in (dict(min_average_window=2.5), dict(max_average_window="10"),
                dict(min_average_window=True), dict(max_num_accumulates=100.0),
                dict(max_average_window=None)):
        kwargs = dict(average_window_rate=0.5, min_average_window=2, max_average_window=4)
        kwargs.update(bad)
        with pytest.raises(TypeError, match="integer"):
            ModelAverage([w], **kwargs)
    with pytest.raises(ValueError, match="v_missing"):
        ModelAverage([w, v], 0.5, 2, 4, updates={w: w + 1})
    with pytest.raises(ValueError, match="v_missing"):
        ExponentialMovingAverage([w, v], 0.9, updates={w: w + 1})
    for decay in (-0.1, 1.5):
        with pytest.raises(ValueError, match="decay"):
            ExponentialMovingAverage([w], decay)
    # numpy integers are fine, and the boundary rates 0 and 1
    ma = ModelAverage([w], 1.0, np.int64(0), np.int32(3))
    assert (ma.min_average_window, ma.max_average_window) == (0, 3)
    ModelAverage([w], 0, 2, 2)


# --------------------------------------------------------------------------
# 6. gradient accumulation: two-function and single-function forms
# --------------------------------------------------------------------------


def _quadratic(rng):
    w = shared(rng.standard_normal(3), "w")
    b = shared(np.float32(0.5), "b")
    x = pt.vector("x", dtype="float64")
    loss = ((w - x) ** 2).sum() + (pt.cast(b, "float64") - x.sum()) ** 2
    return [w, b], x, loss


def _two_function_average(rng, *window, **kwargs):
    """The README's two-function form of sgd on `_quadratic`, a ModelAverage in its apply.

    Returns the parameters, the accumulate function (``x -> loss``), the
    apply function and the average.
    """
    params, x, loss = _quadratic(rng)
    accu, reset = accumulate_gradients(loss, params)
    apply = sgd(accu.grads, params, 0.1)
    apply.update(reset)
    ma = ModelAverage(params, *window, updates=apply, **kwargs)
    apply.update(ma.updates)
    step_fn = pytensor.function([x], loss, updates=accu, mode=MODE)
    apply_fn = pytensor.function([], [], updates=apply, mode=MODE)
    return params, step_fn, apply_fn, ma


def test_two_function_form_counts_apply_calls():
    rng = np.random.default_rng(3)
    params, step_fn, apply_fn, ma = _two_function_average(rng, 0.5, 1, 3, max_num_accumulates=2)
    ref = PaddleWindowRef([(3,), ()], 0.5, 1, 3, 2)
    for k in range(1, 13):
        for _ in range(4):
            step_fn(rng.standard_normal(3))
            assert int(ma.num_updates.get_value()) == k - 1
        apply_fn()
        ref.step([p.get_value() for p in params])
        assert int(ma.num_updates.get_value()) == k
        check_against_ref(ma, ref, f"apply {k}", avg_rtol=2e-6)


def _single_function_updates(variant, loss, params):
    if variant == "sgd_average":
        return sgd(loss, params, 0.1, average=3)
    return with_accumulated_gradients(loss, params, 3, sgd, learning_rate=0.1,
                                      lazy=variant == "lazy")


@pytest.mark.parametrize("variant", ["sgd_average", "lazy", "switch"])
def test_single_function_form_averages_steps_only(variant):
    rng = np.random.default_rng(4)
    params, x, loss = _quadratic(rng)
    upd = _single_function_updates(variant, loss, params)
    assert upd.is_step is not None
    ma = ModelAverage(params, 0.5, 2, 4, max_num_accumulates=5, updates=upd)
    upd.update(ma.updates)
    fn = pytensor.function([x], loss, updates=upd, mode=MODE)
    ref = PaddleWindowRef([(3,), ()], 0.5, 2, 4, 5)
    post_step = []
    for call in range(1, 31):
        before = [p.get_value() for p in params]
        fn(rng.standard_normal(3))
        after = [p.get_value() for p in params]
        if call % 3 == 0:
            assert not np.array_equal(before[0], after[0])
            post_step.append([np.asarray(v, np.float64) for v in after])
            ref.step(after)
        else:
            np.testing.assert_array_equal(before[0], after[0])
        assert int(ma.num_updates.get_value()) == call // 3
        check_against_ref(ma, ref, f"call {call}", avg_rtol=2e-6)
        if call == 9:
            # 3 steps; window closes at step 2: sum_3 = v1 + v2, sum_1 = v3
            assert lib_counters(ma) == (3, 1, 2)
            for i in range(2):
                s1, s2, s3 = (s.get_value() for s in ma.sums[i])
                np.testing.assert_allclose(s1 + s2, post_step[2][i], rtol=1e-12)
                np.testing.assert_allclose(s3, post_step[0][i] + post_step[1][i],
                                           rtol=1e-12)
                np.testing.assert_allclose(
                    ma.averages()[i], np.mean([v[i] for v in post_step], axis=0),
                    rtol=2e-6)


# --------------------------------------------------------------------------
# 7. ExponentialMovingAverage
# --------------------------------------------------------------------------


def _ema_ref_step(shadows, values, t, decay, warmup):
    d = min(decay, (1 + t) / (10 + t)) if warmup else decay
    return [d * s + (1 - d) * np.asarray(v, np.float64) for s, v in zip(shadows, values)]


@pytest.mark.parametrize("warmup,decay", [(False, 0.9), (True, 0.99), (True, 0.5)])
@pytest.mark.parametrize("form", ["assigned", "pre_step"])
def test_ema_matches_reference(warmup, decay, form):
    rng = np.random.default_rng(11)
    w64 = shared(rng.standard_normal((2, 2)), "w64")
    w32 = shared(rng.standard_normal(3).astype(np.float32), "w32")
    params = [w64, w32]
    x64, x32 = pt.matrix("x64", dtype="float64"), pt.vector("x32", dtype="float32")
    upd = {w64: x64, w32: x32}
    ema = ExponentialMovingAverage(params, decay, warmup=warmup,
                                   updates=upd if form == "assigned" else None)
    assert [s.get_value().dtype for s in ema.shadows] == [np.float64, np.float32]
    fn = pytensor.function([x64, x32], [], updates={**upd, **ema.updates}, mode=MODE)
    shadows = [np.asarray(p.get_value(), np.float64) for p in params]
    for t in range(1, 51):
        before = [p.get_value() for p in params]
        fn(rng.standard_normal((2, 2)), rng.standard_normal(3).astype(np.float32))
        after = [p.get_value() for p in params]
        shadows = _ema_ref_step(shadows, after if form == "assigned" else before,
                                t, decay, warmup)
        assert int(ema.num_updates.get_value()) == t
        got = ema.averages()
        assert got[1].dtype == np.float32
        np.testing.assert_allclose(got[0], shadows[0], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(got[1], shadows[1], rtol=1e-5, atol=1e-6)


def test_ema_docstring_example_numbers():
    w = shared(np.array([0.0]), "w")
    ema = ExponentialMovingAverage([w], decay=0.5)
    fn = pytensor.function([], [], updates={w: w + 1, **ema.updates}, mode=MODE)
    fn()
    fn()
    with ema.apply():
        np.testing.assert_array_equal(w.get_value(), [0.5])  # adds 0 then 1
    np.testing.assert_array_equal(w.get_value(), [2.0])
    # warmup: step 1 uses d = min(0.99, 2/11)
    w2 = shared(np.array([1.0]), "w2")
    ema2 = ExponentialMovingAverage([w2], 0.99, warmup=True, updates={w2: w2 * 0 + 12.0})
    pytensor.function([], [], updates={w2: w2 * 0 + 12.0, **ema2.updates}, mode=MODE)()
    np.testing.assert_allclose(ema2.averages()[0], [2 / 11 * 1.0 + 9 / 11 * 12.0], rtol=1e-15)


@pytest.mark.parametrize("variant", ["sgd_average", "lazy", "switch"])
@pytest.mark.parametrize("warmup", [False, True])
def test_ema_gated_by_single_function_steps(variant, warmup):
    rng = np.random.default_rng(5)
    params, x, loss = _quadratic(rng)
    upd = _single_function_updates(variant, loss, params)
    ema = ExponentialMovingAverage(params, 0.8, warmup=warmup, updates=upd)
    upd.update(ema.updates)
    fn = pytensor.function([x], loss, updates=upd, mode=MODE)
    shadows = [np.asarray(p.get_value(), np.float64) for p in params]
    for call in range(1, 31):
        fn(rng.standard_normal(3))
        if call % 3 == 0:
            shadows = _ema_ref_step(shadows, [p.get_value() for p in params], call // 3,
                                    0.8, warmup)
        assert int(ema.num_updates.get_value()) == call // 3
        got = ema.averages()
        np.testing.assert_allclose(got[0], shadows[0], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(got[1], shadows[1], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# host_mode: buffers kept in host memory, advanced by step()
# --------------------------------------------------------------------------


def test_host_mode_keeps_buffers_on_host_and_matches_reference():
    w = shared(np.array([0.0, 10.0]), "w_host")
    ma = ModelAverage([w], 0.5, 2, 4, host_mode="NUMBA")
    ema = ExponentialMovingAverage([w], 0.5, host_mode="CVM")
    assert ma.updates == {} and ema.updates == {}
    step = pytensor.function([], [], updates={w: w + 1}, mode="CVM")
    for _ in range(3):  # the values averaged: w before each step = 0, 1, 2 (+10)
        ma.step()
        ema.step()
        step()
    assert all(isinstance(s.get_value(borrow=True), np.ndarray) for s in ma.sums[0])
    with ma.apply():  # windows close at t = 2: (0 + 1 + 2) / 3
        np.testing.assert_allclose(w.get_value(), [1.0, 11.0])
    with ema.apply():  # 0 -> 0 -> 0.5 -> 1.25 (shadow starts at the initial value)
        np.testing.assert_allclose(w.get_value(), [1.25, 11.25])
    np.testing.assert_array_equal(w.get_value(), [3.0, 13.0])


def test_host_mode_refuses_updates_and_step_needs_host_mode():
    w = shared(np.zeros(2), "w_host2")
    with pytest.raises(ValueError, match="host_mode"):
        ModelAverage([w], 0.5, 2, 4, host_mode="NUMBA", updates={w: w + 1})
    with pytest.raises(RuntimeError, match="host_mode"):
        ModelAverage([w], 0.5, 2, 4).step()


# --------------------------------------------------------------------------
# 8. the step signal is explicit and an empty flush is not a step
# --------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["original", "dict_copy", "explicit"])
def test_copied_single_function_dict_still_averages_steps_only(how):
    """ModelAverage(updates=dict(upd)) keeps the step signal: it averages optimizer steps."""
    rng = np.random.default_rng(8)
    params, x, loss = _quadratic(rng)
    upd = sgd(loss, params, 0.1, average=3)
    if how == "original":
        ma = ModelAverage(params, 0.5, 2, 4, updates=upd)
    elif how == "dict_copy":
        ma = ModelAverage(params, 0.5, 2, 4, updates=dict(upd))
    else:
        ma = ModelAverage(params, 0.5, 2, 4, is_step=upd.is_step)  # averages pre-step values
    ema = ExponentialMovingAverage(params, 0.5, updates=OrderedDict(upd), name="ema_copy")
    fn = pytensor.function([x], loss, updates={**upd, **ma.updates, **ema.updates}, mode=MODE)
    for call in range(1, 10):
        fn(rng.standard_normal(3))
        assert int(ma.num_updates.get_value()) == call // 3
        assert int(ema.num_updates.get_value()) == call // 3


def test_a_dict_whose_step_signal_cannot_be_known_is_refused():
    rng = np.random.default_rng(9)
    params, x, loss = _quadratic(rng)
    upd = dict(sgd(loss, params, 0.1, average=3))
    upd[params[1]] = params[1] * 1.0  # one value without the signal, one with
    with pytest.raises(ValueError, match="pass is_step= explicitly"):
        ModelAverage(params, 0.5, 2, 4, updates=upd)
    with pytest.raises(ValueError, match="is_step= explicitly"):
        ExponentialMovingAverage(params, 0.5, updates=upd)
    # said explicitly, it is accepted: True means every call is a step
    ma = ModelAverage(params, 0.5, 2, 4, updates=upd, is_step=True)
    fn = pytensor.function([x], [], updates={**upd, **ma.updates}, mode=MODE)
    fn(np.ones(3))
    fn(np.ones(3))
    assert int(ma.num_updates.get_value()) == 2
    with pytest.raises(ValueError, match="is_step must be a symbolic condition or True"):
        ModelAverage(params, 0.5, 2, 4, is_step=False)
    with pytest.raises(TypeError, match="is_step must be a symbolic scalar"):
        ModelAverage(params, 0.5, 2, 4, is_step=pt.vector("v"))


def test_empty_flush_of_the_two_function_form_does_not_advance_the_average():
    rng = np.random.default_rng(10)
    params, step_fn, apply_fn, ma = _two_function_average(rng, 0.5, 2, 4)
    apply_fn()  # nothing accumulated
    assert int(ma.num_updates.get_value()) == 0 and ma.steps == 0
    step_fn(rng.standard_normal(3))
    apply_fn()
    w_after = params[0].get_value().copy()
    apply_fn()  # the flush right after
    assert int(ma.num_updates.get_value()) == 1
    np.testing.assert_array_equal(params[0].get_value(), w_after)
    with ma.apply():
        np.testing.assert_allclose(params[0].get_value(), w_after, rtol=1e-12)
