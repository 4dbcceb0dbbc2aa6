"""examples/ghost_batch_norm.py runs on tiny settings and writes a well-formed table.

The checks are structural (the rows, the update counts, the learning rates, what the
large-batch runs share): a run this short says nothing about the paper's numbers.
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

import ghost_batch_norm  # noqa: E402

B, K, EPOCHS, TRAIN, LR = 16, 4, 2, 100, 0.05
ROW = re.compile(r"^(small|large exact|large ghost|large ghost long) +(\d+)x(\d+) +(\d+) +(\S+) +"
                 r"(\d+) +(\d+)" + r" +(\S+)" * 7 + "$", re.M)


@pytest.fixture(scope="module")
def run(tmp_path_factory, cheap_modes):
    out = tmp_path_factory.mktemp("ghost")
    result = ghost_batch_norm.main(
        ["--quick", "--no-progress", "--mode", "CVM", "--out", str(out), "--seeds", "1",
         "--epochs", str(EPOCHS), "--batch-size", str(B), "--accumulate", str(K),
         "--train-size", str(TRAIN), "--lr", str(LR)])
    return result, out


def test_table_file_rows_and_numbers(run, capsys):
    result, out = run
    text = (out / "ghost_batch_norm.txt").read_text()
    assert text.strip() == "\n".join(result["lines"])
    assert re.search(r"gap: the small batch's test accuracy minus the run's", text)
    rows = {m[0]: m[1:] for m in ROW.findall(text)}
    assert list(rows) == [r.name for r in ghost_batch_norm.RUNS]
    per_epoch = TRAIN // B                            # full micro-batches only
    expected = {  # batch, K, BN over, lr, epochs, updates
        "small": (B, 1, B, LR, EPOCHS, per_epoch * EPOCHS),
        "large exact": (B, K, B * K, LR * math.sqrt(K), EPOCHS, per_epoch * EPOCHS // K),
        "large ghost": (B, K, B, LR * math.sqrt(K), EPOCHS, per_epoch * EPOCHS // K),
        "large ghost long": (B, K, B, LR * math.sqrt(K), EPOCHS * K, per_epoch * EPOCHS),
    }
    for name, (b, k, over, lr, epochs, updates, *numbers) in rows.items():
        eb, ek, eover, elr, eepochs, eupdates = expected[name]
        assert (int(b), int(k), int(over), int(epochs), int(updates)) == \
            (eb, ek, eover, eepochs, eupdates), name
        assert float(lr) == pytest.approx(elr, abs=1e-3)
        train, test, test_std, gap, gap_std, spread, spread_std = map(float, numbers)
        assert all(np.isfinite(v) for v in map(float, numbers))
        assert 0 <= train <= 100 and 0 <= test <= 100
        assert -100 <= gap <= 100 and -100 <= spread <= 100
        assert test_std == gap_std == spread_std == 0       # one seed
        assert spread == pytest.approx(train - test, abs=0.02)
    small_test = float(rows["small"][7])
    assert float(rows["small"][9]) == 0                      # the small batch's own gap
    for name, row in rows.items():                           # gap = small's test - test
        assert float(row[9]) == pytest.approx(small_test - float(row[7]), abs=0.02)
    assert os.path.getsize(out / "ghost_batch_norm.png") > 1000


def test_runs_share_everything_but_what_they_are_about(run):
    result, _ = run
    runs = {name: rs[0] for name, rs in result["results"].items()}
    exact, ghost, long = runs["large exact"], runs["large ghost"], runs["large ghost long"]
    assert exact["options"] == dict(ghost["options"], batch_norm="exact")
    assert ghost["options"] == dict(every=K, batch_norm="ghost", running_stats="pooled")
    assert runs["small"]["options"] == dict(ghost["options"], every=1)
    assert long["options"] == ghost["options"]
    for key in ("lr", "epochs", "updates", "examples"):
        assert exact[key] == ghost[key], key
    assert ghost["lr"] == pytest.approx(runs["small"]["lr"] * math.sqrt(K))
    # the same examples seen by the three runs of the same epochs; every update a full window
    per_epoch = TRAIN // B
    assert runs["small"]["examples"] == per_epoch * B * EPOCHS
    for r in runs.values():
        assert r["updates"] == r["planned_updates"]
        assert r["examples"] == r["updates"] * r["options"]["every"] * B
        assert len(r["curve"]) == r["epochs"]
        assert [e for e, _, _ in r["curve"]] == list(range(1, r["epochs"] + 1))
        assert all(0 <= a <= 1 for _, _, a in r["curve"])
    # regime adaptation: as many updates as the small batch
    assert long["updates"] == runs["small"]["updates"] and long["epochs"] == EPOCHS * K
