"""The compilation mode of the test suite and the doctests (pytest loads this first).

Most of the suite checks numbers (a rule against its numpy re-derivation, one
accumulation form against another). Those checks do not depend on the backend
that runs the graph, but compiling dominates their cost: PyTensor's C backend
runs the C++ compiler for every new graph and Numba JIT-compiles every new
graph, seconds each on a cold cache. So every test runs in ``CHEAP_MODE``
(PyTensor's Python ``perform`` implementations behind the same ``fast_run``
graph rewrites as the C backend: nothing is compiled) unless

* it lives in ``tests/test_fast_paths.py`` (the in-place Gemm and LazyStep
  rewrites of the C and Numba backends) or ``tests/test_backends.py``, the
  cross-backend module that compiles for real under C, Numba, JAX and
  PyTorch and compares them, or
* it is a page of the user guide (``docs/*.rst``): a reader pastes those
  snippets into a session that compiles for real, so they run as there,
  under the backend each snippet names (``la.mode()`` is C, no ``mode=`` is
  PyTensor's default, JAX and PyTorch where a page is about them; such a page
  is skipped, with the reason, where they are not installed), or
* it is marked ``@pytest.mark.real_backend`` (for a test about one backend's
  generated code, say a C-only graph rewrite), or
* the environment sets ``LASAGNE_ACCUM_TEST_MODE=real`` (the whole suite on
  the backends the tests name: slow on a cold cache, the check before a
  release).

The swap is done by pointing the mode names ``"CVM"``, ``"C"``, ``"NUMBA"``,
``"FAST_COMPILE"`` and the default mode (``mode=None``) at ``CHEAP_MODE`` for
the duration of each test; a test that passes a ``Mode`` object, ``"JAX"`` or
``"PYTORCH"`` keeps it.
"""

import contextlib
import fnmatch
import os
import re
import sys

import pytensor
import pytest
from pytensor.compile import mode as _pt_mode

#: Python linker (``perform`` of each Op, nothing compiled) behind the C
#: backend's rewrites (``fast_run``: the same in-place graph), without
#: elementwise fusion: a fused ``Composite`` runs its scalar graph per element
#: in Python, while unfused elementwise ops are single numpy calls.
CHEAP_MODE = _pt_mode.Mode(linker="py", optimizer="fast_run").excluding("fusion")
_SWAPPED = ("CVM", "C", "NUMBA", "FAST_COMPILE")
_REAL_MODULES = ("test_backends.py", "test_fast_paths.py")
#: The user guide's directory: its pages' doctests compile for real.
_DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs")
#: Tests compiled for real, as ``fnmatch`` patterns of the test's name with its
#: parameters. The first calls one small function a million times: Python
#: ``perform`` costs more per call than compiling once.
_REAL_TESTS = ("test_precision_million_float32_updates",
               # the float32 cases of the property test: hypothesis found a cancellation
               # case (adagrad, a bias near 0) where the unfused Python implementations
               # round differently from the compiled graph by 1e-3 relative; it passes
               # compiled, as before (the float64 cases agree to 1e-10 either way)
               "test_accumulated_window_equals_large_batch_step[[]*-float32[]]")
#: Tests left out of the quick development subset (``pytest -m "not slow"``)
#: besides those marked ``@pytest.mark.slow`` in their module.
_SLOW_TESTS = ("test_precision_million_float32_updates",)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "real_backend: compile this test's functions with the backends it names "
        "(by default the suite runs them with Python implementations, see conftest.py at the repository root)")


#: Marked groups that run only when the ``-m`` expression names them (``-m bench``,
#: ``-m "ci or not bench"``): the benchmark scripts' runs and the CI-only group (setup.cfg).
_OPT_IN = ("bench", "ci")


def pytest_collection_modifyitems(config, items):
    expression = config.getoption("markexpr") or ""
    left_out = [m for m in _OPT_IN if not re.search(rf"\b{m}\b", expression)]
    dropped = [item for item in items if any(item.get_closest_marker(m) for m in left_out)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(map(id, dropped))
        items[:] = [item for item in items if id(item) not in gone]
    for item in items:
        if getattr(item, "originalname", item.name) in _SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


def _wants_real_backend(request):
    if os.environ.get("LASAGNE_ACCUM_TEST_MODE", "").lower() == "real":
        return True
    node = request.node
    if node.get_closest_marker("real_backend") is not None:
        return True
    if any(fnmatch.fnmatchcase(node.name, pattern) for pattern in _REAL_TESTS):
        return True
    if _is_guide_page(node):
        return True
    return os.path.basename(str(getattr(node, "fspath", ""))) in _REAL_MODULES


def _is_guide_page(node):
    path = str(getattr(node, "fspath", ""))
    return path.endswith(".rst") and os.path.dirname(os.path.abspath(path)) == _DOCS


#: Every test that compiles for real does so through ``tools/fastcompile.py``
#: (precompiled headers, several C modules at a time: the same object code, compiled
#: faster); a module-scoped fixture that compiles for real asks for it with
#: ``pytestmark = pytest.mark.usefixtures("fast_compiles")`` in its module.
#: ``LASAGNE_ACCUM_TEST_PCH=0`` and ``LASAGNE_ACCUM_TEST_JOBS=1`` compile as plain
#: PyTensor does there too.
_PCH = os.environ.get("LASAGNE_ACCUM_TEST_PCH", "1") != "0"
_JOBS = int(os.environ["LASAGNE_ACCUM_TEST_JOBS"]) if os.environ.get(
    "LASAGNE_ACCUM_TEST_JOBS") else None
_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools")
#: Guide pages about another library, whose every snippet needs it: skipped with the
#: reason where it is not installed, so that the page imports it as a reader does.
_PAGE_NEEDS = {"pymc.rst": ("pymc", "PyMC needs Python 3.12+ (the pymc extra)")}


@pytest.fixture(scope="module")
def fast_compiles():
    """Compile this module's C modules with ``tools/fastcompile.py``; off again after it."""
    if _TOOLS not in sys.path:
        sys.path.insert(0, _TOOLS)
    import fastcompile

    fastcompile.use_precompiled_headers(_PCH)
    fastcompile.use_parallel_compile(_JOBS)
    yield
    fastcompile.use_precompiled_headers(False)
    fastcompile.use_parallel_compile(1)


@contextlib.contextmanager
def _cheap_modes():
    with pytest.MonkeyPatch.context() as patch:
        for name in _SWAPPED:
            patch.setitem(_pt_mode.predefined_modes, name, CHEAP_MODE)
        with pytensor.config.change_flags(mode=CHEAP_MODE):   # mode=None
            yield


@pytest.fixture(autouse=True)
def _cheap_compile_mode(request):
    """Run the test's functions in ``CHEAP_MODE`` (see the module docstring)."""
    if _wants_real_backend(request):
        if _is_guide_page(request.node):
            needs = _PAGE_NEEDS.get(os.path.basename(str(request.node.fspath)))
            if needs is not None:
                pytest.importorskip(needs[0], reason=needs[1])
        request.getfixturevalue("fast_compiles")
        yield
        return
    with _cheap_modes():
        yield


@pytest.fixture(scope="module")
def cheap_modes():
    """``CHEAP_MODE`` for what a module-scoped fixture compiles: such a fixture is set up
    before the per-test swap above, so it asks for this one to get it."""
    with _cheap_modes():
        yield
