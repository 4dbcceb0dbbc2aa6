"""``tools/fastcompile.py`` changes how fast g++ compiles PyTensor's modules, not what.

The reference is g++ itself: the same module compiled by PyTensor's own
compile function without the header. The object code must match instruction
for instruction, and g++ is told to fail if it cannot use the header
(``-Werror=invalid-pch``), or the comparison would prove nothing. The
end-to-end tests run in subprocesses with their own compile directory, so
they compile for real (this suite's conftest swaps the C modes for Python
implementations) and leave the suite's own PyTensor untouched.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytensor.tensor as pt
import pytest
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.rewriting.utils import rewrite_graph
from pytensor.link.c.basic import CLinker
from pytensor.link.c.cmodule import GCC_compiler

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)
import fastcompile as compiling  # noqa: E402
from fastcompile import use_parallel_compile, use_precompiled_headers  # noqa: E402

HAVE_GXX = bool(compiling._gxx_version())
needs_gxx = pytest.mark.skipif(not HAVE_GXX, reason="PyTensor's C++ compiler is not g++")


def _adam_like_module():
    """What PyTensor compiles for a rule's fused apply step: source and compile_str's arguments."""
    p, g, m, v = (pt.dvector(n) for n in "pgmv")
    m2 = 0.9 * m + 0.1 * g
    v2 = 0.999 * v + 0.001 * g ** 2
    out = p - 0.01 * m2 / (pt.sqrt(v2) + 1e-8)
    outs = rewrite_graph([out, m2, v2], include=("fast_run",), exclude=("inplace",))   # fused
    linker = CLinker().accept(FunctionGraph([p, g, m, v], outs, clone=True))
    return linker.get_src_code(), dict(include_dirs=linker.header_dirs(),
                                       lib_dirs=linker.lib_dirs(), libs=linker.libraries(),
                                       preargs=linker.compile_args())


def _disassembly(lib):
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", lib], capture_output=True,
                          text=True, check=True).stdout
    return text.replace(lib, "")   # the line naming the file


@needs_gxx
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_same_object_code_with_and_without_the_header(tmp_path, monkeypatch):
    """Through PyTensor's own compile command, with g++ told to fail if it cannot use the header."""
    src, kwargs = _adam_like_module()
    assert len(compiling.include_block(src)) == 8   # the full block: Elemwise's too
    kwargs["preargs"] = [*kwargs["preargs"], "-Werror=invalid-pch"]
    use_parallel_compile(1)
    use_precompiled_headers(False)
    pytensors = GCC_compiler.compile_str
    assert pytensors.__qualname__ == "GCC_compiler.compile_str"
    header = str(tmp_path / "pch" / "pytensor_headers.h")
    monkeypatch.setattr(compiling, "header_path", lambda cmd, block: header)
    monkeypatch.setattr(compiling, "BUILD_ON_MODULE", 1)   # build for the first module
    monkeypatch.setattr(compiling, "_headers", {})
    monkeypatch.setattr(compiling, "_seen", {})
    monkeypatch.setattr(compiling, "counts", dict.fromkeys(compiling.counts, 0))

    use_precompiled_headers()
    for where, compile_str in (("plain", pytensors), ("header", compiling._compile_str)):
        os.mkdir(tmp_path / where)
        compile_str("m", src, location=str(tmp_path / where), py_module=False, **kwargs)
    assert compiling.counts == {"header": 1, "plain": 0, "fallback": 0,
                                "parallel": 0}   # no fallback
    assert compiling.fresh(header)
    assert open(header).read() == src[:len(open(header).read())]   # the module's own lines

    plain, with_header = (_disassembly(str(next((tmp_path / w).glob("m.*"))))
                          for w in ("plain", "header"))
    assert plain.count("\n") > 100   # a real module, not an empty one
    assert plain == with_header


def test_include_block():
    known = "\n".join(["#include <Python.h>", "#include <vector>"])
    assert compiling.include_block(known + "\nint x;\n") == ("#include <Python.h>",
                                                              "#include <vector>")
    assert compiling.include_block("#include <iostream>\n" + known) == ()   # not a known one
    assert compiling.include_block("int x;\n" + known) == ()   # not leading
    assert compiling.include_block("") == ()


def test_changed_or_missing_dependencies_mean_rebuild(tmp_path):
    header = str(tmp_path / "pytensor_headers.h")
    dep = tmp_path / "dep.h"
    dep.write_text("int a;")
    assert not compiling.fresh(header)   # nothing built
    (tmp_path / "pytensor_headers.h.gch").write_bytes(b"built")
    assert not compiling.fresh(header)   # no dependency list
    stamps = tmp_path / "pytensor_headers.h.deps"
    stamps.write_text(json.dumps({str(dep): compiling._stamp(str(dep))}))
    assert compiling.fresh(header)
    mtime = dep.stat().st_mtime_ns
    os.utime(dep, ns=(mtime, mtime - 10 ** 9))   # an older time, as a package may install
    assert not compiling.fresh(header)
    os.utime(dep, ns=(mtime, mtime))
    assert compiling.fresh(header)
    (tmp_path / "new.h").write_text("int b;")   # installed as a new file: same size and time
    os.utime(tmp_path / "new.h", ns=(mtime, mtime))
    os.replace(tmp_path / "new.h", dep)
    assert not compiling.fresh(header)   # (another inode)
    stamps.write_text(json.dumps({str(dep): compiling._stamp(str(dep))}))
    assert compiling.fresh(header)
    dep.write_text("long b;")   # another size
    os.utime(dep, ns=(mtime, mtime))
    assert not compiling.fresh(header)
    dep.unlink()
    assert not compiling.fresh(header)   # gone
    stamps.write_text("{}")
    assert not compiling.fresh(header)   # an empty list proves nothing
    stamps.write_text("not json")
    assert not compiling.fresh(header)


def test_bad_input_and_turning_it_off():
    use_parallel_compile(1)
    use_precompiled_headers(False)
    pytensors = GCC_compiler.compile_str
    assert pytensors.__qualname__ == "GCC_compiler.compile_str"   # PyTensor's own
    with pytest.raises(TypeError, match="enable must be a bool, got str"):
        use_precompiled_headers("yes")
    assert GCC_compiler.compile_str is pytensors   # nothing changed
    assert use_precompiled_headers() is HAVE_GXX
    assert (GCC_compiler.compile_str is compiling._compile_str) is HAVE_GXX
    assert use_precompiled_headers() is HAVE_GXX   # twice is the same as once
    assert use_precompiled_headers(False) is False
    assert GCC_compiler.compile_str is pytensors
    # (conftest's fixture puts the suite's choice back for the next test)


def _fake_compiler(path, banner):
    path.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then printf '%s\\n' "
                    + " ".join(f"'{line}'" for line in banner) + "; else echo 12.2.0; fi\n")
    path.chmod(0o755)
    return str(path)


def test_only_gxx(tmp_path, monkeypatch):
    """clang reads ``.gch`` files its own way; a missing compiler has no version."""
    gxx = _fake_compiler(tmp_path / "g++", ["g++ (Debian 12.2.0-14) 12.2.0",
                                            "Copyright (C) 2022 Free Software Foundation, Inc."])
    clang = _fake_compiler(tmp_path / "clang++", ["Debian clang version 14.0.6",
                                                  "Target: x86_64-pc-linux-gnu"])
    assert compiling._gxx_version_of(gxx) == "g++ (Debian 12.2.0-14) 12.2.0 12.2.0"
    assert compiling._gxx_version_of(clang) == ""
    assert compiling._gxx_version_of(str(tmp_path / "no-such-compiler")) == ""
    assert compiling._gxx_version_of("") == ""
    use_parallel_compile(1)
    use_precompiled_headers(False)
    pytensors = GCC_compiler.compile_str
    monkeypatch.setattr(compiling, "_gxx_version", lambda: "")
    assert use_precompiled_headers() is False
    assert GCC_compiler.compile_str is pytensors


# ---------------------------------------------------------------- end to end

_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np, pytensor, pytensor.tensor as pt
    sys.path.insert(0, {tools!r})
    import fastcompile as compiling
    from fastcompile import use_parallel_compile, use_precompiled_headers

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
""").replace("{tools!r}", repr(TOOLS))


def _run_script(script, compiledir, *argv):
    """Run ``script`` in a new process compiling into ``compiledir``; its last line's JSON."""
    env = dict(os.environ, PYTENSOR_FLAGS=f"compiledir={compiledir}")
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run(tmp_path, *argv):
    return _run_script(_SCRIPT, tmp_path / "compiledir", *argv)


@needs_gxx
def test_compiles_right_with_headers_built_once_and_reused(tmp_path):
    first = _run(tmp_path, "plain", "1.0")
    assert first["on"]
    # the flag set's first module compiles plain, the second builds the header
    assert first["counts"] == {"plain": 1, "header": 2, "fallback": 0, "parallel": 0}
    assert len(first["headers"]) == 1 and first["fresh"] == [True]
    assert max(first["errors"]) < 1e-14
    # a new process finds the header and uses it from its first module (a new
    # constant makes the first graph new; the two others come from the cache)
    second = _run(tmp_path, "plain", "2.0")
    assert second["counts"] == {"plain": 0, "header": 1, "fallback": 0, "parallel": 0}
    assert second["headers"] == first["headers"]
    assert max(second["errors"]) < 1e-14


@needs_gxx
def test_unreadable_header_falls_back_to_a_plain_compile(tmp_path):
    result = _run(tmp_path, "corrupt", "1.0")
    assert result["counts"] == {"plain": 1, "header": 1, "fallback": 1, "parallel": 0}
    assert result["headers"] == []   # that flag set no longer uses one
    assert max(result["errors"]) < 1e-14


# ---------------------------------------------------------------- parallel compiles

def test_parallel_compile_bad_input_and_turning_it_off():
    from pytensor.link.vm import VMLinker

    use_parallel_compile(1)
    use_precompiled_headers(False)
    pytensors, make_all = GCC_compiler.compile_str, VMLinker.make_all
    assert make_all.__qualname__ == "VMLinker.make_all"   # PyTensor's own
    for bad in ("2", 2.0, True, [2]):
        with pytest.raises(TypeError, match="jobs must be an int or None"):
            use_parallel_compile(bad)
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"jobs must be at least 1, got {bad}"):
            use_parallel_compile(bad)
    assert (GCC_compiler.compile_str, VMLinker.make_all) == (pytensors, make_all)   # unchanged
    assert use_parallel_compile(3) == 3
    assert GCC_compiler.compile_str is compiling._compile_str
    assert VMLinker.make_all is compiling._make_all
    assert use_parallel_compile(None) == len(os.sched_getaffinity(0))   # the CPUs it may use
    assert use_parallel_compile(1) == 1
    assert (GCC_compiler.compile_str, VMLinker.make_all) == (pytensors, make_all)
    use_parallel_compile(2)
    use_precompiled_headers()
    use_parallel_compile(1)   # the headers stay on
    assert (GCC_compiler.compile_str is compiling._compile_str) is HAVE_GXX
    assert VMLinker.make_all is make_all


_PARALLEL_SCRIPT = textwrap.dedent("""
    import glob, json, os, sys, threading
    import numpy as np, pytensor, pytensor.tensor as pt
    sys.path.insert(0, {tools!r})
    import fastcompile as compiling
    from fastcompile import use_parallel_compile, use_precompiled_headers

    jobs, pch, case = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
    def left():   # directories a job compiled into that hold no module of PyTensor's cache
        if compiling._executor is not None:
            compiling._executor.shutdown(wait=True)   # as at exit: running jobs finish
        return [d for d in glob.glob(os.path.join(pytensor.config.compiledir, "tmp*"))
                if not os.path.exists(os.path.join(d, "key.pkl"))]
    use_precompiled_headers(pch)
    use_parallel_compile(jobs)
    lock, running, seen = threading.Lock(), [0], {"jobs": 0, "most at once": 0}
    real_job = compiling._job
    def job(*args):   # counts jobs, and how many ran at once
        with lock:
            seen["jobs"] += 1
            first = seen["jobs"] == 1
            running[0] += 1
            seen["most at once"] = max(seen["most at once"], running[0])
        try:
            if case == "first-job-fails" and first:
                raise OSError("this job fails")
            return real_job(*args)
        finally:
            with lock:
                running[0] -= 1
    compiling._job = job
    real_submit = compiling._submit_missing
    if case == "unused-job":   # a job that PyTensor never asks for
        def submit(linker, pool, mine):
            args = ("unused", "int unused() { return 1; }", [], [], [], [], True)
            compiling._pending["unused"] = (compiling._job_key(*args),
                                            pool.submit(job, pytensor.config.compiledir, *args))
            mine.append("unused")
            real_submit(linker, pool, mine)
        compiling._submit_missing = submit
    if case == "mismatch":   # one job compiled other source than PyTensor then asks for
        def submit(linker, pool, mine):
            real_submit(linker, pool, mine)
            expected, job = compiling._pending[mine[0]]
            compiling._pending[mine[0]] = ((expected[0], expected[1] + "// other"), *expected[2:]), job
        compiling._submit_missing = submit
    if case == "scan":   # Scan compiles its inner function while PyTensor makes its thunk
        from pytensor.link.vm import VMLinker

        depth, seen["deepest"], real_make_all = [0], 0, VMLinker.make_all
        def make_all(self, *args, **kwargs):   # how deep the compiles nest
            depth[0] += 1
            seen["deepest"] = max(seen["deepest"], depth[0])
            try:
                return real_make_all(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        VMLinker.make_all = make_all
        x = pt.dvector("x")
        total = pytensor.scan(lambda a, acc: acc + pt.tanh(a) * pt.exp(-a ** 2), sequences=[x],
                              outputs_info=[pt.zeros((), dtype="float64")],
                              return_updates=False)
        f = pytensor.function([x], 2.0 * total[-1] + pt.log1p(x ** 2).sum(), mode="CVM")
        a = np.linspace(-2.0, 2.0, 9)
        error = abs(float(f(a)) - (2.0 * np.sum(np.tanh(a) * np.exp(-a ** 2))
                                   + np.log1p(a ** 2).sum()))
        print(json.dumps({"counts": compiling.counts, "errors": [error],
                          "pending": len(compiling._pending), "left": left(), **seen}))
        sys.exit()
    if case == "broken":   # an op whose C code g++ rejects
        from pytensor.graph.basic import Apply
        from pytensor.link.c.op import COp

        class Broken(COp):
            __props__ = ()
            def make_node(self, x):
                return Apply(self, [x], [x.type()])
            def perform(self, node, inputs, outputs):
                outputs[0][0] = inputs[0]
            def c_code(self, node, name, inputs, outputs, sub):
                return "this is not C++;"
            def c_code_cache_version(self):
                return (1,)

        x = pt.dvector("x")
        try:
            pytensor.function([x], Broken()(pt.exp(x)), mode="CVM")
            error = None
        except Exception as e:
            error = [type(e).__name__, "this is not C++" in str(e)]
        print(json.dumps({"error": error, "pending": len(compiling._pending),
                          "left": left(), "jobs": seen["jobs"]}))
        sys.exit()

    x, w = pt.dmatrix("x"), pt.dmatrix("w")
    h = pt.tanh(x @ w)
    rng = np.random.default_rng(0)
    X, W = rng.normal(size=(5, 3)), rng.normal(size=(3, 4))
    H = np.tanh(X @ W)
    if case in ("first-job-fails", "unused-job", "mismatch"):   # a few modules are enough
        outs, refs = [h, h.sum(axis=0)], [H, H.sum(0)]
    else:
        loss = -pt.log(pt.special.softmax(h, axis=1)[:, 0]).mean() + 0.01 * (w ** 2).sum()
        outs = [loss, pytensor.grad(loss, w), h.max(axis=0), h.argmax(axis=1), h.cumsum(axis=0)]
        # numpy: H = tanh(XW), S = softmax(H), loss = -mean_i log S_i0 + 0.01 |W|^2
        S = np.exp(H - H.max(1, keepdims=True))
        S /= S.sum(1, keepdims=True)
        dH = -(np.eye(4)[0] - S) / len(X)
        refs = [-np.log(S[:, 0]).mean() + 0.01 * (W ** 2).sum(),
                X.T @ (dH * (1 - H ** 2)) + 0.02 * W, H.max(0), H.argmax(1), H.cumsum(0)]
    f = pytensor.function([x, w], outs, mode="CVM")
    errors = [float(np.max(np.abs(np.asarray(o) - r))) for o, r in zip(f(X, W), refs)]
    print(json.dumps({"counts": compiling.counts, "errors": errors,
                      "pending": len(compiling._pending), "left": left(), **seen}))
""").replace("{tools!r}", repr(TOOLS))


def _run_parallel(tmp_path, compiledir, *argv):
    return _run_script(_PARALLEL_SCRIPT, tmp_path / compiledir, *argv)


def _modules(compiledir):
    """Module name -> (its mod.cpp, its disassembly) for each op module in a compiledir."""
    found = {}
    for lib in compiledir.glob("tmp*/m*.so"):
        found[lib.stem] = ((lib.parent / "mod.cpp").read_text(), _disassembly(str(lib)))
    return found


# ci: every test that compiles for real, and the demo, compile through the parallel jobs
# and check their numbers; this one compares the object code, four cold compiles
@pytest.mark.ci
@needs_gxx
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_parallel_compile_gives_the_modules_a_one_by_one_compile_gives(tmp_path):
    one = _run_parallel(tmp_path, "one", "1", "1", "plain")
    assert one["counts"]["parallel"] == 0
    two = _run_parallel(tmp_path, "two", "2", "1", "plain")
    compiled = two["counts"]["plain"] + two["counts"]["header"]
    assert compiled == one["counts"]["plain"] + one["counts"]["header"] >= 8
    assert two["counts"]["parallel"] == compiled   # each came from a job, none twice
    assert two["jobs"] == compiled and one["jobs"] == 0
    assert two["most at once"] == 2   # in parallel, and no more than asked
    assert two["counts"]["fallback"] == 0
    assert max(one["errors"] + two["errors"]) < 1e-12
    assert two["pending"] == 0 and two["left"] == []
    by_one, by_two = _modules(tmp_path / "one"), _modules(tmp_path / "two")
    assert len(by_two) == compiled and set(by_two) == set(by_one)   # the same sources
    for name, (src, code) in by_two.items():
        assert src == by_one[name][0]
        assert code.count("\n") > 50 and code == by_one[name][1], name
    warm = _run_parallel(tmp_path, "two", "2", "1", "plain")   # nothing left to compile
    assert warm["counts"] == dict.fromkeys(warm["counts"], 0)
    assert max(warm["errors"]) < 1e-12
    plain = _run_parallel(tmp_path, "three", "2", "0", "plain")   # without headers
    assert plain["counts"]["parallel"] == compiled and max(plain["errors"]) < 1e-12


@needs_gxx
def test_a_failed_or_unused_job_costs_time_not_results(tmp_path):
    failed = _run_parallel(tmp_path, "failed", "2", "1", "first-job-fails")
    compiled = failed["counts"]["plain"] + failed["counts"]["header"]
    assert failed["counts"]["parallel"] == compiled - 1   # PyTensor compiled that one itself
    assert max(failed["errors"]) < 1e-12 and failed["left"] == []
    unused = _run_parallel(tmp_path, "unused", "2", "1", "unused-job")
    assert unused["counts"]["parallel"] == unused["counts"]["plain"] + unused["counts"]["header"]
    assert max(unused["errors"]) < 1e-12
    assert unused["pending"] == 0 and unused["left"] == []   # dropped and deleted
    # a job whose source is not what PyTensor compiles: compiled again, in an emptied directory
    other = _run_parallel(tmp_path, "other", "2", "1", "mismatch")
    compiled = other["counts"]["plain"] + other["counts"]["header"]
    assert other["counts"]["parallel"] == compiled - 2 == other["jobs"] - 1
    assert max(other["errors"]) < 1e-12 and other["left"] == []
    assert all(len(list(d.glob("m*.so"))) == 1 for d in (tmp_path / "other").glob("tmp*"))


@needs_gxx
def test_nested_compiles_share_the_jobs(tmp_path):
    alone = _run_parallel(tmp_path, "alone", "1", "1", "scan")
    together = _run_parallel(tmp_path, "together", "2", "1", "scan")
    assert together["deepest"] == alone["deepest"] == 2   # the inner function's compile
    compiled = together["counts"]["plain"] + together["counts"]["header"]
    assert compiled == alone["counts"]["plain"] + alone["counts"]["header"] >= 4
    assert together["counts"]["parallel"] == together["jobs"] == compiled
    assert together["most at once"] == 2
    assert max(alone["errors"] + together["errors"]) < 1e-12
    assert together["pending"] == 0 and together["left"] == []


@needs_gxx
def test_a_compile_error_is_pytensors_own(tmp_path):
    alone = _run_parallel(tmp_path, "alone", "1", "1", "broken")
    assert alone["error"] == ["CompileError", True] and alone["jobs"] == 0
    together = _run_parallel(tmp_path, "together", "2", "1", "broken")
    assert together["jobs"] >= 1   # a job tried it first
    assert together == alone | {"pending": 0, "left": [], "jobs": together["jobs"]}
