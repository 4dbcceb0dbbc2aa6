"""Learning-rate schedules equal optax's at steps 0..500, symbolic and on Python ints.

All symbolic schedules are evaluated in ONE compiled function over a vector of
steps (the schedules are elementwise), so the module compiles once. optax is
evaluated with x64 enabled (scoped to the reference code) on int64 steps: on
its own int32 count several optax schedules return float32 values.
"""

import pickle

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from lasagne_accum import schedules

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

STEPS = np.arange(501)
MODE = "FAST_COMPILE"    # one small elementwise graph; the linker does not change the numbers

# (id, ours, optax's) with optax's argument meanings
PAIRS = [
    ("constant", schedules.constant(0.3), optax.constant_schedule(0.3)),
    ("linear_warmup", schedules.linear_warmup(0.0, 0.4, 100),
     optax.linear_schedule(0.0, 0.4, 100)),
    ("linear_warmup_begin", schedules.linear_warmup(0.01, 0.2, 77, transition_begin=20),
     optax.linear_schedule(0.01, 0.2, 77, transition_begin=20)),
    ("linear_decay", schedules.linear_warmup(1.0, 0.1, 333),
     optax.linear_schedule(1.0, 0.1, 333)),
    ("linear_no_steps", schedules.linear_warmup(0.5, 1.0, 0),
     optax.linear_schedule(0.5, 1.0, 0)),
    ("cosine_decay", schedules.cosine_decay(0.1, 300),
     optax.cosine_decay_schedule(0.1, 300)),
    ("cosine_alpha_exponent", schedules.cosine_decay(2.0, 451, alpha=0.1, exponent=2.5),
     optax.cosine_decay_schedule(2.0, 451, alpha=0.1, exponent=2.5)),
    ("warmup_cosine", schedules.warmup_cosine_decay(0.0, 0.1, 50, 400),
     optax.warmup_cosine_decay_schedule(0.0, 0.1, 50, 400)),
    ("warmup_cosine_end", schedules.warmup_cosine_decay(1e-3, 0.5, 123, 456, end_value=0.02,
                                                        exponent=0.5),
     optax.warmup_cosine_decay_schedule(1e-3, 0.5, 123, 456, end_value=0.02, exponent=0.5)),
    ("warmup_cosine_no_warmup", schedules.warmup_cosine_decay(0.0, 0.3, 0, 200),
     optax.warmup_cosine_decay_schedule(0.0, 0.3, 0, 200)),
    ("piecewise", schedules.piecewise_constant(0.1, {250: 2.0, 100: 0.1, 0: 0.5, 500: 0.5}),
     optax.piecewise_constant_schedule(0.1, {250: 2.0, 100: 0.1, 0: 0.5, 500: 0.5})),
    ("piecewise_none", schedules.piecewise_constant(0.7), optax.piecewise_constant_schedule(0.7)),
    ("exponential", schedules.exponential_decay(0.1, 50, 0.5),
     optax.exponential_decay(0.1, 50, 0.5)),
    ("exponential_all", schedules.exponential_decay(0.1, 30, 0.7, transition_begin=40,
                                                    staircase=True, end_value=0.01),
     optax.exponential_decay(0.1, 30, 0.7, transition_begin=40, staircase=True,
                             end_value=0.01)),
    ("exponential_growth", schedules.exponential_decay(0.01, 100, 1.5, end_value=0.05),
     optax.exponential_decay(0.01, 100, 1.5, end_value=0.05)),
    ("exponential_no_steps", schedules.exponential_decay(0.2, 0, 0.5),
     optax.exponential_decay(0.2, 0, 0.5)),
    ("linear_scaling", schedules.linear_scaling(schedules.warmup_cosine_decay(0.0, 0.1, 50, 400),
                                                32, 512),
     lambda c: 16 * optax.warmup_cosine_decay_schedule(0.0, 0.1, 50, 400)(c)),
]
IDS = [p[0] for p in PAIRS]


@pytest.fixture(scope="module")
def references():
    with jax.enable_x64(True):
        steps = jnp.asarray(STEPS, dtype=jnp.int64)
        out = {}
        for name, _, ref in PAIRS:
            value = np.asarray(ref(steps), dtype=np.float64)
            out[name] = np.broadcast_to(value, STEPS.shape)
        return out


@pytest.fixture(scope="module")
def symbolic():
    """Every schedule on one symbolic int64 vector of steps, in one function."""
    steps = pt.lvector("steps")
    outputs = [ours(steps) for _, ours, _ in PAIRS]
    assert all(o.type.dtype == "float64" and o.type.ndim == 1 for o in outputs)
    fn = pytensor.function([steps], outputs, mode=MODE)
    return dict(zip(IDS, fn(STEPS)))


@pytest.mark.parametrize("name", IDS)
def test_symbolic_equals_optax(symbolic, references, name):
    np.testing.assert_allclose(symbolic[name], references[name], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", IDS)
def test_python_int_equals_optax(references, name):
    ours = dict((p[0], p[1]) for p in PAIRS)[name]
    values = [ours(int(k)) for k in STEPS]
    assert all(type(v) is float for v in values)
    np.testing.assert_allclose(values, references[name], rtol=1e-12, atol=1e-15)


def test_scalar_step_gives_scalar():
    step = pt.scalar("step", dtype="int64")
    value = schedules.warmup_cosine_decay(0.0, 1.0, 2, 6)(step)
    assert value.type.ndim == 0 and value.type.dtype == "float64"
    # halfway through the cosine part (step 4 of 2 + 4): peak * 0.5
    assert float(value.eval({step: 4}, mode=MODE)) == pytest.approx(0.5, rel=1e-15)
    assert schedules.constant(0.2)(step).type.ndim == 0


def test_schedules_pickle():
    s = schedules.linear_scaling(schedules.piecewise_constant(0.1, {10: 0.5}), 8, 64)
    back = pickle.loads(pickle.dumps(s))
    assert back(9) == pytest.approx(0.8) and back(10) == pytest.approx(0.4)


def test_linear_scaling_number():
    # Goyal et al.: 0.1 for batch 256, so 0.1 * 8192 / 256 = 3.2 for batch 8192
    assert schedules.linear_scaling(0.1, 256, 8192) == pytest.approx(3.2, rel=1e-15)
    assert schedules.linear_scaling(0.05, 64, 32) == pytest.approx(0.025, rel=1e-15)


@pytest.mark.parametrize("make, error, match", [
    (lambda: schedules.cosine_decay(0.1, 0), ValueError, "decay_steps must be > 0"),
    (lambda: schedules.warmup_cosine_decay(0.0, 0.1, 100, 50), ValueError, "warmup_steps"),
    (lambda: schedules.warmup_cosine_decay(0.0, 0.1, 50, 50), ValueError, "decay_steps"),
    (lambda: schedules.warmup_cosine_decay(0.0, 0.1, -1, 50), ValueError, "warmup_steps"),
    (lambda: schedules.piecewise_constant(0.1, {10: -0.5}), ValueError,
     r"boundaries_and_scales\[10\] must be >= 0"),
    (lambda: schedules.piecewise_constant(0.1, [(10, 0.5)]), TypeError, "boundaries_and_scales"),
    (lambda: schedules.linear_warmup(0.0, 0.1, 2.5), TypeError, "warmup_steps"),
    (lambda: schedules.exponential_decay("0.1", 10, 0.5), TypeError, "init_value"),
    (lambda: schedules.constant(float("nan")), ValueError, "value must be finite"),
    (lambda: schedules.linear_scaling(0.1, 0, 256), ValueError, "base_batch_size"),
    (lambda: schedules.linear_scaling(0.1, 256, 0), ValueError, "batch_size"),
    (lambda: schedules.linear_scaling(-0.1, 256, 512), ValueError, "base_lr"),
    (lambda: schedules.constant(0.1)("3"), TypeError, "step"),
])
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()
