#!/usr/bin/env bash
# Set up .venv (with every optional backend: JAX, PyTorch, Dask, so that no test is
# skipped), then run the whole test suite (unit, property, backend and doctests).
# Extra arguments go to pytest (for example -x, -k adam, or -m "not slow" for the
# quick subset; two marked groups run only when -m names them: -m ci, the CI-only
# group, and -m bench, the benchmark scripts' quick runs). The tests run in parallel, one process per core. Most tests run with PyTensor's Python implementations (nothing
# to compile); tests/test_backends.py compiles under C, Numba, JAX and PyTorch
# (the root conftest.py says how; LASAGNE_ACCUM_TEST_MODE=real compiles everything).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-examples,test,distributed,backends}" bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# the BLAS set-up.sh chose for PyTensor's C backend, where it wrote one (your own
# ~/.pytensorrc, on the right, wins)
rc="${VENV:-.venv}/pytensorrc"; case "$rc" in /*) ;; *) rc="$ROOT/$rc" ;; esac
if [ -f "$rc" ]; then export PYTENSORRC="$rc:${PYTENSORRC:-$HOME/.pytensorrc}"; fi
# the tests are independent: spread them over the cores (pytest-xdist, in the test extra;
# LASAGNE_ACCUM_TEST_WORKERS=0, or -n 0 among the arguments, runs them in this process);
# a module's tests stay in one worker, which sets up its module-scoped fixtures (a Dask
# cluster, a subprocess probe, an example's run, compiled references) once
py="${VENV:-.venv}/bin/python"
# the suite starts many Python processes (xdist's workers, Dask's, the examples', the
# import probes'): let the first import of a module write its .pyc (into the venv and
# the checkout's __pycache__ folders, which git ignores), or under PYTHONDONTWRITEBYTECODE
# every one of them compiles the sources of Dask, torch and the rest again
unset PYTHONDONTWRITEBYTECODE
if "$py" -c "import xdist" >/dev/null 2>&1; then
  set -- -n "${LASAGNE_ACCUM_TEST_WORKERS:-auto}" --dist loadfile "$@"
fi
exec "$py" -m pytest "$@"
