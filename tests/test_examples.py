"""The examples run, on tiny settings, and print what they promise.

Each example's ``main(argv)`` is called in-process (faster than a subprocess)
and its returned results and printed output are checked: table rows present,
numbers finite, accumulation equal to the large batch in float64. A few
subprocess runs check that bad input ends with a one-line error and a
non-zero exit status, not a traceback.
"""

import ast
import gzip
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

pytest.importorskip("sklearn")

import batch_norm_digits  # noqa: E402
import batch_size_noise_scale  # noqa: E402
import cross_minibatch  # noqa: E402
import digits_cnn  # noqa: E402
import distributed_digits  # noqa: E402
import increase_batch_size  # noqa: E402
import large_batch_small_memory  # noqa: E402
import memory_plan  # noqa: E402
import mlp_digits  # noqa: E402
import model_average  # noqa: E402
import models  # noqa: E402
import steps_to_target  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compiles")   # tools/fastcompile.py

FAST = ["--no-progress", "--mode", "CVM"]
ROW = re.compile(r"^(control|cross) nodrop minibatch=(\d+)(?:\((\d+)\))? x(\d+) (\d+) iters "
                 r"(\S+) (\S+) lr=(\S+) momentum=(\S+)$", re.M)


def finite(*values):
    return all(np.isfinite(v) for v in values)


# ------------------------------------------------------------ cross_minibatch


def test_cross_minibatch_table(tmp_path, capsys):
    result = cross_minibatch.main(FAST + ["--model", "mlp", "--epochs", "2", "--train-size", "40",
                                          "--out", str(tmp_path)])
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    rows = ROW.findall(out)
    assert len(rows) == len(cross_minibatch.ROWS) == len(result["rows"])
    labels = {(kind, int(b), int(a or 1), float(m)) for kind, b, a, _, _, _, _, _, m in rows}
    assert labels == {("control", 5, 1, 0.999), ("control", 1, 1, 0.999),
                      ("cross", 1, 5, 0.999), ("cross", 1, 10, 0.999),
                      ("control", 5, 1, 0.995), ("cross", 1, 5, 0.995)}
    lrs = {float(r[7]) for r in rows}
    lr = cross_minibatch.LR
    assert sorted(lrs) == pytest.approx([lr / 10, lr])   # the large and the 10x smaller one
    for kind, b, a, per_epoch, epochs, loss, acc, lr, m in rows:
        assert int(epochs) == 2
        assert int(per_epoch) == 40 // int(b)            # 40 examples, a multiple of 10
        assert finite(float(loss), float(acc)) and 0 <= float(acc) <= 100
    # batch 1 averaged over 5 = batch 5 (same windows), up to float64 rounding
    assert re.search(r"^batch 1 averaged over 5 .* is within 1 accuracy point .* the same to "
                     r"every printed digit$", out, re.M)
    assert result["within_one_point"] is True and result["same_digits"] is True
    by = {(r["batch"], r["average"], r["momentum"]): r for r in result["rows"]}
    assert by[(1, 5, 0.999)]["test_loss"] == pytest.approx(by[(5, 1, 0.999)]["test_loss"],
                                                           rel=1e-10)
    assert re.search(r"^compiling the accumulate step \(CVM\)\.\.\. \d+\.\d s$", err, re.M)
    assert os.path.getsize(tmp_path / "cross_minibatch.png") > 1000


def test_cross_minibatch_quick_defaults():
    args = cross_minibatch.parse_args(["--quick"])
    assert (args.epochs, args.lr) == (cross_minibatch.QUICK_EPOCHS, cross_minibatch.QUICK_LR)
    args = cross_minibatch.parse_args(["--quick", "--epochs", "3", "--lr", "0.01"])
    assert (args.epochs, args.lr) == (3, 0.01)
    args = cross_minibatch.parse_args([])
    assert (args.epochs, args.lr) == (cross_minibatch.EPOCHS, cross_minibatch.LR)
    assert args.no_pch is False and cross_minibatch.parse_args(["--no-pch"]).no_pch is True
    assert cross_minibatch.parse_args(["--rows", "4,1"]).rows == [4, 1]
    # the data split does not depend on the rows chosen: every epoch uses the
    # first multiple of the largest window of all rows (10)
    for rows in ("1", "2,3", "4,1", "5"):
        assert cross_minibatch.parse_args(["--rows", rows]).multiple == 10
    assert cross_minibatch.parse_args([]).multiple == 10


def test_cross_minibatch_turns_precompiled_headers_and_parallel_compiles_on_and_off(tmp_path):
    from pytensor.link.c.cmodule import GCC_compiler

    import fastcompile   # tools/, on the path through models.fast_compiles

    argv = FAST + ["--model", "mlp", "--epochs", "1", "--train-size", "10", "--rows", "1",
                   "--out", str(tmp_path), "--no-plot"]
    was = fastcompile._pch, fastcompile._jobs
    fastcompile.use_parallel_compile(1)
    fastcompile.use_precompiled_headers(False)
    pytensors = GCC_compiler.compile_str
    assert pytensors.__qualname__ == "GCC_compiler.compile_str"   # PyTensor's own
    try:
        cross_minibatch.main(argv + ["--jobs", "1"])
        assert (GCC_compiler.compile_str is fastcompile._compile_str) is bool(
            fastcompile._gxx_version())
        cross_minibatch.main(argv + ["--no-pch", "--jobs", "1"])
        assert GCC_compiler.compile_str is pytensors
        cross_minibatch.main(argv + ["--no-pch", "--jobs", "3"])
        assert fastcompile._jobs == 3 and GCC_compiler.compile_str is fastcompile._compile_str
        cross_minibatch.main(argv + ["--no-pch"])   # one per core
        assert fastcompile._jobs == len(os.sched_getaffinity(0))
    finally:   # as the module's fixture set it
        fastcompile.use_precompiled_headers(was[0])
        fastcompile.use_parallel_compile(was[1])
    with pytest.raises(SystemExit):
        cross_minibatch.parse_args(["--jobs", "0"])


def test_cross_minibatch_decimal():
    assert cross_minibatch.decimal(1e-4) == "0.0001"
    assert cross_minibatch.decimal(7e-5 / 10) == "0.000007"


# ---------------------------------------------------------------------- models


def test_conv2d_and_pooling_match_numpy():
    import pytensor
    import pytensor.tensor as pt

    rng = np.random.RandomState(0)
    images, W, b = rng.rand(3, 7, 9, 2), rng.rand(3 * 3 * 2, 4), rng.rand(4)
    x = pt.tensor4("x")
    conv = pytensor.function([x], models.conv2d(x, pt.constant(W), pt.constant(b), 3, 7, 9),
                             mode="CVM")
    expected = np.empty((3, 5, 7, 4))
    for i in range(5):
        for j in range(7):
            expected[:, i, j] = np.einsum("bklc,klcf->bf", images[:, i:i + 3, j:j + 3],
                                          W.reshape(3, 3, 2, 4)) + b
    np.testing.assert_allclose(conv(images), expected, rtol=1e-12)
    pool = pytensor.function([x], models.max_pool_2x2(x, 5, 7), mode="CVM")
    maps = rng.rand(2, 5, 7, 3)
    np.testing.assert_array_equal(
        pool(maps), maps[:, :4, :6].reshape(2, 2, 2, 3, 2, 3).max(axis=(2, 4)))


# ------------------------------------------------------------------ digits_cnn


def test_digits_cnn_forms_and_model_average(capsys):
    tiny = FAST + ["--epochs", "1", "--train-size", "48"]
    plain = digits_cnn.main(tiny + ["--batch-size", "8"])
    accumulated = digits_cnn.main(tiny + ["--batch-size", "4", "--accumulate", "2"])
    averaged = digits_cnn.main(tiny + ["--batch-size", "4", "--average", "2",
                                       "--model-average"])
    out = capsys.readouterr().out
    assert "accumulate 2 (two functions), effective batch 8" in out
    assert "average=2 (one function), effective batch 8" in out
    assert out.count("with ModelAverage: test loss") == 1
    for r in (plain, accumulated, averaged):
        assert finite(r["test_loss"], r["test_acc"])
    assert finite(averaged["avg_test_loss"], averaged["avg_test_acc"])
    # batch 4 accumulated over 2 trains like batch 8 (float32 rounding apart)
    assert accumulated["test_loss"] == pytest.approx(plain["test_loss"], rel=1e-4)
    assert averaged["test_loss"] == pytest.approx(plain["test_loss"], rel=1e-4)


def test_digits_cnn_mlp_option(capsys):
    r = digits_cnn.main(FAST + ["--model", "mlp", "--epochs", "2", "--train-size", "64",
                                "--optimizer", "adam", "--lr", "0.01"])
    assert len(r["history"]) == 2 and finite(*np.ravel(r["history"]))
    assert "MLP on 64 train" in capsys.readouterr().out


# -------------------------------------------------------- MNIST IDX reader


def write_idx(path, array, compress=False):
    codes = {np.dtype("uint8"): 0x08, np.dtype(">i4"): 0x0C}
    header = struct.pack(">BBBB", 0, 0, codes[array.dtype], array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.tobytes()
    with (gzip.open if compress else open)(path, "wb") as f:
        f.write(data)


def write_mnist(directory, n_train=40, n_test=12, side=10, compress=False, seed=0):
    rng = np.random.RandomState(seed)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {"train_images": rng.randint(0, 256, (n_train, side, side)).astype("uint8"),
              "train_labels": (np.arange(n_train) % 10).astype("uint8"),
              "test_images": rng.randint(0, 256, (n_test, side, side)).astype("uint8"),
              "test_labels": (np.arange(n_test) % 10).astype("uint8")}
    for key, name in models.MNIST_FILES.items():
        write_idx(directory / (name + (".gz" if compress else "")), arrays[key], compress)
    return arrays


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_mnist_reader(tmp_path, compress):
    arrays = write_mnist(tmp_path, compress=compress)
    X_train, y_train, X_test, y_test = models.load_mnist(str(tmp_path))
    assert X_train.shape == (40, 100) and X_test.shape == (12, 100)
    assert X_train.dtype == np.float32 and y_train.dtype == np.int64
    np.testing.assert_allclose(X_train * 255, arrays["train_images"].reshape(40, 100), atol=1e-3)
    np.testing.assert_array_equal(y_test, arrays["test_labels"])


def test_read_idx_other_types_and_errors(tmp_path):
    ints = np.arange(6, dtype=">i4").reshape(2, 3)
    write_idx(tmp_path / "ints", ints)
    np.testing.assert_array_equal(models.read_idx(str(tmp_path / "ints")), ints)
    (tmp_path / "text").write_bytes(b"not an idx file")
    with pytest.raises(models.DataError, match="not an IDX file"):
        models.read_idx(str(tmp_path / "text"))
    (tmp_path / "short").write_bytes((tmp_path / "ints").read_bytes()[:-1])
    with pytest.raises(models.DataError, match="header says shape"):
        models.read_idx(str(tmp_path / "short"))
    (tmp_path / "bad.gz").write_bytes(gzip.compress(b"\0\0\x08\x01")[:-4])
    with pytest.raises(models.DataError, match="cannot read"):
        models.read_idx(str(tmp_path / "bad.gz"))
    with pytest.raises(models.DataError, match="missing t10k-images"):
        write_mnist(tmp_path / "partial")
        os.remove(tmp_path / "partial" / "t10k-images-idx3-ubyte")
        models.load_mnist(str(tmp_path / "partial"))


def test_digits_cnn_on_mnist_files(tmp_path, capsys):
    write_mnist(tmp_path / "mnist", compress=True)
    r = digits_cnn.main(FAST + ["--mnist", str(tmp_path / "mnist"), "--epochs", "1",
                                "--batch-size", "8", "--accumulate", "2", "--model-average"])
    assert finite(r["test_loss"], r["test_acc"], r["avg_test_loss"], r["avg_test_acc"])
    assert "CNN on 40 train / 12 test images (10x10)" in capsys.readouterr().out


# ---------------------------------------------------- large_batch_small_memory


@pytest.mark.real_backend   # compares the peak memory of compiled steps
def test_large_batch_small_memory(tmp_path, capsys):
    r = large_batch_small_memory.main(FAST + ["--model", "mlp", "--n", "1,4", "--batch-size", "16",
                                              "--steps", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    table = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)$", out, re.M)
    assert [(int(n), int(nb)) for n, nb, *_ in table] == [(1, 16), (4, 64)]
    for row in table:
        assert finite(*map(float, row[2:]))
    assert r["max_diff"] < 1e-10 and r["same"]
    assert "< 1e-10: same parameters" in out
    big = r["rows"][-1]
    assert big["real_mib"] > big["accum_mib"] > 0          # 64 examples at once vs 16
    assert os.path.getsize(tmp_path / "large_batch_small_memory.png") > 1000


# ----------------------------------------------------------------- model_average


def test_model_average(capsys):
    r = model_average.main(FAST + ["--model", "mlp", "--epochs", "2", "--train-size", "64"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)$", out, re.M)
    assert [int(e) for e, *_ in rows] == [1, 2]
    for row in rows:
        assert finite(*map(float, row[1:]))
    assert set(r["final"]) == {"raw", "ModelAverage", "EMA"}
    assert finite(*np.ravel(list(r["final"].values())))
    assert "ModelAverage ahead of raw after" in out


def test_mlp_digits(capsys):
    loss, acc = mlp_digits.main(["--epochs", "1", "--no-progress"])
    assert finite(loss, acc) and acc > 0.3
    captured = capsys.readouterr()
    assert re.search(r"^done in \d+\.\d s \(compiling included\)$", captured.out, re.M)
    assert re.search(r"^compiling the accumulate \(\w+\) and apply \(\w+\) functions\.\.\. "
                     r"\d+\.\d s$", captured.err, re.M)


def test_distributed_digits_local_sync(capsys):
    distributed_digits.main(["--epochs", "1", "--workers", "2"])
    out = capsys.readouterr().out
    # 1348 training digits, 674 per worker: 22 batches of 32 each (the last of 2), one
    # push per batch, and a sync round (one optimizer step) per pair of pushes
    assert re.search(r"^44 pushes \(\d+/s\), optimizer steps 22, ", out, re.M)
    assert float(re.search(r"test accuracy (\d\.\d+)", out).group(1)) > 0.5


def test_distributed_digits_local_async(capsys):
    distributed_digits.main(["--epochs", "1", "--workers", "2", "--mode", "async"])
    out = capsys.readouterr().out
    # the same 44 pushes, each applied on arrival: one optimizer step per push, and the
    # staleness of every push reported
    assert re.search(r"^44 pushes \(\d+/s\), optimizer steps 44, ", out, re.M)
    staleness = ast.literal_eval(re.search(r"^staleness per push \(largest over the shards\): (\{.*\})$",
                               out, re.M).group(1))
    assert sum(staleness.values()) == 44 and min(staleness) >= 0
    assert float(re.search(r"test accuracy (\d\.\d+)", out).group(1)) > 0.5


# ----------------------------------------------------------------- memory_plan

MEMORY_QUICK = ["--hidden", "256", "--effective-batch", "512", "--budget", "1", "--windows",
                "1"]


def test_memory_plan_prints_b_and_n(capsys):
    r = memory_plan.main(MEMORY_QUICK + ["--mode", "CVM"])
    out = capsys.readouterr().out
    B, N = r["batch_size"], r["accumulate"]
    assert f"effective batch 512 on a budget of 1 MB: B={B}, N={N}\n" in out
    assert B * N == 512 and 1 < N < 512 and r["peak"] <= 1e6
    assert len(r["losses"]) == 1 and finite(*r["losses"])
    assert re.search(rf"^optimizer step 1: mean loss \d\.\d{{4}} over {N} x {B} examples$",
                     out, re.M)


def test_memory_plan_budget_below_one_example_exits_with_the_smallest(capsys):
    with pytest.raises(SystemExit) as exc:
        memory_plan.main(["--budget", "0.001", "--windows", "0"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert re.search(r"^error: memory_plan\(\): a budget of 0.001 MB does not fit one "
                     r"example per micro-batch: .* the smallest budget that fits is \d+ "
                     r"bytes$", err, re.M)


# ------------------------------------------------------------------- --help

ALL_EXAMPLES = [cross_minibatch, digits_cnn, distributed_digits, large_batch_small_memory,
                memory_plan, mlp_digits, model_average]


@pytest.mark.parametrize("module", ALL_EXAMPLES, ids=lambda m: m.__name__)
def test_help_describes_every_flag_with_its_default(module, monkeypatch):
    import argparse

    built = []
    parse = argparse.ArgumentParser.parse_args

    def spy(self, args=None, namespace=None):
        built.append(self)
        return parse(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", spy)
    module.parse_args([])
    parser = built[0]
    summary = module.__doc__.strip().splitlines()[0]
    assert parser.description.splitlines()[0] == summary and len(summary) > 20
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest == "help":
            continue
        text = formatter._get_help_string(action)
        assert text and len(text) > 8, action.option_strings
        if action.default is not None and action.default is not False:
            assert "default" in text, (action.option_strings, text)
    assert "default: " in parser.format_help()


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize("module, argv", [
    (digits_cnn, ["--accumulate", "0"]),
    (digits_cnn, ["--average", "-2"]),
    (digits_cnn, ["--optimizer", "sgdd"]),
    (digits_cnn, ["--accumulate", "2", "--average", "2"]),
    (digits_cnn, ["--lr", "-1"]),
    (digits_cnn, ["--mode", "FASTEST"]),
    (cross_minibatch, ["--epochs", "0"]),
    (cross_minibatch, ["--rows", "0,9"]),
    (cross_minibatch, ["--train-size", "5"]),            # less than one window of 10
    (large_batch_small_memory, ["--n", "2,0"]),
    (large_batch_small_memory, ["--optimizer", "nope"]),
    (model_average, ["--batch-size", "0"]),
    (model_average, ["--ema-decay", "1.5"]),
    (memory_plan, ["--budget", "0"]),
    (memory_plan, ["--windows", "-1"]),
])
def test_bad_flags_are_usage_errors(module, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage:") and ": error: " in err[-1]   # argparse's usage + error
    assert "Traceback" not in "\n".join(err)


def test_data_errors_exit_1_in_process(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        digits_cnn.main(["--mnist", str(tmp_path / "nowhere")])
    assert exc.value.code == 1
    assert capsys.readouterr().err.strip() == (
        f"error: MNIST directory not found: {tmp_path / 'nowhere'}")


def test_unusable_output_directory(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exc:
        cross_minibatch.main(["--out", str(tmp_path / "file" / "sub")])
    assert exc.value.code == 1
    assert capsys.readouterr().err.startswith("error: cannot create output directory")


def run_example(name, *argv):
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *argv],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.strip()]


def test_exit_codes_subprocess(tmp_path):
    """Real processes: one-line errors, status 2 for flags, 1 for data, no traceback."""
    bad_flag = run_example("cross_minibatch.py", "--lr", "0")
    assert bad_flag.returncode == 2 and "Traceback" not in bad_flag.stderr
    assert error_lines(bad_flag.stderr)[-1] == (
        "cross_minibatch.py: error: argument --lr: must be a finite number > 0, got 0")

    missing = run_example("digits_cnn.py", "--mnist", str(tmp_path / "missing"))
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert error_lines(missing.stderr)[-1] == (
        f"error: MNIST directory not found: {tmp_path / 'missing'}")

    write_mnist(tmp_path / "corrupt")
    path = tmp_path / "corrupt" / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-7])          # truncated
    corrupt = run_example("digits_cnn.py", "--mnist", str(tmp_path / "corrupt"))
    assert corrupt.returncode == 1 and "Traceback" not in corrupt.stderr
    last = error_lines(corrupt.stderr)
    assert len(last) == 1 and last[0].startswith("error: ") and "header says shape" in last[0]


# ------------------------------------------------------------------ progress


def test_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    bar = models.progress(range(5), desc="x")
    assert bar.bar is None
    assert list(bar) == [0, 1, 2, 3, 4]
    assert list(models.progress([1, 2], enabled=False)) == [1, 2]


# ------------------------------------------------- every mode the --help lists

import importlib.util  # noqa: E402

import large_batch_recipe  # noqa: E402

OTHER_BACKENDS = [
    pytest.param("JAX", marks=pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                                 reason="jax not installed")),
    pytest.param("PYTORCH", marks=pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                                     reason="torch not installed")),
]


def _numbers_mlp_digits(result):
    return list(result)


def _numbers_rows(key):
    def numbers(result):
        return [row[k] for row in result["rows"] for k in key]
    return numbers


def _numbers_digits_cnn(result):
    return [result["test_loss"], result["test_acc"], result["avg_test_loss"],
            result["avg_test_acc"]]


def _numbers_model_average(result):
    return [v for row in result["history"] for name in sorted(row) for v in row[name]]


def _numbers_small_memory(result):
    assert result["same"] and result["max_diff"] < 1e-10   # the example's own claim
    big = result["rows"][-1]      # N=4: (XLA's) peak of the real batch above accumulation's
    assert not np.isfinite(big["real_mib"]) or big["real_mib"] > big["accum_mib"] > 0
    return []


def _numbers_memory_plan(result):
    return [result["batch_size"], result["accumulate"], *result["losses"]]


#: Each example's quick setting (the one its test above runs), the numbers it
#: returns, and the relative tolerance of those numbers against the C backend's
#: (float32 models: the backends round sums differently).
QUICK = {
    "mlp_digits": (mlp_digits, ["--epochs", "1", "--no-progress"], _numbers_mlp_digits,
                   1e-4),
    "digits_cnn": (digits_cnn, ["--no-progress", "--epochs", "1", "--train-size", "48",
                                "--batch-size", "4", "--average", "2", "--model-average"],
                   _numbers_digits_cnn, 1e-4),
    "model_average": (model_average, ["--no-progress", "--model", "mlp", "--epochs", "2",
                                      "--train-size", "64"], _numbers_model_average, 1e-9),
    "cross_minibatch": (cross_minibatch, ["--no-progress", "--model", "mlp", "--epochs", "1",
                                          "--train-size", "40", "--rows", "1,3", "--no-plot"],
                        _numbers_rows(("test_loss", "test_acc")), 1e-9),
    "large_batch_small_memory": (large_batch_small_memory,
                                 ["--no-progress", "--model", "mlp", "--n", "1,4",
                                  "--batch-size", "16", "--steps", "2", "--no-plot"],
                                 _numbers_small_memory, 0),
    "large_batch_recipe": (large_batch_recipe,
                           ["--no-progress", "--epochs", "1", "--train-size", "96", "--batch",
                            "4", "--accumulate", "4", "--hidden", "8", "--lr", "0.05",
                            "--warmup-epochs", "1", "--rows", "1,4", "--no-plot"],
                           _numbers_rows(("test_loss", "test_acc")), 1e-9),
    "memory_plan": (memory_plan, MEMORY_QUICK, _numbers_memory_plan, 1e-5),
}
_c_numbers = {}


def _run_quick(name, mode):
    module, argv, numbers, _ = QUICK[name]
    result = module.main(argv + ["--mode", mode])
    return [float(v) for v in numbers(result)]


@pytest.mark.real_backend   # the C backend's numbers, compiled
@pytest.mark.parametrize("backend", OTHER_BACKENDS)
@pytest.mark.parametrize("name", sorted(QUICK))
def test_every_example_runs_in_jax_and_pytorch_with_the_numbers_of_c(name, backend, capsys):
    """Every example's --help offers the JAX and PyTorch modes: each runs its quick
    setting there and prints the numbers of the C backend."""
    if name not in _c_numbers:
        _c_numbers[name] = _run_quick(name, "CVM")
    got = _run_quick(name, backend)
    capsys.readouterr()
    want = _c_numbers[name]
    assert len(got) == len(want)
    np.testing.assert_allclose(got, want, rtol=QUICK[name][3], atol=1e-12)


# ------------------------------------------------------- batch_size_noise_scale


def test_batch_size_noise_scale_table(tmp_path, capsys):
    rows = batch_size_noise_scale.main(["--quick", "--max-epochs", "3", "--max-every", "8",
                                        "--target", "0.9", "--mode", "CVM",
                                        "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert [r["label"] for r in rows] == ["fixed K=1", "fixed K=8", "follow B_simple"]
    for r in rows:
        assert re.search(rf"^{re.escape(r['label'])}\s+(\d+|-)\s+(\d+|-)\s+\d+\s+(\S+)$",
                         out, re.M), r["label"]
        steps, examples, losses = zip(*r["curve"])
        assert list(steps) == sorted(steps) and finite(*losses)
        if r["updates"] is not None:      # reached: the last loss is at or under the target
            assert losses[-1] <= 0.9 and r["examples"] == examples[-1]
    assert rows[0]["b_simple"] is None and rows[0]["final_k"] == 1
    assert rows[1]["final_k"] == 8 and rows[1]["b_simple"] > 0
    assert 2 <= rows[2]["final_k"] <= 8 and rows[2]["b_simple"] > 0
    # a window of the fixed K=8 run holds 8 micro-batches of 16 (128 examples), or 116 where
    # it holds the epoch's last batch of 4 (1348 training examples)
    _, examples, _ = zip(*rows[1]["curve"])
    assert set(np.diff(examples)) <= {128, 116} and 128 in set(np.diff(examples))
    assert (tmp_path / "batch_size_noise_scale.png").exists()


# ------------------------------------------------------------- batch_norm_digits


def test_batch_norm_digits_trains_three_ways(capsys):
    result = batch_norm_digits.main(["--quick", "--epochs", "1", "--mode", "CVM"])
    out = capsys.readouterr().out
    (row,) = result["rows"]
    assert set(row) == {"ghost", "ghost-pooled", "exact"}
    for loss, acc in row.values():
        assert finite(loss, acc) and 0 <= acc <= 1
    # ghost and ghost-pooled train the same parameters (only the running averages differ)
    ghost, pooled = (result["trainers"][n] for n in ("ghost", "ghost-pooled"))
    assert ghost.steps == pooled.steps == result["trainers"]["exact"].steps > 0
    for a, b in zip(ghost.accumulation.params, pooled.accumulation.params):
        np.testing.assert_array_equal(a.get_value(), b.get_value())
    assert result["gap"] > 0 and "largest |ghost - exact|" in out
    assert re.search(r"^\s+1\s+\S+\s+\S+%", out, re.M)


# ------------------------------------------------------------ increase_batch_size


def test_increase_batch_size_writes_its_table_and_plot(tmp_path, capsys):
    results = increase_batch_size.main(["--quick", "--seeds", "1", "--epochs", "3",
                                        "--no-progress", "--mode", "CVM",
                                        "--out", str(tmp_path)])
    out = capsys.readouterr().out
    table = (tmp_path / "increase_batch_size.txt").read_text()
    assert table.strip() in out
    rows = re.findall(r"^(decay lr|increase batch)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$",
                      table, re.M)
    assert [r[0] for r in rows] == ["decay lr", "increase batch"]
    for _, acc, std, updates in rows:
        assert 0 <= float(acc) <= 100 and float(std) >= 0 and int(updates) > 0
    # the same examples, in fewer updates once the batch grows (K = 1, 5, 25 by thirds)
    decay, increase = (results[k][0] for k in ("decay lr", "increase batch"))
    assert increase["updates"] < decay["updates"]
    assert len(decay["curve"]) == len(increase["curve"]) == 3
    assert (tmp_path / "increase_batch_size.png").exists()


# ------------------------------------------------------------ steps_to_target


def test_steps_to_target_fit_recovers_the_model_it_fits():
    # points drawn from S = S_min + E_min / B itself: the fit returns its parameters,
    # with R^2 = 1, and far below B_crit the slope is close to -1
    B = 2.0 ** np.arange(8)
    s_min, e_min = 30.0, 4000.0
    got_s, got_e, r2 = steps_to_target.fit(B, s_min + e_min / B)
    assert got_s == pytest.approx(s_min, rel=1e-6) and got_e == pytest.approx(e_min, rel=1e-6)
    assert r2 == pytest.approx(1.0)
    assert steps_to_target.slope_below(B, 1.0 / B, 64) == pytest.approx(-1.0)
    assert steps_to_target.slope_below(B, 1.0 / B, 1.5) is None   # one point


def test_steps_to_target_writes_its_table_and_plot(tmp_path, capsys):
    result = steps_to_target.main(["--quick", "--powers", "3", "--max-epochs", "4",
                                   "--noise-windows", "2", "--noise-k", "4",
                                   "--out", str(tmp_path)] + FAST)
    out = capsys.readouterr().out
    table = (tmp_path / "steps_to_target.txt").read_text()
    assert table.strip() in out
    rows = re.findall(r"^\s+(\d+)\s+(\d+|never)\s", table, re.M)
    assert [int(B) for B, _ in rows] == [8, 16, 32]
    # one compiled trainer served every run: 3 batch sizes x 3 rates x 1 momentum
    assert len(result["found"]) == 9
    reached = [int(s) for _, s in rows if s != "never"]
    assert all(s > 0 for s in reached)
    if "momentum" in result["fits"]:
        f = result["fits"]["momentum"]
        assert f["b_crit"] == pytest.approx(f["e_min"] / f["s_min"])
        assert re.search(r"^momentum: S_min [\d.]+ steps, E_min \d+ examples, B_crit \d+",
                         table, re.M)
    assert result["b_simple"] is None or result["b_simple"] > 0
    assert "B_simple" in table
    assert (tmp_path / "steps_to_target.png").exists()


def test_steps_to_target_refuses_bad_grids():
    for bad in (["--momenta", "1.0"], ["--lrs", "0,0.1"], ["--lrs", "x"]):
        with pytest.raises(SystemExit) as exc:
            steps_to_target.parse_args(bad)
        assert exc.value.code != 0
