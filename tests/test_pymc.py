"""Beside PyMC: our rules as ``pm.fit(obj_optimizer=...)``, and an import that changes nothing.

PyMC (the ``pymc`` extra, Python 3.12+) calls ``obj_optimizer(grads, params)``
with its own gradients and shared parameters, so any of our rules called with
hyperparameters only plugs in. The references are PyMC's own ``pymc.adam``
(Lasagne's Adam, the same formula as ours: the ELBO history must agree to
float64 rounding) and, for ``average=N``, the conjugate model's posterior in
closed form.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pm = pytest.importorskip("pymc")

import lasagne_accum as la  # noqa: E402

SIGMA = 2.0   # the known noise of the conjugate model
PRIOR_SD = 10.0


def _data():
    return np.random.default_rng(1).normal(1.5, SIGMA, size=50)


def _model():
    """y ~ Normal(mu, SIGMA), mu ~ Normal(0, PRIOR_SD): the posterior of mu is normal."""
    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, PRIOR_SD)
        pm.Normal("y", mu, SIGMA, observed=_data())
    return model


def _posterior():
    """Mean and standard deviation of mu's posterior, in closed form (normal-normal)."""
    data = _data()
    precision = len(data) / SIGMA ** 2 + 1 / PRIOR_SD ** 2
    return data.sum() / SIGMA ** 2 / precision, precision ** -0.5


def _fit(optimizer, n, callbacks=()):
    with _model():
        return pm.fit(n, method="advi", obj_optimizer=optimizer, random_seed=3,
                      progressbar=False, callbacks=list(callbacks))


def test_adam_as_obj_optimizer_matches_pymc_adam():
    ours = _fit(la.adam(learning_rate=0.05), 150)
    theirs = _fit(pm.adam(learning_rate=0.05), 150)
    assert ours.hist.shape == theirs.hist.shape == (150,)
    np.testing.assert_allclose(ours.hist, theirs.hist, rtol=1e-10, atol=0)
    np.testing.assert_allclose(ours.mean.eval(), theirs.mean.eval(), rtol=1e-10, atol=0)
    # average=1 is the plain rule
    same = _fit(la.adam(learning_rate=0.05, average=1), 150)
    np.testing.assert_allclose(same.hist, theirs.hist, rtol=1e-10, atol=0)


def test_average_n_steps_every_nth_call_and_finds_the_posterior():
    every, calls = 4, 1200
    seen = []

    def record(approx, losses, i):
        seen.append(np.concatenate([p.get_value().ravel() for p in approx.params]))

    fit = _fit(la.adam(learning_rate=0.05, average=every), calls, callbacks=[record])
    assert len(seen) == calls
    changed = [k for k in range(1, calls) if not np.array_equal(seen[k], seen[k - 1])]
    # PyMC's callback runs after call i + 1: the parameters change on calls every, 2 every, ...
    assert changed == list(range(every - 1, calls, every))
    mean, sd = _posterior()
    fitted_mean = float(fit.mean.eval()[0])
    fitted_sd = float(fit.std.eval()[0])
    assert abs(fitted_mean - mean) < 0.25 * sd, (fitted_mean, mean, sd)
    assert abs(fitted_sd - sd) < 0.25 * sd, (fitted_sd, sd)


@pytest.mark.parametrize("given", [0.05, "adam", [0.05]])
def test_a_rule_given_a_hyperparameter_in_place_of_the_loss_names_the_argument(given):
    with pytest.raises(TypeError, match="loss_or_grads"):
        la.adam(given)


def test_a_partial_given_the_wrong_params_names_them():
    optimizer = la.adam(learning_rate=0.05)
    with pytest.raises(TypeError, match="params"):
        with _model():
            pm.fit(5, method="advi", obj_optimizer=lambda grads, params: optimizer(
                grads, {"params": params}), progressbar=False)


_PROBE = textwrap.dedent("""
    import json, pkgutil, importlib, sys
    import numpy as np, pymc as pm
    if sys.argv[1] == "1":
        import lasagne_accum
        for info in pkgutil.walk_packages(lasagne_accum.__path__, "lasagne_accum."):
            if ".distributed" not in info.name or importlib.util.find_spec("distributed"):
                importlib.import_module(info.name)
    def ops(fn):
        return sorted(type(n.op).__name__ + str(getattr(n.op, "destroy_map", ""))
                      for n in fn.maker.fgraph.toposort())
    data = np.random.default_rng(1).normal(1.5, 2.0, size=50)
    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 10)
        s = pm.HalfNormal("s", 3)
        pm.Normal("y", mu, s, observed=data)
        logp = model.compile_logp()
        step = pm.NUTS(model=model)
        idata = pm.sample(draws=30, tune=30, chains=1, cores=1, step=step, random_seed=4,
                          progressbar=False, compute_convergence_checks=False)
        inference = pm.ADVI(random_seed=2)
        advi = inference.objective.step_function(obj_optimizer=pm.adam(learning_rate=0.05),
                                                   score=True)
        losses = [np.asarray(advi()).ravel().tolist() for _ in range(5)]
    point = {"mu": 0.3, "s_log__": 0.2}
    print(json.dumps({
        "logp_ops": ops(logp.f), "logp": float(logp(point)),
        "nuts_ops": ops(step._logp_dlogp_func._pytensor_function),
        "draws": idata.posterior["mu"].values.ravel().tolist(),
        "advi_ops": ops(advi), "advi": losses,
        "modules": sorted(m for m in sys.modules if m.startswith("lasagne_accum"))[:3],
    }))
""")


def _probe(with_import):
    done = subprocess.run([sys.executable, "-c", _PROBE, "1" if with_import else "0"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_lasagne_accum_leaves_pymcs_functions_as_they_were():
    # A first run fills Numba's cache; a function compiled afresh and the same function read
    # back from that cache differ in the last bits of NUTS draws, with or without our import.
    # Both compared runs therefore read a warm cache.
    _probe(False)
    plain, ours = _probe(False), _probe(True)
    assert plain["modules"] == [] and "lasagne_accum" in ours["modules"]   # it did import
    for key in ("logp_ops", "nuts_ops", "advi_ops"):
        assert ours[key] == plain[key] and len(plain[key]) > 3, key
    assert ours["logp"] == plain["logp"] and np.isfinite(plain["logp"])
    assert ours["draws"] == plain["draws"] and len(plain["draws"]) == 30
    assert ours["advi"] == plain["advi"] and len({tuple(v) for v in plain["advi"]}) == 5
