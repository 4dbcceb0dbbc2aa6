"""Faster cold compiles of PyTensor's C backend: precompiled headers, parallel compiles.

A compile-speed tool for PyTensor, not part of lasagne_accum: the demo, the
examples and the test suite opt in to it by name (``fast_compiles()`` in
``examples/models.py``); nothing turns it on by itself. It wraps PyTensor's
compile function and VM linker while on, and is tested with the PyTensor
releases in :data:`TESTED`; outside them, turning it on warns and does
nothing (PyTensor compiles as it always does).

Every C module that PyTensor's C backend generates opens with a block of
``#include`` lines, nearly always the same ones (``Python.h``, numpy's
``arrayobject.h`` and friends; ``<vector>`` and ``<algorithm>`` where an
``Elemwise`` or ``CAReduce`` node is in it), and g++ parses those headers
again for each module, before a line of the op's own code: most of a small
module's compile time. :func:`use_precompiled_headers` has g++
parse them once per include block and set of compiler flags, into a
precompiled header (``.gch``) in PyTensor's compile directory, and hands it
to every later compile of that kind with ``-include``.

What it does not change: the code. The precompiled header holds exactly the
module's own include block, built with the module's own command line, and
the module reads its includes again after it (include guards make that
free). The object code is the same instruction for instruction (checked in
``tests/test_fastcompile.py`` through PyTensor's own compile command).
PyTensor's cache keys are untouched too, so modules compiled with and without
it are interchangeable. g++ refuses a precompiled header that does not match
a compile's flags and reads the header text instead: the same result, slower.

:func:`use_parallel_compile` runs g++ on several of a function's modules at
once. PyTensor compiles them one by one, as it makes each node's thunk, each
under its compile lock. Before it starts, this looks at the nodes PyTensor is
about to make thunks for, generates each C module's source the way PyTensor
will, and has a pool of threads compile the ones missing from the cache, each
into a new directory of the compile directory. When PyTensor then compiles a
module a job compiled, it is handed the job's directory, and if its source and
compiler arguments are exactly the job's, it imports the job's library instead
of running g++ again; everything else (the cache, its keys and lock, the
import) is PyTensor's own.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["use_precompiled_headers", "use_parallel_compile", "TESTED"]

#: The PyTensor releases this tool is tested with: ``low <= version < high``.
TESTED = ("3.0.7", "3.4")

#: The include lines PyTensor 3's C backend opens its modules with. A module
#: whose leading include block uses only these (in any order or number) gets a
#: precompiled header of exactly that block; any other compiles as before.
KNOWN_INCLUDES = frozenset([
    "#include <Python.h>",
    '#include "pytensor_mod_helper.h"',
    "#include <math.h>",
    "#include <numpy/arrayobject.h>",
    "#include <numpy/arrayscalars.h>",
    "#include <numpy/npy_math.h>",
    "#include <vector>",
    "#include <algorithm>",
])
#: A kind of module (include block and flags) gets its header when its second
#: module compiles: building one costs about two module compiles, so kinds with
#: a single module are not worth one.
BUILD_ON_MODULE = 2

_lock = threading.RLock()
_original: Any = None     # GCC_compiler.compile_str as found at the first call
_original_make_all: Any = None   # VMLinker.make_all as found at the first call
_original_from_key: Any = None   # ModuleCache.module_from_key as found at the first call
_original_workdir: Any = None    # cmodule.dlimport_workdir as found at the first call
_pch = False              # use_precompiled_headers is on
_jobs = 1                 # use_parallel_compile's number of compiles at once
_headers: dict[tuple, str | None] = {}   # kind -> header path; None: not usable
_kind_locks: dict[tuple, threading.Lock] = {}   # kind -> held while its header builds
_seen: dict[tuple, int] = {}             # kind -> modules compiled so far
#: PyTensor's cache key of a module a job compiles -> (what compile_str will be
#: called with, the job: its directory when done)
_pending: dict[Any, tuple[tuple, Future]] = {}
#: A finished job's directory, handed to PyTensor as the module's location ->
#: what compile_str must be called with to use what is in it
_handed: dict[str, tuple] = {}
_next = threading.local()   # .where: the directory dlimport_workdir hands out next
_executor: ThreadPoolExecutor | None = None   # the compile threads (see _pool)
#: Op modules compiled in this process: "header" (with a precompiled header),
#: "plain" (without), "fallback" (g++ failed on the header; compiled again
#: without it), these three only while headers are on; and "parallel": modules
#: PyTensor asked for that a parallel job had compiled (with headers on, each
#: job's g++ run is also counted under "header" or "plain"). For tests and for
#: a user who wonders whether it works.
counts = {"header": 0, "plain": 0, "fallback": 0, "parallel": 0}


def use_precompiled_headers(enable: bool = True) -> bool:
    """Compile PyTensor's C modules against precompiled headers (g++ only).

    Call it once, before compiling; it lasts for the process. Cold compiles
    (an empty compile cache) get faster; warm ones, which compile nothing,
    do not change. The header of each kind of module (its include block and
    compiler flags) is built when the second module of that kind compiles,
    in ``<pytensor.config.compiledir>/fastcompile_pch/``, and rebuilt when
    any file it includes has changed (size, modification time or inode).

    Parameters
    ----------
    enable : bool
        ``False`` compiles without headers again: PyTensor's own compile
        function is put back unless :func:`use_parallel_compile` is on
        (headers built so far stay on disk, unused).

    Returns
    -------
    bool
        Whether compiles now use precompiled headers: ``False`` when
        ``enable`` is ``False``, or when PyTensor has no C++ compiler
        (``pytensor.config.cxx`` empty) or the compiler is not g++ (clang
        reads ``.gch`` files differently).

    Raises
    ------
    TypeError
        If ``enable`` is not a bool.

    Notes
    -----
    The objects are the same: ``tests/test_fastcompile.py`` compiles a module
    through PyTensor's compile command both ways, with g++ told to fail if
    it cannot use the header, and compares the disassembly. If g++ fails on
    the header itself (say, an unreadable ``.gch``), the module is compiled
    again without it, and that kind of module stops using one; any other
    compile error is raised as PyTensor raises it.

    Examples
    --------
    >>> import pytensor, pytensor.tensor as pt
    >>> from fastcompile import use_precompiled_headers
    >>> on = use_precompiled_headers()   # False without g++
    >>> x = pt.dvector("x")
    >>> f = pytensor.function([x], pt.exp(x) + 1, mode="CVM")
    >>> float(f([0.0])[0])
    2.0
    >>> use_precompiled_headers(False)   # back to PyTensor's own compile
    False
    """
    global _pch
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__}")
    with _lock:
        _pch = enable and bool(_gxx_version()) and tested()
        _install()
        return _pch


def use_parallel_compile(jobs: int | None = None) -> int:
    """Compile up to ``jobs`` of a function's C modules at once.

    Call it once, before compiling; it lasts for the process and applies to
    every ``pytensor.function`` compiled with a VM linker (modes ``"CVM"``,
    ``"VM"``, and ``"FAST_RUN"`` where that means C). Cold compiles get
    faster on a machine with more than one core; warm ones compile nothing
    and gain nothing.

    Parameters
    ----------
    jobs : int or None
        How many g++ runs at once; ``None`` means one per CPU this process
        may run on (``os.sched_getaffinity``; ``os.cpu_count()`` where that
        is missing). ``1`` puts back PyTensor's one-by-one compile.

    Returns
    -------
    int
        The number of compiles at once now in effect (1: off).

    Raises
    ------
    TypeError
        If ``jobs`` is not an int or None.
    ValueError
        If ``jobs`` is less than 1.

    Notes
    -----
    PyTensor makes a function's thunks one node at a time, and compiles each
    node's C module, when it is not in the cache, under its compile lock.
    With this on, before PyTensor starts on a function's nodes, their
    modules' source is generated as PyTensor generates it (its own
    ``CLinker``, one node at a time, as ``COp.make_thunk`` does), and the
    ones not in the cache go to a pool of ``jobs`` threads. Each runs
    PyTensor's compile function (with :func:`use_precompiled_headers`'
    header where that is on) into a new directory of the compile directory,
    named as PyTensor names them. When PyTensor then compiles a module a job
    compiled, it is handed that directory as the module's location, and if
    the source, compiler arguments and libraries it compiles with are exactly
    the job's, it imports the job's library instead of running g++ again;
    the library was built at the path it lives at, so it is the one PyTensor
    would have built. Anything else compiles as before. A job that failed is
    not used: PyTensor compiles that module itself and reports its error as
    it always does (for a module g++ rejects, PyTensor's note naming a
    temporary file with the C code then prints twice, once per attempt).
    The jobs run g++ outside PyTensor's compile lock, each in a directory of
    its own; the cache, its keys and its bookkeeping stay PyTensor's, under
    its lock as before, so modules compiled either way are interchangeable.
    ``tests/test_fastcompile.py`` checks that a function's modules are the
    same (source and disassembly) as a one-by-one compile's. Functions
    compiled by other linkers (Numba, JAX, PyTorch) are not affected. A
    Ctrl-C stops the compile at once: the jobs not started are cancelled,
    those running finish in the background (the process waits for them,
    about a second, when it exits), and what any job compiled for nothing
    is deleted.

    Examples
    --------
    >>> import pytensor, pytensor.tensor as pt
    >>> from fastcompile import use_parallel_compile
    >>> jobs = use_parallel_compile(2)
    >>> x = pt.dvector("x")
    >>> f = pytensor.function([x], pt.exp(x) + pt.log1p(x) ** 2, mode="CVM")
    >>> float(f([0.0])[0])
    1.0
    >>> use_parallel_compile(1)   # back to one at a time
    1
    """
    global _jobs
    if isinstance(jobs, bool) or not (jobs is None or isinstance(jobs, int)):
        raise TypeError(f"jobs must be an int or None, got {type(jobs).__name__}")
    if jobs is None:
        jobs = _usable_cpus()
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    with _lock:
        _jobs = jobs if jobs == 1 or tested() else 1
        _install()
        return _jobs


_warned: list[str] = []


def tested() -> bool:
    """Whether the installed PyTensor is one of :data:`TESTED`; warns once if not."""
    import re
    import warnings

    import pytensor

    def numbers(version):
        match = re.match(r"\d+(\.\d+)*", version)
        return tuple(int(x) for x in match.group(0).split(".")) if match else ()

    version = str(getattr(pytensor, "__version__", "0"))
    ok = numbers(TESTED[0]) <= numbers(version) < numbers(TESTED[1])
    if not ok and version not in _warned:
        _warned.append(version)
        warnings.warn(f"fastcompile is tested with PyTensor >={TESTED[0]},<{TESTED[1]}; "
                      f"found {version}: PyTensor compiles as it always does",
                      RuntimeWarning, stacklevel=3)
    return ok


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def _install() -> None:
    """Put in (or take out) the wrappers the features now on need."""
    global _original, _original_make_all, _original_from_key, _original_workdir
    from pytensor.link.c import cmodule
    from pytensor.link.vm import VMLinker

    if _original is None:
        _original = cmodule.GCC_compiler.compile_str
        _original_make_all = VMLinker.make_all
        _original_from_key = cmodule.ModuleCache.module_from_key
        _original_workdir = cmodule.dlimport_workdir
    cmodule.GCC_compiler.compile_str = staticmethod(  # type: ignore[method-assign]
        _compile_str if (_pch or _jobs > 1) else _original)
    parallel = _jobs > 1
    VMLinker.make_all = _make_all if parallel else _original_make_all  # type: ignore[method-assign]
    cmodule.ModuleCache.module_from_key = (  # type: ignore[method-assign]
        _module_from_key if parallel else _original_from_key)
    cmodule.dlimport_workdir = _dlimport_workdir if parallel else _original_workdir


def _gxx_version() -> str:
    """The version of PyTensor's compiler (``config.cxx``); "" if missing or not g++."""
    from pytensor.configdefaults import config

    return _gxx_version_of(config.cxx)


@functools.lru_cache(maxsize=None)
def _gxx_version_of(cxx: str) -> str:
    if not cxx:
        return ""
    try:
        banner = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                timeout=30)
        full = subprocess.run([cxx, "-dumpfullversion", "-dumpversion"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    if banner.returncode or "clang" in banner.stdout.lower() \
            or "Free Software Foundation" not in banner.stdout:
        return ""
    return f"{banner.stdout.splitlines()[0]} {full.stdout.strip()}"


def include_block(src_code: str) -> tuple[str, ...]:
    """The module's leading ``#include`` lines if all are known ones, else ()."""
    block = []
    for line in src_code.splitlines():
        if not line.startswith("#include"):
            break
        block.append(line.strip())
    return tuple(block) if block and set(block) <= KNOWN_INCLUDES else ()


def _compile_str(module_name, src_code, location=None, include_dirs=None, lib_dirs=None,
                 libs=None, preargs=None, py_module=True, hide_symbols=True):
    """PyTensor's ``GCC_compiler.compile_str``: a parallel job's module where it compiled
    this one, else a compile (with ``-include <header>`` where one fits)."""
    if location is not None:
        with _lock:
            expected = _handed.pop(location, None)
        if expected is not None:
            lib = os.path.join(location, _lib_name(module_name))
            if py_module and os.path.isfile(lib) and expected == _job_key(
                    module_name, src_code, include_dirs, lib_dirs, libs, preargs,
                    hide_symbols):
                from pytensor.link.c.cmodule import dlimport

                with open(os.path.join(location, "__init__.py"), "w"):
                    pass   # the last thing compile_str does before importing
                with _lock:
                    counts["parallel"] += 1
                return dlimport(lib)
            # another module's, or cleared meanwhile (say, by another process
            # clearing the cache): compile afresh in an empty directory
            shutil.rmtree(location, ignore_errors=True)
            os.makedirs(location, exist_ok=True)
    return _compile_one(module_name, src_code, location, include_dirs, lib_dirs, libs,
                        preargs, py_module, hide_symbols)


def _compile_one(module_name, src_code, location, include_dirs, lib_dirs, libs, preargs,
                 py_module, hide_symbols):
    """One g++ run through PyTensor's compile function, with a header if on and one fits."""
    def run(extra=()):
        return _original(module_name, src_code, location, include_dirs, lib_dirs, libs,
                         [*(preargs or []), *extra], py_module, hide_symbols)

    block = include_block(src_code)
    if not _pch or not block or not _gxx_version():   # off; PyTensor's own helpers; not g++
        return run()
    key, header = _header_for(block, list(preargs or []), list(include_dirs or []),
                              hide_symbols)
    if header is None:
        with _lock:
            counts["plain"] += 1
        return run()
    from pytensor.link.c.exceptions import CompileError

    try:
        module = run(("-include", header))
    except CompileError as error:
        # PyTensor's message: a status line, the command line (which names the
        # header), then g++'s output. Only an error about the header falls back.
        said = str(error).split("\n", 2)[-1]
        if "PCH" not in said and os.path.basename(header) not in said:
            raise
        with _lock:
            _headers[key] = None
            counts["fallback"] += 1
        return run()
    with _lock:
        counts["header"] += 1
    return module


def _job_key(module_name, src_code, include_dirs, lib_dirs, libs, preargs, hide_symbols):
    """What makes two compiles the same compile."""
    return (module_name, src_code, tuple(include_dirs or ()), tuple(lib_dirs or ()),
            tuple(libs or ()), tuple(preargs or ()), bool(hide_symbols))


def _lib_name(module_name: str) -> str:
    from pytensor.link.c.cmodule import get_lib_extension

    return f"{module_name}.{get_lib_extension()}"


def _job(compiledir, module_name, src_code, include_dirs, lib_dirs, libs, preargs,
         hide_symbols) -> str:
    """Compile one module where PyTensor would: a new directory of the compile
    directory, named as PyTensor names them. The directory, when it worked."""
    where = _original_workdir(compiledir)
    try:
        _compile_one(module_name, src_code, where, include_dirs, lib_dirs, libs, preargs,
                     False, hide_symbols)
        lib = os.path.join(where, _lib_name(module_name))
        if not os.path.isfile(lib):
            raise FileNotFoundError(lib)
        return where
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise


def _discard(job: Future) -> None:
    """Drop a job nobody will use: cancel it if it has not started, else delete
    what it compiles once it is done (without waiting for it here)."""
    def remove(done: Future) -> None:
        if not done.cancelled() and done.exception() is None:
            shutil.rmtree(done.result(), ignore_errors=True)

    job.cancel()
    job.add_done_callback(remove)


def _module_from_key(self, key, lnk):
    """``ModuleCache.module_from_key``: where a job compiled this module, PyTensor's
    new directory for it is the job's (see :func:`_dlimport_workdir`)."""
    try:
        with _lock:
            entry = _pending.pop(key, None)
    except TypeError:   # an unhashable key: PyTensor will say so
        entry = None
    if entry is None:
        return _original_from_key(self, key, lnk)
    expected, job = entry
    try:
        where = job.result()
    except Exception:   # compiled here instead; PyTensor reports any error
        return _original_from_key(self, key, lnk)
    except BaseException:   # interrupted while waiting
        _discard(job)
        raise
    _next.where = where
    with _lock:
        _handed[where] = expected
    try:
        return _original_from_key(self, key, lnk)
    finally:
        # PyTensor took the directory if it asked for one (it then owns it:
        # registered, or removed by its own clean-up on failure)
        taken = getattr(_next, "where", None) is None
        _next.where = None
        with _lock:
            _handed.pop(where, None)
        if not taken:   # it found the module another way, or failed before
            shutil.rmtree(where, ignore_errors=True)


def _dlimport_workdir(basedir):
    """``cmodule.dlimport_workdir``: the job's directory when one is due (once), else a new one."""
    where, _next.where = getattr(_next, "where", None), None
    if where is not None and os.path.dirname(where) == os.path.normpath(str(basedir)):
        return where
    return _original_workdir(basedir)


def _pool() -> ThreadPoolExecutor:
    """The process's compile threads (one pool, so nested compiles share the ``jobs``)."""
    global _executor
    # What the jobs import lazily (PyTensor's compile lock imports filelock at
    # its first use) is imported here, before any job thread exists: two threads
    # making the first import of a package whose files have no bytecode yet can
    # race in importlib's directory cache, and one of them then sees
    # "No module named 'filelock'".
    import filelock  # noqa: F401
    from pytensor.compile import compilelock  # noqa: F401
    from pytensor.link.c import cmodule  # noqa: F401

    with _lock:
        if _executor is None or _executor._max_workers != _jobs:
            if _executor is not None:
                _executor.shutdown(wait=False)
            _executor = ThreadPoolExecutor(_jobs, thread_name_prefix="fastcompile")
        return _executor


def _make_all(self, *args, **kwargs):
    """``VMLinker.make_all``, with the function's missing C modules compiled in parallel first."""
    from pytensor.configdefaults import config

    if _jobs < 2 or self.c_thunks is False or not config.cxx:
        return _original_make_all(self, *args, **kwargs)
    mine = []   # cache keys of the jobs started for this function
    try:
        _submit_missing(self, _pool(), mine)
        return _original_make_all(self, *args, **kwargs)
    finally:
        with _lock:
            left = [_pending.pop(k) for k in mine if k in _pending]
        for _expected, job in left:   # not asked for after all (or interrupted)
            _discard(job)


def _submit_missing(linker, pool, mine: list) -> None:
    """Start a job for each node's C module that PyTensor will compile; their cache
    keys go to ``mine`` as they start."""
    from pytensor.graph.fg import FunctionGraph
    from pytensor.link.c.basic import CLinker
    from pytensor.link.c.basic import get_module_cache
    from pytensor.link.c.cmodule import GCC_compiler, get_module_hash
    from pytensor.link.c.op import COp

    cache = get_module_cache()
    hashes: set[str] = set()
    for node in linker.schedule(linker.fgraph):
        # Only nodes whose thunk COp.make_thunk makes, through a CLinker of
        # the node alone (COp.make_c_thunk; the VM passes no_recycling=[]).
        if getattr(type(node.op), "make_thunk", None) is not COp.make_thunk:
            continue
        try:
            node.op.prepare_node(node, None, None, "c")
            if any(getattr(v.type, "dtype", "") == "float16"
                   for v in node.inputs + node.outputs):
                continue
            cl = CLinker().accept(FunctionGraph(node.inputs, node.outputs), no_recycling=[])
            key = cl.cmodule_key()
            if key is None or key in cache.entry_from_key or key in _pending:
                continue   # nothing to compile, or a job (this or an outer compile's) has it
            for n in cl.node_order:   # as CLinker.cthunk_factory does
                n.op.prepare_node(n, None, None, "c")
            mod = cl.get_dynamic_module()
            src = mod.code()
            module_hash = get_module_hash(src, key)
            if module_hash in cache.module_hash_to_key_data or module_hash in hashes:
                continue   # PyTensor will find it by its source (it has or will have it)
            hashes.add(module_hash)
            if cl.c_compiler() is not GCC_compiler:
                continue
            args = (mod.code_hash, src, cl.header_dirs(), cl.lib_dirs(), cl.libraries(),
                    cl.compile_args(), True)
            with _lock:
                if key in _pending:
                    continue
                _pending[key] = (_job_key(*args), pool.submit(_job, cache.dirname, *args))
                mine.append(key)
        except Exception:   # PyTensor meets (and reports) it when it makes the thunk
            continue


def compile_command(preargs: list[str], include_dirs: list[str],
                    hide_symbols: bool = True) -> list[str]:
    """The g++ command line (up to the file names) PyTensor compiles a module with.

    The same options in the same order as ``GCC_compiler.compile_str``, less
    the linker's (``-shared``, ``-L``, ``-l``, ``-Wl,``).
    """
    from pytensor.configdefaults import config
    from pytensor.link.c.cmodule import std_include_dirs

    args = [a for a in preargs if not a.startswith(("-l", "-L", "-Wl,"))]
    if config.cmodule__remove_gxx_opt:   # as PyTensor does
        args = [a for a in args if not a.startswith("-O")]
    cmd = [config.cxx, "-g", *args]
    cmd += [f"-I{d}" for d in [d for d in include_dirs if d] + std_include_dirs()]
    if hide_symbols:
        cmd.append("-fvisibility=hidden")
    return cmd


def _header_for(block: tuple[str, ...], preargs: list[str], include_dirs: list[str],
                hide_symbols: bool):
    """(kind, header path or None) for a module with this include block and options."""
    cmd = compile_command(preargs, include_dirs, hide_symbols)
    key = (block, tuple(cmd))
    with _lock:
        if key in _headers:
            return key, _headers[key]
        kind_lock = _kind_locks.setdefault(key, threading.Lock())
    with kind_lock:   # one build per kind; other kinds' compiles go on meanwhile
        with _lock:
            if key in _headers:
                return key, _headers[key]
            _seen[key] = _seen.get(key, 0) + 1
            seen = _seen[key]
        header = header_path(cmd, block)
        if fresh(header):
            usable: str | None = header
        elif seen < BUILD_ON_MODULE:
            return key, None
        else:
            usable = header if build(cmd, header, block) else None
        with _lock:
            _headers[key] = usable
        return key, usable


def header_path(cmd: list[str], block: tuple[str, ...]) -> str:
    """Where the precompiled header for this command lives (its ``.h``; the ``.gch`` beside)."""
    import numpy
    import pytensor
    from pytensor.configdefaults import config

    what = (cmd, block, _gxx_version(), sys.version, numpy.__version__, pytensor.__version__)
    digest = hashlib.sha256(repr(what).encode()).hexdigest()[:20]
    return os.path.join(config.compiledir, "fastcompile_pch", digest, "pytensor_headers.h")


def _stamp(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def fresh(header: str) -> bool:
    """Whether ``header.gch`` exists and every file it was built from is unchanged.

    ``header.deps`` lists them (from g++'s ``-MD``) with their size,
    modification time and inode at build time; any difference means stale.
    Package managers may install an upgraded header with an *older*
    modification time than the ``.gch``, so newer-than is not enough.
    """
    try:
        os.stat(header + ".gch")
        with open(header + ".deps") as f:
            stamps = json.load(f)
        return bool(stamps) and all(_stamp(path) == stamp for path, stamp in stamps.items())
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def build(cmd: list[str], header: str, block: tuple[str, ...]) -> bool:
    """Write ``block`` to ``header`` and precompile it with ``cmd``; True on success.

    Files appear atomically (written under a temporary name, then renamed),
    the ``.gch`` last, so a process that finds it finds it whole.
    """
    text = "\n".join(block) + "\n"
    tmp = f"{header}.{os.getpid()}.{threading.get_ident()}"
    try:
        os.makedirs(os.path.dirname(header), exist_ok=True)
        try:
            with open(header) as f:
                same = f.read() == text
        except OSError:
            same = False
        if not same:   # (rewriting it would change its stamp, making the .gch stale)
            with open(tmp + ".h", "w") as f:
                f.write(text)
            os.replace(tmp + ".h", header)
        done = subprocess.run([*cmd, "-x", "c++-header", header, "-o", tmp + ".gch",
                               "-MD", "-MF", tmp + ".d"], capture_output=True, timeout=600)
        if done.returncode:
            return False
        with open(tmp + ".d") as f:   # make's format: "target: dep dep \<newline> dep"
            names = f.read().replace("\\\n", " ").partition(":")[2].replace("\\ ", "\0")
        paths = [n.replace("\0", " ") for n in names.split()]
        stamps = {p: _stamp(p) for p in paths}
        with open(tmp + ".deps", "w") as f:
            json.dump(stamps, f)
        os.replace(tmp + ".deps", header + ".deps")
        os.replace(tmp + ".gch", header + ".gch")
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        for leftover in (".h", ".gch", ".d", ".deps"):
            try:
                os.remove(tmp + leftover)
            except OSError:
                pass
