"""Faster cold compiles: PyTensor's C modules against a precompiled header.

Every C module that PyTensor's C backend generates opens with the same
includes (``Python.h``, numpy's ``arrayobject.h`` and friends, ``<vector>``,
``<algorithm>``), and g++ parses them again for each module: 0.4-0.6 s of a
0.8-1.2 s compile on a 2-core machine, before a line of the op's own code.
:func:`use_precompiled_headers` has g++ parse them once per set of compiler
flags, into a precompiled header (``.gch``) in PyTensor's compile directory,
and hands it to every later compile with ``-include``.

What it does not change: the code. The precompiled header holds exactly the
text the module would have included, built with the module's own flags, and
the object code is the same instruction for instruction (checked in
``tests/test_compiling.py``). PyTensor's cache keys are untouched too, so
modules compiled with and without it are interchangeable. g++ itself refuses
a precompiled header that does not match a compile's flags and then reads the
header text instead, which gives the same result more slowly.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import threading
from typing import Any

__all__ = ["use_precompiled_headers"]

#: The lines every module of PyTensor 3's C backend starts with (those with
#: support code add the last two); the precompiled header holds them all.
HEADER_TEXT = """#include <Python.h>
#include "pytensor_mod_helper.h"
#include <math.h>
#include <numpy/arrayobject.h>
#include <numpy/arrayscalars.h>
#include <numpy/npy_math.h>
#include <vector>
#include <algorithm>
"""
_FIRST_LINE = HEADER_TEXT.splitlines()[0]
#: A flag set gets its header on its second module: building one costs about
#: two module compiles, so flag sets with a single module are not worth it.
BUILD_AFTER = 1

_lock = threading.RLock()
_original: Any = None         # GCC_compiler.compile_str as PyTensor defines it, once seen
_headers: dict[tuple, str | None] = {}   # flag set -> header path, None: not usable
_seen: dict[tuple, int] = {}  # flag set -> modules compiled without a header so far
#: Op modules compiled in this process: "header" (with a precompiled header),
#: "plain" (without), "fallback" (g++ failed on the header; compiled again
#: without it). For tests and for a user who wonders whether it works.
counts = {"header": 0, "plain": 0, "fallback": 0}


def use_precompiled_headers(enable: bool = True) -> bool:
    """Compile PyTensor's C modules against a precompiled header (g++ only).

    Call it once, before compiling; it lasts for the process. Cold compiles
    (an empty compile cache) get faster; warm ones, which compile nothing,
    do not change. The header of each flag set is built on the set's second
    module, in ``<pytensor.config.compiledir>/lasagne_accum_pch/``, and
    rebuilt when a file it includes is newer than it.

    Parameters
    ----------
    enable : bool
        ``False`` goes back to PyTensor's own compile (headers built so far
        stay on disk, unused).

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
    spends about a quarter less time in g++ (README, "Compiler flags"). The
    objects are the same: ``tests/test_compiling.py`` compiles a module
    both ways and compares the disassembly. If g++ fails on the header
    itself (say, an unreadable ``.gch``), the module is compiled again
    without it, and that flag set stops using one; any other compile error
    is raised as PyTensor raises it.

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
        on = enable and bool(_compiler_version())
        GCC_compiler.compile_str = staticmethod(  # type: ignore[method-assign]
            _compile_str if on else _original)
        return on


def _compiler_version() -> str:
    """g++'s version line and full version, or "" if it is missing or not g++."""
    from pytensor.configdefaults import config

    return _version_of(config.cxx)


@functools.lru_cache(maxsize=None)
def _version_of(cxx: str) -> str:
    if not cxx:
        return ""
    try:
        banner = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                timeout=30)
        full = subprocess.run([cxx, "-dumpfullversion", "-dumpversion"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    first = banner.stdout.splitlines()[0] if banner.stdout else ""
    if banner.returncode or "clang" in banner.stdout.lower() \
            or "Free Software Foundation" not in banner.stdout:
        return ""
    return f"{first} {full.stdout.strip()}"


def _compile_str(module_name, src_code, location=None, include_dirs=None, lib_dirs=None,
                 libs=None, preargs=None, py_module=True, hide_symbols=True):
    """PyTensor's ``GCC_compiler.compile_str`` with ``-include <header>`` added."""
    original = _original
    preargs = list(preargs or [])
    header = key = None
    if src_code.startswith(_FIRST_LINE):   # an op's module, not PyTensor's own helpers
        key, header = _header_for(preargs, list(include_dirs or []), hide_symbols)
        if header is None:
            counts["plain"] += 1
    if header is None:
        return original(module_name, src_code, location, include_dirs, lib_dirs, libs,
                        preargs, py_module, hide_symbols)
    from pytensor.link.c.exceptions import CompileError

    try:
        module = original(module_name, src_code, location, include_dirs, lib_dirs, libs,
                          [*preargs, "-include", header], py_module, hide_symbols)
        counts["header"] += 1
        return module
    except CompileError as error:
        # PyTensor's message: a status line, the command line (which names the
        # header), then g++'s output. Only an error about the header falls back.
        said = str(error).split("\n", 2)[-1]
        if "PCH" not in said and os.path.basename(header) not in said:
            raise
    with _lock:
        _headers[key] = None
        counts["fallback"] += 1
    return original(module_name, src_code, location, include_dirs, lib_dirs, libs,
                    preargs, py_module, hide_symbols)


def compile_command(preargs: list[str], include_dirs: list[str],
                    hide_symbols: bool = True) -> list[str]:
    """The g++ command line (up to the file names) PyTensor compiles a module with.

    The same options in the same order as ``GCC_compiler.compile_str``, less
    the linker's (``-shared``, ``-L``, ``-l``, ``-Wl,``).
    """
    from pytensor.configdefaults import config
    from pytensor.link.c.cmodule import std_include_dirs

    cmd = [config.cxx, "-g", *(a for a in preargs if not a.startswith(("-l", "-L", "-Wl,")))]
    cmd += [f"-I{d}" for d in [d for d in include_dirs if d] + std_include_dirs()]
    if hide_symbols:
        cmd.append("-fvisibility=hidden")
    return cmd


def _header_for(preargs: list[str], include_dirs: list[str], hide_symbols: bool):
    """(flag set, header path or None) for a module compiled with these options."""
    cmd = compile_command(preargs, include_dirs, hide_symbols)
    key = tuple(cmd)
    with _lock:
        if key in _headers:
            return key, _headers[key]
        header = header_path(cmd)
        if fresh(header):
            _headers[key] = header
            return key, header
        _seen[key] = _seen.get(key, 0) + 1
        if _seen[key] <= BUILD_AFTER:
            return key, None
        _headers[key] = header if build(cmd, header) else None
        return key, _headers[key]


def header_path(cmd: list[str]) -> str:
    """Where the precompiled header for this command lives (its ``.h``; the ``.gch`` beside)."""
    from pytensor.configdefaults import config

    digest = hashlib.sha256(repr((cmd, HEADER_TEXT, _compiler_version())).encode())
    return os.path.join(config.compiledir, "lasagne_accum_pch", digest.hexdigest()[:20],
                        "pytensor_headers.h")


def fresh(header: str) -> bool:
    """Whether ``header.gch`` exists and is newer than every file it was built from."""
    try:
        built = os.stat(header + ".gch").st_mtime
        with open(header + ".d") as f:
            deps = f.read()
    except OSError:
        return False
    # make's format: "target: dep dep \<newline> dep ..."; a space in a name is "\ "
    names = deps.replace("\\\n", " ").partition(":")[2].replace("\\ ", "\0").split()
    try:
        return bool(names) and all(os.stat(n.replace("\0", " ")).st_mtime <= built
                                   for n in names)
    except OSError:
        return False


def build(cmd: list[str], header: str) -> bool:
    """Write the header and precompile it with ``cmd``; True on success.

    Files appear atomically (written under a temporary name, then renamed),
    so a process that finds the ``.gch`` finds it whole.
    """
    folder = os.path.dirname(header)
    tmp = f"{header}.{os.getpid()}.{threading.get_ident()}"
    try:
        os.makedirs(folder, exist_ok=True)
        try:
            with open(header) as f:
                same = f.read() == HEADER_TEXT
        except OSError:
            same = False
        if not same:   # (rewriting it would make a header built from it look stale)
            with open(tmp + ".h", "w") as f:
                f.write(HEADER_TEXT)
            os.replace(tmp + ".h", header)
        done = subprocess.run([*cmd, "-x", "c++-header", header, "-o", tmp + ".gch",
                               "-MD", "-MF", tmp + ".d"], capture_output=True, timeout=600)
        if done.returncode:
            return False
        os.replace(tmp + ".d", header + ".d")
        os.replace(tmp + ".gch", header + ".gch")
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        for leftover in (tmp + ".h", tmp + ".gch", tmp + ".d"):
            try:
                os.remove(leftover)
            except OSError:
                pass
