"""examples/large_batch_recipe.py runs on tiny settings and prints its table."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

pytest.importorskip("sklearn")

import large_batch_recipe  # noqa: E402

ROW = re.compile(r"^(base|\([a-d]\)) (\S+) minibatch=(\d+)(?:\((\d+)\))? x(\d+) (\d+) iters "
                 r"(\S+) (\S+) (lr=\S+)(?: trust=(\S+))? momentum=(\S+)$", re.M)
TINY = ["--no-progress", "--mode", "CVM", "--epochs", "2", "--train-size", "96", "--batch", "4",
        "--accumulate", "4", "--hidden", "8", "--lr", "0.05", "--warmup-epochs", "1"]


def test_table(tmp_path, capsys):
    result = large_batch_recipe.main(TINY + ["--out", str(tmp_path)])
    out = capsys.readouterr().out
    rows = ROW.findall(out)
    assert [r[0] for r in rows] == ["base", "(a)", "(b)", "(c)", "(d)"]
    assert [r[1] for r in rows] == ["baseline", "baseline-lr", "linear-scaling",
                                    "scaling+warmup", "lars+warmup"]
    for tag, _, batch, accumulate, n_batches, epochs, loss, acc, lr, trust, mom in rows:
        assert batch == "4" and accumulate == ("" if tag == "base" else "4")
        assert n_batches == "24" and epochs == "2"     # 96 examples in batches of 4
        assert np.isfinite(float(loss)) and 0 <= float(acc) <= 100
        assert mom == "0.9"
    lrs = {r[0]: r[8] for r in rows}
    # the linear scaling rule: 0.05 * (4 * 4) / 4 for the accumulated batch of 16
    assert lrs["(a)"] == "lr=0.05" and lrs["(b)"] == "lr=0.2"
    assert lrs["(c)"] == "lr=0.05->0.2"
    assert rows[-1][9] == "0.001"
    # the printed numbers are the returned ones
    for r, row in zip(result["rows"], rows):
        assert f"{r['test_loss']:.6f}" == row[6] and f"{r['test_acc']:.2f}" == row[7]
        assert len(r["curve"]) == 2
    assert os.path.getsize(tmp_path / "large_batch_recipe.png") > 1000


def test_rows_subset(capsys):
    large_batch_recipe.main(TINY + ["--no-plot", "--rows", "4"])
    rows = ROW.findall(capsys.readouterr().out)
    assert [r[0] for r in rows] == ["(c)"]


def test_help_gives_every_default():
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, "large_batch_recipe.py"),
                             "--help"], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, COLUMNS="200"))
    assert result.returncode == 0
    assert "effective batch 16*B" in result.stdout
    options = re.findall(r"^  (--[\w-]+) [A-Z_]+\s+(.*)$", result.stdout, re.M)
    assert len(options) >= 14
    for flag, text in options:
        assert "default" in text, flag


@pytest.mark.parametrize("argv, message", [
    (["--rows", "6"], "row numbers go from 1 to 5"),
    (["--warmup-epochs", "-1"], "--warmup-epochs must be >= 0"),
    (["--lars-decay", "-0.1"], "--lars-decay must be >= 0"),
])
def test_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit):
        large_batch_recipe.parse_args(argv)
    assert message in capsys.readouterr().err
