"""Precompiled headers (``lasagne_accum.compiling``) change how fast g++ compiles, not what.

The reference is g++ itself: the same module compiled without the header.
The object code must match instruction for instruction, and g++'s ``-H``
report must show that the header was in fact used (``!`` before the
``.gch``), or the comparison would prove nothing. The end-to-end tests run in
subprocesses with their own compile directory, so they compile for real
(this suite's conftest swaps the C modes for Python implementations) and
leave the suite's own PyTensor untouched.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytensor.tensor as pt
import pytest
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.rewriting.utils import rewrite_graph
from pytensor.link.c.basic import CLinker
from pytensor.link.c.cmodule import GCC_compiler

from lasagne_accum import compiling
from lasagne_accum.training import use_precompiled_headers

HAVE_GXX = bool(compiling._compiler_version())
needs_gxx = pytest.mark.skipif(not HAVE_GXX, reason="PyTensor's C++ compiler is not g++")


def _adam_like_module():
    """Source, flags and include dirs of a C module PyTensor generates for a rule's apply step."""
    p, g, m, v = (pt.dvector(n) for n in "pgmv")
    m2 = 0.9 * m + 0.1 * g
    v2 = 0.999 * v + 0.001 * g ** 2
    out = p - 0.01 * m2 / (pt.sqrt(v2) + 1e-8)
    outs = rewrite_graph([out, m2, v2], include=("fast_run",), exclude=("inplace",))   # fused
    linker = CLinker().accept(FunctionGraph([p, g, m, v], outs, clone=True))
    return linker.get_src_code(), linker.compile_args(), linker.header_dirs()


def _gxx(cmd, *args, cwd):
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _disassembly(obj):
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", obj], capture_output=True,
                          text=True, check=True).stdout
    return text.split("\n", 3)[3]   # without the line that names the file


@needs_gxx
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_same_object_code_with_and_without_the_header(tmp_path):
    src, preargs, dirs = _adam_like_module()
    assert src.startswith(compiling.HEADER_TEXT.splitlines()[0])
    (tmp_path / "mod.cpp").write_text(src)
    cmd = compiling.compile_command(preargs, dirs)
    header = str(tmp_path / "pch" / "pytensor_headers.h")
    assert compiling.build(cmd, header)
    assert compiling.fresh(header)

    _gxx(cmd, "-c", "mod.cpp", "-o", "plain.o", cwd=tmp_path)
    report = _gxx(cmd, "-H", "-Winvalid-pch", "-include", header, "-c", "mod.cpp",
                  "-o", "header.o", cwd=tmp_path)
    assert f"! {header}.gch" in report.splitlines(), report[:2000]   # used, not read as text

    plain, with_header = (_disassembly(str(tmp_path / o)) for o in ("plain.o", "header.o"))
    assert plain.count("\n") > 100   # a real module, not an empty one
    assert plain == with_header


def test_stale_or_missing_dependencies_mean_rebuild(tmp_path):
    header = tmp_path / "pytensor_headers.h"
    dep = tmp_path / "dep.h"
    dep.write_text("")
    assert not compiling.fresh(str(header))   # nothing built
    (tmp_path / "pytensor_headers.h.gch").write_bytes(b"built")
    assert not compiling.fresh(str(header))   # no dependency list
    (tmp_path / "pytensor_headers.h.d").write_text(f"x.gch: {header} \\\n {dep}\n")
    header.write_text("")
    old = time.time() - 100
    for f in (header, dep):
        os.utime(f, (old, old))
    assert compiling.fresh(str(header))
    os.utime(dep)   # a header it was built from changed since
    assert not compiling.fresh(str(header))
    os.utime(dep, (old, old))
    dep.unlink()
    assert not compiling.fresh(str(header))   # a dependency is gone
    (tmp_path / "pytensor_headers.h.d").write_text("x.gch:\n")
    assert not compiling.fresh(str(header))   # an empty list proves nothing


def test_bad_input_and_turning_it_off():
    use_precompiled_headers(False)
    pytensors = GCC_compiler.compile_str
    with pytest.raises(TypeError, match="enable must be a bool, got str"):
        use_precompiled_headers("yes")
    assert GCC_compiler.compile_str is pytensors   # nothing changed
    assert use_precompiled_headers() is HAVE_GXX
    assert (GCC_compiler.compile_str is compiling._compile_str) is HAVE_GXX
    assert use_precompiled_headers() is HAVE_GXX   # twice is the same as once
    assert use_precompiled_headers(False) is False
    assert GCC_compiler.compile_str is pytensors
    # (conftest's fixture puts the suite's choice back for the next test)


def test_other_compilers_are_left_alone(tmp_path):
    """clang reads ``.gch`` files its own way; a missing compiler has no version."""
    fake = tmp_path / "clang++"
    fake.write_text("#!/bin/sh\necho 'clang version 17.0.6'\n")
    fake.chmod(0o755)
    assert compiling._version_of(str(fake)) == ""
    assert compiling._version_of(str(tmp_path / "no-such-compiler")) == ""
    assert compiling._version_of("") == ""


# ---------------------------------------------------------------- end to end

_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np, pytensor, pytensor.tensor as pt
    from lasagne_accum import compiling
    from lasagne_accum.training import use_precompiled_headers

    corrupt = sys.argv[1] == "corrupt"
    on = use_precompiled_headers()
    x = pt.dvector("x")
    graphs = [pt.exp(x) + float(sys.argv[2]), pt.tanh(x) * 3.0, pt.sqrt(x ** 2 + 1.0)]
    refs = [lambda a: np.exp(a) + float(sys.argv[2]), lambda a: np.tanh(a) * 3.0,
            lambda a: np.sqrt(a ** 2 + 1.0)]
    a = np.linspace(-2, 2, 7)
    errors = []
    for k, (graph, ref) in enumerate(zip(graphs, refs)):
        if corrupt and k == 2:   # the header (built for graph 1) cut short
            for path in compiling._headers.values():
                if path:
                    data = open(path + ".gch", "rb").read()
                    open(path + ".gch", "wb").write(data[: len(data) // 3])
        f = pytensor.function([x], graph, mode="CVM")
        errors.append(float(np.max(np.abs(f(a) - ref(a)))))
    headers = [p for p in compiling._headers.values() if p]
    print(json.dumps({"on": on, "counts": compiling.counts, "errors": errors,
                      "headers": headers,
                      "fresh": [compiling.fresh(p) for p in headers]}))
""")


def _run(tmp_path, *argv):
    env = dict(os.environ, PYTENSOR_FLAGS=f"compiledir={tmp_path / 'compiledir'}")
    done = subprocess.run([sys.executable, "-c", _SCRIPT, *argv], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_gxx
def test_compiles_right_with_headers_built_once_and_reused(tmp_path):
    first = _run(tmp_path, "plain", "1.0")
    assert first["on"]
    # the flag set's first module compiles plain, the second builds the header
    assert first["counts"] == {"plain": 1, "header": 2, "fallback": 0}
    assert len(first["headers"]) == 1 and first["fresh"] == [True]
    assert max(first["errors"]) < 1e-14
    # a new process finds the header and uses it from its first module (a new
    # constant makes the first graph new; the two others come from the cache)
    second = _run(tmp_path, "plain", "2.0")
    assert second["counts"] == {"plain": 0, "header": 1, "fallback": 0}
    assert second["headers"] == first["headers"]
    assert max(second["errors"]) < 1e-14


@needs_gxx
def test_unreadable_header_falls_back_to_a_plain_compile(tmp_path):
    result = _run(tmp_path, "corrupt", "1.0")
    assert result["counts"] == {"plain": 1, "header": 1, "fallback": 1}
    assert result["headers"] == []   # that flag set no longer uses one
    assert max(result["errors"]) < 1e-14
