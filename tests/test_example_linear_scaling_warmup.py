"""examples/linear_scaling_warmup.py runs on tiny settings and writes what it promises.

Checks the table and the plot, and what follows from the design whatever the numbers:
the same first micro-batch in every run, K times fewer updates for K micro-batches per
update, a warm-up whose first update uses the base rate (a K times shorter first step
than the scaled rate's, from the same gradient), a zero gap for the K=1 row. Not the
paper's numbers.
"""

import math
import os
import re
import sys

import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

pytest.importorskip("sklearn")

import linear_scaling_warmup  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compiles")   # tools/fastcompile.py

NUMBER = r"([-+]?\d+(?:\.\d+)?)"
ROW = re.compile(r"^(K=\d+ (?:base|no warm-up|warm-up))\s+(\d+)\s+(\d+)\s+(\S+)\s+(\d+)"
                 + r"\s+" + r"\s+".join([NUMBER] * 6) + r"$", re.M)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    out = tmp_path_factory.mktemp("linear_scaling_warmup")
    results = linear_scaling_warmup.main(["--quick", "--seeds", "1", "--epochs", "2",
                                          "--ks", "16", "--warmup-epochs", "1",
                                          "--no-progress", "--mode", "CVM", "--out", str(out)])
    return results, out


def test_writes_its_table_and_plot(ran):
    results, out = ran
    table = (out / "linear_scaling_warmup.txt").read_text()
    rows = ROW.findall(table)
    assert [r[0] for r in rows] == ["K=1 base", "K=16 no warm-up", "K=16 warm-up"]
    assert "early gap: mean training loss over the first 2 epochs" in table
    for name, k, batch, lr, updates, *numbers in rows:
        acc, acc_std, gap, gap_std, final, final_std = map(float, numbers)
        assert all(math.isfinite(v) for v in map(float, numbers))
        assert 0 <= acc <= 100 and acc_std >= 0 and gap_std >= 0 and final_std >= 0
        assert int(batch) == 8 * int(k) and int(updates) == results[name][0]["updates"]
    lrs = {r[0]: r[3] for r in rows}
    assert lrs == {"K=1 base": "0.025", "K=16 no warm-up": "0.4",
                   "K=16 warm-up": "0.025->0.4"}
    assert float(rows[0][7]) == 0 and float(rows[0][9]) == 0   # K=1 against itself
    assert os.path.getsize(out / "linear_scaling_warmup.png") > 1000


def test_structure_of_the_runs(ran):
    results, _ = ran
    base, scaled, warm = (results[n][0] for n in ("K=1 base", "K=16 no warm-up",
                                                  "K=16 warm-up"))
    # the same micro-batches in the same order from the same initial MLP
    assert len(base["losses"]) == len(scaled["losses"]) == len(warm["losses"])
    assert base["losses"][0] == scaled["losses"][0] == warm["losses"][0]
    np.testing.assert_array_equal(base["sizes"], warm["sizes"])
    # 16 micro-batches per update (the last window flushed at the end)
    assert base["updates"] == len(base["losses"])
    assert scaled["updates"] == warm["updates"] == math.ceil(base["updates"] / 16)
    # the two K=16 runs share their first window, so their first gradient; from zero
    # velocity the first step is lr * gradient: the warm-up's uses lr, not 16 * lr
    assert scaled["first_step"] / warm["first_step"] == pytest.approx(16, rel=1e-3)
    # the micro-batches inside the first window see the same parameters
    np.testing.assert_allclose(scaled["losses"][:16], warm["losses"][:16], rtol=1e-6)
    assert all(np.isfinite(r["losses"]).all() for r in (base, scaled, warm))


def test_bad_ks_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        linear_scaling_warmup.parse_args(["--ks", "1,16"])
    assert info.value.code == 2
    assert "every K must be >= 2" in capsys.readouterr().err
