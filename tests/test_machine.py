"""default_modes() by measurement, its kept file, and the BLAS report (lasagne_accum.machine).

The choice is tested against timings handed to it (which backend is faster is a
fact of the machine, not of the code); one test runs the real probe in its
child process and checks that the choice is the faster of what it measured.
"""

import json
import os
import subprocess
import sys

import pytensor
import pytest

import lasagne_accum as la
from lasagne_accum import machine
from lasagne_accum.modes import float_dtype


def _entry(acc_c, acc_n, apply_c, apply_n):
    return {"accumulate": {"CVM": acc_c, "NUMBA": acc_n},
            "apply": {"CVM": apply_c, "NUMBA": apply_n}}


def _library(version, arch):
    return {"user_api": "blas", "internal_api": "openblas",
            "filepath": f"/x/libopenblasp-r{version}.so", "version": version,
            "architecture": arch, "num_threads": 1, "role": "C backend"}


@pytest.fixture
def compiledir(tmp_path, monkeypatch):
    """A compile directory of the test's own, a fresh in-process memo, and a counted probe
    that answers with the timings the test sets (``probe.answer``)."""
    monkeypatch.setattr(machine, "_memo", {})
    calls = []

    def probe(dtypes):
        calls.append(list(dtypes))
        return {"dtypes": {d: probe.answer for d in dtypes}, "libraries": probe.libraries}

    probe.answer = _entry(1.0, 2.0, 3.0, 1.0)
    probe.libraries = [_library("0.3.21", "Prescott")]
    probe.calls = calls
    monkeypatch.setattr(machine, "_probe", probe)
    monkeypatch.setattr(machine, "cache_folder", lambda: str(tmp_path))
    return probe


def test_the_faster_backend_of_each_step_is_picked(compiledir):
    compiledir.answer = _entry(86.0, 28.0, 1.4, 0.2)         # a C backend with a slow BLAS
    choice = machine.measured_modes("float32")
    assert choice.modes == ("NUMBA", "NUMBA")
    assert "C 86 ms, Numba 28 ms" in choice.reason
    machine._memo.clear()
    compiledir.answer = _entry(11.0, 21.0, 1.4, 0.2)
    assert machine.measured_modes("float32", remeasure=True).modes == ("CVM", "NUMBA")
    compiledir.answer = _entry(1.0, 1.0, 0.5, 0.5)           # a tie: C
    assert machine.measured_modes("float32", remeasure=True).modes == ("CVM", "CVM")


def test_measured_once_then_read_from_the_kept_file(compiledir):
    first = machine.measured_modes("float64")
    assert compiledir.calls == [["float64"]]
    assert os.path.dirname(first.path) == machine.cache_folder()
    with open(first.path) as f:
        kept = json.load(f)
    assert kept["key"] == machine.machine_key() and "float64" in kept["dtypes"]
    machine._memo.clear()                                     # another process
    assert machine.measured_modes("float64") == first
    assert compiledir.calls == [["float64"]]
    machine.measured_modes("float32")                         # another dtype: measured
    assert compiledir.calls == [["float64"], ["float32"]]
    with open(first.path) as f:
        assert set(json.load(f)["dtypes"]) == {"float32", "float64"}


def test_the_report_measures_its_dtypes_together(compiledir, monkeypatch):
    """The report asks for both dtypes at once (one probe call, processes in parallel);
    a dtype whose process failed gets the fallback with the reason, the other is kept."""
    def probe(dtypes):
        compiledir.calls.append(list(dtypes))
        return {"dtypes": {"float32": _entry(1.0, 2.0, 3.0, 1.0)},
                "errors": {"float64": "the probe exited with status 1: boom"},
                "libraries": [], "load": 0.25}

    monkeypatch.setattr(machine, "_probe", probe)
    f32, f64 = machine._measured(["float32", "float64"])
    assert compiledir.calls == [["float32", "float64"]]
    assert f32.modes == ("CVM", "NUMBA") and f32.load == 0.25
    assert "not measured" in f64.reason and "boom" in f64.reason and f64.path is None
    machine._memo.clear()                                      # another process
    assert machine.measured_modes("float32") == f32            # read from the file
    machine.measured_modes("float64")                          # measured again
    assert compiledir.calls == [["float32", "float64"], ["float64"]]


@pytest.mark.parametrize("damage", ["not json {", '["a list"]', "other key",
                                    "negative time", "nan time", "missing step"])
def test_an_unreadable_or_stale_file_is_measured_again(compiledir, damage):
    path = machine.measured_modes("float32").path
    with open(path) as f:
        data = json.load(f)
    if damage == "other key":
        data["key"] = dict(data["key"], pytensor="0.0.1")
    elif damage == "negative time":
        data["dtypes"]["float32"]["accumulate"]["CVM"] = -1.0
    elif damage == "nan time":
        data["dtypes"]["float32"]["apply"]["NUMBA"] = float("nan")
    elif damage == "missing step":
        del data["dtypes"]["float32"]["apply"]
    with open(path, "w") as f:
        f.write(damage if damage.startswith(("not", "[")) else json.dumps(data))
    machine._memo.clear()
    compiledir.answer = _entry(5.0, 1.0, 5.0, 1.0)
    assert machine.measured_modes("float32").modes == ("NUMBA", "NUMBA")
    assert len(compiledir.calls) == 2
    with open(path) as f:
        assert json.load(f)["key"] == machine.machine_key()


def test_a_change_of_blas_or_threads_is_another_measurement(compiledir, monkeypatch):
    path = machine.measured_modes("float32").path
    current = os.environ.get("OMP_NUM_THREADS")   # Dask's tests may have set it already
    monkeypatch.setenv("OMP_NUM_THREADS", "3" if current != "3" else "5")
    assert machine.cache_path(machine.machine_key()) != path
    if current is None:
        monkeypatch.delenv("OMP_NUM_THREADS")
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", current)
    assert machine.cache_path(machine.machine_key()) == path
    with pytensor.config.change_flags(blas__ldflags="-lblas"):
        assert machine.cache_path(machine.machine_key()) != path
        machine.measured_modes("float32")
    assert len(compiledir.calls) == 2


def test_a_failed_probe_falls_back_to_the_blas_rule_and_says_why(compiledir, monkeypatch):
    def broken(dtypes):
        raise RuntimeError("the probe exited with status 1: boom")

    monkeypatch.setattr(machine, "_probe", broken)
    choice = machine.measured_modes("float32")
    assert choice.modes == ("CVM" if pytensor.config.blas__ldflags else "NUMBA", "NUMBA")
    assert "not measured" in choice.reason and "boom" in choice.reason
    assert choice.path is None
    assert machine.measured_modes("float32") is choice        # not retried in this process


def test_a_backend_that_fails_to_compile_loses(compiledir):
    compiledir.answer = {"accumulate": {"NUMBA": 2.0, "error": {"CVM": "CompileError: no g++"}},
                         "apply": {"CVM": 1.0, "NUMBA": 0.5}}
    choice = machine.measured_modes("float32")
    assert choice.modes == ("NUMBA", "NUMBA")
    assert "CVM failed (CompileError: no g++)" in choice.reason


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        la.default_modes("int64")
    with pytest.raises(ValueError, match="float16"):
        la.default_modes("float16")


def test_float_dtype_of_a_model():
    f32, f64 = pytensor.tensor.fscalar(), pytensor.tensor.dscalar()
    assert float_dtype([f32]) == "float32"
    assert float_dtype([f32, f64]) == "float64"
    assert float_dtype([pytensor.tensor.iscalar()]) is None


def test_a_given_mode_is_honoured_without_measuring(compiledir):
    import numpy as np
    import pytensor.tensor as pt

    x = pt.matrix("x")
    w = pytensor.shared(np.zeros((2, 1)), name="w")
    loss = (x @ w).sum()
    compiledir.answer = _entry(100.0, 1.0, 100.0, 1.0)       # would pick NUMBA
    trainer = la.compile_accumulation([x], loss, [w], la.sgd, dict(learning_rate=0.1),
                                      mode="CVM")
    assert compiledir.calls == []
    assert trainer.accumulate_fn.maker.linker is not None
    la.compile_accumulation([x], loss, [w], la.sgd, dict(learning_rate=0.1))
    assert compiledir.calls == [["float64"]]                   # the parameters' dtype


@pytest.mark.parametrize("arch, flags, generic", [
    ("Prescott", {"avx2", "fma", "avx512f"}, True),
    ("Sandybridge", {"avx2", "fma"}, True),
    ("SkylakeX", {"avx2", "fma", "avx512f"}, False),
    ("Haswell", {"avx2", "fma"}, False),
    ("Zen", {"avx2", "fma"}, False),
    ("Prescott", {"sse3"}, False),            # a CPU without AVX2: nothing better to run
])
def test_generic_kernel(arch, flags, generic):
    lib = {"internal_api": "openblas", "architecture": arch}
    assert machine.generic_kernel(lib, frozenset(flags)) is generic
    assert machine.generic_kernel({"internal_api": "mkl"}, frozenset(flags)) is False


def test_report_names_each_backend_blas_and_warns_on_a_generic_kernel(compiledir, capsys):
    compiledir.answer = _entry(86.0, 28.0, 1.4, 0.2)
    warnings = la.show_config()
    out = capsys.readouterr().out
    assert f"PyTensor {pytensor.__version__}" in out
    assert "C backend" in out and "openblas 0.3.21, kernel Prescott" in out
    assert "float32: accumulate NUMBA, apply NUMBA" in out
    assert "float64: accumulate NUMBA, apply NUMBA" in out
    if {"avx2", "fma"} <= machine.cpu_flags():
        assert "<- generic kernel" in out
    assert len(warnings) >= 1 and "C backend BLAS" in warnings[0]
    assert warnings[0] in out and "troubleshooting" in warnings[0]


def test_report_without_warnings_exits_0(compiledir, capsys):
    from lasagne_accum.__main__ import main

    compiledir.answer = _entry(1.0, 2.0, 3.0, 1.0)
    compiledir.libraries = [_library("0.3.30", "SkylakeX")]
    assert main([]) == (0 if pytensor.config.blas__ldflags else 3)
    assert "kernel SkylakeX" in capsys.readouterr().out


def test_blas_summary_is_one_line_per_run(compiledir):
    line = machine.blas_summary()
    assert line.startswith("C backend: openblas 0.3.21, kernel Prescott, 1 threads")
    assert "\n" not in line
    assert machine.blas_summary([]).startswith("C backend: ")


@pytest.mark.real_backend
def test_the_real_probe_picks_the_faster_of_what_it_measured():
    """The probe in its child process: timings for both backends and both steps, the C
    backend's BLAS among the libraries where one is linked, and the choice their argmin."""
    answer = machine._probe(["float32"])
    entry = answer["dtypes"]["float32"]
    assert machine._valid_times(entry)
    for step in ("accumulate", "apply"):
        assert set(entry[step]) >= {"CVM", "NUMBA"}
    choice = machine._choose("float32", entry, None, answer["libraries"])
    for step, picked in (("accumulate", choice.accumulate), ("apply", choice.apply)):
        assert entry[step][picked] == min(entry[step]["CVM"], entry[step]["NUMBA"])
    roles = {lib["role"] for lib in answer["libraries"]}
    assert "NumPy" in roles


_FAKE_PROBE = """
import json, sys, time
request = json.loads(sys.stdin.readline())
(dtype,) = request["dtypes"]
assert request["handshake"]
if dtype == "float64":
    sys.stderr.write("warnings first\\nboom: no compiler\\n")
    sys.exit(1)
started = time.time()
time.sleep(0.5)                                   # compiling
print("compiled", flush=True)
sys.stdin.readline()
timing = time.time()
time.sleep(0.3)                                   # timing
entry = {"accumulate": {"CVM": 1.0, "NUMBA": 2.0}, "apply": {"CVM": 1.0, "NUMBA": 2.0},
         "clock": [started, timing, time.time()]}
json.dump({"dtypes": {dtype: entry}, "libraries": [], "load": 0.5}, sys.stdout)
"""


def _started_processes(monkeypatch):
    """The list of the processes ``subprocess.Popen`` starts from now on."""
    started = []
    real_popen = subprocess.Popen

    def popen(args, **kwargs):
        started.append(real_popen(args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    return started


def _use_probe(tmp_path, monkeypatch, source):
    """Make :func:`machine._probe` start `source` (a Python script) as its probe."""
    script = tmp_path / "fake_probe.py"
    script.write_text(source)
    monkeypatch.setattr(machine, "PROBE_ARGS", (str(script),))


def test_a_failed_probe_process_is_an_error_for_its_dtype_alone(tmp_path, monkeypatch):
    """One process per dtype; the one that exits without an answer gives its dtype an
    error naming the last line it wrote, and the other dtype's answer is kept."""
    _use_probe(tmp_path, monkeypatch, _FAKE_PROBE)
    children = _started_processes(monkeypatch)
    answer = machine._probe(["float32", "float64"])
    assert len(children) == 2
    assert set(answer["dtypes"]) == {"float32"}
    assert answer["errors"]["float64"] == "the probe exited with status 1: boom: no compiler"
    assert answer["load"] == 0.5


def test_probes_compile_together_and_time_one_after_another(tmp_path, monkeypatch):
    """Each dtype's probe process compiles while the others do; the timings run one
    process at a time."""
    _use_probe(tmp_path, monkeypatch, _FAKE_PROBE.replace('if dtype == "float64"', "if False"))
    answer = machine._probe(["float32", "float64"])
    (s1, t1, e1), (s2, t2, e2) = (answer["dtypes"][d]["clock"] for d in ("float32", "float64"))
    assert max(s1, s2) < min(t1, t2)                # both compiled before either timed
    assert t2 >= e1                                 # the second timed after the first ended
    assert "errors" not in answer or not answer["errors"]


def test_every_probe_failing_is_an_error(tmp_path, monkeypatch):
    _use_probe(tmp_path, monkeypatch, "import sys; sys.stderr.write('no numpy'); sys.exit(2)")
    with pytest.raises(RuntimeError, match="status 2: no numpy"):
        machine._probe(["float32", "float64"])


def test_a_silent_probe_process_is_stopped_at_the_timeout(tmp_path, monkeypatch):
    _use_probe(tmp_path, monkeypatch, "import sys, time\nsys.stdin.readline()\ntime.sleep(60)\n")
    monkeypatch.setattr(machine, "PROBE_TIMEOUT", 0.5)
    children = _started_processes(monkeypatch)
    with pytest.raises(RuntimeError, match="status -9"):
        machine._probe(["float32"])
    assert [child.returncode for child in children] == [-9]    # killed, and reaped
