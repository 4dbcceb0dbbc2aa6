"""norm_constraint / total_norm_constraint against a numpy re-derivation of Lasagne's."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from lasagne_accum import updates as U
from lasagne_accum.constraints import norm_constraint, total_norm_constraint

EPS = 1e-7  # Lasagne's default epsilon

# Lasagne's default norm axes, per rank, typed here independently.
DEFAULT_AXES = {2: (0,), 3: (1, 2), 4: (1, 2, 3), 5: (1, 2, 3, 4)}


def np_norm_constraint(w, max_norm, axes, epsilon=EPS):
    norms = np.sqrt(np.sum(w ** 2, axis=axes, keepdims=True))
    return w * np.clip(norms, 0, max_norm) / (epsilon + norms)


def np_total_norm_constraint(ws, max_norm, epsilon=EPS):
    norm = np.sqrt(sum(np.sum(np.asarray(w, dtype=np.float64) ** 2) for w in ws))
    mult = np.clip(norm, 0, max_norm) / (epsilon + norm)
    return [w * mult for w in ws], norm


def slice_norms(w, axes):
    return np.sqrt(np.sum(w ** 2, axis=axes, keepdims=True))


def varied_tensor(rng, shape, axes):
    """Random tensor whose slices (along the non-norm axes) have very different norms."""
    w = rng.standard_normal(shape)
    n_slices = int(np.prod([s for i, s in enumerate(shape) if i not in axes]))
    scales = np.geomspace(0.05, 20.0, n_slices)
    scale_shape = [1 if i in axes else s for i, s in enumerate(shape)]
    return w * scales.reshape(scale_shape)


# ------------------------------------------------------------ norm_constraint


@pytest.mark.parametrize("shape", [(6, 5), (4, 3, 5), (5, 3, 2, 2), (3, 2, 2, 2, 2)],
                         ids=["2d-dense", "3d", "4d-conv", "5d"])
def test_norm_constraint_default_axes_matches_numpy(rng, shape):
    axes = DEFAULT_AXES[len(shape)]
    w = varied_tensor(rng, shape, axes)
    # a zero slice (a dead unit / filter) must stay zero, without NaN
    zero_slice = [slice(None)] * len(shape)
    zero_slice[1 if len(shape) == 2 else 0] = 0
    w[tuple(zero_slice)] = 0.0
    norms = slice_norms(w, axes)
    max_norm = float(np.median(norms[norms > 0]))
    assert np.sum(norms > max_norm) >= 1 and np.sum((norms < max_norm) & (norms > 0)) >= 1

    x = pt.tensor("x", dtype="float64", shape=(None,) * len(shape))
    f = pytensor.function([x], norm_constraint(x, max_norm))
    out = f(w)

    assert out.shape == w.shape and out.dtype == np.float64
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, np_norm_constraint(w, max_norm, axes), rtol=1e-12,
                               atol=1e-15)
    assert np.all(out[tuple(zero_slice)] == 0.0)
    new_norms = slice_norms(out, axes)
    assert np.all(new_norms <= max_norm * (1 + 1e-12))
    big = (norms > max_norm).squeeze()
    np.testing.assert_allclose(new_norms.squeeze()[big], max_norm * norms.squeeze()[big]
                               / (EPS + norms.squeeze()[big]), rtol=1e-12)
    small = norms <= max_norm
    # slices under the limit are untouched up to the epsilon factor
    np.testing.assert_allclose(np.where(small, out, 0), np.where(small, w, 0), rtol=1e-6,
                               atol=0)


@pytest.mark.parametrize("shape, norm_axes, np_axes", [
    ((6, 5), (1,), (1,)),     # rows instead of columns
    ((7,), 0, (0,)),           # a plain int, on a 1-D tensor
    ((4, 3, 5), [0, 2], (0, 2)),
    ((4, 3, 5), (-1,), (2,)),  # negative axis
])
def test_norm_constraint_explicit_axes_matches_numpy(rng, shape, norm_axes, np_axes):
    w = rng.standard_normal(shape) * 3.0
    x = pt.tensor("x", dtype="float64", shape=(None,) * len(shape))
    out = norm_constraint(x, 1.5, norm_axes=norm_axes).eval({x: w})
    np.testing.assert_allclose(out, np_norm_constraint(w, 1.5, np_axes), rtol=1e-12,
                               atol=1e-15)
    assert np.all(slice_norms(out, np_axes) <= 1.5 * (1 + 1e-12))


def test_norm_constraint_zero_tensor_stays_zero():
    x = pt.tensor4("x")
    out = norm_constraint(x, 1.0).eval({x: np.zeros((3, 2, 2, 2))})
    assert not np.any(np.isnan(out))
    np.testing.assert_array_equal(out, 0.0)


def test_norm_constraint_float32_keeps_dtype_and_matches(rng):
    w = varied_tensor(rng, (5, 3, 2, 2), (1, 2, 3)).astype(np.float32)
    x = pt.tensor("x", dtype="float32", shape=(None,) * 4)
    expr = norm_constraint(x, 2.0)
    assert expr.type.dtype == "float32"
    out = expr.eval({x: w})
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, np_norm_constraint(w.astype(np.float64), 2.0, (1, 2, 3)),
                               rtol=1e-5, atol=1e-6)


def test_norm_constraint_symbolic_max_norm_and_epsilon(rng):
    w = rng.standard_normal((6, 5)) * 4.0
    max_norm = pytensor.shared(np.float64(2.0), name="max_norm")
    x = pt.matrix("x")
    f = pytensor.function([x], norm_constraint(x, max_norm, epsilon=1e-3))
    np.testing.assert_allclose(f(w), np_norm_constraint(w, 2.0, (0,), 1e-3), rtol=1e-12)
    max_norm.set_value(np.float64(0.5))
    np.testing.assert_allclose(f(w), np_norm_constraint(w, 0.5, (0,), 1e-3), rtol=1e-12)


def test_norm_constraint_on_update_in_training_step(rng):
    """Lasagne's recipe: updates[W] = norm_constraint(updates[W], max_norm)."""
    w0 = rng.standard_normal((3, 4))
    g = rng.standard_normal((3, 4)) * 10.0
    W = pytensor.shared(w0.copy(), name="W")
    gv = pt.matrix("g")
    updates = U.sgd([gv], [W], learning_rate=0.5)
    updates[W] = U.norm_constraint(updates[W], max_norm=1.0)
    pytensor.function([gv], [], updates=updates)(g)
    np.testing.assert_allclose(W.get_value(), np_norm_constraint(w0 - 0.5 * g, 1.0, (0,)),
                               rtol=1e-12)


@pytest.mark.parametrize("make", [pt.vector, pt.scalar,
                                  lambda name: pt.tensor(name, shape=(None,) * 6)],
                         ids=["1d", "0d", "6d"])
def test_norm_constraint_without_default_axes_raises(make):
    with pytest.raises(ValueError, match="norm_axes"):
        norm_constraint(make("v"), 1.0)


def test_norm_constraint_bad_arguments_raise():
    x = pt.matrix("x")
    with pytest.raises(ValueError, match="norm_axes"):
        norm_constraint(x, 1.0, norm_axes=(2,))
    with pytest.raises(ValueError, match="max_norm"):
        norm_constraint(x, -1.0)
    with pytest.raises(ValueError, match="epsilon"):
        norm_constraint(x, 1.0, epsilon=-1e-7)


# ------------------------------------------------------ total_norm_constraint


@pytest.fixture
def three_tensors(rng):
    return [rng.standard_normal((3, 4)), rng.standard_normal(4),
            rng.standard_normal((2, 3, 2, 2))]


def _symbols(values, dtype="float64"):
    return [pt.tensor(f"t{i}", dtype=dtype, shape=(None,) * v.ndim)
            for i, v in enumerate(values)]


@pytest.mark.parametrize("max_norm", [1.0, 1e3], ids=["clipped", "unclipped"])
def test_total_norm_constraint_matches_numpy_with_return_norm(three_tensors, max_norm):
    xs = _symbols(three_tensors)
    result = total_norm_constraint(xs, max_norm, return_norm=True)
    assert isinstance(result, tuple) and len(result) == 2
    scaled, norm = result
    assert len(scaled) == 3
    f = pytensor.function(xs, [*scaled, norm])
    *outs, norm_val = f(*three_tensors)

    expected, expected_norm = np_total_norm_constraint(three_tensors, max_norm)
    np.testing.assert_allclose(norm_val, expected_norm, rtol=1e-12)  # norm before rescaling
    for o, e, v in zip(outs, expected, three_tensors):
        assert o.shape == v.shape
        np.testing.assert_allclose(o, e, rtol=1e-12, atol=1e-15)
    joint = np.sqrt(sum(np.sum(o ** 2) for o in outs))
    if max_norm < expected_norm:
        np.testing.assert_allclose(joint, max_norm * expected_norm / (EPS + expected_norm),
                                   rtol=1e-12)
    else:
        for o, v in zip(outs, three_tensors):
            np.testing.assert_allclose(o, v, rtol=1e-6)


def test_total_norm_constraint_without_return_norm_returns_list(three_tensors):
    xs = _symbols(three_tensors)
    scaled = total_norm_constraint(xs, 0.5)
    assert isinstance(scaled, list) and len(scaled) == 3
    outs = pytensor.function(xs, scaled)(*three_tensors)
    expected, _ = np_total_norm_constraint(three_tensors, 0.5)
    for o, e in zip(outs, expected):
        np.testing.assert_allclose(o, e, rtol=1e-12, atol=1e-15)


def test_total_norm_constraint_zero_tensors_stay_zero():
    xs = _symbols([np.zeros((2, 2)), np.zeros(3)])
    scaled, norm = total_norm_constraint(xs, 1.0, return_norm=True)
    a, b, n = pytensor.function(xs, [*scaled, norm])(np.zeros((2, 2)), np.zeros(3))
    assert n == 0.0
    assert not np.any(np.isnan(a)) and not np.any(np.isnan(b))
    np.testing.assert_array_equal(a, 0.0)
    np.testing.assert_array_equal(b, 0.0)


def test_total_norm_constraint_mixed_dtypes_keep_their_dtype(rng):
    a32 = (rng.standard_normal((3, 4)) * 3).astype(np.float32)
    b64 = rng.standard_normal(4) * 3
    xa = pt.tensor("a", dtype="float32", shape=(None, None))
    xb = pt.tensor("b", dtype="float64", shape=(None,))
    (sa, sb), norm = total_norm_constraint([xa, xb], 2.0, return_norm=True)
    assert sa.type.dtype == "float32" and sb.type.dtype == "float64"
    oa, ob, n = pytensor.function([xa, xb], [sa, sb, norm])(a32, b64)
    assert oa.dtype == np.float32 and ob.dtype == np.float64
    (ea, eb), en = np_total_norm_constraint([a32.astype(np.float64), b64], 2.0)
    np.testing.assert_allclose(n, en, rtol=1e-6)
    np.testing.assert_allclose(oa, ea, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ob, eb, rtol=1e-6)


def test_total_norm_constraint_bad_arguments_raise():
    x = pt.vector("x")
    with pytest.raises(ValueError):
        total_norm_constraint([], 1.0)
    with pytest.raises(ValueError, match="max_norm"):
        total_norm_constraint([x], -1.0)
    with pytest.raises(ValueError, match="epsilon"):
        total_norm_constraint([x], 1.0, epsilon=-1.0)
