"""Importing lasagne_accum changes nothing in PyTensor; our fast paths are opt-in by name.

Each check runs graphs that are not ours in two fresh processes, one that
never imports lasagne_accum and one that imports every module of it (and
builds ``lasagne_accum.mode()`` for every backend, which registers our
rewrites under our tags), and compares what PyTensor compiled: the op types
of each function and the generated C code of the CVM ones. Fresh processes,
because this suite's conftest swaps PyTensor's modes for cheap ones.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    import numpy as np, pytensor, pytensor.tensor as pt
    from pytensor.compile.mode import get_mode, optdb
    try:   # PyTensor 3.3 and later
        from pytensor.conditional.op import ifelse
    except ImportError:
        from pytensor.ifelse import ifelse
    from pytensor.graph.basic import Constant
    from pytensor.graph.fg import FunctionGraph
    from pytensor.link.c.basic import CLinker
    from pytensor.scalar.basic import ScalarType

    def c_sources(fgraph):
        # each node's C module source, as PyTensor's C backend generates it (None: no C)
        sources = []
        for node in fgraph.toposort():
            ins = [i if isinstance(i, Constant) else i.type() for i in node.inputs]
            new = node.clone_with_new_inputs(ins)
            fg = FunctionGraph([i for i in ins if not isinstance(i, Constant)], new.outputs,
                               clone=False)
            try:
                sources.append(CLinker().accept(fg).get_src_code())
            except NotImplementedError:
                sources.append(None)
        return sources

    before = {"c_literal": ScalarType.c_literal, "cache": ScalarType.c_code_cache_version,
              "meta_path": list(sys.meta_path)}
    if sys.argv[1] == "ours":
        import lasagne_accum
        for info in pkgutil.walk_packages(lasagne_accum.__path__, "lasagne_accum."):
            try:
                importlib.import_module(info.name)
            except ImportError as exc:   # an optional dependency (dask) missing
                print("skipped", info.name, exc, file=sys.stderr)
        for base in ("CVM", "NUMBA", "JAX", "PYTORCH", "FAST_COMPILE"):
            if base not in ("JAX", "PYTORCH") or importlib.util.find_spec(base.lower()
                                                                          .replace("pytorch", "torch")):
                lasagne_accum.mode(base)
        # one of our functions first: what it compiles must not leak into the others
        w = pytensor.shared(np.zeros(3, "float32"), name="w")
        g = pt.vector("g", dtype="float32")
        upd = lasagne_accum.adam([g], [w], learning_rate=np.float32(0.1), average=2)
        for base in ("CVM", "NUMBA"):
            pytensor.function([g], [], updates=upd, mode=lasagne_accum.mode(base))(
                np.ones(3, "float32"))

    def graphs():
        c = pytensor.shared(np.int64(0), name="c")
        s = pytensor.shared(np.zeros(3), name="s")
        x = pt.vector("x")
        n = c + 1   # a counter and an ifelse that resets a shared vector
        yield "ifelse", [x], [], [(c, n), (s, ifelse(pt.eq(n % 3, 0), pt.zeros_like(s), s + x))]
        t = pt.vector("t", dtype="float32")   # float32 constants in fused C loops
        yield "float32", [t], [1 - np.float32(0.999) ** t, t * np.float32(0.1) + 0.3], []
        acc = pytensor.shared(np.zeros((4, 3)), name="acc")
        a, b = pt.matrix("a"), pt.matrix("b")   # dot plus add
        yield "dot", [a, b], [], [(acc, acc + a @ b)]
        m = pytensor.shared(np.zeros(3, "float32"), name="m")
        v = pt.vector("v", dtype="float32")   # a window-like select of new values
        k = pt.scalar("k", dtype="bool")
        yield "select", [v, k], [], [(m, ifelse(k, m, np.float32(0.9) * m + v))]

    out = {}
    for mode in ("CVM", "NUMBA", "FAST_COMPILE", "JAX"):
        for name, ins, outs, updates in graphs():
            f = pytensor.function(ins, outs, updates=updates, mode=mode)
            key = f"{name}/{mode}"
            out[key] = {"ops": sorted(str(n.op) for n in f.maker.fgraph.toposort())}
            if mode == "CVM":
                out[key]["c"] = c_sources(f.maker.fgraph)
    ours = {name for name in optdb._names if name.startswith("lasagne_accum")}
    # which of the predefined modes' queries pick up any of our rewrites
    picked = {}
    for mode in ("FAST_RUN", "FAST_COMPILE", "CVM", "C", "NUMBA", "JAX", "PYTORCH"):
        m = get_mode(mode)
        query = m.provided_optimizer
        if isinstance(query, str):
            from pytensor.compile.mode import predefined_optimizers
            query = predefined_optimizers[query]
        linker = m.linker
        query = query.including(*getattr(linker, "required_rewrites", ())).excluding(
            *getattr(linker, "incompatible_rewrites", ()))
        objs = {id(r) for tag in query.include for r in optdb.__db__.get(tag, ())}
        picked[mode] = sorted(n for n in ours if any(id(r) in objs for r in optdb.__db__[n]))
    after = {"c_literal": ScalarType.c_literal, "cache": ScalarType.c_code_cache_version,
             "meta_path": list(sys.meta_path)}
    print(json.dumps({"graphs": out, "ours": sorted(ours), "picked": picked,
                      "unchanged": {k: before[k] == after[k] for k in before}}))
""")


def _probe(which, script=_PROBE):
    """Run `script` with the argument `which` in a fresh process; its last line as JSON."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script, which], capture_output=True,
                          text=True, env=env, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probes():
    pytest.importorskip("jax")
    return _probe("plain"), _probe("ours")


def test_pytensor_objects_are_unchanged_by_the_import(probes):
    _, ours = probes
    assert ours["unchanged"] == {"c_literal": True, "cache": True, "meta_path": True}


def test_our_rewrites_are_registered_under_our_tags_only(probes):
    plain, ours = probes
    assert plain["ours"] == []
    assert "lasagne_accum_lazy_step" in ours["ours"] and "lasagne_accum_gemm_reset" in ours["ours"]
    assert ours["picked"] == {mode: [] for mode in ours["picked"]}


def test_graphs_that_are_not_ours_compile_the_same(probes):
    plain, ours = probes
    assert set(plain["graphs"]) == set(ours["graphs"])
    for key in plain["graphs"]:
        assert ours["graphs"][key]["ops"] == plain["graphs"][key]["ops"], key
        if "c" in plain["graphs"][key]:
            assert ours["graphs"][key]["c"] == plain["graphs"][key]["c"], key
    # the probe saw what it is about: an IfElse, a Gemm, a fused float32 loop
    assert any("if{" in op for op in plain["graphs"]["ifelse/CVM"]["ops"])
    assert any("Gemm" in op for op in plain["graphs"]["dot/CVM"]["ops"])
    assert any("0.999" in src for src in plain["graphs"]["float32/CVM"]["c"] if src)


_VERSION_PROBE = textwrap.dedent("""
    import json, sys, warnings
    import numpy as np, pytensor, pytensor.tensor as pt
    if sys.argv[1] != "real":
        pytensor.__version__ = sys.argv[1]
    import lasagne_accum as la
    from pytensor.compile.mode import get_mode
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        modes = [la.mode("CVM"), la.mode("CVM"), la.mode("NUMBA")]
    rng = np.random.default_rng(0)
    W = pytensor.shared(rng.normal(size=(5, 3)), name="W")
    x, y = pt.matrix("x"), pt.matrix("y")
    loss = ((x @ W - y) ** 2).mean()
    f = pytensor.function([x, y], loss, updates=la.adam(loss, [W], 0.01, average=3),
                          mode=modes[0])
    for _ in range(7):
        f(rng.normal(size=(4, 5)), rng.normal(size=(4, 3)))
    print(json.dumps({
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "plain": modes[0] is get_mode("CVM") and modes[2] is get_mode("NUMBA"),
        "ops": sorted({type(n.op).__name__ for n in f.maker.fgraph.toposort()}),
        "W": W.get_value().tolist()}))
""")


def test_an_unsupported_pytensor_gets_the_plain_modes_with_one_warning():
    """A PyTensor outside the tested range (faked here): ``mode()`` warns once and
    returns PyTensor's own modes; the single-function form is PyTensor's IfElse and
    gives the same numbers, bit for bit."""
    future, real = _probe("3.4.0", _VERSION_PROBE), _probe("real", _VERSION_PROBE)
    assert len(future["warnings"]) == 1 and "found 3.4.0" in future["warnings"][0]
    assert future["plain"] and {"IfElse", "LazyIfElse"} & set(future["ops"])
    assert "LazyStep" not in future["ops"]
    assert real["warnings"] == [] and not real["plain"] and "LazyStep" in real["ops"]
    assert future["W"] == real["W"]
