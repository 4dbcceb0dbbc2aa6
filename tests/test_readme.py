"""The README's promises: its quickstart runs and is right, its table is what the demo prints.

The quickstart block runs as a reader would paste it; its numbers are then checked
against a numpy re-derivation of Adam on the large batches (``tests/reference.py``),
not only against each other. The demo's table is compared line by line with a run of
the README's main command's example.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reference import reference_step

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def python_blocks(text):
    """The code of every ```python block of `text`."""
    return re.findall(r"^```python[ \t]*\n(.*?)^```", text, re.S | re.M)


def test_readme_is_a_front_page():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 150
    assert lines[3:5] == ["bash scripts/run-demo.sh     # set up .venv, then train the demo on "
                          "bundled digits (the table below)",
                          "bash scripts/run-tests.sh    # set up .venv, then run the test suite"]
    first_code = next(i for i, ln in enumerate(lines) if ln.startswith("```python"))
    assert first_code < 40   # runnable code on the first screen
    (quickstart,) = python_blocks(text)
    assert len([ln for ln in quickstart.splitlines() if ln.strip()]) <= 20
    for page in re.findall(r"\]\((docs/[\w-]+\.rst)\)", text):
        assert (ROOT / page).exists(), page


def test_quickstart_runs_and_equals_adam_on_the_large_batches():
    (code,) = python_blocks(README.read_text())
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)
    X, Y = ns["X"], ns["Y"]
    params, state = {"W": np.zeros((3, 3))}, {}
    for i in range(0, 256, 64):
        xb, yb = X[i:i + 64], Y[i:i + 64]
        grad = 2 * xb.T @ (xb @ params["W"] - yb) / yb.size   # d/dW of mean((xW - y)^2)
        reference_step("adam", params, {"W": grad}, state, learning_rate=0.1)
    for name in ("W1", "W2", "W3"):
        np.testing.assert_allclose(ns[name].get_value(), params["W"], rtol=1e-10, atol=1e-12,
                                   err_msg=name)


def _readme_table():
    text = README.read_text()
    block = re.search(r"^## The seed's table, reproduced\n.*?^```\n(.*?)^```", text, re.S | re.M)
    return block.group(1).splitlines()


@pytest.mark.slow
def test_the_demo_prints_the_readme_table():
    """``bash scripts/run-demo.sh`` runs this example with these arguments."""
    demo = (ROOT / "scripts" / "run-demo.sh").read_text()
    assert "examples/cross_minibatch.py --quick" in demo
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "examples/cross_minibatch.py", "--quick", "--no-plot",
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [ln for ln in done.stdout.splitlines() if ln.startswith(("control ", "cross "))]
    assert rows == _readme_table()
