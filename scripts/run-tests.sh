#!/usr/bin/env bash
# Set up .venv (with every optional backend: JAX, PyTorch, Dask, so that no test is
# skipped), then run the whole test suite (unit, property, backend and doctests).
# Extra arguments go to pytest (for example -x, -k adam, or -m "not slow" for the
# quick subset). Most tests run with PyTensor's Python implementations (nothing
# to compile); tests/test_backends.py compiles under C, Numba, JAX and PyTorch
# (the root conftest.py says how; LASAGNE_ACCUM_TEST_MODE=real compiles everything).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-examples,test,distributed,backends}" bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "${VENV:-.venv}/bin/python" -m pytest "$@"
