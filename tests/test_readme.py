"""Every ```python block of README.md runs, so that a snippet cannot rot.

The blocks run in order in one namespace, as a reader following the README
would type them. The names a block leaves to the reader (a model ``x, y,
loss, params``, its ``batches``, ``N``, ``evaluate``, ``my_rule``...) are
filled beforehand with a tiny two-layer model. A block that raises fails the
test, naming the block and its first line; a block that needs an optional
package that is missing is skipped (reported as such); a block listed in
:data:`NOT_RUN` (one that needs outside infrastructure) is skipped with its
reason. Checks after the blocks assert what the README promises.
"""

import os
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"

# Blocks that cannot run here, recognised by a fragment of their text: reason.
NOT_RUN = {
    'address="tls://': "connects to a remote Dask cluster with TLS certificates",
}
# Optional packages: a block importing one that is missing is skipped.
OPTIONAL = ("distributed", "dask", "jax", "torch")


def python_blocks(text):
    """(line number, code) of every ```python block of `text`."""
    blocks = []
    for match in re.finditer(r"^```python[ \t]*\n(.*?)^```", text, re.S | re.M):
        line = text.count("\n", 0, match.start()) + 2
        blocks.append((line, match.group(1)))
    return blocks


def reader_namespace():
    """The names the README leaves to the reader: a tiny 2-layer model and its data."""
    rng = np.random.default_rng(11)
    x = pt.matrix("x")
    y = pt.matrix("y")
    W1 = pytensor.shared(0.3 * rng.normal(size=(3, 5)), name="W1")
    b1 = pytensor.shared(np.zeros(5), name="b1")
    W2 = pytensor.shared(0.3 * rng.normal(size=(5, 2)), name="W2")
    b2 = pytensor.shared(np.zeros(2), name="b2")
    params = [W1, b1, W2, b2]
    loss = ((pt.dot(pt.tanh(pt.dot(x, W1) + b1), W2) + b2 - y) ** 2).sum(axis=1).mean()

    def batch(k):
        xb = rng.normal(size=(k, 3))
        return xb, np.stack([xb[:, 0] - xb[:, 1], xb[:, 2]], axis=1)

    batches = [batch(k) for k in (4, 3, 4, 2, 4, 4, 1)]
    test_x, test_y = batch(16)
    loss_fn = pytensor.function([x, y], loss)

    def evaluate():
        return float(loss_fn(test_x, test_y))

    def my_rule(grads, params, learning_rate):
        """A user-written rule: sign SGD."""
        return OrderedDict((p, p - learning_rate * pt.sign(g)) for p, g in zip(params, grads))

    return dict(
        np=np, pytensor=pytensor, pt=pt, x=x, y=y, W1=W1, b1=b1, W2=W2, b2=b2,
        params=params, loss=loss, batches=batches, N=3, steps_per_epoch=100,
        evaluate=evaluate, my_rule=my_rule, hyperparameters=dict(learning_rate=0.01),
        worker_batches=[batches[:4], batches[4:] + batches[:1]],
    )


def _missing_optional(code):
    for package in OPTIONAL:
        if re.search(rf"^\s*(from|import)\s+{package}\b", code, re.M):
            try:
                __import__(package)
            except ImportError:
                return package
    return None


def test_readme_has_python_blocks():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 5, [line for line, _ in blocks]


def test_every_readme_python_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the checkpoint block writes ckpt.npz
    ns = reader_namespace()
    initial = [p.get_value().copy() for p in ns["params"]]
    ran, skipped = [], []
    for line, code in python_blocks(README.read_text()):
        reason = next((why for key, why in NOT_RUN.items() if key in code), None)
        package = _missing_optional(code)
        if reason or package:
            skipped.append((line, reason or f"needs {package}"))
            continue
        try:
            exec(compile(code, f"README.md:{line}", "exec"), ns)
        except Exception as exc:  # noqa: BLE001 - name the block that broke
            first = code.strip().splitlines()[0]
            pytest.fail(f"README.md block at line {line} ({first!r}) raised "
                        f"{type(exc).__name__}: {exc}")
        ran.append(line)
    assert len(ran) >= 5, (ran, skipped)

    # what the README promises, checked on the objects its code built
    for p in ns["params"]:
        assert np.all(np.isfinite(p.get_value())), p.name
    assert any(not np.array_equal(p.get_value(), v) for p, v in zip(ns["params"], initial))
    if "avg" in ns:
        assert ns["avg"].steps >= 1
        assert not ns["avg"].applied  # the with-block restored the trained weights
    if "save_state" in ns:
        assert os.path.exists("ckpt.npz")
    if "result" in ns:
        assert all(np.all(np.isfinite(v)) for v in ns["result"].params.values())


def test_readme_two_function_recipe_is_safe_on_an_empty_window():
    """The two-function block, verbatim: a flush with nothing accumulated changes nothing."""
    block = next(code for _, code in python_blocks(README.read_text())
                 if "accumulate_gradients(" in code and "apply_fn" in code)
    ns = reader_namespace()
    ns["batches"] = ns["batches"][:3]  # exactly one full window of N = 3
    exec(compile(block, "README.md", "exec"), ns)
    params = ns["params"]
    state = [v for v in ns["apply"] if v not in params]
    before = [np.array(v.get_value(), copy=True) for v in params + state]
    assert int(ns["accu"].count.get_value()) == 0
    ns["apply_fn"]()  # the end-of-epoch flush right after a full window
    ns["apply_fn"]()
    for v, old in zip(params + state, before):
        value = np.asarray(v.get_value())
        assert np.all(np.isfinite(value)), v.name
        np.testing.assert_array_equal(value, old, err_msg=v.name)
    t = {v.name: v for v in state}["adam.t"]
    assert int(t.get_value()) == 1  # one real step, none counted for the empty flushes
