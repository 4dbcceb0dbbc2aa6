"""The benchmark harness (``benchmarks/common.py``) and every script's ``--quick`` run.

Timings are never asserted (the machine is shared). The fast tests check the
harness: that no script imports another script but ``common``, that the one
model gives the same loss in PyTensor, PyTorch and JAX as a numpy
re-derivation, that the timing helpers call what they time as often as they
say, and what the graph inspection reports. The ``bench`` tests run each script
with ``--quick`` and check that it finishes, prints the load average, and
that the numbers of one row of its table are positive and finite (each script
compiles its functions in fresh worker processes), and with ``--help``. They
take about 5 minutes, so the suite leaves them out unless asked for with
``-m bench`` (``.ci/run`` runs them after the suite).
"""

import ast
import importlib.util
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytensor
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
# the benchmarks; performance_page.py runs them to write docs/performance.rst
SCRIPTS = sorted(f for f in os.listdir(BENCH)
                 if f.endswith(".py") and f not in ("common.py", "performance_page.py"))

# a line of each script's table, and which of its numbers must be positive
TABLE_ROW = {
    "batch_norm.py": r"^2\s+5\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)",
    "accumulation.py": r"^ ?4 apply / accumulate\s+([\d.]+)\s+([\d.]+)",
    "backends.py": r"^numba\s+float32\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)",
    "cold_start.py": r"^\s+1\s+fastcompile\s+([\d.]+)\s+([\d.]+)",
    "distributed.py": r"^\| wide MLP \| ours, Dask sync \| ([\d.]+) \| ([\d.]+) \|",
    "gpu.py": r"^mlp\s+la-jax\s+([\d.]+)\s+([\d.]+)",
    "inplace.py": r"^NUMBA\s+float32\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)",
    "noise.py": r"^NUMBA\s+256\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)",
    "peers.py": r"^\s+1\s+([\d.]+)\s+([\d.]+)",
    "single_function.py": r"^NUMBA\s+([\d.]+)\s+([\d.]+)\s+lazy",
}


@pytest.fixture(scope="module")
def common():
    spec = importlib.util.spec_from_file_location("bench_common",
                                                  os.path.join(BENCH, "common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_script_has_a_table_check():
    assert sorted(TABLE_ROW) == SCRIPTS


def imported_modules(path):
    """Top-level names of every module `path` imports (``import a.b``, ``from a import``)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_share_only_common(script):
    """A script imports the harness, never another script.

    A script's own name is left out: ``distributed.py`` imports Dask's
    ``distributed`` package (it takes its own directory off ``sys.path``).
    """
    stems = {s[:-3] for s in SCRIPTS} - {script[:-3]}
    assert imported_modules(os.path.join(BENCH, script)) & stems == set()


def numpy_loss(params, x, y):
    """Mean cross-entropy of the ReLU MLP, float64, written out independently."""
    W1, b1, W2, b2 = (np.asarray(p, dtype="float64") for p in params)
    logits = np.maximum(x.astype("float64") @ W1 + b1, 0) @ W2 + b2
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_probs[np.arange(len(y)), y].mean()


def test_one_model_for_every_library(common):
    """PyTensor's, torch's and JAX's MLP are the same network from the same values."""
    x, y = common.batch("float32")
    expected = numpy_loss(common.init_params("float32"), x, y)
    assert 2.0 < expected < 2.6  # 10 classes, small weights: near log(10)
    (xs, ys), params, loss = common.mlp("float32")
    assert [p.name for p in params] == ["W1", "b1", "W2", "b2"]
    for p, v in zip(params, common.init_params("float32")):
        np.testing.assert_array_equal(p.get_value(), v)
    got = pytensor.function([xs, ys], loss)(x, y)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    if importlib.util.find_spec("torch") is not None:
        import torch

        tparams, loss_fn = common.torch_mlp("float32")
        tloss = loss_fn(tparams, torch.from_numpy(x), torch.from_numpy(y))
        np.testing.assert_allclose(tloss.item(), expected, rtol=1e-5)
    if importlib.util.find_spec("jax") is not None:
        jparams, jloss_fn = common.jax_mlp("float32")
        np.testing.assert_allclose(float(jloss_fn(jparams, x, y)), expected, rtol=1e-5)


def test_time_calls_counts_calls_and_checks_stat(common):
    calls = []
    for stat in ("mean", "median"):
        calls.clear()
        seconds = common.time_calls(lambda: calls.append(1), repeat=7, warmup=3, stat=stat)
        assert len(calls) == 10
        assert 0 <= seconds < 0.1
    with pytest.raises(ValueError, match="stat must be 'mean' or 'median'"):
        common.time_calls(lambda: None, stat="min")


def test_time_windows_times_every_call(common):
    log = []
    acc_t, apply_t = common.time_windows(lambda b: log.append(b), lambda: log.append("apply"),
                                         every=3, windows=2, args=("b",))
    assert log == ["b", "b", "b", "apply"] * 2
    assert (len(acc_t), len(apply_t)) == (6, 2)
    assert all(t >= 0 for t in acc_t + apply_t)


def test_inplace_writes_names_the_ops(common):
    """A Gemm accumulating into one variable, an elementwise op on another, none on a third."""
    import pytensor.tensor as pt
    from pytensor.compile.mode import Mode

    w = pytensor.shared(np.zeros((3, 2)), name="w")
    v = pytensor.shared(np.zeros(2), name="v")
    u = pytensor.shared(np.ones(2), name="u")
    x, y = pt.matrix("x"), pt.matrix("y")
    # the C backend's rewrites (in-place Gemm and elementwise ops), nothing compiled
    mode = Mode(linker="py", optimizer="fast_run").excluding("fusion")
    fn = pytensor.function([x, y], u.sum(), updates={w: w + x @ y, v: v * 0.5}, mode=mode)
    assert common.inplace_writes(fn, [w, v, u]) == {
        "w": ["Gemm{inplace}"], "v": ["Mul(inplace)"], "u": []}


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_gpu_benchmark_models_are_the_pytensor_models(kind):
    """benchmarks/gpu.py writes the examples' CNN and MLP out for JAX and PyTorch: the same
    loss and gradients as the PyTensor graph (float64), ReLU and max-pool ties included
    (the digits have blank corners: whole pooling windows tie)."""
    pytest.importorskip("sklearn", reason="the models train on scikit-learn's bundled digits")
    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(BENCH, "gpu.py"))
    gpu = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(gpu)
    finally:   # the script puts benchmarks/ first: its distributed.py would shadow Dask's
        sys.path[:] = [p for p in sys.path if os.path.abspath(p) != BENCH]
        sys.path += [p for p in saved if p not in sys.path]
    X, y, side = gpu.digits("float64")
    x_b, y_b = X[:40], y[:40]
    model = gpu.pytensor_model(kind, "float64", 32, side)
    for p in model.params:   # biases away from zero: ReLU outputs tie in pooling windows
        p.set_value(p.get_value() + 0.01)
    values = [p.get_value() for p in model.params]
    f = pytensor.function([model.x, model.y], [model.loss, *pytensor.grad(model.loss,
                                                                          model.params)])
    want = f(x_b, y_b)
    got = {}
    if importlib.util.find_spec("jax") is not None:
        import jax

        jax.config.update("jax_enable_x64", True)
        loss = gpu.jax_loss(kind, side)
        value, grads = jax.value_and_grad(loss)([jax.numpy.asarray(v) for v in values],
                                                x_b, y_b)
        got["jax"] = [value, *grads]
    if importlib.util.find_spec("torch") is not None:
        import torch

        loss = gpu.torch_loss(kind, side, torch.device("cpu"))
        params = [torch.tensor(v, requires_grad=True) for v in values]
        value = loss(params, torch.from_numpy(x_b), torch.from_numpy(y_b))
        got["torch"] = [value.detach(), *torch.autograd.grad(value, params)]
    assert got, "neither JAX nor PyTorch is installed"
    for library, results in got.items():
        for k, (g, w) in enumerate(zip(results, want)):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-10, atol=1e-13,
                                       err_msg=f"{library} output {k}")


def run_script(script, *args, timeout):
    """Run ``benchmarks/<script> *args`` with the package importable; the process."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(BENCH, script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_quick(script):
    proc = run_script(script, "--quick", timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "load average" in proc.stdout
    match = re.search(TABLE_ROW[script], proc.stdout, re.MULTILINE)
    assert match, proc.stdout[-3000:]
    values = [float(v) for v in match.groups()]
    assert all(math.isfinite(v) and v > 0 for v in values), values


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_help_shows_its_summary(script):
    """``--help`` describes the script with its docstring's first line."""
    path = os.path.join(BENCH, script)
    with open(path) as f:
        summary = ast.get_docstring(ast.parse(f.read())).split("\n")[0]
    proc = run_script(script, "--help", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " ".join(summary.split()[:6]) in " ".join(proc.stdout.split())


def test_performance_page_topics_name_existing_scripts(tmp_path, monkeypatch):
    """Every topic of docs/performance.rst is a benchmark script here, and the page is
    rendered from the stored runs: each run's output kept verbatim, dated, with its
    commit and command; a topic never run says so."""
    spec = importlib.util.spec_from_file_location("performance_page",
                                                  os.path.join(BENCH, "performance_page.py"))
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    for topic, (_, _, command) in page.TOPICS.items():
        assert command[0].startswith("benchmarks/") and command[0][len("benchmarks/"):] in (
            SCRIPTS), topic
    monkeypatch.setattr(page, "PAGE", str(tmp_path / "performance.rst"))
    record = {"date": "2026-01-02", "commit": "abc1234", "dirty": True, "machine": "m",
              "command": "python benchmarks/inplace.py", "output": "a table\n\n  row 1.5"}
    text = open(page.render({"inplace": record})).read()
    assert "Measured on 2026-01-02 at commit ``abc1234 with local changes`` on m" in text
    assert "    a table\n\n      row 1.5" in text
    assert text.count("Not measured yet.") == len(page.TOPICS) - 1
    assert "BLAS and kernel not recorded" in text               # a run from before
    blas = "BLAS: C backend: openblas 0.3.21, kernel Prescott"
    text = open(page.render({"inplace": dict(record, blas=blas)})).read()
    assert f"\n``{blas}``\n\n::\n\n    a table" in text     # literal: no RST markup
