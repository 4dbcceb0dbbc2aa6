"""The gradient noise scale of the window (lasagne_accum.noise), against exact values.

The reference is a numpy MLP on scikit-learn's digits (float64): every per-example
gradient, hence the exact |G|^2 and tr(Sigma) of the data set (Sigma the covariance of
the 1,797 per-example gradients, divided by N). The library's per-window estimates are
checked against the closed form computed in numpy from the same micro-batches, and their
means over many windows drawn without replacement against the exact values.
"""

import math

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import lasagne_accum as la

N_HIDDEN = 16


@pytest.fixture(scope="module")
def digits():
    datasets = pytest.importorskip("sklearn.datasets", reason="needs scikit-learn's digits "
                                   "(the examples extra)")
    X, y = datasets.load_digits(return_X_y=True)
    return X / 16.0, y


@pytest.fixture(scope="module")
def per_example(digits):
    """Every per-example gradient of the MLP's loss (rows), by hand in numpy."""
    X, y = digits
    rng = np.random.default_rng(0)
    W1 = rng.normal(size=(64, N_HIDDEN)) * 0.3
    b1 = rng.normal(size=N_HIDDEN) * 0.1
    W2 = rng.normal(size=(N_HIDDEN, 10)) * 0.3
    b2 = np.zeros(10)
    h = np.tanh(X @ W1 + b1)
    logits = h @ W2 + b2
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dl = p - np.eye(10)[y]                         # d loss_i / d logits_i
    dpre = (dl @ W2.T) * (1 - h ** 2)
    grads = np.concatenate([np.einsum("ni,nj->nij", X, dpre).reshape(len(X), -1), dpre,
                            np.einsum("ni,nj->nij", h, dl).reshape(len(X), -1), dl], axis=1)
    return (W1, b1, W2, b2), grads


def _exact(P):
    G = P.mean(0)
    return float(G @ G), float(((P - G) ** 2).sum(1).mean())


def _closed_form(micro, population=None):
    """numpy: the estimators from the micro-batches' per-example gradient rows."""
    sizes = np.array([len(m) for m in micro], float)
    means = [m.mean(0) for m in micro]
    B, K = sizes.sum(), len(micro)
    A = sum(b * (g @ g) for b, g in zip(sizes, means)) / B
    gbar = sum(b * g for b, g in zip(sizes, means)) / B
    L = gbar @ gbar
    trace = B * (A - L) / (K - 1)
    if population is None:
        return (K * L - A) / (K - 1), trace
    n = population
    trace = trace * (n - 1) / n
    return L - trace * (n - B) / (B * (n - 1)), trace


def _linear_trainer(dim, noise_scale=True, every=4, **kw):
    """A model whose batch gradient is the mean of its input rows: fed per-example gradient
    rows, the accumulation sees exactly those gradients."""
    w = pytensor.shared(np.zeros(dim), name="w")
    rows = pt.matrix("rows")
    loss = (rows @ w).mean()
    return la.compile_accumulation([rows], loss, [w], la.sgd, dict(learning_rate=0.0),
                                   every=every, weight=rows.shape[0], noise_scale=noise_scale,
                                   **kw)


def _windows(n, sizes, rng, repeats):
    """Windows of micro-batches of `sizes`, drawn without replacement from n examples
    (each epoch a new permutation, cut into consecutive windows)."""
    B = sum(sizes)
    cuts = np.cumsum(sizes)[:-1]
    for _ in range(repeats):
        order = rng.permutation(n)
        for start in range(0, n - B + 1, B):
            yield np.split(order[start:start + B], cuts)


@pytest.mark.parametrize("sizes", [(8, 8, 8, 8), (4, 12, 8, 8)], ids=["equal", "unequal"])
def test_each_window_equals_the_closed_form(per_example, sizes):
    _, P = per_example
    trainer = _linear_trainer(P.shape[1], every=len(sizes),
                              noise_scale=dict(population=len(P)))
    rng = np.random.default_rng(1)
    for window in list(_windows(len(P), sizes, rng, 1))[:20]:
        for idx in window:
            trainer.step(P[idx])
        want_g, want_t = _closed_form([P[idx] for idx in window], population=len(P))
        got = trainer.gradient_noise
        np.testing.assert_allclose([got.grad_sq, got.trace], [want_g, want_t], rtol=1e-10)
        assert got.b_simple == pytest.approx(want_t / want_g, rel=1e-10)


@pytest.mark.parametrize("sizes", [(8, 8, 8, 8), (4, 12, 8, 8)], ids=["equal", "unequal"])
def test_mean_of_the_estimates_is_the_exact_value(per_example, sizes):
    """Over ~2,200 windows drawn without replacement, the means of the library's estimates
    are within 3 standard errors and 5% of the data set's exact |G|^2 and tr(Sigma)."""
    _, P = per_example
    exact_g, exact_t = _exact(P)
    trainer = _linear_trainer(P.shape[1], every=len(sizes),
                              noise_scale=dict(population=len(P)))
    rng = np.random.default_rng(2)
    g, t = [], []
    for window in _windows(len(P), sizes, rng, 40):
        for idx in window:
            trainer.step(P[idx])
        g.append(trainer.gradient_noise.grad_sq)
        t.append(trainer.gradient_noise.trace)
    assert len(g) > 2000
    for values, exact in ((g, exact_g), (t, exact_t)):
        mean, se = np.mean(values), np.std(values, ddof=1) / math.sqrt(len(values))
        assert abs(mean - exact) < 3 * se, (mean, exact, se)
        assert abs(mean - exact) < 0.05 * exact, (mean, exact)


def test_the_mlp_loss_through_pytensor_gives_the_closed_form(digits, per_example):
    """End to end: the MLP's loss in PyTensor, its gradients accumulated, the estimates
    equal the closed form of the numpy per-example gradients of the same micro-batches."""
    X, y = digits
    (W1, b1, W2, b2), P = per_example
    params = [pytensor.shared(v.copy(), name=n) for v, n in
              ((W1, "W1"), (b1, "b1"), (W2, "W2"), (b2, "b2"))]
    x, t = pt.matrix("x"), pt.ivector("t")
    h = pt.tanh(x @ params[0] + params[1])
    logp = pt.special.log_softmax(h @ params[2] + params[3], axis=1)
    loss = -logp[pt.arange(x.shape[0]), t].mean()
    trainer = la.compile_accumulation([x, t], loss, params, la.sgd, dict(learning_rate=0.0),
                                      every=3, weight=x.shape[0], noise_scale=True)
    rng = np.random.default_rng(3)
    for window in list(_windows(len(X), (5, 9, 7), rng, 1))[:5]:
        for idx in window:
            trainer.step(X[idx], y[idx].astype("int32"))
        want_g, want_t = _closed_form([P[idx] for idx in window])
        np.testing.assert_allclose([trainer.gradient_noise.grad_sq,
                                    trainer.gradient_noise.trace], [want_g, want_t], rtol=1e-9)


def test_without_the_population_grad_sq_is_the_independent_draws_formula(per_example):
    _, P = per_example
    trainer = _linear_trainer(P.shape[1], every=2)
    trainer.step(P[:6])
    trainer.step(P[6:10])
    want_g, want_t = _closed_form([P[:6], P[6:10]])
    np.testing.assert_allclose([trainer.gradient_noise.grad_sq, trainer.gradient_noise.trace],
                               [want_g, want_t], rtol=1e-10)
    # the equal-size form: (K L - S) / (K - 1) and b K (S - L) / (K - 1)
    trainer.step(P[10:14])
    trainer.step(P[14:18])
    g1, g2 = P[10:14].mean(0), P[14:18].mean(0)
    S, gbar = (g1 @ g1 + g2 @ g2) / 2, (g1 + g2) / 2
    L = gbar @ gbar
    np.testing.assert_allclose([trainer.gradient_noise.grad_sq, trainer.gradient_noise.trace],
                               [(2 * L - S) / 1, 4 * 2 * (S - L) / 1], rtol=1e-10)


def test_running_noise_scale_is_the_ratio_of_the_averages(per_example):
    _, P = per_example
    trainer = _linear_trainer(P.shape[1], every=2, noise_scale=dict(decay=0.5))
    assert trainer.noise_scale is None
    estimates = []
    for i in range(4):
        trainer.step(P[20 * i:20 * i + 5])
        trainer.step(P[20 * i + 5:20 * i + 10])
        estimates.append(trainer.gradient_noise)
    avg_g, avg_t = estimates[0].grad_sq, estimates[0].trace
    for e in estimates[1:]:
        avg_g, avg_t = 0.5 * avg_g + 0.5 * e.grad_sq, 0.5 * avg_t + 0.5 * e.trace
    assert trainer.noise_scale == pytest.approx(avg_t / avg_g, rel=1e-12)
    assert trainer.noise_scale != pytest.approx(np.mean([e.b_simple for e in estimates]))


def test_a_window_of_one_batch_gives_nan_and_the_loop_goes_on(per_example):
    _, P = per_example
    trainer = _linear_trainer(P.shape[1], every=1)
    trainer.step(P[:8])
    assert all(math.isnan(v) for v in (trainer.gradient_noise.grad_sq,
                                       trainer.gradient_noise.trace,
                                       trainer.gradient_noise.b_simple))
    assert trainer.noise_scale is None and trainer.steps == 1


def test_skipped_batches_do_not_enter_the_estimate(per_example):
    _, P = per_example
    trainer = _linear_trainer(P.shape[1], every=3, skip_nonfinite=True)
    bad = P[:4].copy()
    bad[0, 0] = np.nan
    trainer.step(P[10:16])
    trainer.step(bad)           # skipped: the window waits for a third good batch
    trainer.step(P[20:23])
    trainer.step(P[30:37])
    want_g, want_t = _closed_form([P[10:16], P[20:23], P[30:37]])
    np.testing.assert_allclose([trainer.gradient_noise.grad_sq, trainer.gradient_noise.trace],
                               [want_g, want_t], rtol=1e-10)
    assert trainer.examples == 16


def test_bad_input_is_refused_and_nothing_is_lost(per_example):
    _, P = per_example
    w = pytensor.shared(np.zeros(P.shape[1]), name="w")
    rows = pt.matrix("rows")
    loss = (rows @ w).mean()
    with pytest.raises(ValueError, match="noise_scale=True needs weight="):
        la.accumulate_gradients(loss, [w], noise_scale=True)
    plain = la.accumulate_gradients(loss, [w], weight=rows.shape[0])
    with pytest.raises(ValueError, match="noise_scale=True"):
        la.gradient_noise(plain)
    with pytest.raises(TypeError, match="accu must be the result"):
        la.gradient_noise({})
    accu = la.accumulate_gradients(loss, [w], weight=rows.shape[0], noise_scale=True,
                                   name="bad")
    with pytest.raises(TypeError, match="population must be an integer"):
        la.gradient_noise(accu, population=10.5)
    with pytest.raises(ValueError, match="population must be at least 2"):
        la.gradient_noise(accu, population=1)
    with pytest.raises(TypeError, match="noise_scale must be True"):
        _linear_trainer(P.shape[1], noise_scale="yes")
    with pytest.raises(TypeError, match="unknown option"):
        _linear_trainer(P.shape[1], noise_scale=dict(populaton=5))
    with pytest.raises(ValueError, match="decay must be a number in"):
        _linear_trainer(P.shape[1], noise_scale=dict(decay=1.0))
    # a window larger than the population: the apply raises and changes nothing
    trainer = _linear_trainer(P.shape[1], every=2, noise_scale=dict(population=6))
    trainer.step(P[:4])
    with pytest.raises(AssertionError, match="population \\(6\\) is smaller"):
        trainer.step(P[4:8])
    assert trainer.pending == 2 and trainer.steps == 0 and trainer.examples == 0
    assert float(trainer.accumulation.total.get_value()) == 8


@pytest.mark.real_backend
@pytest.mark.parametrize("mode", ["CVM", "NUMBA", "JAX"])
def test_the_same_numbers_on_every_backend(per_example, mode):
    if mode == "JAX":
        pytest.importorskip("jax")
    _, P = per_example
    got = {}
    for m in ("CVM", mode):
        trainer = _linear_trainer(P.shape[1], every=3, noise_scale=dict(population=len(P)),
                                  mode=m)
        for i in range(3):
            trainer.step(P[7 * i:7 * i + 5 + i])
        got[m] = (trainer.gradient_noise.grad_sq, trainer.gradient_noise.trace)
    np.testing.assert_allclose(got[mode], got["CVM"], rtol=1e-12)
    want = _closed_form([P[7 * i:7 * i + 5 + i] for i in range(3)], population=len(P))
    np.testing.assert_allclose(got[mode], want, rtol=1e-10)


@pytest.mark.real_backend
@pytest.mark.parametrize("mode", ["CVM", "NUMBA", "JAX"])
def test_a_large_dense_layer_gives_the_closed_form_for_small_and_large_batches(mode):
    """A weight at least GRAM_MIN_SIDE long on both sides: its squared gradient norm comes
    from the batch's Gram matrices (JAX; C and Numba for small batches) or from the
    product on its way into the buffer (C and Numba, larger batches: GemmSquares); both
    give the closed form."""
    if mode == "JAX":
        pytest.importorskip("jax")
    from lasagne_accum._pytensor.gemm_squares import GemmSquares, use_gram
    from lasagne_accum.accumulate import GRAM_MIN_SIDE

    m, n = GRAM_MIN_SIDE + 2, GRAM_MIN_SIDE + 1
    sizes = [(0, 7), (7, 107), (107, 140)]
    assert [use_gram(m, n, b - a) for a, b in sizes] == [True, False, False]
    rng = np.random.default_rng(7)
    X, T = rng.normal(size=(140, m)), rng.normal(size=(140, n))
    W = pytensor.shared(0.01 * rng.normal(size=(m, n)), name="W")
    x, t = pt.matrix("x"), pt.matrix("t")
    loss = ((x @ W - t) ** 2).sum(axis=1).mean() / 2
    trainer = la.compile_accumulation([x, t], loss, [W], la.sgd, dict(learning_rate=0.0),
                                      every=3, weight=x.shape[0], noise_scale=True,
                                      mode=mode)
    g = np.einsum("ni,nj->nij", X, X @ W.get_value() - T).reshape(140, -1)  # per example
    for a, b in sizes:
        trainer.step(X[a:b], T[a:b])
    want_g, want_t = _closed_form([g[a:b] for a, b in sizes])
    np.testing.assert_allclose([trainer.gradient_noise.grad_sq, trainer.gradient_noise.trace],
                               [want_g, want_t], rtol=1e-10)
    fused = [n for n in trainer.accumulate_fn.maker.fgraph.toposort()
             if isinstance(n.op, GemmSquares)]
    assert len(fused) == (0 if mode == "JAX" else 1)


def test_average_false_gives_the_same_estimates(per_example):
    _, P = per_example
    got = []
    for average in (True, False):
        trainer = _linear_trainer(P.shape[1], every=2, average=average)
        trainer.step(P[:5])
        trainer.step(P[5:12])
        got.append((trainer.gradient_noise.grad_sq, trainer.gradient_noise.trace))
    np.testing.assert_allclose(got[0], got[1], rtol=1e-12)
