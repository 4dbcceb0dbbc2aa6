"""What runs fast on this machine: the measured default modes, the BLAS of each backend.

:func:`~lasagne_accum.default_modes` does not assume which backend is faster:
PyTensor's C backend runs whatever BLAS it was linked to (a system OpenBLAS
older than the CPU falls back to generic kernels and runs several times
slower), while Numba calls SciPy's BLAS. :func:`measured_modes` times a small
accumulate step and apply step under both backends once per machine,
PyTensor release, BLAS and dtype (:mod:`lasagne_accum._probe`, in a process of
its own, about half a minute on a cold compile cache), and keeps the result in a
JSON file beside PyTensor's compile directory. :func:`show_config` (and
``python -m lasagne_accum``) prints the BLAS each backend runs, with its
kernel, and what :func:`~lasagne_accum.default_modes` picked and why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["ModeChoice", "measured_modes", "blas_libraries", "blas_summary", "generic_kernel",
           "show_config"]

#: Bumped when the probe changes what it measures (an edit of its code or of the fast
#: paths makes older files stale anyway: :func:`machine_key` holds their hash).
PROBE_VERSION = 2
BACKENDS = ("CVM", "NUMBA")
DTYPES = ("float32", "float64")
#: the thread settings a measurement depends on
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMBA_NUM_THREADS", "MKL_THREADING_LAYER", "OPENBLAS_CORETYPE")
#: OpenBLAS kernels (``openblas_get_corename``) that use AVX2 and FMA
AVX2_KERNELS = frozenset({"haswell", "skylakex", "cooperlake", "sapphirerapids", "zen",
                          "excavator", "steamroller"})
#: C/Numba time of the accumulate probe above which the C backend's BLAS counts as slow
SLOW_RATIO = 1.5

_lock = threading.Lock()
_memo: dict[tuple[str, str], ModeChoice] = {}


@dataclass(frozen=True)
class ModeChoice:
    """What :func:`~lasagne_accum.default_modes` picked for one dtype, and why.

    Attributes
    ----------
    dtype : str
    accumulate, apply : str
        The base modes picked (``"CVM"`` or ``"NUMBA"``).
    times : dict
        ``{step: {"CVM": ms, "NUMBA": ms}}``: milliseconds per call of the probe's
        steps (median of 30 timed calls), empty when nothing was measured.
    reason : str
        One line: the measured ratios, or why nothing could be measured.
    path : str or None
        The file the measurement is kept in.
    libraries : list of dict
        The BLAS libraries the probe saw (see :func:`blas_libraries`).
    load : float or None
        The machine's 1-minute load average when it was measured (a busy machine
        slows a threaded BLAS most).
    """

    dtype: str
    accumulate: str
    apply: str
    times: dict = field(default_factory=dict)
    reason: str = ""
    path: str | None = None
    libraries: list = field(default_factory=list)
    load: float | None = None

    @property
    def modes(self) -> tuple[str, str]:
        return self.accumulate, self.apply


# --------------------------------------------------------------------------
# the measurement and its file
# --------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=None)
def _code_key() -> str:
    """A hash of the code a measurement runs: the probe and the fast paths of our modes."""
    import glob

    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(here, "_probe.py"), os.path.join(here, "modes.py"),
             *sorted(glob.glob(os.path.join(here, "_pytensor", "*.py")))]
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def machine_key() -> dict[str, Any]:
    """Everything a measurement depends on: the machine, the releases, the BLAS, the threads,
    the library's code."""
    import numba
    import numpy
    import pytensor
    import scipy

    from . import __version__

    return {"probe": PROBE_VERSION, "lasagne_accum": __version__, "code": _code_key(),
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu": cpu_name(), "cpus": os.cpu_count(), "pytensor": pytensor.__version__,
            "numba": numba.__version__, "numpy": numpy.__version__, "scipy": scipy.__version__,
            "blas__ldflags": pytensor.config.blas__ldflags, "cxx": pytensor.config.cxx,
            "threads": {v: os.environ.get(v) for v in THREAD_VARS}}


def cache_folder() -> str:
    """``<pytensor compiledir>/lasagne_accum``: where measurements are kept."""
    import pytensor

    return os.path.join(pytensor.config.compiledir, "lasagne_accum")


def cache_path(key: dict[str, Any]) -> str:
    """The measurement file for `key`."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(cache_folder(), f"default_modes-{digest}.json")


def _valid_times(entry: Any) -> bool:
    """A probe's ``{step: {"CVM": ms, "NUMBA": ms, ...}}`` with a finite positive time for
    at least one backend of each step."""
    if not isinstance(entry, dict):
        return False
    for step in ("accumulate", "apply"):
        times = entry.get(step)
        if not isinstance(times, dict):
            return False
        found = [times[b] for b in BACKENDS if b in times]
        if not found or not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0
                                for t in found):
            return False
    return True


def _read(path: str, key: dict[str, Any]) -> dict[str, Any]:
    """The file's contents if it is readable and measured under `key`; else ``{}`` (redo)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("key") != key or \
            not isinstance(data.get("dtypes"), dict):
        return {}
    data["dtypes"] = {d: e for d, e in data["dtypes"].items() if d in DTYPES and _valid_times(e)}
    if not isinstance(data.get("libraries"), list):
        data["libraries"] = []
    return data


def _write(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


#: seconds a probe process may take to compile, and then to time
PROBE_TIMEOUT = 600
#: the probe's command line after the interpreter
PROBE_ARGS = ("-m", "lasagne_accum._probe")


def _probe(dtypes: list[str]) -> dict[str, Any]:
    """Run :mod:`lasagne_accum._probe` in child processes (the caller's environment).

    One process per dtype, all compiling at once; then each times its steps in
    turn while the others wait, so that no timing shares the machine with a
    compile. Answers ``{"dtypes": {dtype: entry}, "libraries": [...], "load": x}``
    and, for a dtype whose process failed, ``"errors": {dtype: why}``; raises
    RuntimeError when every process failed.
    """
    import tempfile

    import pytensor

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    children = []
    with contextlib.ExitStack() as stack:
        for dtype in dtypes:
            log = stack.enter_context(tempfile.TemporaryFile("w+"))
            child = subprocess.Popen([sys.executable, *PROBE_ARGS],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, cwd=here)
            stack.callback(_stop, child)
            request = {"dtypes": [dtype], "blas__ldflags": pytensor.config.blas__ldflags,
                       "handshake": True}
            assert child.stdin is not None  # stdin=PIPE
            child.stdin.write(json.dumps(request) + "\n")
            child.stdin.flush()
            children.append((dtype, child, log))
        ready = {dtype: _compiled(child) for dtype, child, _ in children}
        answer: dict[str, Any] = {"dtypes": {}, "errors": {}}
        for dtype, child, log in children:
            try:
                if not ready[dtype]:   # it exited, or stayed silent for PROBE_TIMEOUT
                    _stop(child)
                    raise ValueError("no answer")
                out, _ = child.communicate("go\n", timeout=PROBE_TIMEOUT)
                if child.returncode:
                    raise ValueError("no answer")
                one = json.loads(out)
                answer["dtypes"][dtype] = one["dtypes"][dtype]
            except (OSError, ValueError, KeyError, TypeError, subprocess.TimeoutExpired):
                log.seek(0)
                tail = (log.read().strip().splitlines() or ["no output"])[-1]
                answer["errors"][dtype] = (f"the probe exited with status {child.returncode}:"
                                           f" {tail}")
                continue
            if "libraries" not in answer:
                answer["libraries"], answer["load"] = one.get("libraries"), one.get("load")
    if not answer["dtypes"]:
        raise RuntimeError("; ".join(answer["errors"].values()))
    return answer


def _compiled(child: subprocess.Popen) -> bool:
    """Wait for the probe's ``compiled`` line; False if it exits or stays silent for
    :data:`PROBE_TIMEOUT` (a thread reads it: ``select`` takes no pipes on Windows)."""
    out = child.stdout
    assert out is not None  # stdout=PIPE
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(out.readline()), daemon=True)
    reader.start()
    reader.join(PROBE_TIMEOUT)
    return bool(line) and line[0].strip() == "compiled"


def _stop(child: subprocess.Popen) -> None:
    """End a probe process that is still running (an error or a timeout left it)."""
    if child.poll() is None:
        child.kill()
        child.wait()


def _choose(dtype: str, entry: dict[str, Any], path: str | None,
            libraries: list) -> ModeChoice:
    """The faster backend of each step (C on a tie), and the line that says so."""
    picked, parts = {}, []
    for step in ("accumulate", "apply"):
        times = entry[step]
        have = [b for b in BACKENDS if b in times]
        best = min(have, key=lambda b: (times[b], BACKENDS.index(b)))
        picked[step] = best
        if len(have) == 2:
            parts.append(f"{step}: C {times['CVM']:.3g} ms, Numba {times['NUMBA']:.3g} ms")
        else:
            failed = next(b for b in BACKENDS if b not in have)
            why = (times.get("error") or {}).get(failed, "did not compile")
            parts.append(f"{step}: {failed} failed ({why})")
    times = {s: {b: entry[s][b] for b in BACKENDS if b in entry[s]}
             for s in ("accumulate", "apply")}
    return ModeChoice(dtype, picked["accumulate"], picked["apply"], times,
                      f"measured per call on this machine ({dtype}): " + "; ".join(parts),
                      path, libraries)


def _fallback(dtype: str, why: str) -> ModeChoice:
    """The rule used where nothing could be measured: C for the accumulate step where
    PyTensor links a BLAS, Numba for the apply step."""
    from .modes import blas_available

    accumulate = "CVM" if blas_available() else "NUMBA"
    return ModeChoice(dtype, accumulate, "NUMBA", {},
                      f"not measured ({why}); C where a BLAS is linked", None)


def measured_modes(dtype: str | None = None, *, remeasure: bool = False) -> ModeChoice:
    """The base modes of the accumulate and apply steps for `dtype`, by measurement.

    Measured once per machine, PyTensor (and Numba, NumPy, SciPy) release,
    ``blas__ldflags``, thread settings and dtype, in a child process; kept in
    ``<pytensor compiledir>/lasagne_accum/default_modes-<hash>.json``. A file
    that cannot be read, was measured under other conditions or holds values
    that are not timings is ignored and measured again.

    Parameters
    ----------
    dtype : {"float32", "float64"}, optional
        Default: ``pytensor.config.floatX``.
    remeasure : bool
        Measure again even if a valid measurement is kept.

    Returns
    -------
    ModeChoice
        Where the measurement cannot run at all (the child process fails), the
        rule used before measurements (C for the accumulate step where PyTensor
        links a BLAS, Numba for the apply step), with the reason; a process
        keeps what it found for the rest of its life.
    """
    import pytensor

    return _measured([dtype or pytensor.config.floatX], remeasure)[0]


def _measured(dtypes: list[str], remeasure: bool = False) -> list[ModeChoice]:
    """:func:`measured_modes` of each of `dtypes`; those not kept are measured together
    (their probes compile in parallel, see :func:`_probe`)."""
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"default_modes(): dtype must be one of {DTYPES}, got {dtype!r}")
    key = machine_key()
    path = cache_path(key)
    with _lock:
        missing = [d for d in dtypes if remeasure or (path, d) not in _memo]
        if missing:
            with _file_lock(path):
                _measure_into_memo(missing, key, path, remeasure)
        return [_memo[(path, d)] for d in dtypes]


def _measure_into_memo(dtypes: list[str], key: dict[str, Any], path: str,
                       remeasure: bool) -> None:
    """Read the kept measurement, probe the dtypes it lacks, keep what was measured and
    put each dtype's choice (or the fallback, with the reason) into the memo."""
    kept: str | None = path
    data = _read(path, key)
    if remeasure:
        for dtype in dtypes:
            data.get("dtypes", {}).pop(dtype, None)
    todo = [d for d in dtypes if d not in data.get("dtypes", {})]
    if todo:
        try:
            answer = _probe(todo)
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            answer = {"errors": {d: str(exc) for d in todo}}
        errors = answer.get("errors") or {}
        got = {}
        for dtype in todo:
            entry = (answer.get("dtypes") or {}).get(dtype)
            if _valid_times(entry):
                got[dtype] = entry
            else:
                _memo[(path, dtype)] = _fallback(
                    dtype, errors.get(dtype, "the probe gave no timings"))
        if got:
            data = {"key": key, "dtypes": {**data.get("dtypes", {}), **got},
                    "libraries": answer.get("libraries") or data.get("libraries", []),
                    "load": answer.get("load")}
            try:
                _write(path, data)
            except OSError:
                kept = None  # a read-only compile directory: kept for this process only
    load = data.get("load")
    for dtype in dtypes:
        if dtype in data.get("dtypes", {}):
            _memo[(path, dtype)] = replace(
                _choose(dtype, data["dtypes"][dtype], kept, data.get("libraries", [])),
                load=float(load) if isinstance(load, (int, float)) else None)


def _file_lock(path: str):
    """A lock on the measurement file, so that processes started together measure once."""
    try:
        from filelock import FileLock
    except ImportError:  # pragma: no cover - filelock comes with PyTensor
        return contextlib.nullcontext()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError:
        return contextlib.nullcontext()
    return FileLock(path + ".lock", timeout=900)


# --------------------------------------------------------------------------
# the BLAS each backend runs
# --------------------------------------------------------------------------
def generic_kernel(library: dict[str, Any], flags: frozenset[str] | None = None) -> bool:
    """True when an OpenBLAS `library` runs a kernel without AVX2 on a CPU that has AVX2.

    That is what an OpenBLAS older than its CPU does: it does not know the
    model and falls back to its generic (``Prescott``) kernels, several times
    slower. Other libraries, and CPUs without AVX2, give False.
    """
    flags = cpu_flags() if flags is None else flags
    if library.get("internal_api") != "openblas" or not {"avx2", "fma"} <= flags:
        return False
    return str(library.get("architecture") or "").lower() not in AVX2_KERNELS


def blas_libraries(libraries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The probe's BLAS libraries, each with ``role`` (``"C backend"``, ``"NumPy"``,
    ``"SciPy (Numba's dot)"``) and ``generic`` (see :func:`generic_kernel`)."""
    return [dict(lib, generic=generic_kernel(lib)) for lib in libraries
            if isinstance(lib, dict) and lib.get("user_api") == "blas"]


def _describe(lib: dict[str, Any]) -> str:
    kernel = lib.get("architecture") or (
        "chosen at run time" if lib.get("internal_api") == "mkl" else "not reported")
    layer = f" ({lib['threading_layer']})" if lib.get("threading_layer") else ""
    name = os.path.basename(str(lib.get("filepath") or "?"))
    return (f"{lib.get('internal_api')} {lib.get('version')}, kernel {kernel}, "
            f"{lib.get('num_threads')} threads{layer}, {name}")


def blas_summary(libraries: list[dict[str, Any]] | None = None) -> str:
    """One line naming each BLAS the backends run, with its kernel: ``"C backend: openblas
    0.3.21, kernel Prescott, ...; NumPy: ...; SciPy (Numba's dot): ..."`` (the libraries the
    float32 measurement saw, by default). The performance page puts it above each table."""
    if libraries is None:
        libraries = measured_modes("float32").libraries
    libs = blas_libraries(libraries)
    parts = [f"{lib['role']}: {_describe(lib)}" for lib in sorted(libs, key=lambda x: x["role"])]
    if not any(lib["role"] == "C backend" for lib in libs):
        parts.append(f"C backend: {_unidentified_c_blas()}")
    return "; ".join(parts)


def _unidentified_c_blas() -> str:
    import pytensor

    if not pytensor.config.blas__ldflags:
        return "no BLAS linked: matrix products through NumPy's C API"
    return ("not identified (a BLAS threadpoolctl does not know, for example the reference "
            "BLAS)")


def _optional(name: str):
    """The module `name`, or None where it is not installed or does not import."""
    import importlib

    try:
        return importlib.import_module(name)
    except Exception:  # not installed, or a broken install: the report says so
        return None


def report_lines(dtypes: tuple[str, ...] = DTYPES) -> tuple[list[str], list[str]]:
    """The report's lines and its warnings (see :func:`show_config`)."""
    import numba
    import numpy
    import pytensor
    import scipy

    from . import __version__

    lines = [f"lasagne_accum {__version__} on Python {platform.python_version()}, "
             f"{platform.system()} {platform.machine()}",
             f"CPU: {cpu_name()}, {os.cpu_count()} CPUs"
             + (", AVX-512" if "avx512f" in cpu_flags() else
                ", AVX2" if "avx2" in cpu_flags() else ""),
             f"PyTensor {pytensor.__version__} (Numba {numba.__version__}, "
             f"NumPy {numpy.__version__}, SciPy {scipy.__version__}); "
             f"compiledir {pytensor.config.compiledir}",
             f"PyTensor blas__ldflags: {pytensor.config.blas__ldflags!r}"]
    warnings: list[str] = []
    choices = _measured(list(dtypes))
    libs = blas_libraries(choices[0].libraries)
    lines.append("BLAS:")
    c_libs = [lib for lib in libs if lib["role"] == "C backend"]
    for lib in sorted(libs, key=lambda lib: lib["role"]):
        lines.append(f"  {lib['role']:<20} {_describe(lib)}"
                     + ("  <- generic kernel" if lib["generic"] else ""))
    if not c_libs:
        lines.append(f"  {'C backend':<20} {_unidentified_c_blas()}")
    jax = _optional("jax")
    jax_line = "not installed" if jax is None else f"XLA's own kernels; devices {jax.devices()}"
    lines.append(f"  JAX                  {jax_line}")
    torch = _optional("torch")
    if torch is None:
        lines.append("  PyTorch              not installed")
    else:
        blas = next((part.split("=", 1)[1].rstrip(",") for part in
                     torch.__config__.show().split() if part.startswith("BLAS_INFO=")),
                    "unknown")
        lines.append(f"  PyTorch              {torch.__version__}, BLAS {blas}; CUDA "
                     f"{'available' if torch.cuda.is_available() else 'not available'}")
    lines.append("default_modes():")
    for choice in choices:
        lines.append(f"  {choice.dtype}: accumulate {choice.accumulate}, apply {choice.apply}"
                     f" -- {choice.reason}")
    if choices[0].path:
        load = choices[0].load
        lines.append(f"  kept in {choices[0].path}" + (
            f" (measured at a 1-minute load average of {load:.2f} on {os.cpu_count()} CPUs: "
            "delete the file to measure again)" if load is not None else ""))
    slow = [c for c in choices if "CVM" in c.times.get("accumulate", {})
            and "NUMBA" in c.times["accumulate"]
            and c.times["accumulate"]["CVM"] > SLOW_RATIO * c.times["accumulate"]["NUMBA"]]
    generic = any(lib["generic"] for lib in c_libs)
    if generic or slow:
        what = ("runs a generic kernel" if generic else
                f"runs the accumulate probe more than {SLOW_RATIO}x slower than Numba")
        warnings.append(
            f"warning: PyTensor's C backend BLAS {what}. default_modes() compiles with Numba "
            "where that is faster; to make the C backend fast, run the README's set-up "
            "(scripts/setup.sh gives it MKL's wheel), or install a BLAS that knows this "
            "CPU and set PyTensor's blas__ldflags to it (docs: troubleshooting, 'A slow BLAS').")
    if not pytensor.config.blas__ldflags:
        warnings.append("warning: PyTensor's C backend links no BLAS; see docs: "
                        "troubleshooting, 'A slow BLAS'.")
    return lines, warnings


def show_config(file: Any = None) -> list[str]:
    """Print what runs fast here: versions, each backend's BLAS and kernel, the default modes.

    The report a bug report asks for (also ``python -m lasagne_accum``):
    PyTensor's version and ``blas__ldflags``; the BLAS libraries of PyTensor's
    C backend, of NumPy and of SciPy (whose BLAS Numba's products call), each
    with its version, kernel and threads (threadpoolctl); JAX's devices and
    PyTorch's BLAS where installed; the modes :func:`default_modes` picked for
    float32 and float64 and the timings that decided; and a warning line, with
    the fix, when the C backend's BLAS runs a generic kernel or is much slower
    than Numba's.

    Parameters
    ----------
    file : file-like, optional
        Where to print (default ``sys.stdout``).

    Returns
    -------
    list of str
        The warnings printed (empty when all is well).

    Notes
    -----
    The first call on a machine measures the default modes of both dtypes (about
    half a minute, their probes compiling in parallel; see :func:`measured_modes`);
    later calls read the kept measurement.

    Examples
    --------
    >>> import lasagne_accum as la
    >>> warnings = la.show_config()            # doctest: +SKIP
    lasagne_accum 0.3.0 on Python 3.11.7, Linux x86_64
    ...
    """
    lines, warnings = report_lines()
    print("\n".join(lines + warnings), file=file or sys.stdout)
    return warnings
