"""Faster cold compiles: PyTensor's C modules against a precompiled header.

Every C module that PyTensor's C backend generates opens with a block of
``#include`` lines, nearly always the same ones (``Python.h``, numpy's
``arrayobject.h`` and friends; ``<vector>`` and ``<algorithm>`` where an
``Elemwise`` or ``CAReduce`` node is in it), and g++ parses those headers
again for each module: 0.4-0.6 s of a 0.7-1.2 s compile on a 2-core machine,
before a line of the op's own code. :func:`use_precompiled_headers` has g++
parse them once per include block and set of compiler flags, into a
precompiled header (``.gch``) in PyTensor's compile directory, and hands it
to every later compile of that kind with ``-include``.

What it does not change: the code. The precompiled header holds exactly the
module's own include block, built with the module's own command line, and
the module reads its includes again after it (include guards make that
free). The object code is the same instruction for instruction (checked in
``tests/test_compiling.py`` through PyTensor's own compile command).
PyTensor's cache keys are untouched too, so modules compiled with and without
it are interchangeable. g++ refuses a precompiled header that does not match
a compile's flags and reads the header text instead: the same result, slower.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import threading
from typing import Any

__all__ = ["use_precompiled_headers"]

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
_headers: dict[tuple, str | None] = {}   # kind -> header path; None: not usable
_seen: dict[tuple, int] = {}             # kind -> modules compiled so far
#: Op modules compiled in this process: "header" (with a precompiled header),
#: "plain" (without), "fallback" (g++ failed on the header; compiled again
#: without it). For tests and for a user who wonders whether it works.
counts = {"header": 0, "plain": 0, "fallback": 0}


def use_precompiled_headers(enable: bool = True) -> bool:
    """Compile PyTensor's C modules against precompiled headers (g++ only).

    Call it once, before compiling; it lasts for the process. Cold compiles
    (an empty compile cache) get faster; warm ones, which compile nothing,
    do not change. The header of each kind of module (its include block and
    compiler flags) is built when the second module of that kind compiles,
    in ``<pytensor.config.compiledir>/lasagne_accum_pch/``, and rebuilt when
    any file it includes has changed (size, modification time or inode).

    Parameters
    ----------
    enable : bool
        ``False`` puts back the compile function PyTensor had when this was
        first called (headers built so far stay on disk, unused).

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
    The cold run of ``examples/cross_minibatch.py --quick`` (48 C modules)
    took 4-25% less time with it in four paired runs, 17-18% in the middle
    two (README, "Precompiled headers"). The objects are the same: ``tests/test_compiling.py`` compiles a module
    through PyTensor's compile command both ways, with g++ told to fail if
    it cannot use the header, and compares the disassembly. If g++ fails on
    the header itself (say, an unreadable ``.gch``), the module is compiled
    again without it, and that kind of module stops using one; any other
    compile error is raised as PyTensor raises it.

    Examples
    --------
    >>> import pytensor, pytensor.tensor as pt
    >>> from lasagne_accum.training import use_precompiled_headers
    >>> on = use_precompiled_headers()   # False without g++
    >>> x = pt.dvector("x")
    >>> f = pytensor.function([x], pt.exp(x) + 1, mode="CVM")
    >>> float(f([0.0])[0])
    2.0
    >>> use_precompiled_headers(False)   # back to PyTensor's own compile
    False
    """
    global _original
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__}")
    from pytensor.link.c.cmodule import GCC_compiler

    with _lock:
        if _original is None:
            _original = GCC_compiler.compile_str
        on = enable and bool(_gxx_version())
        GCC_compiler.compile_str = staticmethod(  # type: ignore[method-assign]
            _compile_str if on else _original)
        return on


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
    """PyTensor's ``GCC_compiler.compile_str``, with ``-include <header>`` where one fits."""
    def run(extra=()):
        return _original(module_name, src_code, location, include_dirs, lib_dirs, libs,
                         [*(preargs or []), *extra], py_module, hide_symbols)

    block = include_block(src_code)
    if not block or not _gxx_version():   # PyTensor's own helpers; another compiler
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
        header = header_path(cmd, block)
        if fresh(header):
            _headers[key] = header
            return key, header
        _seen[key] = _seen.get(key, 0) + 1
        if _seen[key] < BUILD_ON_MODULE:
            return key, None
        _headers[key] = header if build(cmd, header, block) else None
        return key, _headers[key]


def header_path(cmd: list[str], block: tuple[str, ...]) -> str:
    """Where the precompiled header for this command lives (its ``.h``; the ``.gch`` beside)."""
    import numpy
    import pytensor
    from pytensor.configdefaults import config

    what = (cmd, block, _gxx_version(), sys.version, numpy.__version__, pytensor.__version__)
    digest = hashlib.sha256(repr(what).encode()).hexdigest()[:20]
    return os.path.join(config.compiledir, "lasagne_accum_pch", digest, "pytensor_headers.h")


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
